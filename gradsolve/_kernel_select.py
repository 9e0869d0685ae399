"""Which forward loop runs a recording: the XLA `while_loop` or the fused kernel.

The fused kernel (`_kernel.py`) integrates a whole block of trajectories in one
Pallas program. It covers the common ensemble problem: an explicit Runge--Kutta solver
(`gs.Tsit5`, `gs.Dopri5`), a `PIDController` with the RMS or max norm or a
`ConstantStepSize`, a small state, small `args`, and `SaveAt(t0, t1, ts)`. Anything
else runs on the XLA loop of `_record_xla.py`, which takes the same steps.
"""

import diffrax
import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
import optimistix as optx

from ._components import MAX_COMPONENTS
from ._solver.base import AbstractExplicitSolver


KERNELS = ("auto", "pallas", "xla")
# The kernel passes every array of `args` (and of the vector field's closure) to each
# lane as scalars: a few parameters per trajectory, not network weights.
MAX_ARG_ELEMENTS = 2 * MAX_COMPONENTS


def check_kernel_option(kernel) -> None:
    """Raise for a `kernel=` value that is not one of `KERNELS`."""
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(
            f"kernel={kernel!r} is not an option: pass kernel='auto' (the fused "
            "kernel on a GPU when the problem fits, else XLA), 'pallas' (always the "
            "fused kernel; interpreted on a CPU) or 'xla'."
        )


def kernel_unsupported(solver, controller, plan, layout, dynamic) -> str | None:
    """Why the fused kernel cannot run this recording (`None` if it can).

    **Arguments:**

    - `solver`, `controller`: as given to the recording (the controller wrapped for
        the direction of integration).
    - `plan`: the `SavePlan`.
    - `layout`: the state's component layout (`None` when it is not held as
        components).
    - `dynamic`: the arrays of the vector field's closure and `args`.
    """
    if not isinstance(solver, AbstractExplicitSolver):
        return (
            f"the solver is {type(solver).__name__}; the kernel runs the explicit "
            "solvers gs.Tsit5() and gs.Dopri5()"
        )
    if type(controller) is diffrax.PIDController:
        if controller.norm not in (optx.rms_norm, optx.max_norm):
            return "the PIDController's norm is not optimistix.rms_norm or max_norm"
    elif type(controller) is not diffrax.ConstantStepSize:
        return (
            f"the step size controller is {type(controller).__name__} (the kernel "
            "takes a PIDController without step_ts/jump_ts, or ConstantStepSize)"
        )
    if plan.steps:
        return "SaveAt(steps=True) (the kernel saves at t0, t1 and ts)"
    size = sum(int(np.prod(np.shape(x), dtype=int)) for x in jtu.tree_leaves(dynamic))
    if size > MAX_ARG_ELEMENTS:
        return (
            f"args (with the arrays the vector field closes over) hold {size} "
            f"elements, more than the kernel's {MAX_ARG_ELEMENTS}"
        )
    if layout is None:
        return (
            "the state is not held as scalar components (a floating-point state of "
            f"at most {MAX_COMPONENTS} elements whose vector field is straight-line "
            "scalar arithmetic; see the solver's representation= option)"
        )
    controller_arrays = jtu.tree_leaves(eqx.filter(controller, eqx.is_array))
    if any(np.ndim(x) != 0 for x in controller_arrays):
        return "the step size controller holds non-scalar arrays"
    return None


def kernel_considered(kernel: str) -> bool:
    """Whether the `kernel=` option may pick the fused kernel at all: `"pallas"`, or
    `"auto"` on a GPU backend. (Elsewhere nothing of the kernel is even traced.)"""
    check_kernel_option(kernel)
    return kernel == "pallas" or (kernel == "auto" and jax.default_backend() == "gpu")


def use_kernel(kernel: str, reason: str | None) -> bool:
    """Whether to run the fused kernel, given the `kernel=` option and why it
    cannot run (`reason`, `None` if it can).

    `"auto"` picks the kernel on a GPU backend when the problem fits; `"pallas"`
    insists (and raises with the reason when the problem does not fit).
    """
    check_kernel_option(kernel)
    if kernel == "xla":
        return False
    if kernel == "pallas":
        if reason is not None:
            raise ValueError(
                f"kernel='pallas' cannot run this solve: {reason}. Use kernel='xla' "
                "(or kernel='auto', which falls back to XLA by itself)."
            )
        return True
    return reason is None and jax.default_backend() == "gpu"
