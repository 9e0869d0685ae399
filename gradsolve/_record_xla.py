"""The recording's stepping loop on XLA: Diffrax's loop as a `lax.while_loop`,
writing each accepted step into the mesh's buffers (`_record.record_loop` chooses
between it and the fused kernel of `_kernel.py`)."""

import diffrax
import equinox.internal as eqxi
import jax
import jax.numpy as jnp

from ._solver.interpolation import combine, normalised_time
from ._unbatched import batched_like


def _where(pred, new, old):
    return [jnp.where(pred, a, b) for a, b in zip(new, old)]


def _set_if(buffer, index, value, pred):
    """`buffer` with `value` written at `index` where `pred`, else unchanged.

    Where `pred` is false the index is past the end, and the write is dropped.
    So nothing is read back from the buffer, and nothing is touched where
    nothing is written: under `vmap` each trajectory's row of a
    `(batch, max_steps + 1)` buffer lies in memory pages of its own, and a
    predicated write would gather every trajectory's old value first."""
    index = jnp.where(pred, index, buffer.shape[0])
    return buffer.at[index].set(value, mode="drop")


# How many `SaveAt(ts)` values a step saves at once: every one it passes, up to this
# many, interpolated side by side. Up to this many save times there is no loop
# nested in the stepping loop (one costs XLA more to compile than the extra
# interpolations cost to run); more are saved a window at a time, by a loop. A
# larger window wastes interpolations where a step passes few values (4 at a time
# was faster with 101 save times on 1,024 trajectories, slower with 1,001).
SAVE_WINDOW = 16


def _save_window(saves, ts, keep, tnext, step, dense):
    """Save the values due in the next window of `ts`: those from the next unsaved
    one on that the step passes (`ts <= tnext`), if the step is kept.

    `saves` is `(next unsaved index, values per leaf, step of each value)`; `dense`
    evaluates the step's dense output at an array of times.
    """
    index, values, steps = saves
    width = min(SAVE_WINDOW, len(ts))
    start = jnp.clip(index, 0, len(ts) - width)
    window = jax.lax.dynamic_slice_in_dim(ts, start, width)
    due = keep & (start + jnp.arange(width) >= index) & (window <= tnext)
    values_due = dense(window)

    def put(buffer, new):
        old = jax.lax.dynamic_slice_in_dim(buffer, start, width)
        mask = due.reshape(due.shape + (1,) * (old.ndim - 1))
        return jax.lax.dynamic_update_slice_in_dim(
            buffer, jnp.where(mask, new, old), start, 0
        )

    values = [put(v, x) for v, x in zip(values, values_due)]
    steps = put(steps, jnp.full((width,), step, steps.dtype))
    return index + jnp.sum(due), values, steps


