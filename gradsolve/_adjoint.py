"""The discrete adjoint of the recorded steps, for `jax.grad` through `diffeqsolve`.

`gradsolve.diffeqsolve` cannot replay a mesh whose length it only learns at run time
with a fixed-length scan without paying for `max_steps` steps. Instead its reverse pass
walks back over the accepted steps only (a `while_loop` of `num_steps` iterations): for
each step it recomputes the stages from the stored state and applies `jax.vjp` of that
one step. This is the same derivative as differentiating `gs.replay` (and as
Diffrax's default adjoint): the exact discrete adjoint of the accepted steps.
"""

import equinox as eqx
import jax
import jax.numpy as jnp

from ._components import Representation
from ._mesh import RecordedMesh
from ._problem import LeafProblem
from ._replay import mesh_steps
from ._saving import SaveLayout, SavePlan
from ._solver.base import AbstractGradsolveSolver
from ._solver.interpolation import normalised_time


def is_float_array(x) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact)


def _add(xs, ys):
    return [x + y for x, y in zip(xs, ys)]


def _scale(weight, leaves):
    return [weight * x for x in leaves]


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
    - `every`: the spacing of the checkpoints in `states`.
    - `layout`, `plan`: where each saved value came from (see `_saving.py`).
    - `ys_bar`: the cotangents of the saved values (leaves, leading save axis).
    - `diff`: `(y0_leaves, args, f)`, the differentiable inputs.

    **Returns:**

    The cotangent of `diff`.
    """
    weights_fn = solver.interpolation_cls.weights
    direction, starts, ends = mesh_steps(mesh)
    num_steps = mesh.num_steps
    # The steps hold the state as `_record.py` did (components for a small state):
    # the loop carries and the step's vjp act on that; convert at the boundaries.
    representation = Representation(diff[0])
    split, merge = representation.split, representation.merge
    zeros = split([jnp.zeros_like(x) for x in diff[0]])

    diff_dynamic, diff_static = eqx.partition(diff, is_float_array)

    def step(y, dynamic, s, e):
        _, args, f = eqx.combine(dynamic, diff_static)
        vf = representation.field(LeafProblem(f=f, args=args, treedef=treedef))
        y1, _, dense, _ = solver.step_leaves(vf, s, e, direction, y, None)
        return y1, dense

    y_bar = zeros
    if layout.t1_slot is not None:
        y_bar = split([x[layout.t1_slot] for x in ys_bar])
    step_bar = (
        None if layout.step_slot is None else [x[layout.step_slot] for x in ys_bar]
    )
    ts_bar = None if layout.ts_slot is None else [x[layout.ts_slot] for x in ys_bar]
    if step_bar is not None:
        step_bar = split(step_bar, 1)
    if ts_bar is not None:
        ts_bar = split(ts_bar, 1)
    diff_bar = jax.tree_util.tree_map(jnp.zeros_like, diff_dynamic)

    def interpolation_bar(n, s, e, num_dense):
        """Cotangents of (y_n, y_{n+1}, dense data) from the `ts` saves in step n."""
        lo = jnp.searchsorted(layout.ts_step, n, side="left")
        hi = jnp.searchsorted(layout.ts_step, n, side="right")

        def body(j, acc):
            a_bar, b_bar, k_bar = acc
            inside = (j >= lo) & (j < hi)
            g = [jnp.where(inside, x[j], 0) for x in ts_bar]
            w_y0, w_y1, w_ks = weights_fn(normalised_time(s, plan.ts[j], e))
            a_bar = _add(a_bar, g if w_y0 is None else _scale(w_y0, g))
            if w_y1 is not None:
                b_bar = _add(b_bar, _scale(w_y1, g))
            k_bar = [
                kb if w is None else _add(kb, _scale(w, g))
                for kb, w in zip(k_bar, w_ks)
            ]
            return a_bar, b_bar, k_bar

        def cond(carry):
            return carry[0] < hi

        def loop_body(carry):
            j, acc = carry
            return j + 1, body(j, acc)

        init = (zeros, zeros, [zeros] * num_dense)
        _, acc = jax.lax.while_loop(cond, loop_body, (lo, init))
        return acc

    def step_back(n, y_n, y_bar, diff_bar):
        """Pull `y_bar` (of the state after step n) back over step n."""
        s, e = starts[n], ends[n]
        if step_bar is not None:
            y_bar = _add(y_bar, [x[n] for x in step_bar])
        (_, dense), vjp = jax.vjp(lambda y, d: step(y, d, s, e), y_n, diff_dynamic)
        if ts_bar is not None:
            a_bar, b_bar, k_bar = interpolation_bar(n, s, e, len(dense))
            y_in_bar, d_bar = vjp((_add(y_bar, b_bar), k_bar))
            y_in_bar = _add(y_in_bar, a_bar)
        else:
            k_bar = [zeros] * len(dense)
            y_in_bar, d_bar = vjp((y_bar, k_bar))
        diff_bar = jax.tree_util.tree_map(jnp.add, diff_bar, d_bar)
        return y_in_bar, diff_bar

    def segment_body(carry):
        """Steps `[n0, n0 + every)`: recompute their start states from the segment's
        checkpoint, then walk back over them."""
        segment, y_bar, diff_bar = carry
        n0 = segment * every
        start = [x[segment] for x in states]
        if every == 1:
            local = [x[None] for x in start]
        else:
            index = jnp.minimum(n0 + jnp.arange(every), mesh.max_steps - 1)

            def forward(y, i):
                y1, _ = step(y, diff_dynamic, starts[i], ends[i])
                return y1, y

            _, local = jax.lax.scan(forward, start, index)

        def cond(c):
            return c[0] >= n0

        def body(c):
            n, y_bar, diff_bar = c
            y_n = [x[n - n0] for x in local]
            return (n - 1, *step_back(n, y_n, y_bar, diff_bar))

        last = jnp.minimum(n0 + every, num_steps) - 1
        _, y_bar, diff_bar = jax.lax.while_loop(cond, body, (last, y_bar, diff_bar))
        return segment - 1, y_bar, diff_bar

    num_segments = (num_steps + every - 1) // every
    _, y_bar, diff_bar = jax.lax.while_loop(
        lambda c: c[0] >= 0, segment_body, (num_segments - 1, y_bar, diff_bar)
    )
    if ts_bar is not None:
        # t0 == t1 takes no step: every `ts` value is y0 itself.
        no_steps = num_steps == 0
        y_bar = _add(y_bar, [jnp.where(no_steps, x.sum(0), 0) for x in ts_bar])
    if plan.t0:
        y_bar = _add(y_bar, split([x[0] for x in ys_bar]))
    y0_bar, args_bar, f_bar = diff_bar
    return _add(y0_bar, merge(y_bar)), args_bar, f_bar
