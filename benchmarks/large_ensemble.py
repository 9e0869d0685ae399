"""A 262,144-trajectory Lorenz gradient (rtol = atol = 1e-6, float64) in a memory
budget, recorded and differentiated in chunks.

`python benchmarks/large_ensemble.py [--trajectories 262144]` prints the memory
estimates, the chunk sizes chosen, the record and gradient times, the peak resident
memory of the process, and the largest relative difference of the gradient from
Diffrax's on a sample of trajectories.
"""

import argparse
import resource
import time

import diffrax
import jax
import jax.numpy as jnp
import numpy as np

import gradsolve as gs
from gradsolve._ensemble import available_memory, default_budget
from gradsolve.demo import lorenz


def main(n: int, sample: int = 256):
    term = diffrax.ODETerm(lorenz)
    ctrl = diffrax.PIDController(rtol=1e-6, atol=1e-6)
    params = jnp.stack(
        [jnp.full(n, 10.0), jnp.linspace(0.0, 21.0, n), jnp.full(n, 8 / 3)], axis=1
    )
    y0s = jnp.tile(jnp.array([1.0, 0.0, 0.0]), (n, 1))
    print(f"Lorenz, {n:,} trajectories, float64, rtol = atol = 1e-6, t in [0, 1]")
    print(
        f"available memory {available_memory() / 2**30:.1f} GiB, "
        f"budget {default_budget() / 2**30:.1f} GiB"
    )
    est = gs.estimate_memory(n, 4096, y0s)
    print(f"estimated record at max_steps=4096: {est['record'] / 2**30:.1f} GiB")

    start = time.perf_counter()
    mesh = gs.record_ensemble(
        term,
        gs.Tsit5(),
        0.0,
        1.0,
        None,
        y0s,
        params,
        args_axes=0,
        stepsize_controller=ctrl,
    )
    jax.block_until_ready(mesh.ts)
    record_s = time.perf_counter() - start
    est = gs.estimate_memory(n, mesh.max_steps, y0s)
    print(
        f"recorded in {record_s:.1f} s: {int(jnp.max(mesh.num_steps))} steps at most "
        f"(trimmed to {mesh.max_steps}); estimated gradient "
        f"{est['gradient'] / 2**30:.2f} GiB"
    )

    def loss(params, mesh, y0s):  # arrays as arguments, not compile-time constants
        sol = gs.replay_ensemble(
            mesh, term, gs.Tsit5(), y0s, params, args_axes=0, stale="error"
        )
        return jnp.sum(sol.ys**2)

    grad = jax.jit(jax.grad(loss))
    start = time.perf_counter()
    g = jax.block_until_ready(grad(params, mesh, y0s))
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    g = jax.block_until_ready(grad(params, mesh, y0s))
    grad_s = time.perf_counter() - start
    print(f"gradient: {grad_s:.1f} s ({first_s:.1f} s with compilation)")

    pick = np.linspace(0, n - 1, sample).astype(int)

    def diffrax_loss(p):
        ys = jax.vmap(
            lambda y0, p: (
                diffrax.diffeqsolve(
                    term,
                    diffrax.Tsit5(),
                    0.0,
                    1.0,
                    None,
                    y0,
                    p,
                    stepsize_controller=ctrl,
                ).ys
            )
        )(y0s[pick], p)
        return jnp.sum(ys**2)

    want = jax.jit(jax.grad(diffrax_loss))(params[pick])
    diff = float(jnp.max(jnp.abs(g[pick] - want)) / jnp.max(jnp.abs(want)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"max relative difference from Diffrax on {sample} trajectories: {diff:.1e}")
    print(f"peak resident memory: {peak:.1f} GiB")


if __name__ == "__main__":
    jax.config.update("jax_enable_x64", True)
    parser = argparse.ArgumentParser()
    parser.add_argument("--trajectories", type=int, default=262_144)
    main(parser.parse_args().trajectories)
