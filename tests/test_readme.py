"""The README's code runs as written, and its gradient is Diffrax's."""

import pathlib
import re

import diffrax
import jax
import jax.numpy as jnp

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
