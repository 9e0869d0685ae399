"""Bad inputs and faults: what `diffrax.diffeqsolve` does on the same input, or a
clear error that names the time, the cause and the fix. (See the README's table.)"""

import types

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs

from .helpers import PROBLEMS
from .references import StoredReferences, result_message


REFERENCES = StoredReferences(__file__)
LV = PROBLEMS["lotka_volterra"]
TERM = diffrax.ODETerm(LV.f)
CTRL = diffrax.PIDController(rtol=1e-6, atol=1e-6)


def _message(result) -> str:
    return str(result_message(diffrax.RESULTS, result))


def _stored_solution(name, compute):
    """The parts of Diffrax's solution `compute()` that the tests compare, stored
    under `name`."""

    def parts():
        sol = compute()
        stats = {k: sol.stats[k] for k in ("num_accepted_steps", "num_rejected_steps")}
        result = result_message(diffrax.RESULTS, sol.result)
        return {"ts": sol.ts, "ys": sol.ys, "result": result, "stats": stats}

    stored = REFERENCES(name, parts)
    return types.SimpleNamespace(**{**stored, "result": str(stored["result"])})


def _both(name, term=TERM, t0=0.0, t1=6.0, dt0=None, y0=LV.y0, args=LV.args, **kwargs):
    """gradsolve's solution, and Diffrax's stored under `name`."""
    kwargs.setdefault("stepsize_controller", CTRL)
    ours = gs.diffeqsolve(term, gs.Tsit5(), t0, t1, dt0, y0, args, **kwargs)
    theirs = _stored_solution(
        name,
        lambda: diffrax.diffeqsolve(
            term, diffrax.Tsit5(), t0, t1, dt0, y0, args, **kwargs
        ),
    )
    return ours, theirs


def _assert_same(ours, theirs, rtol=1e-10):
    for a, b in zip(jax.tree.leaves(ours.ys), jax.tree.leaves(theirs.ys)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=rtol)
    np.testing.assert_array_equal(ours.ts, theirs.ts)
    assert _message(ours.result) == theirs.result
    for key in ("num_accepted_steps", "num_rejected_steps"):
        assert ours.stats[key] == theirs.stats[key]


@pytest.mark.parametrize(
    "saveat",
    [
        diffrax.SaveAt(t1=True),
        diffrax.SaveAt(t0=True, ts=jnp.array([0.0, 0.0])),
        diffrax.SaveAt(steps=True),
    ],
    ids=["t1", "ts", "steps"],
)
def test_t0_equal_to_t1_returns_y0_as_diffrax(saveat, request):
    name = f"t0-equal-to-t1-{request.node.callspec.id}"
    ours, theirs = _both(name, t1=0.0, saveat=saveat, max_steps=8)
    _assert_same(ours, theirs, rtol=0)
    mesh = gs.record(
        TERM, gs.Tsit5(), 1.0, 1.0, None, LV.y0, LV.args, stepsize_controller=CTRL
    )
    assert mesh.num_steps == 0
    jac = jax.jacrev(lambda y0: gs.replay(mesh, TERM, gs.Tsit5(), y0, LV.args).ys[0])
    np.testing.assert_array_equal(jac(LV.y0), np.eye(2))


def test_unused_step_slots_are_plus_inf_backwards_as_in_diffrax():
    ours, theirs = _both(
        "unused-step-slots-backwards",
        t0=6.0,
        t1=0.0,
        saveat=diffrax.SaveAt(steps=True),
    )
    # Step times agree to the round-off of the error estimate (see README).
    np.testing.assert_allclose(ours.ts, theirs.ts, rtol=1e-8)
    np.testing.assert_array_equal(ours.ts == jnp.inf, theirs.ts == jnp.inf)
    assert ours.ts[-1] == jnp.inf


