"""Where each `SaveAt(ts=...)` value comes from: the recording notes the step each
value falls in as it saves it. That must be the step a search of the mesh's step
ends gives (the first step ending at or after the value), also for values a failed
solve never reached and for a solve that takes no step."""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs
from gradsolve._problem import LeafProblem
from gradsolve._record import record_loop
from gradsolve._record_xla import SAVE_WINDOW
from gradsolve._saving import SavePlan, save_layout


@pytest.mark.parametrize(
    "t0, t1, max_steps, num_ts",
    [
        (0.0, 5.0, 100, 9),
        (0.0, 5.0, 4, 9),
        (0.0, 0.0, 4, 9),
        (5.0, 0.0, 100, 9),
        (5.0, 0.0, 3, 9),
        (5.0, 0.0, 4, 150),  # dozens of values in a step: saved a window at a time
    ],
    ids=[
        "success",
        "max_steps",
        "empty",
        "backwards",
        "backwards_max_steps",
        "many_backwards_max_steps",
    ],
)
def test_noted_steps_are_the_searched_ones(t0, t1, max_steps, num_ts):
    y0 = [jnp.array(1.0), jnp.array(0.0)]
    problem = LeafProblem(
        f=lambda t, y, args: [y[1], -y[0] - 0.1 * y[1]],
        args=None,
        treedef=jax.tree.structure([0.0, 0.0]),
    )
    direction = 1 if t1 >= t0 else -1
    ts = direction * jnp.linspace(t0, t1, num_ts)  # internal (increasing) time
    plan = SavePlan(ts=ts, t0=False, t1=False, steps=True)
    controller = diffrax.PIDController(rtol=1e-6, atol=1e-6)
    out = record_loop(
        problem, gs.Tsit5(), t0, t1, direction * 0.1, y0, controller, plan,
        max_steps, keep_states=False, has_jumps=False,
    )  # fmt: skip
    searched = save_layout(plan, direction * out.mesh.ts[1:], max_steps)
    np.testing.assert_array_equal(out.layout.ts_step, searched.ts_step)
    np.testing.assert_array_equal(out.layout.ts_slot, searched.ts_slot)
    np.testing.assert_array_equal(out.layout.step_slot, searched.step_slot)


@pytest.mark.bitwise
def test_many_values_per_step_are_diffraxs():
    # At rtol 1e-3 a step spans dozens of the 301 save times: more than one window
    # of them, on trajectories that take different steps (`vmap`).
    t0, t1, num_ts = 0.0, 6.0, 301
    term = diffrax.ODETerm(lambda t, y, k: jnp.stack([y[1], -k * y[0]]))
    y0s = jnp.array([[1.0, 0.0], [0.5, 1.0], [2.0, -1.0]])
    ks = jnp.array([1.0, 4.0, 0.3])
    ts = jnp.linspace(t0, t1, num_ts)

    def solve(lib, y0, k):
        return lib.diffeqsolve(
            term, lib.Tsit5(), t0, t1, None, y0, k,
            saveat=diffrax.SaveAt(ts=ts),
            stepsize_controller=diffrax.PIDController(rtol=1e-3, atol=1e-6),
        )  # fmt: skip

    ours = jax.vmap(lambda y0, k: solve(gs, y0, k))(y0s, ks)
    theirs = jax.vmap(lambda y0, k: solve(diffrax, y0, k))(y0s, ks)
    steps = np.asarray(theirs.stats["num_accepted_steps"])
    assert steps.min() < steps.max()
    assert num_ts / steps.min() > SAVE_WINDOW  # some step spans more than a window
    np.testing.assert_array_equal(ours.stats["num_accepted_steps"], steps)
    np.testing.assert_allclose(ours.ts, theirs.ts, rtol=0, atol=0)
    np.testing.assert_allclose(ours.ys, theirs.ys, rtol=1e-12, atol=1e-14)
