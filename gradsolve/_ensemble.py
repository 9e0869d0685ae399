"""Large ensembles: estimate the memory first, then record and replay in chunks.

A recording allocates `max_steps + 1` times per trajectory before it knows how many
steps it will take, and a reverse-mode replay keeps one state per step: for hundreds
of thousands of trajectories either can exceed the machine. These functions estimate
the bytes needed before allocating anything, and split the ensemble into chunks that
fit a budget. Trajectories are independent, so the chunked results are those of one
batch (the tests check bitwise equality).
"""

import math
import operator
import os

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from ._mesh import RecordedMesh
from ._mesh_checks import check_complete, rows_fault
from ._replay import replay
from ._sharding import Split, full_axes, pad_rows, resolve_split, run_sharded
from ._short_buffer import pad_steps, record_with_short_buffer
from ._solution import Solution
from ._solve import record
from ._stale import check_stale


# Copies of the `(max_steps + 1,)` time buffer alive at once in a recording (the
# loop's buffer, its padded result, the trimmed copy).
_RECORD_COPIES = 3
# Stages of the largest explicit solver plus states live in one step.
_STEP_STATES = 12


def available_memory() -> int:
    """Bytes free on the default device: the accelerator's free memory, else the
    host's `MemAvailable`."""
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def default_budget() -> int:
    """Half the available memory: room for the caller's own arrays and copies."""
    return available_memory() // 2


def _state_bytes(y0) -> int:
    """Bytes of one trajectory's state (`y0` without its batch axis)."""
    return sum(
        math.prod(jnp.shape(x)[1:]) * jnp.result_type(x).itemsize
        for x in jtu.tree_leaves(y0)
    )


def estimate_memory(batch: int, max_steps: int, y0, *, saves: int = 1) -> dict:
    """Estimate the bytes that recording, replaying and differentiating an ensemble
    will need at their peak, before allocating anything.

    **Arguments:**

    - `batch`: the number of trajectories.
    - `max_steps`: the steps per trajectory: `max_steps` for a recording, the
        trimmed `mesh.max_steps` for a replay.
    - `y0`: the batched initial state (only shapes and dtypes are read).
    - `saves`: the number of saved values per trajectory.

    **Returns:**

    A dict of byte counts `record`, `replay` (forward) and `gradient` (reverse mode
    through the replay, which keeps one state per step).
    """
    state = _state_bytes(y0)
    time = 8
    steps = max_steps + 1
    record_bytes = batch * (_RECORD_COPIES * steps * time + _STEP_STATES * state)
    replay_bytes = batch * (steps * time + (saves + _STEP_STATES) * state)
    gradient_bytes = replay_bytes + batch * steps * (2 * state + time)
    return dict(record=record_bytes, replay=replay_bytes, gradient=gradient_bytes)


def _chunk_size(
    batch: int, per_trajectory: int, budget: int | None, what: str, fix: str
) -> int:
    budget = default_budget() if budget is None else budget
    fits = budget // max(per_trajectory, 1)
    if fits < 1:
        raise ValueError(
            f"One trajectory's {what} needs about {per_trajectory:,} bytes, more than "
            f"the memory budget of {budget:,} bytes: {fix}, or raise memory_budget."
        )
    return max(1, min(batch, fits))


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


