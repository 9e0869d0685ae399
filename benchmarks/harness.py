"""Timing and accuracy of all tools on one problem, ensemble size, dtype and tolerance.

Timing protocol (`time_interleaved`): every operation is called first to warm up
(once for JAX, where that call compiles; twice for PyTorch, whose first calls are
slow for a while), then `repeats` rounds each call every operation once,
tools alternating within a round and the order rotated from round to round, so that
slow drifts of the machine (another process, thermal state) hit every tool alike.
Reported: the minimum and the median of the rounds, and the compile time, taken as
the first call minus the steady-state minimum.

Accuracy: every tool's final states are compared with a tight reference (Diffrax
Dopri8 at rtol = atol = 1e-13, float64), and gradsolve's gradient with Diffrax's.
"""

import argparse
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import tools
from problems import Problem, make_inputs


def time_alone(
    fn: Callable, repeats: int, collect_garbage: bool = False
) -> tuple[float, float]:
    """`(min, median)` milliseconds of `fn()`, until its result is ready, over
    `repeats` calls after a compiling one, one task at a time; with
    `collect_garbage`, each call after `gc.collect()`, as `time_interleaved`."""
    jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        if collect_garbage:
            gc.collect()
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(1e3 * (time.perf_counter() - start))
    return min(samples), statistics.median(samples)


def print_case_tables(
    description: str,
    case: Callable,
    argv=None,
    sizes: str = "64",
    repeats: int = 20,
) -> None:
    """The command line of a script that times calls one at a time: for every
    problem and size of `--problems` and `--sizes`, print the rows `(label, min,
    median)` (milliseconds) of `case(name, n, repeats)`. Float64."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--sizes", default=sizes)
    parser.add_argument("--problems", default="lorenz")
    parser.add_argument("--repeats", type=int, default=repeats)
    opts = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    for name in opts.problems.split(","):
        for n in (int(s) for s in opts.sizes.split(",")):
            print(f"\n{name}, N = {n:,} (ms, min / median of {opts.repeats})")
            rows = case(name, n, opts.repeats)
            width = max(len(label) for label, _, _ in rows)
            for label, low, mid in rows:
                print(f"  {label:{width}s} {low:9.3f} / {mid:9.3f}")
            sys.stdout.flush()


def time_gradients(finals: dict[str, Callable], x, repeats: int) -> tuple[dict, dict]:
    """`(times, grads)`: for each `finals[name]`, a function of `x` (parameters),
    the compiled `jax.grad` of `sum(finals[name](x) ** 2)` and its timing by
    `time_interleaved` (in the same order)."""
    grads = {
        name: jax.jit(jax.grad(lambda a, fn=fn: jnp.sum(fn(a) ** 2)))
        for name, fn in finals.items()
    }
    tasks = {k: (lambda g=g: jax.block_until_ready(g(x))) for k, g in grads.items()}
    return time_interleaved(tasks, repeats, log=lambda *_: None), grads


def time_interleaved(
    tasks: dict[str, Callable],
    repeats: int,
    warmups: dict[str, int] | None = None,
    log=print,
) -> dict:
    """Time each zero-argument callable in `tasks`, interleaved (see module doc).

    `warmups[name]` is the number of untimed calls before the rounds (default 1),
    the first of which is timed on its own as `first_s`.

    A task that raises is reported with its error and left out of later rounds.
    Returns `{name: {"first_s", "times_s", "min_s", "median_s", "compile_s"}}` or
    `{name: {"failed": message}}`.
    """
    out, live = {}, []
    for name, fn in tasks.items():
        gc.collect()
        start = time.perf_counter()
        try:
            fn()
        except Exception as e:  # report and go on with the other tools
            out[name] = {"failed": f"{type(e).__name__}: {e}"}
            log(f"    {name}: FAILED ({type(e).__name__}: {str(e)[:200]})")
            log("".join(traceback.format_exception_only(e))[-600:])
            continue
        out[name] = {"first_s": time.perf_counter() - start, "times_s": []}
        for _ in range((warmups or {}).get(name, 1) - 1):
            fn()  # further warm-up calls
        live.append(name)
    for r in range(repeats):
        order = live[r % len(live) :] + live[: r % len(live)] if live else []
        for name in order:
            gc.collect()
            start = time.perf_counter()
            tasks[name]()
            out[name]["times_s"].append(time.perf_counter() - start)
    for name in live:
        times = out[name]["times_s"] or [out[name]["first_s"]]
        out[name]["min_s"] = min(times)
        out[name]["median_s"] = statistics.median(times)
        out[name]["compile_s"] = max(out[name]["first_s"] - out[name]["min_s"], 0.0)
    return out


def trajectory_errors(y: np.ndarray, y_ref: np.ndarray) -> np.ndarray:
    """Per trajectory, `max|y - y_ref| / max|y_ref|` over the state's components."""
    y, y_ref = np.asarray(y, np.float64), np.asarray(y_ref, np.float64)
    scale = np.maximum(np.max(np.abs(y_ref), axis=1), np.finfo(np.float64).tiny)
    return np.max(np.abs(y - y_ref), axis=1) / scale


