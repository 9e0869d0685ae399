"""Compile time of every gradsolve path, next to Diffrax's equivalent, in one process.

    python benchmarks/compile_times.py                   # every row, N = 64, float64
    python benchmarks/compile_times.py --rows lorenz,mlp8 --repeats 5

For each problem, each path is a fresh compiled function, called once (compiling)
and then `--repeats` times; its compile time is the first call minus the fastest
later call. With `--compiles K` each path's first call is made `K` times, JAX's
caches cleared before each, and the row takes the fastest (every one is in the
JSON): on a busy machine a single compilation moves by a second or more. Every
path of both libraries first runs once on a small problem of its own, so that no
row carries the process's one-time start-up costs. The paths:

- gradsolve: `record` (`gs.record_ensemble`), `replay` (forward, `jax.jit` of
  `gs.replay` over the recorded mesh), `replay gradient` (`jax.jit(jax.grad(...))`
  of it) and `one-call gradient` (`jax.grad` through `gs.diffeqsolve`, vmapped);
- Diffrax's equivalents: the forward solve (`jax.jit(jax.vmap(diffrax.diffeqsolve))`,
  against `record` and `replay`) and its gradient (default adjoint, against both
  gradients).

Problems (N trajectories, float64): Lorenz and Lotka-Volterra (per-trajectory
parameters, rtol = atol = 1e-8), the 4-w-w-4 MLP neural ODE of
`benchmarks/problems.py` for widths 8, 32 and 64 (shared weights, 1e-6), Robertson
with `gs.Rodas5()` against `diffrax.Kvaerno5()` (t1 = 100, rtol = 1e-6,
atol = 1e-10), and the Lotka-Volterra fit of `benchmarks/fit_benchmark.py`
(`gs.fit` against the same Optimistix fit on Diffrax, `jac="fwd"`, 16 experiments).
Writes `benchmarks/results/compile_times.json` and prints a markdown table.
"""

import argparse
import gc
import json
import pathlib
import platform
import sys
import time

import diffrax
import jax
import jax.numpy as jnp
import numpy as np


jax.config.update("jax_enable_x64", True)

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

import problems  # noqa: E402

import gradsolve as gs  # noqa: E402


ROWS = ("lorenz", "lotka_volterra", "mlp8", "mlp32", "mlp64", "robertson", "fit")


# Seconds JAX reports spending, by event: tracing to a jaxpr and XLA's compilation.
_DURATIONS = {"trace": 0.0, "xla": 0.0}
_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/backend_compile_duration": "xla",
}


def _on_duration(event: str, seconds: float, **_) -> None:
    if event in _EVENTS:
        _DURATIONS[_EVENTS[event]] += seconds


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def _first_call(fn):
    """`(fn(), {"s": seconds it took, "trace": ..., "xla": ...})`: the seconds JAX
    spent tracing and XLA compiling during the call."""
    # Collected now, so that a collection of the process's garbage is not timed
    # as part of one row's tracing (it moved single rows by ~0.3 s).
    gc.collect()
    before = dict(_DURATIONS)
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    took = {"s": time.perf_counter() - start}
    took.update({k: _DURATIONS[k] - before[k] for k in before})
    return out, took


def compile_time(
    fn, repeats: int, first: dict | None = None, compiles: int = 1
) -> dict:
    """`{"compile", "steady", "trace", "xla", "compiles"}` of `fn()`: its first call
    (timed here, or `first` from `_first_call` if it was made already) minus the
    fastest of `repeats` later calls, that fastest call, and the seconds of the
    first call that JAX reports tracing and XLA compiling. With `compiles > 1` the
    first call is made again after `jax.clear_caches()` (a fresh trace and
    compilation each time) and the row is the fastest of them; `"compiles"` lists
    every one."""
    firsts = [_first_call(fn)[1] if first is None else first]
    for _ in range(compiles - 1):
        jax.clear_caches()
        firsts.append(_first_call(fn)[1])
    steady = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        steady.append(time.perf_counter() - start)
    seconds = [max(f["s"] - min(steady), 0.0) for f in firsts]
    best = min(range(len(firsts)), key=seconds.__getitem__)
    return dict(
        compile=seconds[best],
        steady=min(steady),
        trace=firsts[best]["trace"],
        xla=firsts[best]["xla"],
        compiles=seconds,
    )


