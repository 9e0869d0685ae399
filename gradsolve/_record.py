"""The adaptive forward pass: Diffrax's stepping loop, keeping the accepted steps."""

import math

import diffrax
import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
from diffrax._term import WrapTerm
from jaxtyping import Array

from ._checkpoints import checkpoint_spacing, segment_length
from ._controller import NORMS, on_components
from ._kernel import kernel_loop
from ._kernel_select import kernel_considered, kernel_unsupported, use_kernel
from ._mesh import RecordedMesh, StateStructure, pad_after
from ._problem import LeafProblem
from ._record_xla import xla_loop
from ._representation import Representation
from ._saving import SaveLayout, SavePlan, assemble, caller_times, save_layout
from ._solver.base import AbstractGradsolveSolver, opaque


class RecordOutput(eqx.Module):
    mesh: RecordedMesh
    ts: Array
    ys: list[Array]
    stats: dict
    result: diffrax.RESULTS
    direction: Array
    t_reached: Array
    layout: SaveLayout
    states: list[Array] | None
    checkpoint_every: int = eqx.field(static=True)
    segment_length: int = eqx.field(static=True)


def _clip_floor(t1):
    """The float 100 steps of `eqxi.prevbefore` below `t1`.

    Diffrax rounds a step ending within 100 ULPs of t1 to end at t1, so that no
    uselessly short last step is taken. It steps down with `eqxi.prevbefore`, which
    goes from any number that compares equal to 0 (zero, and subnormals under the
    CPU's denormals-are-zero) to `-tiny`, not to the next subnormal. Computed here
    on the floats' order as integers, in a few operations: the chain of 100 calls
    is ~2,000 scalar operations that every recording program traced and compiled.
    """
    return _steps_below(t1, 100)


def _steps_below(x, n: int):
    """`n` applications of `eqxi.prevbefore` to the finite float `x`."""
    finfo = jnp.finfo(x.dtype)
    int_type = jnp.dtype(f"int{finfo.bits}")
    bits = jax.lax.bitcast_convert_type(x, int_type)
    magnitude = bits & jnp.iinfo(int_type).max
    order = jnp.where(bits < 0, -magnitude, magnitude)  # monotone in x
    tiny = jax.lax.bitcast_convert_type(jnp.asarray(finfo.tiny, x.dtype), int_type)
    # From a normal positive number the chain reaches the largest subnormal after
    # `order - tiny + 1` steps; one more gives `-tiny`, then it steps down.
    to_subnormal = order - tiny + 1
    crossed = -tiny - (n - to_subnormal - 1)
    below = jnp.where(
        order >= tiny, jnp.where(n <= to_subnormal, order - n, crossed), order - n
    )
    below = jnp.where(jnp.abs(order) < tiny, -tiny - (n - 1), below)
    sign = jnp.where(below < 0, jnp.iinfo(int_type).min, 0).astype(int_type)
    return jax.lax.bitcast_convert_type(jnp.abs(below) | sign, x.dtype)


