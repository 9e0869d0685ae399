"""Evaluating the vector field on a state held as a list of scalar components.

A small state (e.g. `y` of shape `(3,)`) is held by the solvers as a flat list of its
elements. Under `jax.vmap` every element is then a contiguous `(batch,)` array, and the
Runge--Kutta stages, the vector field and their derivatives are elementwise operations
on such arrays. (On a `(batch, 3)` state XLA:CPU emits strided slices, pads and
transposes between every pair of operations; the reverse pass is then ~10x slower.)

The user's vector field is traced once with `jax.make_jaxpr` on the state's shapes and
its jaxpr interpreted: indexing, slicing, reshaping and stacking of state-derived
values become operations on NumPy object arrays of components; elementwise primitives
are applied component by component; any other primitive receives its inputs
re-assembled with `jnp.stack` and is bound as usual. The result is the same
computation, so values (and derivatives) agree with the array form to round-off.
"""

import contextlib
import contextvars
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core


# States with at most this many elements in total are held as components.
MAX_COMPONENTS = 32
# Matrix products needing more scalar multiplications than this stay matrix products.
_MAX_SCALAR_PRODUCTS = 4 * MAX_COMPONENTS

_ELEMENTWISE = frozenset(
    """
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp
    convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2
    expm1 floor ge gt igamma integer_pow is_finite le lgamma log log1p logistic lt max
    min mul ne neg nextafter not or pow reduce_precision rem round rsqrt select_n sign
    sin sinh sqrt square sub tan tanh xor
    """.split()
)


# Operations a component trace may still emit (`None`: no limit); see
# `operation_budget`.
_budget: contextvars.ContextVar = contextvars.ContextVar("budget", default=None)


@contextlib.contextmanager
def operation_budget(limit: int):
    """Within this context a trace of a field on components emits at most about
    `limit` scalar operations on traced values (each is one equation of the
    resulting jaxpr); past that it goes on in array form, which is quick to trace.
    Yields a callable that says whether the limit was passed: a field whose
    unrolled form is too large is told apart without unrolling all of it (an MLP
    with a 32-wide layer: 808 operations)."""
    left = [limit]
    token = _budget.set(left)
    try:
        yield lambda: left[0] < 0
    finally:
        _budget.reset(token)


def _over_budget() -> bool:
    left = _budget.get()
    return left is not None and left[0] < 0


def _spend(values) -> None:
    """Count the traced values among `values` (each the result of one operation)
    against the budget, if there is one."""
    left = _budget.get()
    if left is not None:
        left[0] -= sum(isinstance(v, jax.core.Tracer) for v in values)


@jax.custom_jvp
def _divide(x, y):
    """`x / y`, its value rounded as `lax.div` rounds it, with a derivative that
    divides once: `(dx - (x / y) dy) * (1 / y)`.

    JAX's own rule divides every tangent by `y` (and by `y**2`): a forward-mode
    Jacobian with `P` parameters divides `2 P` times per division of the field,
    where this takes one reciprocal, shared by the tangents. (`gs.fit`'s Jacobian
    blocks of 32 FitzHugh-Nagumo experiments, whose field divides by a
    parameter: 1.44-1.61 ms with JAX's rule, 1.06-1.12 ms with this one.) The
    value is `lax.div`'s, bit for bit; the derivative differs from JAX's by
    rounding only."""
    return jax.lax.div(x, y)


@_divide.defjvp
def _divide_jvp(primals, tangents):
    x, y = primals
    dx, dy = tangents
    out = jax.lax.div(x, y)
    return out, (dx - out * dy) * (1 / y)


class _Comp:
    """A value held as an object array of per-element scalars."""

    __slots__ = ("elems", "dtype")

    def __init__(self, elems: np.ndarray, dtype):
        self.elems = elems
        self.dtype = dtype


def _split(x, shape) -> np.ndarray:
    """An array (or tracer) of `shape` as an object array of its elements."""
    out = np.empty(shape, dtype=object)
    if len(shape) == 0:
        out[()] = x
        return out
    flat = jnp.reshape(x, (-1,)) if not isinstance(x, np.ndarray) else x.reshape(-1)
    for i, idx in enumerate(np.ndindex(*shape)):
        out[idx] = flat[i]
    return out


def _stack(elems: np.ndarray, dtype):
    """An object array of scalars as one array."""
    if elems.ndim == 0:
        return jnp.asarray(elems[()], dtype=dtype)
    if elems.size == 0:  # `jnp.stack` needs at least one array
        return jnp.zeros(elems.shape, dtype)
    flat = [jnp.asarray(e, dtype=dtype) for e in elems.reshape(-1)]
    return jnp.reshape(jnp.stack(flat), elems.shape)


