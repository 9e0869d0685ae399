"""Jacobians and the linear solves of a Rosenbrock step, on either state representation.

A Rosenbrock step solves `(I - gamma h J) k = r` once per stage with the same matrix.
Two forms of the state reach it (see `_components.py`):

- a short list of scalar components (under `vmap`, each a `(batch,)` array). The
  Jacobian is then a list of rows of scalars, from one `jax.linearize` of the field and
  one tangent per component, and the matrix is factorised by Gaussian elimination
  with partial pivoting written out element by element: every operation is an
  elementwise one over the batch, as in the rest of the step.
- any other list of leaves: the state is flattened to one vector, the Jacobian formed
  by `jax.jacfwd` and the matrix inverted by Gauss-Jordan elimination with partial
  pivoting written with whole-matrix array operations (`DenseSystem`).

Neither form calls LAPACK. jaxlib's batched LAPACK kernels on CPU split a batch over
XLA's own thread pool and wait for the pieces while holding a worker; when two of them
run at once on a small machine, every worker waits and the program never finishes
(the gradient of a Rodas5 replay of 8,192 trajectories of an 8-state system hung on
2 cores). The eliminations below need no thread of their own.

Both forms are differentiable to any order, in forward and reverse mode.
"""

import jax
import jax.numpy as jnp

from .._custom_types import Leaves


# Above this many scalar components the written-out elimination gives way to the
# array-form one (`DenseSystem`): its size, and XLA's compile time, grow as the cube
# of the dimension (8 components: 3x the compile time for steps 25% faster; 12: the
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
    """`I - scale * J` for a state flattened to one vector, inverted once per step by
    Gauss-Jordan elimination with partial pivoting; each stage's solve is then one
    matrix-vector product.

    The elimination is a `lax.fori_loop` over columns whose body acts on the whole
    matrix, so under `vmap` each step is a few array operations over the batch and
    the program's size does not grow with the dimension. Solves are differentiated
    implicitly (`jax.lax.custom_linear_solve`): a derivative reaches the matrix
    through `A x` only, never through the elimination, so a gradient stores nothing
    of it and costs one product with the transposed inverse per solve."""

    def __init__(self, jac, scale, unravel):
        n = jac.shape[0]
        self.matrix = jnp.eye(n, dtype=jac.dtype) - scale * jac
        self.inverse = _inverse(jax.lax.stop_gradient(self.matrix))
        self.unravel = unravel

    def solve(self, rhs: Leaves) -> Leaves:
        flat = jnp.concatenate([jnp.reshape(x, (-1,)) for x in rhs])
        x = jax.lax.custom_linear_solve(
            lambda v: self.matrix @ v,
            flat,
            solve=lambda _, b: self.inverse @ b,
            transpose_solve=lambda _, b: self.inverse.T @ b,
        )
        return self.unravel(x)


def _inverse(matrix):
    """The inverse of `matrix`, by Gauss-Jordan elimination in place with partial
    pivoting.

    Column `k` is eliminated with the largest remaining entry of that column, in
    row `p[k]`, and rows are never exchanged (the pivot row differs across a batch,
    so an exchange would be two scatters per column; reading the pivot row is one
    gather). Each elimination
    trades unknown `k` for equation `p[k]`; afterwards the matrix holds the inverse
    with its rows and columns permuted, `inverse[k, j] = m[p[k], q[j]]` with `q` the
    inverse permutation of `p`, that is `S m S` for the permutation matrix
    `S[k, p[k]] = 1`.
    """
    n = matrix.shape[0]
    index = jnp.arange(n)

    def eliminate(k, carry):
        m, used, s = carry
        column = m[:, k]
        pivot = jnp.argmax(jnp.where(used, -1, jnp.abs(column)))
        is_pivot = index == pivot
        is_k = index == k
        row = m[pivot]
        reciprocal = 1 / row[k]
        row = jnp.where(is_k, reciprocal, row * reciprocal)
        multipliers = jnp.where(is_pivot, 0, column)
        m = m - multipliers[:, None] * jnp.where(is_k, 0, row)[None, :]
        m = jnp.where(is_k[None, :], -multipliers[:, None] * reciprocal, m)
        m = jnp.where(is_pivot[:, None], row[None, :], m)
        s = jnp.where(is_k[:, None], is_pivot[None, :].astype(m.dtype), s)
        return m, used | is_pivot, s

    carry = (matrix, jnp.zeros(n, bool), jnp.zeros_like(matrix))
    m, _, s = jax.lax.fori_loop(0, n, eliminate, carry)
    return s @ m @ s


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
