"""The discrete adjoint of the recorded steps, for `jax.grad` through `diffeqsolve`.

`gradsolve.diffeqsolve` learns the length of its mesh only at run time, so it cannot
replay it with one fixed-length scan without paying for `max_steps` steps. Its reverse
pass instead walks back over the accepted steps in segments of `length` steps (1 or
8, see `_checkpoints.py`; a `while_loop` of `ceil(num_steps / length)` iterations):
each segment is
recomputed from the state the recording kept at its start, as a fixed-length scan,
and pulled back with one `jax.vjp`. (A large state is kept less often, at the start
of blocks of segments: entering a block, the walk first recomputes the starts of
its segments forward.) This is the same derivative as differentiating
`gs.replay` (and as Diffrax's default adjoint): the exact discrete adjoint of the
accepted steps.
"""

import functools

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp

from ._component_field import args_as_elements
from ._mesh import RecordedMesh
from ._problem import LeafProblem
from ._representation import Representation
from ._saving import SaveLayout, SavePlan
from ._solver.base import AbstractGradsolveSolver
from ._solver.interpolation import normalised_time


# `ts` values whose cotangents one iteration of `save_cotangents` pulls back.
SAVE_WINDOW = 16


def is_float_array(x) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact)


def _along(mask, x):
    """`mask` (one entry per row of `x`) shaped to broadcast against `x`, whose
    rows may be arrays (a state not split into components)."""
    return mask.reshape(mask.shape + (1,) * (x.ndim - 1))


def _add(xs, ys):
    return [x + y for x, y in zip(xs, ys)]


