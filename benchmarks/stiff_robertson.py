"""Stiff ensemble: gs.Rodas5 against Diffrax's Kvaerno5, at matched accuracy.

`python benchmarks/stiff_robertson.py [--trajectories 1024] [--quick]`

Robertson's chemical kinetics with the three rate constants of every trajectory
drawn log-uniformly within a factor 2 of (0.04, 3e7, 1e4), t in [0, 1e3], float64.
For rtol from 1e-4 to 1e-8 (atol = 1e-4 * rtol) it times, side by side in one
process, minimum of repeats after a compiling call (compilation reported apart):

- gradsolve: `gs.diffeqsolve` with `gs.Rodas5()` (forward), the gradient through it
  (record + adjoint in one call), `gs.record`, and the gradient of `gs.replay` over
  the recorded mesh;
- Diffrax: `diffrax.diffeqsolve` with `diffrax.Kvaerno5()` (forward) and its
  default-adjoint gradient.

The loss is `sum(y1 + 1e4 y2 + y3)` at t1 over the ensemble, differentiated with
respect to the rate constants. Accuracy is the largest relative error of the final
states of a subset of trajectories against SciPy's Radau at rtol = 1e-12. Because the
two methods reach different errors at equal rtol, speed-ups are also quoted at equal
error: Diffrax's time interpolated (log-log) at gradsolve's error. Results go to
`benchmarks/results/stiff_robertson.json`, a markdown table on stdout and a
work-precision plot `benchmarks/results/stiff_robertson.png`.
"""

import argparse
import json
import pathlib
import time

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
from scipy.integrate import solve_ivp


jax.config.update("jax_enable_x64", True)

import gradsolve as gs  # noqa: E402


T1 = 1e3
RESULTS = pathlib.Path(__file__).parent / "results"


def robertson(t, y, k):
    k1, k2, k3 = k[0], k[1], k[2]
    return jnp.stack(
        [
            -k1 * y[0] + k3 * y[1] * y[2],
            k1 * y[0] - k2 * y[1] ** 2 - k3 * y[1] * y[2],
            k2 * y[1] ** 2,
        ]
    )