def _as_elems(value, aval) -> np.ndarray:
    if isinstance(value, _Comp):
        return value.elems
    return _split(value, aval.shape)


def _materialise(value, aval):
    if isinstance(value, _Comp):
        return _stack(value.elems, aval.dtype)
    return value


def _take(x: np.ndarray, i: int, axis: int) -> np.ndarray:
    """`np.take(x, i, axis)`, always as an object array (also when 0-d)."""
    return np.take(x, [i], axis=axis).reshape(x.shape[:axis] + x.shape[axis + 1 :])


def _reduce(fn, elems, axes):
    out = elems
    for axis in sorted(axes, reverse=True):
        parts = [_take(out, i, axis) for i in range(out.shape[axis])]
        out = functools.reduce(lambda a, b: _map2(fn, a, b), parts)
    return out


def _map2(fn, a, b):
    out = np.empty(a.shape, dtype=object)
    for idx in np.ndindex(*a.shape):
        out[idx] = fn(a[idx], b[idx])
    return out


def _structural(prim, params, elems):
    """Shape-only primitives on object arrays; `None` if not handled."""
    name = prim.name
    (x,) = elems if len(elems) == 1 else (None,)
    if name == "squeeze":
        return np.squeeze(x, axis=tuple(params["dimensions"]))
    if name == "reshape":
        if params.get("dimensions") is not None:
            return None
        return x.reshape(params["new_sizes"])
    if name == "broadcast_in_dim":
        shape = tuple(params["shape"])
        expanded = [1] * len(shape)
        for i, d in enumerate(params["broadcast_dimensions"]):
            expanded[d] = x.shape[i]
        return np.broadcast_to(x.reshape(expanded), shape)
    if name == "slice":
        strides = params["strides"] or (1,) * x.ndim
        index = tuple(
            slice(start, stop, step)
            for start, stop, step in zip(
                params["start_indices"], params["limit_indices"], strides
            )
        )
        return x[index]
    if name == "transpose":
        return x.transpose(params["permutation"])
    if name == "rev":
        return np.flip(x, axis=tuple(params["dimensions"]))
    if name == "concatenate":
        return np.concatenate(elems, axis=params["dimension"])
    if name == "stack":
        return np.stack(elems, axis=params["axis"])
    return None


def _eval(jaxpr, consts, args):
    env = {}

    def read(v):
        if isinstance(v, jex_core.Literal):
            return v.val
        return env[v]

    def write(v, value):
        env[v] = value

    for v, c in zip(jaxpr.constvars, consts):
        write(v, c)
    for v, a in zip(jaxpr.invars, args):
        write(v, a)

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        avals = [v.aval for v in eqn.invars]
        out_avals = [v.aval for v in eqn.outvars]
        prim = eqn.primitive
        outs = None
        has_comp = any(isinstance(x, _Comp) for x in invals)
        if has_comp:
            outs = _eval_comp(eqn, prim, invals, avals, out_avals)
        if outs is None:
            invals = [_materialise(x, a) for x, a in zip(invals, avals)]
            ans = prim.bind(*invals, **prim.get_bind_params(eqn.params))
            outs = ans if prim.multiple_results else [ans]
        for v, x in zip(eqn.outvars, outs):
            write(v, x)
    return [read(v) for v in jaxpr.outvars]


