"""Calling back to Python from a compiled program, only when a rare condition holds.

`jax.debug.callback` gives a program an effect, and JAX dispatches a program with
effects on its slow, Python path: about 0.1-0.2 ms more per call on a CPU, more
than a replay of a small ensemble takes. A `jax.pure_callback` has no effect. Inside
a `lax.cond` it runs only when the condition holds; returning a factor of one that
the output is multiplied by, it is not removed as unused (XLA cannot know the
factor, and multiplying by one changes no value, not even the sign of a zero).
"""

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np


def call_if(pred, callback, operand, tree, batched: bool = False):
    """Return `tree`, after calling `callback(operand)` in Python if `pred`.

    **Arguments:**

    - `pred`: a boolean scalar, the same for the whole `vmap` batch (reduce it with
        `eqxi.unvmap_any` first, so that the `lax.cond` stays a branch).
    - `callback`: called with `operand` as a NumPy value; its return is ignored.
    - `operand`: an integer scalar, unbatched like `pred`; with `batched`, an
        integer array, batched or not, of which `callback` gets the largest value
        (reduced on the host, after the condition has held: no reduction in the
        program). `batched` needs a floating-point leaf in `tree`.
    - `tree`: what the caller returns; its values and derivatives pass unchanged.
    """
    real = lambda x: jnp.issubdtype(x.dtype, jnp.floating)
    floats = [x for x in jtu.tree_leaves(tree) if real(x)]
    if not floats:
        if batched:
            raise ValueError("call_if(batched=True) needs a floating-point leaf.")
        # Nothing to tie the call to (a complex product with one is not exact when
        # a part is infinite): an effect, and JAX's slower dispatch.
        call = lambda x: jax.debug.callback(lambda v: callback(np.asarray(v)), x)
        jax.lax.cond(pred, call, lambda x: None, operand)
        return tree
    dtype = jnp.result_type(*floats)
    one = jax.ShapeDtypeStruct((), dtype)

    # Under `vmap` the callback gets the batch too (`broadcast_all`), and returns
    # one factor per batch element: the axes `value` has beyond the operand's own.
    own_axes = jnp.ndim(operand)

    def host(value):
        callback(np.asarray(np.max(value)))
        return np.ones(np.shape(value)[: np.ndim(value) - own_axes], dtype)

    def call(x):
        factor = jax.pure_callback(host, one, x, vmap_method="broadcast_all")
        # One factor for the whole batch, as the operand's was: `tree` keeps its
        # own batching (an unbatched leaf stays unbatched under `vmap`).
        return jnp.where(eqxi.unvmap_any(factor != 1), jnp.nan, 1).astype(dtype)

    factor = jax.lax.cond(pred, call, lambda x: jnp.ones((), dtype), operand)

    def tie(x):
        return x * factor.astype(x.dtype) if real(x) else x

    return jtu.tree_map(tie, tree)
