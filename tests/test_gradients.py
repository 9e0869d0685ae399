"""Invariants 2-4: values and gradients equal Diffrax's; replay reproduces the record;
forward mode works through the replay."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs

from .helpers import PROBLEMS, max_relative_error, tree_sum_squares
from .references import StoredReferences


REFERENCES = StoredReferences(__file__)
CTRL = diffrax.PIDController(rtol=1e-8, atol=1e-8)
SOLVERS = [(gs.Tsit5, diffrax.Tsit5), (gs.Dopri5, diffrax.Dopri5)]
NAMES = ["lorenz", "pendulum", "forced"]
CASES = [
    ("tsit5", "t1"),
    ("tsit5", "ts"),
    ("tsit5", "t0_ts_t1"),
    ("tsit5", "steps"),
    ("dopri5", "t1"),
    ("dopri5", "ts"),
]


def _saveats(problem):
    ts = jnp.linspace(problem.t0, problem.t1, 13)[1:-1]
    return {
        "t1": diffrax.SaveAt(t1=True),
        "ts": diffrax.SaveAt(ts=ts),
        "t0_ts_t1": diffrax.SaveAt(t0=True, ts=ts, t1=True),
        "steps": diffrax.SaveAt(steps=True),
    }


def _losses(problem, ours, theirs, saveat):
    """Diffrax's, `gs.diffeqsolve`'s and `gs.replay`'s loss of `(y0, args)`, each
    returning the solution's `(ts, ys)` as well, and a forward-only `gs.diffeqsolve`
    at the problem's `(y0, args)` with the same settings."""
    term = diffrax.ODETerm(problem.f)
    kwargs = dict(saveat=saveat, stepsize_controller=CTRL)

    def finite_loss(sol):
        ys = jax.tree.map(lambda y: jnp.where(jnp.isinf(y), 0, y), sol.ys)
        return tree_sum_squares(ys), (sol.ts, sol.ys)

    def diffrax_loss(y0, args):
        return finite_loss(
            diffrax.diffeqsolve(
                term, theirs, problem.t0, problem.t1, None, y0, args, **kwargs
            )
        )

    def gs_solve(y0, args):
        return gs.diffeqsolve(
            term, ours, problem.t0, problem.t1, None, y0, args, **kwargs
        )

    def gs_loss(y0, args):
        return finite_loss(gs_solve(y0, args))

    def gs_forward():
        return gs_solve(problem.y0, problem.args)

    mesh = gs.record(
        term,
        ours,
        problem.t0,
        problem.t1,
        None,
        problem.y0,
        problem.args,
        stepsize_controller=CTRL,
    )

    def replay_loss(y0, args):
        return finite_loss(gs.replay(mesh, term, ours, y0, args, saveat=saveat))

    return diffrax_loss, gs_loss, replay_loss, gs_forward


def _values_and_gradient(loss, problem):
    """`((ts, ys), gradient)` of `loss` at the problem's `(y0, args)`."""
    value_and_grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (_, solution), grad = jax.jit(value_and_grad)(problem.y0, problem.args)
    return solution, grad


def _gradient_cases():
    """Lorenz with every save (Dopri5 at `ts`), the forced pendulum (time-dependent)
    at `ts`; the long tests run the whole grid on all three problems."""
    quick = {("lorenz", case) for case in CASES}
    quick -= {("lorenz", ("dopri5", "t1"))}
    quick |= {("forced", ("tsit5", "ts"))}
    return [
        pytest.param(
            name,
            *case,
            marks=() if (name, case) in quick else pytest.mark.slow,
            id=f"{case[0]}-{case[1]}-{name}",
        )
        for name in NAMES
        for case in CASES
    ]


