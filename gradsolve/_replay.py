"""The fixed-step replay of a recorded mesh: a differentiable `lax.scan`."""

import functools
import math

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from diffrax._saveat import save_y as _save_y  # the default SaveAt fn

from ._component_field import batched_like_inputs
from ._controller import NORMS, scaled_error as component_scaled_error
from ._mesh import RecordedMesh
from ._mesh_checks import check_batch, check_complete, check_state, error_if_incomplete
from ._problem import LeafProblem, prepare
from ._recorded_steps import fill_after, scan_recorded
from ._representation import Representation
from ._saving import (
    SavePlan,
    assemble,
    before_steps,
    caller_times,
    save_layout,
    values_at_saves,
)
from ._sharding import resolve_split, run_sharded
from ._solution import Solution
from ._solver.base import AbstractGradsolveSolver, opaque, runtime_zero
from ._solver.interpolation import combine, normalised_time
from ._solver.rosenbrock import AbstractRosenbrock
from ._stale import check_stale, roundoff_margin, scaled_error


def mesh_steps(mesh: RecordedMesh):
    """Direction and the internal (increasing) start and end time of every step."""
    ts = mesh.ts
    direction = jnp.where(ts[0] < ts[-1], 1, -1)
    starts = ts[:-1] if mesh.step_starts is None else mesh.step_starts
    return direction, direction * starts, direction * ts[1:]


