"""A scan over a mesh's buffer that runs only the steps the mesh recorded.

A replay is a `lax.scan` over every step of the mesh's buffer: the steps past a
trajectory's last are zero-length and change nothing, but cost as much as the
others. That is what makes the replay differentiable in reverse mode. Where it is
only differentiated in forward mode (the per-trajectory Jacobian blocks of
`gs.fit`), a while loop can stop at the last recorded step instead: the buffer of a
fit's recordings holds 1.5 times the longest mesh at the initial guess, and a
FitzHugh-Nagumo fit's replays ran 320 steps where the trajectories took 150-205.
"""

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import jax.tree_util as jtu


def scan_recorded(body, init, xs, num_steps):
    """`jax.lax.scan(body, init, xs)` for the first `num_steps` elements of `xs`
    only (a traced count), as a while loop: differentiable in forward mode only.

    The outputs keep the scan's shapes; past `num_steps` they are zeros (the caller
    fills what it needs there).
    """
    length = jtu.tree_leaves(xs)[0].shape[0]
    first = jtu.tree_map(lambda x: x[0], xs)
    shapes, treedef = jtu.tree_flatten(jax.eval_shape(body, init, first)[1])
    outs = [jnp.zeros((length,) + s.shape, s.dtype) for s in shapes]

    # Under `vmap`, the longest trajectory's count for all: the predicate stays
    # unbatched, so the loop selects nothing (a shorter trajectory takes its
    # buffer's zero-length steps, as the scan does).
    num_steps = eqxi.unvmap_max(num_steps)

    def cond(state):
        return state[0] < num_steps

    def step(state):
        i, carry, outs = state
        carry, out = body(carry, jtu.tree_map(lambda x: x[i], xs))
        outs = [buffer.at[i].set(o) for buffer, o in zip(outs, jtu.tree_leaves(out))]
        return i + 1, carry, outs

    _, carry, outs = jax.lax.while_loop(cond, step, (jnp.array(0), init, outs))
    return carry, jtu.tree_unflatten(treedef, outs)


def fill_after(values: list, num_steps, last: list) -> list:
    """Per-step values (leading axis: steps) with the entries from `num_steps` on
    replaced by `last`: what zero-length steps would have left there."""
    out = []
    for v, a in zip(values, last):
        taken = jnp.arange(v.shape[0]) < num_steps
        taken = taken.reshape(taken.shape + (1,) * (v.ndim - 1))
        out.append(jnp.where(taken, v, a))
    return out
