"""Saying where and why a solve failed.

Inside `jit` an error message must be static, so a failed solve reports only the
fraction of the interval it covered (`throw_in_graph`). Called eagerly,
`gs.diffeqsolve` and `gs.record` can do better: they look at the failed mesh on the
host, find the time the solve stopped at, the last step size and the state there,
probe the vector field just beyond it, and name the likely cause and its fix.
"""

import diffrax
import equinox as eqx
import jax
import jax.flatten_util
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._mesh import RecordedMesh
from ._replay import replay
from ._unbatched import batch_max_int


def is_concrete(*trees) -> bool:
    """Whether no array in `trees` is a tracer (so values can be read on the host)."""
    leaves = jtu.tree_leaves(trees)
    return not any(isinstance(x, jax.core.Tracer) for x in leaves)


def _code(result) -> int:
    """A concrete result's code, read on the host (comparing the results themselves
    would compile a small program the first time)."""
    return int(np.asarray(jtu.tree_leaves(result)[0]))


def _finite(tree) -> bool:
    return all(np.all(np.isfinite(np.asarray(x))) for x in jtu.tree_leaves(tree))


def _largest(tree) -> float:
    return max(float(np.max(np.abs(np.asarray(x)), initial=0.0)) for x in tree)


def _last_finite_state(mesh, ys):
    """`(n, y)`: the last accepted step whose state is finite in `ys` (a PyTree whose
    leaves have a leading axis over `t0` and each step's end), and that state."""
    n = int(mesh.num_steps)
    leaves = [np.asarray(x) for x in jtu.tree_leaves(ys)]
    for i in range(n, -1, -1):  # ys[i] is the state at ts[i]
        if _finite([x[i] for x in leaves]):
            return i, jtu.tree_map(lambda x: x[i], ys)
    return None


def _replayed_states(mesh, terms, solver, y0, args):
    """The states of a replay of the failed mesh at `t0` and each step's end.

    Only a stand-in for the recording's own states (`failure_message`'s `states`):
    on a stiff problem an explicit solver's accepted steps sit at its stability
    limit, where the recording's rejections kept it bounded and nothing keeps a
    replay's round-off from growing, so a replay can overflow where the recording
    never did (a recording never accepts a non-finite state).
    """
    try:
        return replay(
            mesh,
            terms,
            solver,
            y0,
            args,
            saveat=diffrax.SaveAt(t0=True, steps=True),
            stale="ignore",
            allow_partial=True,
        ).ys
    except Exception:
        return None


def _concrete_float(x) -> float | None:
    try:
        return None if x is None else float(x)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return None  # traced


def pid_settings(controller, *names: str) -> tuple | None:
    """The fields `names` of a `PIDController` (also one inside a
    `ClipStepSizeController`) as Python floats, each `None` where the field is
    `None` or traced; `None` if `controller` is not a PID controller."""
    inner = getattr(controller, "controller", controller)
    if not isinstance(inner, diffrax.PIDController):
        return None
    return tuple(_concrete_float(getattr(inner, name)) for name in names)


def _controller_cause(controller, h) -> tuple[str, str]:
    """A `PIDController(factormax < 1)`: no step may grow, so the steps shrink
    geometrically whatever the error (Diffrax then stalls the same way)."""
    (factormax,) = pid_settings(controller, "factormax") or (None,)
    if factormax is None or factormax >= 1:
        return "", ""
    return (
        f"PIDController(factormax={factormax:g}) lets no step grow: each step is at "
        f"most {factormax:g} times the one before, so the steps shrank to "
        f"{h:.3g} without reaching t1.",
        "Use factormax >= 1 (Diffrax's default is 10).",
    )


