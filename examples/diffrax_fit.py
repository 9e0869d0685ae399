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
import optimistix as optx

# gs.fit's Jacobian assembly and its choice of block mode:
from gradsolve._fit_jacobian import block_mode, ensemble_residuals


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
):
    """Fit shared parameters `params` of `dy/dt = f(t, y, params)` to `data[i, j] ~
    y_i(ts[j])`, every iteration solving with Diffrax. Returns `(params, result,
    iterations, seconds)`; the time includes compilation (call twice to exclude it).
    """
    start = time.perf_counter()
    term = diffrax.ODETerm(f)

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
        params0,
        y0s,
        t0,
        ts,
        data,
    )
    params = jax.block_until_ready(sol.value)
    seconds = time.perf_counter() - start
    return params, sol.result, int(sol.stats["num_steps"]), seconds


@eqx.filter_jit
def _solve(
    term, controller, optimiser, adjoint, jac, mode, max_steps, max_iterations, params0,
    y0s, t0, ts, data,
):  # fmt: skip
    def one(params, y0, data_i):
        sol = diffrax.diffeqsolve(
            term,
            diffrax.Tsit5(),
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
        return sol.ys - data_i

    def residuals(params, _):
        return ensemble_residuals(
            params, fn=one, in_axes=None, inputs=(y0s, data), mode=mode
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
