"""Bad and unusual inputs: what gradsolve's public API answers to each.

Tries a catalogue of inputs on `gs.diffeqsolve`, `gs.record`, `gs.replay`,
`gs.save_mesh`/`gs.load_mesh`, `gs.record_ensemble`/`gs.replay_ensemble` and
`gs.fit`, one call per case, and classifies what comes back:

- **clear error**: a `ValueError`, `TypeError` or `RuntimeError` (inside `jit`, the
    `EquinoxRuntimeError`/`JaxRuntimeError` of `eqx.error_if`) whose message names
    the offending argument or the fix (each case gives a pattern the message must
    match);
- **correct answer**: no exception, and the result equals the reference: Diffrax's
    `diffrax.diffeqsolve` on the same inputs (float64, relative 1e-9), or a closed
    form;
- **unclear error**: an error of those types whose message does not say what is
    wrong, or a failure code returned where an error is due;
- **refused**: an error where the reference returns a valid answer (Diffrax solves
    it: gradsolve must return the same, or fall back to Diffrax);
- **wrong answer**: no exception, and the result differs from the reference, holds
    NaN or inf where the reference does not, or reports success where the
    reference fails (or where no answer exists);
- **crash**: any other exception (`IndexError`, `KeyError`, `AttributeError`, an
    `OSError` where a `ValueError` is due, JAX's tracer errors, ...).

A case that should be an error but which Diffrax answers (successfully, without
NaN) is held to Diffrax's answer instead. The families:

- `times`: non-finite, zero, wrong-sign, integer, boolean, array and reversed
    times, `saveat.ts` unsorted, out of range, with NaN, empty or 2-d, time
    derivatives; eagerly and under `jit`;
- `states`: `y0` with NaN/inf, of integer, boolean, complex or float32 dtype,
    `None`, scalar, nested, with zero-size leaves; vector fields returning the
    wrong shape, structure or dtype, or NaN;
- `controllers`: tolerances negative, zero or NaN, `max_steps`, `dtmin`/`dtmax`,
    `ConstantStepSize`/`StepTo` misuse, solvers gradsolve does not have (which
    fall back to Diffrax), a stiff problem on an explicit solver;
- `meshes`: replays with another state, dtype, solver or problem, failed and
    stale meshes, bad `stale=`;
- `files`: damaged, crafted and misplaced mesh files;
- `ensembles`: `chunk_size`, `memory_budget`, batch mismatches, scalar leaves;
- `fitting`: `gs.fit` with no experiments, data of the wrong shape, NaN
    parameters, zero weights, ...

Usage:

```bash
python benchmarks/bad_inputs.py                   # every family; writes the JSON
python benchmarks/bad_inputs.py --family times    # one family (no JSON unless --json)
python benchmarks/bad_inputs.py --list            # the cases, without running them
python benchmarks/bad_inputs.py --match stale --verbose   # some cases (no JSON)
```

Prints a markdown table (per family: tried, clear errors, correct answers, unclear
errors, refused, crashes, wrong answers) and every case that is neither a clear
error nor a correct answer, with its input and what happened. A full run writes
`benchmarks/results/bad_inputs.json`. Every problem is tiny (y' = -k y on [0, 1]
unless named): compilation dominates, a few minutes on one CPU core.

The cases, one module per family, and the runner are in the package
`benchmarks/bad_input_cases/`; this script is its command line.
"""

import argparse
import pathlib
import sys


HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bad_input_cases import runner  # noqa: E402
from bad_input_cases.case import FAMILIES  # noqa: E402


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, action="append")
    parser.add_argument("--json", type=pathlib.Path, default=None)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--match", default=None, help="only cases whose name matches")
    parser.add_argument("--verbose", action="store_true", help="print each message")
    return parser.parse_args()


def main():
    runner.main(_parse(), __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