def _mlp_problem(width: int) -> problems.Problem:
    def inputs(n, rng):
        wrng = np.random.default_rng(1234)
        dim = problems.NODE_DIM
        sizes = [(width, dim), (width, width), (dim, width)]
        args = {}
        for i, (fan_out, fan_in) in enumerate(sizes, start=1):
            scale = 1.0 / np.sqrt(fan_in)
            args[f"W{i}"] = wrng.normal(0.0, scale, size=(fan_out, fan_in))
            args[f"b{i}"] = wrng.normal(0.0, 0.1, size=(fan_out,))
        return rng.normal(0.0, 1.0, size=(n, dim)), args

    base = problems.PROBLEMS["neural_ode"]
    return problems.Problem(
        **{**base.__dict__, "name": f"mlp{width}", "make_inputs": inputs}
    )


def _robertson(t, y, k):
    return jnp.stack(
        [
            -k[0] * y[0] + k[2] * y[1] * y[2],
            k[0] * y[0] - k[1] * y[1] ** 2 - k[2] * y[1] * y[2],
            k[1] * y[1] ** 2,
        ]
    )


def _setup(row: str, n: int):
    """`(f, y0s, args, args_axes, t1, rtol, atol, gs solver, diffrax solver)`."""
    if row == "robertson":
        rng = np.random.default_rng(0)
        k = np.array([0.04, 3e7, 1e4]) * 2.0 ** rng.uniform(-1, 1, size=(n, 3))
        y0s = np.tile([1.0, 0.0, 0.0], (n, 1))
        return (_robertson, y0s, k, 0, 100.0, 1e-6, 1e-10, gs.Rodas5(),
                diffrax.Kvaerno5())  # fmt: skip
    if row.startswith("mlp"):
        problem = _mlp_problem(int(row.removeprefix("mlp")))
    else:
        problem = problems.PROBLEMS[row]
    y0s, args = problems.make_inputs(problem, n)
    tol = problem.tol64
    return (problem.jax_vf, y0s, args, problem.args_axes, problem.t1, tol, tol,
            gs.Tsit5(), diffrax.Tsit5())  # fmt: skip


def solve_rows(row: str, n: int, repeats: int, compiles: int = 1) -> list[dict]:
    f, y0s, args, ax, t1, rtol, atol, solver, d_solver = _setup(row, n)
    y0s, args = jnp.asarray(y0s), jax.tree_util.tree_map(jnp.asarray, args)
    term = gs.ODETerm(f)
    ctrl = gs.PIDController(rtol=rtol, atol=atol)
    kw = dict(stepsize_controller=ctrl, max_steps=4096)

    def loss_of(ys):
        return jnp.sum(ys**2)

    def one(solve, solver):
        def final(y0, a):
            return solve(term, solver, 0.0, t1, None, y0, a, **kw).ys[-1]

        return jax.vmap(final, in_axes=(0, ax))

    record = lambda: gs.record_ensemble(
        term, solver, 0.0, t1, None, y0s, args, args_axes=ax, **kw
    )
    # The first recording compiles: its time is the record row's first call.
    mesh, record_first = _first_call(record)

    def replay(args, mesh):
        return gs.replay(mesh, term, solver, y0s, args, args_axes=ax).ys

    times = {}
    times["record"] = compile_time(
        record, repeats, first=record_first, compiles=compiles
    )
    replay_fwd = jax.jit(replay)
    times["replay"] = compile_time(
        lambda: replay_fwd(args, mesh), repeats, compiles=compiles
    )
    replay_grad = jax.jit(jax.grad(lambda a, m: loss_of(replay(a, m))))
    times["replay gradient"] = compile_time(
        lambda: replay_grad(args, mesh), repeats, compiles=compiles
    )
    ours = one(gs.diffeqsolve, solver)
    one_call = jax.jit(jax.grad(lambda a: loss_of(ours(y0s, a))))
    times["one-call gradient"] = compile_time(
        lambda: one_call(args), repeats, compiles=compiles
    )

    theirs = one(diffrax.diffeqsolve, d_solver)
    d_forward = jax.jit(lambda a: theirs(y0s, a))
    d_times = {
        "forward": compile_time(lambda: d_forward(args), repeats, compiles=compiles)
    }
    d_grad = jax.jit(jax.grad(lambda a: loss_of(theirs(y0s, a))))
    d_times["gradient"] = compile_time(lambda: d_grad(args), repeats, compiles=compiles)

    against = {"record": "forward", "replay": "forward"}
    rows = []
    for path, ours in times.items():
        peer = against.get(path, "gradient")
        theirs = {f"diffrax_{k}": v for k, v in d_times[peer].items()}
        rows.append(dict(problem=row, path=path, **ours, diffrax_path=peer, **theirs))
    return rows


