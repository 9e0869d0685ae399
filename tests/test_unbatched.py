"""`batch_max_int`: the largest value over array axes and `vmap` batches, unbatched,
0 for an empty batch, and transparent to differentiation."""

import jax
import jax.numpy as jnp
import numpy as np

from gradsolve._unbatched import batch_max_int


def _with_max(y, i):
    m = batch_max_int(i)
    return y * 2.0 + m, m


def test_maximum_over_array_axes_and_nested_batches():
    index = jnp.array([[[1, 5], [2, 0]], [[7, 0], [3, 4]]], jnp.int32)
    ys = jnp.ones(index.shape)
    _, m = jax.jit(jax.vmap(jax.vmap(_with_max)))(ys, index)
    assert np.all(np.asarray(m) == 7)
    _, m = jax.vmap(_with_max, in_axes=(0, None))(ys[0, 0], index[1])
    assert np.all(np.asarray(m) == 7)
    assert int(batch_max_int(index[0])) == 5


def test_empty_batch_gives_zero():
    _, m = jax.vmap(_with_max)(jnp.zeros((0,)), jnp.zeros((0,), jnp.int32))
    assert m.shape == (0,)
    assert int(batch_max_int(jnp.zeros((0,), jnp.int32))) == 0


def test_derivatives_pass_through():
    index = jnp.array([3, 9, 1], jnp.int32)

    def loss(y):
        return jnp.sum(jax.vmap(_with_max)(y, index)[0] ** 2)

    y = jnp.array([0.5, -1.0, 2.0])
    # d/dy sum (2y + 9)^2 = 4 (2y + 9)
    want = 4 * (2 * y + 9)
    np.testing.assert_allclose(jax.grad(loss)(y), want)
    np.testing.assert_allclose(jax.jacfwd(loss)(y), want)
    np.testing.assert_allclose(jax.hessian(loss)(y), 8 * np.eye(3))
