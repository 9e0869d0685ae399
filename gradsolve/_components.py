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

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
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
        for idx in np.ndindex(*shape):
            out[idx] = prim.bind(*(e[idx] for e in elems), **eqn.params)
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
        a = _as_elems(invals[0], avals[0])
        b = _as_elems(invals[1], avals[1])
        a = np.moveaxis(a, tuple(lc), tuple(range(a.ndim - len(lc), a.ndim)))
        b = np.moveaxis(b, tuple(rc), tuple(range(len(rc))))
        k = int(np.prod([avals[0].shape[i] for i in lc], dtype=int))
        a2 = a.reshape(-1, k)
        b2 = b.reshape(k, -1)
        if a2.shape[0] * b2.shape[1] * k > _MAX_SCALAR_PRODUCTS:
            # A large product (e.g. a neural network layer) as scalar operations
            # would bloat the program; keep it one dot on the stacked inputs.
            return None
        out = np.empty((a2.shape[0], b2.shape[1]), dtype=object)
        for i in range(a2.shape[0]):
            for j in range(b2.shape[1]):
                acc = None
                for m in range(k):
                    term = jax.lax.mul(a2[i, m], b2[m, j])
                    acc = term if acc is None else jax.lax.add(acc, term)
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


def _split_args(args):
    """`args` as (static part, its array leaves' treedef, the leaves' structs, inputs):
    small floating-point leaves are split into components once, here, so that the
    vector field's indexing of them (e.g. `a, b, c = args`) is free and their
    cotangents are accumulated per component."""
    dynamic, static = eqx.partition(args, eqx.is_array)
    leaves, treedef = jtu.tree_flatten(dynamic)
    structs = [_struct_of(x) for x in leaves]
    inputs = []
    for x, st in zip(leaves, structs):
        if jnp.issubdtype(st.dtype, jnp.inexact) and 0 < x.size <= MAX_COMPONENTS:
            inputs.append(_Comp(_split(x, st.shape), st.dtype))
        else:
            inputs.append(x)
    return static, treedef, structs, inputs


def args_from_elements(static, treedef, structs, elements) -> tuple:
    """The `(static, treedef, structs, inputs)` of `_split_args`, for `args` whose
    array leaves are already given element by element (`elements[i]` lists the
    elements of leaf `i` in row-major order, e.g. per-lane rows inside a kernel)."""
    inputs = []
    for st, elems in zip(structs, elements):
        out = np.empty(len(elems), dtype=object)
        for j, e in enumerate(elems):
            out[j] = e
        inputs.append(_Comp(out.reshape(st.shape), st.dtype))
    return static, treedef, structs, inputs


def component_field(f, treedef, layout: Layout, t, comps, split_args) -> list:
    """`f(t, y, args)` for `y` given as components; returns components."""
    structs = [trajectory_struct(s, d) for s, d in zip(layout.shapes, layout.dtypes)]
    static, args_treedef, args_structs, args_inputs = split_args

    def g(t, y_leaves, args_leaves):
        y = jtu.tree_unflatten(treedef, y_leaves)
        args = eqx.combine(jtu.tree_unflatten(args_treedef, args_leaves), static)
        return jtu.tree_leaves(f(t, y, args))

    closed = jax.make_jaxpr(g)(t, structs, args_structs)
    inputs = [t]
    i = 0
    for shape, dtype in zip(layout.shapes, layout.dtypes):
        n = int(np.prod(shape, dtype=int))
        elems = np.empty(n, dtype=object)
        for j in range(n):
            elems[j] = comps[i + j]
        i += n
        inputs.append(_Comp(elems.reshape(shape), dtype))
    inputs.extend(args_inputs)
    outs = _eval(closed.jaxpr, closed.consts, inputs)
    result = []
    for x, v, dtype in zip(outs, closed.jaxpr.outvars, layout.dtypes):
        elems = _as_elems(x, v.aval).reshape(-1)
        result.extend(jnp.asarray(e, dtype) for e in elems)
    return result


