"""The discrete adjoint of the recorded steps, for `jax.grad` through `diffeqsolve`.

`gradsolve.diffeqsolve` learns the length of its mesh only at run time, so it cannot
replay it with one fixed-length scan without paying for `max_steps` steps. Its reverse
pass instead walks back over the accepted steps in segments of `SEGMENT_LENGTH`
(a `while_loop` of `ceil(num_steps / SEGMENT_LENGTH)` iterations): each segment is
recomputed from the state the recording kept at its start, as a fixed-length scan,
and pulled back with one `jax.vjp`. This is the same derivative as differentiating
`gs.replay` (and as Diffrax's default adjoint): the exact discrete adjoint of the
accepted steps.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp

from ._components import Representation
from ._mesh import RecordedMesh
from ._problem import LeafProblem
from ._record import CHECKPOINT_EVERY
from ._saving import SaveLayout, SavePlan
from ._solver.base import AbstractGradsolveSolver
from ._solver.interpolation import combine, normalised_time


# Steps per segment of the reverse pass. Longer segments amortise the loop's
# per-iteration cost; every segment takes this many steps, so the last one wastes
# up to `SEGMENT_LENGTH - 1` (skipped) steps. The recording keeps one state per
# segment.
SEGMENT_LENGTH = CHECKPOINT_EVERY


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
):
    """Pull the cotangents of the saved values back to `diff = (y0, args, f)`.

    **Arguments:**

    - `mesh`: the recorded mesh of this trajectory.
    - `states`: the state after every `every`-th accepted step (`states[0] = y0`),
        as the steps hold it (see `_components.Representation`), with a leading
        axis.
    - `every`: the spacing of the checkpoints in `states`; it divides
        `SEGMENT_LENGTH`.
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
    length = SEGMENT_LENGTH
    # The steps hold the state as `_record.py` did (components for a small state):
    # the loop carries and the step's vjp act on that; convert at the boundaries.
    y0_leaves, args, f = diff
    representation = Representation(
        y0_leaves,
        LeafProblem(f=f, args=args, treedef=treedef),
        solver.representation,
        mesh.ts[0],
    )
    split, merge = representation.split, representation.merge

    diff_dynamic, diff_static = eqx.partition(diff, is_float_array)

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
        vf = representation.field(LeafProblem(f=f, args=args, treedef=treedef))
        y1, _, dense, _ = solver.step_leaves(vf, s, e, direction, y, None)
        return y1, dense

    def segment_steps(first):
        """The mesh indices of the steps `[first, first + length)` (clipped into the
        mesh) and which of them were taken."""
        index = first + jnp.arange(length)
        return jnp.minimum(index, mesh.max_steps - 1), index < num_steps

    def segment(y, dynamic, first):
        """Steps `[first, first + length)` from the state before step `first`.

        Returns the state after them and the values they save. Steps past
        `num_steps` are skipped (zero-length, and their result discarded), so that
        every segment has the same static length.
        """
        index, valid = segment_steps(first)
        # Gathered from the mesh directly: `mesh_steps` would first copy the whole
        # `(max_steps + 1)`-long buffer, once per gradient.
        e = direction * ts[index + 1]
        s = ts[index] if mesh.step_starts is None else mesh.step_starts[index]
        s = jnp.where(valid, direction * s, e)

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
            local = layout.ts_step - first
            inside = (local >= 0) & (local < length) & (layout.ts_step < num_steps)
            local = jnp.clip(local, 0, length - 1)
            theta = normalised_time(s[local], plan.ts, e[local])
            theta = jnp.where(inside, theta, 0)
            values = jax.vmap(lambda th, a, b, k: combine(weights_fn(th), a, b, k))(
                theta,
                [x[local] for x in before],
                [x[local] for x in after],
                [[x[local] for x in stage] for stage in dense],
            )
            saved["ts"] = [jnp.where(_along(inside, v), v, 0) for v in values]
        return y_end, saved

    def segment_back(carry):
        """Recompute one segment from its checkpoint and pull the cotangents of
        its end state and of its saved values back to its start."""
        n, y_bar, diff_bar = carry
        first = n * length
        start = [x[n * (length // every)] for x in states]
        _, vjp = jax.vjp(lambda y, d: segment(y, d, first), start, diff_dynamic)
        saved_bar = {}
        if step_bar is not None:
            index, valid = segment_steps(first)
            saved_bar["steps"] = [
                jnp.where(_along(valid, x), x[index], 0) for x in step_bar
            ]
        if ts_bar is not None:
            saved_bar["ts"] = ts_bar
        y_bar, d_bar = vjp((y_bar, saved_bar))
        diff_bar = jax.tree_util.tree_map(jnp.add, diff_bar, d_bar)
        return n - 1, y_bar, diff_bar

    num_segments = (num_steps + length - 1) // length
    _, y_bar, diff_bar = jax.lax.while_loop(
        lambda c: c[0] >= 0, segment_back, (num_segments - 1, y_bar, diff_bar)
    )
    if ts_bar is not None:
        # t0 == t1 takes no step: every `ts` value is y0 itself.
        no_steps = num_steps == 0
        y_bar = _add(y_bar, [jnp.where(no_steps, x.sum(0), 0) for x in ts_bar])
    if plan.t0:
        y_bar = _add(y_bar, split([x[0] for x in ys_bar]))
    y0_bar, args_bar, f_bar = diff_bar
    return _add(y0_bar, merge(y_bar)), args_bar, f_bar