def _eval_comp(eqn, prim, invals, avals, out_avals):
    """Evaluate `eqn` keeping components; `None` to fall back to the array form."""
    if _over_budget():
        return None
    name = prim.name
    if name in ("pjit", "jit", "closed_call", "core_call"):
        closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if isinstance(closed, jex_core.ClosedJaxpr):
            return _eval(closed.jaxpr, closed.consts, invals)
        return _eval(closed, [], invals)
    if prim.multiple_results and name not in ("unstack",):
        return None
    if name == "unstack":
        x = _as_elems(invals[0], avals[0])
        axis = eqn.params["axis"]
        return [
            _Comp(_take(x, i, axis), out_avals[0].dtype) for i in range(x.shape[axis])
        ]
    (out_aval,) = out_avals
    if name in _ELEMENTWISE:
        shape = out_aval.shape
        elems = []
        for x, a in zip(invals, avals):
            e = _as_elems(x, a)
            elems.append(np.broadcast_to(e, shape) if e.shape != shape else e)
        out = np.empty(shape, dtype=object)
        bind = functools.partial(prim.bind, **eqn.params)
        if name == "div" and jnp.issubdtype(out_aval.dtype, jnp.floating):
            bind = _divide
        for idx in np.ndindex(*shape):
            out[idx] = bind(*(e[idx] for e in elems))
        _spend(out.flat)
        return [_Comp(out, out_aval.dtype)]
    if name in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod"):
        op = {
            "reduce_sum": jax.lax.add,
            "reduce_max": jax.lax.max,
            "reduce_min": jax.lax.min,
            "reduce_prod": jax.lax.mul,
        }[name]
        x = _as_elems(invals[0], avals[0])
        out = _reduce(op, x, eqn.params["axes"])
        return [
            _Comp(np.asarray(out, dtype=object).reshape(out_aval.shape), out_aval.dtype)
        ]
    if name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        if lb or rb:
            return None
        pref = eqn.params.get("preferred_element_type")
        if pref is not None and any(
            jnp.dtype(a.dtype) != jnp.dtype(pref) for a in avals
        ):
            return None
        k = int(np.prod([avals[0].shape[i] for i in lc], dtype=int))
        products = int(np.prod(avals[0].shape, dtype=int)) * int(
            np.prod(avals[1].shape, dtype=int)
        )
        if k and products // k > _MAX_SCALAR_PRODUCTS:
            # A large product (e.g. a neural network layer) as scalar operations
            # would bloat the program; keep it one dot on the stacked inputs (and
            # do not split an operand that is an array into elements first).
            return None
        a = _as_elems(invals[0], avals[0])
        b = _as_elems(invals[1], avals[1])
        a = np.moveaxis(a, tuple(lc), tuple(range(a.ndim - len(lc), a.ndim)))
        b = np.moveaxis(b, tuple(rc), tuple(range(len(rc))))
        a2 = a.reshape(-1, k)
        b2 = b.reshape(k, -1)
        out = np.empty((a2.shape[0], b2.shape[1]), dtype=object)
        for i in range(a2.shape[0]):
            for j in range(b2.shape[1]):
                acc = None
                for m in range(k):
                    term = jax.lax.mul(a2[i, m], b2[m, j])
                    acc = term if acc is None else jax.lax.add(acc, term)
                    _spend((term,) if acc is term else (term, acc))
                out[i, j] = acc if acc is not None else jnp.zeros((), out_aval.dtype)
        return [_Comp(out.reshape(out_aval.shape), out_aval.dtype)]
    elems = [_as_elems(x, a) for x, a in zip(invals, avals)]
    out = _structural(prim, eqn.params, elems)
    if out is None:
        return None
    return [_Comp(np.asarray(out, dtype=object), out_aval.dtype)]


def num_components(leaves) -> int:
    return sum(int(np.prod(jnp.shape(x), dtype=int)) for x in leaves)


class Layout(eqx.Module):
    """How a list of state leaves maps to a flat list of components."""

    shapes: tuple = eqx.field(static=True)
    dtypes: tuple = eqx.field(static=True)

    @classmethod
    def of(cls, leaves):
        return cls(
            shapes=tuple(tuple(jnp.shape(x)) for x in leaves),
            dtypes=tuple(jnp.result_type(x) for x in leaves),
        )

    def split(self, leaves, batch_dims: int = 0) -> list:
        """Leaves (with `batch_dims` leading axes) to components."""
        out = []
        for x, shape in zip(leaves, self.shapes):
            lead = jnp.shape(x)[:batch_dims]
            flat = jnp.reshape(x, lead + (-1,))
            out.extend(flat[..., i] for i in range(flat.shape[-1]))
        return out

    def merge(self, comps, batch_dims: int = 0) -> list:
        """Components (with `batch_dims` leading axes) to leaves."""
        out = []
        i = 0
        # A zero-size leaf has no components to read the batch axes from.
        lead = jnp.shape(comps[0])[:batch_dims]
        for shape, dtype in zip(self.shapes, self.dtypes):
            n = int(np.prod(shape, dtype=int))
            parts = [jnp.asarray(c, dtype) for c in comps[i : i + n]]
            i += n
            if n == 0:
                out.append(jnp.zeros(lead + shape, dtype))
                continue
            out.append(jnp.reshape(jnp.stack(parts, axis=-1), lead + shape))
        return out


def trajectory_struct(shape, dtype) -> jax.ShapeDtypeStruct:
    """The type of one trajectory's array here. Inside `jax.shard_map` (a sharded
    ensemble) values carry the device mesh in their type: the traced vector field
    must see the same types as the closure-converted one was built with."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return jax.ShapeDtypeStruct(shape, dtype)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def struct_of(x) -> jax.ShapeDtypeStruct:
    return trajectory_struct(jnp.shape(x), jnp.result_type(x))
