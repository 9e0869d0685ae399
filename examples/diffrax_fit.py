"""The same Optimistix fit as `gs.fit`, with Diffrax gradients: the reference.

Used by `fit_lotka_volterra.py`, by `benchmarks/fit_benchmark.py` and by the tests.
Every optimiser iteration solves the ensemble adaptively with `diffrax.diffeqsolve`
(vmapped, compiled once) and differentiates that solve. The Jacobian is assembled
from per-trajectory blocks exactly as `gs.fit` does it (same block mode, chosen by
the same rule), so that the two fits differ only in how the ODE is solved and
differentiated: forward-mode blocks differentiate through `diffrax.ForwardMode()`
(Diffrax's adjoint for forward-mode autodiff), reverse-mode blocks through the
default `RecursiveCheckpointAdjoint`.
"""

import time

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import optimistix as optx

# gs.fit's Jacobian assembly and its choice of block mode:
from gradsolve._fit_jacobian import block_mode, ensemble_residuals


def _state(y, params):
    return y


def diffrax_fit(
    f,
    params0,
    y0s,
    ts,
    data,
    *,
    stepsize_controller=diffrax.PIDController(rtol=1e-8, atol=1e-8),
    optimiser=optx.LevenbergMarquardt(rtol=1e-8, atol=1e-8),
    jac="fwd",
    t0=0.0,
    max_steps=4096,
    max_iterations=256,
    solver=diffrax.Tsit5(),
    observe=None,
    weights=None,
):
    """Fit shared parameters `params` of `dy/dt = f(t, y, params)` to `data[i, j] ~
    observe(y_i(ts[j]), params)` (default: the state), with residuals scaled by
    `sqrt(weights)` (default 1), every iteration solving with Diffrax's `solver`.
    Returns `(params, result, iterations, seconds)`; the time includes compilation
    (call twice to exclude it).
    """
    start = time.perf_counter()
    term = diffrax.ODETerm(f)
    observe = _state if observe is None else observe
    sqrt_weights = jnp.sqrt(
        jnp.broadcast_to(1.0 if weights is None else weights, data.shape)
    )

    mode = block_mode(data[0].size, params0, None)
    adjoint = (
        diffrax.ForwardMode() if mode == "fwd" else diffrax.RecursiveCheckpointAdjoint()
    )
    sol = _solve(
        term,
        stepsize_controller,
        optimiser,
        adjoint,
        jac,
        mode,
        max_steps,
        max_iterations,
        solver,
        observe,
        params0,
        y0s,
        t0,
        ts,
        data,
        sqrt_weights,
    )
    params = jax.block_until_ready(sol.value)
    seconds = time.perf_counter() - start
    return params, sol.result, int(sol.stats["num_steps"]), seconds


@eqx.filter_jit
def _solve(
    term, controller, optimiser, adjoint, jac, mode, max_steps, max_iterations, solver,
    observe, params0, y0s, t0, ts, data, sqrt_weights,
):  # fmt: skip
    def one(params, y0, data_i, sqrt_w):
        sol = diffrax.diffeqsolve(
            term,
            solver,
            t0,
            ts[-1],
            None,
            y0,
            params,
            saveat=diffrax.SaveAt(ts=ts),
            stepsize_controller=controller,
            adjoint=adjoint,
            max_steps=max_steps,
        )
        obs = jax.vmap(lambda y: observe(y, params))(sol.ys)
        return sqrt_w * (obs - data_i)

    def residuals(params, _):
        inputs = (y0s, data, sqrt_weights)
        return ensemble_residuals(
            params, fn=one, in_axes=None, inputs=inputs, mode=mode
        )

    if isinstance(optimiser, optx.AbstractMinimiser):
        options = {"autodiff_mode": jac}
    else:
        options = {"jac": jac}
    return optx.least_squares(
        residuals,
        optimiser,
        params0,
        None,
        options=options,
        max_steps=max_iterations,
        throw=False,
    )
