"""Non-finite or zero times are errors that name the argument, eagerly and inside
`jit`, for `gs.diffeqsolve` and `gs.record`: never `y0` returned as a successful
solve or a made-up saved value."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import gradsolve as gs


RUNTIME = (eqx.EquinoxRuntimeError, jax.errors.JaxRuntimeError)
TERM = diffrax.ODETerm(lambda t, y, args: -args * y)
CTRL = diffrax.PIDController(rtol=1e-6, atol=1e-6)
Y0 = jnp.array([1.0, 2.0])

CASES = [
    (dict(t1=jnp.nan), "t1 is NaN or infinite"),
    (dict(t1=jnp.inf), "t1 is NaN or infinite"),
    (dict(t0=-jnp.inf), "t0 is NaN or infinite"),
    (dict(dt0=jnp.nan), "dt0 is NaN or infinite"),
    (dict(dt0=0.0), "dt0 is 0"),
    (dict(ts=jnp.array([0.5, jnp.nan])), "saveat.ts is NaN or infinite"),
    (dict(ts=jnp.array([jnp.inf])), "saveat.ts is NaN or infinite"),
]


def _call(fn, t0=0.0, t1=2.0, dt0=None, ts=None):
    saveat = gs.SaveAt(t1=True) if ts is None else gs.SaveAt(ts=ts)
    out = fn(
        TERM, gs.Tsit5(), t0, t1, dt0, Y0, 0.5, saveat=saveat, stepsize_controller=CTRL
    )
    return out.ts


@pytest.mark.parametrize("fn", [gs.diffeqsolve, gs.record], ids=["solve", "record"])
@pytest.mark.parametrize("case, message", CASES)
def test_bad_times_are_errors(fn, case, message):
    with pytest.raises(ValueError, match=message):
        _call(fn, **case)
    traced = eqx.filter_jit(lambda c: _call(fn, **c))
    # Inside `jit`, a traced time fails when the program runs; a Python number is
    # known while tracing, and may fail then.
    with pytest.raises(RUNTIME, match=message):
        jax.block_until_ready(traced(jax.tree.map(jnp.asarray, case)))
    with pytest.raises((ValueError, *RUNTIME), match=message):
        jax.block_until_ready(traced(case))


@pytest.mark.parametrize("fn", [gs.diffeqsolve, gs.record], ids=["solve", "record"])
@pytest.mark.parametrize("max_steps", [0, -1, 2.5, True])
def test_max_steps_must_be_a_positive_integer(fn, max_steps):
    with pytest.raises(ValueError, match="max_steps=.*positive integer"):
        fn(
            TERM,
            gs.Tsit5(),
            0.0,
            1.0,
            None,
            Y0,
            0.5,
            stepsize_controller=CTRL,
            max_steps=max_steps,
        )


def test_forward_mode_through_diffeqsolve_points_to_replay():
    solve = lambda rate: (
        gs.diffeqsolve(
            TERM, gs.Tsit5(), 0.0, 1.0, None, Y0, rate, stepsize_controller=CTRL
        ).ys
    )
    for transform in (
        lambda f: jax.jvp(f, (0.5,), (1.0,)),
        lambda f: jax.jacfwd(f)(0.5),
    ):
        with pytest.raises(TypeError, match="forward mode .* gs.replay"):
            transform(solve)


def test_stiff_problem_at_a_loose_tolerance_is_called_stiff():
    # Robertson's kinetics on an explicit solver: only rejected trial steps
    # overflow, the accepted states stay finite, and the message says stiff.
    def robertson(t, y, k):
        return jnp.stack(
            [
                -k[0] * y[0] + k[2] * y[1] * y[2],
                k[0] * y[0] - k[1] * y[1] ** 2 - k[2] * y[1] * y[2],
                k[1] * y[1] ** 2,
            ]
        )

    for fn in (gs.diffeqsolve, gs.record):
        with pytest.raises(ValueError, match="looks stiff.*gs.Rodas5"):
            fn(
                diffrax.ODETerm(robertson),
                gs.Tsit5(),
                0.0,
                1e3,
                None,
                jnp.array([1.0, 0.0, 0.0]),
                jnp.array([0.04, 3e7, 1e4]),
                stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-6),
                max_steps=2000,
            )
