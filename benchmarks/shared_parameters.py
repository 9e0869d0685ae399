"""Gradients with respect to parameters that every trajectory shares, against Diffrax.

    python benchmarks/shared_parameters.py                 # Lorenz, N = 64 and 1,024
    python benchmarks/shared_parameters.py --problems lotka_volterra --sizes 4096

`run.py`'s problems give each trajectory its own parameters (`args_axes=0`). Fitting
one model to many experiments shares them instead: one set of `args` for the whole
ensemble, which a loss over `jax.vmap` of the solves differentiates from outside the
`vmap`. This times that gradient, in one process with the tables' interleaved
protocol (`harness.time_interleaved`), float64, Tsit5 at the problem's tolerance,
the trajectories differing in their initial states (`y0 * (1 + i / N)`):

- `replay`: `jax.grad` of a loss over `gs.replay` of the ensemble's recorded mesh;
- `replay, closed over`: the same with the parameters closed over by the vector
  field instead of passed in `args`;
- `one-call`: `jax.grad` of the same loss over `jax.vmap(gs.diffeqsolve)`;
- `diffrax`: the same over `jax.vmap(diffrax.diffeqsolve)`.

Prints the minimum and median of the rounds (ms), the first call (s, compilation
included) and the gradients' largest relative difference from Diffrax's.
"""

import argparse
import sys

import diffrax
import jax
import jax.numpy as jnp
import numpy as np


jax.config.update("jax_enable_x64", True)

from harness import time_gradients  # noqa: E402
from problems import PROBLEMS, make_inputs  # noqa: E402

import gradsolve as gs  # noqa: E402


def case(problem, n: int, repeats: int) -> list[str]:
    base_y0, args = jax.tree.map(jnp.asarray, _shared_inputs(problem))
    y0s = base_y0 * (1 + jnp.arange(n)[:, None] / n)
    t0, t1, tol = problem.t0, problem.t1, problem.tol64
    term = gs.ODETerm(problem.jax_vf)
    kw = dict(max_steps=problem.max_steps)
    mesh = gs.record_ensemble(
        term, gs.Tsit5(), t0, t1, None, y0s, args,
        stepsize_controller=gs.PIDController(rtol=tol, atol=tol), **kw,
    )  # fmt: skip

    def solved(lib):
        ctrl = lib.PIDController(rtol=tol, atol=tol)

        def one(y0, a):
            sol = lib.diffeqsolve(
                lib.ODETerm(problem.jax_vf), lib.Tsit5(), t0, t1, None, y0, a,
                stepsize_controller=ctrl, **kw,
            )  # fmt: skip
            return sol.ys[-1]

        return lambda a: jax.vmap(one, in_axes=(0, None))(y0s, a)

    def closed_over(a):  # the field closes over the parameters instead
        field = gs.ODETerm(lambda t, y, _: problem.jax_vf(t, y, a))
        return gs.replay(mesh, field, gs.Tsit5(), y0s).ys[:, -1]

    finals = {
        "replay": lambda a: gs.replay(mesh, term, gs.Tsit5(), y0s, a).ys[:, -1],
        "replay, closed over": closed_over,
        "one-call": solved(gs),
        "diffrax": solved(diffrax),
    }
    times, grads = time_gradients(finals, args, repeats)
    want = jax.tree.leaves(grads["diffrax"](args))
    rows = []
    for name, t in times.items():
        got = jax.tree.leaves(grads[name](args))
        gap = max(float(np.max(np.abs(a - b) / np.abs(b))) for a, b in zip(got, want))
        speed_up = times["diffrax"]["min_s"] / t["min_s"]
        rows.append(
            f"| {problem.name} | {n} | {name} | {1e3 * t['min_s']:.2f} "
            f"| {1e3 * t['median_s']:.2f} | {t['first_s']:.1f} | {speed_up:.2f}x "
            f"| {gap:.1e} |"
        )
    return rows


def _shared_inputs(problem):
    """The initial state and parameters of the last trajectory of `problem`'s
    ensemble of two (for Lorenz, rho = 21)."""
    y0s, args = make_inputs(problem, 2)
    return y0s[-1], args[-1] if problem.args_axes == 0 else args


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", default="lorenz")
    parser.add_argument("--sizes", default="64,1024")
    parser.add_argument("--repeats", type=int, default=10)
    opts = parser.parse_args()
    print(
        "| problem | N | gradient | min ms | median ms | first call s "
        "| speed-up vs Diffrax (min) | gradient vs Diffrax |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in opts.problems.split(","):
        for n in map(int, opts.sizes.split(",")):
            for row in case(PROBLEMS[name], n, opts.repeats):
                print(row, flush=True)


if __name__ == "__main__":
    sys.exit(main())
