"""Ensembles under vmap: each trajectory gets its own steps and its own gradient."""

import diffrax
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs

from .helpers import PROBLEMS
from .references import StoredReferences


REFERENCES = StoredReferences(__file__)


CTRL = diffrax.PIDController(rtol=1e-7, atol=1e-7)


@pytest.mark.bitwise
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


def _loop_reductions(jaxpr, inside=False) -> int:
    """How many `reduce_sum`s the loops (`scan`, `while`) of `jaxpr` hold."""
    count = 0
    for eqn in jaxpr.eqns:
        if inside and eqn.primitive.name == "reduce_sum":
            count += 1
        loop = eqn.primitive.name in ("scan", "while")
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _loop_reductions(sub, inside or loop)
    return count


def test_gradient_with_respect_to_shared_parameters():
    # jax.grad of a loss over a batched replay, with respect to parameters that every
    # trajectory shares (passed in args, or closed over by the field): Diffrax's
    # gradient, each trajectory's cotangent accumulated on its own and summed over
    # the batch once, after the loop over steps (not a sum over the batch at every
    # step).
    problem = PROBLEMS["lotka_volterra"]
    term = diffrax.ODETerm(problem.f)
    n = 8
    y0s = problem.y0 * (1 + 0.1 * jnp.arange(n)[:, None])
    mesh = gs.record_ensemble(
        term, gs.Tsit5(), 0.0, 6.0, None, y0s, problem.args, stepsize_controller=CTRL
    )

    def loss(args):
        return jnp.sum(gs.replay(mesh, term, gs.Tsit5(), y0s, args).ys ** 2)

    def per_trajectory_loss(args):  # the same, with a copy of args per trajectory
        copies = jnp.broadcast_to(args, (n,) + args.shape)
        sol = gs.replay(mesh, term, gs.Tsit5(), y0s, copies, args_axes=0)
        return jnp.sum(sol.ys**2)

    def diffrax_loss(args):
        def one(y0):
            sol = diffrax.diffeqsolve(
                term,
                diffrax.Tsit5(),
                0.0,
                6.0,
                None,
                y0,
                args,
                stepsize_controller=CTRL,
            )
            return jnp.sum(sol.ys**2)

        return jnp.sum(jax.vmap(one)(y0s))

    def closure_loss(args):  # the parameters closed over by the field instead
        field = diffrax.ODETerm(lambda t, y, _: problem.f(t, y, args))
        return jnp.sum(gs.replay(mesh, field, gs.Tsit5(), y0s).ys ** 2)

    grad = jax.grad(loss)(problem.args)
    np.testing.assert_allclose(
        grad, jax.grad(per_trajectory_loss)(problem.args), rtol=1e-13
    )
    np.testing.assert_allclose(grad, jax.grad(closure_loss)(problem.args), rtol=1e-13)
    want = REFERENCES(
        "lotka-volterra-shared-parameters-gradient",
        lambda: jax.jit(jax.grad(diffrax_loss))(problem.args),
    )
    np.testing.assert_allclose(grad, want, rtol=1e-9)
    for fn in (loss, closure_loss):
        assert _loop_reductions(jax.make_jaxpr(jax.grad(fn))(problem.args).jaxpr) == 0
