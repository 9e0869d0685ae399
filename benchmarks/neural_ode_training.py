"""Train the Diffrax-style neural ODE three ways, side by side in one process.

    python benchmarks/neural_ode_training.py                  # 100 steps a phase
    python benchmarks/neural_ode_training.py --steps 30 --width 32

Runs `examples/neural_ode_diffrax_style.py` (an `eqx.Module` MLP field, a batch of
32 series saved at `SaveAt(ts)`, PID rtol 1e-3 / atol 1e-6, float32, optax
AdaBelief, first 10% of each series then the whole): `diffrax` as written,
`swapped` (only `diffrax.diffeqsolve` / `diffrax.Tsit5` swapped for gradsolve's)
and `mesh` (recorded meshes replayed, re-recorded when stale or every
`--record-every` steps); and, as a reference, `floor`: the same step with no solve
at all, which is what the optimiser and the step's dispatch cost. Same seeds, same
batches, same steps. Also prints the gradient time of the cheapest possible replay
of a phase-1 batch (`replay_lower_bound`). Reports per phase the first step
(compilation included), the median steady step, the speed-up against Diffrax's
median, the final loss and the number of recordings; writes
`benchmarks/results/neural_ode_training.json` and prints a markdown table.
"""

import argparse
import json
import pathlib
import platform
import sys
import time

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

import neural_ode_diffrax_style as example  # noqa: E402


def replay_lower_bound(steps=3, batch=32, width=64, seed=5678, repeats=50):
    """The gradient of the cheapest possible replay of a phase-1 batch: `steps`
    equal Tsit5 steps (at the initial weights, every series of the first batch
    takes 2 or 3) over the first 10% of the series, written by hand on the
    batch (no controller, no error estimate, no saves but the last state,
    `jax.checkpoint` per step), at the example's initial weights. Returns the
    fastest of `repeats` calls in seconds: no replay of these steps costs less."""
    data_key, model_key, _ = jax.random.split(jax.random.key(seed), 3)
    ts, ys = example.dataset(256, 100, key=data_key)
    mlp = example.Field(2, width, 2, key=model_key).mlp
    tableau = diffrax.Tsit5.tableau
    a = [[float(w) for w in row] for row in tableau.a_lower]
    b = [float(w) for w in tableau.b_sol]
    y0, target, h = ys[:batch, 0], ys[:batch, 9], float(ts[9] - ts[0]) / steps

    def solve(mlp):
        f = jax.vmap(mlp)

        def step(y, _):
            ks = [f(y)]
            for row in a:
                ks.append(f(y + h * sum(w * k for w, k in zip(row, ks))))
            return y + h * sum(w * k for w, k in zip(b, ks)), None

        return jax.lax.scan(jax.checkpoint(step), y0, None, length=steps)[0]

    grad = eqx.filter_jit(
        eqx.filter_value_and_grad(lambda m: jnp.mean((solve(m) - target) ** 2))
    )
    jax.block_until_ready(grad(mlp))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(grad(mlp))
        times.append(time.perf_counter() - start)
    return float(np.min(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--record-every", type=int, default=10)
    parser.add_argument("--out", default=str(HERE / "results"))
    opts = parser.parse_args()
    results = example.main(
        steps=opts.steps,
        batch=opts.batch,
        width=opts.width,
        record_every=opts.record_every,
        ways=("diffrax", "swapped", "mesh", "floor"),
    )
    bound = replay_lower_bound(batch=opts.batch, width=opts.width)
    print(
        f"Lower bound of a replay's gradient (3 hand-written Tsit5 steps, phase 1, "
        f"{opts.batch} series): {1e3 * bound:.2f} ms"
    )
    out = pathlib.Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    record = dict(
        steps=opts.steps,
        width=opts.width,
        batch=opts.batch,
        record_every=opts.record_every,
        machine=platform.machine(),
        jax=jax.__version__,
        diffrax=diffrax.__version__,
        results=results,
        replay_lower_bound_s=bound,
    )
    (out / "neural_ode_training.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
