"""Diffrax's step-size controllers, as one lane of the fused kernel computes them.

`ConstantStepSize.adapt_step_size` is elementwise and used as it is.
`PIDController.adapt_step_size` reduces twice: its NaN check (`jnp.isnan(y).any()`,
per leaf) and its norm (`optimistix.rms_norm` sums one-element dot products). Under
`jax.vmap` over the lanes these become a boolean reduction and batched matrix
products, which the Triton lowering of Pallas does not have. `pid_adapt_step_size`
is the same computation, operation for operation, on a state held as scalar
components (each leaf one element, as the XLA recording hands them to the controller),
with those two reductions written as the scalar operations they amount to. The
tests check that the kernel and the XLA loop take identical steps.
"""

import functools
import math

import diffrax
import jax
import jax.numpy as jnp
import optimistix as optx


def _rms_norm(x):
    # `optx.rms_norm`: `two_norm(x) / sqrt(size)`, with `two_norm` the absolute value
    # for one element, else the square root of the left-to-right sum of squares.
    if len(x) == 1:
        two = jnp.abs(x[0])
    else:
        two = jnp.sqrt(functools.reduce(jnp.add, [xi * xi for xi in x]))
    return two / math.sqrt(len(x))


def _max_norm(x):
    return functools.reduce(jnp.maximum, [jnp.abs(xi) for xi in x])


_NORMS = {optx.rms_norm: _rms_norm, optx.max_norm: _max_norm}


def pid_adapt_step_size(c: diffrax.PIDController, t0, t1, y0, y1, y_error, order, s):
    """`diffrax.PIDController.adapt_step_size` (diffrax 0.7,
    `_step_size_controller/pid.py`) for a state of scalar components; see there for
    the reasons behind each line."""
    prev_inv_scaled_error, prev_prev_inv_scaled_error, at_dtmin = s
    error_order = c._get_error_order(order)
    prev_dt = t1 - t0

    def _scale(_y0, _y1_candidate, _y_error):
        _nan = jnp.isnan(_y1_candidate)  # one element: `.any()` is the element
        _y1_candidate = jnp.where(_nan, _y0, _y1_candidate)
        _y = jnp.maximum(jnp.abs(_y0), jnp.abs(_y1_candidate))
        with jax.numpy_dtype_promotion("standard"):
            return _y_error / (c.atol + _y * c.rtol)

    scaled = [_scale(a, b, e) for a, b, e in zip(y0, y1, y_error)]
    scaled_error = _NORMS[c.norm](scaled)
    keep_step = scaled_error < 1
    if c.dtmin is not None:
        keep_step = keep_step | at_dtmin
    inv_scaled_error = 1 / jnp.asarray(scaled_error)

    _zero_coeff = lambda x: isinstance(x, (int, float)) and x == 0
    coeff1 = (c.icoeff + c.pcoeff + c.dcoeff) / error_order
    coeff2 = -(c.pcoeff + 2 * c.dcoeff) / error_order
    coeff3 = c.dcoeff / error_order
    factor1 = 1 if _zero_coeff(coeff1) else inv_scaled_error**coeff1
    factor2 = 1 if _zero_coeff(coeff2) else prev_inv_scaled_error**coeff2
    factor3 = 1 if _zero_coeff(coeff3) else prev_prev_inv_scaled_error**coeff3
    factormin = jnp.where(keep_step, 1, c.factormin)
    factormax = jnp.where(keep_step, c.factormax, c.safety)
    factor = jnp.clip(
        c.safety * factor1 * factor2 * factor3, min=factormin, max=factormax
    )
    dt = prev_dt * factor.astype(jnp.result_type(prev_dt))
    pred = (inv_scaled_error == 0) | jnp.isinf(inv_scaled_error)
    inv_scaled_error = jnp.where(pred, 1, inv_scaled_error)

    result = diffrax.RESULTS.successful
    if c.dtmax is not None:
        dt = jnp.minimum(dt, c.dtmax)
    if c.dtmin is not None:
        if not c.force_dtmin:
            result = diffrax.RESULTS.where(
                dt < c.dtmin, diffrax.RESULTS.dt_min_reached, result
            )
        dt = jnp.where(at_dtmin & (factor == 1), c.dtmin, dt)
        at_dtmin = dt <= c.dtmin
        dt = jnp.maximum(dt, c.dtmin)

    next_t0 = jnp.where(keep_step, t1, t0)
    next_t1 = next_t0 + dt
    inv_scaled_error = jnp.where(keep_step, inv_scaled_error, prev_inv_scaled_error)
    prev_inv_scaled_error = jnp.where(
        keep_step, prev_inv_scaled_error, prev_prev_inv_scaled_error
    )
    state = (inv_scaled_error, prev_inv_scaled_error, at_dtmin)
    return keep_step, next_t0, next_t1, state, result


def adapt_step_size(controller, t0, t1, y0, y1, y_error, order, state):
    """Accept or reject the step `[t0, t1]` and propose the next, for one lane.

    **Returns:**

    `(keep, next_t0, next_t1, state, result)`, as the controller's own
    `adapt_step_size` (less `made_jump`, which neither controller sets).
    """
    if type(controller) is diffrax.PIDController:
        return pid_adapt_step_size(controller, t0, t1, y0, y1, y_error, order, state)
    keep, next_t0, next_t1, _, state, result = controller.adapt_step_size(
        t0, t1, tuple(y0), tuple(y1), None, tuple(y_error), order, state
    )
    return keep, next_t0, next_t1, state, result