@pytest.mark.parametrize("name,solver_name,saveat_name", _gradient_cases())
def test_values_and_gradients_match_diffrax(name, solver_name, saveat_name):
    problem = PROBLEMS[name]
    solvers = dict(zip(["tsit5", "dopri5"], SOLVERS))[solver_name]
    # Values saved at step ends sit at times that differ from Diffrax's by the
    # round-off of the step sizes (see test_steps.py), hence the looser bound.
    tol = 1e-8 if saveat_name == "steps" else 1e-10
    saveat = _saveats(problem)[saveat_name]
    ours, theirs = solvers[0](), solvers[1]()
    diffrax_loss, gs_loss, replay_loss, gs_forward = _losses(
        problem, ours, theirs, saveat
    )
    # Each library's values and gradient come from one compiled program.
    (ts_want, ys_want), want = REFERENCES(
        f"{name}-{solver_name}-{saveat_name}",
        lambda: _values_and_gradient(diffrax_loss, problem),
    )
    (ts, ys), got = _values_and_gradient(gs_loss, problem)
    (_, ys_replay), replayed = _values_and_gradient(replay_loss, problem)
    # A forward-only solve (no states kept for the adjoint) is a program of its own.
    assert max_relative_error(gs_forward().ys, ys_want) <= tol
    assert max_relative_error(ys, ys_want) <= tol
    np.testing.assert_allclose(ts, ts_want, rtol=1e-8)
    assert max_relative_error(ys_replay, ys_want) <= tol
    for grad in (got, replayed):
        assert max_relative_error(grad, want) <= 10 * tol


@pytest.mark.parametrize("solvers", SOLVERS, ids=["tsit5", "dopri5"])
def test_replay_reproduces_record(solvers):
    problem = PROBLEMS["lotka_volterra"]
    ours = solvers[0]()
    term = diffrax.ODETerm(problem.f)
    saveat = diffrax.SaveAt(ts=jnp.linspace(0, 6, 25), steps=True)
    sol = gs.diffeqsolve(
        term,
        ours,
        0.0,
        6.0,
        None,
        problem.y0,
        problem.args,
        saveat=saveat,
        stepsize_controller=CTRL,
    )
    replayed = gs.replay(sol.mesh, term, ours, problem.y0, problem.args, saveat=saveat)
    assert max_relative_error(replayed.ys, sol.ys) <= 1e-13
    np.testing.assert_array_equal(replayed.ts, sol.ts)
    ratio = float(replayed.stats["max_error_ratio"])
    assert 0.1 < ratio <= 1.0


def test_stale_mesh_is_reported():
    problem = PROBLEMS["lotka_volterra"]
    term = diffrax.ODETerm(problem.f)
    mesh = gs.record(
        term,
        gs.Tsit5(),
        0.0,
        6.0,
        None,
        problem.y0,
        problem.args,
        stepsize_controller=CTRL,
    )
    near = gs.replay(
        mesh, term, gs.Tsit5(), problem.y0, problem.args * 1.0001, stale="ignore"
    )
    far = gs.replay(
        mesh, term, gs.Tsit5(), problem.y0, problem.args * 1.5, stale="ignore"
    )
    assert float(near.stats["max_error_ratio"]) < 2.0
    assert float(far.stats["max_error_ratio"]) > 1.0


def test_trim_keeps_the_replay():
    problem = PROBLEMS["lorenz"]
    term = diffrax.ODETerm(problem.f)
    rhos = jnp.linspace(5.0, 28.0, 6)
    args = jnp.stack([jnp.full(6, 10.0), rhos, jnp.full(6, 8 / 3)], axis=1)
    record = jax.vmap(
        lambda p: gs.record(
            term, gs.Tsit5(), 0.0, 1.0, None, problem.y0, p, stepsize_controller=CTRL
        )
    )
    meshes = record(args)
    trimmed = meshes.trim()
    longest = int(jnp.max(meshes.num_steps))
    assert longest <= trimmed.max_steps < 2 * max(longest, 8)
    y0s = jnp.broadcast_to(problem.y0, (6, 3))
    full = gs.replay(meshes, term, gs.Tsit5(), y0s, args, args_axes=0)
    short = gs.replay(trimmed, term, gs.Tsit5(), y0s, args, args_axes=0)
    np.testing.assert_array_equal(full.ys, short.ys)


