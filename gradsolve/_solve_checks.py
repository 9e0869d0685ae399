"""The checks `gs.diffeqsolve` and `gs.record` make of their options before tracing,
and the error they give for forward-mode derivatives."""

import contextlib
import math
import numbers

import diffrax

from ._diagnose import pid_settings


@contextlib.contextmanager
def explained_forward_mode():
    """JAX's own error for `jax.jvp` / `jax.jacfwd` through the reverse-mode solve,
    with where forward mode is available."""
    try:
        yield
    except TypeError as e:
        if "forward-mode autodiff" not in str(e):
            raise
        raise TypeError(
            "gs.diffeqsolve is differentiated in reverse mode (jax.grad, jax.vjp, "
            "jax.jacrev), as diffrax.diffeqsolve with its default adjoint. For "
            "forward mode (jax.jvp, jax.jacfwd, jax.hessian) differentiate "
            "gs.replay over a mesh (mesh = gs.record(...) or sol.mesh), or pass "
            "adjoint=diffrax.DirectAdjoint(), which hands the solve to Diffrax."
        ) from e


def check_max_steps(max_steps) -> int:
    """`max_steps` as a Python `int` (a NumPy integer is accepted), or an error."""
    if (
        isinstance(max_steps, bool)
        or not isinstance(max_steps, numbers.Integral)
        or max_steps < 1
    ):
        raise ValueError(
            f"max_steps={max_steps!r}: it must be a positive integer, the most steps "
            "the solve may take (e.g. the default 4096)."
        )
    return int(max_steps)


def check_solver(solver) -> None:
    if not isinstance(solver, diffrax.AbstractSolver):
        hint = " (a class: call it)" if isinstance(solver, type) else ""
        raise TypeError(
            f"solver={solver!r}{hint} is not a solver: pass an instance such as "
            "gs.Tsit5(), gs.Dopri5(), gs.Rodas5() or any Diffrax solver."
        )


def check_tolerances(controller) -> None:
    """A `PIDController`'s `rtol`/`atol` must be finite, non-negative and not both
    zero (else no step is ever accepted, and the solve ends at `max_steps`), and its
    `dtmax` positive (else no step can be taken: the solve would end at `max_steps`
    with a message about the vector field)."""
    settings = pid_settings(controller, "rtol", "atol", "dtmax")
    if settings is None:
        return
    rtol, atol, dtmax = settings
    if rtol is None or atol is None:
        return  # traced tolerances: not checked
    if not all(math.isfinite(x) and x >= 0 for x in (rtol, atol)) or rtol == atol == 0:
        raise ValueError(
            f"PIDController(rtol={rtol!r}, atol={atol!r}): tolerances must be finite, "
            "non-negative and not both zero (e.g. rtol=1e-6, atol=1e-8)."
        )
    if dtmax is not None and not dtmax > 0:
        raise ValueError(
            f"PIDController(dtmax={dtmax!r}): dtmax must be positive, the largest "
            "step allowed (or None for no limit)."
        )
