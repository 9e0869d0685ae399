"""gradsolve inside Equinox models: solvers and meshes as fields, `eqx.filter_jit` and
`eqx.filter_grad` through `gs.diffeqsolve` and `gs.replay`, no recompilation when
only array values change. Gradients are checked against Diffrax's."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

import gradsolve as gs

from .helpers import PROBLEMS
from .references import StoredReferences


REFERENCES = StoredReferences(__file__)
PROBLEM = PROBLEMS["lotka_volterra"]
TERM = gs.ODETerm(PROBLEM.f)
CTRL = gs.PIDController(rtol=1e-8, atol=1e-8)
TS = jnp.linspace(1.0, PROBLEM.t1, 5)


class Model(eqx.Module):
    params: jax.Array
    mesh: gs.RecordedMesh
    solver: gs.Tsit5 = gs.Tsit5()

    def replay(self, y0):
        saveat = gs.SaveAt(ts=TS)
        return gs.replay(self.mesh, TERM, self.solver, y0, self.params, saveat=saveat)

    def solve(self, y0):
        return gs.diffeqsolve(
            TERM,
            self.solver,
            PROBLEM.t0,
            PROBLEM.t1,
            None,
            y0,
            self.params,
            saveat=gs.SaveAt(ts=TS),
            stepsize_controller=CTRL,
        )


def record(params):
    return gs.record(
        TERM, gs.Tsit5(), PROBLEM.t0, PROBLEM.t1, None, PROBLEM.y0, params,
        stepsize_controller=CTRL,
    )  # fmt: skip


@jax.jit
def diffrax_grad(params):
    def loss(p):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(PROBLEM.f),
            diffrax.Tsit5(),
            PROBLEM.t0,
            PROBLEM.t1,
            None,
            PROBLEM.y0,
            p,
            saveat=diffrax.SaveAt(ts=TS),
            stepsize_controller=CTRL,
        )
        return jnp.sum(sol.ys**2)

    return jax.grad(loss)(params)


def test_filter_jit_and_grad_through_a_model_without_recompiling():
    traces = []

    @eqx.filter_jit
    @eqx.filter_grad
    def grads(model, y0):
        traces.append(None)  # runs once per trace, never when the cache is hit
        replayed = jnp.sum(model.replay(y0).ys ** 2)
        solved = jnp.sum(model.solve(y0).ys ** 2)
        return replayed + 2 * solved

    for scale in (1.0, 1.05, 0.97):
        params = PROBLEM.args * scale
        # A new mesh (recorded at these parameters) and new parameter values: only
        # array values change, so the compiled function is reused.
        model = Model(params, record(params))
        g = grads(model, PROBLEM.y0)
        assert isinstance(g, Model)
        want = REFERENCES(f"grad-scale-{scale}", lambda: diffrax_grad(params))
        np.testing.assert_allclose(g.params, 3 * want, rtol=1e-9)
    assert len(traces) == 1


def test_model_of_an_ensemble_with_a_trimmed_mesh():
    ps = PROBLEM.args * jnp.linspace(0.9, 1.1, 6)[:, None]
    y0s = jnp.broadcast_to(PROBLEM.y0, (6, 2))
    mesh = jax.vmap(
        lambda y0, p: gs.record(
            TERM, gs.Tsit5(), PROBLEM.t0, PROBLEM.t1, None, y0, p,
            stepsize_controller=CTRL,
        )
    )(y0s, ps).trim()  # fmt: skip

    class Ensemble(eqx.Module):
        params: jax.Array
        mesh: gs.RecordedMesh
        solver: gs.Tsit5

        def __call__(self, y0s):
            sol = gs.replay(self.mesh, TERM, self.solver, y0s, self.params, args_axes=0)
            return jnp.sum(sol.ys**2)

    model = Ensemble(ps, mesh, gs.Tsit5())
    # Differentiate the parameters only (the Equinox filter-spec pattern): the mesh
    # is data, not a parameter.
    spec = eqx.tree_at(lambda m: m.params, jtu.tree_map(lambda _: False, model), True)
    diff, static = eqx.partition(model, spec)

    @eqx.filter_jit
    def grads(diff, static):
        return eqx.filter_grad(lambda d: eqx.combine(d, static)(y0s))(diff)

    g = grads(diff, static)
    want = REFERENCES("ensemble-grad-final", lambda: diffrax_grad_final(ps))
    np.testing.assert_allclose(g.params, want, rtol=1e-9)


@jax.jit
@jax.vmap
def diffrax_grad_final(params):
    def loss(p):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(PROBLEM.f),
            diffrax.Tsit5(),
            PROBLEM.t0,
            PROBLEM.t1,
            None,
            PROBLEM.y0,
            p,
            stepsize_controller=CTRL,
        )
        return jnp.sum(sol.ys**2)

    return jax.grad(loss)(params)
