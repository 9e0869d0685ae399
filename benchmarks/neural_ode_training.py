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
batches, same steps. Reports per phase the first step (compilation included), the
median steady step, the speed-up against Diffrax's median, the final loss and the
number of recordings; writes `benchmarks/results/neural_ode_training.json` and
prints a markdown table.
"""

import argparse
import json
import pathlib
import platform
import sys

import diffrax
import jax


HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

import neural_ode_diffrax_style as example  # noqa: E402


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
    )
    (out / "neural_ode_training.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
