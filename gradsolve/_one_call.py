"""`gs.diffeqsolve` as one compiled program, and its reverse-mode derivative.

The solve is a `custom_vjp`: forward, the adaptive recording of `_record.py`
(keeping checkpointed states when it is differentiated); backward, the discrete
adjoint of the accepted steps (`_adjoint.py`), which is the derivative Diffrax
returns by default.
"""

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

from ._adjoint import adjoint_loop
from ._diagnose import throw_in_graph
from ._fallback import refuse_time_derivatives
from ._problem import LeafProblem, has_jump_ts, prepare
from ._record import record_loop
from ._solution import Solution
from ._tracing import differentiated_inside_jit


def _scalars_as_arrays(diff):
    """`diff` with its Python-number leaves as arrays. Differentiated inline, a
    `custom_vjp`'s rules receive the primal of a traced Python scalar as a
    number-like literal, not an array; the field was closure-converted with an
    array in its place."""
    number = lambda x: isinstance(x, (int, float, complex))
    return jtu.tree_map(lambda x: jnp.asarray(x) if number(x) else x, diff)


def record_steps(
    diff, solver, t0, t1, dt0, controller, plan, max_steps, treedef, keep, kernel
):
    """The adaptive solve of `diff = (y0, args, f)`, recording its accepted steps
    (`_record.record_loop`); with `keep`, also the checkpointed states the adjoint
    walks back from."""
    y0, args, f = _scalars_as_arrays(diff)
    problem = LeafProblem(f=f, args=args, treedef=treedef)
    return record_loop(
        problem,
        solver,
        t0,
        t1,
        dt0,
        y0,
        controller,
        plan,
        max_steps,
        keep_states=keep,
        has_jumps=has_jump_ts(controller),
        kernel=kernel,
    )


@eqx.filter_custom_vjp
def _solve(diff, solver, t0, t1, dt0, controller, plan, max_steps, treedef, kernel):
    return record_steps(
        diff, solver, t0, t1, dt0, controller, plan, max_steps, treedef, False, kernel
    )


@_solve.def_fwd
def _solve_fwd(
    perturbed, diff, solver, t0, t1, dt0, controller, plan, max_steps, treedef, kernel
):
    # The adjoint needs checkpointed states, which only the XLA loop keeps.
    del perturbed, kernel
    out = record_steps(
        diff, solver, t0, t1, dt0, controller, plan, max_steps, treedef, True, "xla"
    )
    residuals = (
        out.mesh,
        out.states,
        out.layout,
        out.checkpoint_every,
        out.segment_length,
    )
    out = eqx.tree_at(lambda o: o.states, out, None, is_leaf=lambda x: x is None)
    return out, residuals


@_solve.def_bwd
def _solve_bwd(
    residuals,
    grad_obj,
    perturbed,
    diff,
    solver,
    t0,
    t1,
    dt0,
    controller,
    plan,
    max_steps,
    treedef,
    kernel,
):
    del perturbed, t0, t1, dt0, controller, max_steps, kernel
    mesh, states, layout, every, length = residuals
    ys_bar = [
        jnp.zeros((plan.size(mesh.max_steps),) + y.shape, y.dtype) if g is None else g
        for g, y in zip(grad_obj.ys, diff[0])
    ]
    diff = _scalars_as_arrays(diff)
    return adjoint_loop(
        solver, mesh, states, layout, plan, ys_bar, diff, treedef, every, length
    )


def _prepare_and_convert(terms, t0, t1, dt0, y0, args, saveat):
    """`(prepared, f, dynamic args)`: the inputs checked and flattened
    (`_problem.prepare`), and the vector field with its closed-over arrays made
    explicit."""
    t0, t1, dt0, saveat = refuse_time_derivatives(t0, t1, dt0, saveat)
    prepared = prepare(terms, t0, t1, dt0, y0, args, saveat)
    # Make closed-over arrays of the vector field explicit, so that they are
    # differentiated like `args` (and custom_vjp sees no closed-over tracers). The
    # non-array part of `args` is closed over too: a function passed in `args` may
    # itself close over arrays being differentiated.
    dynamic, static = eqx.partition(args, eqx.is_array)
    field = prepared.problem.f
    f = eqx.filter_closure_convert(
        lambda t, y, a: field(t, y, eqx.combine(a, static)),
        prepared.t0,
        jtu.tree_unflatten(prepared.problem.treedef, prepared.y0),
        dynamic,
    )
    return prepared, f, dynamic


def _fast_diffeqsolve_traced(
    terms,
    solver,
    t0,
    t1,
    dt0,
    y0,
    args,
    saveat,
    stepsize_controller,
    max_steps,
    throw,
    kernel,
):
    prepared, f, args = _prepare_and_convert(terms, t0, t1, dt0, y0, args, saveat)
    treedef = prepared.problem.treedef
    out = _solve(
        (prepared.y0, args, f),
        solver,
        prepared.t0,
        prepared.t1,
        prepared.dt0,
        stepsize_controller,
        prepared.plan,
        max_steps,
        treedef,
        kernel,
    )
    ys = out.ys
    if throw:
        ys = throw_in_graph(
            ys,
            out.result,
            max_steps,
            prepared.valid,
            out.t_reached,
            prepared.t0,
            prepared.t1,
        )
    return Solution(
        t0=prepared.t0,
        t1=prepared.t1,
        ts=out.ts,
        ys=jtu.tree_unflatten(treedef, ys),
        stats=out.stats,
        result=out.result,
        mesh=out.mesh,
    )


_fast_diffeqsolve_jitted = eqx.filter_jit(_fast_diffeqsolve_traced)


def fast_diffeqsolve(*inputs):
    """The solve as one compiled program; traced inline where it is differentiated
    inside the caller's `jit` (see `_tracing.py`)."""
    if differentiated_inside_jit():
        return _fast_diffeqsolve_traced(*inputs)
    return _fast_diffeqsolve_jitted(*inputs)
