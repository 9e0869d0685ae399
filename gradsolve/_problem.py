"""Turning a user's `diffeqsolve`-style inputs into the internal problem, with checks.

Every check raises an error that says what is wrong and how to fix it. Checks that
need values (NaN in `y0`, unsorted `saveat.ts`) run inside `jit` via `eqx.error_if`.
"""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._saving import SavePlan
from ._unbatched import batch_max_int


class LeafProblem(eqx.Module):
    """The ODE seen as a function of the flat list of state leaves."""

    f: object
    args: object
    treedef: object = eqx.field(static=True)

    def vf(self, t, leaves):
        y = jtu.tree_unflatten(self.treedef, leaves)
        return jtu.tree_leaves(self.f(t, y, self.args))

    def tree(self, leaves):
        return jtu.tree_unflatten(self.treedef, leaves)


class Prepared(eqx.Module):
    problem: LeafProblem
    t0: jax.Array
    t1: jax.Array
    dt0: jax.Array | None
    y0: list
    plan: SavePlan
    # False when y0 or args hold NaN/inf: the errors that would follow are not reported
    # over the one that explains them.
    valid: jax.Array


def _check_time_type(x, name: str) -> None:
    """A time must be a number or an array of numbers: a string would otherwise
    reach JAX as a dtype name (`data type '.0' not understood`)."""
    if isinstance(x, bool | int | float | np.number | jax.Array | np.ndarray):
        return
    try:
        kind = np.asarray(x).dtype.kind
    except (TypeError, ValueError):
        kind = "O"
    if kind not in "biuf":
        raise TypeError(
            f"{name} must be a real number or an array of them; got "
            f"{type(x).__name__} {x!r:.60}. Convert it with float(...) or "
            "jnp.asarray(...)."
        )


def time_dtype(t0, t1, dt0, ts):
    named = (("t0", t0), ("t1", t1), ("dt0", dt0), ("saveat.ts", ts))
    for name, x in named:
        if x is not None:
            _check_time_type(x, name)
    timelikes = [x for x in (t0, t1, dt0, ts) if x is not None]
    with jax.numpy_dtype_promotion("standard"):
        dtype = jnp.result_type(*timelikes)
    if jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_):
        dtype = jnp.result_type(float)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"t0, t1, dt0 and saveat.ts must be real numbers; got dtype {dtype}."
        )
    return dtype


def inexact_leaves(tree) -> list:
    """The floating-point array leaves of `tree` (Python floats included)."""
    out = []
    for x in jtu.tree_leaves(tree):
        if isinstance(x, float) or (
            hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
        ):
            out.append(x)
    return out


def _numpy_or_jax(*trees):
    """NumPy for values known now (every leaf of `trees` concrete), else `jax.numpy`.

    Checks of concrete inputs run on the host in NumPy: each `jax.numpy` operation on
    a concrete array compiles a small XLA program of its own the first time it meets
    a shape and dtype (~20 ms apiece, ~0.5 s of a first solve's wait). A value known
    while a `jit` is traced (a Python number or array closed over) is checked then,
    and fails while tracing; traced values stay JAX operations, raised at run time
    as Diffrax's are."""
    traced = any(isinstance(x, jax.core.Tracer) for x in jtu.tree_leaves(trees))
    return jnp if traced else np


def _finite(tree):
    leaves = inexact_leaves(tree)
    xp = _numpy_or_jax(leaves)
    if not leaves:
        return xp.asarray(True)
    return xp.all(xp.stack([xp.all(xp.isfinite(x)) for x in leaves]))


def _check(x, bad, msg: str, checks: list | None):
    """`eqx.error_if(x, bad, msg)`, or, given `checks`, `x` with `(bad, msg)`
    added to them for `raise_first` (traced predicates only)."""
    if not isinstance(bad, jax.core.Tracer):
        # Known: raised already where it is true (a Python bool costs Equinox no
        # JAX operation).
        bad = bool(bad)
    if checks is None:
        return eqx.error_if(x, bad, msg)
    if isinstance(bad, jax.core.Tracer):
        checks.append((bad, msg))
    return x


def raise_first(tree, checks: list):
    """`tree` with the checks gathered by `prepare` threaded onto it as one
    `eqx.branched_error_if` (the first failing check's message). One, because each
    `eqx.error_if` walks the Python stack when it is traced: ~50 ms apiece inside a
    deep trace such as a fit's."""
    if not checks:
        return tree
    failed = jnp.stack([jnp.any(bad) for bad, _ in checks])
    # Unbatched before Equinox reduces it (see `_unbatched`: an empty ensemble).
    index = batch_max_int(jnp.argmax(failed))
    return eqx.branched_error_if(tree, jnp.any(failed), index, [m for _, m in checks])


