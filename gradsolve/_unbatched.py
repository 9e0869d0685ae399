"""Reductions over a `jax.vmap` batch that also work when the batch is empty.

`eqx.branched_error_if` reduces a batched message index with `unvmap_max`, which is a
`jnp.max` without an initial value: it fails to trace for an empty ensemble (`vmap`
over 0 trajectories), in Diffrax as here. An index made unbatched first, with
`unvmap_any` only (which is defined on an empty batch), avoids that.
"""

import equinox.internal as eqxi
import jax.numpy as jnp


def batch_max_int(x, bits: int):
    """The largest value of the non-negative integer `x` (`< 2**bits`) over every
    array axis and every `vmap` batch, as an unbatched scalar; 0 for an empty batch.

    Built bit by bit from the top with `unvmap_any`, so it is exact.
    """
    x = jnp.asarray(x).astype(jnp.int32)
    best = jnp.array(0, dtype=jnp.int32)
    for bit in reversed(range(bits)):
        candidate = best | (1 << bit)
        best = jnp.where(eqxi.unvmap_any(jnp.any(x >= candidate)), candidate, best)
    return best
