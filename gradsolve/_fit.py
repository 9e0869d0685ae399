"""`fit`: parameter estimation for ODE ensembles, Optimistix on recorded meshes."""

import time
from collections.abc import Callable
from typing import Literal

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optimistix as optx
from jaxtyping import PyTree

from ._fit_convergence import gauss_newton_refine, tolerances
from ._fit_problem import FitProblem, make_problem
from ._fit_program import fit_per_evaluation, optimiser_options, record_fit
from ._mesh import RecordedMesh
from ._solve_checks import check_max_steps


class FitResult(eqx.Module):
    """What [`gradsolve.fit`][] returns.

    **Fields:**

    - `params`: the fitted parameters, structured like `params0` (with `fit_y0=True`,
        the pair `(params, y0s)`).
    - `result`: an `optimistix.RESULTS` code: `successful`, or why the fit stopped
        (`nonlinear_max_steps_reached` when the optimiser or the rounds of
        re-recording ran out, `nonlinear_divergence` when the ODE could not be solved
        at some parameters, `nonfinite` for NaN/inf parameters or residuals).
        `optx.RESULTS[fit.result]` is a message.
    - `stats`: a dict of Python numbers: `rounds` (optimiser runs), `records`
        (ensemble meshes recorded), `stale_meshes` (rounds that ended on a mesh whose
        replay error ratio exceeded the threshold), `iterations` (optimiser steps, all
        rounds), `refinement_steps` (Gauss-Newton steps that refined an answer on
        the mesh recorded at it, see below), `jacobian_evaluations` (one per
        optimiser step and per refinement step: a Jacobian of the residuals for
        least-squares solvers, a gradient for minimisers),
        `mesh_steps` (the trimmed length of the final mesh), `max_error_ratio`
        (the replay's error ratio at `params` on the final mesh; <= 1 means the mesh
        meets the recording tolerances there), `residual_norm` (the 2-norm of the
        weighted residuals at `params`), `validation_error` (the largest difference
        between the observables of a fresh adaptive solve at `params` and those of
        the replay, relative to the largest observable), `wall_time` (seconds,
        compilation included).
    - `mesh`: a trimmed ensemble mesh recorded at `params` (by the validating solve;
        `None` if the fit did not converge), for further replays near `params`.
    """

    params: PyTree
    result: optx.RESULTS
    stats: dict
    mesh: RecordedMesh | None


# The most Gauss-Newton steps that refine an answer on a mesh recorded at it.
REFINE_STEPS = 8


@eqx.filter_jit
def _round(problem: FitProblem, optimiser, jac, mode, max_iterations, params, mesh):
    """One optimiser run on the residuals replayed over a fixed mesh; `mode` is how
    the Jacobian blocks are computed (`None`: no blocks, see `FitProblem.residuals`).
    """

    def residuals(p, mesh):
        return problem.residuals(p, mesh, mode)

    sol = optx.least_squares(
        residuals,
        optimiser,
        params,
        mesh,
        options=optimiser_options(optimiser, jac),
        max_steps=max_iterations,
        throw=False,
    )
    obs, ratio, norm = _assess(problem, sol.value, mesh)
    return sol.value, sol.result, sol.stats["num_steps"], obs, ratio, norm


@eqx.filter_jit
def _assess(problem: FitProblem, params, mesh):
    """The observables replayed at `params` over `mesh`, the replay's error ratio
    and the weighted residuals' 2-norm."""
    obs, ratio = problem.predict(params, mesh)
    norm = jnp.sqrt(jnp.sum((problem.sqrt_weights * (obs - problem.data)) ** 2))
    return obs, ratio, norm


def _validation_error(problem: FitProblem, params, replayed, fresh_mesh) -> float:
    """The largest difference between the observables `replayed` at `params` (over
    the fit's last mesh) and those replayed over a mesh freshly recorded at
    `params`, relative to the largest observable.

    A replay over a freshly recorded mesh gives the values of the adaptive solve
    that recorded it (to round-off), so this compares against a fresh solve. It
    runs the program that assessed the answer (the meshes share a length, see
    `fit`).
    """
    fresh, _, _ = _assess(problem, params, fresh_mesh)
    scale = jnp.maximum(jnp.max(jnp.abs(fresh)), jnp.finfo(fresh.dtype).tiny)
    return float(jnp.max(jnp.abs(fresh - replayed)) / scale)


def _finite(tree) -> bool:
    leaves = [x for x in jtu.tree_leaves(tree) if eqx.is_inexact_array(x)]
    return all(_all_finite(x) for x in leaves)


def _all_finite(x) -> bool:
    if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
        # Reduced where the values lie (across hosts, no process holds them all).
        return bool(jnp.all(jnp.isfinite(x)))
    # On the host (NumPy): no dispatch of a compiled reduction per leaf.
    return bool(np.isfinite(np.asarray(x)).all())


