"""Anything outside the fast path is passed to diffrax.diffeqsolve unchanged."""

import diffrax
import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs

from .helpers import PROBLEMS


LV = PROBLEMS["lotka_volterra"]
TERM = diffrax.ODETerm(LV.f)
CTRL = diffrax.PIDController(rtol=1e-6, atol=1e-6)


def _both(solver, **kwargs):
    args = (TERM, solver, 0.0, 6.0, None, LV.y0, LV.args)
    kwargs.setdefault("stepsize_controller", CTRL)
    return gs.diffeqsolve(*args, **kwargs), diffrax.diffeqsolve(*args, **kwargs)


@pytest.mark.parametrize(
    "solver,kwargs",
    [
        (diffrax.Tsit5(), {}),
        (diffrax.Kvaerno5(), {}),
        (gs.Tsit5(), {"saveat": diffrax.SaveAt(dense=True)}),
        (
            gs.Tsit5(),
            {
                "saveat": diffrax.SaveAt(
                    ts=jnp.linspace(0, 6, 5), fn=lambda t, y, a: y[0]
                )
            },
        ),
        (gs.Tsit5(), {"adjoint": diffrax.DirectAdjoint()}),
        (gs.Tsit5(), {"event": diffrax.Event(lambda t, y, args, **kw: y[0] - 0.5)}),
    ],
    ids=["diffrax_solver", "implicit_solver", "dense", "saveat_fn", "adjoint", "event"],
)
def test_fallback_equals_diffrax(solver, kwargs):
    ours, theirs = _both(solver, **kwargs)
    assert isinstance(ours, diffrax.Solution)
    np.testing.assert_array_equal(ours.ys, theirs.ys)
    np.testing.assert_array_equal(ours.ts, theirs.ts)


def test_gradsolve_solvers_are_diffrax_solvers():
    ts = jnp.linspace(0, 6, 9)
    for ours, theirs in [
        (gs.Tsit5(), diffrax.Tsit5()),
        (gs.Dopri5(), diffrax.Dopri5()),
    ]:
        kwargs = dict(
            saveat=diffrax.SaveAt(ts=ts, dense=True), stepsize_controller=CTRL
        )
        a = diffrax.diffeqsolve(TERM, ours, 0.0, 6.0, None, LV.y0, LV.args, **kwargs)
        b = diffrax.diffeqsolve(TERM, theirs, 0.0, 6.0, None, LV.y0, LV.args, **kwargs)
        np.testing.assert_allclose(a.ys, b.ys, rtol=1e-10)
        np.testing.assert_allclose(a.evaluate(2.345), b.evaluate(2.345), rtol=1e-10)
