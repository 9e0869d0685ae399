"""One Lorenz ensemble split across every device, on one host or several.

The same code runs on one device, on several devices of one host, and on several
hosts:

    # one host, 8 simulated CPU devices (or all the GPUs of the machine):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python examples/sharded_ensemble.py

    # several hosts: start one process per host with its coordinates
    python examples/sharded_ensemble.py --coordinator host0:1234 \
        --num-processes 2 --process-id 0   # on host 0, and --process-id 1 on host 1

Every device records, trims and replays its own trajectories; the loss (a sum over
the ensemble) is the only value that crosses devices.
"""

import argparse

import jax


jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gradsolve as gs  # noqa: E402


def lorenz(t, y, args):
    sigma, rho, beta = args
    return jnp.stack(
        [sigma * (y[1] - y[0]), y[0] * (rho - y[2]) - y[1], y[0] * y[1] - beta * y[2]]
    )


def main(n: int = 1024) -> dict:
    sharding = gs.ensemble_sharding()  # every device of every host
    # Each host makes only its own rows, and JAX assembles the global arrays from
    # them (on one host, its rows are all of them).
    rows = np.array_split(np.arange(n), jax.process_count())[jax.process_index()]
    rho = np.linspace(0.0, 21.0, n)[rows]
    local_params = np.stack([np.full(rho.size, 10.0), rho, np.full(rho.size, 8 / 3)], 1)
    local_y0s = np.tile([1.0, 0.0, 0.0], (rho.size, 1))
    params = jax.make_array_from_process_local_data(sharding, local_params)
    y0s = jax.make_array_from_process_local_data(sharding, local_y0s)

    term, solver = gs.ODETerm(lorenz), gs.Tsit5()
    ctrl = gs.PIDController(rtol=1e-8, atol=1e-8)

    def record_one(y0, p):
        return gs.record(term, solver, 0.0, 1.0, None, y0, p, stepsize_controller=ctrl)

    # Each device runs its own adaptive loop over its own trajectories.
    meshes = jax.jit(gs.sharded_vmap(record_one, sharding=sharding))(y0s, params)
    meshes = meshes.trim()  # one bucket for the whole ensemble; the mesh stays split

    # Global arrays enter `jit` as arguments: across hosts, no process holds all of
    # them, so they cannot be closed over as constants.
    def loss(params, meshes, y0s):
        sol = gs.replay(
            meshes, term, solver, y0s, params, args_axes=0, sharding=sharding
        )
        return jnp.sum(sol.ys**2)  # the one reduction across devices

    value, grads = jax.jit(jax.value_and_grad(loss))(params, meshes, y0s)
    return dict(
        devices=jax.device_count(),
        processes=jax.process_count(),
        mesh_steps=meshes.max_steps,
        mesh_sharding=meshes.ts.sharding,
        loss=float(value),
        grads_sharding=grads.sharding,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", "--trajectories", type=int, default=1024)
    parser.add_argument("--coordinator", help="host:port of process 0")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    a = parser.parse_args()
    if a.coordinator:
        # On a cluster JAX knows (SLURM, Cloud TPU, ...) initialize() needs no
        # arguments.
        jax.distributed.initialize(a.coordinator, a.num_processes, a.process_id)
    for key, value in main(a.trajectories).items():
        print(f"{key}: {value}")
