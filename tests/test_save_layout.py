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
from gradsolve._saving import SavePlan, save_layout


@pytest.mark.parametrize(
    "t0, t1, max_steps",
    [(0.0, 5.0, 100), (0.0, 5.0, 4), (0.0, 0.0, 4), (5.0, 0.0, 100), (5.0, 0.0, 3)],
    ids=["success", "max_steps", "empty", "backwards", "backwards_max_steps"],
)
def test_noted_steps_are_the_searched_ones(t0, t1, max_steps):
    y0 = [jnp.array(1.0), jnp.array(0.0)]
    problem = LeafProblem(
        f=lambda t, y, args: [y[1], -y[0] - 0.1 * y[1]],
        args=None,
        treedef=jax.tree.structure([0.0, 0.0]),
    )
    direction = 1 if t1 >= t0 else -1
    ts = direction * jnp.linspace(t0, t1, 9)  # internal (increasing) time
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
