"""The user's vector field on a state held as scalar components (see
`_components.py`), with its `args` split into elements once, outside the loops
over steps."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._components import (
    MAX_COMPONENTS,
    Layout,
    _as_elems,
    _Comp,
    _eval,
    _split,
    struct_of,
    trajectory_struct,
)
from ._unbatched import batched_like


def _splits(x, limit: int = MAX_COMPONENTS) -> bool:
    """Whether `_split_args` splits this array leaf of `args` into elements: a
    floating-point one of at most `limit` elements."""
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact) and 0 < x.size <= limit


def _unstack(x, shape) -> np.ndarray:
    """`_split`, by one `split` of the flattened array. Its transpose is one
    concatenation, where that of reading each element (`x[i]`) is a pad to the
    whole array per element, and the pads are summed (see `ElementField`)."""
    out = np.empty(shape, dtype=object)
    size = int(np.prod(shape, dtype=int))
    if size == 0:
        return out
    parts = jnp.split(jnp.reshape(x, (-1,)), size)
    for idx, part in zip(np.ndindex(*shape), parts):
        out[idx] = jnp.reshape(part, ())
    return out


def _split_args(args, limit: int = MAX_COMPONENTS, split=_split):
    """`args` as (static part, its array leaves' treedef, the leaves' structs, inputs):
    floating-point leaves of at most `limit` elements are split into components
    (by `split`, `_split` or `_unstack`) once, here, so that the vector field's
    indexing of them (e.g. `a, b, c = args`) is free and their cotangents are
    accumulated per component."""
    dynamic, static = eqx.partition(args, eqx.is_array)
    leaves, treedef = jtu.tree_flatten(dynamic)
    structs = [struct_of(x) for x in leaves]
    inputs = []
    for x, st in zip(leaves, structs):
        if _splits(x, limit):
            inputs.append(_Comp(split(x, st.shape), st.dtype))
        else:
            inputs.append(x)
    return static, treedef, structs, inputs


def batched_like_elements(args, refs):
    """`args` with the leaves that `_split_args` splits into elements batched like
    `refs` under `vmap` (`_unbatched.batched_like`); the other leaves as they are (a
    large weight matrix copied per trajectory would cost more than it saves)."""
    small, rest = eqx.partition(args, lambda x: eqx.is_array(x) and _splits(x))
    return eqx.combine(batched_like(small, refs), rest)


def batched_like_inputs(f, args, t, y, refs) -> tuple[Callable, object]:
    """`(field, args)`: the vector field `f(t, y, args)` and its `args`, with the
    arrays `f` closes over made part of `args`, and the small floating-point leaves
    of both batched like `refs` (`batched_like_elements`).

    Parameters are as often closed over by the field (`lambda t, y, args: -k * y`
    inside a loss of `k`) as passed in `args`: either way each trajectory reads its
    own elements, and a gradient with respect to them is summed over the batch
    once, not at every step. `t`, `y` are examples of the field's arguments."""
    converted = eqx.filter_closure_convert(f, t, y, args)
    consts, static = eqx.partition(converted, eqx.is_array)
    if not jtu.tree_leaves(consts):
        return f, batched_like_elements(args, refs)

    def field(t, y, args_and_consts):
        args, consts = args_and_consts
        return eqx.combine(consts, static)(t, y, args)

    return field, batched_like_elements((args, consts), refs)


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


def args_as_elements(args) -> tuple[list, Callable]:
    """`args` for a loop that differentiates with respect to them: `(flat,
    rebuild)`, where `flat` lists the array leaves of `args`, the small
    floating-point ones element by element (as `_split_args` splits them), and
    `rebuild(flat)` gives `_split_args(args)` back from such a list.

    A loop over steps whose field takes `rebuild(flat)` accumulates the
    cotangents of `flat`: one array per element, rather than each step scattering
    into the whole leaf."""
    static, treedef, structs, inputs = _split_args(args)
    flat, sizes = [], []
    for x in inputs:
        parts = list(x.elems.reshape(-1)) if isinstance(x, _Comp) else [x]
        flat.extend(parts)
        sizes.append(len(parts) if isinstance(x, _Comp) else None)

    def rebuild(flat):
        rebuilt, i = [], 0
        for st, size in zip(structs, sizes):
            if size is None:
                rebuilt.append(flat[i])
                i += 1
                continue
            elems = np.empty(size, dtype=object)
            for j in range(size):
                elems[j] = flat[i + j]
            i += size
            rebuilt.append(_Comp(elems.reshape(st.shape), st.dtype))
        return static, treedef, structs, rebuilt

    return flat, rebuild


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
    """A `LeafProblem` whose state is a flat list of components (see `Layout`).

    `args` leaves of at most `arg_limit` elements are read element by element."""

    def __init__(self, f, args, treedef, layout, split_args=None, arg_limit=None):
        self.f = f
        self.treedef = treedef
        self.layout = layout
        if split_args is None:
            split_args = _split_args(args, arg_limit or MAX_COMPONENTS)
        self.split_args = split_args

    def vf(self, t, comps):
        return component_field(
            self.f, self.treedef, self.layout, t, comps, self.split_args
        )


class ElementField:
    """The user's vector field `f(t, y, args)` on a state held as arrays (a list of
    leaves of `layout`), evaluated on the state's elements: the state and the
    `args` leaves of at most as many elements are split into elements once per
    evaluation (`_unstack`), the field runs on them as on components, and its
    output is stacked back into leaves.

    For a state too large to be held as components whose field reads it element by
    element (`y[0] * y[1]`, ..., `jnp.stack`), as kinetics models are written:
    each read of an element on arrays is a slice, whose transpose is a pad of the
    whole state, and the gradient sums one such pad per read. A 40-species network
    so written, 64 trajectories, 16 steps: Diffrax's gradient took 117 ms where
    its forward solve takes 3 ms; on elements the reads are free and the
    transpose of the one split is one concatenation (15 ms over a mesh).
    """

    def __init__(self, f, args, treedef, layout: Layout):
        self.f = f
        self.args = args
        self.treedef = treedef
        self.layout = layout
        size = sum(int(np.prod(shape, dtype=int)) for shape in layout.shapes)
        self.arg_limit = max(MAX_COMPONENTS, size)

    def __call__(self, t, leaves: list) -> list:
        comps = []
        for x, shape in zip(leaves, self.layout.shapes):
            comps.extend(_unstack(x, shape).reshape(-1))
        split_args = _split_args(self.args, self.arg_limit, _unstack)
        out = component_field(self.f, self.treedef, self.layout, t, comps, split_args)
        return self.layout.merge(out)
