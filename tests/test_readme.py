"""The README's code runs as written, and its gradient is Diffrax's."""

import pathlib
import re

import diffrax
import jax
import jax.numpy as jnp
import pytest

from .helpers import max_relative_error


README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_and_matches_diffrax():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no python example"
    namespace = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    grads, params, y0s = namespace["grads"], namespace["params"], namespace["y0s"]

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


@pytest.mark.slow
def test_readme_stiff_example_matches_diffrax_running_rodas5():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    stiff = [b for b in blocks if "gs.Rodas5()" in b]
    assert stiff, "the README has no Rodas5 example"
    namespace = {}
    exec(compile(stiff[0], str(README), "exec"), namespace)
    ns = namespace

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