# Compiled as one program, as the recording is: an operation run eagerly (here the
# first stage before the scan) is rounded without the fused multiply-adds that XLA
# uses in a compiled program, and the replay would then not reproduce the record.
@eqx.filter_jit
def replay_one(
    mesh: RecordedMesh,
    problem: LeafProblem,
    solver: AbstractGradsolveSolver,
    y0: list,
    plan: SavePlan,
    forward_only: bool = False,
):
    """Replay one trajectory. Returns `(ts, ys_leaves, max_error_ratio)`.

    With `forward_only` (the caller differentiates it in forward mode only and
    needs no error ratio: it is `None`), a replay on components with an explicit
    solver runs only the recorded steps (`_recorded_steps.py`), not the buffer.
    """
    mesh = mesh.cut()  # A mesh trimmed without a copy is cut here, in the program.
    # `y0`, `args` and the initial time as the recording compiled them, whether the
    # caller passes them as constants or as arguments (see `opaque`).
    y0, args, t_first = opaque((y0, problem.args, mesh.ts[0]))
    problem = LeafProblem(f=problem.f, args=args, treedef=problem.treedef)
    direction, starts, ends = mesh_steps(mesh)
    max_steps = mesh.max_steps
    # (A loop keeps what the scan's dead-code elimination would have dropped.)
    adaptive = mesh.rtol is not None and not forward_only
    keep_states = plan.ts is not None or plan.steps

    # A small state is stepped as a list of scalar components (see `_components.py`).
    representation = Representation(
        y0, problem, solver.representation, t_first, solver.reads_elements(True)
    )
    if representation.layout is not None and not forward_only:
        # The field reads its parameters element by element: each trajectory of a
        # batch gets its own elements, whose cotangents it accumulates alone (see
        # `batched_like`; a Lorenz gradient over 1,024 trajectories with respect to
        # shared parameters took 27 ms with them shared, 11 ms so). Forward mode
        # has no cotangents to sum.
        f, args = batched_like_inputs(
            problem.f, args, t_first, problem.tree(y0), [*y0, t_first]
        )
        problem = LeafProblem(f=f, args=args, treedef=problem.treedef)
    vf = representation.field(problem)
    to_comps, to_leaves = representation.split, representation.merge
    # `SaveAt(ts)` on components interpolates from the stages of the save times'
    # steps computed again after the scan; in array form the scan keeps them.
    # (Not for Rosenbrock solvers: their recomputed steps, a Jacobian and linear
    # solves each, made the forward-mode Jacobian of a Robertson replay compile
    # for minutes instead of 4 s.)
    recompute_stages = representation.layout is not None and not isinstance(
        solver, AbstractRosenbrock
    )
    keep_ks = plan.ts is not None and not recompute_stages

    sizes = None
    if mesh.norm in NORMS and representation.layout is not None:
        # The ratio of each step is computed as the recording computed it when it
        # accepted the step (`_controller.scaled_error`: same operations, same
        # order), so a fresh mesh replays with the ratios it was accepted on, each
        # below 1, bit for bit.
        sizes = tuple(math.prod(shape) for shape in representation.layout.shapes)
        as_tree = None
    elif mesh.norm in NORMS:
        # These norms see only the elements: hand them the leaves as they are.
        as_tree = tuple
    else:
        as_tree = lambda comps: problem.tree(to_leaves(comps))

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def body(carry, x):
        y, f0, worst = carry
        if mesh.restarts is None:
            s, e = x
        else:
            s, e, restart = x
            if f0 is not None:
                fresh = vf(direction * s, y)
                f0 = [jnp.where(restart, a, b) for a, b in zip(fresh, f0)]
        y1, y_error, ks, f1 = solver.step_leaves(vf, s, e, direction, y, f0)
        f1 = None if f0 is None else f1
        ratio = None
        if adaptive and sizes is not None:
            y_error = [jnp.where(jnp.isnan(x), jnp.inf, x) for x in y_error]
            ratio = component_scaled_error(
                mesh.norm, mesh.rtol, mesh.atol, y, y1, y_error, sizes, runtime_zero(s)
            )
        elif adaptive:
            ratio = scaled_error(
                mesh.norm, mesh.rtol, mesh.atol, as_tree, y, y1, y_error
            )
        if ratio is not None:
            # The largest ratio so far, carried: no per-step buffer of ratios
            # reduced after the loop. A NaN ratio (the replay blew up) counts as
            # infinite.
            ratio = jax.lax.stop_gradient(ratio)
            worst = jnp.maximum(worst, jnp.where(jnp.isnan(ratio), jnp.inf, ratio))
        out = (y1 if keep_states else None, ks if keep_ks else None)
        return (y1, f1, worst), out

    xs = (starts, ends) if mesh.restarts is None else (starts, ends, mesh.restarts)
    y0_comps = to_comps(y0)
    f_init = vf(t_first, y0_comps) if representation.carries_fsal(solver) else None
    # (A Python zero: the scan gives it the ratio's dtype.)
    init = (y0_comps, f_init, 0.0 if adaptive else None)
    if forward_only and recompute_stages:
        (y_final, _, worst), (states, ks) = scan_recorded(
            body, init, xs, mesh.num_steps
        )
        if states is not None:
            states = fill_after(states, mesh.num_steps, y_final)
    else:
        (y_final, _, worst), (states, ks) = jax.lax.scan(body, init, xs)
    y_final = to_leaves(y_final)
    state_comps = states
    if states is not None:
        states = to_leaves(states, 1)
    if ks is not None:
        ks = [to_leaves(k, 1) for k in ks]
    layout = save_layout(plan, ends, max_steps)
    ts_values = None
    if plan.ts is not None:
        n = layout.ts_step
        theta = normalised_time(starts[n], plan.ts, ends[n])
        if recompute_stages:
            values = values_at_saves(
                solver, vf, starts[n], ends[n], direction, theta,
                before_steps(y0_comps, state_comps, n),
                [s[n] for s in state_comps], forward_only,
            )  # fmt: skip
            ts_values = to_leaves(values, 1)
        else:
            before, after = before_steps(y0, states, n), [s[n] for s in states]
            stage_ks = [[leaf[n] for leaf in stage] for stage in ks]
            weights = solver.interpolation_cls.weights
            ts_values = jax.vmap(lambda th, a, b, k: combine(weights(th), a, b, k))(
                theta, before, after, stage_ks
            )
    ts_out, ys_out = assemble(
        plan,
        layout,
        max_steps,
        mesh.num_steps,
        starts[0],
        ends,
        y0,
        ts_values,
        states,
        y_final,
    )
    max_ratio = None
    if adaptive:
        max_ratio = worst / (1 + roundoff_margin(jnp.result_type(*y0), mesh.rtol))
    return caller_times(direction, ts_out), ys_out, max_ratio


def replay_stats(mesh: RecordedMesh, max_ratio) -> dict:
    """A replay's `Solution.stats`: the mesh's steps, all accepted, and the largest
    error ratio (none if `max_ratio` is `None`)."""
    stats = dict(
        num_steps=mesh.num_steps,
        num_accepted_steps=mesh.num_steps,
        num_rejected_steps=jnp.zeros_like(mesh.num_steps),
        max_steps=mesh.max_steps,
    )
    if max_ratio is not None:
        stats["max_error_ratio"] = max_ratio
    return stats


