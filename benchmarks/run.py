"""gradsolve benchmark: forward solves and ensemble gradients against Diffrax, torchode
and SciPy, at matched accuracy, timed side by side in one process.

    python benchmarks/run.py --quick     # Lorenz, Lotka-Volterra; N = 64, 1024
    python benchmarks/run.py             # all problems, N = 1 ... 65536
    python benchmarks/run.py --sweep     # work-precision plots (Lorenz, N = 1024)

See benchmarks/README.md for what is measured and what each column means. Results
(JSON of every raw number, and a markdown table) go to --out (benchmarks/results).
"""

import argparse
import sys
import time
from pathlib import Path

import jax


jax.config.update("jax_enable_x64", True)  # the reference is always float64

import harness  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import memory  # noqa: E402
import report  # noqa: E402
import sweep  # noqa: E402
import tools  # noqa: E402
from problems import PROBLEMS  # noqa: E402


HERE = Path(__file__).resolve().parent
ALL_TOOLS = ["gradsolve", "diffrax", "torchode", "scipy"]
SWEEP_TOLS = [1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9, 1e-10]


def _csv(kind):
    return lambda text: [kind(x) for x in text.replace(" ", "").split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 2)[2],
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="Lorenz and Lotka-Volterra, N = 64 and 1024, float64, 3 "
        "repeats, SciPy on 32 trajectories, memory at N = 1024",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="work-precision sweep over --tols on the first of --problems "
        "and the first of --sizes (default lorenz, 1024)",
    )
    p.add_argument(
        "--sizes",
        type=_csv(int),
        default=None,
        help="ensemble sizes, comma-separated (default "
        "1,64,1024,16384,65536; quick: 64,1024)",
    )
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p.add_argument(
        "--problems",
        type=_csv(str),
        default=None,
        help=f"comma-separated, from {', '.join(PROBLEMS)} (default all; "
        "quick: lorenz,lotka_volterra)",
    )
    p.add_argument(
        "--tools",
        type=_csv(str),
        default=ALL_TOOLS,
        help="comma-separated subset of " + ",".join(ALL_TOOLS),
    )
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed rounds after warm-up (default 5; quick 3)",
    )
    p.add_argument(
        "--tol",
        type=float,
        default=None,
        help="rtol = atol for every problem (default: per problem, see README)",
    )
    p.add_argument(
        "--tols", type=_csv(float), default=SWEEP_TOLS, help="tolerances of --sweep"
    )
    p.add_argument(
        "--scipy-cap",
        type=int,
        default=None,
        help="SciPy solves at most this many trajectories and scales the "
        "time (default 256; quick 32)",
    )
    p.add_argument(
        "--torchode-max-n",
        type=int,
        default=16384,
        help="skip torchode above this ensemble size (its backprop graph "
        "grows with N x steps; default 16384)",
    )
    p.add_argument(
        "--memory-size",
        type=int,
        default=None,
        help="N for the peak-memory comparison, 0 to skip (default 16384; "
        "quick: the largest of --sizes)",
    )
    p.add_argument("--memory-problem", default="lorenz")
    a = p.parse_args(argv)
    if a.sweep and a.sizes is None:
        a.sizes = [1024]
    a.sizes = a.sizes or ([64, 1024] if a.quick else [1, 64, 1024, 16384, 65536])
    a.problems = a.problems or (
        ["lorenz", "lotka_volterra"] if a.quick else list(PROBLEMS)
    )
    a.repeats = a.repeats or (3 if a.quick else 5)
    a.scipy_cap = a.scipy_cap or (32 if a.quick else 256)
    if a.memory_size is None:
        a.memory_size = max(a.sizes) if a.quick else 16384
    for name in a.problems:
        if name not in PROBLEMS:
            p.error(f"unknown problem {name!r}; choose from {', '.join(PROBLEMS)}")
    for name in a.tools:
        if name not in ALL_TOOLS:
            p.error(f"unknown tool {name!r}; choose from {', '.join(ALL_TOOLS)}")
    return a


def tolerance(problem, dtype, override):
    """rtol = atol used for `problem`: --tol, else the problem's default for dtype."""
    if override is not None:
        return override
    return problem.tol64 if dtype == jnp.float64 else problem.tol32


