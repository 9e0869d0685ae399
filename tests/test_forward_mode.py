"""Invariant 4: jvp, jacfwd and hessian work through the replay and agree with
reverse mode and with central finite differences."""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs

from .helpers import PROBLEMS


CTRL = diffrax.PIDController(rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "solver",
    [gs.Tsit5(), pytest.param(gs.Dopri5(), marks=pytest.mark.slow)],
    ids=["tsit5", "dopri5"],
)
def test_forward_mode_through_replay(solver):
    problem = PROBLEMS["lotka_volterra"]
    term = diffrax.ODETerm(problem.f)
    ts = jnp.linspace(0.5, 6.0, 7)
    mesh = gs.record(
        term, solver, 0.0, 6.0, None, problem.y0, problem.args, stepsize_controller=CTRL
    )

    def solution(params):
        sol = gs.replay(
            mesh, term, solver, problem.y0, params, saveat=diffrax.SaveAt(ts=ts)
        )
        return sol.ys.ravel()

    def loss(params):
        return jnp.sum(jnp.sin(solution(params)))

    # Each compiled once: the finite differences below call them 8 times.
    solution, loss = jax.jit(solution), jax.jit(loss)
    p = problem.args
    forward = jax.jacfwd(solution)(p)
    backward = jax.jacrev(solution)(p)
    np.testing.assert_allclose(forward, backward, rtol=1e-10, atol=1e-12)
    direction = jnp.array([0.3, -0.2, 0.5, 0.1])
    _, tangent = jax.jvp(solution, (p,), (direction,))
    np.testing.assert_allclose(tangent, backward @ direction, rtol=1e-10, atol=1e-12)
    # Central differences on the same mesh: the replay is a smooth function of params.
    eps = 1e-6
    columns = [
        (solution(p + eps * e) - solution(p - eps * e)) / (2 * eps) for e in jnp.eye(4)
    ]
    np.testing.assert_allclose(
        forward, jnp.stack(columns, axis=1), rtol=1e-6, atol=1e-7
    )
    hessian = jax.hessian(loss)(p)
    np.testing.assert_allclose(hessian, hessian.T, rtol=1e-9, atol=1e-11)

    # The gradient of the loss from the programs compiled above (no third one):
    # the chain rule through the reverse-mode Jacobian.
    def grad(q):
        return jax.jacrev(solution)(q).T @ jnp.cos(solution(q))

    fd_hessian = jnp.stack(
        [(grad(p + eps * e) - grad(p - eps * e)) / (2 * eps) for e in jnp.eye(4)]
    )
    np.testing.assert_allclose(hessian, fd_hessian, rtol=1e-5, atol=1e-6)


def test_forward_only_replay_runs_only_the_recorded_steps():
    # gs.fit's forward-mode Jacobian blocks replay with a while loop that stops at
    # the batch's longest recorded step instead of running the whole buffer: the
    # same values and tangents as the scan over the buffer.
    from gradsolve._replay import replay_values

    problem = PROBLEMS["lotka_volterra"]
    term = diffrax.ODETerm(problem.f)
    ts = jnp.linspace(0.5, 6.0, 7)
    y0s = problem.y0 * jnp.linspace(0.5, 2.0, 6)[:, None]
    # An untrimmed buffer of 300 steps, trajectories of different lengths.
    record = lambda y0: gs.record(term, gs.Tsit5(), 0.0, 6.0, None, y0, problem.args,
                                  stepsize_controller=CTRL, max_steps=300)  # fmt: skip
    mesh = jax.vmap(record)(y0s)
    assert mesh.max_steps == 300 and len(set(np.asarray(mesh.num_steps))) > 1

    def values(forward_only):
        one = lambda m, y0, p: replay_values(
            m, term, gs.Tsit5(), y0, p, ts, forward_only
        )
        batch = lambda p: jax.vmap(one, in_axes=(0, 0, None))(mesh, y0s, p)
        return jax.jit(lambda p: (batch(p), jax.jacfwd(batch)(p)))

    got, want = values(True)(problem.args), values(False)(problem.args)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    # The steps' scan became a while loop.
    count = lambda f: str(jax.make_jaxpr(f)(problem.args)).count(" while[")
    assert count(values(True)) > count(values(False))


def _michaelis_menten(t, y, p):
    # Divisions by a parameter and by a state-dependent value.
    vmax, km, volume = p[0], p[1], p[2]
    s, q = y[0], y[1]
    rate = vmax * s / (km + s)
    return jnp.stack([-rate / volume, rate / volume - q / p[3]])


def test_divisions_on_components_share_one_reciprocal_across_tangents():
    # On components a division's derivative takes one reciprocal, whatever the
    # number of tangents (JAX's own rule divides every tangent): the elements
    # divided in a forward-mode Jacobian do not grow with the parameters.
    from gradsolve._component_field import ComponentProblem
    from gradsolve._components import Layout
    from gradsolve._representation import equations

    y0 = jnp.array([2.0, 0.5])
    layout = Layout.of([y0])
    treedef = jax.tree_util.tree_structure(y0)

    def on_components(p, y):
        problem = ComponentProblem(_michaelis_menten, p, treedef, layout)
        return jnp.stack(problem.vf(0.0, [y[0], y[1]]))

    def divisions(num_params):
        p = jnp.linspace(1.0, 2.0, num_params)
        jaxpr = jax.make_jaxpr(jax.jacfwd(on_components))(p, y0).jaxpr
        return sum(
            eqn.outvars[0].aval.size
            for eqn, _ in equations(jaxpr)
            if eqn.primitive.name == "div"
        )

    assert divisions(4) == divisions(12)
    p = jnp.array([1.5, 0.7, 2.0, 3.0])
    # Values bit for bit, derivatives to round-off, of the field as written.
    assert jnp.array_equal(on_components(p, y0), _michaelis_menten(0.0, y0, p))
    for wrt in (0, 1):
        ours = jax.jacfwd(on_components, argnums=wrt)(p, y0)
        theirs = jax.jacfwd(lambda p, y: _michaelis_menten(0.0, y, p), argnums=wrt)(
            p, y0
        )
        np.testing.assert_allclose(ours, theirs, rtol=1e-14, atol=1e-15)
        back = jax.jacrev(on_components, argnums=wrt)(p, y0)
        np.testing.assert_allclose(back, theirs, rtol=1e-14, atol=1e-15)


def test_replay_jacobian_of_a_field_with_divisions_matches_finite_differences():
    term = diffrax.ODETerm(_michaelis_menten)
    y0, p = jnp.array([2.0, 0.5]), jnp.array([1.5, 0.7, 2.0, 3.0])
    ts = jnp.linspace(0.5, 5.0, 10)
    mesh = gs.record(term, gs.Tsit5(), 0.0, 5.0, None, y0, p, stepsize_controller=CTRL)

    @jax.jit
    def solution(p):
        sol = gs.replay(mesh, term, gs.Tsit5(), y0, p, saveat=diffrax.SaveAt(ts=ts))
        return sol.ys.ravel()

    forward = jax.jacfwd(solution)(p)
    np.testing.assert_allclose(forward, jax.jacrev(solution)(p), rtol=1e-12)
    eps = 1e-6
    columns = [
        (solution(p + eps * e) - solution(p - eps * e)) / (2 * eps) for e in jnp.eye(4)
    ]
    np.testing.assert_allclose(forward, jnp.stack(columns, 1), rtol=1e-6, atol=1e-8)
