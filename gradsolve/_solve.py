"""`diffeqsolve` and `record`: the adaptive solve, with the Diffrax fallback."""

import functools

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

# Diffrax's own function, not the public name: a program (or a conformance run) may
# point `diffrax.diffeqsolve` at `gs.diffeqsolve`, and the fallback must not recurse.
from diffrax._integrate import diffeqsolve as _diffrax_diffeqsolve

from ._diagnose import is_concrete, throw_eagerly, throw_in_graph
from ._fallback import (
    differentiated,
    fallback_reason,
    no_time_derivative_error as _no_time_derivative_error,
    refuse_time_derivatives,
)
from ._kernel_select import check_kernel_option
from ._mesh import RecordedMesh
from ._one_call import fast_diffeqsolve, record_steps
from ._problem import check_concrete_inputs, prepare
from ._saving import SavePlan
from ._sharding import explained_explicit_mesh
from ._solve_checks import (
    check_max_steps,
    check_solver,
    check_tolerances,
    explained_forward_mode,
)


def diffeqsolve(
    terms,
    solver,
    t0,
    t1,
    dt0,
    y0,
    args=None,
    *,
    saveat: diffrax.SaveAt = diffrax.SaveAt(t1=True),
    stepsize_controller: diffrax.AbstractStepSizeController = (
        diffrax.ConstantStepSize()
    ),
    adjoint: diffrax.AbstractAdjoint = diffrax.RecursiveCheckpointAdjoint(),
    event=None,
    max_steps: int | None = 4096,
    throw: bool = True,
    progress_meter=diffrax.NoProgressMeter(),
    solver_state=None,
    controller_state=None,
    made_jump=None,
    discrete_terminating_event=None,
    kernel: str = "auto",
):
    """Solve an ODE; a drop-in replacement for `diffrax.diffeqsolve`.

    Takes the same arguments with the same defaults. With a gradsolve solver
    (`gs.Tsit5()`, `gs.Dopri5()`, `gs.Rodas5()`, `gs.Rodas5P()`), a
    `diffrax.ODETerm`, a `PIDController`, `ConstantStepSize` or `StepTo` controller
    and `SaveAt(t0, t1, ts, steps)`, it records the accepted steps (the same steps
    Diffrax takes) and returns them as `sol.mesh`; `jax.grad` through it is the
    exact discrete adjoint over those steps (the derivative Diffrax returns by
    default), computed in time proportional to the number of accepted steps.

    Anything else (a Diffrax solver, other terms, `SaveAt(dense=True)` or `fn`,
    events, another `adjoint`, a progress meter, ...) is passed unchanged to
    `diffrax.diffeqsolve`, whose `diffrax.Solution` is returned. Forward-mode
    derivatives (`jax.jvp`, `jax.jacfwd`) are available through [`gradsolve.replay`][],
    or through this function with `adjoint=diffrax.DirectAdjoint()` (which falls back).

    `kernel` (the one argument Diffrax does not have) chooses how an ensemble,
    `jax.vmap(gs.diffeqsolve)`, is solved: `"auto"` (default) runs the fused Pallas
    kernel, one GPU kernel for the whole ensemble, when the backend is a GPU and the
    problem fits (`gs.Tsit5`/`gs.Dopri5`, a `PIDController` with the RMS or max norm
    or a `ConstantStepSize`, at most 32 state elements, small `args`,
    `SaveAt(t0, t1, ts)`), else the XLA loop; `"pallas"` always the kernel (Pallas
    interpret mode off a GPU; an error if the problem does not fit); `"xla"` never.
    Both take the same steps. Under `jax.grad` the recording runs on XLA, which keeps
    the states the adjoint needs.

    **Returns:**

    A [`gradsolve.Solution`][] (`ts`, `ys`, `stats`, `result`, `mesh`) on the fast
    path, else a `diffrax.Solution`.
    """
    check_solver(solver)
    reason = fallback_reason(
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
    )
    if discrete_terminating_event is not None:
        reason = "a discrete_terminating_event (Diffrax warns it is deprecated)"
    if reason is None and differentiated((t0, t1, dt0, saveat.subs.ts)):
        # The replay holds step times fixed; Diffrax differentiates through them.
        reason = "a derivative with respect to t0, t1, dt0 or saveat.ts"
    check_kernel_option(kernel)
    if reason is not None:
        if kernel == "pallas":
            raise ValueError(
                f"kernel='pallas' cannot run this solve: {reason}. Use kernel='xla' "
                "(or kernel='auto', which falls back by itself)."
            )
        return _diffrax_diffeqsolve(
            terms,
            solver,
            t0,
            t1,
            dt0,
            y0,
            args,
            saveat=saveat,
            stepsize_controller=stepsize_controller,
            adjoint=adjoint,
            event=event,
            max_steps=max_steps,
            throw=throw,
            progress_meter=progress_meter,
            solver_state=solver_state,
            controller_state=controller_state,
            made_jump=made_jump,
            discrete_terminating_event=discrete_terminating_event,
        )
    max_steps = check_max_steps(max_steps)
    check_tolerances(stepsize_controller)
    check_concrete_inputs(t0, t1, dt0, y0, args, saveat)
    # Called eagerly, a failure is explained on the host (with its time and cause).
    eager = throw and is_concrete(terms, t0, t1, dt0, y0, args, saveat)
    with explained_explicit_mesh("gs.diffeqsolve"), explained_forward_mode():
        sol = fast_diffeqsolve(
            terms,
            solver,
            t0,
            t1,
            dt0,
            y0,
            args,
            saveat,
            stepsize_controller,
            max_steps,
            throw and not eager,
            kernel,
        )
    if eager:
        ys = throw_eagerly(
            sol.ys,
            sol.mesh,
            sol.stats,
            sol.t0,
            sol.t1,
            terms,
            solver,
            y0,
            args,
            max_steps,
            states=functools.partial(
                _accepted_states,
                terms,
                solver,
                t0,
                t1,
                dt0,
                y0,
                args,
                stepsize_controller,
                max_steps,
            ),
            controller=stepsize_controller,
        )
        sol = eqx.tree_at(lambda s: s.ys, sol, ys)
    return sol


