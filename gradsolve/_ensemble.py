"""Large ensembles: estimate the memory first, then record and replay in chunks.

A recording allocates `max_steps + 1` times per trajectory before it knows how many
steps it will take, and a reverse-mode replay keeps one state per step: for hundreds
of thousands of trajectories either can exceed the machine. These functions estimate
the bytes needed before allocating anything, and split the ensemble into chunks that
fit a budget. Trajectories are independent, so the chunked results are those of one
batch (the tests check bitwise equality).
"""

import operator

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from ._batch_record import batch_recorder
from ._memory import (
    available_memory as available_memory,
    default_budget as default_budget,
    estimate_memory as estimate_memory,
    fit_chunk,
    record_footprint,
)
from ._mesh import RecordedMesh
from ._mesh_checks import check_complete, rows_fault
from ._record_chunks import record_in_chunks
from ._replay_chunks import replay_chunks, replay_chunks_footprint, replay_compiled
from ._sharding import Split, full_axes, pad_rows, resolve_split, run_sharded
from ._short_buffer import (
    SHORT_BUFFER,
    pad_steps,
    record_with_short_buffer,
    trim_small,
)
from ._solution import Solution
from ._solve import record


def _check_count(value, name: str, meaning: str, default: str | None = None) -> None:
    """`value` is a positive integer (or `None` where there is a `default`)."""
    if value is None and default is not None:
        return
    try:
        if not isinstance(value, bool) and operator.index(value) >= 1:
            return
    except TypeError:
        pass
    otherwise = "" if default is None else f", or None for {default}"
    raise ValueError(
        f"{name} must be a positive integer ({meaning}){otherwise}; got {value!r}."
    )


def _check_sizes(memory_budget, chunk_size) -> None:
    _check_count(memory_budget, "memory_budget", "bytes", "half the available memory")
    _check_count(
        chunk_size,
        "chunk_size",
        "trajectories per chunk on each device",
        "as many as fit memory_budget",
    )


# Bytes below which an ensemble is recorded at once with its full `max_steps` buffer
# (a few trajectories at the default `max_steps`).
SMALL_RECORDING = 2**20

# Bytes below which (and below a quarter of the default budget) an ensemble is
# recorded in one chunk, short buffer first, without the bookkeeping of chunks
# (footprints, pieces, their assembly): with it, 64 Lorenz trajectories took 1.1 ms
# to record, without it 0.9 ms.
MODEST_RECORDING = 2**26

# Bytes below which a modest recording goes ahead without reading the available
# memory (a file read, ~0.1-0.2 ms, a tenth of a 64-trajectory recording).
UNBUDGETED_RECORDING = 2**24


def _record_one(terms, solver, t0, t1, dt0, y0, args, max_steps, kwargs):
    return record(terms, solver, t0, t1, dt0, y0, args, max_steps=max_steps, **kwargs)


def _device_budget(memory_budget, split: Split | None):
    """The bytes one device may use: CPU devices of one process share its memory."""
    if memory_budget is not None:
        return memory_budget
    if split is None:
        return default_budget()
    if jax.devices()[0].platform != "cpu":
        return default_budget()
    if not isinstance(split.mesh, jax.sharding.Mesh):  # abstract: count them all
        return default_budget() // split.size
    devices = split.mesh.devices.flat
    here = [d for d in devices if d.process_index == jax.process_index()]
    return default_budget() // max(len(here), 1)


def _place(tree, in_axes, batch: int, split: Split):
    """The mapped leaves padded to whole shards and placed on the split's devices."""
    extra = -batch % split.size
    sharding = split.sharding()
    axes = full_axes(in_axes, tree)

    def place(axis, x):
        if axis != 0 or not eqx.is_array(x):
            return x
        return jax.device_put(pad_rows(jnp.asarray(x), extra) if extra else x, sharding)

    return jtu.tree_map(place, axes, tree, is_leaf=lambda x: x is None)


@eqx.filter_jit
def _device_rows(tree, in_axes, split: Split, start: int, size: int):
    """Rows `[start, start + size)` of every device's shard, still on that device."""

    def take(axis, x):
        if axis != 0 or not eqx.is_array(x):
            return x
        x = x.reshape((split.size, -1) + x.shape[1:])[:, start : start + size]
        return jax.lax.with_sharding_constraint(
            x.reshape((-1,) + x.shape[2:]), split.sharding()
        )

    return jtu.tree_map(take, full_axes(in_axes, tree), tree, is_leaf=_is_none)


