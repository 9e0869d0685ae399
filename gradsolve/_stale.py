"""Reporting a stale mesh: a replay whose error estimate exceeds the tolerances."""

import warnings

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp

from ._unbatched import batch_max_int


STALE_OPTIONS = ("warn", "error", "ignore")

_ERROR = (
    "The mesh is stale: replayed with these inputs, its steps miss the tolerances "
    "it was recorded at (stats['max_error_ratio'] > 1), so the result and its "
    "gradient are less accurate than requested. Record a new mesh at these inputs "
    "with gs.record, or pass stale='warn' or stale='ignore' to gs.replay."
)


class StaleMeshWarning(UserWarning):
    """A mesh was replayed with inputs for which its steps miss the tolerances it
    was recorded at (`stats["max_error_ratio"] > 1`): record it again."""


def _warn(decade):
    size = "infinite (NaN or inf)" if decade >= 400 else f"up to 1e{int(decade)}"
    warnings.warn(
        f"The mesh is stale: replayed with these inputs, its error estimate is "
        f"{size} times the tolerance it was recorded at "
        "(stats['max_error_ratio'] > 1), so the result and its gradient are less "
        "accurate than requested. Record a new mesh at these inputs with gs.record; "
        "pass stale='error' to gs.replay to stop instead, or stale='ignore'.",
        StaleMeshWarning,
        stacklevel=2,
    )


def check_stale(tree, max_ratio, stale: str):
    """Return `tree`, after warning about or raising on a stale mesh.

    Works inside `jit`, `grad` and `vmap` without a host round trip on the common
    path: `stale="error"` is an `eqx.error_if`; `stale="warn"` calls back to Python
    only inside a `lax.cond` taken when some trajectory is stale (under `vmap` the
    predicate is reduced over the batch, so the callback runs at most once).
    """
    if stale not in STALE_OPTIONS:
        raise ValueError(f"stale must be one of {STALE_OPTIONS}; got {stale!r}.")
    if max_ratio is None or stale == "ignore":
        return tree
    ratio = jax.lax.stop_gradient(max_ratio)
    is_stale = ~(ratio <= 1)  # NaN counts as stale
    if stale == "error":
        return eqx.error_if(tree, is_stale, _ERROR)
    any_stale = eqxi.unvmap_any(jnp.any(is_stale))
    # The decade of the worst ratio, reduced without `unvmap_max` (see `_unbatched`).
    ratio = jnp.where(jnp.isnan(ratio), jnp.inf, ratio)
    decade = jnp.clip(jnp.ceil(jnp.log10(jnp.maximum(ratio, 1))), 0, 400)
    decade = batch_max_int(decade.astype(jnp.int32), bits=9)
    jax.lax.cond(
        any_stale, lambda d: jax.debug.callback(_warn, d), lambda d: None, decade
    )
    return tree
