"""Diffrax's example notebooks, run with gradsolve swapped in: do they still agree?

Given a Diffrax source tree (at the tag of the installed Diffrax; its notebooks are
not part of this repository), takes each example notebook that calls `Tsit5`,
`Dopri5` or `diffeqsolve`, shrinks its work with a few substitutions kept below
(fewer training steps, smaller datasets and widths), and runs its code cells twice,
each time in a fresh Python process:

- baseline: Diffrax as installed;
- swapped: before the notebook's code, `diffrax.diffeqsolve`, `diffrax.Tsit5` and
  `diffrax.Dopri5` are replaced by gradsolve's (whose fallback calls Diffrax's own
  `diffeqsolve`, so SDE, CDE and other-solver notebooks exercise the fallback).

Both runs must exit 0, and they must print the same numbers: every number the
notebook prints (timings masked), in order, and a summary appended after the last
cell (for each global that is a solution, a floating JAX array, or a container or
notebook-defined Equinox module holding such arrays, in sorted name order: shape,
sum, largest magnitude and count of non-finite entries of each array, and a
solution's step counts; the value of a cell's last expression, which Jupyter would
display, is kept as `_cell<i>_out`). Numbers agree when within `--rtol` (default
1e-8 in float64, 1e-4 in float32) relative to the larger, `--atol` absolute, or one
unit in the last printed digit; `LOOSE` below names the notebooks that amplify
round-off, and their looser tolerance. Two substitutions are compatibility fixes
for the installed versions, not size (kalman_filter, underdamped_langevin_example).

In the swapped run `diffrax.diffeqsolve` is a thin wrapper that counts, per trace,
how many solves gradsolve ran itself and how many it passed on to Diffrax (the last
column of the table); `--plain-swap` assigns `gs.diffeqsolve` itself instead.

```bash
python benchmarks/diffrax_examples.py /tmp/diffrax-src                # float64
python benchmarks/diffrax_examples.py /tmp/diffrax-src --float32
python benchmarks/diffrax_examples.py /tmp/diffrax-src --notebooks hessian,forcing
```

Needs optax and imageio besides the test extra (scipy, matplotlib). Runs are
sequential, one process at a time. Writes a markdown table to stdout and JSON to
`benchmarks/results/diffrax_examples.json` (`diffrax_examples_float32.json`), keeping
earlier notebooks' results when running a subset.
"""

import argparse
import ast
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time


HERE = pathlib.Path(__file__).resolve().parent

# Notebooks left out, and why.
EXCLUDED = {
    "symbolic_regression": "needs PySR (Julia) and sympy2jax; solves nothing itself, "
    "it `%run`s neural_ode",
}

# Per notebook: (pattern, replacement) regex substitutions applied to each code
# cell. Each must match at least once somewhere in the notebook (else the notebook
# has changed and the table needs a look). `{examples}` in a replacement is the
# absolute path of the tree's docs/examples folder. Replacements are literal text.
SHRINK = {
    "continuous_normalising_flow": [
        (
            r'main\(in_path="\.\./imgs/cat\.png"\)',
            'main(in_path="{examples}/../imgs/cat.png", batch_size=16, '
            "virtual_batches=1, steps=1, num_blocks=1, width_size=8, depth=1, "
            "print_every=1)",
        ),
        (r"num_samples = 5000", "num_samples = 16"),
    ],
    "coupled_odes": [],
    "forcing": [],
    "hessian": [],
    "kalman_filter": [
        (r"main\(n_gradient_steps=100\)", "main(n_gradient_steps=4, print_every=1)"),
        # Compatibility, not size: with the installed Optax, `opt.update` of
        # gradients filtered by `filter_spec` needs a state of the same structure.
        (r"opt\.init\(kmf\)", "opt.init(eqx.filter(kmf, filter_spec))"),
    ],
    "latent_ode": [
        (
            r"^main\(\)",
            "main(dataset_size=64, batch_size=16, steps=3, save_every=2, "
            "hidden_size=8, latent_size=8, width_size=8)",
        ),
    ],
    "neural_cde": [
        (
            r"^main\(\)",
            "main(dataset_size=64, batch_size=16, steps=3, width_size=16)",
        ),
    ],
    "neural_ode": [
        (
            r"= main\(\)",
            "= main(dataset_size=64, steps_strategy=(2, 2), width_size=16, "
            "print_every=1)",
        ),
    ],
    "neural_sde": [
        (
            r"^main\(\)",
            "main(batch_size=32, steps=3, steps_per_print=1, dataset_size=128, "
            "hidden_size=8, width_size=8)",
        ),
        (
            r"num_samples = min\(50, dataset_size\)",
            "num_samples = min(8, dataset_size)",
        ),
    ],
    "nonlinear_heat_pde": [],
    "sde_example": [
        (r"num_samples = 100\b", "num_samples = 16"),
        (r"num_steps = 191\b", "num_steps = 4"),
        (r"if i % 10 == 0:", "if True:"),
    ],
    "steady_state": [(r"for step in range\(100\):", "for step in range(5):")],
    "stiff_ode": [],
    "underdamped_langevin_example": [
        # Compatibility, not size: Diffrax 0.7.2 calls grad_f(x, args).
        (r"lambda x: 2 \* x", "lambda x, args: 2 * x"),
    ],
}

