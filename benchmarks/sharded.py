"""A Lorenz ensemble on 1 and 2 (simulated) devices: the speed-up and its traffic.

`python benchmarks/sharded.py [--trajectories 16384] [--devices 1 2]` runs each
device count in its own process (JAX fixes the number of devices when it starts;
on a CPU, `XLA_FLAGS=--xla_force_host_platform_device_count=k` splits the host into
`k` devices) and times, after a warm-up:

- `record`: `gs.sharded_vmap(gs.record)` over the ensemble, then `trim()`;
- `gradient`: the replay's gradient of `sum(y(t1)**2)` with respect to the
  per-trajectory parameters, over that mesh;
- `record + gradient`: both, as one gradient evaluation from scratch.

It counts the collective operations (all-reduce, all-gather, ...) in the compiled
programs: what crosses devices. The problem is DiffEqGPU.jl's: t in [0, 1],
y0 = (1, 0, 0), sigma = 10, rho = linspace(0, 21, N), beta = 8/3, float64,
rtol = atol = 1e-8, Tsit5. Results go to `benchmarks/results/sharded.{json,md}`.
"""

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time


RESULTS = pathlib.Path(__file__).with_name("results")
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute")


def _collectives(jitted, *args) -> dict:
    text = jitted.lower(*args).compile().as_text()
    return {k: len(re.findall(rf"= \S+ {k}(-start)?\(", text)) for k in COLLECTIVES}


def _times(fn, repeats: int) -> dict:
    fn()  # warm-up: compilation
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return dict(min=min(samples), median=statistics.median(samples))


def child(n: int, repeats: int) -> dict:
    """One device count (set by the parent in `XLA_FLAGS`)."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    import gradsolve as gs
    from gradsolve.demo import lorenz

    sharding = gs.ensemble_sharding()
    term, solver = gs.ODETerm(lorenz), gs.Tsit5()
    ctrl = gs.PIDController(rtol=1e-8, atol=1e-8)
    params = jnp.stack(
        [jnp.full(n, 10.0), jnp.linspace(0.0, 21.0, n), jnp.full(n, 8 / 3)], axis=1
    )
    y0s = jnp.tile(jnp.array([1.0, 0.0, 0.0]), (n, 1))
    y0s, params = jax.device_put((y0s, params), sharding)

    def one(y0, p):
        return gs.record(term, solver, 0.0, 1.0, None, y0, p, stepsize_controller=ctrl)

    record_jit = jax.jit(gs.sharded_vmap(one, sharding=sharding))

    def record():
        return record_jit(y0s, params).trim()

    mesh = record()

    def loss(p, mesh):
        sol = gs.replay(
            mesh, term, solver, y0s, p, args_axes=0, stale="ignore", sharding=sharding
        )
        return jnp.sum(sol.ys**2)

    grad_jit = jax.jit(jax.grad(loss))

    def gradient():
        return grad_jit(params, mesh).block_until_ready()

    def both():
        return grad_jit(params, record()).block_until_ready()

    def block(fn):
        return lambda: jax.block_until_ready(fn())

    out = dict(
        devices=jax.device_count(),
        trajectories=n,
        mesh_steps=mesh.max_steps,
        record=_times(block(record), repeats),
        gradient=_times(gradient, repeats),
        record_and_gradient=_times(both, repeats),
        collectives=dict(
            record=_collectives(record_jit, y0s, params),
            gradient=_collectives(grad_jit, params, mesh),
            loss=_collectives(jax.jit(loss), params, mesh),
        ),
        gradient_sharding=str(grad_jit(params, mesh).sharding.spec),
    )
    # For contrast: plain jax.vmap under jit, partitioned by XLA itself.
    plain = jax.jit(jax.vmap(one))
    out["collectives"]["record_plain_vmap"] = _collectives(plain, y0s, params)
    return out


def run(devices: int, n: int, repeats: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    root = str(pathlib.Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, "--child", "-n", str(n), "-r", str(repeats)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(rows: list[dict]) -> str:
    base = rows[0]
    lines = [
        f"Lorenz, {base['trajectories']:,} trajectories, float64, rtol = atol = 1e-8, "
        f"Tsit5, {base['mesh_steps']} mesh steps; {os.cpu_count()} CPU cores; "
        "seconds, min (median) of the repeats after a warm-up.",
        "",
        "| devices | record | gradient | record + gradient | speed-up (r+g, min) "
        "| collectives: record / gradient / loss |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [
            f"{row[k]['min']:.3f} ({row[k]['median']:.3f})"
            for k in ("record", "gradient", "record_and_gradient")
        ]
        speed = base["record_and_gradient"]["min"] / row["record_and_gradient"]["min"]
        c = row["collectives"]
        traffic = " / ".join(
            ", ".join(f"{v} {k}" for k, v in c[w].items() if v) or "none"
            for w in ("record", "gradient", "loss")
        )
        lines.append(
            f"| {row['devices']} | " + " | ".join(cells) + f" | {speed:.2f}x | "
            f"{traffic} |"
        )
    plain = rows[-1]["collectives"]["record_plain_vmap"]
    lines += [
        "",
        f"Plain `jax.vmap(gs.record)` under `jit` on {rows[-1]['devices']} devices "
        f"(partitioned by XLA): {plain['all-reduce']} all-reduces in the program, "
        "run on every step of the loop.",
    ]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", "--trajectories", type=int, default=16384)
    parser.add_argument("-r", "--repeats", type=int, default=5)
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--child", action="store_true")
    a = parser.parse_args()
    if a.child:
        print(json.dumps(child(a.trajectories, a.repeats)))
        return
    rows = [run(k, a.trajectories, a.repeats) for k in a.devices]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sharded.json").write_text(json.dumps(rows, indent=1) + "\n")
    text = report(rows)
    (RESULTS / "sharded.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
