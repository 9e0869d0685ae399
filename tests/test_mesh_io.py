"""Saving and loading meshes: a loaded mesh is the saved one, bit for bit, and a
damaged file is an error that names the file, never a wrong gradient."""

import hashlib
import json
import os
import pathlib
import struct
import subprocess
import sys

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

    def version(d, number=99):  # a well-formed file of another version
        d[8:12] = struct.pack("<I", number)
        d[-32:] = hashlib.sha256(bytes(d[:-32])).digest()
        return d

    with pytest.raises(ValueError, match="format version 99.*reads version 2"):
        gs.load_mesh(_damaged(path, tmp_path, version))
    # Version 1 files (no t0, t1 or state; names by module) are refused by version.
    with pytest.raises(ValueError, match="format version 1, .*reads version 2"):
        gs.load_mesh(_damaged(path, tmp_path, lambda d: version(d, 1)))
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


def test_norms_are_saved_by_name(tmp_path, monkeypatch):
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
    with pytest.raises(ValueError, match=r"register_mesh_name\(max_abs_norm\)"):
        gs.save_mesh(tmp_path / "x.gsmesh", mesh)
    monkeypatch.setattr(gs._mesh_names, "_REGISTERED", {})
    assert gs.register_mesh_name(max_abs_norm) is max_abs_norm
    gs.save_mesh(tmp_path / "x.gsmesh", mesh)
    loaded = gs.load_mesh(tmp_path / "x.gsmesh")
    assert loaded.norm is max_abs_norm
    _assert_identical(_grad(loaded), _grad(mesh))
    with pytest.raises(ValueError, match="norm is .*lambda.*module level"):
        gs.save_mesh(tmp_path / "y.gsmesh", record(lambda x: max_abs_norm(x)))
    # A session that has not registered it refuses the file, naming file and norm.
    monkeypatch.setattr(gs._mesh_names, "_REGISTERED", {})
    with pytest.raises(ValueError, match=r"x\.gsmesh.*names the norm.*max_abs_norm"):
        gs.load_mesh(tmp_path / "x.gsmesh")


def test_save_refuses_a_traced_mesh(tmp_path):
    def inside(y0):
        mesh = gs.record(
            TERM, gs.Tsit5(), 0.0, 6.0, None, y0, LV.args, stepsize_controller=CTRL
        )
        gs.save_mesh(tmp_path / "x.gsmesh", mesh)
        return mesh.ts

    with pytest.raises(ValueError, match="concrete mesh"):
        jax.jit(inside)(LV.y0)


# Saving replaces the file whole. The children below load a saved mesh and save it
# again under a file-size limit, or die while saving, or save while this process
# reads: the previous file survives byte for byte, and a reader never sees part of
# a file.

_CHILD = """
import os, pathlib, signal, sys, time
import jax
jax.config.update("jax_enable_x64", True)
import gradsolve as gs
source, target, mode = sys.argv[1:4]
mesh = gs.load_mesh(source)
if mode == "limit":
    import resource
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write fails instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    try:
        gs.save_mesh(target, mesh)
    except OSError as e:
        print("error:", e)
elif mode == "kill":
    # Killed once the new file is written, before it replaces the old one.
    os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
    gs.save_mesh(target, mesh)
elif mode == "writer":
    other = gs.load_mesh(sys.argv[4])
    print("ready", flush=True)
    end = time.monotonic() + float(sys.argv[5])
    while time.monotonic() < end:
        gs.save_mesh(target, mesh)
        gs.save_mesh(target, other)
"""