def xla_loop(
    problem,
    solver,
    controller,
    error_order,
    vf,
    as_tree,
    t0,
    lane,
    plan,
    max_steps,
    keep_states,
    has_jumps,
    spacing,
    fsal,
):
    """The stepping loop as an XLA `while_loop`. Returns its final carry and how
    often it kept a state (`every`): every step when steps are saved, else every
    `spacing`-th (see `_checkpoints.checkpoint_spacing`)."""
    interpolation = solver.interpolation_cls
    ti0, ti1, direction = lane["ti0"], lane["ti1"], lane["direction"]
    clip_floor, y = lane["clip_floor"], lane["y"]
    time_dtype = jnp.result_type(ti0)
    num_ts = 0 if plan.ts is None else len(plan.ts)
    zeros_like = lambda leaves, n: [jnp.zeros((n,) + x.shape, x.dtype) for x in leaves]
    carry = dict(
        tprev=ti0,
        tnext=lane["tnext"],
        y=y,
        made_jump=jnp.array(False),
        controller_state=lane["cstate"],
        num_steps=jnp.array(0),
        num_accepted=jnp.array(0),
        num_rejected=jnp.array(0),
        result=diffrax.RESULTS.successful,
        # In the caller's time (no copy of the whole buffer to convert it after the
        # loop). Filled with t1: after a successful solve the padding is in place.
        mesh_ts=jnp.full((max_steps + 1,), direction * ti1, dtype=time_dtype)
        .at[0]
        .set(direction * ti0),
        ts_index=jnp.array(0),
        ts_values=zeros_like(y, num_ts),
        # The step each `ts` value falls in, noted when it is saved (a binary
        # search over the `max_steps`-long buffer afterwards costs more than the
        # steps of a short solve). Unsaved values are set after the loop.
        ts_steps=jnp.zeros((num_ts,), dtype=int),
    )
    if fsal:
        carry["f_fsal"] = vf(t0, y)
    if has_jumps:
        carry["starts"] = jnp.full((max_steps,), ti0, dtype=time_dtype)
        carry["restarts"] = jnp.zeros((max_steps,), dtype=bool)
    # Every state is kept when saved (`SaveAt(steps=True)`); for the adjoint alone,
    # every `spacing`-th (it recomputes the others from them).
    # They are kept as the steps hold them (components for a small state).
    every = 1 if plan.steps else spacing
    if keep_states or plan.steps:
        carry["states"] = [
            jnp.broadcast_to(x, (max_steps // every + 1,) + x.shape) for x in y
        ]

    # Left as the body makes them: the buffers are written only where their
    # trajectory is active (`_set_if`; the saved values only where a kept step
    # passes them, and a step is kept only where active), and `active` is the mask
    # itself. (Masked, every step would select each trajectory's whole buffer.)
    unmasked = {"mesh_ts", "starts", "restarts", "states", "active"}
    unmasked |= {"ts_index", "ts_values", "ts_steps"}

    def running(c):
        going = (c["tprev"] < ti1) & (c["num_steps"] < max_steps)
        return going & (c["result"] == diffrax.RESULTS.successful)

    def cond_fn(c):
        # Under `vmap` the loop runs while any trajectory runs, and the body leaves
        # the others as they are (`active`): with a batched predicate `vmap` would
        # select the whole carry, buffers included, every iteration. (`active` is
        # carried rather than recomputed at the start of the body: recomputed, it
        # changed how XLA compiled a batch of one, whose steps then differed from
        # the same trajectory's in a larger batch by round-off.)
        return eqxi.unvmap_any(c["active"])

    def body_fn(c):
        before = c
        active = c["active"]
        c = dict(c)
        tprev, tnext, y = c["tprev"], c["tnext"], c["y"]
        f0 = c.get("f_fsal")
        if has_jumps and f0 is not None:
            f0 = _where(c["made_jump"], vf(direction * tprev, y), f0)
        y1, y_error, ks, f1 = solver.step_leaves(vf, tprev, tnext, direction, y, f0)
        y_error = [jnp.where(jnp.isnan(e), jnp.inf, e) for e in y_error]
        (keep, next_tprev, next_tnext, made_jump, controller_state, ctrl_result) = (
            controller.adapt_step_size(
                tprev,
                tnext,
                as_tree(y),
                as_tree(y1),
                problem.args,
                as_tree(y_error),
                error_order,
                c["controller_state"],
            )
        )
        next_tprev = jnp.minimum(next_tprev, ti1)
        clip = next_tnext > clip_floor
        next_tnext = jnp.where(
            clip,
            jnp.where(keep, ti1, next_tprev + 0.5 * (ti1 - next_tprev)),
            next_tnext,
        )
        keep = keep & active
        index = c["num_accepted"]
        c["mesh_ts"] = _set_if(c["mesh_ts"], index + 1, direction * tnext, keep)
        if has_jumps:
            c["starts"] = _set_if(c["starts"], index, tprev, keep)
            c["restarts"] = _set_if(c["restarts"], index, c["made_jump"], keep)
        if "states" in c:
            at_checkpoint = keep & ((index + 1) % every == 0)
            c["states"] = [
                _set_if(s, (index + 1) // every, v, at_checkpoint)
                for s, v in zip(c["states"], y1)
            ]
        if num_ts > 0:
            saves = (c["ts_index"], c["ts_values"], c["ts_steps"])
            dense = lambda ts: jax.vmap(
                lambda t: combine(
                    interpolation.weights(normalised_time(tprev, t, tnext)), y, y1, ks
                )
            )(ts)
            save = lambda s: _save_window(s, plan.ts, keep, tnext, index, dense)
            if num_ts <= SAVE_WINDOW:
                saves = save(saves)
            else:

                def more_due(s):
                    i = s[0]
                    due = plan.ts[jnp.minimum(i, num_ts - 1)] <= tnext
                    return keep & (i < num_ts) & due

                # Runs while any trajectory has values due (`unvmap_any`): a batched
                # predicate would select every buffer each time round; the window
                # writes only what is due.
                saves = jax.lax.while_loop(
                    lambda s: eqxi.unvmap_any(more_due(s)), save, saves
                )
            c["ts_index"], c["ts_values"], c["ts_steps"] = saves
        c["y"] = _where(keep, y1, y)
        if f0 is not None:
            c["f_fsal"] = _where(keep, f1, f0)
        c["made_jump"] = jnp.where(keep, made_jump, c["made_jump"])
        c["tprev"], c["tnext"] = next_tprev, next_tnext
        c["controller_state"] = controller_state
        c["result"] = diffrax.RESULTS.where(
            c["result"] == diffrax.RESULTS.successful, ctrl_result, c["result"]
        )
        c["num_steps"] = c["num_steps"] + 1
        c["num_accepted"] = index + jnp.where(keep, 1, 0)
        c["num_rejected"] = c["num_rejected"] + jnp.where(keep, 0, 1)
        c["active"] = active & running(c)
        return {
            k: v if k in unmasked else _where_tree(active, v, before[k])
            for k, v in c.items()
        }

    # As `running`, whose result test would be an eager program here: the result
    # starts successful.
    carry["active"] = (ti0 < ti1) & (max_steps > 0)
    # A loop over a batched state ends per trajectory, so every carry ends up
    # batched anyway: batched from the start, `vmap` traces the body once.
    carry = batched_like(carry, [lane["tnext"], *y, *carry.get("f_fsal", [])])
    c = jax.lax.while_loop(cond_fn, body_fn, carry)
    return c, every


def _where_tree(pred, new, old):
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), new, old)