@pytest.mark.parametrize(
    "y0,args,times",
    [
        (jnp.array([1, 2]), LV.args, (0.0, 6.0)),  # integer y0: cast to float
        (jnp.array([1, 2]), LV.args.astype(jnp.float32), (0.0, 6.0)),
        (LV.y0.astype(jnp.float32), LV.args, (0.0, 6.0)),  # promoted to float64
        (LV.y0, LV.args, (0, 6)),  # integer times
    ],
    ids=["int_y0", "int_y0_f32_args", "f32_y0_f64_args", "int_times"],
)
def test_integer_and_mixed_dtypes_as_diffrax(y0, args, times, request):
    name = f"dtypes-{request.node.callspec.id}"
    ours, theirs = _both(name, t0=times[0], t1=times[1], y0=y0, args=args)
    _assert_same(ours, theirs)


def test_mixed_dtype_pytree_state_as_diffrax():
    term = diffrax.ODETerm(lambda t, y, a: (-y[0], -2 * y[1]))
    y0 = (jnp.array(1.0, jnp.float32), jnp.array([1.0, 2.0]))
    ours, theirs = _both("mixed-dtype-pytree", term=term, y0=y0, args=None)
    _assert_same(ours, theirs)


def test_float32_throughout_keeps_float32():
    y0, args = LV.y0.astype(jnp.float32), LV.args.astype(jnp.float32)
    t0, t1 = jnp.float32(0.0), jnp.float32(6.0)
    ours, theirs = _both("float32-throughout", t0=t0, t1=t1, y0=y0, args=args)
    assert ours.ys.dtype == theirs.ys.dtype == jnp.float32
    # Step counts may differ by one at float32 round-off; values agree to tolerance.
    np.testing.assert_allclose(ours.ys, theirs.ys, rtol=1e-4)


def test_empty_ensemble():
    """Zero trajectories: empty outputs (Diffrax fails to trace this case)."""
    y0s, ps = jnp.zeros((0, 2)), jnp.zeros((0, 4))
    record = lambda y0, p: gs.record(
        TERM, gs.Tsit5(), 0.0, 6.0, None, y0, p, stepsize_controller=CTRL
    )
    mesh = jax.vmap(record)(y0s, ps).trim()
    assert mesh.ts.shape[0] == 0
    loss = lambda p: jnp.sum(
        gs.replay(mesh, TERM, gs.Tsit5(), y0s, p, args_axes=0, stale="error").ys
    )
    assert jax.grad(loss)(ps).shape == (0, 4)
    sol = jax.vmap(
        lambda y0, p: (
            gs.diffeqsolve(
                TERM, gs.Tsit5(), 0.0, 6.0, None, y0, p, stepsize_controller=CTRL
            ).ys
        )
    )(y0s, ps)
    assert sol.shape == (0, 1, 2)


def test_mismatched_mesh_and_ensemble():
    y3, p3 = jnp.stack([LV.y0] * 3), jnp.stack([LV.args] * 3)
    record = lambda y0, p: gs.record(
        TERM, gs.Tsit5(), 0.0, 6.0, None, y0, p, stepsize_controller=CTRL
    )
    mesh = jax.vmap(record)(y3, p3)
    with pytest.raises(ValueError, match="holds 3 trajectories but y0"):
        gs.replay(mesh, TERM, gs.Tsit5(), y3[:2], p3, args_axes=0)
    with pytest.raises(ValueError, match="holds 3 trajectories but args"):
        gs.replay(mesh, TERM, gs.Tsit5(), y3, p3[:2], args_axes=0)
    with pytest.raises(ValueError, match="one or two axes"):
        gs.replay(jax.tree.map(lambda x: x[None], mesh), TERM, gs.Tsit5(), y3, p3)


def _fails(name, f, t1, match, **kwargs):
    """Same result code as Diffrax (stored under `name`) without `throw`; a named
    error with it."""
    term = diffrax.ODETerm(f)
    ours, theirs = _both(
        name, term=term, t1=t1, y0=jnp.array([1.0]), args=None, throw=False, **kwargs
    )
    assert _message(ours.result) == theirs.result
    assert ours.result != diffrax.RESULTS.successful
    with pytest.raises(ValueError, match=match):
        gs.diffeqsolve(
            term,
            gs.Tsit5(),
            0.0,
            t1,
            None,
            jnp.array([1.0]),
            stepsize_controller=kwargs.get("stepsize_controller", CTRL),
            max_steps=kwargs.get("max_steps", 4096),
        )
    return ours, theirs


