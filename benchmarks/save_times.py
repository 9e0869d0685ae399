"""Solves that save many values: `SaveAt(ts=...)` with 11 to 1,001 save
times, gradsolve against Diffrax, in one process.

    python benchmarks/save_times.py [--problems lotka_volterra,lorenz]
        [--num-ts 11,101,1001] [--n 1,1024] [--repeats 5] [--gradient]

For each problem, number of save times and ensemble size: `jax.jit(jax.vmap(...))`
of `gs.diffeqsolve` and of `diffrax.diffeqsolve` (Tsit5, PID rtol = atol = 1e-6,
float64, the save times spread evenly over the interval), each a fresh compiled
function. Reports the first call (compilation included) and the fastest of
`--repeats` later calls, and checks that the saved values agree. `--gradient` times
the gradient of `sum(ys**2)` with respect to the parameters instead (gradsolve's
one-call gradient against Diffrax's default adjoint) and compares the gradients.
"""

import argparse
import time

import diffrax
import jax
import jax.numpy as jnp
import numpy as np


jax.config.update("jax_enable_x64", True)

from problems import PROBLEMS  # noqa: E402

import gradsolve as gs  # noqa: E402


def _timed(fn, *args, repeats: int):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return out, first, best


def row(problem, num_ts: int, n: int, repeats: int, gradient: bool = False) -> dict:
    y0s, args = problem.make_inputs(n, np.random.default_rng(0))
    y0s, args = jnp.asarray(y0s), jax.tree.map(jnp.asarray, args)
    saveat = diffrax.SaveAt(ts=jnp.linspace(problem.t0, problem.t1, num_ts))
    ctrl = diffrax.PIDController(rtol=1e-6, atol=1e-6)
    term = diffrax.ODETerm(problem.jax_vf)
    out = dict(problem=problem.name, num_ts=num_ts, n=n)
    ys = {}
    for lib in (gs, diffrax):
        solve = lambda y0, a, lib=lib: lib.diffeqsolve(
            term, lib.Tsit5(), problem.t0, problem.t1, None, y0, a,
            saveat=saveat, stepsize_controller=ctrl, max_steps=problem.max_steps,
        ).ys  # fmt: skip
        fn = jax.vmap(solve, in_axes=(0, problem.args_axes))
        if gradient:  # of sum(ys**2) with respect to `args`
            fn = jax.grad(lambda y0s, a, fn=fn: jnp.sum(fn(y0s, a) ** 2), argnums=1)
        fn = jax.jit(fn)
        ys[lib.__name__], first, best = _timed(fn, y0s, args, repeats=repeats)
        out[lib.__name__] = dict(first_s=first, run_ms=1e3 * best)
    scale = np.max(np.abs(ys["diffrax"]))
    out["max_difference"] = float(np.max(np.abs(ys["gradsolve"] - ys["diffrax"])))
    out["max_difference"] /= scale
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default="lotka_volterra,lorenz")
    parser.add_argument("--num-ts", default="11,101,1001")
    parser.add_argument("--n", default="1,1024")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--gradient",
        action="store_true",
        help="time the gradient of sum(ys**2) with respect to the parameters "
        "(gradsolve's one-call gradient against Diffrax's default adjoint)",
    )
    args = parser.parse_args(argv)
    print(
        "| problem | save times | N | gradsolve first s | gradsolve run ms "
        "| Diffrax first s | Diffrax run ms | run speed-up | largest difference |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.problems.split(","):
        for num_ts in map(int, args.num_ts.split(",")):
            for n in map(int, args.n.split(",")):
                r = row(PROBLEMS[name], num_ts, n, args.repeats, args.gradient)
                ours, theirs = r["gradsolve"], r["diffrax"]
                print(
                    f"| {name} | {num_ts} | {n} | {ours['first_s']:.2f} "
                    f"| {ours['run_ms']:.2f} | {theirs['first_s']:.2f} "
                    f"| {theirs['run_ms']:.2f} "
                    f"| {theirs['run_ms'] / ours['run_ms']:.1f}x "
                    f"| {r['max_difference']:.0e} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
