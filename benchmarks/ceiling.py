"""The ceiling: a plain hand-written replay of the same mesh, next to gs.replay.

    python benchmarks/ceiling.py             # N = 1 ... 16,384, both dtypes
    python benchmarks/ceiling.py --sizes 64,4096 --dtypes float64 --repeats 7

For Lorenz and Lotka-Volterra (`benchmarks/problems.py`), each ensemble is recorded
once (`gs.record_ensemble`, Tsit5, rtol = atol = the problem's tolerance for the
dtype) and then, in one process, interleaved as in `benchmarks/run.py`:

- `ceiling`: the replay written by hand for this one case: Tsit5's tableau (Python
  floats, zero coefficients skipped) applied to the state held as `d` arrays of
  shape `(N,)`, the problem's field written on those arrays, one `lax.scan` over
  the mesh's step sizes with `jax.checkpoint` around each step, no error estimate,
  no saving but `y(t1)`, no restarts;
- `gs.replay` over the same mesh, with its stale check (default) and without
  (`stale="ignore"`);
- the one-call gradient, `jax.grad` through `jax.vmap(gs.diffeqsolve)`;
- Diffrax: `jax.vmap(diffrax.diffeqsolve)` with `diffrax.Tsit5`, default adjoint.

The loss is `sum(y(t1)**2)`, its gradient taken with respect to every trajectory's
parameters. Every gradsolve time is reported as a fraction of the ceiling's (1.0
means as fast as the hand-written replay), and every time as a speed-up over
Diffrax's. The gradients of the ceiling, of `gs.replay` and of Diffrax are compared
(they differentiate the same steps). Writes `ceiling.json` (with the machine and
versions) and `ceiling.md` to `--out` (default `benchmarks/results/`) and prints the
table.
"""

import argparse
import pathlib
import sys

import diffrax
import jax
import jax.numpy as jnp
import numpy as np


jax.config.update("jax_enable_x64", True)

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import problems  # noqa: E402
import report  # noqa: E402
from harness import gradient_difference, time_interleaved  # noqa: E402

import gradsolve as gs  # noqa: E402


def _tsit5():
    """Tsit5's tableau as Python floats: `(a rows, b)`."""
    tableau = diffrax.Tsit5.tableau
    a = [[float(w) for w in row] for row in tableau.a_lower]
    return a, [float(w) for w in tableau.b_sol]


def _lorenz(y, p):
    (x, yy, z), (sigma, rho, beta) = y, p
    return [sigma * (yy - x), x * (rho - z) - yy, x * yy - beta * z]


def _lotka_volterra(y, p):
    (u, v), (a, b, c, d) = y, p
    return [a * u - b * u * v, c * u * v - d * v]


# The fields written on components: lists of `(N,)` arrays in, lists out.
COMPONENT_FIELDS = {"lorenz": _lorenz, "lotka_volterra": _lotka_volterra}


def ceiling_final_state(field, ts, y0s, args):
    """`y(t1)` of every trajectory, replaying the steps of `ts` (`(N, steps + 1)`,
    padded steps of length 0) by hand, with `field(y, p)` written on components
    (and independent of time); times are taken in the state's dtype."""
    a, b = _tsit5()
    comps = [y0s[:, i] for i in range(y0s.shape[1])]
    params = [args[:, i] for i in range(args.shape[1])]
    ts = ts.astype(y0s.dtype)

    def f(t, y):
        return field(y, params)

    def combine(y, h, weights, ks):
        return [
            yi + h * sum(w * k[i] for w, k in zip(weights, ks) if w != 0)
            for i, yi in enumerate(y)
        ]

    def step(y, x):
        t, h = x
        ks = [f(t, y)]
        for row in a:
            ks.append(f(t, combine(y, h, row, ks)))
        return combine(y, h, b, ks), None

    starts, sizes = ts[:, :-1].T, jnp.diff(ts, axis=1).T
    final, _ = jax.lax.scan(jax.checkpoint(step), comps, (starts, sizes))
    return jnp.stack(final, axis=1)