# Notebooks whose numbers amplify round-off, compared with a looser relative
# tolerance (unless --rtol is given): (rtol, why).
LOOSE = {
    "neural_cde": (
        1e-2,
        "rtol=1e-3 adaptive steps over a cubic-spline control: in Diffrax alone, "
        "moving y0 by one ulp changes the steps taken and the loss by ~1e-3",
    ),
}

# Printed text that differs from run to run, masked before numbers are read.
VOLATILE = [
    r"(?i)computation time:\s*\S+",
    r"\bin [-+0-9.eE]+ seconds",
]

USES = re.compile(r"\b(Tsit5|Dopri5|diffeqsolve)\b")
NUMBER = re.compile(
    r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|\b(?:nan|inf)\b"
)
MARK = "=== diffrax_examples summary ==="

SWAP = """\
import diffrax
import gradsolve as gs

diffrax.diffeqsolve = gs.diffeqsolve
diffrax.Tsit5 = gs.Tsit5
diffrax.Dopri5 = gs.Dopri5
"""

# With --count-paths: the swapped `diffrax.diffeqsolve` is a thin wrapper around
# `gs.diffeqsolve` that counts, per trace or eager call, whether gradsolve solved it
# (a `gs.Solution` came back) or passed it on to Diffrax (a `diffrax.Solution`).
COUNT = """\
import functools as _functools

_diffrax_examples_paths = {"gradsolve": 0, "fallback": 0}


@_functools.wraps(gs.diffeqsolve)
def _diffrax_examples_counted(*args, **kwargs):
    out = gs.diffeqsolve(*args, **kwargs)
    which = "gradsolve" if isinstance(out, gs.Solution) else "fallback"
    _diffrax_examples_paths[which] += 1
    return out


diffrax.diffeqsolve = _diffrax_examples_counted
"""
PATHS = "=== diffrax_examples paths ==="