def fit_rows(n: int) -> list[dict]:
    import fit_benchmark
    from fit_problems import CASES

    case = CASES["lotka_volterra"]
    y0s, ts, data = case.make_data(n)
    fits = {
        "gs": lambda: fit_benchmark._gs(case, y0s, ts, data, "fwd", meshes="auto"),
        "diffrax": lambda: fit_benchmark._diffrax(case, y0s, ts, data, "fwd"),
    }
    times = {}
    for name, fit in fits.items():
        result, first = _first_call(fit)
        first["s"] = result[3]  # the fit's own time, without its host checks
        steadies = [fit()[3] for _ in range(2)]
        times[name] = dict(
            compile=first["s"] - min(steadies),
            steady=min(steadies),
            trace=first["trace"],
            xla=first["xla"],
        )
    theirs = {f"diffrax_{k}": v for k, v in times["diffrax"].items()}
    return [dict(problem="fit", path="gs.fit", **times["gs"],
                 diffrax_path="optx fit", **theirs)]  # fmt: skip


def warm_up() -> None:
    """Run every path of both libraries once on a small problem of its own (a
    vector field no row uses), so that the first row does not carry the one-time
    costs of the process (JAX's backend and the libraries' first traces)."""
    term = gs.ODETerm(lambda t, y, k: -k * y)
    y0s, ks = jnp.ones((2, 2)), jnp.array([1.0, 2.0])
    kw = dict(stepsize_controller=gs.PIDController(rtol=1e-6, atol=1e-6))

    def loss(solve, solver, k):
        final = lambda y0, k: solve(term, solver, 0.0, 1.0, None, y0, k, **kw).ys
        return jnp.sum(jax.vmap(final)(y0s, k) ** 2)

    mesh = gs.record_ensemble(term, gs.Tsit5(), 0.0, 1.0, None, y0s, ks, **kw)
    replay = lambda k: jnp.sum(gs.replay(mesh, term, gs.Tsit5(), y0s, k).ys ** 2)
    for fn in (
        replay,
        jax.grad(replay),
        jax.grad(lambda k: loss(gs.diffeqsolve, gs.Tsit5(), k)),
        lambda k: loss(diffrax.diffeqsolve, diffrax.Tsit5(), k),
        jax.grad(lambda k: loss(diffrax.diffeqsolve, diffrax.Tsit5(), k)),
    ):
        jax.block_until_ready(jax.jit(fn)(ks))


def table(rows: list[dict]) -> str:
    lines = [
        "| problem | gradsolve path | compile (s) | trace + XLA (s) | steady (ms) | "
        "Diffrax path | compile (s) | trace + XLA (s) | steady (ms) | compile ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["compile"] / max(r["diffrax_compile"], 1e-9)
        lines.append(
            f"| {r['problem']} | {r['path']} | {r['compile']:.2f} | "
            f"{r['trace']:.2f} + {r['xla']:.2f} | {1e3 * r['steady']:.2f} | "
            f"{r['diffrax_path']} | {r['diffrax_compile']:.2f} | "
            f"{r['diffrax_trace']:.2f} + {r['diffrax_xla']:.2f} | "
            f"{1e3 * r['diffrax_steady']:.2f} | {ratio:.2f} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--fit-n", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--compiles",
        type=int,
        default=1,
        help="first calls per path, caches cleared between; the fastest is the row's",
    )
    parser.add_argument("--out", default=str(HERE / "results" / "compile_times.json"))
    opts = parser.parse_args()
    warm_up()
    rows = []
    for row in opts.rows.split(","):
        if row == "fit":
            new = fit_rows(opts.fit_n)
        else:
            new = solve_rows(row, opts.n, opts.repeats, opts.compiles)
        rows.extend(new)
        print(table(new).split("\n", 2)[2], flush=True)
    out = dict(
        n=opts.n, fit_n=opts.fit_n, repeats=opts.repeats, compiles=opts.compiles,
        rows=rows,
        machine=platform.processor() or platform.machine(),
        jax=jax.__version__, diffrax=diffrax.__version__,
    )  # fmt: skip
    pathlib.Path(opts.out).write_text(json.dumps(out, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