def check_finite(tree, name: str, checks: list | None = None):
    """Raise (inside jit too) if `tree` holds a NaN or an infinity."""
    if not inexact_leaves(tree):
        return tree
    finite = _finite(tree)
    msg = (
        f"{name} contains NaN or inf; the solve would return NaN. Check how {name} "
        "is computed (e.g. a division by zero or a log of a negative number)."
    )
    try:  # concrete values get a Python error, raised at once
        if not bool(finite):
            raise ValueError(msg)
    except jax.errors.ConcretizationTypeError:
        pass
    if not any(isinstance(x, jax.Array) for x in jtu.tree_leaves(tree)):
        return tree  # Python numbers only: checked above, and nothing to thread on.
    return _check(tree, ~finite, msg, checks)


def check_vector_field(f, t0, y0, args):
    """Trace `f` once and compare its output with `y0`: structure, shape, dtype."""
    try:
        out = eqx.filter_eval_shape(f, t0, y0, args)  # args may hold non-arrays
    except Exception as e:
        # The error itself, with a note (not rebuilt from its message: not every
        # exception type can be, e.g. JAX's tracer conversion errors).
        e.add_note("(raised by the vector field f(t0, y0, args), traced by gradsolve)")
        raise
    y_struct = jax.eval_shape(lambda: y0)
    if jtu.tree_structure(out) != jtu.tree_structure(y_struct):
        raise ValueError(
            "The vector field must return the same PyTree structure as y0: y0 has "
            f"{jtu.tree_structure(y_struct)} but f(t, y, args) returned "
            f"{jtu.tree_structure(out)}."
        )
    for a, b in zip(jtu.tree_leaves(out), jtu.tree_leaves(y_struct)):
        a = jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))  # or a number
        if a.shape != b.shape:
            raise ValueError(
                f"The vector field returned an array of shape {a.shape} where y0 has "
                f"shape {b.shape}; f(t, y, args) must return dy/dt with y's shape."
            )
        if a.dtype != b.dtype and not jnp.can_cast(a.dtype, b.dtype, "same_kind"):
            raise ValueError(
                f"The vector field returned dtype {a.dtype} for a state of dtype "
                f"{b.dtype}; return floating-point values of the state's dtype."
            )


class TimeValueError(ValueError, RuntimeError):
    """Times with bad values (unsorted or out-of-range `saveat.ts`, NaN, a zero
    `dt0`), found before solving. A `ValueError`, and also a `RuntimeError`: Diffrax
    finds the same problems inside its compiled solve and raises an
    `EquinoxRuntimeError`, so code that catches either keeps working."""


def _check_ts(ts, t0, t1, checks: list | None = None):
    """`saveat.ts` must be monotone in the direction of integration and in range."""
    xp = _numpy_or_jax(ts, t0, t1)
    if xp is np:
        ts, t0, t1 = np.asarray(ts), np.asarray(t0), np.asarray(t1)
    lo, hi = xp.minimum(t0, t1), xp.maximum(t0, t1)
    increasing = t1 >= t0
    step = ts[1:] - ts[:-1]
    unsorted = xp.any(xp.where(increasing, step < 0, step > 0))
    outside = xp.any((ts < lo) | (ts > hi))
    try:  # concrete values get a Python error, raised at once
        bad_order, bad_range = bool(unsorted), bool(outside)
    except jax.errors.ConcretizationTypeError:
        bad_order = bad_range = None
    order_msg = (
        "saveat.ts must be sorted in the direction of integration (increasing when "
        "t0 < t1, decreasing when t0 > t1); sort it, e.g. with jnp.sort."
    )
    range_msg = "saveat.ts must lie within [t0, t1]; drop or clip the times outside."
    if bad_order:
        raise TimeValueError(order_msg)
    if bad_range:
        raise TimeValueError(range_msg)
    ts = _check(ts, unsorted, order_msg, checks)
    return _check(ts, outside, range_msg, checks)


def _raise_or_thread(x, bad, msg: str, checks: list | None = None):
    """Raise `msg` at once when `bad` is known, else thread it onto `x` (inside jit)."""
    try:  # concrete values get a Python error, raised at once
        if bool(bad):
            raise TimeValueError(msg)
    except jax.errors.ConcretizationTypeError:
        pass
    return _check(x, bad, msg, checks)


def check_finite_times(t0, t1, dt0, ts, checks: list | None = None):
    """NaN or infinite times are errors, naming the argument (a NaN `t1` would
    otherwise return `y0` as a successful solve, a NaN in `ts` a made-up value)."""
    out = []
    for x, name in ((t0, "t0"), (t1, "t1"), (dt0, "dt0"), (ts, "saveat.ts")):
        if x is not None:
            msg = (
                f"{name} is NaN or infinite; times must be finite numbers. Check how "
                f"{name} is computed."
            )
            xp = _numpy_or_jax(x)
            x = _raise_or_thread(x, ~xp.all(xp.isfinite(x)), msg, checks)
        out.append(x)
    if dt0 is not None:
        msg = (
            "dt0 is 0: the first step would make no progress. Pass a nonzero dt0, "
            "or dt0=None to let the step size controller choose it."
        )
        out[2] = _raise_or_thread(out[2], out[2] == 0, msg, checks)
    return out


