"""The main job: solve, record, differentiate and compare with Diffrax.

Run with `python -m gradsolve.demo` (add `--trajectories N` to change the ensemble).
A Lorenz ensemble (the DiffEqGPU.jl benchmark problem: rho varied across
trajectories) is solved adaptively at rtol = atol = 1e-8 in float64. gradsolve
records the accepted steps once and differentiates a fixed-step replay over them;
Diffrax differentiates its own adaptive solve with its default adjoint. Both give
the same derivative (the exact discrete adjoint of the same steps), which the demo
checks, and the demo reports how long each takes.
"""

import argparse
import time

import jax


jax.config.update("jax_enable_x64", True)

import diffrax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gradsolve as gs  # noqa: E402


def lorenz(t, y, args):
    sigma, rho, beta = args
    return jnp.stack(
        [sigma * (y[1] - y[0]), y[0] * (rho - y[2]) - y[1], y[0] * y[1] - beta * y[2]]
    )


def best_time(fn, *args, repeats=5):
    """Minimum wall time of `fn(*args)` over `repeats` runs, after one warm-up."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def main(num_trajectories: int = 1024):
    term = gs.ODETerm(lorenz)
    controller = gs.PIDController(rtol=1e-8, atol=1e-8)
    rho = jnp.linspace(0.0, 21.0, num_trajectories)
    params = jnp.stack([jnp.full_like(rho, 10.0), rho, jnp.full_like(rho, 8 / 3)], 1)
    y0s = jnp.broadcast_to(jnp.array([1.0, 0.0, 0.0]), (num_trajectories, 3))

    def record():
        # The whole ensemble's trimmed mesh (`jax.vmap` of `gs.record`, then `trim`).
        return gs.record_ensemble(
            term,
            gs.Tsit5(),
            0.0,
            1.0,
            None,
            y0s,
            params,
            args_axes=0,
            stepsize_controller=controller,
        )

    def solve_loss(params):  # no mesh kept: record and differentiate in one call
        ys = jax.vmap(
            lambda y0, p: (
                gs.diffeqsolve(
                    term,
                    gs.Tsit5(),
                    0.0,
                    1.0,
                    None,
                    y0,
                    p,
                    stepsize_controller=controller,
                ).ys
            )
        )(y0s, params)
        return jnp.sum(ys**2)

    def replay_loss(params, mesh):
        ys = jax.vmap(lambda m, y0, p: gs.replay(m, term, gs.Tsit5(), y0, p).ys)(
            mesh, y0s, params
        )
        return jnp.sum(ys**2)

    def diffrax_loss(params):
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
                    stepsize_controller=controller,
                ).ys
            )
        )(y0s, params)
        return jnp.sum(ys**2)

    gs_forward = jax.jit(solve_loss)
    diffrax_forward = jax.jit(diffrax_loss)
    replay_grad = jax.jit(jax.grad(replay_loss))
    solve_grad = jax.jit(jax.grad(solve_loss))
    diffrax_grad = jax.jit(jax.grad(diffrax_loss))

    print(
        f"Lorenz ensemble: {num_trajectories} trajectories, t in [0, 1], "
        "rtol = atol = 1e-8, float64"
    )
    mesh = record()
    steps = np.asarray(mesh.num_steps)
    print(
        f"recorded meshes: {steps.min()}-{steps.max()} accepted steps per "
        f"trajectory (trimmed to {mesh.max_steps})"
    )

    t_forward = best_time(gs_forward, params)
    t_diffrax_forward = best_time(diffrax_forward, params)
    t_record = best_time(lambda: record().ts)
    t_grad = best_time(replay_grad, params, mesh)
    t_solve_grad = best_time(solve_grad, params)
    t_diffrax = best_time(diffrax_grad, params)
    g_ours = replay_grad(params, mesh)
    g_theirs = diffrax_grad(params)
    rel = float(jnp.max(jnp.abs(g_ours - g_theirs)) / jnp.max(jnp.abs(g_theirs)))
    stale = jax.vmap(
        lambda m, y0, p: gs.replay(m, term, gs.Tsit5(), y0, p).stats["max_error_ratio"]
    )(mesh, y0s, params)

    print(f"gradsolve solve (adaptive forward)  : {1e3 * t_forward:8.1f} ms")
    print(f"Diffrax solve (adaptive forward)    : {1e3 * t_diffrax_forward:8.1f} ms")
    print(f"gradsolve record (solve + mesh)     : {1e3 * t_record:8.1f} ms")
    print(f"gradsolve gradient, existing mesh   : {1e3 * t_grad:8.1f} ms")
    print(f"gradsolve record + gradient         : {1e3 * (t_record + t_grad):8.1f} ms")
    print(f"gradsolve one-call gradient         : {1e3 * t_solve_grad:8.1f} ms")
    print(f"Diffrax gradient (default adjoint)  : {1e3 * t_diffrax:8.1f} ms")
    print(
        f"speed-up, forward solve             : {t_diffrax_forward / t_forward:8.1f}x"
    )
    print(f"speed-up, existing mesh             : {t_diffrax / t_grad:8.1f}x")
    print(
        f"speed-up, record + gradient         : {t_diffrax / (t_record + t_grad):8.1f}x"
    )
    print(f"speed-up, one-call gradient         : {t_diffrax / t_solve_grad:8.1f}x")
    print(f"max relative difference of gradients: {rel:.2e}")
    print(
        f"largest replay error ratio (<= 1: mesh still valid): {float(stale.max()):.3f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=1024)
    main(parser.parse_args().trajectories)