def record_loop(
    problem: LeafProblem,
    solver: AbstractGradsolveSolver,
    t0,
    t1,
    dt0,
    y0: list[Array],
    controller: diffrax.AbstractStepSizeController,
    plan: SavePlan,
    max_steps: int,
    keep_states: bool,
    has_jumps: bool,
    kernel: str = "xla",
) -> RecordOutput:
    """Integrate adaptively from `t0` to `t1` and record the accepted steps.

    The stepping logic is Diffrax's (`diffrax/_integrate.py::loop`): the same
    controller object is asked to accept or reject each step and to propose the next,
    steps ending within 100 ULPs of `t1` are clipped to `t1`, and NaN error estimates
    count as infinite. So the accepted steps are Diffrax's, to round-off.

    `plan.ts` is in internal time (`direction * t`). With `keep_states`, the state
    after every `checkpoint_spacing`-th accepted step is kept for the adjoint (see
    `_checkpoints.py`).

    `kernel` (`"auto"`, `"pallas"` or `"xla"`, see `_kernel_select.use_kernel`)
    chooses the fused Pallas kernel for the loop when the problem fits; it takes the
    same steps. Recordings that keep states for the adjoint always run on XLA.
    """
    # The inputs as the replay compiles them, whether the caller passes them as
    # constants or as arguments (see `opaque`).
    t0, t1, dt0, y0, args = opaque((t0, t1, dt0, y0, problem.args))
    problem = LeafProblem(f=problem.f, args=args, treedef=problem.treedef)
    direction = jnp.where(t0 < t1, 1, -1)
    ti0 = t0 * direction
    ti1 = t1 * direction
    dti0 = None if dt0 is None else dt0 * direction
    controller = controller.wrap(direction)

    # The controller sees the term exactly as Diffrax shows it to it: wrapped for the
    # direction of integration. (Diffrax's initial step selection treats a wrapped
    # term as a non-ODE term; using the same wrapper keeps `dt0=None` identical.)
    internal_term = WrapTerm(diffrax.ODETerm(problem.f), direction)
    error_order = solver.error_order(internal_term)
    tnext, controller_state = controller.init(
        internal_term,
        ti0,
        ti1,
        problem.tree(y0),
        dti0,
        problem.args,
        lambda terms, t, y, args: terms.vf(t, y, args),
        error_order,
    )
    tnext = jnp.minimum(tnext, ti1)
    clip_floor = _clip_floor(ti1)
    num_ts = 0 if plan.ts is None else len(plan.ts)

    # A small state is stepped as scalar components (see `_components.py`).
    representation = Representation(
        y0, problem, solver.representation, t0, solver.reads_elements(False)
    )
    vf = representation.field(problem)
    to_leaves = representation.merge
    y = representation.split(y0)
    norm = getattr(controller, "norm", None)
    step_controller = None
    if representation.layout is not None:
        sizes = tuple(math.prod(s) for s in representation.layout.shapes)
        step_controller = on_components(controller, sizes)
    if step_controller is not None:
        # A PIDController's error estimate computed on the components in the
        # operations of Diffrax's on the leaves (`_controller.py`), as the kernel and
        # the replay compute it.
        as_tree = list
    elif norm in NORMS:
        # These norms see only the elements, not the structure: hand them the
        # leaves as they are.
        step_controller = controller
        as_tree = tuple
    else:
        step_controller = controller
        as_tree = lambda comps: problem.tree(to_leaves(comps))
    lane = dict(
        ti0=ti0,
        ti1=ti1,
        direction=direction,
        clip_floor=clip_floor,
        tnext=tnext,
        cstate=controller_state,
        y=y,
    )
    fused = False
    if kernel_considered(kernel) and not keep_states:
        f = eqx.filter_closure_convert(problem.f, t0, problem.tree(y0), problem.args)
        dynamic = eqx.filter((f, problem.args), eqx.is_array)
        reason = kernel_unsupported(
            solver, controller, plan, representation.layout, dynamic
        )
        fused = use_kernel(kernel, reason)
    # The adjoint recomputes this many steps at a time from a kept state. (Decided
    # with or without `keep_states`: `_solve`'s primal and forward outputs agree.)
    segment = segment_length(problem, y0, t0)
    spacing = checkpoint_spacing(problem, segment, y0, max_steps, t0)
    if fused:
        every = spacing
        c = kernel_loop(
            problem,
            f,
            solver,
            controller,
            error_order,
            representation,
            lane,
            plan.ts,
            max_steps,
        )
        # The kernel writes internal times; the XLA loop writes the caller's.
        c["mesh_ts"] = direction * c["mesh_ts"]
    else:
        c, every = xla_loop(
            problem,
            solver,
            step_controller,
            error_order,
            vf,
            as_tree,
            t0,
            lane,
            plan,
            max_steps,
            keep_states,
            has_jumps,
            spacing,
            representation.carries_fsal(solver),
        )
    result = diffrax.RESULTS.where(
        (c["tprev"] < ti1) & (c["result"] == diffrax.RESULTS.successful),
        diffrax.RESULTS.max_steps_reached,
        c["result"],
    )
    num_accepted = c["num_accepted"]
    # A solve that stopped early pads with the last time it reached. (The branch is
    # taken only if some trajectory of the batch failed.)
    mesh_ts = jax.lax.cond(
        eqxi.unvmap_any(c["tprev"] < ti1),
        lambda ts: pad_after(ts, num_accepted),
        lambda ts: ts,
        c["mesh_ts"],
    )
    step_ends = direction * mesh_ts[1:]
    if num_ts > 0:
        # t0 == t1 takes no step: every requested save is the initial state.
        ts_values = [
            jnp.where(ti0 == ti1, jnp.broadcast_to(a, v.shape), v)
            for a, v in zip(y, c["ts_values"])
        ]
        ts_values = to_leaves(ts_values, 1)
    else:
        ts_values = None
    states = c.get("states")
    step_values = None
    if plan.steps:
        step_values = to_leaves([s[1:] for s in states], 1)
    ts_step = None
    if num_ts > 0 and "ts_steps" in c:
        # A value the loop did not save lies past the last step it reached (or
        # the solve took no step): where a search of the padded buffer puts it.
        saved = jnp.arange(num_ts) < c["ts_index"]
        unsaved = jnp.where(plan.ts <= c["tprev"], 0, max(max_steps - 1, 0))
        ts_step = jnp.where(saved, c["ts_steps"], unsaved)
    layout = save_layout(plan, step_ends, max_steps, ts_step)
    ts_out, ys_out = assemble(
        plan,
        layout,
        max_steps,
        num_accepted,
        ti0,
        step_ends,
        y0,
        ts_values,
        step_values,
        to_leaves(c["y"]),
    )
    if has_jumps:
        used = jnp.arange(max_steps) < num_accepted
        step_starts = jnp.where(used, direction * c["starts"], mesh_ts[-1])
        restarts = c["restarts"] & used
    else:
        step_starts = restarts = None
    rtol, atol, norm = _tolerances(controller)
    mesh = RecordedMesh(
        ts=mesh_ts,
        num_steps=num_accepted,
        step_starts=step_starts,
        restarts=restarts,
        rtol=rtol,
        atol=atol,
        result=result,
        t0=t0,
        t1=t1,
        norm=norm,
        solver_type=type(solver),
        state=StateStructure.of(y0, problem.treedef),
    )
    stats = dict(
        num_steps=c["num_steps"],
        num_accepted_steps=num_accepted,
        num_rejected_steps=c["num_rejected"],
        max_steps=max_steps,
    )
    return RecordOutput(
        mesh=mesh,
        ts=caller_times(direction, ts_out),
        ys=ys_out,
        stats=stats,
        result=result,
        direction=direction,
        # Where the solve stopped, in the caller's time: what a failure message
        # needs, without keeping the mesh buffer alive in a forward-only solve.
        t_reached=direction * c["tprev"],
        layout=layout,
        states=states if keep_states else None,
        checkpoint_every=every,
        segment_length=segment,
    )


def _tolerances(controller):
    """The tolerances and norm that a replay checks its error estimate against."""
    if isinstance(controller, diffrax.AbstractAdaptiveStepSizeController):
        rtol = jnp.asarray(controller.rtol)
        atol = jnp.asarray(controller.atol)
        return rtol, atol, controller.norm
    return None, None, None