def _check_dt0(dt0, t0, t1, checks: list | None = None):
    # Times may mix Python numbers, integers and floats (Diffrax accepts
    # `t0=0, t1=1, dt0=0.1`), also under `jax_numpy_dtype_promotion="strict"`.
    dtype = time_dtype(t0, t1, dt0, None)
    xp = _numpy_or_jax(dt0, t0, t1)
    dt0, t0, t1 = (xp.asarray(x, dtype=dtype) for x in (dt0, t0, t1))
    wrong = (t1 - t0) * dt0 < 0
    msg = (
        "dt0 has the wrong sign: it must point from t0 to t1 (negative when "
        "integrating backwards, t0 > t1). Flip its sign or pass dt0=None."
    )
    try:
        if bool(wrong):
            raise ValueError(msg)
    except jax.errors.ConcretizationTypeError:
        pass
    return _check(dt0, wrong, msg, checks)


def check_concrete_inputs(t0, t1, dt0, y0, args, saveat: diffrax.SaveAt):
    """Raise at once, outside `jit`, for bad inputs whose values are known. (Traced
    values are left to `prepare`, inside the compiled solve.)"""
    traced = []  # dropped: `prepare` checks them where its result is used
    check_finite(y0, "y0", traced)
    check_finite(args, "args", traced)
    if saveat.subs.ts is not None and jnp.ndim(saveat.subs.ts) != 1:
        raise ValueError(
            f"saveat.ts has shape {jnp.shape(saveat.subs.ts)}: pass a 1-D array of "
            "times (e.g. jnp.linspace(t0, t1, 10)); for an ensemble, jax.vmap the "
            "solve."
        )
    dtype = time_dtype(t0, t1, dt0, saveat.subs.ts)
    xp = _numpy_or_jax(t0, t1, dt0, saveat.subs.ts)
    as_time = lambda x: None if x is None else xp.asarray(x, dtype=dtype)
    t0, t1 = as_time(t0), as_time(t1)
    check_finite_times(t0, t1, as_time(dt0), as_time(saveat.subs.ts), traced)
    if dt0 is not None:
        _check_dt0(dt0, t0, t1, traced)
    if saveat.subs.ts is not None:
        _check_ts(as_time(saveat.subs.ts), t0, t1, traced)


def prepare(term, t0, t1, dt0, y0, args, saveat: diffrax.SaveAt) -> Prepared:
    """Validate and normalise the inputs of a fast-path solve."""
    sub = saveat.subs
    ts = sub.ts
    dtype = time_dtype(t0, t1, dt0, ts)
    as_time = lambda x: None if x is None else jnp.asarray(x, dtype=dtype)
    checks = []  # traced checks, raised as one (see `raise_first`)
    t0, t1, dt0, ts = check_finite_times(
        as_time(t0), as_time(t1), as_time(dt0), as_time(ts), checks
    )
    if dt0 is not None:
        dt0 = _check_dt0(dt0, t0, t1, checks)

    def promote(leaf):
        leaf = jnp.asarray(leaf)
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            leaf = leaf.astype(dtype)
        with jax.numpy_dtype_promotion("standard"):
            return leaf.astype(jnp.result_type(leaf, dtype))

    y0 = jtu.tree_map(promote, y0)
    if not jtu.tree_leaves(y0):
        raise ValueError("y0 has no arrays; pass the initial state as an array.")
    y0 = check_finite(y0, "y0", checks)
    args = check_finite(args, "args", checks)
    valid = _finite(y0) & _finite(args)
    f = term.vector_field
    check_vector_field(f, t0, y0, args)
    direction = jnp.where(t0 < t1, 1, -1)
    if ts is not None:
        ts = _check_ts(ts, t0, t1, checks)
    t0, t1, dt0, ts, y0, args = raise_first((t0, t1, dt0, ts, y0, args), checks)
    if ts is not None:
        ts = ts * direction
    leaves, treedef = jtu.tree_flatten(y0)
    problem = LeafProblem(f=f, args=args, treedef=treedef)
    plan = SavePlan(ts=ts, t0=bool(sub.t0), t1=bool(sub.t1), steps=bool(sub.steps))
    return Prepared(problem, t0, t1, dt0, leaves, plan, valid)


def has_jump_ts(controller) -> bool:
    return getattr(controller, "jump_ts", None) is not None
