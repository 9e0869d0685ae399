"""What the fast path covers: the solves it hands to Diffrax, and the derivatives it
refuses."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from diffrax._saveat import save_y as _save_y  # the default SaveAt fn

from ._solver.base import AbstractGradsolveSolver


_FAST_CONTROLLERS = (
    diffrax.PIDController,
    diffrax.ConstantStepSize,
    diffrax.StepTo,
    diffrax.ClipStepSizeController,
)


def fallback_reason(
    terms,
    solver,
    y0,
    saveat,
    stepsize_controller,
    adjoint,
    event,
    max_steps,
    progress_meter,
    solver_state,
    controller_state,
    made_jump,
) -> str | None:
    """Why a solve cannot take the fast path (`None` if it can)."""
    if not isinstance(solver, AbstractGradsolveSolver):
        return f"the solver is {type(solver).__name__}, not a gradsolve solver"
    if type(terms) is not diffrax.ODETerm:
        return "the terms are not a single diffrax.ODETerm"
    leaves = jtu.tree_leaves(y0)
    if not any(jnp.size(x) for x in leaves):
        return "y0 has no elements (None, an empty PyTree or zero-size arrays only)"
    if any(jnp.iscomplexobj(x) for x in leaves):
        return "a complex y0"
    if saveat.solver_state or saveat.controller_state or saveat.made_jump:
        return "SaveAt(solver_state=, controller_state= or made_jump=True)"
    sub = saveat.subs
    if saveat.dense or not isinstance(sub, diffrax.SubSaveAt):
        return "SaveAt(dense=True) or nested SubSaveAt"
    if sub.fn is not _save_y or sub.steps not in (0, 1, False, True):
        return "SaveAt(fn=...) or SaveAt(steps=n > 1)"
    if not isinstance(stepsize_controller, _FAST_CONTROLLERS):
        return f"the step size controller {type(stepsize_controller).__name__}"
    if isinstance(stepsize_controller, diffrax.ClipStepSizeController):
        if not isinstance(stepsize_controller.controller, diffrax.PIDController):
            return "a ClipStepSizeController around a controller other than PID"
        if stepsize_controller.store_rejected_steps is not None:
            return "ClipStepSizeController(store_rejected_steps=...)"
    if not isinstance(adjoint, diffrax.RecursiveCheckpointAdjoint):
        return f"adjoint={type(adjoint).__name__}()"
    if event is not None:
        return "an event"
    if max_steps is None:
        return "max_steps=None"
    if not isinstance(progress_meter, diffrax.NoProgressMeter):
        return "a progress meter"
    if any(x is not None for x in (solver_state, controller_state, made_jump)):
        return "solver_state/controller_state/made_jump passed in"
    if differentiated(stepsize_controller):
        return "a derivative with respect to a value inside the step size controller"
    return None


def differentiated(tree) -> bool:
    """Whether a forward- or reverse-mode derivative is being taken with respect to
    an array of `tree` (seen from inside that transformation: under `jax.grad`,
    `jax.jvp`, also inside `jax.jit` or `jax.vmap` of it).

    gradsolve's replay holds step times fixed, so derivatives that flow through the
    step times (e.g. with respect to a controller's `step_ts`) are Diffrax's to take.
    """
    for leaf in jtu.tree_leaves(tree):
        x = leaf
        while isinstance(x, jax.core.Tracer):
            # JVPTracer (jvp, grad) and LinearizeTracer (linearize); BatchTracer
            # (vmap) wraps its value in `val`, a differentiation tracer in `primal`.
            if type(x).__name__ in ("JVPTracer", "LinearizeTracer"):
                return True
            x = getattr(x, "primal", getattr(x, "val", None))
    return False


@jax.custom_jvp
def _no_time_derivative(t):
    return t


@_no_time_derivative.defjvp
def _no_time_derivative_jvp(primals, tangents):
    no_time_derivative_error()


def no_time_derivative_error():
    raise ValueError(
        "gs.record and gs.replay hold the step times fixed, so they do not "
        "differentiate with respect to t0, t1, dt0, saveat.ts or the step size "
        "controller's values. Differentiate with respect to y0 and args; for "
        "derivatives with respect to times call gs.diffeqsolve (it hands them to "
        "Diffrax) with jax.grad applied inside any jax.jit, or diffrax.diffeqsolve."
    )


def refuse_time_derivatives(t0, t1, dt0, saveat):
    t0, t1 = _no_time_derivative(t0), _no_time_derivative(t1)
    dt0 = None if dt0 is None else _no_time_derivative(dt0)
    if saveat.subs.ts is not None:
        saveat = eqx.tree_at(
            lambda s: s.subs.ts, saveat, _no_time_derivative(saveat.subs.ts)
        )
    return t0, t1, dt0, saveat
