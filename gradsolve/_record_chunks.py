"""Recording an ensemble on one device in chunks, within a memory budget.

Each chunk is recorded with a buffer of `SHORT_BUFFER` steps, and the trajectories
that outgrow it (or fail) again with `max_steps`, in parts of at most `parts`
trajectories: no `(max_steps + 1)`-long buffer exists for more trajectories at
once. Every recording is trimmed and kept as a piece with the rows it fills; the
mesh is assembled from the pieces at the end, in place, so that memory holds the
pieces and the mesh (about twice the mesh) and no merged copy of a chunk.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._memory import RUNTIME_BYTES
from ._mesh import RecordedMesh
from ._mesh_checks import failed_rows
from ._short_buffer import SHORT_BUFFER, _bucket, pad_steps


def record_in_chunks(
    record_batch,
    y0,
    args,
    args_axes,
    max_steps: int,
    throw: bool,
    chunk_size: int,
    parts: int,
    budget: int | None = None,
) -> RecordedMesh:
    """The trimmed mesh of the ensemble `y0`, `args`, recorded in chunks.

    **Arguments:**

    - `record_batch`: `record_batch(max_steps, throw)` returns a function
        `(y0, args) -> RecordedMesh` that records a batch (a jitted `vmap` of
        [`gradsolve.record`][]).
    - `y0`, `args`, `args_axes`: the ensemble, as for `jax.vmap`.
    - `max_steps`, `throw`: as for `gs.record`.
    - `chunk_size`: trajectories recorded at once with the short buffer.
    - `parts`: trajectories recorded at once with `max_steps`.
    - `budget`: if given, bytes the call may use: an error as soon as the mesh
        returned, extrapolated from the chunks recorded so far, would not fit.
    """
    batch = jtu.tree_leaves(y0)[0].shape[0]
    if batch == 0:
        return record_batch(max_steps, throw)(y0, args).trim()
    short = min(max_steps, SHORT_BUFFER)
    part = 1 << (max(parts, 1).bit_length() - 1)  # powers of two split evenly
    pieces = _Pieces(batch, budget)
    for start in range(0, batch, chunk_size):
        rows = np.arange(start, min(start + chunk_size, batch))
        take = lambda x: x[start : start + chunk_size]
        whole = rows.size == batch  # one chunk: no copy of the inputs
        chunk = (y0, args) if whole else _take(take, y0, args, args_axes)
        mesh = record_batch(short, throw and short == max_steps)(*chunk).trim()
        pieces.add(rows, mesh, chunk_rows=rows.size)
        if short == max_steps:
            continue
        failed = rows[failed_rows(mesh)]
        del mesh, chunk
        for first in range(0, failed.size, part):
            group = failed[first : first + part]
            # Padded (with its last trajectory) to a power of two: re-recordings
            # of a few trajectories reuse a handful of compiled shapes.
            size = _bucket(group.size, rows.size)
            group = np.concatenate([group, np.full(size - group.size, group[-1])])
            index = jnp.asarray(group)
            again = _take(lambda x: jnp.asarray(x)[index], y0, args, args_axes)
            pieces.add(group, record_batch(max_steps, throw)(*again).trim())
    return pieces.assemble()


def _take(take, y0, args, args_axes):
    return jtu.tree_map(take, y0), args if args_axes is None else jtu.tree_map(
        take, args
    )


def _row_bytes(mesh: RecordedMesh, length: int) -> float:
    """Bytes of one trajectory of `mesh` padded to `length` steps."""
    rows = max(mesh.ts.shape[0], 1)
    total = sum(x.nbytes for x in jtu.tree_leaves(mesh))
    per_step = sum(
        x.nbytes / (rows * x.shape[1])
        for x in (mesh.ts, mesh.step_starts, mesh.restarts)
        if x is not None
    )
    return total / rows + per_step * (length - mesh.max_steps)


class _Pieces:
    """The trimmed recordings of an ensemble with the rows they fill (later pieces
    overwrite earlier ones), assembled into one mesh at the end."""

    def __init__(self, batch: int, budget: int | None):
        self.batch, self.budget = batch, budget
        self.pieces, self.bytes, self.rows = [], 0, 0

    def add(self, rows, mesh: RecordedMesh, chunk_rows: int = 0):
        self.pieces.append((rows, mesh))
        self.bytes += sum(x.nbytes for x in jtu.tree_leaves(mesh))
        self.rows += chunk_rows
        if self.budget is None:
            return
        longest = max(m.max_steps for _, m in self.pieces)
        mesh_bytes = int(self.batch * _row_bytes(mesh, longest))
        held = int(self.bytes * self.batch / max(self.rows, 1))
        if 2 * max(mesh_bytes, held) > self.budget - RUNTIME_BYTES:
            raise ValueError(
                f"The mesh of {self.batch:,} trajectories takes about "
                f"{mesh_bytes:,} bytes ({longest} steps each after trimming), and "
                "assembling it from the chunks' recordings holds those as well "
                f"(about {held:,} bytes): more than memory_budget={self.budget:,} "
                "bytes allows. Raise memory_budget to at least "
                f"{2 * max(mesh_bytes, held) + RUNTIME_BYTES:,}, or record the "
                "ensemble in parts (gs.record_ensemble on slices of y0)."
            )

    def assemble(self) -> RecordedMesh:
        rows, mesh = self.pieces[0]
        if len(self.pieces) == 1 and rows.size == self.batch:
            return mesh
        length = max(m.max_steps for _, m in self.pieces)
        out = _empty(mesh, self.batch, length)
        del mesh
        # A piece is written in blocks of rows: each block is padded to the mesh's
        # steps on the way, a copy that should stay small beside the mesh.
        block = max(64, -(-self.batch // 16))
        while self.pieces:  # each piece is released once written
            rows, mesh = self.pieces.pop(0)
            for start in range(0, rows.size, block):
                part = jtu.tree_map(lambda x: x[start : start + block], mesh)
                index = jnp.asarray(rows[start : start + block])
                # Waited for: a buffer still in use by a queued write is not
                # donated but copied.
                out = jax.block_until_ready(_write(out, part, index))
        return out


_FIELDS = lambda m: (m.ts, m.step_starts, m.restarts)


def _empty(mesh: RecordedMesh, batch: int, length: int) -> RecordedMesh:
    """A mesh like `mesh` with `batch` trajectories of `length` steps, of zeros."""
    steps = (length + 1, length, length)
    rest = eqx.tree_at(_FIELDS, mesh, (None, None, None), is_leaf=_is_none)
    zeros = lambda x, *shape: jnp.zeros((batch,) + (shape or x.shape[1:]), x.dtype)
    grown = tuple(
        None if x is None else zeros(x, n) for x, n in zip(_FIELDS(mesh), steps)
    )
    return eqx.tree_at(_FIELDS, jtu.tree_map(zeros, rest), grown, is_leaf=_is_none)


def _is_none(x):
    return x is None


@functools.partial(jax.jit, donate_argnums=0)
def _write(out: RecordedMesh, piece: RecordedMesh, rows) -> RecordedMesh:
    """`out` with `piece` (padded to its steps) in `rows`, updated in place (its
    buffers are donated)."""
    piece = pad_steps(piece, out.max_steps)
    return jtu.tree_map(lambda o, p: o.at[rows].set(p), out, piece)
