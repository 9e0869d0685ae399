"""Large ensembles: estimate the memory first, then record and replay in chunks.

A recording allocates `max_steps + 1` times per trajectory before it knows how many
steps it will take, and a reverse-mode replay keeps one state per step: for hundreds
of thousands of trajectories either can exceed the machine. These functions estimate
the bytes needed before allocating anything, and split the ensemble into chunks that
fit a budget. Trajectories are independent, so the chunked results are those of one
batch (the tests check bitwise equality).
"""

import math
import os

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from ._mesh import RecordedMesh
from ._replay import replay
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


def _chunk_size(batch: int, per_trajectory: int, budget: int | None, what: str) -> int:
    budget = default_budget() if budget is None else budget
    fits = budget // max(per_trajectory, 1)
    if fits < 1:
        raise ValueError(
            f"One trajectory's {what} needs about {per_trajectory:,} bytes, more than "
            f"the memory budget of {budget:,} bytes: lower max_steps, or raise "
            "memory_budget."
        )
    return max(1, min(batch, fits))


def _split(tree, batch: int, size: int):
    """`tree`'s leading axis padded (by repeating the last row) to whole chunks,
    reshaped to `(chunks, size, ...)`."""
    chunks = -(-batch // size)

    def split(x):
        x = jnp.asarray(x)
        pad = jnp.repeat(x[-1:], chunks * size - batch, axis=0)
        return jnp.concatenate([x, pad]).reshape((chunks, size) + x.shape[1:])

    return jtu.tree_map(split, tree)


@eqx.filter_jit
def _record_batch(terms, solver, t0, t1, dt0, y0, args, args_axes, steps, throw, kw):
    """`jax.vmap` of `record`, compiled once per shape and setting (a module-level
    function, so that repeated calls of `record_ensemble` reuse it)."""
    one = lambda y, a: record(
        terms, solver, t0, t1, dt0, y, a, max_steps=steps, throw=throw, **kw
    )
    return jax.vmap(one, in_axes=(0, args_axes))(y0, args)


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
    **kwargs,
) -> RecordedMesh:
    """Record an ensemble in chunks that fit a memory budget; return a trimmed mesh.

    Equivalent to `jax.vmap` of [`gradsolve.record`][] followed by `trim()` (the same
    mesh), but faster and smaller: the `(max_steps + 1)`-long buffers exist for one
    chunk at a time, and each chunk is first recorded with a buffer of 256 steps;
    only the trajectories that need more (or fail) are recorded again with
    `max_steps`.

    **Arguments:**

    As [`gradsolve.record`][], with `y0` (and `args` when `args_axes=0`) batched
    along a leading axis, and:

    - `memory_budget`: bytes the recording may use (default: half the available
        memory, see `available_memory`).
    - `chunk_size`: trajectories per chunk (default: as many as fit the budget).

    **Returns:**

    A batched, trimmed [`gradsolve.RecordedMesh`][].
    """
    batch = jtu.tree_leaves(y0)[0].shape[0]
    if chunk_size is None:
        per = estimate_memory(1, max_steps, y0)["record"]
        chunk_size = _chunk_size(batch, per, memory_budget, "recording")
    throw = kwargs.pop("throw", True)

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
    length = max(m.max_steps for m in meshes)
    meshes = [pad_steps(m, length) for m in meshes]
    return jtu.tree_map(lambda *xs: jnp.concatenate(xs), *meshes)


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
) -> Solution:
    """[`gradsolve.replay`][] of a batched mesh, in chunks sized for its gradient.

    The chunks run one after another (`lax.map`), each under `jax.checkpoint`, so
    reverse mode holds the per-step states of one chunk at a time. The values and
    gradients are those of `gs.replay` on the whole batch.

    **Arguments:**

    As [`gradsolve.replay`][], and:

    - `memory_budget`: bytes the gradient may use (default: half the available
        memory).
    - `chunk_size`: trajectories per chunk (default: as many as fit the budget).

    **Returns:**

    A [`gradsolve.Solution`][] as from `gs.replay`.
    """
    batch = mesh.ts.shape[0]
    if chunk_size is None:
        saves = max(1, len(saveat.subs.ts) if saveat.subs.ts is not None else 1)
        per = estimate_memory(1, mesh.max_steps, y0, saves=saves)["gradient"]
        chunk_size = _chunk_size(batch, per, memory_budget, "gradient")
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
