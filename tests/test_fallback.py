"""Anything outside the fast path is passed to diffrax.diffeqsolve unchanged."""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs

from .helpers import PROBLEMS
from .references import StoredReferences, assert_same, result_message


LV = PROBLEMS["lotka_volterra"]
TERM = diffrax.ODETerm(LV.f)
CTRL = diffrax.PIDController(rtol=1e-6, atol=1e-6)
# Diffrax's own solutions, to compare the fallback's with: gradsolve's side of each
# test runs Diffrax live (that is what a fallback is).
REFERENCES = StoredReferences(__file__)


def _solve(lib, solver, terms=TERM, y0=LV.y0, **kwargs):
    kwargs.setdefault("stepsize_controller", CTRL)
    dt0 = kwargs.pop("dt0", None)
    return lib.diffeqsolve(terms, solver, 0.0, 6.0, dt0, y0, LV.args, **kwargs)


def _parts(sol: diffrax.Solution) -> dict:
    result = result_message(diffrax.RESULTS, sol.result)
    return {"ts": sol.ts, "ys": sol.ys, "result": result}


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


@pytest.mark.bitwise
@pytest.mark.parametrize("row", list(ROWS))
def test_fallback_equals_diffrax(row):
    solver, kwargs = ROWS[row]
    ours = _solve(gs, solver, **kwargs)
    assert isinstance(ours, diffrax.Solution)
    theirs = REFERENCES(row, lambda: _parts(_solve(diffrax, solver, **kwargs)))
    assert_same(jax.tree.map(np.asarray, _parts(ours)), theirs, row)


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
    theirs = REFERENCES(
        "gradient-with-event", lambda: jax.grad(lambda p: loss(diffrax, p))(LV.args)
    )
    assert_same(np.asarray(ours), theirs, "gradient-with-event")
    assert jnp.all(jnp.isfinite(ours))


def test_gradsolve_solvers_are_diffrax_solvers():
    saveat = diffrax.SaveAt(ts=jnp.linspace(0, 6, 9), dense=True)

    def solve(solver):
        sol = _solve(diffrax, solver, saveat=saveat)
        return {"ys": sol.ys, "at 2.345": sol.evaluate(2.345)}

    for ours, theirs in [
        (gs.Tsit5(), diffrax.Tsit5()),
        (gs.Dopri5(), diffrax.Dopri5()),
    ]:
        a = solve(ours)
        b = REFERENCES(f"diffrax-{type(theirs).__name__}", lambda: solve(theirs))
        np.testing.assert_allclose(a["ys"], b["ys"], rtol=1e-10)
        np.testing.assert_allclose(a["at 2.345"], b["at 2.345"], rtol=1e-10)
