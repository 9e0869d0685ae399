"""Refining a least-squares answer on a mesh recorded at it.

A fit ends with an optimiser run on a mesh recorded at the previous run's answer.
Started at its optimum, a least-squares solver such as Levenberg-Marquardt spends
many steps at the residuals' round-off floor, where a step is accepted only when
the loss happens to round down, before its termination test passes. From a point
that close to the optimum, plain Gauss-Newton steps (what Levenberg-Marquardt's steps
become as its damping vanishes) reach the solver's termination test, Optimistix's
Cauchy test on the change of the variable and of the residuals, in a few Jacobians;
where they do not (a step that raises the loss, or too many steps), the fit runs the
solver as before.
"""

import equinox as eqx
import jax
import jax.flatten_util
import jax.numpy as jnp
import optimistix as optx

from ._fit_problem import FitProblem
from ._mesh import RecordedMesh


def tolerances(optimiser):
    """`(rtol, atol, norm)` of a least-squares solver, or `None` when it has none."""
    if not isinstance(optimiser, optx.AbstractLeastSquaresSolver):
        return None
    rtol = getattr(optimiser, "rtol", None)
    atol = getattr(optimiser, "atol", None)
    if rtol is None or atol is None:
        return None
    return float(rtol), float(atol), getattr(optimiser, "norm", optx.max_norm)


@eqx.filter_jit
def gauss_newton_refine(
    problem: FitProblem, mode, params, mesh: RecordedMesh, rtol, atol, norm, max_steps
):
    """Gauss-Newton steps from `params` over the fixed `mesh`, until a step and the
    change of the residuals it makes are below `atol + rtol * |value|` in `norm`
    (Optimistix's Cauchy test). Stops without convergence after `max_steps` steps,
    or at a step that is not finite or raises the loss without passing the test
    (that step is not taken).

    Returns `(params, converged, steps)`.
    """
    flat, unravel = jax.flatten_util.ravel_pytree(params)

    def residuals(x):
        return jnp.ravel(problem.residuals(unravel(x), mesh, mode))

    def linearised(x):
        r, push = jax.linearize(residuals, x)
        jac = jax.vmap(push, out_axes=1)(jnp.eye(x.size, dtype=x.dtype))
        return r, jac

    def cond(carry):
        *_, converged, failed, steps = carry
        return ~converged & ~failed & (steps < max_steps)

    def body(carry):
        x, r, jac, _, _, steps = carry
        step, *_ = jnp.linalg.lstsq(jac, -r)
        x_new = x + step
        r_new, jac_new = linearised(x_new)
        small_y = norm(jnp.abs(step) / (atol + rtol * jnp.abs(x_new))) < 1
        small_f = norm(jnp.abs(r_new - r) / (atol + rtol * jnp.abs(r_new))) < 1
        finite = jnp.all(jnp.isfinite(x_new)) & jnp.all(jnp.isfinite(r_new))
        small = small_y & small_f
        # A step within the tolerances counts even where the loss rounds up.
        ok = finite & ((jnp.sum(r_new**2) <= jnp.sum(r**2)) | small)
        x_new, r_new, jac_new = jax.tree.map(
            lambda a, b: jnp.where(ok, a, b), (x_new, r_new, jac_new), (x, r, jac)
        )
        return x_new, r_new, jac_new, ok & small, ~ok, steps + 1

    r, jac = linearised(flat)
    false = jnp.array(False)
    init = (flat, r, jac, false, false, jnp.array(0))
    x, _, _, converged, _, steps = jax.lax.while_loop(cond, body, init)
    return unravel(x), converged, steps
