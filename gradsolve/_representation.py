"""Which form the solvers hold a state in: scalar components or arrays.

`Representation` is the choice made for one problem: `"components"` (see
`_components.py`) for a small state whose vector field stays small when unrolled
on them, else `"array"`, its field evaluated on the state's elements if it reads
them one by one (`_reads_elements`); the user may force either form
(`representation=` on the solvers). The rules are measured on the field's jaxpr
(`choose_layout`).
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.extend import core as jex_core

from ._component_field import ComponentProblem, ElementField
from ._components import (
    MAX_COMPONENTS,
    Layout,
    num_components,
    operation_budget,
    struct_of,
    trajectory_struct,
)
from ._solver.base import LoopedStages


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


# A larger state's field is not evaluated on its elements (`_reads_elements`): the
# trace on elements grows with the state.
MAX_ELEMENT_FIELD = 1024


# Primitives that take parts of an array or put arrays together: in a field held in
# array form they make the step loop over its stages (see `_loops_stages`).
SLICING = frozenset(
    """
    slice dynamic_slice dynamic_update_slice concatenate pad gather scatter
    scatter-add rev
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
    structs = jtu.tree_map(struct_of, dynamic)
    return jax.make_jaxpr(on_arrays)(t, leaves, structs).jaxpr


def component_field_jaxpr(problem, layout: Layout, time_dtype, arg_limit=None):
    """The jaxpr of one evaluation of `problem`'s field on a state held as the
    components of `layout`, `args` leaves of at most `arg_limit` elements read
    element by element (traced, not compiled; inputs as in `array_field_jaxpr`)."""
    dynamic, static = eqx.partition((problem.f, problem.args), eqx.is_array)

    def on_components(t, comps, dynamic):
        f, args = eqx.combine(dynamic, static)
        cp = ComponentProblem(f, args, problem.treedef, layout, arg_limit=arg_limit)
        return cp.vf(t, comps)

    t = trajectory_struct((), time_dtype)
    comps = [trajectory_struct((), d) for s, d in zip(layout.shapes, layout.dtypes)
             for _ in range(int(np.prod(s, dtype=int)))]  # fmt: skip
    structs = jtu.tree_map(struct_of, dynamic)
    return jax.make_jaxpr(on_components)(t, comps, structs).jaxpr


def _components_are_small(
    problem,
    layout: Layout,
    time_dtype,
    array_jaxpr,
    arg_limit=None,
    floor: int = COMPONENT_OPS_FLOOR,
) -> bool:
    """Whether one evaluation of `problem`'s field on components takes at most
    `max(floor, COMPONENT_OPS_RATIO * n)` operations, `n` those it takes on
    arrays (`array_jaxpr()`, the field's jaxpr on arrays), and the field has none
    of the `STRUCTURED` primitives (then it is not traced on components at all).
    Traced, not compiled; the trace on components goes on in array form once past
    that limit."""
    array_jaxpr = array_jaxpr()
    if _primitives(array_jaxpr) & STRUCTURED:
        return False
    n_array = count_operations(array_jaxpr)
    limit = max(floor, COMPONENT_OPS_RATIO * n_array)
    with operation_budget(limit) as exceeded:
        jaxpr = component_field_jaxpr(problem, layout, time_dtype, arg_limit)
    return not exceeded() and count_operations(jaxpr) <= limit


def _reads_elements(problem, leaves, t, array_jaxpr) -> Layout | None:
    """The `Layout` of a state of `leaves` held as arrays whose field is evaluated
    on its elements (`ElementField`), or `None`: for a floating-point state of
    more than `MAX_COMPONENTS` and at most `MAX_ELEMENT_FIELD` elements whose field
    on elements takes at most `COMPONENT_OPS_RATIO` times its operations on arrays
    (and has no `STRUCTURED` primitive). A field written element by element takes
    about as many on elements as on arrays (a 40-species network: 556 against
    1,269, its reads free; with `dy.at[i].set`: 3,957 against 1,349); a field on
    the whole state many times more (`-0.5 * y` on 40 elements: 40 against 1),
    with no floor as for components."""
    floating = all(jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves)
    size = num_components(leaves)
    if not floating or not MAX_COMPONENTS < size <= MAX_ELEMENT_FIELD:
        return None
    layout = Layout.of(leaves)
    time_dtype = jnp.result_type(*layout.dtypes) if t is None else jnp.result_type(t)
    small = _components_are_small(
        problem, layout, time_dtype, array_jaxpr, size, floor=0
    )
    return layout if small else None