def _accepted_states(terms, solver, t0, t1, dt0, y0, args, controller, max_steps):
    """The states a (failed) solve accepted, at `t0` and at each step's end: what a
    failure's diagnosis looks at."""
    saveat = diffrax.SaveAt(t0=True, steps=True)
    return fast_diffeqsolve(
        terms,
        solver,
        t0,
        t1,
        dt0,
        y0,
        args,
        saveat,
        controller,
        max_steps,
        False,
        "xla",
    ).ys


@eqx.filter_jit
def _fast_record(
    terms,
    solver,
    t0,
    t1,
    dt0,
    y0,
    args,
    saveat,
    stepsize_controller,
    max_steps,
    throw,
    kernel,
):
    t0, t1, dt0, saveat = refuse_time_derivatives(t0, t1, dt0, saveat)
    prepared = prepare(terms, t0, t1, dt0, y0, args, saveat)
    y0 = jax.lax.stop_gradient(prepared.y0)
    args = jtu.tree_map(
        lambda x: jax.lax.stop_gradient(x) if eqx.is_array(x) else x, args
    )
    # The mesh does not depend on what is saved: record without saving anything.
    nothing = SavePlan(ts=None, t0=False, t1=False, steps=False)
    out = record_steps(
        (y0, args, prepared.problem.f),
        solver,
        prepared.t0,
        prepared.t1,
        prepared.dt0,
        stepsize_controller,
        nothing,
        max_steps,
        prepared.problem.treedef,
        False,
        kernel,
    )
    mesh = out.mesh
    if prepared.plan.ts is not None:
        # A recording saves nothing, but non-finite save times are still reported.
        bad = ~jnp.all(jnp.isfinite(prepared.plan.ts))
        msg = "saveat.ts is NaN or infinite; times must be finite numbers."
        mesh = eqx.tree_at(lambda m: m.ts, mesh, eqx.error_if(mesh.ts, bad, msg))
    if throw:
        mesh = throw_in_graph(
            mesh,
            out.result,
            max_steps,
            prepared.valid,
            out.t_reached,
            prepared.t0,
            prepared.t1,
        )
    return mesh


def record(
    terms,
    solver,
    t0,
    t1,
    dt0,
    y0,
    args=None,
    *,
    saveat: diffrax.SaveAt = diffrax.SaveAt(t1=True),
    stepsize_controller: diffrax.AbstractStepSizeController = (
        diffrax.ConstantStepSize()
    ),
    max_steps: int = 4096,
    throw: bool = True,
    kernel: str = "auto",
) -> RecordedMesh:
    """Solve adaptively and return the accepted steps as a `RecordedMesh`.

    The arguments are those of `diffrax.diffeqsolve` (a gradsolve solver, a
    `diffrax.ODETerm`, a `PIDController`/`ConstantStepSize`/`StepTo` controller).
    No derivative flows through a recording: differentiate [`gradsolve.replay`][]
    over the mesh instead. Under `jax.vmap` every trajectory records its own steps
    and the mesh gains a leading batch axis; `mesh.trim()` then removes padding.

    `kernel="auto"` (default), `"pallas"` or `"xla"` chooses the fused Pallas kernel
    or the XLA loop for an ensemble, as in [`gradsolve.diffeqsolve`][]; both record
    the same steps.

    **Returns:**

    A [`gradsolve.RecordedMesh`][] whose steps are those `diffrax.diffeqsolve` takes
    with the corresponding Diffrax solver, to round-off.
    """
    check_solver(solver)
    reason = fallback_reason(
        terms,
        solver,
        y0,
        saveat,
        stepsize_controller,
        diffrax.RecursiveCheckpointAdjoint(),
        None,
        max_steps,
        diffrax.NoProgressMeter(),
        None,
        None,
        None,
    )
    check_kernel_option(kernel)
    if reason is not None:
        raise ValueError(
            f"gs.record cannot record this solve: {reason}. It records gradsolve "
            "solvers (gs.Tsit5(), gs.Dopri5(), gs.Rodas5()) on a diffrax.ODETerm "
            "with a PIDController, ConstantStepSize or StepTo controller."
        )
    if differentiated((t0, t1, dt0, saveat.subs.ts, stepsize_controller)):
        _no_time_derivative_error()
    max_steps = check_max_steps(max_steps)
    check_tolerances(stepsize_controller)
    check_concrete_inputs(t0, t1, dt0, y0, args, saveat)
    eager = throw and is_concrete(terms, t0, t1, dt0, y0, args, saveat)
    with explained_explicit_mesh("gs.record"):
        mesh = _fast_record(
            terms,
            solver,
            t0,
            t1,
            dt0,
            y0,
            args,
            saveat,
            stepsize_controller,
            max_steps,
            throw and not eager,
            kernel,
        )
    if eager:
        states = functools.partial(
            _accepted_states,
            terms,
            solver,
            t0,
            t1,
            dt0,
            y0,
            args,
            stepsize_controller,
            max_steps,
        )
        mesh = throw_eagerly(
            mesh,
            mesh,
            None,
            t0,
            t1,
            terms,
            solver,
            y0,
            args,
            max_steps,
            states,
            stepsize_controller,
        )
    return mesh
