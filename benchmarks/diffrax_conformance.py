"""Diffrax's own test suite, run against gradsolve: the drop-in conformance table.

Given a Diffrax source tree at the tag of the installed Diffrax (its tests are not
part of this repository), runs each test file three ways and compares outcomes test
by test:

- `diffeqsolve`: `diffrax.Tsit5`, `diffrax.Dopri5` and `diffrax.diffeqsolve` are
  gradsolve's;
- `solvers`: only `diffrax.Tsit5` and `diffrax.Dopri5` are gradsolve's;
- `none` (the baseline): unpatched, Diffrax as installed, run on the cases that
  failed in a swapped run (`--full-baseline`: on all of them).

A case that fails swapped and passes in the baseline is a new failure;
`docs/limits.md` lists the tests that are expected to fail and why. Cases
parametrised only by solvers that are not gradsolve's (`diffrax.Kvaerno5()`, ...) are
skipped unless `--all-cases`: with either swap they run Diffrax unchanged.

```bash
git clone --branch v0.7.2 https://github.com/patrick-kidger/diffrax /tmp/diffrax-src
python benchmarks/diffrax_conformance.py /tmp/diffrax-src              # all files
python benchmarks/diffrax_conformance.py /tmp/diffrax-src --files test_vmap.py
```

The swap itself is a pytest plugin (`benchmarks/diffrax_swap.py`) chosen by the
environment variable `GRADSOLVE_SWAP` (`none`, `solvers` or `diffeqsolve`).
"""

import argparse
import collections
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET


FILES = (
    "test_integrate.py",
    "test_saveat_solution.py",
    "test_adaptive_stepsize_controller.py",
    "test_solver.py",
    "test_event.py",
    "test_detest.py",
    "test_global_interpolation.py",
    "test_adjoint.py",
    "test_vmap.py",
)
MODES = ("none", "solvers", "diffeqsolve")  # baseline first
HERE = pathlib.Path(__file__).resolve().parent


def run_file(tree, name, mode, workers, extra, ids=None, affected_only=True):
    """Outcome of the tests of one file (or only `ids`): {node id: outcome}, the
    outcome 'passed', 'skipped' or 'failed: <message>'."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.xml")
        env = dict(os.environ, GRADSOLVE_SWAP=mode)
        env["GRADSOLVE_AFFECTED_ONLY"] = "1" if affected_only else "0"
        env["PYTHONPATH"] = os.pathsep.join(
            [str(HERE), env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep)
        targets = list(ids) if ids is not None else [f"test/{name}"]
        cmd = [sys.executable, "-m", "pytest", *targets, "-p", "diffrax_swap", "-q"]
        cmd += ["-p", "no:cacheprovider", f"--junitxml={report}", *extra]
        if workers > 1:
            cmd += ["-n", str(workers)]
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        if not os.path.exists(report):
            if ids is None or len(ids) > 1:
                # The process died before writing its report (XLA, after many
                # compilations in one process): run each test in its own process.
                if ids is None:
                    ids = _collected_ids(tree, name, env)
                return _one_process_each(tree, name, mode, extra, affected_only, ids)
            why = f"failed: the process ended with code {proc.returncode}"
            return {ids[0]: f"{why}: {proc.stdout[-300:]}"}
        outcomes = {}
        for case in ET.parse(report).getroot().iter("testcase"):
            module = case.get("classname").replace(".", "/") + ".py"
            key = f"{module}::{case.get('name')}"
            problems = [c for c in case if c.tag in ("failure", "error")]
            if problems:
                message = (problems[0].get("message") or "").splitlines()
                outcomes[key] = "failed: " + (message[0][:200] if message else "")
            elif any(c.tag == "skipped" for c in case):
                outcomes[key] = "skipped"
            else:
                outcomes[key] = "passed"
        return outcomes


def _collected_ids(tree, name, env) -> list[str]:
    """The node ids of the tests of one file, as pytest collects them."""
    listing = subprocess.run(
        [sys.executable, "-m", "pytest", f"test/{name}", "-p", "diffrax_swap"]
        + ["-p", "no:cacheprovider", "--collect-only", "-q"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    ).stdout
    return [line for line in listing.splitlines() if line.startswith(f"test/{name}::")]


def _one_process_each(tree, name, mode, extra, affected_only, ids):
    """`run_file`'s outcomes of the tests `ids`, each run in a fresh process."""
    print(f"  {name} [{mode}]: one process per test ({len(ids)})", flush=True)
    outcomes = {}
    for i in ids:
        out = run_file(tree, name, mode, 1, extra, ids=[i], affected_only=affected_only)
        outcomes.update(out)
    return outcomes


