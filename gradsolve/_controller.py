"""Diffrax's `PIDController` arithmetic on a state held as scalar components.

The XLA recording loop, the fused kernel and the replay's error ratio all compute the
controller's error estimate here, with the same operations in the same order, so
that they agree bit for bit with each other and (to the extent XLA compiles Diffrax's
own arrays the same way, see below) with `diffrax.diffeqsolve`.

`PIDController.adapt_step_size` (diffrax 0.7, `_step_size_controller/pid.py`)
reduces twice per leaf of the state: its NaN check (`jnp.isnan(y).any()`) and its
norm (`optimistix.rms_norm`: a `jnp.dot(x, x)` per leaf, the leaves' dots added in
order). Here both are written as the scalar operations they amount to, per leaf of
the user's state:

- a leaf of one element contributes the product `x * x` (XLA turns a one-element
    dot into a multiplication);
- a longer leaf contributes `((0 + x0 x0) + x1 x1) + ...` from a zero the compiler
    cannot see (`runtime_zero`), each step a fused multiply-add: the order and
    rounding of XLA's dot (on the CPU, and for a fused `reduce(multiply)` anywhere).

(Under `jax.vmap` the batched dots and the boolean reduction are batched matrix
products and reductions, which the Triton lowering of Pallas does not have either.)
"""

import functools
import math

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import optimistix as optx

from ._solver.base import runtime_zero


NORMS = (optx.rms_norm, optx.max_norm)


def _by_leaf(x, sizes):
    out, i = [], 0
    for n in sizes:
        out.append(x[i : i + n])
        i += n
    return out


def _sum_squares(leaves, zero):
    parts = []
    for x in leaves:
        if len(x) == 1:
            parts.append(x[0] * x[0])
        else:
            acc = zero.astype(jnp.result_type(x[0]))
            for xi in x:
                acc = acc + xi * xi
            parts.append(acc)
    return functools.reduce(jnp.add, parts)


def error_norm(norm, scaled, sizes, zero):
    """`norm` (`optx.rms_norm` or `optx.max_norm`) of the scaled errors, given as
    components of leaves of `sizes` elements, as `optimistix` computes it on the
    leaves."""
    leaves = [x for x in _by_leaf(scaled, sizes) if len(x) > 0]
    if not leaves:
        return zero  # a state with no elements has no error
    if norm is optx.max_norm:
        maxes = [
            functools.reduce(jnp.maximum, [jnp.abs(xi) for xi in x]) for x in leaves
        ]
        return functools.reduce(jnp.maximum, maxes)
    size = sum(sizes)
    if size == 1:
        two = jnp.abs(leaves[0][0])
    else:
        two = jnp.sqrt(_sum_squares(leaves, zero))
    return two / math.sqrt(size)


def scaled_error(norm, rtol, atol, y0, y1, y_error, sizes, zero):
    """The error ratio a `PIDController` accepts a step on (accepted if `< 1`):
    `norm(y_error / (atol + rtol * max(|y0|, |y1|)))`, with `y1` replaced by `y0`
    in a leaf where it holds a NaN. `y_error` must hold no NaN (a NaN counts as
    infinite, as in Diffrax's loop)."""
    scaled = []
    for a, b, e in zip(*(_by_leaf(v, sizes) for v in (y0, y1, y_error))):
        if len(b) == 0:
            continue  # a zero-size leaf: no error, and no NaN to look for
        nan = functools.reduce(jnp.logical_or, [jnp.isnan(x) for x in b])
        for _y0, _y1, _e in zip(a, b, e):
            _y1 = jnp.where(nan, _y0, _y1)
            _y = jnp.maximum(jnp.abs(_y0), jnp.abs(_y1))
            with jax.numpy_dtype_promotion("standard"):
                scaled.append(_e / (atol + _y * rtol))
    return error_norm(norm, scaled, sizes, zero)


def pid_adapt_step_size(
    c: diffrax.PIDController, t0, t1, y0, y1, y_error, order, s, sizes
):
    """`diffrax.PIDController.adapt_step_size` (diffrax 0.7,
    `_step_size_controller/pid.py`) for a state of scalar components, grouped into
    leaves of `sizes` elements; see there for the reasons behind each line."""
    prev_inv_scaled_error, prev_prev_inv_scaled_error, at_dtmin = s
    error_order = c._get_error_order(order)
    prev_dt = t1 - t0
    zero = runtime_zero(t0)
    scaled_error_ = scaled_error(c.norm, c.rtol, c.atol, y0, y1, y_error, sizes, zero)
    keep_step = scaled_error_ < 1
    if c.dtmin is not None:
        keep_step = keep_step | at_dtmin
    inv_scaled_error = 1 / jnp.asarray(scaled_error_)

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


class _ComponentPID(eqx.Module):
    """A `PIDController` computed by `pid_adapt_step_size`, for a
    `ClipStepSizeController` (`step_ts`/`jump_ts`) to wrap in its place."""

    controller: diffrax.PIDController
    sizes: tuple = eqx.field(static=True)

    def adapt_step_size(self, t0, t1, y0, y1, args, y_error, order, state):
        del args
        keep, next_t0, next_t1, state, result = pid_adapt_step_size(
            self.controller, t0, t1, y0, y1, y_error, order, state, self.sizes
        )
        return keep, next_t0, next_t1, False, state, result


def on_components(controller, sizes):
    """`controller` with every `PIDController` of the RMS or max norm in it computed
    on components (leaves of `sizes` elements) by `pid_adapt_step_size`; `None` if it
    has none (its own `adapt_step_size` then runs on the state's leaves)."""
    if type(controller) is diffrax.PIDController:
        if controller.norm in NORMS:
            return _ComponentPID(controller, sizes)
        return None
    if isinstance(controller, diffrax.ClipStepSizeController):
        inner = on_components(controller.controller, sizes)
        if inner is None:
            return None
        return eqx.tree_at(lambda c: c.controller, controller, inner)
    return None


def adapt_step_size(controller, t0, t1, y0, y1, y_error, order, state, sizes):
    """Accept or reject the step `[t0, t1]` and propose the next, for one lane of
    the fused kernel (a `PIDController` or a `ConstantStepSize`).

    **Returns:**

    `(keep, next_t0, next_t1, state, result)`, as the controller's own
    `adapt_step_size` (less `made_jump`, which neither controller sets).
    """
    if type(controller) is diffrax.PIDController:
        return pid_adapt_step_size(
            controller, t0, t1, y0, y1, y_error, order, state, sizes
        )
    keep, next_t0, next_t1, _, state, result = controller.adapt_step_size(
        t0, t1, tuple(y0), tuple(y1), None, tuple(y_error), order, state
    )
    return keep, next_t0, next_t1, state, result
