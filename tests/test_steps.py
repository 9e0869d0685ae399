"""Invariant 1: the recorded accepted steps are Diffrax's, to round-off (float64)."""

import itertools

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs

from .helpers import PROBLEMS
from .references import StoredReferences


REFERENCES = StoredReferences(__file__)
SOLVERS = [(gs.Tsit5, diffrax.Tsit5), (gs.Dopri5, diffrax.Dopri5)]
SOLVER_IDS = ["tsit5", "dopri5"]


def _controllers(t0, t1):
    lo, hi = min(t0, t1), max(t0, t1)
    span = hi - lo
    return {
        "default": diffrax.PIDController(rtol=1e-6, atol=1e-6),
        "pi": diffrax.PIDController(rtol=1e-7, atol=1e-9, pcoeff=0.4, icoeff=0.3),
        "pid_limits": diffrax.PIDController(
            rtol=1e-5,
            atol=1e-7,
            pcoeff=0.2,
            icoeff=0.4,
            dcoeff=0.1,
            factormin=0.3,
            factormax=5.0,
            safety=0.8,
        ),
        "dtmax": diffrax.PIDController(rtol=1e-6, atol=1e-6, dtmax=span / 37),
        "jump_ts": diffrax.PIDController(
            rtol=1e-6,
            atol=1e-6,
            jump_ts=jnp.array([lo + 0.31 * span, lo + 0.62 * span]),
        ),
        "step_ts": diffrax.PIDController(
            rtol=1e-6, atol=1e-6, step_ts=jnp.array([lo + 0.25 * span, lo + 0.5 * span])
        ),
        "dtmin": diffrax.PIDController(rtol=1e-8, atol=1e-8, dtmin=span / 200),
    }


def _diffrax_steps(problem, solver, t0, t1, dt0, controller):
    sol = jax.jit(
        lambda y0, args: diffrax.diffeqsolve(
            diffrax.ODETerm(problem.f),
            solver,
            t0,
            t1,
            dt0,
            y0,
            args,
            saveat=diffrax.SaveAt(steps=True),
            stepsize_controller=controller,
            max_steps=4096,
        )
    )(problem.y0, problem.args)
    n = int(sol.stats["num_accepted_steps"])
    return np.concatenate([[t0], np.asarray(sol.ts[:n])]), n


def _check(name, problem_name, solvers, controller_name, direction, dt0_given):
    """`name`: the test's, under which Diffrax's steps are stored."""
    problem = PROBLEMS[problem_name]
    t0, t1 = problem.t0, problem.t1
    if direction == "backward":
        # Backwards over a shorter span: several of these problems blow up backwards.
        t0, t1 = 0.3 * (problem.t1 - problem.t0), problem.t0
    controller = _controllers(t0, t1)[controller_name]
    dt0 = (t1 - t0) / 50 if dt0_given else None
    ours, theirs = solvers
    expected, n = REFERENCES(
        name, lambda: _diffrax_steps(problem, theirs(), t0, t1, dt0, controller)
    )
    n = int(n)
    mesh = gs.record(
        diffrax.ODETerm(problem.f),
        ours(),
        t0,
        t1,
        dt0,
        problem.y0,
        problem.args,
        stepsize_controller=controller,
    )
    assert int(mesh.num_steps) == n
    ts = np.asarray(mesh.ts)
    # Single trajectories: for a 2-element state XLA's CPU dot rounds Diffrax's
    # first element without fused multiply-adds (README, "How the steps match
    # Diffrax's", case 1), which moves later step sizes by up to ~1e-9 of the span;
    # the steps themselves (count, accept/reject) are identical. Ensembles agree bit
    # for bit (`test_step_agreement.py`).
    np.testing.assert_allclose(ts[: n + 1], expected, rtol=0, atol=1e-6 * abs(t1 - t0))
    assert np.all(ts[n + 1 :] == ts[n])  # padding repeats the final time
    assert ts[n] == pytest.approx(t1, abs=0)


CONTROLLERS = ["default", "pi", "pid_limits", "dtmax", "jump_ts", "step_ts", "dtmin"]


