"""Replaying an ensemble on one device in chunks, within a memory budget.

Chunk `k` replays rows `[k * chunk_size, (k + 1) * chunk_size)` of the mesh, sliced
where they lie, in a `lax.map` whose body is checkpointed: the reverse pass keeps
one chunk's states at a time.
"""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from ._memory import replay_footprint
from ._replay import replay, replay_stats
from ._solution import Solution
from ._stale import check_stale


def replay_chunks_footprint(mesh, y0, solver, args, args_axes, saveat):
    """The gradient's `Footprint` for these replay arguments."""
    sub = saveat.subs if isinstance(saveat.subs, diffrax.SubSaveAt) else None
    if sub is None:  # gs.replay says what it supports
        return replay_footprint(mesh.max_steps, y0, solver, gradient=True)
    times = 0 if sub.ts is None else len(sub.ts)
    saves = times + bool(sub.t0) + bool(sub.t1) + (mesh.max_steps if sub.steps else 0)
    return replay_footprint(
        mesh.max_steps,
        y0,
        solver,
        None if args_axes is None else args,
        saves=max(saves, 1),
        dense=times > 0,
        keep_states=bool(sub.steps),
        gradient=True,
    )


def replay_chunks(
    terms, solver, saveat, args_axes, stale, partial, chunk_size, mesh, y0, args
):
    """`replay_ensemble` on one device's trajectories.

    Every chunk's rows are sliced out of the inputs where they lie (a padded or
    reshaped copy of the whole mesh would cost more than the chunks): chunk `k`
    replays rows `[k * chunk_size, (k + 1) * chunk_size)`, and the last one the last
    `chunk_size` rows, which overlap the previous chunk's. The overlapping rows are
    replayed twice by the same program, so the results are the same either way.
    """
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
    chunks = -(-batch // chunk_size)
    starts = jnp.minimum(jnp.arange(chunks) * chunk_size, batch - chunk_size)

    @jax.checkpoint
    def one(start):
        take = lambda x: jax.lax.dynamic_slice_in_dim(x, start, chunk_size)
        a = args if args_axes is None else jtu.tree_map(take, args)
        sol = replay(
            jtu.tree_map(take, mesh),
            terms,
            solver,
            jtu.tree_map(take, y0),
            a,
            saveat=saveat,
            args_axes=args_axes,
            stale="ignore",
            allow_partial=partial,
        )
        return sol.ts, sol.ys, sol.stats.get("max_error_ratio")

    ts, ys, ratio = jax.lax.map(one, starts)
    # Rows of the last chunk that the previous chunks did not replay.
    new = batch - (chunks - 1) * chunk_size

    def merge(x):
        if x is None:
            return None
        done = x[:-1].reshape((-1,) + x.shape[2:])
        return jnp.concatenate([done, x[-1, chunk_size - new :]])

    ts, ys, ratio = merge(ts), jtu.tree_map(merge, ys), merge(ratio)
    ts, ys = check_stale((ts, ys), ratio, stale)
    stats = replay_stats(mesh, ratio)
    return Solution(
        t0=mesh.ts[:, 0],
        t1=mesh.ts[:, -1],
        ts=ts,
        ys=ys,
        stats=stats,
        result=mesh.result,
        mesh=mesh,
    )


@eqx.filter_jit
def replay_compiled(*inputs):
    """`replay_chunks` compiled as one program, also when called outside `jit`: op
    by op, every slice would be a new copy of the ensemble's arrays (and every call
    would compile the replay again). The solution comes without its mesh, which the
    caller puts back: an output of a compiled program is a copy."""
    sol = replay_chunks(*inputs)
    return eqx.tree_at(lambda s: s.mesh, sol, None)
