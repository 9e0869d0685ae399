"""A solve differentiated inside `jax.jit` is traced inline, its recording once."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs
import gradsolve._one_call as one_call
from gradsolve._tracing import differentiated_inside_jit


def lotka_volterra(t, y, p):
    a, b, c, d = p
    prey, predator = y
    return jnp.stack(
        [a * prey - b * prey * predator, c * prey * predator - d * predator]
    )


# How each case calls `f(x) -> scalar` on `x` of shape (3,).
CALLS = {
    "eager": lambda f, x: f(x),
    "jit": lambda f, x: jax.jit(f)(x),
    "grad": lambda f, x: jax.grad(f)(x),
    "vmap": lambda f, x: jax.vmap(f)(x[:, None]),
    "grad-of-jit": lambda f, x: jax.grad(jax.jit(f))(x),
    "jit-of-grad": lambda f, x: jax.jit(jax.grad(f))(x),
    "jit-of-vmap-of-grad": lambda f, x: jax.jit(jax.vmap(jax.grad(f)))(x[:, None]),
    "jit-of-jvp": lambda f, x: jax.jit(lambda y: jax.jvp(f, (y,), (y,))[1])(x),
}
STAGED_DERIVATIVE = {"jit-of-grad", "jit-of-vmap-of-grad", "jit-of-jvp"}


@pytest.mark.parametrize("case", CALLS)
def test_differentiated_inside_jit(case):
    seen = []

    def f(x):
        seen.append(differentiated_inside_jit())
        return jnp.sum(jnp.sin(x))

    CALLS[case](f, jnp.arange(3.0))
    assert seen == [case in STAGED_DERIVATIVE] * len(seen) and seen


def test_one_call_gradient_traces_the_recording_once(monkeypatch):
    traced = []
    record = one_call.record_steps

    def counting(*args):
        traced.append(args[-2])  # whether the states are kept (the forward rule)
        return record(*args)

    monkeypatch.setattr(one_call, "record_steps", counting)
    term = gs.ODETerm(lotka_volterra)
    y0 = jnp.array([1.0, 0.5])
    ctrl = gs.PIDController(rtol=1e-8, atol=1e-8)

    def loss(args, module, solver):
        sol = module.diffeqsolve(
            module.ODETerm(lotka_volterra), solver, 0.0, 3.0, 0.1, y0, args,
            stepsize_controller=module.PIDController(rtol=1e-8, atol=1e-8),
        )  # fmt: skip
        return jnp.sum(sol.ys**2)

    args = jnp.array([1.1, 0.4, 0.1, 0.4])
    grad = jax.jit(jax.grad(loss), static_argnums=(1, 2))(args, gs, gs.Tsit5())
    # Only the forward rule (which keeps the states the adjoint needs) was traced.
    assert traced == [True]
    expected = jax.jit(jax.grad(loss), static_argnums=(1, 2))(
        args, diffrax, diffrax.Tsit5()
    )
    np.testing.assert_allclose(grad, expected, rtol=1e-9)
    # Outside a differentiated `jit` the solve stays one compiled program.
    traced.clear()
    gs.diffeqsolve(term, gs.Tsit5(), 0.0, 3.0, 0.1, y0, args, stepsize_controller=ctrl)
    assert traced == [False]


class _ScaledDecay(eqx.Module):
    rate: float

    def __call__(self, t, y, args):
        shift, sign = args
        return jnp.stack([-self.rate * y[0] + shift, sign * 0.1 * y[1]])


def test_python_scalars_in_args_differentiated_inline():
    """Python numbers in `args`, differentiated (`allow_int`) inside a `jit`: the
    forward rule sees them as number-like literals, not arrays, and must still call
    the closure-converted field with arrays."""

    def loss(inputs, module):
        y0, args, field = inputs
        sol = module.diffeqsolve(
            module.ODETerm(field), module.Tsit5(), 0.3, 4.5, None, y0, args,
            stepsize_controller=module.PIDController(rtol=1e-8, atol=1e-8),
        )  # fmt: skip
        return jnp.sum(sol.ys)

    inputs = (jnp.array([0.9, 2.4]), (0.1, -1), _ScaledDecay(rate=0.7))
    grad = eqx.filter_jit(jax.grad(loss, allow_int=True))
    ours, theirs = grad(inputs, gs), grad(inputs, diffrax)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        if jnp.issubdtype(jnp.result_type(a), jnp.inexact):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def test_a_first_solve_compiles_one_program():
    # Checks of concrete inputs run in NumPy and the loop's set-up compares nothing
    # eagerly: a first solve waits for one XLA compilation, not for small programs
    # of its own besides (each ~20 ms the first time it meets a shape and dtype).
    import logging
    import re

    names = []

    class Collect(logging.Handler):
        def emit(self, record):
            found = re.match(r"Compiling (\S+) with", record.getMessage())
            if found:
                names.append(found.group(1))

    y0 = jnp.array([1.0, 0.5, 0.25])  # a shape no other test here solves
    args = jnp.array([1.1, 0.4, 0.1, 0.4])
    field = lambda t, y, p: jnp.stack([-p[0] * y[0], p[1] * y[0] - y[1], -p[3] * y[2]])
    saveat = gs.SaveAt(ts=jnp.linspace(0.0, 2.0, 7))
    jax.block_until_ready((y0, args, saveat.subs.ts))
    jax.clear_caches()
    logger = logging.getLogger("jax._src.interpreters.pxla")
    handler = Collect(level=logging.DEBUG)
    logger.addHandler(handler)
    try:
        with jax.log_compiles():
            sol = gs.diffeqsolve(
                gs.ODETerm(field), gs.Tsit5(), 0.0, 2.0, None, y0, args,
                saveat=saveat,
                stepsize_controller=gs.PIDController(rtol=1e-6, atol=1e-6),
            )  # fmt: skip
            jax.block_until_ready(sol.ys)
    finally:
        logger.removeHandler(handler)
    assert sol.ys.shape == (7, 3)
    assert len(names) == 1, names
