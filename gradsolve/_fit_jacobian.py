"""Residuals of an ensemble whose Jacobian is assembled trajectory by trajectory.

Trajectory `i`'s residuals depend only on the shared parameters and on trajectory
`i`'s own entries (its initial state, its per-trajectory parameters). Optimistix asks
for the Jacobian of all residuals at once: `jax.jacrev` of an ensemble of `B`
trajectories with `R` residuals each would pull back `B * R` cotangents through the
whole ensemble (`B` times too much work), and `jax.jacfwd` pushes every
per-trajectory entry's tangent through every trajectory. Here each trajectory's
Jacobian block is computed alone (vmapped over the ensemble), in the requested
mode, and the ensemble Jacobian is the contraction of those blocks: a `custom_jvp`
whose tangent is linear in the blocks, so Optimistix's `jax.linearize` (`jac="fwd"`)
and `jax.jacrev` (`jac="bwd"`) both get it for the cost of the blocks.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu


def _jacobian(fn, mode):
    # The residuals come back as the auxiliary output: one pass gives both.
    pair = lambda p, *inputs: (fn(p, *inputs), fn(p, *inputs))
    if mode == "fwd":
        return jax.jacfwd(pair, has_aux=True)
    if mode == "bwd":
        return jax.jacrev(pair, has_aux=True)
    raise ValueError(f'mode must be "fwd" or "bwd"; got {mode!r}.')


def _contract(jac, tangent):
    """`sum_leaves jac_leaf . tangent_leaf` over the tangent leaves' axes."""
    terms = [
        jnp.tensordot(j, t, axes=t.ndim)
        for j, t in zip(jtu.tree_leaves(jac), jtu.tree_leaves(tangent))
    ]
    return sum(terms[1:], terms[0])


@eqx.filter_custom_jvp
def ensemble_residuals(params, *, fn: Callable, in_axes, inputs, mode: str):
    """All residuals `jax.vmap(fn, in_axes=(in_axes, 0, ...))(params, *inputs)`.

    **Arguments:**

    - `params`: the fit variable (any PyTree of arrays).
    - `fn`: `fn(params_i, *inputs_i) -> residuals_i`, one trajectory.
    - `in_axes`: the `jax.vmap` axes of `params` (`None` shared, `0` per trajectory).
    - `inputs`: a tuple of PyTrees with a leading ensemble axis (meshes, data, ...).
    - `mode`: `"fwd"` or `"bwd"`: how each trajectory's Jacobian block is computed.
    """
    return jax.vmap(fn, in_axes=(in_axes,) + (0,) * len(inputs))(params, *inputs)


@ensemble_residuals.def_jvp
def _ensemble_residuals_jvp(primals, tangents, *, fn, in_axes, inputs, mode):
    (params,) = primals
    (t_params,) = tangents
    vmap_axes = (in_axes,) + (0,) * len(inputs)
    jac, out = jax.vmap(_jacobian(fn, mode), in_axes=vmap_axes)(params, *inputs)
    if t_params is None:
        return out, jnp.zeros_like(out)
    # Symbolic zero tangents (None) become zeros, to keep the leaves aligned.
    tangent = jtu.tree_map(
        lambda t, p: jnp.zeros_like(p) if t is None else t,
        t_params,
        params,
        is_leaf=lambda x: x is None,
    )
    t_out = jax.vmap(_contract, in_axes=(0, in_axes))(jac, tangent)
    return out, t_out
