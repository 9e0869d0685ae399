"""A field held in array form whose gradient gradsolve computes slower than Diffrax.

    python benchmarks/array_form.py                  # 48 states, N = 64
    python benchmarks/array_form.py --states 64 --sizes 16,256

A state of more than 32 elements is stepped in array form (see "How it works").
This field, a chain of `--states` states coupled to its neighbours through slices
and a concatenation (a one-dimensional diffusion with a quadratic sink, two shared
parameters), is where that form is slow: each step's stages are unrolled into one
program, and XLA:CPU compiles the backward pass through their slices and pads to
code ~10x slower than the forward. Diffrax computes the stages in a loop over the
stage index, whose backward pass does not have that problem. Timed in one process
with the benchmarks' interleaved protocol (`harness.time_interleaved`), float64,
Tsit5 at rtol = atol = 1e-8 over t in [0, 2]:

- `replay`: `jax.grad` of a loss over `gs.replay` of the recorded mesh;
- `one-call`: the same over `jax.vmap(gs.diffeqsolve)`;
- `stage loop`: a hand-written replay of the same mesh (Tsit5's stages in a
  `fori_loop`, as Diffrax computes them; no stale check, no saving but `t1`);
- `diffrax`: the same loss over `jax.vmap(diffrax.diffeqsolve)`.
"""

import argparse
import sys

import diffrax
import jax
import jax.numpy as jnp
import numpy as np


jax.config.update("jax_enable_x64", True)

from harness import time_gradients  # noqa: E402

import gradsolve as gs  # noqa: E402


def chain(t, y, p):
    k, c = p
    inner = y[2:] - 2 * y[1:-1] + y[:-2]
    lap = jnp.concatenate([y[1:2] - y[:1], inner, y[-2:-1] - y[-1:]])
    return k * lap - c * y * y


def stage_loop_replay(ts, y0, p):
    """Tsit5 over the steps `ts`, its stages in a loop; each step checkpointed."""
    co = gs.Tsit5.coefficients()
    stages = len(co.c)
    a = np.zeros((stages, stages))
    for i, row in enumerate(co.a):
        a[i + 1, : len(row)] = row
    a, c, b = jnp.asarray(a), jnp.asarray(co.c, float), jnp.asarray(co.b_sol, float)

    def step(y, x):
        s, e = x
        h = e - s

        def stage(i, ks):
            y_i = y + jnp.tensordot(a[i], ks, axes=1)
            return ks.at[i].set(h * chain(s + c[i] * h, y_i, p))

        ks = jax.lax.fori_loop(0, stages, stage, jnp.zeros((stages,) + y.shape))
        return y + jnp.tensordot(b, ks, axes=1), None

    y, _ = jax.lax.scan(jax.checkpoint(step), y0, (ts[:-1], ts[1:]))
    return y


def case(states: int, n: int, repeats: int) -> list[str]:
    y0s = jnp.linspace(0.1, 1.0, states) * (1 + 0.1 * jnp.arange(n)[:, None] / n)
    p = jnp.array([0.5, 0.3])
    kw = dict(stepsize_controller=gs.PIDController(rtol=1e-8, atol=1e-8))
    term = gs.ODETerm(chain)
    mesh = gs.record_ensemble(term, gs.Tsit5(), 0.0, 2.0, None, y0s, p, **kw).trim()
    # Every trajectory's steps, padded with zero-length ones (as the mesh holds them).
    ts = mesh.ts[:, : mesh.max_steps + 1]

    def solved(lib):
        ctrl = lib.PIDController(rtol=1e-8, atol=1e-8)

        def one(y0, a):
            sol = lib.diffeqsolve(
                lib.ODETerm(chain), lib.Tsit5(), 0.0, 2.0, None, y0, a,
                stepsize_controller=ctrl,
            )  # fmt: skip
            return sol.ys[-1]

        return lambda a: jax.vmap(one, in_axes=(0, None))(y0s, a)

    finals = {
        "replay": lambda a: gs.replay(mesh, term, gs.Tsit5(), y0s, a).ys[:, -1],
        "one-call": solved(gs),
        "stage loop": lambda a: jax.vmap(stage_loop_replay, (0, 0, None))(ts, y0s, a),
        "diffrax": solved(diffrax),
    }
    times, grads = time_gradients(finals, p, repeats)
    want = np.asarray(grads["diffrax"](p))
    rows = []
    for name, t in times.items():
        gap = np.max(np.abs(np.asarray(grads[name](p)) - want) / np.abs(want))
        rows.append(
            f"| {states} | {n} | {int(mesh.max_steps)} | {name} "
            f"| {1e3 * t['min_s']:.2f} | {1e3 * t['median_s']:.2f} "
            f"| {t['first_s']:.1f} "
            f"| {times['diffrax']['min_s'] / t['min_s']:.2f}x | {gap:.1e} |"
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--states", type=int, default=48)
    parser.add_argument("--sizes", default="64")
    parser.add_argument("--repeats", type=int, default=10)
    opts = parser.parse_args()
    print(
        "| states | N | steps | gradient | min ms | median ms | first call s "
        "| speed-up vs Diffrax (min) | gradient vs Diffrax |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n in map(int, opts.sizes.split(",")):
        for row in case(opts.states, n, opts.repeats):
            print(row, flush=True)


if __name__ == "__main__":
    sys.exit(main())
