"""`_host_call.call_if`: a Python call from a compiled program, only when asked,
without an effect and without changing values or derivatives."""

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np

from gradsolve._host_call import call_if


def _traced(seen):
    def f(x):
        pred = eqxi.unvmap_any(x[0] > 5)
        return call_if(pred, seen.append, jnp.int32(7), (x * 2, jnp.int32(1)))

    return f


def test_calls_only_when_the_condition_holds():
    seen = []
    f = jax.jit(_traced(seen))
    jax.block_until_ready(f(jnp.ones(3)))
    assert seen == []
    jax.block_until_ready(f(jnp.full(3, 10.0)))
    assert [int(v) for v in seen] == [7]
    # Under vmap, once for the batch.
    seen.clear()
    jax.block_until_ready(jax.jit(jax.vmap(_traced(seen)))(jnp.full((4, 3), 10.0)))
    assert [int(v) for v in seen] == [7]


def test_values_derivatives_and_no_effect():
    seen = []
    x = jnp.array([10.0, -0.0, jnp.inf, jnp.nan, -3.5])
    out, _ = jax.jit(_traced(seen))(x)
    np.testing.assert_array_equal(np.signbit(out), np.signbit(x * 2))
    np.testing.assert_array_equal(out, x * 2)  # NaN equal to NaN here
    grad = jax.grad(lambda y: jnp.sum(_traced(seen)(y)[0] ** 2))(jnp.arange(6.0, 13))
    np.testing.assert_array_equal(grad, 8 * jnp.arange(6.0, 13))
    assert not jax.make_jaxpr(_traced(seen))(x).effects
