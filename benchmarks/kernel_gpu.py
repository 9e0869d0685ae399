"""The fused forward kernel against the XLA loop and vmapped Diffrax, on a GPU.

The Lorenz ensemble of the DiffEqGPU.jl benchmark (t in [0, 1], y0 = [1, 0, 0],
sigma = 10, rho = linspace(0, 21, N), beta = 8/3), float32, Tsit5, saving y(t1):

- `adaptive`: `PIDController(rtol=1e-8, atol=1e-8)`, `dt0=None`;
- `fixed`: `ConstantStepSize()`, `dt0=1e-3` (1,000 steps).

Tools: `jax.vmap(gs.diffeqsolve(..., kernel="pallas"))` (the kernel),
`kernel="xla"` (the XLA loop) and `jax.vmap(diffrax.diffeqsolve)`, each jitted, timed
after a compiling call, `--repeats` times, alternating tools. gradsolve's solves
record the mesh too; `max_steps` is the largest step count at N = 1,024 plus a
quarter, so the mesh (`N x (max_steps + 1)` times) fits at N = 8,388,608.

```bash
python benchmarks/kernel_gpu.py               # on a GPU: the table in the README
python benchmarks/kernel_gpu.py --smoke       # anywhere: N = 16 (interpreted off a GPU)
python benchmarks/kernel_gpu.py --lower-only  # no GPU: lower the kernel to Triton IR
```

`--smoke` only checks that the script runs: off a GPU the kernel is interpreted, and
its times say nothing about performance.
"""

import argparse
import json
import os
import sys
import time


if "--lower-only" in sys.argv:
    # Lowering for CUDA on a machine without it cannot emit host callbacks, which
    # equinox's runtime checks use; make them NaN-producing instead.
    os.environ.setdefault("EQX_ON_ERROR", "nan")

import diffrax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import gradsolve as gs  # noqa: E402
import gradsolve._kernel as gs_kernel  # noqa: E402


SIZES = (1024, 16384, 131072, 1048576, 8388608)
TOOLS = ("kernel", "xla", "diffrax")


def lorenz(t, y, p):
    sigma, rho, beta = p[0], p[1], p[2]
    return jnp.stack(
        [sigma * (y[1] - y[0]), y[0] * (rho - y[2]) - y[1], y[0] * y[1] - beta * y[2]]
    )


def inputs(n):
    rho = jnp.linspace(0.0, 21.0, n, dtype=jnp.float32)
    args = jnp.stack([jnp.full(n, 10.0), rho, jnp.full(n, 8 / 3)], 1)
    y0s = jnp.tile(jnp.array([1.0, 0.0, 0.0]), (n, 1))
    return y0s.astype(jnp.float32), args.astype(jnp.float32)


def mode_setup(mode):
    if mode == "adaptive":
        return gs.PIDController(rtol=1e-8, atol=1e-8), None
    return gs.ConstantStepSize(), jnp.float32(1e-3)


def solver_fn(tool, mode, max_steps):
    ctrl, dt0 = mode_setup(mode)
    t0, t1 = jnp.float32(0.0), jnp.float32(1.0)
    term = diffrax.ODETerm(lorenz)
    kernel = "pallas" if tool == "kernel" else "xla"

    def one(y0, p):
        if tool == "diffrax":
            sol = diffrax.diffeqsolve(
                term,
                diffrax.Tsit5(),
                t0,
                t1,
                dt0,
                y0,
                p,
                stepsize_controller=ctrl,
                max_steps=max_steps,
                throw=False,
            )
            return sol.ys, sol.stats
        sol = gs.diffeqsolve(
            term,
            gs.Tsit5(),
            t0,
            t1,
            dt0,
            y0,
            p,
            stepsize_controller=ctrl,
            max_steps=max_steps,
            throw=False,
            kernel=kernel,
        )
        return sol.ys, sol.stats

    return jax.jit(jax.vmap(one))


def steps_needed(mode):
    """The longest trajectory's steps at N = 1,024 (rho covers the same range at
    every N), plus a quarter."""
    if mode == "fixed":
        return 1000
    ys, stats = solver_fn("xla", mode, 4096)(*inputs(1024))
    return int(1.25 * int(jnp.max(stats["num_steps"]))) + 8


