"""One evaluation of `gs.fit`'s residuals, in parts, against Diffrax's Jacobian.

    python benchmarks/fit_evaluation.py            # FitzHugh-Nagumo, 32 experiments
    python benchmarks/fit_evaluation.py --n 64

With meshes recorded at every evaluation (`gs.fit`'s default for least squares), an
evaluation is a recording of the ensemble and the forward-mode Jacobian blocks of
the replays over it (each trajectory's values at the observation times
differentiated in forward mode, one tangent per parameter pushed through the whole
ensemble, the replay running only the recorded steps). This times the two apart on
`benchmarks/fit_problems.py`'s FitzHugh-Nagumo fit at its initial guess, next to
what one evaluation of the Diffrax fit costs: the same blocks through
`diffrax.diffeqsolve` with `diffrax.ForwardMode()`. Timed with the benchmarks'
interleaved protocol (`harness.time_interleaved`): the minimum and median of
`--repeats` rounds, and the compile time (first call minus the minimum).
"""

import argparse
import sys

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
from harness import time_interleaved  # noqa: E402

import gradsolve as gs  # noqa: E402
from gradsolve._replay import replay_values  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--buffer", type=int, default=256, help="steps per mesh")
    parser.add_argument("--repeats", type=int, default=30)
    opts = parser.parse_args()
    y0s, ts, _ = fitzhugh_nagumo_data(opts.n)
    term, solver = gs.ODETerm(fitzhugh_nagumo), gs.Tsit5()
    t1 = ts[-1]  # gs.fit records up to the last observation

    def record_one(y0, p):
        return gs.record(term, solver, 0.0, t1, None, y0, p,
                         stepsize_controller=FHN_CONTROLLER,
                         max_steps=opts.buffer, throw=False)  # fmt: skip

    record = jax.jit(jax.vmap(record_one, in_axes=(0, None)))
    held = {}

    def recording():
        held["mesh"] = jax.block_until_ready(record(y0s, FHN_GUESS))

    def voltage(p, y0, m):
        return replay_values(m, term, solver, y0, p, ts, True)[:, 0]

    # As gs.fit assembles them (`_fit_jacobian.py`): one tangent per parameter,
    # pushed through every trajectory at once.
    ensemble = lambda p, *inputs: jax.vmap(voltage, in_axes=(None, 0, 0))(p, *inputs)
    blocks = jax.jit(jax.jacfwd(ensemble))

    def diffrax_voltage(p, y0):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(fitzhugh_nagumo), diffrax.Tsit5(), 0.0, t1, None, y0, p,
            saveat=diffrax.SaveAt(ts=ts), stepsize_controller=FHN_CONTROLLER,
            adjoint=diffrax.ForwardMode(),
        )  # fmt: skip
        return sol.ys[:, 0]

    diffrax_ensemble = lambda p, y0s: jax.vmap(diffrax_voltage, in_axes=(None, 0))(
        p, y0s
    )
    diffrax_blocks = jax.jit(jax.jacfwd(diffrax_ensemble))
    # In this order, so that the first call of each (its compilation) comes first
    # and the blocks replay the mesh just recorded.
    tasks = {
        "gradsolve recording": recording,
        "gradsolve Jacobian blocks": lambda: jax.block_until_ready(
            blocks(FHN_GUESS, y0s, held["mesh"])
        ),
        "Diffrax Jacobian blocks": lambda: jax.block_until_ready(
            diffrax_blocks(FHN_GUESS, y0s)
        ),
    }
    times = time_interleaved(tasks, opts.repeats, log=lambda *_: None)
    mesh = held["mesh"]
    gap = jnp.max(
        jnp.abs(blocks(FHN_GUESS, y0s, mesh) - diffrax_blocks(FHN_GUESS, y0s))
    )
    steps = f"{int(mesh.num_steps.min())}-{int(mesh.num_steps.max())} steps"
    print(f"FitzHugh-Nagumo, {opts.n} experiments, {len(ts)} times, {steps}, "
          f"buffer {opts.buffer}; Jacobian blocks' largest difference from "
          f"Diffrax's: {float(gap):.1e}")  # fmt: skip
    for name, t in times.items():
        print(f"{name}: {1e3 * t['min_s']:.2f} ms (median {1e3 * t['median_s']:.2f}), "
              f"compile {t['compile_s']:.2f} s")  # fmt: skip
    evaluation = (
        times["gradsolve recording"]["min_s"]
        + times["gradsolve Jacobian blocks"]["min_s"]
    )
    ratio = times["Diffrax Jacobian blocks"]["min_s"] / evaluation
    print(f"evaluation: {1e3 * evaluation:.2f} ms, {ratio:.2f}x Diffrax's")


if __name__ == "__main__":
    sys.exit(main())
