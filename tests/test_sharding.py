"""Ensembles split across 1, 2, 4 and 8 devices give the results of one device.

JAX fixes the number of devices when it starts, and this process already runs on
one CPU device, so the checks run in a child process with 8 simulated CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`): `tests/sharding_checks.py`.
The reference is the same computation unsharded, since the property tested is that
sharding changes nothing (the unsharded path is tested against Diffrax elsewhere).

Per-trajectory results (meshes, values, gradients with respect to per-trajectory
parameters) are compared bit for bit. A gradient with respect to a shared
parameter is a sum over the ensemble, which devices add in another order: equal to
round-off. So are values saved at `SaveAt(ts)` through `gs.diffeqsolve` when the
ensemble is padded (XLA compiles the recording's dense output for the per-device
batch size), values at `SaveAt(ts)` replayed in chunks (`gs.replay_ensemble`: the
save times' stages are computed for the chunk's batch), and fitted parameters,
whose optimiser turns such round-off into differences within its own tolerance.

The child compiles every check for every device count (about a minute and a half on
two cores), so these are long tests; the default suite runs the README's sharding
example (`test_readme.py`), which splits an ensemble over the devices there are.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest


pytestmark = pytest.mark.slow

SCRIPT = pathlib.Path(__file__).with_name("sharding_checks.py")
ROOT = SCRIPT.parents[1]


def _run(*flags) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checks():
    return _run("--slow")


NO_COLLECTIVES = {
    "all-reduce": 0,
    "all-gather": 0,
    "all-to-all": 0,
    "collective-permute": 0,
}


def _identity(out, sizes, device_counts):
    for n in sizes:
        for k in device_counts:
            key = f"n{n}_d{k}"
            assert out[f"mesh_{key}"], key
            assert out[f"replay_grad_{key}"], key


def _equal_to_round_off(out, key):
    assert out[f"shared_grad_values_{key}"], key
    assert out[f"shared_grad_rel_{key}"] <= 1e-13, key
    assert out[f"diffeqsolve_values_rel_{key}"] <= 1e-13, key
    assert out[f"diffeqsolve_grad_rel_{key}"] <= 1e-13, key


def test_runs_on_eight_devices(checks):
    assert checks["devices"] == 8


def test_meshes_and_gradients_identical_on_1_2_4_8_devices(checks):
    # 13 trajectories: padded to 14 or 16 on 2, 4 and 8 devices; 16 fill them.
    _identity(checks, sizes=(13, 16), device_counts=(1, 2, 4, 8))


def test_shared_gradient_and_diffeqsolve_equal_to_round_off(checks):
    for n in (13, 16):
        for k in (1, 2, 4, 8):
            _equal_to_round_off(checks, f"n{n}_d{k}")


def test_chunked_record_identical_and_replay_equal_to_round_off(checks):
    for key in ("n13_d4", "n16_d8"):
        assert checks[f"record_ensemble_{key}"], key
        # Values at SaveAt(ts) and their gradients (docs/guides/ensembles.md).
        assert checks[f"replay_ensemble_rel_{key}"] <= 1e-12, key


def test_explicit_axes_mesh(checks):
    assert checks["explicit_mesh_record"]


def test_placed_arrays_stay_split_without_communication(checks):
    assert checks["record_inferred_identical"] and checks["trim_identical"]
    for what in ("record", "trim", "grad", "eager_replay"):
        assert checks[f"{what}_stays_split"], what
    assert checks["record_collectives"] == NO_COLLECTIVES
    assert checks["grad_collectives"] == NO_COLLECTIVES
    # The gradient of a shared parameter: its one sum across devices.
    assert checks["shared_grad_collectives"] == dict(
        NO_COLLECTIVES, **{"all-reduce": 1}
    )


def test_bad_shardings_name_the_fix(checks):
    errors = checks["errors"]
    assert "along its axis 1" in errors["non_ensemble_axis"]
    assert "split over different devices" in errors["mismatched"]
    assert "sharding=None to follow the arrays" in errors["mismatched_request"]
    assert "must be a jax.sharding.NamedSharding" in errors["bad_type"]
    assert "jnp.moveaxis" in errors["in_axes"]
    assert "Use gs.sharded_vmap" in errors["explicit_mesh_vmap"]


def test_plain_vmap_synchronises_devices_where_sharded_vmap_does_not(checks):
    # Plain jax.vmap left to XLA reduces the loop's predicate across devices on
    # every step; the sharded recording has no collective at all.
    assert checks["vmap_record_all_reduces"] > 0
    assert checks["record_collectives"] == NO_COLLECTIVES


def test_sharded_fits_equal_the_unsharded_fit(checks):
    for key in ("n6_d4", "n16_d8"):
        assert checks[f"fit_success_{key}"] == [0, 0]
        assert checks[f"fit_rel_{key}"] <= 1e-6, key


def test_two_processes_give_the_one_process_result(tmp_path):
    # Two local processes of two CPU devices each, joined by jax.distributed (as
    # two hosts would be), run examples/sharded_ensemble.py unchanged.
    example = ROOT / "examples" / "sharded_ensemble.py"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, str(example), "-n", "64"]
    distributed = ["--coordinator", f"localhost:{port}", "--num-processes", "2"]
    procs = [
        subprocess.Popen(
            cmd + distributed + ["--process-id", str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][1][-3000:]
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    single = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert single.returncode == 0, single.stderr[-3000:]

    def fields(text):
        return dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)

    one = fields(single.stdout)
    for out, _ in outs:
        two = fields(out)
        assert two["processes"] == "2" and two["devices"] == "4"
        # The loss sums the ensemble across devices, which two processes add in
        # another order than one: equal to round-off.
        assert abs(float(two["loss"]) / float(one["loss"]) - 1) <= 1e-14
        assert "P('ensemble',)" in two["grads_sharding"]