@pytest.mark.parametrize(
    "controller",
    [
        diffrax.PIDController(rtol=1e-8, atol=1e-8, jump_ts=jnp.array([1.3, 2.9])),
        diffrax.PIDController(rtol=1e-8, atol=1e-8, step_ts=jnp.array([0.7, 4.1])),
        diffrax.ConstantStepSize(),
    ],
    ids=["jump_ts", "step_ts", "constant"],
)
def test_gradients_with_clipped_and_constant_steps(controller, request):
    controller_name = request.node.callspec.id
    problem = PROBLEMS["forced"]
    term = diffrax.ODETerm(problem.f)
    saveat = diffrax.SaveAt(ts=jnp.linspace(0.5, 8.0, 9))
    dt0 = 0.05 if isinstance(controller, diffrax.ConstantStepSize) else None

    def loss(solve, solver):
        def fn(y0, args):
            sol = solve(
                term,
                solver,
                0.0,
                8.0,
                dt0,
                y0,
                args,
                saveat=saveat,
                stepsize_controller=controller,
            )
            return jnp.sum(sol.ys**2)

        return fn

    want = REFERENCES(
        f"clipped-{controller_name}",
        lambda: jax.grad(loss(diffrax.diffeqsolve, diffrax.Tsit5()), argnums=(0, 1))(
            problem.y0, problem.args
        ),
    )
    got = jax.grad(loss(gs.diffeqsolve, gs.Tsit5()), argnums=(0, 1))(
        problem.y0, problem.args
    )
    assert max_relative_error(got, want) <= 1e-8


def test_empty_interval():
    problem = PROBLEMS["lotka_volterra"]
    term = diffrax.ODETerm(problem.f)
    saveat = diffrax.SaveAt(t0=True, ts=jnp.array([1.0, 1.0]), t1=True)

    def loss(solve, solver):
        def fn(y0):
            sol = solve(term, solver, 1.0, 1.0, 0.1, y0, problem.args, saveat=saveat)
            return jnp.sum(sol.ys**2), sol.ys

        return fn

    (value, ys), grad = jax.value_and_grad(
        loss(gs.diffeqsolve, gs.Tsit5()), has_aux=True
    )(problem.y0)
    (want_value, want_ys), want_grad = REFERENCES(
        "empty-interval",
        lambda: jax.value_and_grad(
            loss(diffrax.diffeqsolve, diffrax.Tsit5()), has_aux=True
        )(problem.y0),
    )
    np.testing.assert_allclose(ys, want_ys)
    np.testing.assert_allclose(grad, want_grad)


def test_one_call_gradient_with_args_of_every_kind():
    """`args` mixing a scalar, a small matrix (split into elements), a leaf too large
    to split, an integer leaf and a function: the one-call gradient with respect to
    each floating-point leaf equals Diffrax's."""
    term = diffrax.ODETerm(
        lambda t, y, a: (
            a["rate"] * (a["mix"] @ y)
            + jnp.sum(a["weights"]) / a["weights"].size * a["shape"](y)
            + a["shift"].astype(y.dtype)
        )
    )
    args = {
        "rate": jnp.array(0.7),
        "mix": jnp.array([[-0.5, 1.0], [-1.0, -0.2]]),
        "weights": jnp.linspace(0.1, 0.2, 40),
        "shift": jnp.array([1, 0]),
        "shape": jnp.tanh,
    }
    saveat = diffrax.SaveAt(ts=jnp.linspace(0.5, 3.0, 6))

    def loss(solve, solver):
        def fn(y0, args):
            sol = solve(
                term, solver, 0.0, 3.0, None, y0, args,
                saveat=saveat, stepsize_controller=CTRL,
            )  # fmt: skip
            return jnp.sum(sol.ys**2)

        return fn

    y0 = jnp.array([1.0, -0.5])
    diff, static = eqx.partition(args, eqx.is_inexact_array)

    def grad(solve, solver):
        fn = loss(solve, solver)
        return jax.jit(
            jax.grad(lambda y, d: fn(y, eqx.combine(d, static)), argnums=(0, 1))
        )(y0, diff)

    want = REFERENCES(
        "args-of-every-kind", lambda: grad(diffrax.diffeqsolve, diffrax.Tsit5())
    )
    got = grad(gs.diffeqsolve, gs.Tsit5())
    assert max_relative_error(got, want) <= 1e-8