def run(sizes, modes, tools, repeats):
    rows = []
    for mode in modes:
        max_steps = steps_needed(mode)
        for n in sizes:
            y0s, args = inputs(n)
            fns = {tool: solver_fn(tool, mode, max_steps) for tool in tools}
            row = dict(mode=mode, n=n, max_steps=max_steps, times={}, compile={})
            outs = {}
            for tool, fn in fns.items():
                start = time.perf_counter()
                try:
                    outs[tool] = jax.block_until_ready(fn(y0s, args))
                except Exception as e:  # e.g. out of memory at the largest N
                    row["times"][tool] = f"failed: {type(e).__name__}"
                    print(f"{mode} N={n} {tool}: {e}".splitlines()[0], flush=True)
                    continue
                row["compile"][tool] = time.perf_counter() - start
                row["times"][tool] = []
            for _ in range(repeats):
                for tool, fn in fns.items():
                    if not isinstance(row["times"][tool], list):
                        continue
                    start = time.perf_counter()
                    jax.block_until_ready(fn(y0s, args))
                    row["times"][tool].append(time.perf_counter() - start)
            if "kernel" in outs and "xla" in outs:
                (ys_k, st_k), (ys_x, st_x) = outs["kernel"], outs["xla"]
                row["same_steps"] = bool(
                    jnp.all(st_k["num_steps"] == st_x["num_steps"])
                )
                row["max_abs_diff"] = float(jnp.max(jnp.abs(ys_k - ys_x)))
            print(json.dumps(summary(row)), flush=True)
            rows.append(row)
    return rows


def summary(row):
    out = dict(mode=row["mode"], n=row["n"])
    for tool, times in row["times"].items():
        out[tool] = (
            f"{1e3 * min(times):.3g} ms" if isinstance(times, list) and times else times
        )
    out.update({k: row[k] for k in ("same_steps", "max_abs_diff") if k in row})
    return out


def table(rows):
    lines = [
        "| N | mode | kernel ms | XLA path ms | Diffrax ms | kernel vs XLA | "
        "kernel vs Diffrax |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        t = {
            k: 1e3 * min(v) if isinstance(v, list) and v else None
            for k, v in row["times"].items()
        }
        fmt = lambda x: "—" if x is None else f"{x:.3g}"
        ratio = lambda a, b: (
            "—" if t.get(a) is None or t.get(b) is None else f"{t[b] / t[a]:.1f}x"
        )
        lines.append(
            f"| {row['n']:,} | {row['mode']} | {fmt(t.get('kernel'))} | "
            f"{fmt(t.get('xla'))} | {fmt(t.get('diffrax'))} | "
            f"{ratio('kernel', 'xla')} | {ratio('kernel', 'diffrax')} |"
        )
    return "\n".join(lines)


def lower_only():
    """Lower the kernel for CUDA without a GPU: Pallas emits Triton IR (compiling
    it to PTX and running it needs the GPU)."""
    gs_kernel.INTERPRET = False
    y0s, args = inputs(1024)
    for mode in ("adaptive", "fixed"):
        lowered = solver_fn("kernel", mode, 1024).trace(y0s, args)
        text = lowered.lower(lowering_platforms=("cuda",)).as_text()
        ok = "__gpu$xla.gpu.triton" in text
        print(f"{mode}, float32: {'Triton kernel emitted' if ok else 'NO kernel'}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--modes", default="adaptive,fixed")
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/kernel_gpu.json")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--lower-only", action="store_true")
    a = parser.parse_args()
    if a.lower_only:
        return lower_only()
    backend = jax.default_backend()
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.smoke:
        sizes, a.repeats = [16], 1
    if backend != "gpu":
        print(
            f"backend {backend}: the kernel runs in Pallas interpret mode; these "
            "times are not a performance measurement."
        )
        if not a.smoke:
            sys.exit("Run with --smoke off a GPU (the full sizes need one).")
    rows = run(sizes, a.modes.split(","), a.tools.split(","), a.repeats)
    print(table(rows))
    if not a.smoke:
        info = dict(backend=backend, devices=[str(d) for d in jax.devices()])
        with open(a.out, "w") as f:
            json.dump(dict(info=info, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
