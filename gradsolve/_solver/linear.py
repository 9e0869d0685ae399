"""Jacobians and the linear solves of a Rosenbrock step, on either state representation.

A Rosenbrock step solves `(I - gamma h J) k = r` once per stage with the same matrix.
Two forms of the state reach it (see `_components.py`):

- a short list of scalar components (under `vmap`, each a `(batch,)` array). The
  Jacobian is then a list of rows of scalars, from one `jax.linearize` of the field and
  one tangent per component, and the matrix is factorised by Gaussian elimination
  with partial pivoting written out element by element: every operation is an
  elementwise one over the batch, as in the rest of the step.
- any other list of leaves: the state is flattened to one vector, the Jacobian formed
  by `jax.jacfwd` and the matrix factorised by `jax.scipy.linalg.lu_factor`.

Both forms are differentiable to any order, in forward and reverse mode.
"""

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl

from .._custom_types import Leaves


# Above this many scalar components the written-out elimination gives way to a stacked
# LU factorisation: its size, and XLA's compile time, grow as the cube of the
# dimension (8 components: 3x the compile time for steps 25% faster; 12: the
# gradient no longer compiles in 8 GiB), while its speed-up is largest for the
# smallest systems (3 components: steps 3x faster).
MAX_UNROLLED = 4


class ScalarSystem:
    """`I - scale * J` for a state of scalar components, factorised with partial
    pivoting. Pivot choices are made by comparisons, so they carry no derivative."""

    def __init__(self, jac_rows: list[list], scale):
        n = len(jac_rows)
        m = [
            [(1 if i == j else 0) - scale * jac_rows[i][j] for j in range(n)]
            for i in range(n)
        ]
        swaps = []
        for k in range(n):
            # Bring the largest remaining entry of column k to the diagonal, by a
            # sequence of conditional row exchanges (a permutation for every element
            # of the batch).
            for i in range(k + 1, n):
                swap = jnp.abs(m[i][k]) > jnp.abs(m[k][k])
                swaps.append((k, i, swap))
                for j in range(n):
                    m[k][j], m[i][j] = (
                        jnp.where(swap, m[i][j], m[k][j]),
                        jnp.where(swap, m[k][j], m[i][j]),
                    )
            for i in range(k + 1, n):
                factor = m[i][k] / m[k][k]
                m[i][k] = factor
                for j in range(k + 1, n):
                    m[i][j] = m[i][j] - factor * m[k][j]
        self.lu = m
        self.swaps = swaps

    def solve(self, rhs: Leaves) -> Leaves:
        x = list(rhs)
        for k, i, swap in self.swaps:
            x[k], x[i] = jnp.where(swap, x[i], x[k]), jnp.where(swap, x[k], x[i])
        n = len(x)
        m = self.lu
        for i in range(n):
            for j in range(i):
                x[i] = x[i] - m[i][j] * x[j]
        for i in reversed(range(n)):
            for j in range(i + 1, n):
                x[i] = x[i] - m[i][j] * x[j]
            x[i] = x[i] / m[i][i]
        return x


class DenseSystem:
    """`I - scale * J` for a state flattened to one vector, LU-factorised."""

    def __init__(self, jac, scale, unravel):
        n = jac.shape[0]
        matrix = jnp.eye(n, dtype=jac.dtype) - scale * jac
        self.lu_and_pivots = jsl.lu_factor(matrix)
        self.unravel = unravel

    def solve(self, rhs: Leaves) -> Leaves:
        flat = jnp.concatenate([jnp.reshape(x, (-1,)) for x in rhs])
        return self.unravel(jsl.lu_solve(self.lu_and_pivots, flat))


def _is_scalar_list(y: Leaves) -> bool:
    return len(y) <= MAX_UNROLLED and all(jnp.ndim(x) == 0 for x in y)


def linearise(vf, t, y: Leaves):
    """The field, its time derivative and its Jacobian at `(t, y)`.

    **Returns:**

    `(f, f_t, jac)`: `f = vf(t, y)` and `f_t = df/dt` as leaves, and `jac`, the
    Jacobian `df/dy` in the form `system` expects.
    """
    if _is_scalar_list(y):
        f, tangent_map = jax.linearize(lambda s, *ys: vf(s, list(ys)), t, *y)
        zeros = [jnp.zeros_like(x) for x in y]
        f_t = tangent_map(jnp.ones_like(t), *zeros)
        columns = []
        for j, x in enumerate(y):
            basis = zeros[:j] + [jnp.ones_like(x)] + zeros[j + 1 :]
            columns.append(tangent_map(jnp.zeros_like(t), *basis))
        rows = [[columns[j][i] for j in range(len(y))] for i in range(len(y))]
        return f, f_t, rows
    flat, unravel = _flattening(y)

    def flat_field(s, v):
        return jnp.concatenate([jnp.reshape(x, (-1,)) for x in vf(s, unravel(v))])

    f_flat, f_t_flat = jax.jvp(lambda s: flat_field(s, flat), (t,), (jnp.ones_like(t),))
    jac = jax.jacfwd(lambda v: flat_field(t, v))(flat)
    return unravel(f_flat), unravel(f_t_flat), (jac, unravel)


def system(jac, scale):
    """`I - scale * jac`, factorised; `.solve(rhs_leaves)` solves with it."""
    if isinstance(jac, list):
        return ScalarSystem(jac, scale)
    matrix, unravel = jac
    return DenseSystem(matrix, scale, unravel)


def _flattening(y: Leaves):
    shapes = [jnp.shape(x) for x in y]
    sizes = [int(jnp.size(x)) for x in y]
    dtypes = [jnp.result_type(x) for x in y]
    flat = jnp.concatenate([jnp.reshape(x, (-1,)) for x in y])

    def unravel(v):
        out, start = [], 0
        for shape, size, dtype in zip(shapes, sizes, dtypes):
            out.append(jnp.reshape(v[start : start + size], shape).astype(dtype))
            start += size
        return out

    return flat, unravel
