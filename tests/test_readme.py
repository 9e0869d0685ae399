"""The README's code runs as written, and its gradient is Diffrax's."""

import pathlib
import re

import diffrax
import jax
import jax.numpy as jnp
import optimistix as optx
import pytest

from .helpers import max_relative_error


README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no python example"
    return blocks


def _block(marker: str) -> str:
    """The one README block that contains `marker`."""
    found = [b for b in _blocks() if marker in b]
    assert len(found) == 1, f"{len(found)} README blocks contain {marker!r}"
    return found[0]


def _run(block: str, namespace: dict) -> dict:
    exec(compile(block, str(README), "exec"), namespace)
    return namespace


def test_readme_example_runs_and_matches_diffrax(tmp_path, monkeypatch):
    """The first example, then the blocks that continue it (saving meshes, the
    kernel, sharding), in one namespace as a reader would run them."""
    namespace = _run(_blocks()[0], {})
    grads, params, y0s = namespace["grads"], namespace["params"], namespace["y0s"]
    meshes = namespace["meshes"]

    def diffrax_loss(params):
        ys = jax.vmap(
            lambda y0, p: (
                diffrax.diffeqsolve(
                    diffrax.ODETerm(namespace["lorenz"]),
                    diffrax.Tsit5(),
                    0.0,
                    1.0,
                    None,
                    y0,
                    p,
                    stepsize_controller=namespace["ctrl"],
                ).ys
            )
        )(y0s, params)
        return jnp.sum(ys**2)

    assert max_relative_error(grads, jax.grad(diffrax_loss)(params)) <= 1e-9

    monkeypatch.chdir(tmp_path)  # the mesh file is written to the working folder
    _run(_block("gs.save_mesh("), namespace)
    assert (tmp_path / "lorenz.gsmesh").exists()
    assert jnp.array_equal(namespace["meshes"].ts, meshes.ts)

    _run(_block('kernel="auto"'), namespace)
    final = jax.vmap(
        lambda y0, p: diffrax.diffeqsolve(
            diffrax.ODETerm(namespace["lorenz"]), diffrax.Tsit5(), 0.0, 1.0, None,
            y0, p, stepsize_controller=namespace["ctrl"],
        ).ys
    )(y0s, params)  # fmt: skip
    assert max_relative_error(namespace["sols"].ys, final) <= 1e-9
    assert max_relative_error(namespace["sol"].ys, final) <= 1e-9

    _run(_block("gs.ensemble_sharding()"), namespace)
    assert max_relative_error(namespace["grads"], grads) <= 1e-12


def test_readme_fit_example_recovers_the_parameters():
    """The fit block runs on its own; its data are noise-free, so the fit must
    return the parameters that made them."""
    namespace = _run(_block("gs.fit("), {})
    fit = namespace["fit"]
    assert fit.result == optx.RESULTS.successful
    assert max_relative_error(fit.params, namespace["true_params"]) <= 1e-6


@pytest.mark.slow
def test_readme_stiff_example_matches_diffrax_running_rodas5():
    ns = _run(_block("gs.Rodas5()"), {})

    def diffrax_loss(rates):
        ys = jax.vmap(
            lambda y0, k: (
                diffrax.diffeqsolve(
                    ns["term"],
                    ns["solver"],
                    0.0,
                    1e3,
                    None,
                    y0,
                    k,
                    saveat=ns["saveat"],
                    stepsize_controller=ns["ctrl"],
                ).ys
            )
        )(ns["y0s"], rates)
        return jnp.sum(jnp.log(ys[..., 0]))

    expected = jax.jit(jax.grad(diffrax_loss))(ns["rates"])
    assert max_relative_error(ns["grads"], expected) <= 1e-9