def state_error(y: np.ndarray, y_ref: np.ndarray) -> float:
    """The forward-state error: the largest `trajectory_errors` in the ensemble."""
    return float(np.max(trajectory_errors(y, y_ref)))


def gradient_difference(g: list[np.ndarray], g_ref: list[np.ndarray]) -> float:
    """`max|g - g_ref| / max|g_ref|` over all gradient leaves together."""
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(g, g_ref, strict=True))
    scale = max(float(np.max(np.abs(b))) for b in g_ref)
    return diff / scale if scale > 0 else diff


def _build(name, problem, y0s, args, tol, dtype, scipy_cap):
    if name == "gradsolve":
        return tools.build_gradsolve(problem, y0s, args, tol, dtype)
    if name == "diffrax":
        return tools.build_diffrax(problem, y0s, args, tol, dtype)
    if name == "torchode":
        return tools.build_torchode(problem, y0s, args, tol, dtype)
    if name == "scipy":
        return tools.build_scipy(problem, y0s, args, tol, dtype, scipy_cap)
    raise ValueError(name)


def compute_reference(
    problem: Problem, n: int, dtype, with_gradient: bool = False, log=print
) -> dict:
    """The tight reference of one ensemble (see `tools.reference`), timed."""
    y0s, args = make_inputs(problem, n)
    start = time.perf_counter()
    states, grad = tools.reference(
        problem, y0s, args, dtype, with_gradient=with_gradient
    )
    seconds = time.perf_counter() - start
    log(
        f"  reference ({'states and gradient' if with_gradient else 'states'}): "
        f"{seconds:.1f} s"
    )
    return {
        "states": states,
        "gradient": grad,
        "seconds": seconds,
        "method": "diffrax Dopri8, rtol = atol = 1e-13, float64",
    }