def adjoint_loop(
    solver: AbstractGradsolveSolver,
    mesh: RecordedMesh,
    states: list,
    layout: SaveLayout,
    plan: SavePlan,
    ys_bar: list,
    diff,
    treedef,
    every: int,
    length: int,
):
    """Pull the cotangents of the saved values back to `diff = (y0, args, f)`.

    **Arguments:**

    - `mesh`: the recorded mesh of this trajectory.
    - `states`: the state after every `every`-th accepted step (`states[0] = y0`),
        as the steps hold it (see `_components.Representation`), with a leading
        axis.
    - `every`: the spacing of the checkpoints in `states`; it divides `length`, or
        is a multiple of it (a large state, see `_checkpoints.checkpoint_spacing`:
        the starts of the segments between two checkpoints are then recomputed
        forward, a block at a time, as the walk reaches them).
    - `length`: the steps per segment. Longer segments amortise the loop's
        per-iteration cost; every segment takes this many steps, so the last one
        wastes up to `length - 1` (skipped) steps.
    - `layout`, `plan`: where each saved value came from (see `_saving.py`).
    - `ys_bar`: the cotangents of the saved values (leaves, leading save axis).
    - `diff`: `(y0_leaves, args, f)`, the differentiable inputs.

    **Returns:**

    The cotangent of `diff`.
    """
    weights_fn = solver.interpolation_cls.weights
    ts = mesh.ts
    direction = jnp.where(ts[0] < ts[-1], 1, -1)
    num_steps = mesh.num_steps
    # The steps hold the state as `_record.py` did (components for a small state):
    # the loop carries and the step's vjp act on that; convert at the boundaries.
    y0_leaves, args, f = diff
    problem = LeafProblem(f=f, args=args, treedef=treedef)
    recorded = Representation(
        y0_leaves,
        problem,
        solver.representation,
        mesh.ts[0],
        solver.reads_elements(False),
    )
    representation = recorded
    walked = (solver.derivative_representation, solver.reads_elements(True))
    if walked != (solver.representation, solver.reads_elements(False)):
        # Walked back in the form the solver's steps differentiate fastest in,
        # from the states kept as the recording held them (steps recomputed in
        # another form equal the recorded ones to round-off).
        representation = Representation(
            y0_leaves,
            problem,
            solver.derivative_representation,
            mesh.ts[0],
            solver.reads_elements(True),
        )
        states = representation.split(recorded.merge(states, 1), 1)
    split, merge = representation.split, representation.merge

    # On components the field reads `args` element by element: those elements are
    # what the segments differentiate, so that their cotangents build up as one
    # array each, and are gathered into `args`' leaves once, at the end.
    if representation.layout is None:
        loop_args, rebuild = args, None
    else:
        loop_args, rebuild = args_as_elements(args)
    diff_dynamic, diff_static = eqx.partition((y0_leaves, loop_args, f), is_float_array)

    # The cotangents of the final state, of the step saves and of the `ts` saves.
    y_bar = split([jnp.zeros_like(x) for x in diff[0]])
    if layout.t1_slot is not None:
        y_bar = split([x[layout.t1_slot] for x in ys_bar])
    step_bar = ts_bar = None
    if layout.step_slot is not None:
        step_bar = split([x[layout.step_slot] for x in ys_bar], 1)
    if layout.ts_slot is not None:
        ts_bar = split([x[layout.ts_slot] for x in ys_bar], 1)
    diff_bar = jax.tree_util.tree_map(jnp.zeros_like, diff_dynamic)

    def step(y, dynamic, s, e):
        _, args, f = eqx.combine(dynamic, diff_static)
        if rebuild is None:
            vf = representation.field(LeafProblem(f=f, args=args, treedef=treedef))
        else:
            vf = representation.field(LeafProblem(f, None, treedef), rebuild(args))
        y1, _, dense, _ = solver.step_leaves(vf, s, e, direction, y, None)
        return y1, dense

    if ts_bar is not None:
        # The shapes of a step's dense-output data (stages of state-like leaves).
        dense_struct = jax.eval_shape(
            lambda y, d: step(y, d, ts[0], ts[-1])[1], y_bar, diff_dynamic
        )

    def segment_steps(first, count=length):
        """The mesh indices of the steps `[first, first + count)` (clipped into the
        mesh) and which of them were taken."""
        index = first + jnp.arange(count)
        return jnp.minimum(index, mesh.max_steps - 1), index < num_steps

    def segment_times(first, count=length):
        """The start and end (internal time) of the steps `[first, first + count)`
        and which of them were taken; steps not taken have length zero."""
        index, valid = segment_steps(first, count)
        # Gathered from the mesh directly: `mesh_steps` would first copy the whole
        # `(max_steps + 1)`-long buffer, once per gradient.
        e = direction * ts[index + 1]
        s = ts[index] if mesh.step_starts is None else mesh.step_starts[index]
        return jnp.where(valid, direction * s, e), e, valid

    def segment(y, dynamic, first, times=None):
        """Steps `[first, first + length)` from the state before step `first`
        (whose `segment_times` are `times` if given).

        Returns the state after them and the values they save. Steps past
        `num_steps` are skipped (zero-length, and their result discarded), so that
        every segment has the same static length.
        """
        s, e, valid = segment_times(first) if times is None else times

        @functools.partial(jax.checkpoint, prevent_cse=False)
        def body(y, x):
            s, e, ok = x
            y1, dense = step(y, dynamic, s, e)
            y1 = [jnp.where(ok, a, b) for a, b in zip(y1, y)]
            # Only what the saves need leaves the scan.
            return y1, (
                y if ts_bar is not None else None,
                y1 if ts_bar is not None or step_bar is not None else None,
                dense if ts_bar is not None else None,
            )

        y_end, (before, after, dense) = jax.lax.scan(body, y, (s, e, valid))
        saved = {}
        if step_bar is not None:
            saved["steps"] = after
        if ts_bar is not None:
            # The `ts` values are linear in each step's data: their cotangents
            # are pulled back to that data (`save_cotangents`), not through an
            # interpolation of every save time in every segment.
            saved["ts"] = (before, after, dense)
        return y_end, saved

    def save_cotangents(first):
        """The cotangents of the data `(before, after, dense)` of the steps
        `[first, first + length)` from the `ts` values that fall in them.

        Those values are a contiguous run of `plan.ts` (both it and the steps are
        sorted); they are taken `SAVE_WINDOW` at a time, so that a segment costs
        what its own saves cost, whatever the total number of saves."""
        s_all, e_all, _ = segment_times(first)
        end = jnp.minimum(first + length, num_steps)
        lo = jnp.searchsorted(layout.ts_step, first, side="left")
        hi = jnp.searchsorted(layout.ts_step, end, side="left")
        window = min(SAVE_WINDOW, plan.ts.shape[0])
        zeros = lambda xs: [jnp.zeros((length,) + x.shape, x.dtype) for x in xs]
        states = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in ts_bar]
        bars = (zeros(states), zeros(states), [zeros(stage) for stage in dense_struct])

        def add_window(carry):
            start, (before_bar, after_bar, dense_bar) = carry
            k = start + jnp.arange(window, dtype=start.dtype)
            ok = k < hi
            k = jnp.minimum(k, plan.ts.shape[0] - 1)
            local = jnp.clip(layout.ts_step[k] - first, 0, length - 1)
            theta = normalised_time(s_all[local], plan.ts[k], e_all[local])
            w_y0, w_y1, w_ks = jax.vmap(weights_fn)(jnp.where(ok, theta, 0))
            onehot = (local[:, None] == jnp.arange(length)[None]) & ok[:, None]

            def pull(bar, w):
                # bar[i] += sum over the window's saves in step i of w * ts_bar.
                out = []
                for acc, x in zip(bar, ts_bar):
                    v = x[k]
                    v = v if w is None else _along(w.astype(v.dtype), v) * v
                    out.append(acc + jnp.tensordot(onehot.T.astype(v.dtype), v, 1))
                return out

            before_bar = pull(before_bar, w_y0)
            after_bar = after_bar if w_y1 is None else pull(after_bar, w_y1)
            dense_bar = [
                d if w is None else pull(d, w) for d, w in zip(dense_bar, w_ks)
            ]
            return start + window, (before_bar, after_bar, dense_bar)

        _, bars = jax.lax.while_loop(lambda c: c[0] < hi, add_window, (lo, bars))
        return bars

    num_segments = (num_steps + length - 1) // length
    # States kept every `every` steps: a segment starts at one, or (`every` a
    # multiple of `length`, for a large state) inside a block of segments whose
    # starts are recomputed, forward, when the walk enters the block.
    per_block = max(every // length, 1)
    block_starts = [
        jnp.zeros((per_block,) + x.shape[1:], x.dtype) for x in states
    ] if per_block > 1 else []  # fmt: skip

    def recompute_block(block, need, times, starts):
        """The start of every segment of `block` (where `need`) from the state
        kept at the block's start: the block's segments taken forward over its
        step `times` (gathered outside: inside this branch and its loop, the
        mesh's whole time buffer would be copied)."""
        first = block * per_block
        count = jnp.where(need, jnp.minimum(per_block, num_segments - first), 0)

        def forward(carry):
            j, y, starts = carry
            starts = [x.at[j].set(v) for x, v in zip(starts, y)]
            own = [jax.lax.dynamic_slice_in_dim(x, j * length, length) for x in times]
            y, _ = segment(y, diff_dynamic, None, own)
            return j + 1, y, starts

        y = [x[block] for x in states]
        # Trajectories that stay in their block keep their starts (count 0).
        init = (jnp.zeros_like(count), y, starts)
        _, _, starts = jax.lax.while_loop(lambda c: c[0] < count, forward, init)
        return starts

    def segment_start(n, loaded, starts):
        """The state before segment `n`, and the block of starts held after it."""
        if per_block == 1:
            return [x[n * (length // every)] for x in states], loaded, starts
        block = n // per_block
        need = block != loaded
        starts = jax.lax.cond(
            eqxi.unvmap_any(need),
            recompute_block,
            lambda block, need, times, starts: starts,
            block,
            need,
            segment_times(block * every, every),
            starts,
        )
        start = [x[n % per_block] for x in starts]
        return start, jnp.where(need, block, loaded), starts

    def segment_back(carry):
        """Recompute one segment from its checkpoint and pull the cotangents of
        its end state and of its saved values back to its start."""
        n, y_bar, diff_bar, loaded, starts = carry
        first = n * length
        start, loaded, starts = segment_start(n, loaded, starts)
        _, vjp = jax.vjp(lambda y, d: segment(y, d, first), start, diff_dynamic)
        saved_bar = {}
        if step_bar is not None:
            index, valid = segment_steps(first)
            saved_bar["steps"] = [
                jnp.where(_along(valid, x), x[index], 0) for x in step_bar
            ]
        if ts_bar is not None:
            saved_bar["ts"] = save_cotangents(first)
        y_bar, d_bar = vjp((y_bar, saved_bar))
        diff_bar = jax.tree_util.tree_map(jnp.add, diff_bar, d_bar)
        return n - 1, y_bar, diff_bar, loaded, starts

    init = (num_segments - 1, y_bar, diff_bar, jnp.array(-1), block_starts)
    _, y_bar, diff_bar, _, _ = jax.lax.while_loop(
        lambda c: c[0] >= 0, segment_back, init
    )
    if ts_bar is not None:
        # t0 == t1 takes no step: every `ts` value is y0 itself.
        no_steps = num_steps == 0
        y_bar = _add(y_bar, [jnp.where(no_steps, x.sum(0), 0) for x in ts_bar])
    if plan.t0:
        y_bar = _add(y_bar, split([x[0] for x in ys_bar]))
    y0_bar, args_bar, f_bar = diff_bar
    if rebuild is not None:
        args_bar = _gather_elements(args, args_bar)
    return _add(y0_bar, merge(y_bar)), args_bar, f_bar


def _gather_elements(args, elements_bar):
    """The cotangent of `args` from that of its elements (`args_as_elements`)."""
    args_dynamic, args_static = eqx.partition(args, is_float_array)

    def elements(dynamic):
        flat, _ = args_as_elements(eqx.combine(dynamic, args_static))
        return eqx.filter(flat, is_float_array)

    _, pull = jax.vjp(elements, args_dynamic)
    (args_bar,) = pull(elements_bar)
    return args_bar