def test_nan_mid_solve_recovers_as_diffrax():
    """NaN in a short window: the step that meets it is rejected and shrunk."""
    f = lambda t, y, a: -y + jnp.where(jnp.abs(t - 0.45) < 0.05, jnp.nan, 0.0)
    ours, theirs = _both(
        "nan-recovers", term=diffrax.ODETerm(f), t1=1.0, y0=jnp.array([1.0]), args=None
    )
    _assert_same(ours, theirs)
    assert ours.stats["num_rejected_steps"] > 0
    np.testing.assert_allclose(ours.ys[-1], jnp.exp(-1.0), rtol=1e-5)


def test_nan_mid_solve_that_never_recovers():
    """sqrt(1 - t) is NaN past t = 1: the error names the time and the cause."""
    _fails(
        "nan-never-recovers",
        lambda t, y, a: -y * jnp.sqrt(1.0 - t),
        2.0,
        r"max_steps=4096 was reached at t=(1|0\.99\d*) \((49|50)% .*vector field "
        r"returns NaN or inf at t=1.*square root",
    )


def test_singularity_and_blow_up():
    _fails(
        "singularity",
        lambda t, y, a: jnp.ones_like(y) / (t - 0.5),
        1.0,
        r"reached at t=0\.5 .*step size shrank to .* singular",
    )
    _fails("blow-up", lambda t, y, a: y**2, 2.0, r"reached at t=1\.0000\d* .*blow-up")


def test_stiff_problem_on_an_explicit_solver():
    _fails(
        "stiff",
        lambda t, y, a: -1e6 * (y - jnp.cos(t)),
        10.0,
        r"max_steps=500 was reached at t=.*looks stiff.*stability limit.*"
        r"gs\.Rodas5\(\)",
        max_steps=500,
    )


def test_dtmin_reached_names_the_time():
    ctrl = diffrax.PIDController(rtol=1e-6, atol=1e-6, dtmin=1e-3, force_dtmin=False)
    _fails(
        "dtmin-reached",
        lambda t, y, a: y**2,
        2.0,
        r"step size fell below dtmin at t=0\.99\d* .*Lower dtmin",
        stepsize_controller=ctrl,
    )


def _record(**kwargs):
    kw = dict(y0=LV.y0, args=LV.args, stepsize_controller=CTRL)
    kw.update(kwargs)
    return gs.record(TERM, gs.Tsit5(), 0.0, 1.0, None, **kw)


def test_two_dimensional_save_times_are_refused():
    ts = jnp.array([[0.2], [0.5]])
    with pytest.raises(ValueError, match=r"saveat.ts has shape \(2, 1\)"):
        _record(saveat=gs.SaveAt(ts=ts))
    with pytest.raises(ValueError, match=r"saveat.ts has shape \(2, 1\)"):
        gs.diffeqsolve(TERM, gs.Tsit5(), 0.0, 1.0, None, LV.y0, LV.args,
                       saveat=gs.SaveAt(ts=ts), stepsize_controller=CTRL)  # fmt: skip


@pytest.mark.parametrize("solver", [None, gs.Tsit5, "tsit5"])
def test_something_not_a_solver_is_a_type_error(solver):
    with pytest.raises(TypeError, match="is not a solver: pass an instance"):
        gs.diffeqsolve(TERM, solver, 0.0, 1.0, 0.1, LV.y0, LV.args)
    with pytest.raises(TypeError, match="is not a solver: pass an instance"):
        gs.record(TERM, solver, 0.0, 1.0, 0.1, LV.y0, LV.args)


