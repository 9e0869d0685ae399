"""A stale mesh is never silent: `gs.replay(..., stale=)` warns (default) or raises."""

import warnings

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
FAR = LV.args * jnp.array([3.0, 1.0, 2.0, 2.0])  # much faster dynamics
RUNTIME = (eqx.EquinoxRuntimeError, jax.errors.JaxRuntimeError)


def _mesh(args=LV.args):
    return gs.record(
        TERM, gs.Tsit5(), 0.0, 6.0, None, LV.y0, args, stepsize_controller=CTRL
    )


def _loss(mesh, stale="warn"):
    def loss(args):
        sol = gs.replay(mesh, TERM, gs.Tsit5(), LV.y0, args, stale=stale)
        return jnp.sum(sol.ys**2), sol.stats["max_error_ratio"]

    return loss


def test_fresh_mesh_is_silent():
    mesh = _mesh()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, ratio = jax.jit(jax.grad(_loss(mesh), has_aux=True))(LV.args)
        jax.block_until_ready(ratio)
        sol = gs.replay(mesh, TERM, gs.Tsit5(), LV.y0, LV.args, stale="error")
        jax.block_until_ready(sol.ys)
    assert ratio <= 1


def test_stale_mesh_warns_by_default():
    mesh = _mesh()
    with pytest.warns(
        gs.StaleMeshWarning, match=r"stale.*infinite.*times the tolerance"
    ):
        sol = gs.replay(mesh, TERM, gs.Tsit5(), LV.y0, FAR)
        jax.block_until_ready(sol.ys)
    # FAR blows the replay up (NaN): reported as an infinite ratio, not hidden.
    assert sol.stats["max_error_ratio"] == jnp.inf
    # Under jit and grad too.
    with pytest.warns(gs.StaleMeshWarning):
        _, ratio = jax.jit(jax.grad(_loss(mesh), has_aux=True))(FAR)
        jax.block_until_ready(ratio)
        jax.effects_barrier()


def test_stale_mesh_error_option():
    mesh = _mesh()
    with pytest.raises(RUNTIME, match="The mesh is stale.*gs.record"):
        jax.block_until_ready(
            gs.replay(mesh, TERM, gs.Tsit5(), LV.y0, FAR, stale="error").ys
        )
    grad = jax.jit(jax.grad(_loss(mesh, "error"), has_aux=True))
    with pytest.raises(RUNTIME, match="The mesh is stale"):
        jax.block_until_ready(grad(FAR))


def test_ignore_is_explicit_and_options_are_checked():
    mesh = _mesh()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sol = gs.replay(mesh, TERM, gs.Tsit5(), LV.y0, FAR, stale="ignore")
        jax.block_until_ready(sol.ys)
    assert sol.stats["max_error_ratio"] > 1
    with pytest.raises(ValueError, match="stale must be one of"):
        gs.replay(mesh, TERM, gs.Tsit5(), LV.y0, LV.args, stale="silent")


def test_one_warning_for_an_ensemble():
    """One stale trajectory of three: one warning, batched mesh or user's vmap."""
    argss = jnp.stack([LV.args, FAR, LV.args])
    mesh = jax.vmap(_mesh)(jnp.stack([LV.args] * 3))
    y0s = jnp.stack([LV.y0] * 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sol = gs.replay(mesh, TERM, gs.Tsit5(), y0s, argss, args_axes=0)
        jax.block_until_ready(sol.ys)
        ys = jax.vmap(lambda m, y, a: gs.replay(m, TERM, gs.Tsit5(), y, a).ys)(
            mesh, y0s, argss
        )
        jax.block_until_ready(ys)
        jax.effects_barrier()
    stale = [w for w in caught if issubclass(w.category, gs.StaleMeshWarning)]
    assert len(stale) == 2
    assert list(sol.stats["max_error_ratio"] > 1) == [False, True, False]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh = gs.replay(
            mesh, TERM, gs.Tsit5(), y0s, jnp.stack([LV.args] * 3), args_axes=0
        )
        jax.block_until_ready(fresh.ys)
