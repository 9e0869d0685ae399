"""`gs.fit` against the same Optimistix fit with Diffrax gradients, side by side.

    python benchmarks/fit_benchmark.py              # Lotka-Volterra, 64 experiments
    python benchmarks/fit_benchmark.py --problems fitzhugh_nagumo,robertson  # 32, 4
    python benchmarks/fit_benchmark.py --n 16 --repeats 3

The problems are in `fit_problems.py`: Lotka-Volterra (`examples/fit_lotka_volterra.py`:
20 times, 5% noise, four shared parameters), FitzHugh-Nagumo observing the voltage
only, and Robertson's stiff kinetics (`examples/fit_robertson.py`, `gs.Rodas5`
against Diffrax's `Kvaerno5`); all with Levenberg-Marquardt at rtol = atol = 1e-8,
float64. Both fits assemble the Jacobian from the same per-trajectory blocks
(`examples/diffrax_fit.py`); they differ only in how the ODE is solved and
differentiated: gs.fit replays recorded meshes, the reference solves adaptively
with `diffrax.diffeqsolve` (vmapped, compiled once) at every iteration. `jac` goes
to both: the reference hands it to Optimistix (`"bwd"` materialises the Jacobian by
one cotangent per residual), gs.fit materialises the assembled Jacobian in the
direction with fewer passes whatever it says (see `gs.fit`). gs.fit runs
both ways with its meshes: `meshes="reused"` (rounds of optimiser runs over recorded
meshes) and `meshes="per_evaluation"` (one program, a mesh recorded at every
evaluation). For each problem and `jac` mode, the first call of each fit
(compilation included) is timed alone, then the fits run alternately `--repeats`
times; the table reports the minimum and median of those runs and the first call.
With `--first-runs K` (default 3) each fit's first call is also timed in `K` fresh
Python processes per fit, alternated between the fits: a single first call on a
busy machine moves by a second or more, and in one process the fit timed second
would find JAX and the shared programs (the data's) already warm. The table then
gives the median of those fresh first calls (min in the JSON).
Writes `benchmarks/results/fit_benchmark.json` and prints a markdown table per
problem.
"""

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time

import jax


jax.config.update("jax_enable_x64", True)

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import numpy as np  # noqa: E402
import optimistix as optx  # noqa: E402
from first_call import run_child  # noqa: E402
from fit_problems import CASES  # noqa: E402


def _gs(case, y0s, ts, data, jac, meshes):
    start = time.perf_counter()
    fit = case.gradsolve(y0s, ts, data, jac, meshes)  # host values: synchronised
    seconds = time.perf_counter() - start
    ok = fit.result == optx.RESULTS.successful
    return np.asarray(fit.params), bool(ok), fit.stats["iterations"], seconds


def _diffrax(case, y0s, ts, data, jac):
    params, result, iterations, seconds = case.diffrax(y0s, ts, data, jac)
    ok = result == optx.RESULTS.successful
    return np.asarray(params), bool(ok), iterations, seconds


# gs.fit's two ways with its meshes (the `meshes` argument), and the reference.
GRADSOLVE = {"gradsolve": "reused", "gradsolve per evaluation": "per_evaluation"}
FITS = {
    "gradsolve": lambda *a: _gs(*a, meshes="reused"),
    "gradsolve per evaluation": lambda *a: _gs(*a, meshes="per_evaluation"),
    "diffrax": _diffrax,
}


# One first call in a fresh process: the data made (and its programs compiled)
# before the clock starts, as in `run`.
FIRST_CALL = """
import json, sys, time
import jax
jax.config.update("jax_enable_x64", True)
sys.path.insert(0, {benchmarks!r})
from fit_problems import CASES
case = CASES[{problem!r}]
y0s, ts, data = case.make_data({n})
jax.block_until_ready((y0s, ts, data))
start = time.perf_counter()
if {meshes!r} is None:
    jax.block_until_ready(case.diffrax(y0s, ts, data, {jac!r})[0])
else:
    jax.block_until_ready(case.gradsolve(y0s, ts, data, {jac!r}, {meshes!r}).params)
print(json.dumps(time.perf_counter() - start))
"""


def fresh_first_calls(case, n: int, jac: str, names, runs: int) -> dict:
    """`{name: [seconds, ...]}`: each fit's first call in `runs` fresh processes,
    the fits alternated."""
    benchmarks = str(pathlib.Path(__file__).resolve().parent)
    out = {name: [] for name in names}
    for _ in range(runs):
        for name in names:
            code = FIRST_CALL.format(
                benchmarks=benchmarks, problem=case.name, n=n, jac=jac,
                meshes=GRADSOLVE.get(name),
            )  # fmt: skip
            out[name].append(run_child(code))
    return out


