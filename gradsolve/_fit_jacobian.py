"""Residuals of an ensemble whose Jacobian is assembled trajectory by trajectory.

Trajectory `i`'s residuals depend only on the shared parameters and on trajectory
`i`'s own entries (its initial state, its per-trajectory parameters). Optimistix asks
for the Jacobian of all residuals at once: `jax.jacrev` of an ensemble of `B`
trajectories with `R` residuals each would pull back `B * R` cotangents through the
whole ensemble (`B` times too much work), and `jax.jacfwd` pushes every
per-trajectory entry's tangent through every trajectory. Here each trajectory's
Jacobian block is computed alone (vmapped over the ensemble), in the mode that needs
fewer passes (forward when a trajectory has more residuals than entries it depends
on, the usual case of a fit), and the ensemble Jacobian is the contraction of those
blocks: a `custom_jvp` whose tangent is linear in the blocks, so Optimistix's
`jax.linearize` (`jac="fwd"`) and `jax.jacrev` (`jac="bwd"`) both get it for the
cost of the blocks.
"""

import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from ._sharding import Split, ensemble_map, replicated


def block_mode(residuals: int, params, in_axes) -> str:
    """`"fwd"` or `"bwd"`: the mode that computes one trajectory's Jacobian block in
    fewer passes: one per entry of `params` the trajectory depends on (forward), or
    one per each of its `residuals` (reverse). From shapes only; nothing is traced.
    """

    def entries(axis, p):
        leaves = jtu.tree_leaves(p)
        if axis is None:
            return sum(math.prod(jnp.shape(x)) for x in leaves)
        return sum(math.prod(jnp.shape(x)[1:]) for x in leaves)

    sizes = jtu.tree_map(entries, in_axes, params, is_leaf=lambda x: x is None)
    return "fwd" if sum(jtu.tree_leaves(sizes)) <= residuals else "bwd"


def _blocks_fwd(fn, in_axes, vmap_axes, split):
    """`(params, *inputs) -> (blocks, residuals)` for the ensemble in forward mode,
    one primal pass.

    One tangent per entry that a trajectory depends on (the shared entries and its
    own), pushed through every trajectory at once: the tangents are the outer batch
    and the trajectories the inner one, so the steps' arrays hold a tangent's values
    for all trajectories side by side (with the trajectories outside, every array
    had the few tangents of one trajectory side by side, which XLA vectorises
    worse: FitzHugh-Nagumo's 32 x 3 blocks 1.58 ms against 1.36 ms).
    """

    def blocks(params, *inputs):
        one = _one_trajectory(params, in_axes)
        unravel, leaves = _unravel(one), jtu.tree_leaves(one)
        entries = sum(math.prod(x.shape) for x in leaves)
        basis = jnp.eye(entries, dtype=jnp.result_type(*leaves))

        def push(direction, p, *inputs_i):
            return jax.jvp(lambda q: fn(q, *inputs_i), (p,), (unravel(direction),))

        def push_all(direction):
            run = ensemble_map(push, (None,) + vmap_axes, split)
            return run(direction, params, *inputs)

        out, cols = jax.vmap(push_all, out_axes=(None, -1))(basis)
        return _split_columns(cols, one), out

    return blocks


def _one_trajectory(params, in_axes):
    """The shapes and dtypes of `params` as one trajectory sees them: a shared leaf
    whole, a per-trajectory leaf without its leading axis."""

    def one(axis, subtree):
        def leaf(x):
            shape = jnp.shape(x) if axis is None else jnp.shape(x)[1:]
            return jax.ShapeDtypeStruct(shape, jnp.result_type(x))

        return jtu.tree_map(leaf, subtree)

    # `in_axes` is a prefix of `params`, as for `jax.vmap`.
    return jtu.tree_map(one, in_axes, params, is_leaf=lambda x: x is None)


def _blocks_bwd(fn):
    """`(params, *inputs) -> (block, residuals)` of one trajectory in reverse mode:
    one cotangent per residual, one primal pass."""

    def jac_bwd(p, *inputs):
        out, pull = jax.vjp(lambda q: fn(q, *inputs), p)
        basis = jnp.eye(out.size, dtype=out.dtype).reshape((out.size,) + out.shape)
        (rows,) = jax.vmap(pull)(basis)
        # rows: leaves of shape (out.size,) + leaf.shape -> out.shape + leaf.shape
        return jtu.tree_map(lambda r: r.reshape(out.shape + r.shape[1:]), rows), out

    return jac_bwd