def rates(n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.array([0.04, 3e7, 1e4]) * 2.0 ** rng.uniform(-1, 1, size=(n, 3))


def reference(rates_subset: np.ndarray) -> np.ndarray:
    field = jax.jit(robertson)
    jac = jax.jit(jax.jacfwd(robertson, argnums=1))
    out = []
    for k in rates_subset:
        sol = solve_ivp(
            lambda t, y: np.asarray(field(t, y, k)),
            (0.0, T1),
            [1.0, 0.0, 0.0],
            method="Radau",
            rtol=1e-12,
            atol=1e-16,
            jac=lambda t, y: np.asarray(jac(t, y, k)),
        )
        out.append(sol.y[:, -1])
    return np.array(out)


def best_time(fn, *args, repeats: int = 3) -> float:
    best = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def compiled_time(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


WEIGHTS = jnp.array([1.0, 1e4, 1.0])


def build(n: int, max_steps: int):
    term = diffrax.ODETerm(robertson)
    y0s = jnp.tile(jnp.array([1.0, 0.0, 0.0]), (n, 1))

    def ctrl(rtol):
        return diffrax.PIDController(rtol=rtol, atol=1e-4 * rtol)

    def solve_with(diffeqsolve, solver):
        def solve(y0, k, rtol):
            return diffeqsolve(
                term,
                solver,
                0.0,
                T1,
                None,
                y0,
                k,
                stepsize_controller=ctrl(rtol),
                max_steps=max_steps,
            )

        return solve

    gs_solve = solve_with(gs.diffeqsolve, gs.Rodas5())
    diffrax_solve = solve_with(diffrax.diffeqsolve, diffrax.Kvaerno5())

    def final_states(solve):
        return jax.jit(
            lambda k, rtol: jax.vmap(lambda y0, k: solve(y0, k, rtol).ys[-1])(y0s, k)
        )

    def steps(solve):
        def one(y0, k, rtol):
            stats = solve(y0, k, rtol).stats
            return stats["num_accepted_steps"], stats["num_rejected_steps"]

        return jax.jit(
            lambda k, rtol: jax.vmap(one, in_axes=(0, 0, None))(y0s, k, rtol)
        )

    def gradient(solve):
        def loss(k, rtol):
            ys = jax.vmap(lambda y0, k: solve(y0, k, rtol).ys[-1])(y0s, k)
            return jnp.sum(ys * WEIGHTS)

        return jax.jit(jax.grad(loss))

    record = jax.jit(
        lambda k, rtol: jax.vmap(
            lambda y0, k: gs.record(
                term,
                gs.Rodas5(),
                0.0,
                T1,
                None,
                y0,
                k,
                stepsize_controller=ctrl(rtol),
                max_steps=max_steps,
            )
        )(y0s, k)
    )

    @jax.jit
    def replay_gradient(k, mesh):
        def loss(k):
            ys = gs.replay(mesh, term, gs.Rodas5(), y0s, k, args_axes=0).ys[:, -1]
            return jnp.sum(ys * WEIGHTS)

        return jax.grad(loss)(k)

    return dict(
        gs_forward=final_states(gs_solve),
        gs_steps=steps(gs_solve),
        gs_gradient=gradient(gs_solve),
        gs_record=record,
        gs_replay_gradient=replay_gradient,
        diffrax_forward=final_states(diffrax_solve),
        diffrax_steps=steps(diffrax_solve),
        diffrax_gradient=gradient(diffrax_solve),
    )


def interpolate_time(errors, times, at_error):
    """Time at `at_error` on the log-log work-precision line through (errors, times);
    None outside the measured range."""
    order = np.argsort(errors)
    e, t = np.log(np.asarray(errors)[order]), np.log(np.asarray(times)[order])
    x = np.log(at_error)
    if x < e[0] or x > e[-1]:
        return None
    return float(np.exp(np.interp(x, e, t)))


def main(n: int, quick: bool, subset: int):
    tols = [1e-4, 1e-6, 1e-8] if quick else [1e-4, 1e-5, 1e-6, 1e-7, 1e-8]
    k = jnp.asarray(rates(n))
    chosen = np.linspace(0, n - 1, min(subset, n)).astype(int)
    ref = reference(np.asarray(k)[chosen])
    fns = build(n, max_steps=4096)
    rows = []
    compile_s = {}
    for rtol in tols:
        r = jnp.asarray(rtol)
        row = dict(rtol=rtol)
        for tool in ("gs", "diffrax"):
            forward, grad = fns[f"{tool}_forward"], fns[f"{tool}_gradient"]
            if tool not in compile_s:
                compile_s[tool] = dict(
                    forward=compiled_time(forward, k, r),
                    gradient=compiled_time(grad, k, r),
                )
            ys = np.asarray(forward(k, r))[chosen]
            row[f"{tool}_error"] = float(
                np.max(np.abs(ys - ref) / (1e-4 * rtol + np.abs(ref)))
            )
            accepted, rejected = fns[f"{tool}_steps"](k, r)
            row[f"{tool}_steps"] = float(np.mean(np.asarray(accepted)))
            row[f"{tool}_rejected"] = float(np.mean(np.asarray(rejected)))
            row[f"{tool}_forward_s"] = best_time(forward, k, r)
            row[f"{tool}_gradient_s"] = best_time(grad, k, r)
        mesh = fns["gs_record"](k, r)
        row["gs_record_s"] = best_time(fns["gs_record"], k, r)
        mesh = mesh.trim()
        row["gs_replay_gradient_s"] = best_time(fns["gs_replay_gradient"], k, mesh)
        g_ref = np.asarray(fns["diffrax_gradient"](k, r))
        g = np.asarray(fns["gs_gradient"](k, r))
        row["gradient_vs_diffrax"] = float(
            np.max(np.abs(g - g_ref)) / np.max(np.abs(g_ref))
        )
        rows.append(row)
        print(f"rtol {rtol:.0e} done", flush=True)

    RESULTS.mkdir(exist_ok=True)
    out = dict(trajectories=n, t1=T1, rows=rows, compile_s=compile_s, machine=machine())
    (RESULTS / "stiff_robertson.json").write_text(json.dumps(out, indent=2))
    summarise(out)


def summarise(out: dict):
    """Speed-ups at equal error, the table and the plot, from the measurements."""
    rows = out["rows"]
    for row in rows:
        row["gs_record_replay_gradient_s"] = (
            row["gs_record_s"] + row["gs_replay_gradient_s"]
        )
        for op in ("forward", "gradient"):
            matched = interpolate_time(
                [r["diffrax_error"] for r in rows],
                [r[f"diffrax_{op}_s"] for r in rows],
                row["gs_error"],
            )
            row[f"diffrax_{op}_s_at_gs_error"] = matched
    report(out["trajectories"], rows, out["compile_s"])
    plot(rows)


def machine() -> dict:
    import os
    import platform

    return dict(
        platform=platform.platform(),
        cpus=os.cpu_count(),
        jax=jax.__version__,
        diffrax=diffrax.__version__,
        device=str(jax.devices()[0]),
    )


def report(n, rows, compile_s):
    ms = lambda s: "-" if s is None else f"{1e3 * s:.1f}"
    ratio = lambda a, b: "-" if a is None or b is None else f"{a / b:.1f}x"
    print(f"\nRobertson, {n} trajectories, float64, t1 = {T1:g}, atol = 1e-4 rtol")
    print(
        "\n| rtol | error gs / Kvaerno5 | steps gs / Kvaerno5 (rejected) "
        "| forward ms gs / Kvaerno5 | gradient ms gs / Kvaerno5 "
        "| record + replay grad ms | speed-up at equal error: forward "
        "| gradient (one call) | record + replay gradient |"
    )
    print("|---" * 8 + "|")
    for r in rows:
        at_error = r["diffrax_gradient_s_at_gs_error"]
        print(
            f"| {r['rtol']:.0e} | {r['gs_error']:.2g} / {r['diffrax_error']:.2g} "
            f"| {r['gs_steps']:.0f} ({r['gs_rejected']:.0f}) / "
            f"{r['diffrax_steps']:.0f} ({r['diffrax_rejected']:.0f}) "
            f"| {ms(r['gs_forward_s'])} / {ms(r['diffrax_forward_s'])} "
            f"| {ms(r['gs_gradient_s'])} / {ms(r['diffrax_gradient_s'])} "
            f"| {ms(r['gs_record_s'])} + {ms(r['gs_replay_gradient_s'])} "
            f"| {ratio(r['diffrax_forward_s_at_gs_error'], r['gs_forward_s'])} "
            f"| {ratio(r['diffrax_gradient_s_at_gs_error'], r['gs_gradient_s'])} "
            f"| {ratio(at_error, r['gs_record_replay_gradient_s'])} |"
        )
    print(
        f"\nCompile (s): gs forward {compile_s['gs']['forward']:.1f}, gradient "
        f"{compile_s['gs']['gradient']:.1f}; Kvaerno5 forward "
        f"{compile_s['diffrax']['forward']:.1f}, gradient "
        f"{compile_s['diffrax']['gradient']:.1f}."
    )
    worst = max(r["gradient_vs_diffrax"] for r in rows)
    print(
        f"Largest relative difference of the two gradients: {worst:.1e} (two methods: "
        "each within its own error)."
    )


def plot(rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, op in zip(axes, ("forward", "gradient")):
        for tool, label in (("gs", "gs.Rodas5"), ("diffrax", "Diffrax Kvaerno5")):
            ax.loglog(
                [r[f"{tool}_error"] for r in rows],
                [1e3 * r[f"{tool}_{op}_s"] for r in rows],
                "o-",
                label=label,
            )
        if op == "gradient":
            ax.loglog(
                [r["gs_error"] for r in rows],
                [1e3 * r["gs_replay_gradient_s"] for r in rows],
                "s--",
                label="gs.replay over a mesh",
            )
        ax.set_xlabel("max relative error of y(t1)")
        ax.set_ylabel(f"{op} time (ms)")
        ax.set_title(f"Robertson ensemble: {op}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "stiff_robertson.png", dpi=120)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="three tolerances")
    parser.add_argument("--subset", type=int, default=16, help="SciPy references")
    parser.add_argument(
        "--report", action="store_true", help="only redo the table and plot"
    )
    args = parser.parse_args()
    if args.report:
        summarise(json.loads((RESULTS / "stiff_robertson.json").read_text()))
    else:
        main(args.trajectories, args.quick, args.subset)