def replay(
    mesh: RecordedMesh,
    terms: diffrax.ODETerm,
    solver: AbstractGradsolveSolver,
    y0,
    args=None,
    *,
    saveat: diffrax.SaveAt = diffrax.SaveAt(t1=True),
    allow_other_solver: bool = False,
    args_axes=None,
    stale: str = "warn",
    sharding=None,
    allow_partial: bool = False,
) -> Solution:
    """Solve again over a recorded mesh, with fixed steps; differentiable.

    The replay takes exactly the steps in `mesh` (no error control, no rejected steps,
    no `while_loop`): a fixed-length `lax.scan`. So it can be differentiated in reverse
    and forward mode to any order (`jax.grad`, `jax.jvp`, `jax.jacfwd`,
    `jax.hessian`). Its reverse-mode derivative is the exact discrete adjoint of those
    steps, which is the derivative `diffrax.diffeqsolve` returns by default over the
    same steps. Each step is checkpointed: the backward pass stores one state per
    step and recomputes the stages.

    **Arguments:**

    - `mesh`: a [`gradsolve.RecordedMesh`][], e.g. from [`gradsolve.record`][]. A
        batched mesh (leading batch axis, not under `vmap`) replays the whole ensemble:
        `y0` then has the same leading axis.
    - `terms`: a `diffrax.ODETerm`.
    - `solver`: the solver that recorded the mesh.
    - `y0`: initial state (any PyTree of arrays).
    - `args`: any PyTree passed to the vector field.
    - `saveat`: a `diffrax.SaveAt` with any of `t0`, `t1`, `ts`, `steps`.
    - `allow_other_solver`: replay with a solver other than the recording one (the
        mesh was chosen for the recording solver's error estimate).
    - `args_axes`: for a batched mesh, the `jax.vmap` `in_axes` of `args` (default
        `None`: shared by every trajectory; `0` maps every leaf over its first axis).
    - `stale`: what to do when the mesh is stale for these inputs
        (`stats["max_error_ratio"] > 1`): `"warn"` (a `gs.StaleMeshWarning`),
        `"error"` (an error, also inside `jit`) or `"ignore"`. The check costs no
        host round trip unless the mesh is stale.
    - `sharding`: for a batched mesh, the devices to split the ensemble over (see
        [`gradsolve.sharded_vmap`][]): a `jax.sharding.NamedSharding` of the leading
        axis or a `jax.sharding.Mesh`. By default a mesh, `y0` or `args` placed on
        several devices (`jax.device_put`) is replayed where it lies: every device
        replays, checks and differentiates its own trajectories, and the results stay
        split. Inside `jax.jit` pass it explicitly unless the mesh is a constant (or
        the device mesh has Explicit axes); otherwise XLA partitions the replay
        itself, with a few scalar all-reduces for the input and staleness checks.
    - `allow_partial`: replay a mesh whose recording failed (`mesh.result`, e.g.
        `max_steps_reached` with `throw=False`) over the part it recorded; it then
        stops where the recording did, and `sol.result` is the recording's. By
        default such a mesh is an error (inside `jit` too).

    `y0` must have the structure, shapes and dtypes of the state the mesh was
    recorded for (`mesh.state`; per trajectory for a batched mesh): a mesh fits
    only its own problem.

    **Returns:**

    A [`gradsolve.Solution`][]; `stats["max_error_ratio"] > 1` says the mesh has gone
    stale for these inputs (the recording tolerances are no longer met): record again.
    The ratio is the largest over the steps of the embedded error estimate against
    the tolerances, computed as the recording computed it to accept each step, and
    divided by `1 + eps / rtol` (the round-off of the error estimate, see
    `roundoff_margin`): a mesh replayed with the inputs it was recorded at reads
    `<= 1`.
    """
    if not isinstance(mesh, RecordedMesh):
        hint = " (a solution: pass its .mesh)" if isinstance(mesh, Solution) else ""
        raise TypeError(
            f"gs.replay's first argument must be a gs.RecordedMesh{hint}, from "
            f"gs.record, gs.record_ensemble or gs.load_mesh; got {type(mesh).__name__}."
        )
    if not isinstance(solver, AbstractGradsolveSolver):
        raise TypeError(
            "gs.replay needs a gradsolve solver (gs.Tsit5(), gs.Dopri5(), "
            f"gs.Rodas5(), gs.Rodas5P()); got "
            f"{type(solver).__name__}. Use gs.diffeqsolve, which falls back to "
            "diffrax.diffeqsolve, for other solvers."
        )
    if mesh.solver_type is not type(solver) and not allow_other_solver:
        raise ValueError(
            f"This mesh was recorded with {mesh.solver_type.__name__} but is replayed "
            f"with {type(solver).__name__}. Replay with "
            f"gs.{mesh.solver_type.__name__}(), or pass allow_other_solver=True if "
            "this is intended."
        )
    if not isinstance(terms, diffrax.ODETerm):
        raise TypeError(f"gs.replay needs a diffrax.ODETerm; got {type(terms)}.")
    if mesh.is_batched:
        check_batch(mesh, y0, args, args_axes)
        # Checked here once for a concrete mesh; else by every trajectory's replay.
        partial = allow_partial or check_complete(mesh)
        split = resolve_split(
            sharding, (mesh, y0, args), (0, 0, args_axes), "gs.replay"
        )
        if split is None or mesh.ts.shape[0] == 0:
            sol = _replay_batched(
                mesh, terms, solver, y0, args, saveat, args_axes, partial
            )
            return _checked(sol, stale)
        # Each device replays and checks its own trajectories: the staleness check's
        # reductions stay on the device too.
        inputs = (terms, solver, saveat, args_axes, stale, partial, mesh, y0, args)
        axes = (None,) * 6 + (0, 0, args_axes)
        return run_sharded(_replay_checked, inputs, axes, split)
    if sharding is not None:
        raise ValueError(
            "sharding= splits an ensemble, but this mesh holds one trajectory: "
            "replay a batched mesh (from jax.vmap of gs.record), or drop sharding=."
        )
    if mesh.ts.ndim != 1:
        raise ValueError(f"mesh.ts must have one or two axes; got {mesh.ts.shape}.")
    _check_saveat(saveat)
    # Structure and shapes first: a y0 of another problem would fail in the vector
    # field, with a less telling message.
    check_state(mesh, *jtu.tree_flatten(y0), dtypes=False)
    prepared = prepare(terms, mesh.ts[0], mesh.ts[-1], None, y0, args, saveat)
    check_state(mesh, prepared.y0, prepared.problem.treedef)
    partial = allow_partial or check_complete(mesh)
    ts, ys, max_ratio = replay_one(
        mesh, prepared.problem, solver, prepared.y0, prepared.plan
    )
    stats = replay_stats(mesh, max_ratio)
    treedef = prepared.problem.treedef
    sol = Solution(
        t0=prepared.t0,
        t1=prepared.t1,
        ts=ts,
        ys=jtu.tree_unflatten(treedef, ys),
        stats=stats,
        result=diffrax.RESULTS.where(
            mesh.result == diffrax.RESULTS.successful,
            diffrax.RESULTS.successful,
            mesh.result,
        ),
        mesh=mesh,
    )
    return _checked(sol, stale, None if partial else mesh)