def _loops_stages(array_jaxpr) -> bool:
    """Whether an explicit Runge--Kutta step of a field held in array form, whose
    jaxpr on arrays `array_jaxpr()` returns, computes its stages in a loop
    (`LoopedStages`) rather than unrolled: when the field slices, pads or
    concatenates its state (`SLICING`) and has no matrix product.

    Measured on a 48-state diffusion chain (slices and a concatenation), 64 and
    1,024 trajectories: the replay gradient 26 -> 6.9 ms and 344 -> 66 ms in a loop,
    the one-call gradient 29 -> 7.7 ms and 491 -> 213 ms. With matrix products the
    unrolled step is faster (an MLP field: 4.1 against 5.6 ms and 81 against 89 ms;
    a dense linear field alike), and so it is for an elementwise field at 1,024
    trajectories (one-call gradient 233 against 293 ms).
    """
    names = _primitives(array_jaxpr())
    return bool(names & SLICING) and "dot_general" not in names


def leaves_field_jaxpr(problem, leaves, t):
    """`array_field_jaxpr` of `problem` on a state of `leaves`, at a time `t` (of
    the state's dtype if `None`)."""
    shapes = [jnp.shape(x) for x in leaves]
    dtypes = [jnp.result_type(x) for x in leaves]
    time_dtype = jnp.result_type(*dtypes) if t is None else jnp.result_type(t)
    return array_field_jaxpr(problem, shapes, dtypes, time_dtype)


def _traced_once(problem, leaves, t):
    """`leaves_field_jaxpr(problem, leaves, t)` as a function that traces it on its
    first call only."""
    return functools.cache(lambda: leaves_field_jaxpr(problem, leaves, t))


def choose_layout(
    leaves, problem=None, representation: str = "auto", t=None, array_jaxpr=None
):
    """The component `Layout` for a state of `leaves`, or `None` to hold it as
    arrays.

    `"array"` never splits; `"components"` splits any floating-point state;
    `"auto"` splits a floating-point state of at most `MAX_COMPONENTS` elements
    when the field on components takes at most
    `max(COMPONENT_OPS_FLOOR, COMPONENT_OPS_RATIO * array operations)` operations
    and has none of the `STRUCTURED` primitives
    (`problem` is needed for that count, and `t`, a time, for its dtype; without
    `problem` the size alone decides). `array_jaxpr`, if given, returns the
    field's jaxpr on arrays (`_traced_once`: so that a caller traces it once for
    several decisions).
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
    if array_jaxpr is None:
        array_jaxpr = _traced_once(problem, leaves, t)
    small = _components_are_small(problem, layout, time_dtype, array_jaxpr)
    return layout if small else None


class Representation:
    """How the solvers hold a state given as a list of `leaves`: as scalar components
    or as the leaves themselves, as `choose_layout` decides for `problem` (the
    `LeafProblem` to be solved) and the `representation` option.

    `split(leaves, batch_dims)` and `merge(comps, batch_dims)` convert (with
    `batch_dims` leading axes); `field(problem)` is the vector field on the
    representation. In array form it is evaluated on the state's elements where
    `elements` is a `Layout` (see `_reads_elements`; only if `reads_elements`,
    by default with `"auto"`: the solver says, `AbstractGradsolveSolver.
    reads_elements`), and marked `LoopedStages` where `stage_loop` (see
    `_loops_stages`). Build the field outside any loop over steps: on components
    it splits the problem's `args` once.
    """

    def __init__(
        self,
        leaves,
        problem=None,
        representation: str = "auto",
        t=None,
        reads_elements: bool | None = None,
    ):
        # The field on arrays is traced at most once, for all decisions.
        array_jaxpr = _traced_once(problem, leaves, t)
        self.layout = choose_layout(leaves, problem, representation, t, array_jaxpr)
        if reads_elements is None:
            reads_elements = representation == "auto"
        self.elements = None
        if reads_elements and self.layout is None and problem is not None:
            self.elements = _reads_elements(problem, leaves, t, array_jaxpr)
        self.stage_loop = (
            self.layout is None and problem is not None and _loops_stages(array_jaxpr)
        )

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
            vf = problem.vf
            if self.elements is not None:
                vf = ElementField(
                    problem.f, problem.args, problem.treedef, self.elements
                )
            return LoopedStages(vf) if self.stage_loop else vf
        cp = ComponentProblem(
            problem.f, problem.args, problem.treedef, self.layout, split_args
        )
        return cp.vf