def run(case, n: int, repeats: int, jacs, first_runs: int = 0) -> dict:
    y0s, ts, data = case.make_data(n)
    fits = {
        name: fit
        for name, fit in FITS.items()
        if name == "diffrax" or GRADSOLVE[name] in case.meshes
    }
    rows = {}
    for jac in jacs:
        first = {name: fit(case, y0s, ts, data, jac) for name, fit in fits.items()}
        times = {name: [] for name in fits}
        for _ in range(repeats):  # interleaved: all see the same machine load
            for name, f in fits.items():
                params, ok, iterations, seconds = f(case, y0s, ts, data, jac)
                times[name].append(seconds)
        row = {}
        for name in fits:
            params, ok, iterations, first_seconds = first[name]
            median = statistics.median(times[name])
            row[name] = dict(
                params=params.tolist(),
                success=ok,
                iterations=iterations,
                min_s=min(times[name]),
                median_s=median,
                compile_s=first_seconds - median,
                first_s=first_seconds,
                times_s=times[name],
            )
        if first_runs:
            fresh = fresh_first_calls(case, n, jac, list(fits), first_runs)
            for name, seconds in fresh.items():
                row[name]["first_fresh_s"] = seconds
                row[name]["first_fresh_min_s"] = min(seconds)
                row[name]["first_fresh_median_s"] = statistics.median(seconds)
        reference = first["diffrax"][0]
        for name in set(GRADSOLVE) & set(fits):
            gap = np.max(np.abs(first[name][0] - reference) / np.abs(reference))
            row[name]["relative_parameter_gap"] = float(gap)
            row[name]["speedup_min"] = row["diffrax"]["min_s"] / row[name]["min_s"]
            row[name]["speedup_median"] = (
                row["diffrax"]["median_s"] / row[name]["median_s"]
            )
        rows[jac] = row
    return dict(
        problem=case.name,
        experiments=n,
        times=int(ts.shape[0]),
        repeats=repeats,
        machine=f"{platform.machine()}, {jax.devices()[0].device_kind}",
        jax=jax.__version__,
        results=rows,
    )


def _first_call_note(out: dict) -> str:
    rows = [r for jac in out["results"].values() for r in jac.values()]
    runs = {len(r["first_fresh_s"]) for r in rows if "first_fresh_s" in r}
    if not runs:
        return "; first calls in this process"
    return f"; first calls: median of {max(runs)} fresh processes per fit"


def table(out: dict) -> str:
    lines = [
        f"{out['problem']}, {out['experiments']} experiments x {out['times']} times, "
        f"{out['repeats']} interleaved repeats (ms; compile in s)"
        + _first_call_note(out),
        "",
        "| jac | meshes | gs.fit min | gs.fit median | Diffrax min | Diffrax median "
        "| speed-up (min / median) | iterations gs / Diffrax | first call s, gs / "
        "Diffrax | parameter gap |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for jac, r in out["results"].items():
        d = r["diffrax"]
        for name in [name for name in GRADSOLVE if name in r]:
            g = r[name]
            first_g, first_d = g["first_s"], d["first_s"]
            if "first_fresh_median_s" in g:
                first_g, first_d = g["first_fresh_median_s"], d["first_fresh_median_s"]
            lines.append(
                f"| {jac} | {GRADSOLVE[name]} | {1e3 * g['min_s']:.0f} "
                f"| {1e3 * g['median_s']:.0f} "
                f"| {1e3 * d['min_s']:.0f} | {1e3 * d['median_s']:.0f} "
                f"| {g['speedup_min']:.1f}x / {g['speedup_median']:.1f}x "
                f"| {g['iterations']} / {d['iterations']} "
                f"| {first_g:.1f} / {first_d:.1f} "
                f"| {g['relative_parameter_gap']:.0e} |"
            )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--problems",
        default="lotka_volterra",
        help=f"comma-separated, of {', '.join(CASES)}",
    )
    parser.add_argument(
        "--n",
        type=int,
        default=None,
        help="number of experiments (default: each problem's, 64, 32 and 4)",
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--first-runs",
        type=int,
        default=3,
        help="fresh processes per fit for its first call (0: the in-process one)",
    )
    parser.add_argument("--jac", choices=["fwd", "bwd", "both"], default="both")
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / "fit_benchmark.json")
    )
    args = parser.parse_args()
    jacs = ("fwd", "bwd") if args.jac == "both" else (args.jac,)
    outs = []
    for name in args.problems.split(","):
        n = CASES[name].experiments if args.n is None else args.n
        outs.append(run(CASES[name], n, args.repeats, jacs, args.first_runs))
        print(table(outs[-1]) + "\n", flush=True)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(outs, indent=1))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
