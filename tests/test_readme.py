"""Every python block of the README runs on its own, as pasted into a fresh
interpreter, and computes what it says: Diffrax's gradients, closed forms, the
parameters that made the fit's data.

Each block runs in a child process (nothing of this process's JAX configuration or
names leaks in), with a few lines appended that save the values to check.
"""

import pathlib
import re

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import max_relative_error, run_fresh
from .references import StoredReferences


ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
REFERENCES = StoredReferences(__file__)


def _blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no python example"
    return blocks


def _block(marker: str) -> str:
    """The one README block that contains `marker`."""
    found = [b for b in _blocks() if marker in b]
    assert len(found) == 1, f"{len(found)} README blocks contain {marker!r}"
    return found[0]


def _run_fresh(
    block: str, outputs: dict[str, str], folder: pathlib.Path, env=None
) -> dict:
    """Run `block` alone in a new Python process (in `folder`, with the environment
    variables `env` added) and return the values of the expressions `outputs`
    (name -> expression) as NumPy arrays."""
    save = ", ".join(f"{name}=_np.asarray({expr})" for name, expr in outputs.items())
    script = block + f"\nimport numpy as _np\n_np.savez('outputs.npz', {save})\n"
    done = run_fresh(script, folder, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    with np.load(folder / "outputs.npz") as saved:
        return {name: saved[name] for name in saved.files}


def _lorenz(t, y, args):
    sigma, rho, beta = args
    return jnp.stack(
        [sigma * (y[1] - y[0]), y[0] * (rho - y[2]) - y[1], y[0] * y[1] - beta * y[2]]
    )


def test_first_example_matches_diffrax(tmp_path):
    out = _run_fresh(
        _blocks()[0], dict(grads="grads", params="params", y0s="y0s"), tmp_path
    )
    ctrl = diffrax.PIDController(rtol=1e-8, atol=1e-8)

    def diffrax_loss(params):
        ys = jax.vmap(
            lambda y0, p: diffrax.diffeqsolve(
                diffrax.ODETerm(_lorenz), diffrax.Tsit5(), 0.0, 1.0, None, y0, p,
                stepsize_controller=ctrl,
            ).ys
        )(out["y0s"], params)  # fmt: skip
        return jnp.sum(ys**2)

    # Diffrax's gradient is stored with the inputs it was computed at: a changed
    # example must be stored again.
    inputs = (out["y0s"], out["params"])
    stored_inputs, expected = REFERENCES(
        "first-example-gradient",
        lambda: (inputs, jax.jit(jax.grad(diffrax_loss))(jnp.asarray(inputs[1]))),
    )
    for x, stored in zip(inputs, stored_inputs):
        np.testing.assert_array_equal(
            x, stored, err_msg="The README's first example changed: "
            "GRADSOLVE_REFERENCES=update python -m pytest tests/test_readme.py -n 0",
        )  # fmt: skip
    assert max_relative_error(out["grads"], expected) <= 1e-9


def _decay(y0s, rates):
    """y' = -k y from y0 at t = 1, and d/dk of sum(y(1)**2): closed forms."""
    ys = y0s * np.exp(-rates)[:, None]
    return ys, -2.0 * np.sum(ys**2, axis=1)


def test_mesh_saving_example(tmp_path):
    outputs = dict(ys="sol.ys[:, -1]", y0s="y0s", rates="rates", loaded_ts="meshes.ts")
    out = _run_fresh(_block("gs.save_mesh("), outputs, tmp_path)
    assert (tmp_path / "decay.gsmesh").exists()
    assert out["loaded_ts"].shape[0] == 256
    ys, _ = _decay(out["y0s"], out["rates"])
    np.testing.assert_allclose(out["ys"], ys, rtol=1e-5)


def test_kernel_example(tmp_path):
    outputs = dict(ys="sols.ys[:, -1]", y0s="y0s", rates="rates")
    out = _run_fresh(_block('kernel="auto"'), outputs, tmp_path)
    ys, _ = _decay(out["y0s"], out["rates"])
    np.testing.assert_allclose(out["ys"], ys, rtol=1e-5)


def test_sharding_example(tmp_path):
    # On two simulated CPU devices, so that the ensemble is split for real (the long
    # tests in test_sharding.py go up to eight).
    outputs = dict(
        grads="grads",
        y0s="y0s",
        rates="rates",
        devices="len(grads.sharding.device_set)",
    )
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    out = _run_fresh(_block("gs.ensemble_sharding()"), outputs, tmp_path, env)
    assert out["devices"] == 2
    _, grads = _decay(out["y0s"], out["rates"])
    np.testing.assert_allclose(out["grads"], grads, rtol=1e-5)


@pytest.mark.slow  # two Optimistix fits in a fresh interpreter: ~17 s
def test_fit_example_recovers_the_parameters(tmp_path):
    """The fit's data are noise-free, so it must return the parameters that made
    them."""
    outputs = dict(
        params="fit.params",
        true="true_params",
        success="fit.result == optx.RESULTS.successful",
    )
    out = _run_fresh(_block("gs.fit("), outputs, tmp_path)
    assert out["success"]
    assert max_relative_error(out["params"], out["true"]) <= 1e-6


@pytest.mark.slow
def test_stiff_example_matches_diffrax_running_rodas5(tmp_path):
    block = _block("gs.Rodas5()")
    out = _run_fresh(block, dict(grads="grads", rates="rates", y0s="y0s"), tmp_path)
    namespace = {}
    exec(compile(block.split("meshes = ")[0], str(README), "exec"), namespace)
    ns = namespace

    def diffrax_loss(rates):
        ys = jax.vmap(
            lambda y0, k: diffrax.diffeqsolve(
                ns["term"], ns["solver"], 0.0, 1e3, None, y0, k, saveat=ns["saveat"],
                stepsize_controller=ns["ctrl"],
            ).ys
        )(out["y0s"], rates)  # fmt: skip
        return jnp.sum(jnp.log(ys[..., 0]))

    expected = jax.jit(jax.grad(diffrax_loss))(jnp.asarray(out["rates"]))
    assert max_relative_error(out["grads"], expected) <= 1e-9