def fit(
    term: diffrax.ODETerm,
    solver,
    params0: PyTree,
    y0s: PyTree,
    ts,
    data,
    *,
    stepsize_controller: diffrax.AbstractStepSizeController = diffrax.PIDController(
        rtol=1e-8, atol=1e-8
    ),
    optimiser: optx.AbstractLeastSquaresSolver
    | optx.AbstractMinimiser = optx.LevenbergMarquardt(rtol=1e-8, atol=1e-8),
    jac: Literal["fwd", "bwd"] = "fwd",
    observe: Callable | None = None,
    weights=None,
    t0=0.0,
    dt0=None,
    params_axes: PyTree = None,
    fit_y0: bool = False,
    max_error_ratio: float = 1.0,
    max_rounds: int = 8,
    max_iterations: int = 256,
    max_steps: int = 4096,
    sharding=None,
    meshes: Literal["auto", "reused", "per_evaluation"] = "auto",
) -> FitResult:
    """Fit the parameters of an ODE ensemble to observations, reusing recorded meshes.

    Records one adaptive mesh for the whole ensemble (one `jax.vmap` of
    [`gradsolve.record`][]), then lets an Optimistix solver minimise the weighted
    squared residuals `observe(y(ts), params) - data` computed by
    [`gradsolve.replay`][] over that mesh: every iteration differentiates a
    fixed-step replay instead of an adaptive solve. After each optimiser run the
    replay's embedded error estimate at the new parameters tells whether the mesh is
    stale; the ensemble is then recorded again at the new parameters and the
    optimiser restarted from them. The fit ends when a run that started on a mesh
    recorded at the previous run's optimum converges and the mesh is still fresh
    (error ratio <= `max_error_ratio`) at its answer, so the answer is a minimum of
    residuals computed to the solver's tolerances. For a least-squares solver with
    `rtol` and `atol` (Levenberg-Marquardt, Gauss-Newton, Dogleg), that last run is
    first tried as Gauss-Newton steps on the new mesh, which stop at the solver's
    own termination test (Optimistix's Cauchy test on the change of the variable
    and of the residuals): started next to the optimum, the solver itself would
    spend most of its steps rejecting steps at the residuals' round-off floor. Where
    the steps fail (one raises the loss without passing the test, or 8 do not
    converge), the solver runs as before. A fresh adaptive solve at the
    final parameters validates the replayed values (`stats["validation_error"]`).

    The outer loop runs on the host; each optimiser run is one compiled call,
    reused from round to round (and by later fits with the same shapes): the mesh
    length is rounded up to buckets (see [`gradsolve.RecordedMesh.trim`][]), so a
    new mesh rarely needs a new compilation.

    **Arguments:**

    - `term`: a `diffrax.ODETerm` whose vector field is `f(t, y, params)`.
    - `solver`: a gradsolve solver, e.g. `gs.Tsit5()`.
    - `params0`: initial guess, any PyTree of arrays, passed to the vector field as
        `args`. Shared by the ensemble, except the entries `params_axes` marks.
    - `y0s`: the initial states, a PyTree whose leaves have a leading ensemble axis.
    - `ts`: the observation times, increasing, shared by the ensemble.
    - `data`: observations, an array of shape `(trajectories, len(ts)) +
        observe(y, params).shape`: `data[i, j]` observes trajectory `i` at `ts[j]`.
    - `stepsize_controller`: how meshes are recorded (default
        `PIDController(rtol=1e-8, atol=1e-8)`).
    - `optimiser`: an `optimistix.AbstractLeastSquaresSolver` (`LevenbergMarquardt`,
        `GaussNewton`, `Dogleg`, ...) or an `optimistix.AbstractMinimiser` (`BFGS`,
        ...), which then minimises the sum of squared residuals.
    - `jac`: `"fwd"` or `"bwd"`, Optimistix's option: for minimisers the autodiff
        mode of the gradient (`"bwd"`: one reverse pass through the replay, the
        cheapest choice for many parameters). For least squares both give the same
        Jacobian, assembled from per-trajectory blocks, each computed by
        differentiating that trajectory's replay in the mode that needs fewer
        passes (forward mode when a trajectory has more residuals than entries of
        the fit variable it depends on, as in most fits); Optimistix is then given
        the direction that materialises the assembled Jacobian in fewer passes
        (`"fwd"` when the fit variable has fewer entries than there are residuals),
        whichever `jac` says: Optimistix's `"bwd"` pulls back one cotangent per
        residual, a cost of residuals squared times parameters.
    - `observe`: `observe(y, params) -> array`, what is measured of a state (with
        that trajectory's parameters); default: the state itself.
    - `weights`: optional non-negative weights broadcastable to `data`'s shape; the
        residuals are scaled by `sqrt(weights)`. NaN entries of `data` are allowed
        where the weight is 0 (missing observations).
    - `t0`: the initial time of every trajectory (at or before `ts[0]`).
    - `dt0`: the initial step (`None`: chosen by the controller).
    - `params_axes`: which entries of `params0` are per trajectory: `None` (all
        shared), `0` (all per trajectory, leading axis), or a PyTree prefix of
        `params0` with `None`/`0` entries; the `in_axes` of a `jax.vmap`.
    - `fit_y0`: fit the initial states too. The optimised variable, and
        `FitResult.params`, are then the pair `(params, y0s)`, with `y0s` the initial
        guess; the vector field and `observe` still see only `params`.
    - `max_error_ratio`: a mesh is stale at some parameters when the replay's
        error ratio there exceeds this (1: the recording tolerances are missed).
    - `max_rounds`: the most optimiser runs (each after a fresh record).
    - `max_iterations`: the most steps of one optimiser run.
    - `max_steps`: the most steps of one trajectory's recording.
    - `sharding`: the devices to split the experiments over (see
        [`gradsolve.sharded_vmap`][]): a `jax.sharding.NamedSharding` of the leading
        axis or a `jax.sharding.Mesh`; by default, the devices `y0s` and `data` lie
        on. Every device records, replays and differentiates its own experiments;
        the optimiser's reductions over all residuals cross devices.

    - `meshes`: `"auto"` (the default: `"per_evaluation"` with a least-squares optimiser
        or `jac="fwd"`, the faster way on the Lotka-Volterra, FitzHugh-Nagumo and
        Robertson benchmarks; `"reused"` otherwise, a minimiser with a reverse-mode
        gradient), `"reused"` (the rounds above) or `"per_evaluation"`: the whole fit as
        one compiled program in which every evaluation of the residuals records the
        ensemble at its own parameters (under `stop_gradient`) and differentiates the
        replay over that mesh. The optimiser then takes the steps it takes with Diffrax
        gradients, iteration for iteration, since the residuals are the adaptive solve's
        and their derivative is Diffrax's; it compiles one program instead of five. The
        recordings' buffer is 256 steps when the Jacobian blocks are computed in
        forward mode by an explicit solver (their replays stop at the last recorded
        step) for an ensemble of up to 32,768 trajectories, else 1.5 times the
        longest mesh at `params0` (bucketed; one recording more). Where the
        optimiser's path needs more, the fit records at `params0` to size the buffer
        (if it did not) or doubles it, and runs again (noted at no cost unless it
        happens), at most twice, then falls back to `"reused"`.
        `stats["max_error_ratio"]` and `stats["validation_error"]` are NaN there, not
        computed (every residual is replayed over a mesh recorded at its own
        parameters); `fit.mesh` is recorded at the answer.

    **Returns:**

    A [`gradsolve.FitResult`][]: `params`, an `optimistix.RESULTS` `result`, and
    `stats`. Failures (an unsolvable ODE at some parameters, a diverging optimiser)
    are reported in `result`, not raised.
    """
    start = time.perf_counter()
    if meshes not in ("auto", "reused", "per_evaluation"):
        raise ValueError(
            f'meshes must be "auto", "reused" or "per_evaluation"; got {meshes!r}.'
        )
    if meshes == "auto":
        least_squares = isinstance(optimiser, optx.AbstractLeastSquaresSolver)
        meshes = "per_evaluation" if least_squares or jac == "fwd" else "reused"
    if jac not in ("fwd", "bwd"):
        raise ValueError(f'jac must be "fwd" or "bwd"; got {jac!r}.')
    if not isinstance(
        optimiser, optx.AbstractLeastSquaresSolver | optx.AbstractMinimiser
    ):
        raise TypeError(
            "optimiser must be an Optimistix least-squares solver (e.g. "
            "optx.LevenbergMarquardt) or minimiser (e.g. optx.BFGS); got "
            f"{type(optimiser).__name__}."
        )
    max_steps = check_max_steps(max_steps)
    if dt0 is not None and not (np.all(np.isfinite(np.asarray(dt0))) and dt0 > 0):
        raise ValueError(
            f"dt0={dt0}: the initial step must be a positive finite number, or None "
            "to let the controller choose it."
        )
    if max_rounds < 2:
        raise ValueError(
            "max_rounds must be at least 2: a fit ends with an optimiser run on a "
            "mesh recorded at the previous run's answer."
        )
    problem, params = make_problem(
        term,
        solver,
        params0,
        y0s,
        ts,
        data,
        observe=observe,
        weights=weights,
        t0=t0,
        params_axes=params_axes,
        fit_y0=fit_y0,
        sharding=sharding,
    )
    stats = dict(rounds=0, records=0, stale_meshes=0, iterations=0)
    result = optx.RESULTS.successful
    mesh = None
    ratio = norm = np.nan

    length = [0]

    def record_at(p):
        if not _finite(p):
            return None
        mesh, ok = record_fit(problem, p, stepsize_controller, dt0, max_steps)
        if not bool(ok):
            return None
        # Never shorter than the meshes before: the compiled optimiser run is reused.
        mesh = mesh.trim(at_least=length[0])
        length[0] = mesh.max_steps
        return mesh

    mode = None
    if not (isinstance(optimiser, optx.AbstractMinimiser) and jac == "bwd"):
        mode = problem.block_mode(params)
        if isinstance(optimiser, optx.AbstractLeastSquaresSolver):
            # Assembled from the blocks, the Jacobian has the same entries either
            # way; Optimistix's `"bwd"` materialises it with one cotangent per
            # residual (2,560 passes over the blocks for Lotka-Volterra's 4
            # parameters), `"fwd"` with one tangent per parameter.
            jac = problem.materialise_mode(params)
    outcome = None
    if meshes == "per_evaluation":
        outcome = fit_per_evaluation(
            problem, params, optimiser, jac, mode, stepsize_controller, dt0,
            max_steps, max_iterations,
        )  # fmt: skip
    if outcome is not None:
        params, result, steps, norm, fresh, recordings = outcome
        # One recording per evaluation (the last one's mesh is `fresh`), and those
        # on the host: at the initial guess, where it sized the buffer.
        stats.update(rounds=1, iterations=steps, records=recordings + steps)
        stats.update(stale_meshes=0, refinement_steps=0, jacobian_evaluations=steps)
        stats.update(residual_norm=norm, max_error_ratio=np.nan)
        stats.update(validation_error=np.nan)
        if fresh is None:
            result = optx.RESULTS.nonlinear_divergence
        stats["mesh_steps"] = None if fresh is None else fresh.max_steps
        stats["wall_time"] = time.perf_counter() - start
        return FitResult(params=params, result=result, stats=stats, mesh=fresh)
    # (A per-evaluation fit that fell back recorded at the initial guess too.)
    stats["records"] += 1 + (meshes == "per_evaluation")
    mesh = record_at(params)
    converged = False
    tolerance = tolerances(optimiser)
    stats["refinement_steps"] = 0
    for round_ in range(max_rounds):
        if mesh is None:
            result = optx.RESULTS.nonlinear_divergence
            break
        if round_ > 0 and tolerance is not None and mode is not None:
            # Started at the previous run's optimum, the solver would spend most of
            # its steps at the round-off floor: Gauss-Newton steps get there first.
            refined, ok, steps = gauss_newton_refine(
                problem, mode, params, mesh, *tolerance, REFINE_STEPS
            )
            stats["refinement_steps"] += int(steps)
            if bool(ok) and _finite(refined):
                obs, ratio, norm = _assess(problem, refined, mesh)
                ratio, norm = float(ratio), float(norm)
                if ratio <= max_error_ratio:
                    params, converged = refined, True
                    break
        new, code, steps, obs, ratio, norm = _round(
            problem,
            optimiser,
            jac,
            mode,
            max_iterations,
            params,
            mesh,
        )
        stats["rounds"] += 1
        stats["iterations"] += int(steps)
        ratio = float(ratio)
        stale = not ratio <= max_error_ratio  # NaN counts as stale
        stats["stale_meshes"] += int(stale)
        if not _finite(new) or not np.isfinite(float(norm)):
            result = optx.RESULTS.nonfinite
            break
        failed = code != optx.RESULTS.successful
        if failed and not stale:
            # The optimiser itself failed (not the mesh): report its code.
            result, params = code, new
            break
        if round_ > 0 and not stale:
            # This run started on a mesh recorded at the previous run's optimum, and
            # the mesh still meets the tolerances at its answer.
            params, converged = new, True
            break
        params = new
        mesh = record_at(params)
        stats["records"] += 1
    else:
        result = optx.RESULTS.nonlinear_max_steps_reached
    stats["validation_error"] = np.nan
    if converged:
        fresh = record_at(params)
        if fresh is None:
            result = optx.RESULTS.nonlinear_divergence
        else:
            stats["validation_error"] = _validation_error(problem, params, obs, fresh)
    stats["jacobian_evaluations"] = stats["iterations"] + stats["refinement_steps"]
    stats["mesh_steps"] = None if mesh is None else mesh.max_steps
    mesh = fresh if converged else None
    stats["max_error_ratio"] = float(ratio)
    stats["residual_norm"] = float(norm)
    stats["wall_time"] = time.perf_counter() - start
    return FitResult(params=params, result=result, stats=stats, mesh=mesh)
