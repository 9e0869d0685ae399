"""A field held in array form that slices its state: gradsolve against Diffrax.

    python benchmarks/array_form.py                  # 48 states, N = 64
    python benchmarks/array_form.py --states 64 --sizes 16,256
    python benchmarks/array_form.py --fields chain,elementwise,linear

A state of more than 32 elements is stepped in array form (see "How it works").
This field, a chain of `--states` states coupled to its neighbours through slices
and a concatenation (a one-dimensional diffusion with a quadratic sink, two shared
parameters), is where unrolled stages were slow: XLA:CPU compiled the backward
pass through seven stages of slices and pads to code ~10x slower than the forward.
gradsolve now computes the stages of such a field in a loop over the stage index,
as Diffrax does. `--fields` adds three other fields held in array form:
`elementwise` (no slicing; each element coupled to the mean), `linear` (a dense
matrix product; its stages stay unrolled) and `kinetics` (a reaction network
written species by species, `y[i]` read by `y[i]` and the rates stacked, evaluated
on the state's elements). Timed in one process
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


def elementwise(t, y, p):
    # No slicing: each element decays and is driven by the state's mean.
    return -p[0] * y + p[1] * jnp.sin(y) + 0.1 * jnp.mean(y)


def kinetics(t, y, p):
    # A reaction network written species by species, as kinetics models usually
    # are: each rate reads single elements of the state, and the rates are stacked.
    n = y.shape[0]
    rates = []
    for i in range(n):
        produced = p[0] * y[i - 1] ** 2 / (1 + y[i - 1]) if i > 0 else 0.0
        consumed = p[0] * y[i] ** 2 / (1 + y[i])
        rates.append(produced - consumed + p[1] * (y[(i + 7) % n] - y[i]))
    return jnp.stack(rates)


def make_linear(states: int):
    # A dense coupling matrix: one matrix product per evaluation.
    w = jax.random.normal(jax.random.key(0), (states, states)) / np.sqrt(states)
    w = w - jnp.eye(states)

    def linear(t, y, p):
        return p[0] * (w @ y) - p[1] * y * y

    return linear


FIELDS = ("chain", "elementwise", "linear", "kinetics")


def make_field(name: str, states: int):
    if name == "linear":
        return make_linear(states)
    return {"chain": chain, "elementwise": elementwise, "kinetics": kinetics}[name]


def stage_loop_replay(f, ts, y0, p):
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
            return ks.at[i].set(h * f(s + c[i] * h, y_i, p))

        ks = jax.lax.fori_loop(0, stages, stage, jnp.zeros((stages,) + y.shape))
        return y + jnp.tensordot(b, ks, axes=1), None

    y, _ = jax.lax.scan(jax.checkpoint(step), y0, (ts[:-1], ts[1:]))
    return y


def case(field: str, states: int, n: int, repeats: int) -> list[str]:
    f = make_field(field, states)
    y0s = jnp.linspace(0.1, 1.0, states) * (1 + 0.1 * jnp.arange(n)[:, None] / n)
    p = jnp.array([0.5, 0.3])
    kw = dict(stepsize_controller=gs.PIDController(rtol=1e-8, atol=1e-8))
    term = gs.ODETerm(f)
    mesh = gs.record_ensemble(term, gs.Tsit5(), 0.0, 2.0, None, y0s, p, **kw).trim()
    # Every trajectory's steps, padded with zero-length ones (as the mesh holds them).
    ts = mesh.ts[:, : mesh.max_steps + 1]

    def solved(lib):
        ctrl = lib.PIDController(rtol=1e-8, atol=1e-8)

        def one(y0, a):
            sol = lib.diffeqsolve(
                lib.ODETerm(f), lib.Tsit5(), 0.0, 2.0, None, y0, a,
                stepsize_controller=ctrl,
            )  # fmt: skip
            return sol.ys[-1]

        return lambda a: jax.vmap(one, in_axes=(0, None))(y0s, a)

    finals = {
        "replay": lambda a: gs.replay(mesh, term, gs.Tsit5(), y0s, a).ys[:, -1],
        "one-call": solved(gs),
        "stage loop": lambda a: jax.vmap(
            lambda ts, y0, a: stage_loop_replay(f, ts, y0, a), (0, 0, None)
        )(ts, y0s, a),
        "diffrax": solved(diffrax),
    }
    times, grads = time_gradients(finals, p, repeats)
    want = np.asarray(grads["diffrax"](p))
    rows = []
    for name, t in times.items():
        gap = np.max(np.abs(np.asarray(grads[name](p)) - want) / np.abs(want))
        rows.append(
            f"| {field} | {states} | {n} | {int(mesh.max_steps)} | {name} "
            f"| {1e3 * t['min_s']:.2f} | {1e3 * t['median_s']:.2f} "
            f"| {t['first_s']:.1f} "
            f"| {times['diffrax']['min_s'] / t['min_s']:.2f}x | {gap:.1e} |"
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fields", default="chain")
    parser.add_argument("--states", type=int, default=48)
    parser.add_argument("--sizes", default="64")
    parser.add_argument("--repeats", type=int, default=10)
    opts = parser.parse_args()
    fields = opts.fields.split(",")
    for name in fields:
        if name not in FIELDS:
            parser.error(f"--fields: {name!r} is not one of {', '.join(FIELDS)}")
    print(
        "| field | states | N | steps | gradient | min ms | median ms | first call s "
        "| speed-up vs Diffrax (min) | gradient vs Diffrax |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for field in fields:
        for n in map(int, opts.sizes.split(",")):
            for row in case(field, opts.states, n, opts.repeats):
                print(row, flush=True)


if __name__ == "__main__":
    sys.exit(main())