def run_case(
    problem: Problem,
    n: int,
    dtype,
    tol: float,
    repeats: int,
    tool_names: list[str],
    scipy_cap: int,
    ref: dict | None = None,
    log=print,
) -> dict:
    """Time and check every tool in `tool_names` on one ensemble; return raw numbers.

    `ref` is a `compute_reference` result, computed here if not given; when it holds
    a gradient, each tool's gradient error against it is reported too (used by the
    work-precision sweep).
    """
    case_start = time.perf_counter()
    dtype_name = jnp.dtype(dtype).name
    log(f"\n== {problem.name}, N = {n}, {dtype_name}, rtol = atol = {tol:g}")
    y0s, args = make_inputs(problem, n)
    ref = ref or compute_reference(problem, n, dtype, log=log)
    ref_states, ref_grad = ref["states"], ref["gradient"]
    case = {
        "problem": problem.name,
        "n": n,
        "dtype": dtype_name,
        "rtol": tol,
        "atol": tol,
        "repeats": repeats,
        "reference": {"method": ref["method"], "seconds": ref["seconds"]},
        "tools": {},
    }

    built = {}
    for name in tool_names:
        try:
            built[name] = _build(name, problem, y0s, args, tol, dtype, scipy_cap)
        except Exception as e:
            case["tools"][name] = {"failed": f"{type(e).__name__}: {e}"}
            log(f"  {name}: could not be built ({type(e).__name__}: {e})")
    tasks = {f"{b.tool}/{op}": fn for b in built.values() for op, fn in b.tasks.items()}
    warmups = {
        f"{b.tool}/{op}": b.warmup_calls for b in built.values() for op in b.tasks
    }
    timings = time_interleaved(tasks, repeats, warmups, log=log)

    for name, b in built.items():
        entry = {"ops": {}, "info": dict(b.info)}
        for op in b.tasks:
            t = dict(timings[f"{name}/{op}"])
            scale = b.time_scale.get(op, 1.0)
            if "failed" not in t and scale != 1.0:
                t["time_scale"] = scale
                for key in ("min_s", "median_s"):
                    t[key] *= scale
            entry["ops"][op] = t
        ok = {op for op, t in entry["ops"].items() if "failed" not in t}
        if "record" in ok and "gradient" in ok:
            rec, grad = entry["ops"]["record"], entry["ops"]["gradient"]
            entry["ops"]["record+gradient"] = {
                key: rec[key] + grad[key] for key in ("min_s", "median_s", "compile_s")
            }
        try:
            if "forward" in ok:
                ref = ref_states if b.subset is None else ref_states[b.subset]
                errs = trajectory_errors(b.states["forward"](), ref)
                entry["error"] = float(np.max(errs))
                entry["error_median"] = float(np.median(errs))
            if b.gradient is not None and "gradient" in ok:
                entry["_gradient"] = b.gradient()
                if ref_grad is not None:
                    entry["gradient_error"] = gradient_difference(
                        entry["_gradient"], ref_grad
                    )
            if b.steps is not None and ok:
                entry["steps"] = b.steps()
        except Exception as e:
            entry["check_failed"] = f"{type(e).__name__}: {e}"
            log(f"  {name}: accuracy check failed ({type(e).__name__}: {e})")
        case["tools"][name] = entry

    # Gradients against Diffrax's (the same derivative for gradsolve, to round-off).
    theirs = case["tools"].get("diffrax", {}).get("_gradient")
    for name, entry in case["tools"].items():
        mine = entry.pop("_gradient", None)
        if mine is not None and theirs is not None and name != "diffrax":
            entry["gradient_vs_diffrax"] = gradient_difference(mine, theirs)
    case["seconds"] = time.perf_counter() - case_start
    _log_case(case, log)
    return case


def _log_case(case, log):
    """Print one line per tool and operation, and the gradient check."""
    for name, entry in case["tools"].items():
        if "failed" in entry:
            continue
        for op, t in entry["ops"].items():
            if "failed" in t:
                log(f"  {name:9s} {op:16s} FAILED: {t['failed'][:120]}")
                continue
            scaled = f" (x{t['time_scale']:.0f} scaled)" if "time_scale" in t else ""
            log(
                f"  {name:9s} {op:16s} min {1e3 * t['min_s']:10.2f} ms  median "
                f"{1e3 * t['median_s']:10.2f} ms  compile {t['compile_s']:6.2f} s"
                f"{scaled}"
            )
        extras = []
        if "error" in entry:
            extras.append(f"state error {entry['error']:.2e}")
        if "gradient_error" in entry:
            extras.append(f"gradient error {entry['gradient_error']:.2e}")
        if "steps" in entry:
            extras.append(
                f"steps {entry['steps']['steps_min']}-{entry['steps']['steps_max']}"
            )
        if extras:
            log(f"  {name:9s} " + ", ".join(extras))
    gs_entry = case["tools"].get("gradsolve", {})
    if "gradient_vs_diffrax" in gs_entry:
        log(
            f"  CHECK gradsolve gradient vs Diffrax: max relative difference "
            f"{gs_entry['gradient_vs_diffrax']:.2e}"
        )
    else:
        log("  CHECK gradsolve gradient vs Diffrax: not available (a tool failed)")
    to_entry = case["tools"].get("torchode", {})
    if "gradient_vs_diffrax" in to_entry:
        log(
            f"  torchode gradient vs Diffrax (own steps, not expected equal): "
            f"{to_entry['gradient_vs_diffrax']:.2e}"
        )
    log(f"  (case took {case['seconds']:.1f} s in all)")