class ComponentProblem:
    """A `LeafProblem` whose state is a flat list of components (see `Layout`)."""

    def __init__(self, f, args, treedef, layout, split_args=None):
        self.f = f
        self.treedef = treedef
        self.layout = layout
        self.split_args = _split_args(args) if split_args is None else split_args

    def vf(self, t, comps):
        return component_field(
            self.f, self.treedef, self.layout, t, comps, self.split_args
        )


REPRESENTATIONS = ("auto", "components", "array")
# "auto" holds a state as components when the vector field evaluated on them takes
# at most this many operations, or this many times the operations of the field on
# arrays (whichever is larger): past that the unrolled program costs more to
# compile, and to run, than the elementwise form saves (see `count_operations`).
COMPONENT_OPS_FLOOR = 64
COMPONENT_OPS_RATIO = 4
# ... and when it has no control flow or linear algebra: a field that interpolates
# data (a `scan` in `searchsorted`) or inverts a matrix is not the straight-line
# scalar arithmetic that components speed up, and unrolled around such operations
# its gradient compiled for minutes (a Kalman filter, 6 states).
STRUCTURED = frozenset(
    """
    scan while cond custom_linear_solve lu cholesky triangular_solve eig eigh svd qr
    householder_product schur
    """.split()
)


def check_representation_option(representation) -> None:
    """Raise for a `representation=` value that is not one of `REPRESENTATIONS`."""
    if not isinstance(representation, str) or representation not in REPRESENTATIONS:
        raise ValueError(
            f"representation={representation!r} is not an option: pass "
            "representation='auto' (components for a small state whose vector field "
            "stays small when unrolled, else arrays), 'components' or 'array'."
        )


def equations(jaxpr):
    """Every equation of `jaxpr` and of its sub-jaxprs, each with its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        subs = [
            p.jaxpr if isinstance(p, jex_core.ClosedJaxpr) else p
            for p in eqn.params.values()
            if isinstance(p, (jex_core.ClosedJaxpr, jex_core.Jaxpr))
        ]
        yield eqn, subs
        for sub in subs:
            yield from equations(sub)


def count_operations(jaxpr) -> int:
    """The primitive operations of `jaxpr`, those of its sub-jaxprs included (an
    equation that only holds sub-jaxprs counts as theirs)."""
    return sum(1 for _, subs in equations(jaxpr) if not subs)


def _primitives(jaxpr) -> set[str]:
    """The names of the primitives of `jaxpr` and of its sub-jaxprs."""
    return {eqn.primitive.name for eqn, _ in equations(jaxpr)}


def _struct_of(x) -> jax.ShapeDtypeStruct:
    return trajectory_struct(jnp.shape(x), jnp.result_type(x))


def array_field_jaxpr(problem, shapes, dtypes, time_dtype):
    """The jaxpr of one evaluation of `problem`'s field (a `LeafProblem`) on a state
    of leaves of `shapes` and `dtypes` (traced, not compiled).

    The arrays of the field and its `args` enter as inputs of the trace, so that
    it is the same whether they are constants or tracers of an enclosing `jit` or
    `vmap` (a recording and its replay decide alike)."""
    dynamic, static = eqx.partition((problem.f, problem.args), eqx.is_array)

    def on_arrays(t, leaves, dynamic):
        f, args = eqx.combine(dynamic, static)
        return jtu.tree_leaves(f(t, jtu.tree_unflatten(problem.treedef, leaves), args))

    t = trajectory_struct((), time_dtype)
    leaves = [trajectory_struct(s, d) for s, d in zip(shapes, dtypes)]
    structs = jtu.tree_map(_struct_of, dynamic)
    return jax.make_jaxpr(on_arrays)(t, leaves, structs).jaxpr


def _operation_counts(problem, layout: Layout, time_dtype) -> tuple[int, int] | None:
    """The operations of one evaluation of `problem`'s field on components and on
    arrays (traced, not compiled); `None` if the field has `STRUCTURED` primitives
    (then it is not traced on components at all).

    Both traces take the field's arrays as inputs (see `array_field_jaxpr`)."""
    array_jaxpr = array_field_jaxpr(problem, layout.shapes, layout.dtypes, time_dtype)
    if _primitives(array_jaxpr) & STRUCTURED:
        return None
    dynamic, static = eqx.partition((problem.f, problem.args), eqx.is_array)
    structs = jtu.tree_map(_struct_of, dynamic)
    t = trajectory_struct((), time_dtype)
    comps = [trajectory_struct((), d) for s, d in zip(layout.shapes, layout.dtypes)
             for _ in range(int(np.prod(s, dtype=int)))]  # fmt: skip

    def on_components(t, comps, dynamic):
        f, args = eqx.combine(dynamic, static)
        return ComponentProblem(f, args, problem.treedef, layout).vf(t, comps)

    n_comps = count_operations(jax.make_jaxpr(on_components)(t, comps, structs).jaxpr)
    return n_comps, count_operations(array_jaxpr)


