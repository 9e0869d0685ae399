"""A user's first call, as a script makes it: `diffeqsolve` without `jax.jit`, then
`jax.grad` through it, each library in a fresh process.

    python benchmarks/first_call.py [--problems lotka_volterra,lorenz] [--runs 2]

Each run starts a new Python process per library (so neither shares the other's
compiled programs or JAX's start-up), imports it, and times the first forward
solve (`SaveAt(ts=...)`, PID rtol = atol = 1e-6, float64, one trajectory) and the
first gradient of `sum(ys)` with respect to the parameters. These are the waits of
a first call: tracing, compiling every program the call runs (a library's checks of
its inputs included), and the solve. Prints the minimum over runs per row.
"""

import argparse
import json
import pathlib
import subprocess
import sys


CHILD = """
import json, sys, time
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
sys.path.insert(0, {benchmarks!r})
from problems import PROBLEMS
lib_name, problem_name = {lib!r}, {problem!r}
if lib_name == "gradsolve":
    import gradsolve as lib
else:
    import diffrax as lib
solver = lib.Tsit5()
import diffrax
problem = PROBLEMS[problem_name]
import numpy as np
y0s, all_args = problem.make_inputs(1, np.random.default_rng(0))
y0 = jnp.asarray(y0s[0])
args = jax.tree.map(lambda a: jnp.asarray(a[0] if problem.args_axes == 0 else a),
                    all_args)
ts = jnp.linspace(problem.t0, problem.t1, 11)
ctrl = diffrax.PIDController(rtol=1e-6, atol=1e-6)
term = diffrax.ODETerm(problem.jax_vf)
def solve(a):
    return lib.diffeqsolve(term, solver, problem.t0, problem.t1, None, y0, a,
                           saveat=diffrax.SaveAt(ts=ts), stepsize_controller=ctrl).ys
jnp.zeros(2) + 1  # JAX's own start-up, outside the timings
start = time.perf_counter()
jax.block_until_ready(solve(args))
forward = time.perf_counter() - start
start = time.perf_counter()
jax.block_until_ready(jax.grad(lambda a: jnp.sum(solve(a)))(args))
gradient = time.perf_counter() - start
print(json.dumps(dict(forward=forward, gradient=gradient)))
"""


def run_child(code: str):
    """Run `code` in a fresh Python process and return the JSON value its last line
    of output prints (its error output raised if it fails)."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def first_call(lib: str, problem: str) -> dict:
    benchmarks = str(pathlib.Path(__file__).resolve().parent)
    return run_child(CHILD.format(benchmarks=benchmarks, lib=lib, problem=problem))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default="lotka_volterra,lorenz")
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args(argv)
    print("| problem | call | gradsolve s | Diffrax s | ratio |")
    print("|---|---|---|---|---|")
    for problem in args.problems.split(","):
        best = {}
        for _ in range(args.runs):  # interleaved: the two libraries in turn
            for lib in ("gradsolve", "diffrax"):
                for call, seconds in first_call(lib, problem).items():
                    key = (lib, call)
                    best[key] = min(best.get(key, float("inf")), seconds)
        for call in ("forward", "gradient"):
            ours, theirs = best["gradsolve", call], best["diffrax", call]
            print(
                f"| {problem} | first {call} | {ours:.2f} | {theirs:.2f} | "
                f"{ours / theirs:.2f}x |"
            )


if __name__ == "__main__":
    main()
