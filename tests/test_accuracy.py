"""Order of accuracy and float32, against closed forms."""

import diffrax
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import pytest

import gradsolve as gs

from .helpers import LINEAR_A, PROBLEMS


@pytest.mark.parametrize("solver", [gs.Tsit5(), gs.Dopri5()], ids=["tsit5", "dopri5"])
def test_order_of_accuracy(solver):
    y0 = jnp.array([1.0, 0.5, -0.3])
    t1 = 4.0
    exact = jsl.expm(LINEAR_A * t1) @ y0
    term = diffrax.ODETerm(PROBLEMS["linear"].f)
    steps = np.array([16, 24, 32, 48, 64])
    errors = []
    for n in steps:
        sol = gs.diffeqsolve(term, solver, 0.0, t1, t1 / n, y0, LINEAR_A)
        errors.append(float(jnp.max(jnp.abs(sol.ys[-1] - exact))))
    slope = np.polyfit(np.log(t1 / steps), np.log(errors), 1)[0]
    assert 4.6 < slope < 5.6, slope


@pytest.mark.parametrize("solver", [gs.Tsit5(), gs.Dopri5()], ids=["tsit5", "dopri5"])
def test_float32_matches_float64(solver):
    problem = PROBLEMS["lotka_volterra"]
    term = diffrax.ODETerm(problem.f)
    ts = jnp.linspace(0.0, 6.0, 7)
    ctrl = diffrax.PIDController(rtol=1e-5, atol=1e-5)

    def solve(y0, args, t1):
        return gs.diffeqsolve(
            term,
            solver,
            0.0,
            t1,
            None,
            y0,
            args,
            saveat=diffrax.SaveAt(ts=ts.astype(y0.dtype)),
            stepsize_controller=ctrl,
        )

    f32 = jnp.float32
    sol32 = solve(problem.y0.astype(f32), problem.args.astype(f32), f32(6.0))
    sol64 = solve(problem.y0, problem.args, 6.0)
    assert sol32.ys.dtype == jnp.float32
    np.testing.assert_allclose(sol32.ys, sol64.ys, rtol=1e-4, atol=1e-4)
    grad = lambda y0, a, t1: jax.grad(lambda a: jnp.sum(solve(y0, a, t1).ys))(a)
    g32 = grad(problem.y0.astype(f32), problem.args.astype(f32), f32(6.0))
    g64 = grad(problem.y0, problem.args, 6.0)
    assert g32.dtype == jnp.float32
    np.testing.assert_allclose(g32, g64, rtol=1e-3, atol=1e-3)
