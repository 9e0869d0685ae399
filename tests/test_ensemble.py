"""Ensembles under vmap: each trajectory gets its own steps and its own gradient."""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np

import gradsolve as gs

from .helpers import PROBLEMS
from .references import StoredReferences


REFERENCES = StoredReferences(__file__)


CTRL = diffrax.PIDController(rtol=1e-7, atol=1e-7)


def test_vmapped_ensemble_matches_single_solves():
    problem = PROBLEMS["lotka_volterra"]
    term = diffrax.ODETerm(problem.f)
    n = 1000
    key = jax.random.PRNGKey(0)
    scales = 1 + 0.3 * jax.random.uniform(key, (n, 4), minval=-1, maxval=1)
    args = problem.args * scales
    y0s = jnp.broadcast_to(problem.y0, (n, 2))

    def solve(y0, p):
        return gs.diffeqsolve(
            term, gs.Tsit5(), 0.0, 6.0, None, y0, p, stepsize_controller=CTRL
        )

    def loss(p, y0):
        return jnp.sum(solve(y0, p).ys ** 2)

    sols = jax.jit(jax.vmap(solve))(y0s, args)
    grads = jax.jit(jax.vmap(jax.grad(loss)))(args, y0s)
    steps = np.asarray(sols.mesh.num_steps)
    assert steps.min() < steps.max()  # trajectories really take different steps
    single_solve = jax.jit(solve)
    single_grad = jax.jit(jax.grad(loss))
    for i in range(0, n, 97):
        one = single_solve(y0s[i], args[i])
        assert int(one.mesh.num_steps) == steps[i]
        k = steps[i] + 1
        # XLA fuses the batched program differently (e.g. fused multiply-adds), so
        # batched and single solves agree to amplified round-off, not bitwise.
        np.testing.assert_allclose(sols.mesh.ts[i, :k], one.mesh.ts[:k], rtol=1e-9)
        np.testing.assert_allclose(sols.ys[i], one.ys, rtol=1e-10)
        np.testing.assert_allclose(grads[i], single_grad(args[i], y0s[i]), rtol=1e-9)

    # Diffrax's gradient of the same ensemble, for a sample of trajectories.
    def diffrax_loss(p, y0):
        sol = diffrax.diffeqsolve(
            term, diffrax.Tsit5(), 0.0, 6.0, None, y0, p, stepsize_controller=CTRL
        )
        return jnp.sum(sol.ys**2)

    sample = slice(0, n, 50)
    want = REFERENCES(
        "lotka-volterra-ensemble-gradients",
        lambda: jax.jit(jax.vmap(jax.grad(diffrax_loss)))(args[sample], y0s[sample]),
    )
    np.testing.assert_allclose(grads[sample], want, rtol=1e-9)


def test_batched_replay_checks_sizes():
    problem = PROBLEMS["lotka_volterra"]
    term = diffrax.ODETerm(problem.f)
    y0s = jnp.broadcast_to(problem.y0, (4, 2))
    meshes = jax.vmap(
        lambda y0: gs.record(
            term, gs.Tsit5(), 0.0, 6.0, None, y0, problem.args, stepsize_controller=CTRL
        )
    )(y0s)
    sol = gs.replay(meshes, term, gs.Tsit5(), y0s, problem.args)
    assert sol.ys.shape == (4, 1, 2)
    try:
        gs.replay(meshes, term, gs.Tsit5(), y0s[:3], problem.args)
    except ValueError as e:
        assert "4 trajectories" in str(e) and "leading axis" in str(e)
    else:
        raise AssertionError("a y0 batch of the wrong size must be refused")
