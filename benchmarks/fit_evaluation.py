"""One evaluation of `gs.fit`'s residuals, in parts, against Diffrax's Jacobian.

    python benchmarks/fit_evaluation.py            # FitzHugh-Nagumo, 32 experiments
    python benchmarks/fit_evaluation.py --n 64

With meshes recorded at every evaluation (`gs.fit`'s default for least squares), an
evaluation is a recording of the ensemble and the forward-mode Jacobian blocks of
the replays over it (`jax.jacfwd` of each trajectory's values at the observation
times, the replay running only the recorded steps). This times the two apart on
`benchmarks/fit_problems.py`'s FitzHugh-Nagumo fit at its initial guess, next to
what one evaluation of the Diffrax fit costs: the same blocks through
`diffrax.diffeqsolve` with `diffrax.ForwardMode()`. The minimum of `--repeats`
calls, each compiled once before.
"""

import argparse
import sys
import time

import diffrax
import jax
import jax.numpy as jnp


jax.config.update("jax_enable_x64", True)

from fit_problems import (  # noqa: E402
    FHN_CONTROLLER,
    FHN_GUESS,
    fitzhugh_nagumo,
    fitzhugh_nagumo_data,
)

import gradsolve as gs  # noqa: E402
from gradsolve._replay import replay_values  # noqa: E402


T1 = 10.0


def fastest(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--buffer", type=int, default=256, help="steps per mesh")
    parser.add_argument("--repeats", type=int, default=30)
    opts = parser.parse_args()
    y0s, ts, _ = fitzhugh_nagumo_data(opts.n)
    term, solver = gs.ODETerm(fitzhugh_nagumo), gs.Tsit5()

    def record_one(y0, p):
        return gs.record(term, solver, 0.0, T1, None, y0, p,
                         stepsize_controller=FHN_CONTROLLER,
                         max_steps=opts.buffer, throw=False)  # fmt: skip

    record = jax.jit(jax.vmap(record_one, in_axes=(0, None)))
    mesh = record(y0s, FHN_GUESS)

    def voltage(p, y0, m):
        return replay_values(m, term, solver, y0, p, ts, True)[:, 0]

    blocks = jax.jit(jax.vmap(jax.jacfwd(voltage), in_axes=(None, 0, 0)))

    def diffrax_voltage(p, y0):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(fitzhugh_nagumo), diffrax.Tsit5(), 0.0, T1, None, y0, p,
            saveat=diffrax.SaveAt(ts=ts), stepsize_controller=FHN_CONTROLLER,
            adjoint=diffrax.ForwardMode(),
        )  # fmt: skip
        return sol.ys[:, 0]

    diffrax_blocks = jax.jit(jax.vmap(jax.jacfwd(diffrax_voltage), in_axes=(None, 0)))
    ours = blocks(FHN_GUESS, y0s, mesh)
    gap = float(jnp.max(jnp.abs(ours - diffrax_blocks(FHN_GUESS, y0s))))
    steps = mesh.num_steps
    print(f"FitzHugh-Nagumo, {opts.n} experiments, {len(ts)} times, "
          f"{int(steps.min())}-{int(steps.max())} steps, buffer {opts.buffer}; "
          f"Jacobian blocks' largest difference from Diffrax's: {gap:.1e}")  # fmt: skip
    times = {
        "gradsolve recording": fastest(lambda: record(y0s, FHN_GUESS), opts.repeats),
        "gradsolve Jacobian blocks": fastest(
            lambda: blocks(FHN_GUESS, y0s, mesh), opts.repeats
        ),
        "Diffrax Jacobian blocks": fastest(
            lambda: diffrax_blocks(FHN_GUESS, y0s), opts.repeats
        ),
    }
    for name, seconds in times.items():
        print(f"{name}: {1e3 * seconds:.2f} ms")
    ours = times["gradsolve recording"] + times["gradsolve Jacobian blocks"]
    print(f"evaluation: {1e3 * ours:.2f} ms, "
          f"{times['Diffrax Jacobian blocks'] / ours:.2f}x Diffrax's")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