def _cause(
    mesh, terms, solver, y0, args, t0, t1, states, controller=None
) -> tuple[str, str]:
    """The likely cause of a failed solve and its fix, as two sentences."""
    ts = np.asarray(mesh.ts)
    span = abs(float(t1) - float(t0))
    try:
        ys = states() if states is not None else None
    except Exception:
        ys = None
    if ys is None:
        ys = _replayed_states(mesh, terms, solver, y0, args)
    found = None if ys is None else _last_finite_state(mesh, ys)
    if found is None:
        return "", ""
    n, y = found
    t_end = ts[n]
    h = abs(ts[n] - ts[n - 1]) if n > 0 else None
    direction = 1.0 if float(t1) >= float(t0) else -1.0
    base = h if h else span * 1e-6
    f = terms.vector_field
    for scale in (0.0, 1e-6, 1e-3, 1.0):
        t = t_end + direction * min(scale * base, abs(float(t1) - t_end))
        if not _finite(f(jnp.asarray(t, ts.dtype), y, args)):
            return (
                f"The vector field returns NaN or inf at t={t:.9g} (from the state "
                f"reached at t={t_end:.9g}), so every step past it was rejected and "
                "shrunk, as in Diffrax.",
                "Check f there (a square root or log of a negative number, a "
                "division by zero), or end the solve before that time.",
            )
    y0_size = _largest(jtu.tree_leaves(y0))
    if _largest(jtu.tree_leaves(y)) > 1e8 * (1.0 + y0_size):
        return (
            f"The solution grows without bound near t={t_end:.9g} (|y| reached "
            f"{_largest(jtu.tree_leaves(y)):.3g}): a finite-time blow-up.",
            "Check the model, or end the solve before that time.",
        )
    if h is not None and h < 1e-9 * span:
        cause, fix = _controller_cause(controller, h)
        if cause:
            return cause, fix
        return (
            f"The step size shrank to {h:.3g} at t={t_end:.9g}: the vector field is "
            "singular or discontinuous there.",
            "Remove the singularity, or pass the time of a discontinuity in "
            "PIDController(jump_ts=...).",
        )
    stiffness = _stiffness(f, t_end, y, args, h)
    if stiffness is not None:
        return (
            f"The problem looks stiff at t={t_end:.9g}: the steps (h={h:.3g}) are "
            f"held at the explicit solver's stability limit (h * |lambda| = "
            f"{stiffness:.2g} for the largest eigenvalue of the Jacobian), not by "
            "accuracy.",
            "Use a stiff solver, gs.Rodas5(), or raise max_steps.",
        )
    return "", ""


def _stiffness(f, t, y, args, h) -> float | None:
    """`h * |lambda|` if the step looks limited by explicit stability (about 1-6 for
    the usual explicit RK methods) at a fast-decaying mode, else `None`."""
    if not h:
        return None
    flat, unravel = jax.flatten_util.ravel_pytree(y)
    if flat.size > 64:
        return None
    field = lambda v: jax.flatten_util.ravel_pytree(f(t, unravel(v), args))[0]
    try:
        eigenvalues = np.linalg.eigvals(np.asarray(jax.jacfwd(field)(flat)))
    except Exception:
        return None
    fastest = eigenvalues[np.argmax(np.abs(eigenvalues))]
    product = h * abs(fastest)
    return float(product) if fastest.real < 0 and 1 <= product <= 6 else None


