"""Bad input gets a clear error that names the fix."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import gradsolve as gs

from .helpers import PROBLEMS


LV = PROBLEMS["lotka_volterra"]
TERM = diffrax.ODETerm(LV.f)
CTRL = diffrax.PIDController(rtol=1e-6, atol=1e-6)
# Inside jax.jit (rather than eqx.filter_jit) the same message arrives wrapped.
RUNTIME = (eqx.EquinoxRuntimeError, jax.errors.JaxRuntimeError)


def solve(**overrides):
    kwargs = dict(
        terms=TERM,
        solver=gs.Tsit5(),
        t0=0.0,
        t1=6.0,
        dt0=None,
        y0=LV.y0,
        args=LV.args,
        stepsize_controller=CTRL,
    )
    kwargs.update(overrides)
    return gs.diffeqsolve(**kwargs)


def _raises(match, **overrides):
    with pytest.raises((ValueError, TypeError, *RUNTIME), match=match):
        jax.block_until_ready(solve(**overrides))


def test_nan_in_y0_and_args():
    _raises("y0 contains NaN or inf", y0=jnp.array([jnp.nan, 1.0]))
    _raises("args contains NaN or inf", args=LV.args.at[0].set(jnp.inf))


def test_nan_inside_jit_is_caught():
    bad = jax.jit(lambda y0: solve(y0=y0).ys)
    with pytest.raises(RUNTIME, match="y0 contains NaN or inf"):
        jax.block_until_ready(bad(jnp.array([jnp.nan, 1.0])))


def test_dt0_with_the_wrong_sign():
    _raises("dt0 has the wrong sign", dt0=-0.1)
    _raises("dt0 has the wrong sign", t0=6.0, t1=0.0, dt0=0.1)


def test_max_steps_reached():
    # Eagerly: the time reached (Diffrax's fifth step end) and the counts.
    ref = diffrax.diffeqsolve(
        TERM,
        diffrax.Tsit5(),
        0.0,
        6.0,
        None,
        LV.y0,
        LV.args,
        stepsize_controller=CTRL,
        saveat=diffrax.SaveAt(steps=True),
        max_steps=5,
        throw=False,
    )
    t = float(ref.ts[int(ref.stats["num_accepted_steps"]) - 1])
    _raises(
        rf"max_steps=5 was reached at t={t:.9g} \({int(100 * t / 6)}% of the way "
        r"from t0=0 to t1=6\), after 5 accepted steps.*Raise max_steps"
        r".*loosen rtol/atol.*stiff",
        max_steps=5,
    )
    # Inside jit the message is static: the fraction of the interval covered.
    jitted = jax.jit(lambda y0: solve(y0=y0, max_steps=5).ys)
    with pytest.raises(RUNTIME, match=rf"max_steps=5 was reached {int(100 * t / 6)}%"):
        jax.block_until_ready(jitted(LV.y0))
    _raises(
        "max_steps=200 was reached at t=2 .*(49|50)% of the way",
        t1=4.0,
        dt0=0.01,
        max_steps=200,
        stepsize_controller=diffrax.ConstantStepSize(),
    )
    sol = solve(max_steps=5, throw=False)
    assert sol.result == diffrax.RESULTS.max_steps_reached
    with pytest.raises(ValueError, match="max_steps=5 was reached at t="):
        jax.block_until_ready(
            gs.record(
                TERM,
                gs.Tsit5(),
                0.0,
                6.0,
                None,
                LV.y0,
                LV.args,
                stepsize_controller=CTRL,
                max_steps=5,
            )
        )


def test_vector_field_wrong_shape_or_dtype():
    with pytest.raises(ValueError, match="shape"):
        solve(terms=diffrax.ODETerm(lambda t, y, a: jnp.zeros(3)))
    with pytest.raises(ValueError, match="structure"):
        solve(terms=diffrax.ODETerm(lambda t, y, a: (y, y)))
    with pytest.raises(ValueError, match="dtype"):
        solve(terms=diffrax.ODETerm(lambda t, y, a: jnp.zeros(2, dtype=jnp.complex128)))


def test_saveat_ts_unsorted_or_outside():
    _raises("sorted", saveat=diffrax.SaveAt(ts=jnp.array([1.0, 0.5])))
    _raises("within", saveat=diffrax.SaveAt(ts=jnp.array([1.0, 7.0])))
    traced = jax.jit(lambda ts: solve(saveat=diffrax.SaveAt(ts=ts)).ys)
    with pytest.raises(RUNTIME, match="sorted"):
        jax.block_until_ready(traced(jnp.array([2.0, 1.0])))


def test_replay_with_another_solver_or_batch():
    mesh = gs.record(
        TERM, gs.Tsit5(), 0.0, 6.0, None, LV.y0, LV.args, stepsize_controller=CTRL
    )
    with pytest.raises(ValueError, match="recorded with Tsit5.*allow_other_solver"):
        gs.replay(mesh, TERM, gs.Dopri5(), LV.y0, LV.args)
    sol = gs.replay(mesh, TERM, gs.Dopri5(), LV.y0, LV.args, allow_other_solver=True)
    assert jnp.all(jnp.isfinite(sol.ys))
    with pytest.raises(TypeError, match="gradsolve solver"):
        gs.replay(mesh, TERM, diffrax.Tsit5(), LV.y0, LV.args)


def test_time_derivatives_are_refused_by_record():
    # gs.diffeqsolve hands time derivatives to Diffrax (tests/test_dropin.py); a
    # recording holds its step times fixed and says so.
    def loss(t1):
        mesh = gs.record(
            TERM, gs.Tsit5(), 0.0, t1, None, LV.y0, LV.args, stepsize_controller=CTRL
        )
        return jnp.sum(mesh.ts)

    with pytest.raises(ValueError, match="t0, t1, dt0, saveat.ts"):
        jax.grad(loss)(6.0)


def test_record_refuses_what_it_cannot_record():
    with pytest.raises(ValueError, match="cannot record.*Kvaerno5"):
        gs.record(
            TERM,
            diffrax.Kvaerno5(),
            0.0,
            6.0,
            None,
            LV.y0,
            LV.args,
            stepsize_controller=CTRL,
        )


def test_dtmin_reached_without_force():
    ctrl = diffrax.PIDController(rtol=1e-10, atol=1e-10, dtmin=0.05, force_dtmin=False)
    _raises("step size fell below dtmin", stepsize_controller=ctrl)
    sol = solve(stepsize_controller=ctrl, throw=False)
    want = diffrax.diffeqsolve(
        TERM,
        diffrax.Tsit5(),
        0.0,
        6.0,
        None,
        LV.y0,
        LV.args,
        stepsize_controller=ctrl,
        throw=False,
    )
    assert sol.result == diffrax.RESULTS.dt_min_reached == want.result