def _covering_cases() -> set:
    """Every controller with both solvers, the problems taken in turn (each appears
    twice or more), each solver both ways with and without `dt0`: every option of
    the full grid, not every combination."""
    names = sorted(PROBLEMS)
    cases = set()
    for c, controller_name in enumerate(CONTROLLERS):
        for s in range(len(SOLVERS)):
            problem_name = names[(2 * c + s) % len(names)]
            direction = "forward" if (c + s) % 2 == 0 else "backward"
            cases.add((controller_name, s, problem_name, direction, (c // 2) % 2 == 0))
    return cases


def _grid():
    """The full grid; the cases outside `_covering_cases()` are long tests."""
    covering = _covering_cases()
    for dt0_given, direction, controller_name, s, problem_name in itertools.product(
        [False, True],
        ["forward", "backward"],
        CONTROLLERS,
        range(len(SOLVERS)),
        sorted(PROBLEMS),
    ):
        case = (controller_name, s, problem_name, direction, dt0_given)
        name = f"{controller_name}-{SOLVER_IDS[s]}-{problem_name}"
        yield pytest.param(
            problem_name,
            SOLVERS[s],
            controller_name,
            direction,
            dt0_given,
            id=f"{dt0_given}-{direction}-{name}",
            marks=() if case in covering else pytest.mark.slow,
        )


@pytest.mark.parametrize(
    "problem_name,solvers,controller_name,direction,dt0_given", list(_grid())
)
def test_same_steps_as_diffrax(
    problem_name, solvers, controller_name, direction, dt0_given, request
):
    _check(
        request.node.name,
        problem_name,
        solvers,
        controller_name,
        direction,
        dt0_given,
    )


@pytest.mark.parametrize("solvers", SOLVERS, ids=SOLVER_IDS)
def test_constant_step_size_and_step_to(solvers, request):
    problem = PROBLEMS["lotka_volterra"]
    ours, theirs = solvers
    term = diffrax.ODETerm(problem.f)
    for controller_name, controller, dt0 in [
        ("constant", diffrax.ConstantStepSize(), 0.02),
        ("step_to", diffrax.StepTo(ts=jnp.array([0.0, 0.5, 1.7, 2.0, 4.5, 6.0])), None),
    ]:

        def solve(lib, solver):
            return lib.diffeqsolve(
                term, solver, 0.0, 6.0, dt0, problem.y0, problem.args,
                saveat=diffrax.SaveAt(steps=True), stepsize_controller=controller,
            )  # fmt: skip

        def diffrax_steps():
            sol = solve(diffrax, theirs())
            return {
                "ts": sol.ts,
                "ys": sol.ys,
                "num_accepted_steps": sol.stats["num_accepted_steps"],
            }

        sol = REFERENCES(f"{controller_name}-{request.node.callspec.id}", diffrax_steps)
        mine = solve(gs, ours())
        n = int(sol["num_accepted_steps"])
        assert int(mine.mesh.num_steps) == n
        np.testing.assert_allclose(mine.ts[:n], sol["ts"][:n], rtol=1e-12)
        np.testing.assert_allclose(mine.ys[:n], sol["ys"][:n], rtol=1e-10, atol=1e-12)
        assert np.all(np.isinf(np.asarray(mine.ts[n:])))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_last_step_rounding_threshold_is_diffraxs(dtype):
    # The recording rounds a step ending within 100 ULPs of t1 to t1, as Diffrax does
    # by 100 calls of `eqxi.prevbefore`; it computes the same float in closed form.
    # Checked bit for bit against that chain, across zero, the subnormals (which
    # compare equal to 0 on the CPU) and the smallest normal numbers.
    import equinox.internal as eqxi

    from gradsolve._record import _clip_floor

    finfo = jnp.finfo(dtype)
    up = np.array(np.inf, dtype)
    near_tiny = [np.array(finfo.tiny, dtype)]
    for _ in range(150):
        near_tiny.append(np.nextafter(near_tiny[-1], up))
    subnormal = np.array(finfo.tiny, dtype) / 1024
    others = [0.0, -0.0, 1.0, -1.0, 3.5, 1e6, -1e6, 1e-30, -1e-30, subnormal]
    others += [-subnormal, -finfo.tiny, float(finfo.max) / 2, -float(finfo.max) / 2]
    xs = jnp.asarray(np.array(near_tiny + others, dtype))

    def chain(x):
        for _ in range(100):
            x = eqxi.prevbefore(x)
        return x

    expected = np.asarray(jax.jit(jax.vmap(chain))(xs))
    got = np.asarray(jax.jit(jax.vmap(_clip_floor))(xs))
    int_type = np.int64 if dtype == jnp.float64 else np.int32
    np.testing.assert_array_equal(got.view(int_type), expected.view(int_type))
