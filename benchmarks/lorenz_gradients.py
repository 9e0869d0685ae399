"""Forward and gradient times of every gradsolve path next to Diffrax's, on one case.

`python benchmarks/lorenz_gradients.py [--trajectories 4096]`: the Lorenz ensemble of
the DiffEqGPU.jl benchmark (rho = linspace(0, 21, N)), float64, rtol = atol = 1e-8,
loss = sum(y(t1)**2). Prints minimum times over repeats (after a compiling call) for
Diffrax's forward and default-adjoint gradient, `gs.diffeqsolve` forward and gradient,
and `gs.replay` forward and gradient over an existing trimmed mesh, plus the largest
relative difference of the gradients from Diffrax's, and the time to record the
ensemble's trimmed mesh with `jax.vmap(gs.record)` + `trim()` and with
`gs.record_ensemble`. Used for the table of levers in
benchmarks/README.md.
"""

import argparse

import diffrax
import jax
import jax.numpy as jnp

import gradsolve as gs
from gradsolve.demo import best_time, lorenz  # the demo's problem and timer (float64)


def best_ms(fn, *args):
    return 1e3 * best_time(fn, *args)


def main(n: int):
    term = diffrax.ODETerm(lorenz)
    ctrl = diffrax.PIDController(rtol=1e-8, atol=1e-8)
    rho = jnp.linspace(0.0, 21.0, n)
    params = jnp.stack([jnp.full(n, 10.0), rho, jnp.full(n, 8 / 3)], axis=1)
    y0s = jnp.tile(jnp.array([1.0, 0.0, 0.0]), (n, 1))

    def ensemble(solve):
        return lambda params: jax.vmap(solve)(y0s, params)

    diffrax_ys = ensemble(
        lambda y0, p: (
            diffrax.diffeqsolve(
                term, diffrax.Tsit5(), 0.0, 1.0, None, y0, p, stepsize_controller=ctrl
            ).ys
        )
    )
    gs_ys = ensemble(
        lambda y0, p: (
            gs.diffeqsolve(
                term, gs.Tsit5(), 0.0, 1.0, None, y0, p, stepsize_controller=ctrl
            ).ys
        )
    )
    mesh = jax.jit(
        ensemble(
            lambda y0, p: gs.record(
                term, gs.Tsit5(), 0.0, 1.0, None, y0, p, stepsize_controller=ctrl
            )
        )
    )(params)
    mesh = mesh.trim()

    def replay_ys(params, mesh):
        return jax.vmap(lambda m, y0, p: gs.replay(m, term, gs.Tsit5(), y0, p).ys)(
            mesh, y0s, params
        )

    def loss(ys_fn):
        return lambda *a: jnp.sum(ys_fn(*a) ** 2)

    grads = {
        "diffrax": jax.jit(jax.grad(loss(diffrax_ys))),
        "gs.diffeqsolve": jax.jit(jax.grad(loss(gs_ys))),
        "gs.replay": jax.jit(jax.grad(loss(replay_ys))),
    }
    forwards = {
        "diffrax": jax.jit(diffrax_ys),
        "gs.diffeqsolve": jax.jit(gs_ys),
        "gs.replay": jax.jit(replay_ys),
    }
    extra = {"diffrax": (), "gs.diffeqsolve": (), "gs.replay": (mesh,)}
    reference = grads["diffrax"](params)
    print(
        f"Lorenz, {n} trajectories, float64, rtol = atol = 1e-8, "
        f"mesh of {mesh.max_steps} steps"
    )
    record_vmap = jax.jit(
        ensemble(
            lambda y0, p: gs.record(
                term, gs.Tsit5(), 0.0, 1.0, None, y0, p, stepsize_controller=ctrl
            )
        )
    )
    recorders = {
        "jit(vmap(gs.record)) + trim": lambda p: record_vmap(p).trim().ts,
        "gs.record_ensemble": lambda p: (
            gs.record_ensemble(
                term,
                gs.Tsit5(),
                0.0,
                1.0,
                None,
                y0s,
                p,
                args_axes=0,
                stepsize_controller=ctrl,
            ).ts
        ),
    }
    for name, fn in recorders.items():
        print(f"record, {name:28s} {best_ms(fn, params):8.2f} ms")
    for name in grads:
        fwd = best_ms(forwards[name], params, *extra[name])
        grad = best_ms(grads[name], params, *extra[name])
        g = grads[name](params, *extra[name])
        diff = float(jnp.max(jnp.abs(g - reference)) / jnp.max(jnp.abs(reference)))
        print(
            f"{name:15s} forward {fwd:8.2f} ms   gradient {grad:8.2f} ms   "
            f"gradient vs Diffrax {diff:.1e}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=4096)
    main(parser.parse_args().trajectories)
