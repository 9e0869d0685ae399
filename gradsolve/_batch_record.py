"""The compiled `jax.vmap` of `gs.record` that `gs.record_ensemble` calls, reused
across calls with the same settings.

`eqx.filter_jit` would do, but for a small ensemble its work on every call (splitting
the settings into arrays and the rest, then rebuilding its output) costs more than
the recording: ~0.16 ms against ~0.07 ms for `jax.jit` on one Lorenz trajectory,
whose whole recording takes ~0.4 ms. Here the settings are split once per call
with a plain flatten, the compiled function is looked up by what is not an array,
and only the arrays (settings, `y0`, `args`) cross into `jax.jit`.
"""

import collections
from collections.abc import Callable

import equinox as eqx
import jax
import jax.tree_util as jtu

from ._solve import record


# Compiled recorders kept (least recently used dropped first): each holds the
# settings it was built for, the vector field among them.
CACHED_RECORDERS = 32

_RECORDERS: collections.OrderedDict = collections.OrderedDict()


def _record_batch(settings, y0, args):
    """`jax.vmap` of `record` over `y0` and `args` (batched along `args_axes`)."""
    terms, solver, t0, t1, dt0, args_axes, steps, throw, kw = settings
    one = lambda y, a: record(
        terms, solver, t0, t1, dt0, y, a, max_steps=steps, throw=throw, **kw
    )
    return jax.vmap(one, in_axes=(0, args_axes))(y0, args)


# For settings that cannot be a cache key: Equinox splits them on every call.
_record_batch_filtered = eqx.filter_jit(_record_batch)


def _recorder(treedef, static: tuple, is_array: tuple) -> Callable:
    """`jax.jit` of the batched recording for settings flattened to `treedef`,
    with the leaves `static` where `is_array` is false (arrays come as arguments)."""

    def settings(arrays):
        it = iter(arrays)
        leaves = [next(it) if dynamic else s for s, dynamic in zip(static, is_array)]
        return jtu.tree_unflatten(treedef, leaves)

    return jax.jit(lambda arrays, y0, args: _record_batch(settings(arrays), y0, args))


def batch_recorder(terms, solver, t0, t1, dt0, args_axes, steps, throw, kw):
    """A function `(y0, args) -> RecordedMesh` recording a batch (`args` batched
    along `args_axes`) with these settings, compiled once per settings' structure
    and non-array values."""
    fixed = (terms, solver, t0, t1, dt0, args_axes, steps, throw, kw)
    leaves, treedef = jtu.tree_flatten(fixed, is_leaf=lambda x: x is None)
    is_array = tuple(eqx.is_array(x) for x in leaves)
    static = tuple(None if a else x for x, a in zip(leaves, is_array))
    key = (treedef, static, is_array)
    try:
        hash(key)
    except TypeError:
        return lambda y, a: _record_batch_filtered(fixed, y, a)
    run = _RECORDERS.pop(key, None) or _recorder(treedef, static, is_array)
    _RECORDERS[key] = run
    while len(_RECORDERS) > CACHED_RECORDERS:
        _RECORDERS.popitem(last=False)
    arrays = [x for x, a in zip(leaves, is_array) if a]
    return lambda y, a: run(arrays, y, a)