EPILOGUE = """
def _diffrax_examples_summary(namespace, mark):
    import json

    import diffrax
    import equinox as eqx
    import jax
    import numpy as np

    def is_solution(v):
        return type(v).__name__ == "Solution" and hasattr(v, "ys") and hasattr(v, "ts")

    def is_float(x):
        return isinstance(x, jax.Array) and jax.numpy.issubdtype(
            x.dtype, jax.numpy.inexact
        )

    def stats(x):
        a = np.abs(np.asarray(x)).astype(np.float64) if np.iscomplexobj(x) else (
            np.asarray(x, dtype=np.float64)
        )
        finite = np.isfinite(a)
        return {
            "shape": list(a.shape),
            "sum": float(a[finite].sum()),
            "max_abs": float(np.abs(a[finite]).max()) if finite.any() else 0.0,
            "nonfinite": int((~finite).sum()),
        }

    def tree(v):
        out = {}
        flat, _ = jax.tree_util.tree_flatten_with_path(v, is_leaf=is_solution)
        for path, leaf in flat:
            key = jax.tree_util.keystr(path)
            if is_solution(leaf):
                out.update({key + k: s for k, s in solution(leaf).items()})
            elif is_float(leaf):
                out[key] = stats(leaf)
        return out

    def solution(sol):
        out = {}
        out.update({".ts" + k: s for k, s in tree(sol.ts).items()})
        out.update({".ys" + k: s for k, s in tree(sol.ys).items()})
        for k in ("num_steps", "num_accepted_steps", "num_rejected_steps"):
            if isinstance(sol.stats, dict) and k in sol.stats:
                out[".stats." + k] = {"sum": float(np.sum(np.asarray(sol.stats[k])))}
        ok = np.asarray(sol.result == diffrax.RESULTS.successful)
        out[".result_successful"] = {"all": bool(ok.all())}
        return out

    summary = {}
    for name in sorted(namespace):
        if name.startswith("__"):
            continue
        v = namespace[name]
        if is_solution(v):
            entries = solution(v)
        elif is_float(v):
            entries = {"": stats(v)}
        elif isinstance(v, (tuple, list, dict)) or (
            isinstance(v, eqx.Module) and type(v).__module__ == "__main__"
        ):
            try:
                entries = tree(v)
            except Exception:
                continue
        else:
            continue
        summary.update({name + k: s for k, s in entries.items()})
    print(mark)
    print(json.dumps(summary, sort_keys=True))


_diffrax_examples_summary(dict(globals()), MARK_TEXT)
""".replace("MARK_TEXT", repr(MARK))


def code_cells(path):
    with open(path) as f:
        nb = json.load(f)
    return [
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        for c in nb["cells"]
        if c["cell_type"] == "code"
    ]


def prepare(cells, subs, examples):
    """The notebook as one script: magics and plt.show() removed, substitutions
    applied, each cell's last expression kept as `_cell<i>_out`."""
    hits = [0] * len(subs)
    out = []
    for i, src in enumerate(cells):
        lines = []
        for line in src.splitlines():
            stripped = line.lstrip()
            indent = line[: len(line) - len(stripped)]
            if stripped.startswith(("%", "!")):
                line = indent + "pass  # (magic removed)" if indent else ""
            elif re.fullmatch(r"plt\.show\(\)\s*(#.*)?", stripped):
                line = indent + "pass  # (plt.show removed)"
            lines.append(line)
        src = "\n".join(lines)
        for j, (pattern, repl) in enumerate(subs):
            repl = repl.replace("{examples}", str(examples))
            src, n = re.subn(pattern, lambda m, r=repl: r, src, flags=re.MULTILINE)
            hits[j] += n
        src = _keep_last_expression(src, i)
        out.append(f"# ---- cell {i}\n{src}\n")
    missing = [subs[j][0] for j, n in enumerate(hits) if n == 0]
    if missing:
        raise ValueError(f"substitutions matched nothing: {missing}")
    return "\n".join(out)


def _keep_last_expression(src, i):
    try:
        body = ast.parse(src).body
    except SyntaxError:
        return src
    if not body or not isinstance(body[-1], ast.Expr):
        return src
    node = body[-1]
    lines = src.splitlines()
    k = node.lineno - 1
    lines[k] = (
        lines[k][: node.col_offset] + f"_cell{i}_out = " + lines[k][node.col_offset :]
    )
    return "\n".join(lines)


def run(script, swapped, float32, timeout, count=True):
    """Runs the script in a fresh process in a fresh folder."""
    prologue = (SWAP + (COUNT if count else "")) if swapped else ""
    text = prologue + "\n" + script + EPILOGUE
    if swapped and count:
        text += f"\nprint({PATHS!r})\n"
        text += "print(__import__('json').dumps(_diffrax_examples_paths))\n"
    env = dict(os.environ, MPLBACKEND="Agg", JAX_ENABLE_X64="0" if float32 else "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "notebook.py")
        with open(path, "w") as f:
            f.write(text)
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, path],
                cwd=tmp,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc = "timeout"
            stdout = _text(e.stdout)
            stderr = _text(e.stderr)
        seconds = time.perf_counter() - start
    stdout, _, paths = stdout.partition(PATHS)
    try:
        paths = json.loads(paths) if paths.strip() else None
    except json.JSONDecodeError:
        paths = None
    printed, _, summary = stdout.partition(MARK)
    try:
        summary = json.loads(summary) if summary.strip() else None
    except json.JSONDecodeError:
        summary = None
    return {
        "rc": rc,
        "seconds": round(seconds, 1),
        "stdout": printed,
        "summary": summary,
        "paths": paths,
        "stderr_tail": "\n".join(stderr.strip().splitlines()[-12:]),
    }