def test_replay_of_something_not_a_mesh_is_a_type_error():
    sol = gs.diffeqsolve(TERM, gs.Tsit5(), 0.0, 1.0, None, LV.y0, LV.args,
                         stepsize_controller=CTRL)  # fmt: skip
    with pytest.raises(TypeError, match=r"gs.RecordedMesh \(a solution: pass its"):
        gs.replay(sol, TERM, gs.Tsit5(), LV.y0, LV.args)
    with pytest.raises(TypeError, match="got NoneType"):
        gs.replay(None, TERM, gs.Tsit5(), LV.y0, LV.args)


@pytest.mark.parametrize(
    "rtol, atol", [(-1e-6, 1e-6), (1e-6, -1e-6), (0.0, 0.0), (np.nan, 1e-6)]
)
def test_invalid_tolerances_are_named(rtol, atol):
    ctrl = gs.PIDController(rtol=rtol, atol=atol)
    with pytest.raises(ValueError, match="tolerances must be finite, non-negative"):
        _record(stepsize_controller=ctrl)
    with pytest.raises(ValueError, match="tolerances must be finite, non-negative"):
        gs.diffeqsolve(TERM, gs.Tsit5(), 0.0, 1.0, None, LV.y0, LV.args,
                       stepsize_controller=ctrl)  # fmt: skip


def test_numpy_integer_max_steps_and_float32_times_as_diffrax():
    # (Diffrax itself needs a Python int: it compares max_steps under jit.)
    t0, t1 = jnp.float32(0.0), jnp.float32(2.0)
    ours, theirs = _both("numpy-max-steps-float32-times", t0=t0, t1=t1, max_steps=256)
    _assert_same(ours, theirs)
    numpy_max_steps = gs.diffeqsolve(
        TERM, gs.Tsit5(), t0, t1, None, LV.y0, LV.args,
        stepsize_controller=CTRL, max_steps=np.int64(256),
    )  # fmt: skip
    np.testing.assert_array_equal(numpy_max_steps.ys, ours.ys)
    np.testing.assert_array_equal(numpy_max_steps.ts, ours.ts)


def test_errors_of_the_vector_field_keep_their_type():
    def branching(t, y, args):
        return -y if y[0] > 0 else y  # Python control flow on a traced value

    with pytest.raises(jax.errors.TracerBoolConversionError) as caught:
        gs.diffeqsolve(diffrax.ODETerm(branching), gs.Tsit5(), 0.0, 1.0, 0.1, LV.y0)
    assert any("raised by the vector field" in n for n in caught.value.__notes__)


def test_vector_field_returning_a_python_number():
    term = diffrax.ODETerm(lambda t, y, args: -0.5)
    ours, theirs = _both("python-number-field", term=term, y0=jnp.array(1.0), args=None)
    _assert_same(ours, theirs)


@pytest.mark.parametrize("name", ["t0", "t1", "dt0"])
def test_a_time_given_as_a_string_is_a_type_error(name):
    times = dict(t0=0.0, t1=1.0, dt0=0.1)
    times[name] = "1.0"
    with pytest.raises(TypeError, match=rf"^{name} must be a real number"):
        gs.diffeqsolve(TERM, gs.Tsit5(), y0=LV.y0, args=LV.args, **times)
    with pytest.raises(TypeError, match=rf"^{name} must be a real number"):
        gs.record(TERM, gs.Tsit5(), y0=LV.y0, args=LV.args, **times)


def test_dtmax_that_allows_no_step_is_named():
    ctrl = gs.PIDController(rtol=1e-6, atol=1e-6, dtmax=0.0)
    with pytest.raises(ValueError, match=r"dtmax=0\.0\): dtmax must be positive"):
        _record(stepsize_controller=ctrl)


def test_factormax_below_one_is_named_when_the_solve_stalls():
    # Each step is at most half the one before: the steps sum to at most twice the
    # first (about 1e-3 here), so the solve never reaches t1 = 1.
    ctrl = diffrax.PIDController(rtol=1e-6, atol=1e-6, factormax=0.5)
    _fails(
        "factormax-stall",
        lambda t, y, a: -y,
        1.0,
        r"max_steps=64 was reached .*factormax=0\.5\) lets no step grow.*"
        r"Use factormax >= 1",
        stepsize_controller=ctrl,
        max_steps=64,
    )