def _split(tree, batch: int, size: int):
    """`tree`'s leading axis padded (by repeating the last row) to whole chunks,
    reshaped to `(chunks, size, ...)`."""
    chunks = -(-batch // size)

    def split(x):
        x = pad_rows(jnp.asarray(x), chunks * size - batch)
        return x.reshape((chunks, size) + x.shape[1:])

    return jtu.tree_map(split, tree)


@eqx.filter_jit
def _record_batch(terms, solver, t0, t1, dt0, y0, args, args_axes, steps, throw, kw):
    """`jax.vmap` of `record`, compiled once per shape and setting (a module-level
    function, so that repeated calls of `record_ensemble` reuse it)."""
    one = lambda y, a: record(
        terms, solver, t0, t1, dt0, y, a, max_steps=steps, throw=throw, **kw
    )
    return jax.vmap(one, in_axes=(0, args_axes))(y0, args)


def _record_one(terms, solver, t0, t1, dt0, y0, args, max_steps, kwargs):
    return record(terms, solver, t0, t1, dt0, y0, args, max_steps=max_steps, **kwargs)


def _device_budget(memory_budget, split: Split | None):
    """The bytes one device may use: CPU devices of one process share its memory."""
    if memory_budget is not None or split is None:
        return memory_budget
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
    with `max_steps`. On several devices (see `sharding`) every device records its
    own trajectories, chunk by chunk, and steps independently of the others; the mesh
    stays split across the devices.

    **Arguments:**

    As [`gradsolve.record`][], with `y0` (and `args` when `args_axes=0`) batched
    along a leading axis, and:

    - `memory_budget`: bytes the recording may use on each device (default: half
        the available memory, see `available_memory`, shared by a host's CPU
        devices).
    - `chunk_size`: trajectories per chunk on each device (default: as many as fit
        the budget).
    - `sharding`: the devices to split the ensemble over (see
        [`gradsolve.sharded_vmap`][]): a `jax.sharding.NamedSharding` of the
        leading axis, a `jax.sharding.Mesh`, or `None` to follow `y0`'s and `args`'
        own placement.

    **Returns:**

    A batched, trimmed [`gradsolve.RecordedMesh`][], split like the ensemble.
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
    if chunk_size is None:
        per = estimate_memory(1, max_steps, y0)["record"]
        budget = _device_budget(memory_budget, split)
        chunk_size = _chunk_size(
            local_batch, per, budget, "recording", "lower max_steps"
        )
    throw = kwargs.pop("throw", True)
    if split is None:

        def record_batch(steps, throw):
            return lambda y, a: _record_batch(
                terms, solver, t0, t1, dt0, y, a, args_axes, steps, throw, kwargs
            )

        meshes = []
        for start in range(0, max(batch, 1), chunk_size):
            take = lambda x: x[start : start + chunk_size]
            chunk_args = args if args_axes is None else jtu.tree_map(take, args)
            meshes.append(
                record_with_short_buffer(
                    record_batch,
                    jtu.tree_map(take, y0),
                    chunk_args,
                    args_axes,
                    max_steps,
                    throw,
                )
            )
        return jtu.tree_map(lambda *xs: jnp.concatenate(xs), *_pad_steps(meshes))
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
        saves = max(1, len(saveat.subs.ts) if saveat.subs.ts is not None else 1)
        per = estimate_memory(1, mesh.max_steps, y0, saves=saves)["gradient"]
        budget = _device_budget(memory_budget, split)
        fix = (
            f"replay over a shorter mesh (it has {mesh.max_steps} steps; "
            "mesh.trim() removes padding), save fewer times"
        )
        chunk_size = _chunk_size(-(-batch // devices), per, budget, "gradient", fix)
    # Checked here once for a concrete mesh; else by every chunk's replay.
    partial = allow_partial or check_complete(mesh)
    fixed = (terms, solver, saveat, args_axes, stale, partial, chunk_size)
    if split is None:
        return _replay_chunks(*fixed, *inputs)
    axes = (None,) * len(fixed) + in_axes
    return run_sharded(_replay_chunks, fixed + inputs, axes, split)


def _replay_chunks(
    terms, solver, saveat, args_axes, stale, partial, chunk_size, mesh, y0, args
):
    """`replay_ensemble` on one device's trajectories."""
    batch = mesh.ts.shape[0]
    if batch == 0 or chunk_size >= batch:
        return replay(
            mesh,
            terms,
            solver,
            y0,
            args,
            saveat=saveat,
            args_axes=args_axes,
            stale=stale,
            allow_partial=partial,
        )
    split_args = args if args_axes is None else _split(args, batch, chunk_size)

    @jax.checkpoint
    def one(chunk):
        m, y, a = chunk
        if args_axes is None:
            a = args
        sol = replay(
            m,
            terms,
            solver,
            y,
            a,
            saveat=saveat,
            args_axes=args_axes,
            stale="ignore",
            allow_partial=partial,
        )
        return sol.ts, sol.ys, sol.stats.get("max_error_ratio")

    chunks = (
        _split(mesh, batch, chunk_size),
        _split(y0, batch, chunk_size),
        None if args_axes is None else split_args,
    )
    ts, ys, ratio = jax.lax.map(one, chunks)
    merge = lambda x: None if x is None else x.reshape((-1,) + x.shape[2:])[:batch]
    ts, ys, ratio = merge(ts), jtu.tree_map(merge, ys), merge(ratio)
    ts, ys = check_stale((ts, ys), ratio, stale)
    stats = dict(
        num_steps=mesh.num_steps,
        num_accepted_steps=mesh.num_steps,
        num_rejected_steps=jnp.zeros_like(mesh.num_steps),
        max_steps=mesh.max_steps,
    )
    if ratio is not None:
        stats["max_error_ratio"] = ratio
    return Solution(
        t0=mesh.ts[:, 0],
        t1=mesh.ts[:, -1],
        ts=ts,
        ys=ys,
        stats=stats,
        result=mesh.result,
        mesh=mesh,
    )
