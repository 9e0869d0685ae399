"""Property tests: random stable linear systems and random Lotka--Volterra systems,
random tolerances and time spans, each checked against Diffrax.

For every example: the recorded mesh has Diffrax's steps, the gradient is Diffrax's,
a replay of the fresh mesh reproduces the solve (and says the mesh is fresh), and
forward and reverse mode agree through the replay. Arrays (not Python floats) carry
the tolerances and times, so one compilation serves every example of a shape.
"""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import gradsolve as gs


def _linear(t, y, A):
    return A @ y


def _lotka_volterra(t, y, p):
    a, b, c, d = p
    return jnp.stack([a * y[0] - b * y[0] * y[1], c * y[0] * y[1] - d * y[1]])


def _solve(lib, solver, f, y0, args, t1, tol, saveat=None):
    return lib.diffeqsolve(
        diffrax.ODETerm(f),
        solver,
        jnp.zeros_like(t1),
        t1,
        None,
        y0,
        args,
        saveat=saveat or diffrax.SaveAt(t1=True),
        stepsize_controller=diffrax.PIDController(rtol=tol, atol=tol),
    )


FIELDS = {"linear": _linear, "lotka_volterra": _lotka_volterra}


@jax.jit(static_argnums=0)
def _diffrax_steps(name, y0, args, t1, tol):
    saveat = diffrax.SaveAt(steps=True)
    sol = _solve(diffrax, diffrax.Tsit5(), FIELDS[name], y0, args, t1, tol, saveat)
    return sol.ts, sol.stats["num_accepted_steps"]


def _gradient(lib, solver):
    @jax.jit(static_argnums=0)
    def gradient(name, y0, args, t1, tol):
        def loss(y0, args):
            return jnp.sum(_solve(lib, solver, FIELDS[name], y0, args, t1, tol).ys ** 2)

        return jax.grad(loss, argnums=(0, 1))(y0, args)

    return gradient


_OUR_GRADIENT = _gradient(gs, gs.Tsit5())
_DIFFRAX_GRADIENT = _gradient(diffrax, diffrax.Tsit5())


@jax.jit(static_argnums=0)
def _diffrax_gradient_over(name, step_ts, y0, args):
    """Diffrax's gradient over the given steps (`StepTo`): the exact discrete adjoint
    of those steps, from an independent implementation."""

    def loss(y0, args):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(FIELDS[name]),
            diffrax.Tsit5(),
            step_ts[0],
            step_ts[-1],
            None,
            y0,
            args,
            stepsize_controller=diffrax.StepTo(ts=step_ts),
        )
        return jnp.sum(sol.ys**2)

    return jax.grad(loss, argnums=(0, 1))(y0, args)


@jax.jit(static_argnums=0)
def _replay_checks(name, mesh, y0, args):
    term = diffrax.ODETerm(FIELDS[name])
    replayed = gs.replay(mesh, term, gs.Tsit5(), y0, args, stale="error")
    final = lambda y0, args: gs.replay(mesh, term, gs.Tsit5(), y0, args).ys[-1]
    fwd = jax.jacfwd(final, argnums=(0, 1))(y0, args)
    rev = jax.jacrev(final, argnums=(0, 1))(y0, args)
    return replayed.ys, replayed.stats["max_error_ratio"], fwd, rev


def _check(name, y0, args, t1, tol):
    t1, tol = jnp.asarray(t1), jnp.asarray(tol)
    f = FIELDS[name]
    ctrl = diffrax.PIDController(rtol=tol, atol=tol)

    # 1. Diffrax's steps.
    mesh = gs.record(
        diffrax.ODETerm(f),
        gs.Tsit5(),
        jnp.zeros_like(t1),
        t1,
        None,
        y0,
        args,
        stepsize_controller=ctrl,
    )
    ts, n = _diffrax_steps(name, y0, args, t1, tol)
    assert int(mesh.num_steps) == int(n)
    # To round-off, amplified: a matrix product on a state held as components is
    # summed in another order than XLA's dot, and the error estimate (a difference
    # of nearly equal stage sums) amplifies it: step times moved by 5.4e-7 at
    # t1 = 0.5 in a random 3 x 3 system at tol = 1e-8, where the array form gives
    # Diffrax's steps bit for bit.
    np.testing.assert_allclose(mesh.ts[1 : n + 1], ts[:n], rtol=0, atol=1e-5 * t1)

    # 2. Diffrax's gradient: over the same steps to round-off, and Diffrax's own
    # (its steps differ from the recorded ones by the round-off of the error
    # estimate, which moves a gradient by up to ~1e-7 relative at rtol = 1e-8).
    ours = _OUR_GRADIENT(name, y0, args, t1, tol)
    same_steps = _diffrax_gradient_over(
        name, mesh.ts[: int(mesh.num_steps) + 1], y0, args
    )
    theirs = _DIFFRAX_GRADIENT(name, y0, args, t1, tol)
    for a, b, c in zip(ours, same_steps, theirs):
        scale = float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9 * scale)
        np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-6 * scale)

    # 3. A replay of the fresh mesh reproduces the solve and says it is fresh.
    # 4. Forward and reverse mode agree through the replay.
    sol = _solve(gs, gs.Tsit5(), f, y0, args, t1, tol)
    ys, ratio, fwd, rev = _replay_checks(name, mesh, y0, args)
    np.testing.assert_allclose(ys, sol.ys, rtol=1e-12, atol=1e-12)
    assert ratio <= 1
    for a, b in zip(fwd, rev):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


tolerances = st.floats(-8, -4).map(lambda e: 10.0**e)
spans = st.floats(0.5, 5.0)


@st.composite
def stable_linear(draw):
    d = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    B = rng.normal(size=(d, d)) / np.sqrt(d)
    S = rng.normal(size=(d, d))
    # A skew part (rotation) minus a positive definite part: all eigenvalues in the
    # open left half plane.
    A = (S - S.T) - (B @ B.T + 0.1 * np.eye(d))
    return jnp.asarray(A), jnp.asarray(rng.normal(size=d))


@st.composite
def lotka_volterra(draw):
    p = [draw(st.floats(0.5, 2.0)) for _ in range(4)]
    y0 = [draw(st.floats(0.5, 2.0)) for _ in range(2)]
    return jnp.asarray(p), jnp.asarray(y0)


def _linear_property(system, t1, tol):
    A, y0 = system
    _check("linear", y0, A, t1, tol)


def _lv_property(system, t1, tol):
    p, y0 = system
    _check("lotka_volterra", y0, p, t1, tol)


@settings(max_examples=1, deadline=None)
@given(stable_linear(), spans, tolerances)
def test_random_stable_linear_systems(system, t1, tol):
    _linear_property(system, t1, tol)


@settings(max_examples=1, deadline=None)
@given(lotka_volterra(), spans, tolerances)
def test_random_lotka_volterra(system, t1, tol):
    _lv_property(system, t1, tol)


@pytest.mark.slow
# The same 100 examples on every run (CI included); the default tests draw anew.
@settings(max_examples=100, deadline=None, derandomize=True)
@given(stable_linear(), spans, tolerances)
def test_random_stable_linear_systems_many(system, t1, tol):
    _linear_property(system, t1, tol)


@pytest.mark.slow
@settings(max_examples=100, deadline=None, derandomize=True)
@given(lotka_volterra(), spans, tolerances)
def test_random_lotka_volterra_many(system, t1, tol):
    _lv_property(system, t1, tol)