def _unravel(tree):
    """The inverse of flattening `tree`'s leaves (shapes) into one vector."""
    leaves, treedef = jtu.tree_flatten(tree)

    def unravel(v):
        parts, start = [], 0
        for x in leaves:
            size = math.prod(x.shape)
            parts.append(v[start : start + size].reshape(x.shape).astype(x.dtype))
            start += size
        return jtu.tree_unflatten(treedef, parts)

    return unravel


def _split_columns(cols, tree):
    """Columns `out.shape + (n,)` as a PyTree like `tree`: `out.shape + leaf.shape`."""
    leaves, treedef = jtu.tree_flatten(tree)
    parts, start = [], 0
    for x in leaves:
        size = math.prod(x.shape)
        block = cols[..., start : start + size]
        parts.append(block.reshape(cols.shape[:-1] + x.shape))
        start += size
    return jtu.tree_unflatten(treedef, parts)


def _contract(jac, tangent):
    """`sum_leaves jac_leaf . tangent_leaf` over the tangent leaves' axes."""
    terms = [
        jnp.tensordot(j, t, axes=t.ndim)
        for j, t in zip(jtu.tree_leaves(jac), jtu.tree_leaves(tangent))
    ]
    return sum(terms[1:], terms[0])


def _explicit_abstract_mesh():
    """The current abstract mesh, set as an explicit context.

    JAX traces a custom derivative's rule with the (empty) abstract mesh set as a
    context where the primal saw none, and that difference alone is another cache
    key for every jitted function both call: `fn`'s replay was traced twice (about
    a tenth of a FitzHugh-Nagumo fit's trace). The primal and the rule both trace
    `fn` under this context, and share its traces."""
    return jax.sharding.use_abstract_mesh(jax.sharding.get_abstract_mesh())


@eqx.filter_custom_jvp
def ensemble_residuals(
    params, *, fn: Callable, in_axes, inputs, mode: str, split: Split | None = None
):
    """All residuals `jax.vmap(fn, in_axes=(in_axes, 0, ...))(params, *inputs)`.

    **Arguments:**

    - `params`: the fit variable (any PyTree of arrays).
    - `fn`: `fn(params_i, *inputs_i) -> residuals_i`, one trajectory.
    - `in_axes`: the `jax.vmap` axes of `params` (`None` shared, `0` per trajectory).
    - `inputs`: a tuple of PyTrees with a leading ensemble axis (meshes, data, ...).
    - `mode`: `"fwd"` or `"bwd"`: how each trajectory's Jacobian block is computed
        (see `block_mode`).
    - `split`: the devices the ensemble is split over (`None`: one device); every
        device computes its own trajectories' blocks.
    """
    axes = (in_axes,) + (0,) * len(inputs)
    with _explicit_abstract_mesh():
        return replicated(ensemble_map(fn, axes, split)(params, *inputs), split)


@ensemble_residuals.def_jvp
def _ensemble_residuals_jvp(
    primals, tangents, *, fn, in_axes, inputs, mode, split=None
):
    (params,) = primals
    (t_params,) = tangents
    vmap_axes = (in_axes,) + (0,) * len(inputs)
    with _explicit_abstract_mesh():
        if mode == "fwd":
            jac, out = _blocks_fwd(fn, in_axes, vmap_axes, split)(params, *inputs)
        elif mode == "bwd":
            blocks = ensemble_map(_blocks_bwd(fn), vmap_axes, split)
            jac, out = blocks(params, *inputs)
        else:
            raise ValueError(f'mode must be "fwd" or "bwd"; got {mode!r}.')
    out = replicated(out, split)
    if t_params is None:
        return out, jnp.zeros_like(out)
    # Symbolic zero tangents (None) become zeros, to keep the leaves aligned.
    tangent = jtu.tree_map(
        lambda t, p: jnp.zeros_like(p) if t is None else t,
        t_params,
        params,
        is_leaf=lambda x: x is None,
    )
    t_out = ensemble_map(_contract, (0, in_axes), split)(jac, tangent)
    return out, replicated(t_out, split)
