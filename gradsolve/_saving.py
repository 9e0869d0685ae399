"""Where each saved value comes from, and where it goes in the output.

Record, replay and the adjoint all lay out `SaveAt(t0, ts, steps, t1)` outputs the way
`diffrax.diffeqsolve` does: `t0` first, then the `ts` values and the step values in
time order (a `ts` value before the value of the step it falls in), `t1` last, and
unused slots (steps beyond the last accepted one) filled with `inf`. The values at
the `ts` of a replay on components are interpolated from the stages of the steps
that hold them, computed again (`values_at_saves`).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, Real

from ._solver.interpolation import combine


class SavePlan(eqx.Module):
    """What to save: a static description plus the `ts` in internal time."""

    ts: Real[Array, " saves"] | None
    t0: bool = eqx.field(static=True)
    t1: bool = eqx.field(static=True)
    steps: bool = eqx.field(static=True)

    def size(self, max_steps: int) -> int:
        size = int(self.t0) + (0 if self.ts is None else len(self.ts))
        if self.steps:
            size += max_steps
        elif self.t1:
            size += 1
        return size


class SaveLayout(eqx.Module):
    """For one trajectory: the step each `ts` value falls in and the output slot of
    every saved value (`-1`-free; slots of unused steps hold `inf`)."""

    ts_step: Int[Array, " saves"] | None
    ts_slot: Int[Array, " saves"] | None
    step_slot: Int[Array, " steps"] | None
    t1_slot: int | None = eqx.field(static=True)


def save_layout(
    plan: SavePlan,
    step_ends: Array,
    max_steps: int,
    ts_step: Int[Array, " saves"] | None = None,
) -> SaveLayout:
    """Compute the layout from the mesh's step ends (internal, increasing time).

    A `ts` value belongs to the first step whose end is at or after it, exactly as the
    adaptive loop saves it when that step is accepted. `ts_step`, where given, is
    that step for every `ts` value (as the loop noted it), instead of a search.
    """
    base = int(plan.t0)
    ts_slot = step_slot = None
    num_ts = 0 if plan.ts is None else len(plan.ts)
    if plan.ts is not None and ts_step is None:
        ts_step = jnp.searchsorted(step_ends, plan.ts, side="left")
        ts_step = jnp.minimum(ts_step, max_steps - 1) if max_steps > 0 else ts_step
    if plan.ts is not None:
        ts_slot = base + jnp.arange(num_ts)
        if plan.steps:
            ts_slot = ts_slot + ts_step
    if plan.steps:
        steps = jnp.arange(max_steps)
        step_slot = base + steps
        if plan.ts is not None:
            before = jnp.searchsorted(ts_step, steps, side="right")
            step_slot = step_slot + before
    t1_slot = None
    if plan.t1 and not plan.steps:
        t1_slot = plan.size(max_steps) - 1
    return SaveLayout(ts_step, ts_slot, step_slot, t1_slot)


def assemble(
    plan: SavePlan,
    layout: SaveLayout,
    max_steps: int,
    num_steps: Array,
    t0: Array,
    step_ends: Array,
    y0: list[Array],
    ts_values: list[Array] | None,
    step_values: list[Array] | None,
    y_final: list[Array],
) -> tuple[Array, list[Array]]:
    """Scatter the saved times and states (lists of leaves, leading axis per save)
    into the output buffers, in internal time."""
    size = plan.size(max_steps)
    ts_out = jnp.full((size,), jnp.inf, dtype=step_ends.dtype)
    ys_out = [jnp.full((size,) + leaf.shape, jnp.inf, dtype=leaf.dtype) for leaf in y0]

    def put(slots, times, values):
        nonlocal ts_out, ys_out
        ts_out = ts_out.at[slots].set(times)
        ys_out = [out.at[slots].set(v) for out, v in zip(ys_out, values)]

    if plan.t0:
        put(0, t0, y0)
    if plan.ts is not None:
        put(layout.ts_slot, plan.ts, ts_values)
    if plan.steps:
        used = jnp.arange(max_steps) < num_steps
        times = jnp.where(used, step_ends, jnp.inf)
        values = [
            jnp.where(used.reshape((-1,) + (1,) * (v.ndim - 1)), v, jnp.inf)
            for v in step_values
        ]
        put(layout.step_slot, times, values)
    if layout.t1_slot is not None:
        put(layout.t1_slot, step_ends[-1], y_final)
    return ts_out, ys_out


def caller_times(direction: Array, ts_out: Array) -> Array:
    """Saved times in the caller's time. Unused slots stay `+inf` in both directions
    of integration, as in `diffrax.diffeqsolve`."""
    return jnp.where(ts_out == jnp.inf, jnp.inf, direction * ts_out)


def values_at_saves(
    solver, vf, starts, ends, direction, theta, before, after, forward_only
):
    """The dense output at the save times, from the steps that hold them: step `i`
    from `starts[i]` to `ends[i]`, its states `before[i]` and `after[i]` (scalar
    components), at normalised time `theta[i]`; the stages are computed again.

    On components a step is one fused kernel per output, and every array a scan
    keeps is one more kernel per step: keeping Tsit5's seven stages at every step
    for the interpolation made a replay of 64 Lotka-Volterra trajectories with 20
    save times 6x slower than one saving only `t1` (0.37 against 0.06 ms). Computed
    again after the scan, the stages of the save times cost about as much as the
    scan's states. (The inputs must be components: split and merged inside the
    recomputation, a leaf's component axis is transposed in every kernel, which
    XLA then does not vectorise.)

    One batch (`jax.vmap`), or a loop (`lax.map`) when the replay is `forward_only`
    (`gs.fit`'s forward-mode Jacobian blocks). There, batched, XLA fused the stages'
    tangents into the kernel that writes the values, transposed, and computed the
    whole chain of stages again for every component and tangent of every value
    (an optimization barrier does not stop it: XLA's CPU pipeline removes them
    before fusion): in a fit of 32 FitzHugh-Nagumo experiments that kernel was half
    the time, the compiled fit 35 ms against 18.7 ms with the loop. Elsewhere the
    batch: a loop's reverse-mode gradient was 10% slower on 64 Lotka-Volterra
    trajectories, and rounded differently with the batch size, so that an ensemble
    split over devices (padded) no longer had the unsplit one's gradients bit for
    bit.
    """
    weights = solver.interpolation_cls.weights

    def value(step):
        s, e, th, y0, y1 = step
        _, _, ks, _ = solver.step_leaves(vf, s, e, direction, y0, None)
        return combine(weights(th), y0, y1, ks)

    steps = (starts, ends, theta, before, after)
    return jax.lax.map(value, steps) if forward_only else jax.vmap(value)(steps)


def before_steps(y0, states, n):
    """The states at the start of steps `n`, from `y0` and the states after each."""
    return [jnp.concatenate([a[None], s[:-1]])[n] for a, s in zip(y0, states)]