def _child(*argv):
    root = str(pathlib.Path(__file__).resolve().parents[1])
    paths = [root, os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    command = [sys.executable, "-c", _CHILD, *map(str, argv)]
    return subprocess.Popen(command, env=env, text=True, stdout=subprocess.PIPE)


@pytest.fixture(scope="module")
def old_file(saved, tmp_path_factory):
    """A file holding another (trimmed) mesh, to be replaced by the saved one."""
    mesh, _ = saved
    path = tmp_path_factory.mktemp("old") / "old.gsmesh"
    gs.save_mesh(path, mesh.trim())
    return path


def _target(old_file, tmp_path):
    target = tmp_path / "target.gsmesh"
    target.write_bytes(old_file.read_bytes())
    return target


def test_save_over_a_file_size_limit_keeps_the_old_file(saved, old_file, tmp_path):
    _, path = saved
    target = _target(old_file, tmp_path)
    assert path.stat().st_size > 4096 > target.stat().st_size
    out, _ = _child(path, target, "limit").communicate(timeout=120)
    assert "File too large" in out and "previous file, if any, is unchanged" in out
    assert str(target) in out
    assert target.read_bytes() == old_file.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target.gsmesh"]


def test_save_killed_mid_write_keeps_the_old_file(saved, old_file, tmp_path):
    _, path = saved
    target = _target(old_file, tmp_path)
    child = _child(path, target, "kill")
    child.communicate(timeout=120)
    assert child.returncode == -9
    assert target.read_bytes() == old_file.read_bytes()
    _assert_identical(gs.load_mesh(target), gs.load_mesh(old_file))


def test_reader_never_sees_a_partly_written_file(saved, old_file, tmp_path):
    _, path = saved
    target = _target(old_file, tmp_path)
    sizes = {path.stat().st_size, old_file.stat().st_size}
    child = _child(path, target, "writer", old_file, 1.5)
    assert child.stdout.readline().strip() == "ready"
    loads = 0
    while child.poll() is None:
        data = target.read_bytes()
        assert len(data) in sizes
        gs.load_mesh(target)
        loads += 1
    assert child.returncode == 0 and loads > 10, loads


def _crafted(path, tmp_path, change_header=None, raw=None):
    """A copy of the mesh file at `path` with its header changed, and a valid
    checksum: what a crafted file looks like."""
    data = path.read_bytes()
    version, length = struct.unpack("<II", data[8:16])
    header = data[16 : 16 + length]
    if change_header is not None:
        header = json.loads(header)
        change_header(header)
        header = json.dumps(header).encode()
    if raw is not None:
        header = raw
    body = data[:8] + struct.pack("<II", version, len(header)) + header
    body += data[16 + length : -32]
    out = tmp_path / "crafted.gsmesh"
    out.write_bytes(body + hashlib.sha256(body).digest())
    return out


def test_file_names_only_allowed_objects(saved, tmp_path):
    _, path = saved
    gone = "numpy.f2py" not in sys.modules
    for key, name in [
        ("norm", "sys:exit"),
        ("norm", "numpy:f2py.get_include"),
        ("norm", "gradsolve:Tsit5"),
        ("solver_type", "builtins:object"),
        ("solver_type", "optimistix:rms_norm"),
        ("solver_type", "gradsolve._solver.tsit5:Tsit5"),  # a module path: refused
    ]:

        def change(h, key=key, name=name):
            h[key] = name

        with pytest.raises(ValueError, match=rf"crafted\.gsmesh.*{name[:8]}") as info:
            gs.load_mesh(_crafted(path, tmp_path, change))
        assert type(info.value) is ValueError
    assert not gone or "numpy.f2py" not in sys.modules  # nothing was imported
    with pytest.raises(ValueError, match="gradsolve's name"):
        gs.register_mesh_name(max_abs_norm, "optimistix:rms_norm")


def _set(*keys, value):
    def change(header):
        for key in keys[:-1]:
            header = header[key]
        header[keys[-1]] = value

    return change


@pytest.mark.parametrize(
    "change, raw",
    [
        (None, b"\xff\xfe not UTF-8"),
        (None, b"{not json"),
        (None, b"[1, 2]"),
        (None, b""),
        (_set("fields", value=None), None),
        (_set("fields", value={}), None),
        (_set("fields", "ts", value=3), None),
        (_set("fields", "ts", "kind", value="pickle"), None),
        (_set("fields", "ts", "shape", value="4097"), None),
        (_set("fields", "ts", "shape", value=[-1]), None),
        (_set("fields", "ts", "shape", value=[[4097]]), None),
        (_set("fields", "ts", "dtype", value="object"), None),
        (_set("fields", "ts", "dtype", value=7), None),
        (_set("fields", "ts", "shape", value=[]), None),
        (_set("fields", "num_steps", "shape", value=[3]), None),
        (_set("fields", "result", value={"kind": "none"}), None),
        (_set("solver_type", value=None), None),
        (_set("solver_type", value=["gradsolve:Tsit5"]), None),
        (_set("norm", value=5), None),
        (_set("state", value=None), None),
        (_set("state", "shapes", value=[[2], [2]]), None),
        (_set("state", "dtypes", value=["int32"]), None),
        (_set("state", "treedef", value=3), None),
        (_set("fields", "t1", "shape", value=[7]), None),
        (_set("payload_bytes", value="many"), None),
        (_set("payload_bytes", value=1), None),
    ],
)
def test_crafted_header_is_a_value_error_naming_the_file(saved, tmp_path, change, raw):
    _, path = saved
    crafted = _crafted(path, tmp_path, change, raw)
    with pytest.raises(ValueError, match=r"crafted\.gsmesh") as info:
        gs.load_mesh(crafted)
    assert type(info.value) is ValueError


def test_header_length_past_the_end_is_a_value_error(saved, tmp_path):
    _, path = saved
    data = bytearray(path.read_bytes())
    data[12:16] = struct.pack("<I", 2**31)
    data[-32:] = hashlib.sha256(bytes(data[:-32])).digest()
    out = tmp_path / "crafted.gsmesh"
    out.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"crafted\.gsmesh.*runs past"):
        gs.load_mesh(out)
