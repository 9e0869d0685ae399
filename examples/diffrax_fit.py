"""The same Optimistix fit as `gs.fit`, with Diffrax gradients: the reference.

Used by `fit_lotka_volterra.py`, by `benchmarks/fit_benchmark.py` and by the tests.
Every optimiser iteration solves the ensemble adaptively with `diffrax.diffeqsolve`
and differentiates that solve: with the default adjoint
(`RecursiveCheckpointAdjoint`, reverse mode) for `jac="bwd"`, and with
`diffrax.DirectAdjoint()` for `jac="fwd"` (the default adjoint refuses forward
mode). The Jacobian is assembled trajectory by trajectory exactly as `gs.fit` does
it, so that the two fits differ only in how the ODE is solved and differentiated.
"""

import time

import diffrax
import equinox as eqx
import jax
import optimistix as optx

from gradsolve._fit_jacobian import ensemble_residuals  # gs.fit's Jacobian assembly


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
    adjoint = (
        diffrax.DirectAdjoint() if jac == "fwd" else diffrax.RecursiveCheckpointAdjoint()
    )
    sol = _solve(
        diffrax.ODETerm(f),
        stepsize_controller,
        optimiser,
        adjoint,
        jac,
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
    term, controller, optimiser, adjoint, jac, max_steps, max_iterations, params0,
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
            params, fn=one, in_axes=None, inputs=(y0s, data), mode=jac
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
