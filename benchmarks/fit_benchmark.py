"""`gs.fit` against the same Optimistix fit with Diffrax gradients, side by side.

    python benchmarks/fit_benchmark.py              # Lotka-Volterra, 64 experiments
    python benchmarks/fit_benchmark.py --n 16 --repeats 3

The problem is that of `examples/fit_lotka_volterra.py`: 64 experiments, 20 times,
5% noise, four shared parameters, Levenberg-Marquardt at rtol = atol = 1e-8,
Tsit5 at rtol = atol = 1e-8. Both fits assemble the Jacobian from the same
per-trajectory blocks (`examples/diffrax_fit.py`); they differ only in how the ODE
is solved and differentiated: gs.fit replays recorded meshes, the reference solves
adaptively with `diffrax.diffeqsolve` (vmapped, compiled once) at every iteration.
For each `jac` mode, the first call of each fit (compilation included) is timed
alone, then the two fits run alternately `--repeats` times; the table reports the
minimum and median of those runs and the compile time (first call minus median).
Writes `benchmarks/results/fit_benchmark.json` and prints a markdown table.
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

import fit_lotka_volterra as lv  # noqa: E402
import numpy as np  # noqa: E402
import optimistix as optx  # noqa: E402


def _gs(y0s, ts, data, jac):
    start = time.perf_counter()
    fit = lv.fit_gradsolve(y0s, ts, data, jac)  # returns host values: synchronised
    seconds = time.perf_counter() - start
    ok = fit.result == optx.RESULTS.successful
    return np.asarray(fit.params), bool(ok), fit.stats["iterations"], seconds


def _diffrax(y0s, ts, data, jac):
    params, result, iterations, seconds = lv.fit_diffrax(y0s, ts, data, jac)
    ok = result == optx.RESULTS.successful
    return np.asarray(params), bool(ok), iterations, seconds


def run(n: int, repeats: int, jacs) -> dict:
    y0s, ts, data = lv.make_data(n)
    rows = {}
    for jac in jacs:
        first = {"gradsolve": _gs(y0s, ts, data, jac)}
        first["diffrax"] = _diffrax(y0s, ts, data, jac)
        times = {"gradsolve": [], "diffrax": []}
        for _ in range(repeats):  # interleaved: both see the same machine load
            for name, f in (("gradsolve", _gs), ("diffrax", _diffrax)):
                params, ok, iterations, seconds = f(y0s, ts, data, jac)
                times[name].append(seconds)
        row = {}
        for name in ("gradsolve", "diffrax"):
            params, ok, iterations, first_seconds = first[name]
            median = statistics.median(times[name])
            row[name] = dict(
                params=params.tolist(),
                success=ok,
                iterations=iterations,
                min_s=min(times[name]),
                median_s=median,
                compile_s=first_seconds - median,
                times_s=times[name],
            )
        gap = np.max(
            np.abs(first["gradsolve"][0] - first["diffrax"][0])
            / np.abs(first["diffrax"][0])
        )
        row["relative_parameter_gap"] = float(gap)
        row["speedup_min"] = row["diffrax"]["min_s"] / row["gradsolve"]["min_s"]
        row["speedup_median"] = (
            row["diffrax"]["median_s"] / row["gradsolve"]["median_s"]
        )
        rows[jac] = row
    return dict(
        problem="Lotka-Volterra",
        experiments=n,
        times=int(ts.shape[0]),
        repeats=repeats,
        machine=f"{platform.machine()}, {jax.devices()[0].device_kind}",
        jax=jax.__version__,
        results=rows,
    )


def table(out: dict) -> str:
    lines = [
        f"Lotka-Volterra, {out['experiments']} experiments x {out['times']} times, "
        f"{out['repeats']} interleaved repeats (ms; compile in s)",
        "",
        "| jac | gs.fit min | gs.fit median | Diffrax min | Diffrax median "
        "| speed-up (min / median) | iterations gs / Diffrax | compile gs / Diffrax "
        "| parameter gap |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for jac, r in out["results"].items():
        g, d = r["gradsolve"], r["diffrax"]
        lines.append(
            f"| {jac} | {1e3 * g['min_s']:.0f} | {1e3 * g['median_s']:.0f} "
            f"| {1e3 * d['min_s']:.0f} | {1e3 * d['median_s']:.0f} "
            f"| {r['speedup_min']:.1f}x / {r['speedup_median']:.1f}x "
            f"| {g['iterations']} / {d['iterations']} "
            f"| {g['compile_s']:.1f} / {d['compile_s']:.1f} "
            f"| {r['relative_parameter_gap']:.0e} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64, help="number of experiments")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--jac", choices=["fwd", "bwd", "both"], default="both")
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / "fit_benchmark.json")
    )
    args = parser.parse_args()
    jacs = ("fwd", "bwd") if args.jac == "both" else (args.jac,)
    out = run(args.n, args.repeats, jacs)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    print(table(out))
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
