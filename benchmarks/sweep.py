"""Work-precision sweep: every tool over a range of tolerances on one problem/size.

For each tolerance the tools are timed as in the main benchmark (`harness.run_case`),
and two errors are measured against one tight reference (Diffrax Dopri8 at
rtol = atol = 1e-13, float64): the final states' and the gradient's (max relative).
Two PNG plots show time against error, one line per tool, for the forward solve and
for the gradient; the speed-ups at equal error are read off by interpolating
log(time) against log(error) on each curve.
"""

import math
from pathlib import Path

import harness
import numpy as np
from problems import Problem


FORWARD_CURVES = {  # label -> (tool, operation)
    "gradsolve diffeqsolve": ("gradsolve", "forward"),
    "gradsolve record": ("gradsolve", "record"),
    "Diffrax": ("diffrax", "forward"),
    "torchode": ("torchode", "forward"),
    "SciPy RK45 (scaled)": ("scipy", "forward"),
}
GRADIENT_CURVES = {
    "gradsolve gradient (existing mesh)": ("gradsolve", "gradient"),
    "gradsolve record + gradient": ("gradsolve", "record+gradient"),
    "gradsolve one-call gradient": ("gradsolve", "solve_gradient"),
    "Diffrax": ("diffrax", "gradient"),
    "torchode": ("torchode", "gradient"),
}


def curves(cases: list[dict], spec: dict, error_key: str) -> dict:
    """`{label: [(error, time_s, tol), ...]}` from the sweep's cases."""
    out = {}
    for label, (tool, op) in spec.items():
        points = []
        for case in cases:
            entry = case["tools"].get(tool, {})
            t = entry.get("ops", {}).get(op, {})
            err = entry.get(error_key)
            if "min_s" in t and err is not None and err > 0:
                points.append((err, t["min_s"], case["rtol"]))
        if points:
            out[label] = sorted(points)
    return out


def _log_time_at(points, error):
    """Interpolated log(time) at `error` on a curve (points sorted by error)."""
    xs = np.log([p[0] for p in points])
    ys = np.log([p[1] for p in points])
    return float(np.interp(math.log(error), xs, ys))


def equal_error_speedups(curve_set: dict, baseline: str = "Diffrax") -> list[dict]:
    """Speed-up of each curve over `baseline` at equal error.

    At every power of ten inside the error range both curves cover (or at the
    geometric middle of that range when it holds no power of ten), both times are
    interpolated linearly in log-log; speed-up = baseline time / tool time.
    """
    if baseline not in curve_set:
        return []
    base = curve_set[baseline]
    rows = []
    for label, points in curve_set.items():
        if label == baseline:
            continue
        lo = max(points[0][0], base[0][0])
        hi = min(points[-1][0], base[-1][0])
        if lo > hi:
            rows.append({"tool": label, "note": "no common error range"})
            continue
        levels = [
            10.0**k
            for k in range(math.ceil(math.log10(lo)), math.floor(math.log10(hi)) + 1)
        ]
        levels = levels or [math.sqrt(lo * hi)]
        for e in levels:
            t_base = math.exp(_log_time_at(base, e))
            t_tool = math.exp(_log_time_at(points, e))
            rows.append(
                {
                    "tool": label,
                    "error": e,
                    "baseline_ms": 1e3 * t_base,
                    "tool_ms": 1e3 * t_tool,
                    "speedup": t_base / t_tool,
                }
            )
    return rows


def plot(curve_set: dict, title: str, xlabel: str, path: Path):
    """One log-log work-precision plot, one line per tool."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for label, points in curve_set.items():
        ax.loglog(
            [p[0] for p in points], [1e3 * p[1] for p in points], "o-", label=label
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("time (ms, minimum of repeats)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_sweep(
    problem: Problem,
    n: int,
    dtype,
    tols: list[float],
    repeats: int,
    tool_names: list[str],
    scipy_cap: int,
    out_dir: Path,
    log=print,
) -> dict:
    """Run the sweep, write the two PNGs, return the raw numbers and speed-ups."""
    dtype_name = np.dtype(dtype).name
    log(
        f"\nWork-precision sweep: {problem.name}, N = {n}, {dtype_name}, "
        f"tolerances {', '.join(f'{t:g}' for t in tols)}"
    )
    ref = harness.compute_reference(problem, n, dtype, with_gradient=True, log=log)
    cases = [
        harness.run_case(
            problem, n, dtype, tol, repeats, tool_names, scipy_cap, ref=ref, log=log
        )
        for tol in tols
    ]
    fwd = curves(cases, FORWARD_CURVES, "error")
    grad = curves(cases, GRADIENT_CURVES, "gradient_error")
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"sweep_{problem.name}_{n}_{dtype_name}"
    title = (
        f"{problem.name}, N = {n}, {dtype_name}, rtol = atol in "
        f"[{min(tols):g}, {max(tols):g}]"
    )
    paths = {
        "forward": out_dir / f"{stem}_forward.png",
        "gradient": out_dir / f"{stem}_gradient.png",
    }
    plot(
        fwd,
        f"Forward solve: {title}",
        "max relative error of the final states (vs Dopri8 at 1e-13)",
        paths["forward"],
    )
    plot(
        grad,
        f"Gradient: {title}",
        "max relative error of the gradient (vs Dopri8 at 1e-13)",
        paths["gradient"],
    )
    result = {
        "problem": problem.name,
        "n": n,
        "dtype": dtype_name,
        "tols": tols,
        "cases": cases,
        "curves": {"forward": fwd, "gradient": grad},
        "speedups": {
            "forward": equal_error_speedups(fwd),
            "gradient": equal_error_speedups(grad),
        },
        "plots": {k: str(p) for k, p in paths.items()},
    }
    for line in speedup_lines(result):
        log(line)
    return result


def speedup_lines(result: dict) -> list[str]:
    """The equal-error speed-ups as markdown lines."""
    lines = []
    for kind in ("forward", "gradient"):
        lines += [
            "",
            f"Speed-up over Diffrax at equal {kind} error (log-log interpolation):",
            "",
            "| tool | error | Diffrax ms | tool ms | speed-up |",
            "|---|---|---|---|---|",
        ]
        for r in result["speedups"][kind]:
            if "note" in r:
                lines.append(f"| {r['tool']} | {r['note']} | | | |")
            else:
                lines.append(
                    f"| {r['tool']} | {r['error']:.0e} | "
                    f"{r['baseline_ms']:.3g} | {r['tool_ms']:.3g} | "
                    f"{r['speedup']:.2f}x |"
                )
    return lines
