"""Anything outside the fast path is passed to diffrax.diffeqsolve unchanged."""

import diffrax
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import gradsolve as gs

from .helpers import PROBLEMS


LV = PROBLEMS["lotka_volterra"]
TERM = diffrax.ODETerm(LV.f)
CTRL = diffrax.PIDController(rtol=1e-6, atol=1e-6)


def _both(solver, terms=TERM, y0=LV.y0, **kwargs):
    args = (terms, solver, 0.0, 6.0, kwargs.pop("dt0", None), y0, LV.args)
    kwargs.setdefault("stepsize_controller", CTRL)
    return gs.diffeqsolve(*args, **kwargs), diffrax.diffeqsolve(*args, **kwargs)


def _sde_terms():
    brownian = diffrax.VirtualBrownianTree(
        0.0, 6.0, tol=1e-3, shape=(2,), key=jax.random.key(0)
    )
    noise = diffrax.ControlTerm(lambda t, y, args: 0.1 * jnp.diag(y), brownian)
    return diffrax.MultiTerm(TERM, noise)


def _cde_terms():
    ts = jnp.linspace(0.0, 6.0, 13)
    control = diffrax.LinearInterpolation(ts, jnp.stack([ts, jnp.sin(ts)], axis=1))
    return diffrax.ControlTerm(lambda t, y, args: -jnp.diag(y) * 0.3, control)


# One row per line of the README's fallback table.
ROWS = {
    "diffrax_solver": (diffrax.Tsit5(), {}),
    "implicit_solver": (diffrax.Kvaerno5(), {}),
    "dense": (gs.Tsit5(), {"saveat": diffrax.SaveAt(dense=True)}),
    "saveat_fn": (
        gs.Tsit5(),
        {"saveat": diffrax.SaveAt(ts=jnp.linspace(0, 6, 5), fn=lambda t, y, a: y[0])},
    ),
    "subsaveat": (
        gs.Tsit5(),
        {
            "saveat": diffrax.SaveAt(
                subs=(
                    diffrax.SubSaveAt(t1=True),
                    diffrax.SubSaveAt(ts=jnp.linspace(0, 6, 4)),
                )
            )
        },
    ),
    "steps_n": (gs.Tsit5(), {"saveat": diffrax.SaveAt(steps=3)}),
    "sde": (
        diffrax.Euler(),
        {
            "terms": _sde_terms(),
            "dt0": 0.01,
            "stepsize_controller": diffrax.ConstantStepSize(),
            "max_steps": 1000,
        },
    ),
    "cde": (gs.Tsit5(), {"terms": _cde_terms()}),
    "direct_adjoint": (gs.Tsit5(), {"adjoint": diffrax.DirectAdjoint()}),
    "backsolve_adjoint": (gs.Tsit5(), {"adjoint": diffrax.BacksolveAdjoint()}),
    "event": (
        gs.Tsit5(),
        {"event": diffrax.Event(lambda t, y, args, **kw: y[0] - 0.5)},
    ),
    "progress_meter": (gs.Tsit5(), {"progress_meter": diffrax.TextProgressMeter()}),
    "made_jump": (gs.Tsit5(), {"made_jump": jnp.array(False)}),
    "max_steps_none": (
        gs.Tsit5(),
        {"max_steps": None, "adjoint": diffrax.ForwardMode()},
    ),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_fallback_equals_diffrax(row):
    solver, kwargs = ROWS[row]
    ours, theirs = _both(solver, **kwargs)
    assert isinstance(ours, diffrax.Solution)
    for a, b in zip(
        jtu.tree_leaves((ours.ts, ours.ys)), jtu.tree_leaves((theirs.ts, theirs.ys))
    ):
        np.testing.assert_array_equal(a, b)
    assert ours.result == theirs.result


def test_gradient_through_a_fallback_solve():
    """A gradsolve solver with an event, differentiated: Diffrax's gradient."""
    event = diffrax.Event(lambda t, y, args, **kw: y[0] - 0.5)

    def loss(lib, p):
        sol = lib.diffeqsolve(
            TERM,
            gs.Tsit5(),
            0.0,
            6.0,
            None,
            LV.y0,
            p,
            stepsize_controller=CTRL,
            event=event,
        )
        return jnp.sum(sol.ys**2)

    ours = jax.grad(lambda p: loss(gs, p))(LV.args)
    theirs = jax.grad(lambda p: loss(diffrax, p))(LV.args)
    np.testing.assert_array_equal(ours, theirs)
    assert jnp.all(jnp.isfinite(ours))


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