def failure_message(
    result,
    mesh: RecordedMesh,
    stats,
    terms,
    solver,
    y0,
    args,
    t0,
    t1,
    max_steps,
    states=None,
    controller=None,
) -> str | None:
    """A message naming the time and likely cause of a failed solve, or `None` if it
    succeeded. Needs concrete values; `stats` may be `None` (a recording).
    `states()`, if given, returns the states the recording accepted (at `t0` and
    each step's end); else they are replayed from the mesh. `controller`, if
    given, is the step size controller, checked for settings that stall a solve."""
    if _code(result) == _code(diffrax.RESULTS.successful):
        return None
    n = int(mesh.num_steps)
    t_end = float(np.asarray(mesh.ts)[n])
    span = float(t1) - float(t0)
    percent = int(np.floor(100.0 * (t_end - float(t0)) / span)) if span else 100
    where = f"at t={t_end:.9g} ({percent}% of the way from t0={float(t0):.9g} to "
    where += f"t1={float(t1):.9g}), after {n} accepted steps"
    if stats is not None:
        where += f" and {int(stats['num_rejected_steps'])} rejected ones"
    where += "."
    cause, fix = _cause(mesh, terms, solver, y0, args, t0, t1, states, controller)
    if result == diffrax.RESULTS.max_steps_reached:
        head = f"max_steps={max_steps} was reached {where}"
        fix = fix or (
            "Raise max_steps or loosen rtol/atol; if the problem is stiff (many "
            "tiny steps where the solution is smooth), use a stiff solver, "
            "gs.Rodas5()."
        )
    elif result == diffrax.RESULTS.dt_min_reached:
        head = f"The step size fell below dtmin {where}"
        fix = fix or "Lower dtmin, or loosen rtol/atol."
    else:
        head = f"The solve failed ({result}) {where}"
        fix = fix or "Inspect sol.result with throw=False."
    return " ".join(x for x in (head, cause, fix) if x)


def _max_steps_messages(max_steps) -> list[str]:
    """One message per percent of the interval reached (an error message must be
    static, so the place is chosen from a list by a traced index)."""
    return [
        f"max_steps={max_steps} was reached {percent}% of the way from t0 to t1. "
        "Raise max_steps, loosen rtol/atol, or, if the problem is stiff (an "
        "explicit solver then takes tiny steps for stability), use gs.Rodas5()."
        for percent in range(101)
    ]


def throw_in_graph(out, result, max_steps, valid, t_reached, t0, t1):
    """Return `out` with a check of a failed solve (inside `jit`, `grad` and
    `vmap`): static messages, the place (`t_reached`) as a percentage of the
    interval. One `eqx.branched_error_if`, since each check walks the Python stack
    when it is traced.
    """
    span = jnp.where(t1 == t0, 1, t1 - t0)
    fraction = (t_reached - t0) / span
    percent = jnp.clip(jnp.floor(100 * fraction), 0, 100).astype(jnp.int32)
    failed = valid & (result != diffrax.RESULTS.successful)
    # The message's index: over an ensemble the largest, so a trajectory that
    # reached max_steps is reported, with the furthest one got (defined when empty).
    index = jnp.where(
        result == diffrax.RESULTS.max_steps_reached,
        2 + percent,
        jnp.where(result == diffrax.RESULTS.dt_min_reached, 1, 0),
    )
    index = batch_max_int(jnp.where(failed, index, 0))
    messages = [
        "The solve failed; inspect sol.result with throw=False.",
        "The step size fell below dtmin (PIDController(force_dtmin=False)). Lower "
        "dtmin, loosen rtol/atol, or check the vector field for a singularity.",
        *_max_steps_messages(max_steps),
    ]
    return eqx.branched_error_if(out, failed, index, messages)


def throw_eagerly(
    out,
    mesh,
    stats,
    t0,
    t1,
    terms,
    solver,
    y0,
    args,
    max_steps,
    states=None,
    controller=None,
):
    """Return `out`, or raise a `ValueError` naming the time and cause of a failed
    solve. If the result turned out to be traced (a vector field closing over a
    tracer), fall back to the in-graph check of `throw_in_graph`."""
    if not is_concrete(mesh):
        # The mesh is padded with the last time reached.
        t_reached = mesh.ts[..., -1]
        return throw_in_graph(out, mesh.result, max_steps, True, t_reached, t0, t1)
    message = failure_message(
        mesh.result,
        mesh,
        stats,
        terms,
        solver,
        y0,
        args,
        t0,
        t1,
        max_steps,
        states,
        controller,
    )
    if message is not None:
        raise ValueError(message)
    return out
