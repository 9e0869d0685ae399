"""Saving and loading meshes: a loaded mesh is the saved one, bit for bit, and a
damaged file is an error that names the file, never a wrong gradient."""

import hashlib
import struct

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import gradsolve as gs

from .helpers import PROBLEMS


LV = PROBLEMS["lotka_volterra"]
TERM = diffrax.ODETerm(LV.f)
CTRL = diffrax.PIDController(rtol=1e-7, atol=1e-7)
TS = jnp.linspace(0.0, 6.0, 7)


def _record(**kwargs):
    return gs.record(
        TERM,
        gs.Tsit5(),
        0.0,
        6.0,
        None,
        LV.y0,
        LV.args,
        stepsize_controller=CTRL,
        **kwargs,
    )


def _grad(mesh, y0=LV.y0, args=LV.args, **kwargs):
    def loss(y0, args):
        sol = gs.replay(
            mesh, TERM, gs.Tsit5(), y0, args, saveat=gs.SaveAt(ts=TS), **kwargs
        )
        return jnp.sum(sol.ys**2)

    return jax.grad(loss, argnums=(0, 1))(y0, args)


def _assert_identical(a, b):
    assert jtu.tree_structure(a) == jtu.tree_structure(b)
    for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    mesh = _record()
    path = tmp_path_factory.mktemp("mesh") / "lv.gsmesh"
    gs.save_mesh(path, mesh)
    return mesh, path


def test_round_trip_gives_bitwise_equal_gradients(saved):
    mesh, path = saved
    loaded = gs.load_mesh(path)
    _assert_identical(loaded, mesh)
    assert loaded.solver_type is gs.Tsit5 and loaded.norm is mesh.norm
    _assert_identical(_grad(loaded), _grad(mesh))


def test_round_trip_of_a_batched_trimmed_mesh_with_jumps(tmp_path):
    ctrl = diffrax.PIDController(rtol=1e-6, atol=1e-6, jump_ts=jnp.array([2.5]))
    y0s = LV.y0 * jnp.array([[1.0], [1.2], [0.8]])
    record = lambda y0: gs.record(
        TERM, gs.Dopri5(), 0.0, 6.0, None, y0, LV.args, stepsize_controller=ctrl
    )
    mesh = jax.vmap(record)(y0s).trim()
    gs.save_mesh(tmp_path / "batch.gsmesh", mesh)
    loaded = gs.load_mesh(tmp_path / "batch.gsmesh")
    _assert_identical(loaded, mesh)
    replay = lambda m: gs.replay(m, TERM, gs.Dopri5(), y0s, LV.args).ys
    _assert_identical(replay(loaded), replay(mesh))
    with pytest.raises(ValueError, match="holds 3 trajectories but y0"):
        gs.replay(loaded, TERM, gs.Dopri5(), y0s[:2], LV.args)


def _damaged(path, tmp_path, change):
    data = bytearray(path.read_bytes())
    out = tmp_path / "damaged.gsmesh"
    out.write_bytes(bytes(change(data)))
    return out


@pytest.mark.parametrize("keep", [0, 5, 14, 100, -40, -1])
def test_truncated_file_is_an_error(saved, tmp_path, keep):
    _, path = saved
    short = _damaged(path, tmp_path, lambda d: d[:keep] if keep >= 0 else d[:keep])
    with pytest.raises(ValueError, match=r"damaged\.gsmesh.* is truncated"):
        gs.load_mesh(short)


def test_flipped_byte_anywhere_is_an_error(saved, tmp_path):
    _, path = saved
    size = path.stat().st_size
    # Every region: version/length prefix, header, payload, digest.
    for position in [9, 20, size // 3, size // 2, size - 40, size - 1]:

        def flip(d, position=position):
            d[position] ^= 0x10
            return d

        with pytest.raises(ValueError, match=r"damaged\.gsmesh.*(corrupted|truncated)"):
            gs.load_mesh(_damaged(path, tmp_path, flip))


def test_other_format_version_or_not_a_mesh_file(saved, tmp_path):
    _, path = saved

    def version(d):  # a well-formed file of another version
        d[8:12] = struct.pack("<I", 99)
        d[-32:] = hashlib.sha256(bytes(d[:-32])).digest()
        return d

    with pytest.raises(ValueError, match="format version 99.*reads version 1"):
        gs.load_mesh(_damaged(path, tmp_path, version))
    other = tmp_path / "weights.eqx"
    eqx.tree_serialise_leaves(other, jnp.zeros(3))
    with pytest.raises(ValueError, match="not a gradsolve mesh file"):
        gs.load_mesh(other)


def test_loaded_mesh_with_the_wrong_solver(saved):
    _, path = saved
    loaded = gs.load_mesh(path)
    with pytest.raises(ValueError, match="recorded with Tsit5 but is replayed"):
        gs.replay(loaded, TERM, gs.Dopri5(), LV.y0, LV.args)


def test_float64_mesh_with_float64_disabled(saved):
    _, path = saved
    with jax.enable_x64(False):
        with pytest.raises(ValueError, match="float64 is disabled.*jax_enable_x64"):
            gs.load_mesh(path)


def max_abs_norm(x):
    return jnp.max(jnp.stack([jnp.max(jnp.abs(v)) for v in jtu.tree_leaves(x)]))


def test_norms_are_saved_by_name(tmp_path):
    record = lambda norm: gs.record(
        TERM,
        gs.Tsit5(),
        0.0,
        6.0,
        None,
        LV.y0,
        LV.args,
        stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-6, norm=norm),
    )
    mesh = record(max_abs_norm)
    gs.save_mesh(tmp_path / "x.gsmesh", mesh)
    loaded = gs.load_mesh(tmp_path / "x.gsmesh")
    assert loaded.norm is max_abs_norm
    _assert_identical(_grad(loaded), _grad(mesh))
    with pytest.raises(ValueError, match="norm is .*lambda.*module level"):
        gs.save_mesh(tmp_path / "y.gsmesh", record(lambda x: max_abs_norm(x)))


def test_save_refuses_a_traced_mesh(tmp_path):
    def inside(y0):
        mesh = gs.record(
            TERM, gs.Tsit5(), 0.0, 6.0, None, y0, LV.args, stepsize_controller=CTRL
        )
        gs.save_mesh(tmp_path / "x.gsmesh", mesh)
        return mesh.ts

    with pytest.raises(ValueError, match="concrete mesh"):
        jax.jit(inside)(LV.y0)