def _text(b):
    if b is None:
        return ""
    return b.decode(errors="replace") if isinstance(b, bytes) else b


def numbers(text):
    """(value, unit in the last printed digit) of each number printed, in order."""
    for pattern in VOLATILE:
        text = re.sub(pattern, "<masked>", text)
    out = []
    for m in NUMBER.finditer(text):
        tok = m.group(0)
        value = float(tok)
        mant, _, exp = tok.lower().partition("e")
        decimals = len(mant.split(".")[1]) if "." in mant else 0
        ulp = 10.0 ** (int(exp or 0) - decimals)
        out.append((tok, value, ulp))
    return out


def _flatten_summary(summary):
    out = []
    for name in sorted(summary):
        for stat in sorted(summary[name]):
            v = summary[name][stat]
            out.append((f"{name}:{stat}", v))
    return out


def compare(base, swap, rtol, atol):
    """Max relative difference and the values that disagree."""
    bad, worst = [], 0.0

    def check(where, a, b, ulp=0.0):
        nonlocal worst
        if any(x is None or isinstance(x, (list, bool, str)) for x in (a, b)):
            if a != b:
                bad.append(f"{where}: {a} vs {b}")
            return
        if math.isnan(a) and math.isnan(b) or a == b:
            return
        scale = max(abs(a), abs(b))
        diff = abs(a - b)
        if math.isinf(diff) or math.isnan(diff):
            bad.append(f"{where}: {a!r} vs {b!r}")
            return
        rel = diff / max(scale, atol / rtol)
        worst = max(worst, rel)
        if diff > rtol * scale + atol and diff > ulp * 1.0000001:
            bad.append(f"{where}: {a!r} vs {b!r} (rel {rel:.2e})")

    nb, ns = numbers(base["stdout"]), numbers(swap["stdout"])
    if len(nb) != len(ns):
        bad.append(f"printed {len(nb)} numbers in the baseline, {len(ns)} swapped")
    for k, ((tb, a, ua), (ts, b, ub)) in enumerate(zip(nb, ns)):
        check(f"printed #{k}", a, b, max(ua, ub))
    sb, ss = base["summary"] or {}, swap["summary"] or {}
    if base["summary"] is None or swap["summary"] is None:
        bad.append("no summary")
    for name in sorted(set(sb) ^ set(ss)):
        bad.append(f"{name}: only in the {'baseline' if name in sb else 'swapped'} run")
    for name in sorted(set(sb) & set(ss)):
        for stat in sorted(set(sb[name]) | set(ss[name])):
            check(f"{name} {stat}", sb[name].get(stat), ss[name].get(stat))
    return worst, bad, len(nb) + sum(len(v) for v in sb.values())


def _status(r):
    if r["rc"] == 0:
        return "ok"
    return "TIMEOUT" if r["rc"] == "timeout" else f"FAIL (rc={r['rc']})"