def choose_layout(leaves, problem=None, representation: str = "auto", t=None):
    """The component `Layout` for a state of `leaves`, or `None` to hold it as
    arrays.

    `"array"` never splits; `"components"` splits any floating-point state;
    `"auto"` splits a floating-point state of at most `MAX_COMPONENTS` elements
    when the field on components takes at most
    `max(COMPONENT_OPS_FLOOR, COMPONENT_OPS_RATIO * array operations)` operations
    and has none of the `STRUCTURED` primitives
    (`problem` is needed for that count, and `t`, a time, for its dtype; without
    `problem` the size alone decides).
    """
    check_representation_option(representation)
    floating = all(jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves)
    size = num_components(leaves)
    if representation == "array" or not floating or size == 0:
        return None
    layout = Layout.of(leaves)
    if representation == "components":
        return layout
    if size > MAX_COMPONENTS:
        return None
    if problem is None:
        return layout
    time_dtype = jnp.result_type(*layout.dtypes) if t is None else jnp.result_type(t)
    counts = _operation_counts(problem, layout, time_dtype)
    if counts is None:
        return None
    n_comps, n_array = counts
    if n_comps <= max(COMPONENT_OPS_FLOOR, COMPONENT_OPS_RATIO * n_array):
        return layout
    return None


class Representation:
    """How the solvers hold a state given as a list of `leaves`: as scalar components
    or as the leaves themselves, as `choose_layout` decides for `problem` (the
    `LeafProblem` to be solved) and the `representation` option.

    `split(leaves, batch_dims)` and `merge(comps, batch_dims)` convert (with
    `batch_dims` leading axes); `field(problem)` is the vector field on the
    representation. Build the field outside any loop over steps: it splits the
    problem's `args` once.
    """

    def __init__(self, leaves, problem=None, representation: str = "auto", t=None):
        self.layout = choose_layout(leaves, problem, representation, t)

    def split(self, leaves, batch_dims: int = 0) -> list:
        if self.layout is None:
            return list(leaves)
        return self.layout.split(leaves, batch_dims)

    def merge(self, comps, batch_dims: int = 0) -> list:
        if self.layout is None:
            return list(comps)
        return self.layout.merge(comps, batch_dims)

    def carries_fsal(self, solver) -> bool:
        """Whether a loop over the steps of `solver` carries the field at the end of
        each step into the next (first same as last), or evaluates it again at the
        start of the next.

        On scalar components every operation of a step is elementwise, and XLA
        fuses the whole step into one kernel per output: evaluating the field once
        more at the start of a step costs nothing there, while a carried field is
        one more kernel per component per step, and one more state per step kept
        for the backward pass (a replay of Lotka-Volterra, 1,024 trajectories, 320
        steps: the gradient 31 ms carried against 20 ms not, the forward 5.3
        against 3.6 ms). In array form the field is made of matrix products, and the
        carry saves one of them per step. Either way the field is evaluated on the
        same state at the same time.
        """
        return solver.fsal and self.layout is None

    def field(self, problem, split_args=None):
        """`problem.vf` (a `LeafProblem`'s field) on this representation.

        `split_args` (see `args_from_elements`) replaces splitting `problem.args`,
        for arguments that arrive already split into elements."""
        if self.layout is None:
            return problem.vf
        cp = ComponentProblem(
            problem.f, problem.args, problem.treedef, self.layout, split_args
        )
        return cp.vf