def _count(outcomes, kind):
    return sum(v.startswith(kind) for v in outcomes.values())


def table(results, files):
    lines = [
        "| file | cases run | solvers swapped: passed / failed / new failures "
        "| diffeqsolve swapped: passed / failed / new failures |",
        "|---|---|---|---|",
    ]
    for name in files:
        r = results[name]
        base = r.get("none", {})
        row = [name, str(len(r.get("diffeqsolve", {})))]
        for mode in MODES[1:]:
            out = r.get(mode)
            if out is None:
                row.append("not run")
                continue
            new = _new_failures(base, out)
            row.append(
                f"{_count(out, 'passed')} / {_count(out, 'failed')} / {len(new)}"
            )
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _new_failures(base, out):
    """Failures in a swapped run of tests that the baseline passes (or did not
    run: a failure is new until the baseline shows otherwise)."""
    return {
        k: v
        for k, v in out.items()
        if v.startswith("failed") and not base.get(k, "").startswith("failed")
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", help="a Diffrax source tree (with its test/ folder)")
    parser.add_argument("--files", default=",".join(FILES))
    parser.add_argument("--modes", default="diffeqsolve,solvers")
    parser.add_argument("--workers", type=int, default=1, help="pytest-xdist workers")
    parser.add_argument(
        "--all-cases",
        action="store_true",
        help="also run cases parametrised only by Diffrax's other solvers",
    )
    parser.add_argument(
        "--full-baseline",
        action="store_true",
        help="run the whole baseline, not only the cases that failed swapped",
    )
    parser.add_argument("--out", default="benchmarks/results/diffrax_conformance.json")
    parser.add_argument(
        "--report", action="store_true", help="print the table of --out; run nothing"
    )
    parser.add_argument("pytest_args", nargs="*", help="passed on to pytest")
    a = parser.parse_args()
    files = a.files.split(",")
    results = collections.defaultdict(dict)
    if os.path.exists(a.out):  # keep earlier files' results when running a subset
        with open(a.out) as f:
            results.update(json.load(f))
    if a.report:
        print(table(results, [n for n in FILES if n in results]))
        return
    for name in files:
        # Only the modes run now are replaced: a run of one mode keeps the file's
        # results in the others.
        results[name] = dict(results.get(name, {}))
        for mode in a.modes.split(","):
            out = run_file(
                a.tree,
                name,
                mode,
                a.workers,
                a.pytest_args,
                affected_only=not a.all_cases,
            )
            results[name][mode] = out
            print(
                f"{name} [{mode}]: {_count(out, 'passed')} passed, "
                f"{_count(out, 'failed')} failed of {len(out)}",
                flush=True,
            )
        failed = sorted(
            {
                k
                for m in results[name].values()
                for k, v in m.items()
                if v.startswith("failed")
            }
        )
        if a.full_baseline or failed:
            ids = None if a.full_baseline else failed
            results[name]["none"] = run_file(
                a.tree,
                name,
                "none",
                a.workers,
                a.pytest_args,
                ids=ids,
                affected_only=not a.all_cases,
            )
        for mode in MODES[1:]:
            if mode in results[name]:
                new = _new_failures(results[name].get("none", {}), results[name][mode])
                for k, v in new.items():
                    print(f"  new failure [{mode}] {k}: {v}", flush=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    print(table(results, [n for n in FILES if n in results]))


if __name__ == "__main__":
    main()
