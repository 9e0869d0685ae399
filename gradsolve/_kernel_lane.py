"""What one lane of the fused kernel computes: one step attempt and one dense save.

These functions are written for one trajectory, on scalars, and the kernel
(`_kernel.py`) maps them over the lanes of its block with `jax.vmap`, exactly as the
XLA recording is mapped over an ensemble. The step is the solver's own `step_leaves`,
the vector field the component field of `_components.py`, and the controller's
arithmetic Diffrax's (`_controller.py`): every accepted or rejected step is
computed as in the XLA loop, so both take the same steps.
"""

import dataclasses
import math

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

from ._component_field import args_from_elements
from ._controller import adapt_step_size
from ._problem import LeafProblem
from ._solver.interpolation import combine, normalised_time


@dataclasses.dataclass(frozen=True)
class LaneStatics:
    """Everything static that a lane needs: the solver, how to rebuild the vector
    field, `args` and the controller from their elements, and the loop's limits."""

    solver: object
    error_order: object
    representation: object
    treedef: object
    f_tree: object
    f_static: object
    f_structs: tuple
    a_tree: object
    a_static: object
    a_structs: tuple
    c_tree: object
    c_static: object
    c_structs: tuple
    cstate_tree: object


def _rebuild(elements, struct):
    if struct.shape == ():
        return elements[0]
    return jnp.stack(elements).reshape(struct.shape).astype(struct.dtype)


def _tree(tree, static, elements, structs):
    leaves = [_rebuild(e, s) for e, s in zip(elements, structs)]
    return eqx.combine(jtu.tree_unflatten(tree, leaves), static)


def lane_field(st: LaneStatics, k):
    """The vector field on components, for this lane's `args` and closure."""
    f = _tree(st.f_tree, st.f_static, k["f"], st.f_structs)
    split_args = args_from_elements(st.a_static, st.a_tree, st.a_structs, k["a"])
    problem = LeafProblem(f=f, args=None, treedef=st.treedef)
    return st.representation.field(problem, split_args)


def attempt(st: LaneStatics, s, k):
    """One step attempt of one lane, as one iteration of `_record.record_loop`.

    **Arguments:**

    - `s`: the lane's loop state (`tprev`, `tnext`, `y`, `cstate`, `f0` if FSAL).
    - `k`: the lane's constants (`ti1`, `direction`, `clip_floor`, and the elements
        of the closure `f`, `args` `a` and controller `c`).

    **Returns:**

    A dict: `keep`, the next `tprev`/`tnext`, the candidate `y1`, the stage
    increments `ks`, `f1` (FSAL), the controller state `cstate` and its `result`
    code.
    """
    vf = lane_field(st, k)
    controller = _tree(st.c_tree, st.c_static, k["c"], st.c_structs)
    tprev, tnext, y = s["tprev"], s["tnext"], s["y"]
    y1, y_error, ks, f1 = st.solver.step_leaves(
        vf, tprev, tnext, k["direction"], y, s.get("f0")
    )
    y_error = [jnp.where(jnp.isnan(e), jnp.inf, e) for e in y_error]
    cstate = jtu.tree_unflatten(st.cstate_tree, s["cstate"])
    sizes = tuple(math.prod(shape) for shape in st.representation.layout.shapes)
    keep, next_tprev, next_tnext, cstate, result = adapt_step_size(
        controller, tprev, tnext, y, y1, y_error, st.error_order, cstate, sizes
    )
    ti1 = k["ti1"]
    next_tprev = jnp.minimum(next_tprev, ti1)
    clip = next_tnext > k["clip_floor"]
    next_tnext = jnp.where(
        clip,
        jnp.where(keep, ti1, next_tprev + 0.5 * (ti1 - next_tprev)),
        next_tnext,
    )
    out = dict(
        keep=jnp.asarray(keep),
        tprev=next_tprev,
        tnext=next_tnext,
        y1=y1,
        ks=ks,
        cstate=[jnp.asarray(x) for x in jtu.tree_leaves(cstate)],
        result=jnp.asarray(result._value),
    )
    if f1 is not None and "f0" in s:
        out["f1"] = f1
    return out


def dense_save(st: LaneStatics, tprev, tnext, t, y, y1, ks):
    """The solver's dense output at `t` in the step `[tprev, tnext]`."""
    theta = normalised_time(tprev, t, tnext)
    weights = st.solver.interpolation_cls.weights(theta)
    return combine(weights, y, y1, ks)
