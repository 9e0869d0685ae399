"""`gs.estimate_memory` against XLA's own accounting of the programs it estimates.

For each solver, state size and path (a forward replay and its gradient, under
`jax.jit` of `gs.replay_ensemble`; a recording, `jax.vmap` of `gs.record`), compile
the program for two batch sizes and compare `compiled.memory_analysis()`
(temporaries + outputs - aliased) with the estimate, per trajectory. The estimate
should be at or a little above XLA's figure everywhere: below it, `memory_budget`
can be exceeded; far above it, chunks are smaller than they need to be.

    python benchmarks/memory_calibration.py [--sizes 3 8 12 32]

prints one row per case: the ratio estimate / XLA for the larger batch, and the
per-trajectory bytes of each.
"""

import argparse

import jax
import jax.numpy as jnp

import gradsolve as gs


jax.config.update("jax_enable_x64", True)


def _field(t, y, p):
    return p[0] * jnp.sin(y[::-1]) - p[1] * y + p[2]


def _inputs(n_state: int, batch: int):
    y0 = jnp.tile(jnp.linspace(0.1, 1.0, n_state), (batch, 1))
    params = jnp.stack(
        [jnp.full(batch, 2.0), jnp.linspace(0.5, 1.5, batch), jnp.full(batch, 0.3)], 1
    )
    return y0, params


def _xla_bytes(compiled) -> int:
    ma = compiled.memory_analysis()
    return int(ma.temp_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes)


def measure(solver_name: str, n_state: int, batch: int, t1: float) -> dict:
    solver = gs.Rodas5() if solver_name == "rodas5" else gs.Tsit5()
    term = gs.ODETerm(_field)
    ctrl = gs.PIDController(rtol=1e-8, atol=1e-8)
    y0s, params = _inputs(n_state, batch)
    mesh = gs.record_ensemble(
        term, solver, 0.0, t1, None, y0s, params, args_axes=0,
        stepsize_controller=ctrl, max_steps=4096,
    )  # fmt: skip
    steps = mesh.max_steps

    def replay(p, mesh, y0s):
        sol = gs.replay_ensemble(
            mesh, term, solver, y0s, p, args_axes=0, stale="ignore"
        )
        return sol.ys

    def loss(p, mesh, y0s):
        return jnp.sum(replay(p, mesh, y0s) ** 2)

    def record(y0s, p):
        return jax.vmap(
            lambda y, q: gs.record(
                term,
                solver,
                0.0,
                t1,
                None,
                y,
                q,
                stepsize_controller=ctrl,
                max_steps=steps,
            )  # fmt: skip
        )(y0s, p)

    estimate = gs.estimate_memory(batch, steps, y0s, solver=solver, args=params)
    out = dict(solver=solver_name, n=n_state, batch=batch, steps=steps)
    for path, fn, args in [
        ("replay", replay, (params, mesh, y0s)),
        ("gradient", jax.grad(loss), (params, mesh, y0s)),
        ("record", record, (y0s, params)),
    ]:
        xla = _xla_bytes(jax.jit(fn).lower(*args).compile())
        out[path] = dict(xla=xla, estimate=estimate[path])
    return out


def main(sizes, solvers, batches, t1):
    print(
        f"{'solver':7s} {'n':>3s} {'steps':>5s} {'path':9s} "
        f"{'XLA B/traj':>11s} {'est B/traj':>11s} {'est/XLA':>8s}"
    )
    for solver in solvers:
        for n in sizes:
            small, large = (measure(solver, n, b, t1) for b in batches)
            for path in ("replay", "gradient", "record"):
                a, b = small[path], large[path]
                dx = (b["xla"] - a["xla"]) / (large["batch"] - small["batch"])
                de = (b["estimate"] - a["estimate"]) / (large["batch"] - small["batch"])
                print(
                    f"{solver:7s} {n:3d} {large['steps']:5d} {path:9s} {dx:11.0f} "
                    f"{de:11.0f} {b['estimate'] / b['xla']:8.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[3, 8, 12, 32])
    parser.add_argument("--solvers", nargs="+", default=["tsit5", "rodas5"])
    parser.add_argument("--batches", type=int, nargs=2, default=[256, 1024])
    parser.add_argument("--t1", type=float, default=1.0)
    a = parser.parse_args()
    main(a.sizes, a.solvers, a.batches, a.t1)
