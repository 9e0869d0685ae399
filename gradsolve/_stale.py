"""A stale mesh: a replay whose error estimate exceeds the tolerances. The error
ratio a replay computes (`scaled_error`, `roundoff_margin`), and how it is reported."""

import warnings

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp

from ._host_call import call_if


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
    only when some trajectory is stale (`_host_call.call_if`; under `vmap` the
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
    # The decade of each ratio: the callback names the largest, reduced on the host
    # when the warning fires (no reduction over the batch in every replay).
    ratio = jnp.where(jnp.isnan(ratio), jnp.inf, ratio)
    decade = jnp.clip(jnp.ceil(jnp.log10(jnp.maximum(ratio, 1))), 0, 400)
    return call_if(any_stale, _warn, decade.astype(jnp.int32), tree, batched=True)


def scaled_error(norm, rtol, atol, as_tree, y0, y1, y_error):
    """The error ratio Diffrax's `PIDController` accepts a step on (accept if < 1),
    for a state held as leaves or a norm other than the RMS or max norm.

    `as_tree` turns the list of scaled errors into what `norm` takes.
    """

    def scale(a, b, e):
        b = jnp.where(jnp.isnan(b).any(), a, b)
        with jax.numpy_dtype_promotion("standard"):
            return e / (atol + jnp.maximum(jnp.abs(a), jnp.abs(b)) * rtol)

    e = [jnp.where(jnp.isnan(x), jnp.inf, x) for x in y_error]
    return norm(as_tree([scale(a, b, x) for a, b, x in zip(y0, y1, e)]))


def roundoff_margin(dtype, rtol):
    """How far the error ratio of a step may move with the rounding of its error
    estimate: `eps / rtol`.

    The replay computes each step's ratio with the operations the recording used to
    accept it, and reproduces it bit for bit when XLA compiles both programs alike.
    It need not: XLA fuses a multiplication into a following addition only when the
    product has no other use in the same kernel, so a vector field whose outputs
    share a product (`inf = b * S * I` in both `dS` and `dI`) can be rounded
    differently in the recording's loop and in the replay's scan, by an ulp of its
    terms. The error estimate, a sum of stage increments that nearly cancels, then
    moves by about `eps |y|`, and the ratio by about `eps / rtol`: up to 5.4% in
    float32 at `rtol=1e-7` on 1,000 SIR trajectories. The replay reports its ratio
    against the tolerance widened by this margin, so that a fresh mesh reads `<= 1`.
    (In float64 the margin is `2e-16 / rtol`: nothing at usual tolerances. In
    float32 at `rtol=1e-6` it is 12%, as close as the check can tell a step that
    meets the tolerance from one that misses it there.)
    """
    eps = jnp.finfo(dtype).eps
    return eps / jnp.maximum(rtol, eps)
