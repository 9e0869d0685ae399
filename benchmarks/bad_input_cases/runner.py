"""Running the cases, and reporting what came back.

[`main`][] builds the cases of the families asked for, runs each
([`run_case`][]), prints a markdown table of outcomes per family ([`table`][]) and
the cases that are neither a clear error nor a correct answer
([`exceptions_list`][]), and writes `benchmarks/results/bad_inputs.json`.
"""

import argparse
import collections
import gc
import json
import pathlib
import platform
import re
import sys
import time
import traceback
import warnings

import diffrax
import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
import optimistix as optx

import gradsolve as gs

from .case import FAMILIES, OUTCOMES, Case, classify, first_line, gradsolve_frame, valid
from .controllers import controllers_cases
from .defaults import DEFAULTS_TEXT
from .ensembles import ensembles_cases
from .files import files_cases
from .fitting import fitting_cases
from .meshes import meshes_cases
from .states import states_cases
from .times import times_cases


RESULTS = pathlib.Path(__file__).resolve().parent.parent / "results" / "bad_inputs.json"


BUILDERS = {
    "times": times_cases,
    "states": states_cases,
    "controllers": controllers_cases,
    "meshes": meshes_cases,
    "files": files_cases,
    "ensembles": ensembles_cases,
    "fitting": fitting_cases,
}


def to_numpy(tree):
    """Wait for a result, and turn its arrays into NumPy arrays."""
    tree = jax.block_until_ready(tree)
    return jtu.tree_map(lambda x: np.asarray(x) if eqx.is_array_like(x) else x, tree)


def run_case(case: Case) -> dict:
    """Run one case and its reference, and classify the outcome.

    **Arguments:**

    - `case`: the [`Case`][] to run.

    **Returns:**

    The record of the case: its input, outcome, exception and message, where in
    gradsolve it was raised, what the reference did, the warnings, the seconds.
    """
    start = time.perf_counter()
    ref = ref_error = None
    if case.reference is not None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ref = to_numpy(case.reference())
        except Exception as e:
            ref_error = e
    got = error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got = to_numpy(case.call())
            jax.effects_barrier()
        except Exception as e:
            error = e
    outcome, detail = classify(case, got, error, ref, ref_error)
    warned = [f"{w.category.__name__}: {first_line(w.message, 160)}" for w in caught]
    return {
        "family": case.family,
        "name": case.name,
        "input": case.what,
        "expected": case.expected,
        "keyword": case.keyword,
        "outcome": outcome,
        "detail": detail,
        "exception": None if error is None else type(error).__name__,
        "message": first_line(error),
        "where": gradsolve_frame(error),
        "reference": (
            None
            if case.reference is None
            else (
                f"raises {type(ref_error).__name__}: {first_line(ref_error, 160)}"
                if ref_error is not None
                else ("answers" if valid(ref) else "answers with NaN or a failure")
            )
        ),
        "warnings": warned[:3],
        "seconds": round(time.perf_counter() - start, 3),
    }


# ------------------------------------------------------------------ the report


def table(records: list[dict]) -> str:
    """A markdown table of the outcomes per family, and in all."""
    counts = collections.defaultdict(collections.Counter)
    for r in records:
        counts[r["family"]][r["outcome"]] += 1
    plural = {"refused": "refused", "crash": "crashes"}
    head = ["family", "tried"] + [plural.get(o, o + "s") for o in OUTCOMES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    total = collections.Counter()
    for family in FAMILIES:
        if family not in counts:
            continue
        c = counts[family]
        total.update(c)
        row = [family, str(sum(c.values()))] + [str(c[o]) for o in OUTCOMES]
        lines.append("| " + " | ".join(row) + " |")
    row = ["**all**", f"**{sum(total.values())}**"]
    row += [f"**{total[o]}**" for o in OUTCOMES]
    lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def exceptions_list(records: list[dict]) -> str:
    """The cases that are neither a clear error nor a correct answer, in markdown."""
    lines = []
    for r in records:
        if r["outcome"] in ("clear error", "correct answer"):
            continue
        what = r["exception"] or "no exception"
        lines.append(
            f"- **{r['outcome']}** ({r['family']}) {r['name']}: `{r['input']}`"
        )
        lines.append(f"  - gradsolve: {what}: {r['message'] or r['detail']}")
        if r["exception"] and r["detail"]:
            lines.append(f"  - {r['detail']}")
        if r["where"]:
            lines.append(f"  - raised in `{r['where']}`")
        if r["reference"]:
            lines.append(f"  - Diffrax/reference: {r['reference']}")
    return "\n".join(lines)


def main(opts: argparse.Namespace, description: str) -> None:
    """Build the cases of the families asked for; list them, or run and report.

    **Arguments:**

    - `opts`: the parsed command line of `benchmarks/bad_inputs.py` (`family`,
        `json`, `list`, `match`, `verbose`).
    - `description`: the first line of its docstring, written into the JSON.

    **Returns:**

    Nothing: prints the table and the cases that are neither a clear error nor a
    correct answer, and writes the JSON where `opts` or a full run asks for it.
    """
    families = opts.family or list(FAMILIES)
    cases = [c for f in families for c in BUILDERS[f]()]
    if opts.match:
        cases = [c for c in cases if re.search(opts.match, c.name)]
    if opts.list:
        for c in cases:
            print(f"{c.family:12} {c.expected:7} {c.name}: {c.what}")
        print(f"{len(cases)} cases")
        return
    records = []
    start = time.perf_counter()
    for i, case in enumerate(cases):
        if i and case.family != cases[i - 1].family:
            # Compiled programs are not shared across families: free them, so
            # that a full run stays within a few GB.
            jax.clear_caches()
            gc.collect()
        try:
            record = run_case(case)
        except Exception:  # a fault of this script: report it, go on
            traceback.print_exc()
            raise
        records.append(record)
        print(
            f"[{i + 1}/{len(cases)}] {record['outcome']:14} {case.family}: "
            f"{case.name} ({record['seconds']:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
        if opts.verbose:
            print(
                f"    {record['exception']}: {record['message']} {record['detail']}\n"
                f"    reference: {record['reference']}",
                file=sys.stderr,
            )
    wall = time.perf_counter() - start
    print(f"\n{len(records)} inputs tried in {wall:.0f} s.\n")
    print(table(records))
    print("\nNot a clear error or a correct answer:\n")
    print(exceptions_list(records) or "(none)")
    everything = opts.family is None and opts.match is None
    out = opts.json if opts.json else (RESULTS if everything else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        summary = collections.Counter(r["outcome"] for r in records)
        report = {
            "description": description,
            "defaults": DEFAULTS_TEXT,
            "date": time.strftime("%Y-%m-%d"),
            "wall_time_s": round(wall, 1),
            "versions": {
                "python": platform.python_version(),
                "jax": jax.__version__,
                "equinox": eqx.__version__,
                "diffrax": diffrax.__version__,
                "optimistix": optx.__version__,
                "gradsolve": gs.__version__,
            },
            "summary": {o: summary[o] for o in OUTCOMES} | {"tried": len(records)},
            "cases": records,
        }
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nwrote {out}")