@eqx.filter_jit
def _join_device_rows(chunks, split: Split):
    """The inverse of `_device_rows` over all chunks: each device's rows in order."""

    def join(*xs):
        parts = [x.reshape((split.size, -1) + x.shape[1:]) for x in xs]
        x = jnp.concatenate(parts, axis=1)
        return jax.lax.with_sharding_constraint(
            x.reshape((-1,) + x.shape[2:]), split.sharding()
        )

    return jtu.tree_map(join, *chunks)


def record_ensemble(
    terms,
    solver,
    t0,
    t1,
    dt0,
    y0,
    args=None,
    *,
    args_axes=None,
    max_steps: int = 4096,
    memory_budget: int | None = None,
    chunk_size: int | None = None,
    sharding=None,
    **kwargs,
) -> RecordedMesh:
    """Record an ensemble in chunks that fit a memory budget; return a trimmed mesh.

    Equivalent to `jax.vmap` of [`gradsolve.record`][] followed by `trim()` (the same
    mesh), but faster and smaller: the `(max_steps + 1)`-long buffers exist for one
    chunk at a time, and on one device each chunk is first recorded with a buffer of
    512 steps; only the trajectories that need more (or fail) are recorded again
    with `max_steps`. (A small ensemble, whose full buffers take under 1 MiB, is
    recorded at once with `max_steps`; one whose full buffers take under 64 MiB, in
    one chunk.) On several devices (see `sharding`) every
    device records its own trajectories, chunk by chunk, and steps independently of
    the others; the mesh stays split across the devices.

    **Arguments:**

    As [`gradsolve.record`][], with `y0` (and `args` when `args_axes=0`) batched
    along a leading axis, and:

    - `memory_budget`: bytes the recording may use on each device on top of its
        inputs, the mesh returned included (default: half the available memory,
        see `available_memory`, shared by a host's CPU devices). Half goes to the
        chunk being recorded, half to the mesh, which is assembled from the
        chunks' meshes and so held twice meanwhile: a mesh larger than that is an
        error as soon as the chunks recorded show it.
    - `chunk_size`: trajectories per chunk on each device (default: as many as fit
        the budget).
    - `sharding`: the devices to split the ensemble over (see
        [`gradsolve.sharded_vmap`][]): a `jax.sharding.NamedSharding` of the
        leading axis, a `jax.sharding.Mesh`, or `None` to follow `y0`'s and `args`'
        own placement.

    **Returns:**

    A batched, trimmed [`gradsolve.RecordedMesh`][], split like the ensemble. One
    whose step arrays take under 1 MiB is trimmed without a copy (see
    [`gradsolve.RecordedMesh.trim`][]: it keeps its buffers, and every replay
    cuts them in its own program).
    """
    _check_count(max_steps, "max_steps", "the most steps of one trajectory")
    _check_sizes(memory_budget, chunk_size)
    batch, fault = rows_fault(y0, "y0", None)
    if fault is not None:
        raise ValueError(
            f"{fault}: gs.record_ensemble needs one initial state per trajectory, "
            "along the first axis of every leaf of y0."
        )
    if args_axes == 0:
        _, fault = rows_fault(args, "args", batch)
        if fault is not None:
            raise ValueError(
                f"{fault}, where args_axes=0 needs {batch} rows (one per trajectory "
                "of y0) on every leaf: pass one set of args per trajectory, or "
                "args_axes=None to share them."
            )
    split = resolve_split(sharding, (y0, args), (0, args_axes), "gs.record_ensemble")
    if batch == 0:
        split = None
    devices = 1 if split is None else split.size
    local_batch = -(-batch // devices)
    throw = kwargs.pop("throw", True)
    own_args = None if args_axes is None else args  # per trajectory, if any

    def record_batch(steps, throw):
        return batch_recorder(
            terms, solver, t0, t1, dt0, args_axes, steps, throw, kwargs
        )

    if split is None and chunk_size is None and memory_budget is None and batch > 0:
        full = record_footprint(max_steps, y0, solver, own_args).bytes(batch)
        if full <= SMALL_RECORDING:
            # Recorded at once with the full buffer: filling it costs less than the
            # bookkeeping of a short buffer first (and of a memory budget).
            return trim_small(record_batch(max_steps, throw)(y0, args))
        if full <= MODEST_RECORDING and (
            full <= UNBUDGETED_RECORDING or full <= default_budget() // 4
        ):
            # One chunk, even if every trajectory needs the full buffer: no pieces
            # to assemble, no budget to watch.
            return record_with_short_buffer(
                record_batch, y0, args, args_axes, max_steps, throw
            )
    budget, parts = None, chunk_size
    if chunk_size is None:
        # Half the budget for the chunk being recorded, half for the mesh returned
        # (assembled from the chunks' meshes, which it holds twice meanwhile).
        budget = _device_budget(memory_budget, split)
        fit = lambda steps: fit_chunk(
            local_batch,
            record_footprint(steps, y0, solver, own_args),
            budget,
            "recording",
            "lower max_steps",
            share=0.5,
        )
        # On one device chunks are recorded with a short buffer first, and the
        # trajectories that need more steps again, `parts` at a time.
        parts = fit(max_steps)
        chunk_size = parts if split is not None else fit(min(max_steps, SHORT_BUFFER))
    if split is None:
        chunks = (chunk_size, parts, budget)
        return record_in_chunks(
            record_batch, y0, args, args_axes, max_steps, throw, *chunks
        )
    kwargs = dict(kwargs, throw=throw)
    # Chunks are taken within every device's shard, so no trajectory moves.
    inputs = _place((y0, args), (0, args_axes), batch, split)
    fixed = (terms, solver, t0, t1, dt0)
    axes = (None,) * 5 + (0, args_axes, None, None)
    meshes = []
    for start in range(0, local_batch, chunk_size):
        y, a = _device_rows(inputs, (0, args_axes), split, start, chunk_size)
        chunk = fixed + (y, a, max_steps, kwargs)
        mesh = run_sharded(_record_one, chunk, axes, split, vmap=True)
        meshes.append(mesh.trim())
    mesh = _join_device_rows(_pad_steps(meshes), split)
    if devices * local_batch != batch:
        # The padding trajectories go; what remains cannot be split evenly.
        mesh = jtu.tree_map(lambda x: x[:batch], mesh)
    return mesh


def _pad_steps(meshes):
    """Meshes padded to the longest one's steps: more zero-length steps at the end."""
    length = max(m.max_steps for m in meshes)
    return [pad_steps(m, length) for m in meshes]


def _is_none(x):
    return x is None


def replay_ensemble(
    mesh: RecordedMesh,
    terms,
    solver,
    y0,
    args=None,
    *,
    saveat: diffrax.SaveAt = diffrax.SaveAt(t1=True),
    args_axes=None,
    stale: str = "warn",
    memory_budget: int | None = None,
    chunk_size: int | None = None,
    sharding=None,
    allow_partial: bool = False,
) -> Solution:
    """[`gradsolve.replay`][] of a batched mesh, in chunks sized for its gradient.

    The chunks run one after another (`lax.map`), each under `jax.checkpoint`, so
    reverse mode holds the per-step states of one chunk at a time. The values and
    gradients are those of `gs.replay` on the whole batch. On several devices every
    device replays its own trajectories in its own chunks.

    **Arguments:**

    As [`gradsolve.replay`][], and:

    - `memory_budget`: bytes the gradient may use on each device (default: half the
        available memory, shared by a host's CPU devices).
    - `chunk_size`: trajectories per chunk on each device (default: as many as fit
        the budget).
    - `sharding`: as for [`gradsolve.record_ensemble`][]; by default the mesh's,
        `y0`'s and `args`' own placement.
    - `allow_partial`: as for [`gradsolve.replay`][]: replay trajectories whose
        recording failed over the part they recorded (else an error).

    **Returns:**

    A [`gradsolve.Solution`][] as from `gs.replay`, split like the ensemble.
    """
    if not isinstance(mesh, RecordedMesh) or not mesh.is_batched:
        raise ValueError(
            "gs.replay_ensemble needs a batched mesh (one row per trajectory, from "
            "gs.record_ensemble or jax.vmap of gs.record); replay a single "
            "trajectory's mesh with gs.replay."
        )
    _check_sizes(memory_budget, chunk_size)
    batch = mesh.ts.shape[0]
    inputs = (mesh, y0, args)
    in_axes = (0, 0, args_axes)
    split = resolve_split(sharding, inputs, in_axes, "gs.replay_ensemble")
    if batch == 0:
        split = None
    devices = 1 if split is None else split.size
    if chunk_size is None:
        # Sized for the gradient, which needs more than the replay it runs.
        need = replay_chunks_footprint(mesh, y0, solver, args, args_axes, saveat)
        budget = _device_budget(memory_budget, split)
        fix = (
            f"replay over a shorter mesh (it has {mesh.max_steps} steps; "
            "mesh.trim() removes padding), save fewer times"
        )
        local = -(-batch // devices)
        chunk_size = fit_chunk(local, need, budget, "gradient", fix)
    # Checked here once for a concrete mesh; else by every chunk's replay.
    partial = allow_partial or check_complete(mesh)
    fixed = (terms, solver, saveat, args_axes, stale, partial, chunk_size)
    if split is None:
        sol = replay_compiled(*fixed, *inputs)
        return eqx.tree_at(lambda s: s.mesh, sol, mesh, is_leaf=_is_none)
    axes = (None,) * len(fixed) + in_axes
    return run_sharded(replay_chunks, fixed + inputs, axes, split)