def available_tools(requested, log) -> tuple[list[str], dict]:
    """The requested tools that can run here, and why the others are skipped."""
    skipped = {}
    if "torchode" in requested:
        ok, reason = tools.torchode_status()
        if not ok:
            skipped["torchode"] = reason
            log(
                f"SKIPPING torchode: {reason} (install: pip install torch==2.13.0 "
                "torchode)"
            )
    return [t for t in requested if t not in skipped], skipped


def settings_lines(args, tols) -> list[str]:
    lines = [
        f"- {name}: {PROBLEMS[name].description}; rtol = atol = {tol:g}"
        for name, tol in tols.items()
    ]
    return lines + [
        f"- sizes {args.sizes}, {args.dtype}, {args.repeats} timed rounds "
        "after warm-up (1 call, 2 for torchode); times are min / median "
        f"of the rounds; SciPy on at most {args.scipy_cap} trajectories, "
        f"time scaled to N; torchode skipped above N = "
        f"{args.torchode_max_n}"
    ]


def main(argv=None):
    args = parse_args(argv)
    dtype = jnp.float64 if args.dtype == "float64" else jnp.float32
    mode = "sweep" if args.sweep else ("quick" if args.quick else "full")
    log = lambda *s: print(*s, flush=True)  # noqa: E731
    env = report.environment()
    log(f"gradsolve benchmark ({mode}), {time.strftime('%Y-%m-%d %H:%M:%S')}")
    for line in report.environment_lines(env):
        log(line)
    tool_names, skipped = available_tools(args.tools, log)
    start = time.perf_counter()
    data = {
        "mode": mode,
        "argv": sys.argv[1:],
        "environment": env,
        "skipped_tools": skipped,
    }

    if args.sweep:
        problem, n = PROBLEMS[args.problems[0]], args.sizes[0]
        result = sweep.run_sweep(
            problem,
            n,
            dtype,
            sorted(args.tols, reverse=True),
            args.repeats,
            tool_names,
            args.scipy_cap,
            args.out,
            log=log,
        )
        data["sweep"] = result
        data["seconds"] = time.perf_counter() - start
        markdown = "\n".join(
            [
                f"# gradsolve work-precision sweep: {problem.name}, N = {n}, "
                f"{args.dtype}",
                "",
            ]
            + report.environment_lines(env)
            + ["", report.markdown_table(result["cases"]), ""]
            + report.checks_lines(result["cases"])
            + sweep.speedup_lines(result)
            + [
                "",
                "Plots (beside this file): "
                f"{Path(result['plots']['forward']).name}, "
                f"{Path(result['plots']['gradient']).name}",
            ]
        )
        paths = report.write(
            args.out, f"sweep_{problem.name}_{n}_{args.dtype}", data, markdown
        )
        log("\n" + markdown)
        log(f"\nwrote {paths[0]}, {paths[1]} ({data['seconds']:.0f} s)")
        return

    tols = {name: tolerance(PROBLEMS[name], dtype, args.tol) for name in args.problems}
    data["settings"] = {
        "sizes": args.sizes,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "scipy_cap": args.scipy_cap,
        "tolerances": tols,
        "problems": args.problems,
    }
    data["cases"] = []

    def write():
        data["seconds"] = time.perf_counter() - start
        markdown = "\n".join(
            [f"# gradsolve benchmark ({mode})", ""]
            + report.environment_lines(env)
            + [""]
            + settings_lines(args, tols)
            + ["", report.markdown_table(data["cases"]), ""]
            + report.checks_lines(data["cases"])
            + [""]
            + report.memory_lines(data.get("memory"))
        )
        return markdown, report.write(args.out, mode, data, markdown)

    for name in args.problems:
        problem = PROBLEMS[name]
        for n in args.sizes:
            names = [
                t
                for t in tool_names
                if not (t == "torchode" and n > args.torchode_max_n)
            ]
            if len(names) < len(tool_names):
                log(f"(torchode skipped at N = {n} > --torchode-max-n)")
            data["cases"].append(
                harness.run_case(
                    problem,
                    n,
                    dtype,
                    tols[name],
                    args.repeats,
                    names,
                    args.scipy_cap,
                    log=log,
                )
            )
            write()  # keep what we have if a later case fails

    if args.memory_size:
        log(
            f"\n== peak memory of one gradient: {args.memory_problem}, "
            f"N = {args.memory_size}, {args.dtype}"
        )
        data["memory"] = memory.measure(
            args.memory_problem, args.memory_size, args.dtype, args.tol, log=log
        )
    markdown, paths = write()
    log("\n" + markdown)
    log(f"\nwrote {paths[0]}, {paths[1]} ({data['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