def table(results, names):
    lines = [
        "| notebook | baseline | swapped | values agree (max rel diff) "
        "| seconds (baseline / swapped) | swapped solves: gradsolve / fallback |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        r = results[name]
        b, s = r["baseline"], r["swapped"]
        if b["rc"] != 0 or s["rc"] != 0:
            agree = "—"
        else:
            word = "yes" if r["agree"] else f"NO ({len(r['mismatches'])} differ)"
            agree = f"{word} ({r['max_rel_diff']:.1e}, {r['n_values']} values)"
            if name in LOOSE:
                agree += f" at rtol {r.get('rtol')}"
        p = s.get("paths")
        paths = f"{p['gradsolve']} / {p['fallback']}" if p else "—"
        lines.append(
            f"| {name} | {_status(b)} | {_status(s)} | {agree} "
            f"| {b['seconds']} / {s['seconds']} | {paths} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", help="a Diffrax source tree (with docs/examples/)")
    parser.add_argument("--notebooks", help="comma-separated names (default: all)")
    parser.add_argument("--float32", action="store_true", help="JAX_ENABLE_X64=0")
    parser.add_argument("--rtol", type=float, help="default 1e-8 (float32: 1e-4)")
    parser.add_argument("--atol", type=float, help="default 1e-12 (float32: 1e-6)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--out", help="JSON output (default benchmarks/results/...)")
    parser.add_argument("--keep", help="also write the generated scripts here")
    parser.add_argument(
        "--plain-swap",
        action="store_true",
        help="assign gs.diffeqsolve itself, without the wrapper counting which "
        "solves gradsolve ran and which it passed on to Diffrax",
    )
    a = parser.parse_args()
    rtol = a.rtol if a.rtol is not None else (1e-4 if a.float32 else 1e-8)
    atol = a.atol if a.atol is not None else (1e-6 if a.float32 else 1e-12)
    out = a.out or str(
        HERE / "results" / f"diffrax_examples{'_float32' if a.float32 else ''}.json"
    )
    examples = (pathlib.Path(a.tree) / "docs" / "examples").resolve()

    available = {}
    for path in sorted(examples.glob("*.ipynb")):
        cells = code_cells(path)
        if any(USES.search(c) for c in cells):
            available[path.stem] = cells
    if a.notebooks:
        names = a.notebooks.split(",")
        unknown = [n for n in names if n not in available]
        if unknown:
            parser.error(f"no such notebook using the solvers: {unknown}")
    else:
        names = [n for n in available if n not in EXCLUDED]
        for n, why in EXCLUDED.items():
            if n in available:
                print(f"excluded {n}: {why}", flush=True)

    results = {}
    if os.path.exists(out):  # keep earlier notebooks' results when running a subset
        with open(out) as f:
            results.update(json.load(f).get("notebooks", {}))
    for name in names:
        if name not in SHRINK:
            print(f"{name}: no shrink table entry, running it unchanged", flush=True)
        script = prepare(available[name], SHRINK.get(name, []), examples)
        if a.keep:
            os.makedirs(a.keep, exist_ok=True)
            with open(os.path.join(a.keep, f"{name}.py"), "w") as f:
                f.write(script + EPILOGUE)
        base = run(script, False, a.float32, a.timeout)
        print(f"{name} [baseline]: {_status(base)} in {base['seconds']} s", flush=True)
        swap = run(script, True, a.float32, a.timeout, count=not a.plain_swap)
        print(f"{name} [swapped]: {_status(swap)} in {swap['seconds']} s", flush=True)
        r = {"baseline": base, "swapped": swap}
        if base["rc"] == 0 and swap["rc"] == 0:
            tol = LOOSE[name][0] if name in LOOSE and a.rtol is None else rtol
            worst, bad, count = compare(base, swap, tol, atol)
            r.update(agree=not bad, max_rel_diff=worst, mismatches=bad, n_values=count)
            r.update(rtol=tol)
            for line in bad[:10]:
                print(f"  differs: {line}", flush=True)
        else:
            r.update(agree=False, max_rel_diff=None, mismatches=[], n_values=0)
            for which, run_ in (("baseline", base), ("swapped", swap)):
                if run_["rc"] != 0:
                    tail = run_["stderr_tail"].splitlines()[-4:]
                    print(f"  {which}: " + "\n    ".join(tail), flush=True)
        for run_ in (base, swap):  # keep the JSON small
            run_["stdout_tail"] = run_.pop("stdout")[-2000:]
        results[name] = r
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            meta = {"float32": a.float32, "rtol": rtol, "atol": atol}
            json.dump({"settings": meta, "notebooks": results}, f, indent=1)
    print(table(results, [n for n in sorted(results) if n in available]))


if __name__ == "__main__":
    main()