def run_case(problem, n, dtype, repeats):
    y0s, args = problems.make_inputs(problem, n)
    y0s, args = jnp.asarray(y0s, dtype), jnp.asarray(args, dtype)
    tol = problem.tol64 if dtype == jnp.float64 else problem.tol32
    term = gs.ODETerm(problem.jax_vf)
    ctrl = gs.PIDController(rtol=tol, atol=tol)
    t0, t1 = problem.t0, problem.t1
    kw = dict(stepsize_controller=ctrl, max_steps=problem.max_steps)
    mesh = gs.record_ensemble(
        term, gs.Tsit5(), t0, t1, None, y0s, args, args_axes=0, **kw
    )

    def replay(stale):
        return lambda a: gs.replay(
            mesh, term, gs.Tsit5(), y0s, a, args_axes=0, stale=stale
        ).ys[:, -1]

    def solved(solve, solver):
        one = lambda y0, a: solve(term, solver, t0, t1, None, y0, a, **kw).ys[-1]
        return lambda a: jax.vmap(one)(y0s, a)

    field = COMPONENT_FIELDS[problem.name]
    ceiling = lambda a: ceiling_final_state(field, mesh.ts, y0s, a)
    finals = {
        "ceiling": ceiling,
        "replay": replay("warn"),
        "replay (stale off)": replay("ignore"),
        "one-call": solved(gs.diffeqsolve, gs.Tsit5()),
        "diffrax": solved(diffrax.diffeqsolve, diffrax.Tsit5()),
    }
    grads = {
        name: jax.jit(jax.grad(lambda a, fn=fn: jnp.sum(fn(a) ** 2)))
        for name, fn in finals.items()
    }
    forwards = {
        name: jax.jit(finals[name]) for name in ("ceiling", "replay", "diffrax")
    }
    tasks = {
        f"grad {k}": (lambda g=g: jax.block_until_ready(g(args)))
        for k, g in grads.items()
    }
    tasks.update(
        {
            f"fwd {k}": (lambda f=f: jax.block_until_ready(f(args)))
            for k, f in forwards.items()
        }
    )
    times = time_interleaved(tasks, repeats, log=lambda *_: None)
    reference = [np.asarray(grads["diffrax"](args))]
    check = {
        name: gradient_difference([np.asarray(grads[name](args))], reference)
        for name in ("ceiling", "replay")
    }
    return dict(
        problem=problem.name, n=n, dtype=jnp.dtype(dtype).name,
        steps=int(mesh.max_steps), times=times, gradient_vs_diffrax=check,
    )  # fmt: skip


def table(cases) -> str:
    lines = [
        "| problem | N | dtype | path | forward ms | gradient ms "
        "| compile s (fwd / grad) | fraction of the ceiling (fwd / grad) "
        "| speed-up vs Diffrax (fwd / grad) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        t = c["times"]
        ms = lambda key: 1e3 * t[key]["min_s"] if key in t else None
        fmt = lambda x: "—" if x is None else f"{x:.3g}"
        ratio = lambda x, y: "—" if x is None or y is None else f"{x / y:.2f}"
        for path in ("ceiling", "replay", "replay (stale off)", "one-call", "diffrax"):
            fwd, grad = ms(f"fwd {path}"), ms(f"grad {path}")
            comp = [t.get(f"{k} {path}", {}).get("compile_s") for k in ("fwd", "grad")]
            comp = " / ".join("—" if x is None else f"{x:.1f}" for x in comp)
            of_ceiling = (
                f"{ratio(fwd, ms('fwd ceiling'))} / {ratio(grad, ms('grad ceiling'))}"
            )
            vs_diffrax = (
                f"{ratio(ms('fwd diffrax'), fwd)} / {ratio(ms('grad diffrax'), grad)}"
            )
            lines.append(
                f"| {c['problem']} | {c['n']} | {c['dtype']} | {path} | {fmt(fwd)} | "
                f"{fmt(grad)} | {comp} | {of_ceiling} | {vs_diffrax} |"
            )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default="lorenz,lotka_volterra")
    parser.add_argument("--sizes", default="1,64,1024,4096,16384")
    parser.add_argument("--dtypes", default="float64,float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results"))
    opts = parser.parse_args()
    cases = []
    for name in opts.problems.split(","):
        for dtype in opts.dtypes.split(","):
            for n in map(int, opts.sizes.split(",")):
                case = run_case(
                    problems.PROBLEMS[name], n, jnp.dtype(dtype), opts.repeats
                )
                cases.append(case)
                print(table([case]).split("\n", 2)[2], flush=True)
                check = case["gradient_vs_diffrax"]
                print(
                    f"  gradient vs Diffrax: ceiling {check['ceiling']:.1e}, "
                    f"gs.replay {check['replay']:.1e}",
                    flush=True,
                )
    markdown = table(cases)
    report.write(
        pathlib.Path(opts.out),
        "ceiling",
        dict(cases=cases, environment=report.environment()),
        markdown,
    )
    print(markdown)


if __name__ == "__main__":
    main()
