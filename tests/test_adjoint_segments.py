"""The reverse pass of `gs.diffeqsolve` walks back over its steps in fixed-length
segments (8 steps for a cheap vector field, 1 for a costly one, see
`_checkpoints.py`): step counts on either side of a segment boundary, a mesh filled
to `max_steps`, a vmapped ensemble with ragged step counts and many save times in
one step must all give Diffrax's gradient."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import gradsolve as gs
from gradsolve._adjoint import SAVE_WINDOW
from gradsolve._checkpoints import (
    CHEAP_FIELD_SEGMENT as SEGMENT_LENGTH,
    checkpoint_spacing,
    segment_length,
)
from gradsolve._problem import LeafProblem

from .helpers import PROBLEMS, max_relative_error
from .references import StoredReferences


REFERENCES = StoredReferences(__file__)
PROBLEM = PROBLEMS["forced"]
TERM = diffrax.ODETerm(PROBLEM.f)


def _grad(solve, solver, saveat, num_steps):
    def loss(y0, args):
        sol = solve(
            TERM,
            solver,
            0.0,
            2.0,
            2.0 / num_steps,
            y0,
            args,
            saveat=saveat,
            stepsize_controller=diffrax.ConstantStepSize(),
            max_steps=num_steps,
        )
        return jnp.sum(jnp.where(jnp.isinf(sol.ys), 0, sol.ys) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(PROBLEM.y0, PROBLEM.args)


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "num_steps",
    [
        pytest.param(1, marks=SLOW),
        pytest.param(SEGMENT_LENGTH - 1, marks=SLOW),
        pytest.param(SEGMENT_LENGTH, marks=SLOW),
        SEGMENT_LENGTH + 1,
        pytest.param(2 * SEGMENT_LENGTH, marks=SLOW),
    ],
)
@pytest.mark.parametrize(
    "saves", [pytest.param("t1", marks=SLOW), "t0_ts_t1", "steps_ts"]
)
def test_segment_boundaries_and_a_full_mesh(num_steps, saves, request):
    ts = jnp.array([0.0, 0.3, 0.3, 1.1, 1.97, 2.0])
    saveat = {
        "t1": diffrax.SaveAt(t1=True),
        "t0_ts_t1": diffrax.SaveAt(t0=True, ts=ts, t1=True),
        "steps_ts": diffrax.SaveAt(ts=ts, steps=True),
    }[saves]
    # `max_steps = num_steps`: the mesh has no padding, the last segment ends at
    # the buffer's end.
    got = _grad(gs.diffeqsolve, gs.Tsit5(), saveat, num_steps)
    want = REFERENCES(
        f"boundaries-{request.node.callspec.id}",
        lambda: _grad(diffrax.diffeqsolve, diffrax.Tsit5(), saveat, num_steps),
    )
    assert max_relative_error(got, want) <= 1e-10


def test_ragged_ensemble_under_vmap():
    # Decay rates over three decades: 8 to ~60 steps, so the trajectories end in
    # different segments.
    rates = jnp.geomspace(0.1, 100.0, 7)
    ctrl = diffrax.PIDController(rtol=1e-6, atol=1e-9)
    saveat = diffrax.SaveAt(ts=jnp.linspace(0.1, 3.0, 5), t1=True)

    def loss(solve, solver):
        def one(k):
            f = lambda t, y, k: -k * y + jnp.sin(t)
            sol = solve(
                diffrax.ODETerm(f),
                solver,
                0.0,
                3.0,
                None,
                jnp.array([1.0, 2.0]),
                k,
                saveat=saveat,
                stepsize_controller=ctrl,
            )
            return jnp.sum(sol.ys**2), sol.stats["num_accepted_steps"]

        def total(rates):
            values, steps = jax.vmap(one)(rates)
            return jnp.sum(values), steps

        return jax.jit(jax.grad(total, has_aux=True))

    got, steps = loss(gs.diffeqsolve, gs.Tsit5())(rates)
    want, _ = REFERENCES(
        "ragged-ensemble", lambda: loss(diffrax.diffeqsolve, diffrax.Tsit5())(rates)
    )
    assert steps.min() < SEGMENT_LENGTH < 2 * SEGMENT_LENGTH < steps.max()
    assert max_relative_error(got, want) <= 1e-9


@pytest.mark.parametrize(
    "saves", ["t0_ts_t1", pytest.param("steps_ts", marks=pytest.mark.slow)]
)
def test_a_state_held_as_an_array(saves):
    # 40 elements: too many to split into components, so the reverse pass handles
    # the state (and its saves) as arrays.
    d = 40
    lap = -2 * jnp.eye(d) + jnp.eye(d, k=1) + jnp.eye(d, k=-1)
    term = diffrax.ODETerm(lambda t, y, k: k * (lap @ y) + jnp.sin(t))
    y0 = jnp.sin(jnp.linspace(0, 3, d))
    ts = jnp.array([0.1, 0.25, 0.4])
    saveat = {
        "t0_ts_t1": diffrax.SaveAt(t0=True, ts=ts, t1=True),
        "steps_ts": diffrax.SaveAt(ts=ts, steps=True),
    }[saves]
    ctrl = diffrax.PIDController(rtol=1e-6, atol=1e-6)

    def grad(solve, solver):
        def loss(y0, k):
            sol = solve(
                term,
                solver,
                0.0,
                0.5,
                None,
                y0,
                k,
                saveat=saveat,
                stepsize_controller=ctrl,
            )
            return jnp.sum(jnp.where(jnp.isinf(sol.ys), 0, sol.ys) ** 2)

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(y0, 3.0)

    got = grad(gs.diffeqsolve, gs.Tsit5())
    want = REFERENCES(
        f"state-as-array-{saves}", lambda: grad(diffrax.diffeqsolve, diffrax.Tsit5())
    )
    assert max_relative_error(got, want) <= 1e-9


# An MLP field: thousands of operations per evaluation, so the reverse pass
# recomputes one step at a time.
MLP = eqx.nn.MLP(2, 2, 32, 2, activation=jnp.tanh, key=jax.random.key(0))


def _mlp_field(t, y, model):
    return model(y) - 0.1 * y


def test_segment_length_follows_the_cost_of_the_field():
    costly = LeafProblem(f=_mlp_field, args=MLP, treedef=jax.tree.structure(0.0))
    cheap = LeafProblem(f=PROBLEM.f, args=PROBLEM.args, treedef=costly.treedef)
    assert segment_length(costly, [jnp.zeros(2)], 0.0) == 1
    assert segment_length(cheap, [PROBLEM.y0], 0.0) == SEGMENT_LENGTH
    # A larger state (8 float64 elements) is kept every eighth step even when
    # its field is costly: keeping every state would take 8x the mesh's memory.
    wide = eqx.nn.MLP(8, 8, 32, 2, key=jax.random.key(2))
    costly_wide = LeafProblem(f=_mlp_field, args=wide, treedef=costly.treedef)
    assert segment_length(costly_wide, [jnp.zeros(8)], 0.0) == SEGMENT_LENGTH
    assert segment_length(costly_wide, [jnp.zeros(8, jnp.float32)], 0.0) == 1


@pytest.mark.parametrize(
    "saves", ["t0_ts_t1", pytest.param("steps_ts", marks=pytest.mark.slow)]
)
def test_costly_field_ragged_ensemble_with_many_saves_per_step(saves):
    # More save times than one window holds fall in single steps (a loose
    # tolerance takes few steps), some of them repeated and some on t0 and t1.
    ts = jnp.sort(
        jnp.concatenate(
            [jnp.linspace(0.0, 2.0, 3 * SAVE_WINDOW + 5), jnp.array([1.0, 2.0])]
        )
    )
    saveat = {
        "t0_ts_t1": diffrax.SaveAt(t0=True, ts=ts, t1=True),
        "steps_ts": diffrax.SaveAt(ts=ts, steps=True),
    }[saves]
    ctrl = diffrax.PIDController(rtol=1e-4, atol=1e-6)
    y0s = jnp.array([[0.5, -0.3], [1.5, 0.2], [-2.0, 1.0]])
    rates = jnp.array([0.2, 1.0, 8.0])  # time scales: few to many steps
    term = diffrax.ODETerm(lambda t, y, a: a[1] * _mlp_field(t, y, a[0]))

    def grad(solve, solver):
        def one(y0, model, rate):
            sol = solve(
                term, solver, 0.0, 2.0, 0.1, y0, (model, rate),
                saveat=saveat, stepsize_controller=ctrl,
            )  # fmt: skip
            ys = jnp.where(jnp.isinf(sol.ys), 0, sol.ys)  # unused step slots
            return jnp.sum(jnp.cos(ys)), sol.stats["num_accepted_steps"]

        def total(y0s, model):
            values, steps = jax.vmap(one, (0, None, 0))(y0s, model, rates)
            return jnp.sum(values), steps

        return eqx.filter_jit(eqx.filter_grad(total, has_aux=True))(y0s, MLP)

    got, steps = grad(gs.diffeqsolve, gs.Tsit5())
    want, _ = REFERENCES(
        f"costly-field-{saves}", lambda: grad(diffrax.diffeqsolve, diffrax.Tsit5())
    )
    assert steps.min() < steps.max()  # ragged
    assert max_relative_error(got, want) <= 1e-9


def _chain(t, y, rate):
    # A large state that the field slices (array form, cheap segments).
    inner = y[2:] - 2 * y[1:-1] + y[:-2]
    return rate * jnp.concatenate([y[1:2] - y[:1], inner, y[-2:-1] - y[-1:]]) - y**3


def test_large_state_kept_in_blocks_ragged_ensemble():
    # A 40-element state kept every 8 steps would take 40x a 256-step mesh's
    # memory: it is kept every 48th step, and the reverse pass recomputes the
    # segment starts of each block before walking back over them. Trajectories
    # of 9 to 140 steps end in different blocks and segments.
    d, max_steps = 40, 256

    def spacing_of(f, args, size):
        problem = LeafProblem(f=f, args=args, treedef=jax.tree.structure(0.0))
        return checkpoint_spacing(
            problem, SEGMENT_LENGTH, [jnp.zeros(size)], max_steps, 0.0
        )

    spacing = spacing_of(_chain, 1.0, d)
    assert spacing == 6 * SEGMENT_LENGTH
    # Not a small state, nor a costly field (a matrix product per element).
    assert spacing_of(_chain, 1.0, 3) == SEGMENT_LENGTH
    dense = jnp.ones((d, d))
    assert spacing_of(lambda t, y, a: a @ y, dense, d) == SEGMENT_LENGTH
    rates = jnp.array([0.05, 5.0, 20.0, 40.0])
    y0 = jnp.sin(jnp.linspace(0.0, 3.0, d))
    saveat = diffrax.SaveAt(ts=jnp.linspace(0.1, 3.0, 7), t1=True)
    ctrl = diffrax.PIDController(rtol=1e-6, atol=1e-6)

    def grad(solve, solver):
        def one(rate):
            sol = solve(
                diffrax.ODETerm(_chain), solver, 0.0, 3.0, None, y0, rate,
                saveat=saveat, stepsize_controller=ctrl, max_steps=max_steps,
            )  # fmt: skip
            return jnp.sum(sol.ys**2), sol.stats["num_accepted_steps"]

        def total(rates):
            values, steps = jax.vmap(one)(rates)
            return jnp.sum(values), steps

        return jax.jit(jax.grad(total, has_aux=True))(rates)

    got, steps = grad(gs.diffeqsolve, gs.Tsit5())
    want, _ = REFERENCES(
        "large-state-blocks", lambda: grad(diffrax.diffeqsolve, diffrax.Tsit5())
    )
    assert steps.min() < spacing and steps.max() > 2 * spacing
    assert max_relative_error(got, want) <= 1e-9
