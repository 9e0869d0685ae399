"""Values across a `jax.vmap` batch: reductions that also work when the batch is
empty, and values made batched where a batch of trajectories is.

`eqx.branched_error_if` reduces a batched message index with `unvmap_max`, which is a
`jnp.max` without an initial value: it fails to trace for an empty ensemble (`vmap`
over 0 trajectories), in Diffrax as here. An index made unbatched first, with a
maximum that starts from 0, avoids that.
"""

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap


@custom_vmap
def _max_from_zero(x):
    return jnp.max(x, initial=0)


@_max_from_zero.def_vmap
def _max_over_batch(axis_size, in_batched, x):
    # The batch axis is reduced here (0 for an empty batch), the array axes and any
    # outer batch by the call it makes: one reduction per level, unbatched result.
    (batched,) = in_batched
    return _max_from_zero(jnp.max(x, axis=0, initial=0) if batched else x), False


def batch_max_int(x):
    """The largest value of the non-negative integer `x` over every array axis and
    every `vmap` batch, as an unbatched scalar; 0 for an empty batch.

    One reduction per batch level (a bit-by-bit search with `unvmap_any` took one
    reduction per bit, a third of a small solve's XLA compile time).
    """
    return _max_from_zero(jnp.asarray(x).astype(jnp.int32))


def batched_like(tree, refs):
    """`tree`, its values unchanged, batched under `vmap` wherever one of `refs` is.

    Where a batch is differentiated from outside its `vmap` (`jax.grad` of a loss
    over `jax.vmap` of a replay), the cotangent of an unbatched value that a batched
    loop reads is summed over the batch at every step, inside the loop: a reduction
    per step and per value. Made batched before the loop, each trajectory
    accumulates its own cotangent, and the sum over the batch is taken once, after
    the loop. (Also the fixed point of `vmap` over a while loop: a carry that starts
    unbatched but becomes batched costs a trace of the body.)
    """
    never = jnp.array(False)
    for r in refs:
        never = never | (jnp.any(jnp.isnan(r)) & False)
    return jax.tree_util.tree_map(lambda x: jnp.where(never, x, x), tree)