def replay_values(mesh: RecordedMesh, terms, solver, y0, args, ts, forward_only):
    """The values at `ts` of one trajectory's replay, unchecked (a failed
    recording is replayed over the part it recorded, a stale mesh as it is), for
    callers that differentiate it in forward mode only when `forward_only`
    (`gs.fit`'s Jacobian blocks)."""
    prepared = prepare(
        terms, mesh.ts[0], mesh.ts[-1], None, y0, args, diffrax.SaveAt(ts=ts)
    )
    check_state(mesh, prepared.y0, prepared.problem.treedef)
    _, ys, _ = replay_one(
        mesh, prepared.problem, solver, prepared.y0, prepared.plan, forward_only
    )
    return jtu.tree_unflatten(prepared.problem.treedef, ys)


def _checked(sol: Solution, stale: str, unchecked_mesh=None) -> Solution:
    """`sol` with the staleness check, and the failed-recording check of a traced
    mesh (`unchecked_mesh`), on its outputs."""
    ts, ys = check_stale((sol.ts, sol.ys), sol.stats.get("max_error_ratio"), stale)
    if unchecked_mesh is not None:
        ts, ys = error_if_incomplete((ts, ys), unchecked_mesh)
    return eqx.tree_at(lambda s: (s.ts, s.ys), sol, (ts, ys), is_leaf=_is_none)


def _is_none(x):
    return x is None


def _check_saveat(saveat: diffrax.SaveAt):
    sub = saveat.subs
    if saveat.dense or not isinstance(sub, diffrax.SubSaveAt) or sub.fn is not _save_y:
        raise ValueError(
            "gs.replay supports SaveAt(t0=..., t1=..., ts=..., steps=True). For "
            "dense output, SaveAt(fn=...) or nested SubSaveAt, use gs.diffeqsolve (it "
            "falls back to diffrax.diffeqsolve), or apply fn to the saved ys."
        )
    if sub.steps not in (0, 1, False, True):
        raise ValueError("gs.replay supports SaveAt(steps=True) but not steps=n > 1.")


def _replay_checked(terms, solver, saveat, args_axes, stale, partial, mesh, y0, args):
    sol = _replay_batched(mesh, terms, solver, y0, args, saveat, args_axes, partial)
    return _checked(sol, stale)


def _replay_batched(mesh, terms, solver, y0, args, saveat, args_axes, partial):
    def one(m, y, a):
        return replay(
            m,
            terms,
            solver,
            y,
            a,
            saveat=saveat,
            allow_other_solver=True,
            stale="ignore",
            allow_partial=partial,
        )

    return jax.vmap(one, in_axes=(0, 0, args_axes))(mesh, y0, args)
