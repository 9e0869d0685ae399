"""Record an ensemble with a short mesh buffer first, and again with the full one
only for the trajectories that outgrew it.

A recording allocates its `(max_steps + 1)`-long time buffer per trajectory before it
knows how many steps it will take, and filling it costs more than the steps
themselves when `max_steps` is far above the steps taken (the default 4096 against
the ~100 of a typical trajectory). Most trajectories fit a buffer of
`SHORT_BUFFER` steps; those that do not (their result is `max_steps_reached`, or any
other failure, so that the full recording reports it) are recorded again with
`max_steps`. `max_steps` bounds the steps only, never the steps chosen, so every
trajectory's mesh is the one a single recording with `max_steps` gives.
"""

from collections.abc import Callable

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._mesh import RecordedMesh, trimmed
from ._mesh_checks import failed_rows


# Steps (accepted and rejected) of the first recording's buffer: room for most
# trajectories of small ODEs at tight tolerances (a few hundred steps), and filled
# 8 times faster than the default `max_steps = 4096`.
SHORT_BUFFER = 512

# Bytes of a mesh's step arrays below which it is trimmed without a copy (see
# `RecordedMesh.trim`): a few dozen trajectories' short buffers, for which the cut
# (a compiled call) costs a third of a record + gradient.
UNCUT_MESH = 2**20


def trim_small(mesh: RecordedMesh) -> RecordedMesh:
    """`mesh.trim()`, without a copy if its step arrays take under `UNCUT_MESH`."""
    arrays = (mesh.ts, mesh.step_starts, mesh.restarts)
    size = sum(x.nbytes for x in arrays if x is not None)
    return trimmed(mesh, copy=size > UNCUT_MESH)


def _bucket(count: int, batch: int) -> int:
    """`count` rounded up to a power of two (at most `batch`): re-recordings of a
    few trajectories reuse a handful of compiled shapes."""
    return min(batch, 1 << max(count - 1, 0).bit_length())


def record_with_short_buffer(
    record_batch: Callable[[int, bool], Callable],
    y0,
    args,
    args_axes,
    max_steps: int,
    throw: bool,
) -> RecordedMesh:
    """Record a batch, first with a buffer of `SHORT_BUFFER` steps.

    **Arguments:**

    - `record_batch`: `record_batch(max_steps, throw)` returns a function
        `(y0, args) -> RecordedMesh` that records a batch (a jitted `vmap` of
        [`gradsolve.record`][]).
    - `y0`, `args`, `args_axes`: the batch, as for `jax.vmap`.
    - `max_steps`: the most steps of one trajectory.
    - `throw`: whether a trajectory that fails with `max_steps` raises.

    **Returns:**

    The batched mesh, trimmed.
    """
    short = min(max_steps, SHORT_BUFFER)
    if short == max_steps:
        return trim_small(record_batch(max_steps, throw)(y0, args))
    mesh = trim_small(record_batch(short, False)(y0, args))
    failed = failed_rows(mesh)
    if failed.size == 0:
        return mesh
    batch = mesh.ts.shape[0]
    index = np.concatenate(
        [failed, np.full(_bucket(failed.size, batch) - failed.size, failed[-1])]
    )
    take = lambda x: jnp.asarray(x)[index]
    again = record_batch(max_steps, throw)(
        jtu.tree_map(take, y0),
        args if args_axes is None else jtu.tree_map(take, args),
    ).trim()
    return _merge(mesh, again, jnp.asarray(failed))


def pad_steps(mesh: RecordedMesh, length: int) -> RecordedMesh:
    """A batched mesh with `length` steps: more zero-length steps at the end."""
    mesh = mesh.cut()
    extra = length - mesh.max_steps

    def grow(x):
        if x is None or extra == 0:
            return x
        last = x[:, -1:] if x.dtype != jnp.bool_ else jnp.zeros_like(x[:, -1:])
        return jnp.concatenate([x, jnp.repeat(last, extra, axis=1)], axis=1)

    fields = lambda m: (m.ts, m.step_starts, m.restarts)
    new = tuple(grow(x) for x in fields(mesh))
    return eqx.tree_at(fields, mesh, new, is_leaf=lambda x: x is None)


@eqx.filter_jit
def _merge(mesh: RecordedMesh, again: RecordedMesh, rows) -> RecordedMesh:
    """`mesh` with its trajectories `rows` replaced by the first rows of `again`
    (one compiled call: a handful of eager updates would cost more at small sizes)."""
    length = max(mesh.max_steps, again.max_steps)
    mesh, again = pad_steps(mesh, length), pad_steps(again, length)
    n = rows.shape[0]
    return jtu.tree_map(lambda a, b: a.at[rows].set(b[:n]), mesh, again)
