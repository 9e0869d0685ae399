"""The machine and versions, the markdown table, and the JSON of raw numbers."""

import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path

import jax
import numpy as np


PACKAGES = [
    "gradsolve",
    "jax",
    "jaxlib",
    "diffrax",
    "equinox",
    "numpy",
    "scipy",
    "torch",
    "torchode",
    "matplotlib",
]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str:
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "../gradsolve"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        return commit.strip() + (" (gradsolve/ modified)" if dirty.strip() else "")
    except Exception:
        return "unknown"


def environment() -> dict:
    """Where and with what the numbers were taken."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "gradsolve_commit": _git_commit(),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "versions": versions,
    }


def environment_lines(env: dict) -> list[str]:
    """The environment as a few human-readable lines."""
    v = env["versions"]
    return [
        f"platform: {env['platform']} ({env['machine']}), CPU: {env['cpu']}, "
        f"{env['cpu_count']} cores, Python {env['python']}",
        f"JAX {v['jax']} (jaxlib {v['jaxlib']}) on {env['jax_backend']}: "
        f"{', '.join(env['jax_devices'])}; Diffrax {v['diffrax']}, equinox "
        f"{v['equinox']}, gradsolve {v['gradsolve']} at {env['gradsolve_commit']}",
        f"torch {v['torch']}, torchode {v['torchode']}, SciPy {v['scipy']}, "
        f"NumPy {v['numpy']}",
    ]


def _ms(t: dict | None) -> str:
    if t is None:
        return "—"
    if "failed" in t:
        return "failed"
    return f"{1e3 * t['min_s']:.3g} / {1e3 * t['median_s']:.3g}"


def _compile(*ts) -> str:
    parts = [f"{t['compile_s']:.1f}" for t in ts if t is not None and "compile_s" in t]
    return " / ".join(parts) if parts else "—"


def _speedup(ref: dict | None, t: dict | None) -> str:
    if not ref or not t or "min_s" not in ref or "min_s" not in t:
        return "—"
    return f"{ref['min_s'] / t['min_s']:.2f}x"


def table_rows(case: dict) -> list[list[str]]:
    """The rows of one case: gradsolve, gradsolve record + gradient, then the others."""
    tools = case["tools"]
    d_ops = tools.get("diffrax", {}).get("ops", {})
    d_fwd, d_grad = d_ops.get("forward"), d_ops.get("gradient")
    head = [case["problem"], str(case["n"]), case["dtype"]]
    rows = []

    def add(label, fwd, grad, compile_parts, entry):
        err = "—"
        if isinstance(entry.get("error"), float):
            err = f"{entry['error']:.1e} / {entry['error_median']:.1e}"
        speed = f"{_speedup(d_fwd, fwd)} / {_speedup(d_grad, grad)}"
        rows.append(
            head + [label, _ms(fwd), _ms(grad), _compile(*compile_parts), err, speed]
        )

    for name, entry in tools.items():
        if "failed" in entry:
            rows.append(head + [name, "failed", "failed", "—", "—", "—"])
            continue
        ops = entry["ops"]
        if name == "gradsolve":
            add(
                "gradsolve",
                ops.get("forward"),
                ops.get("gradient"),
                [ops.get("forward"), ops.get("gradient")],
                entry,
            )
            add(
                "gradsolve record + gradient",
                ops.get("record"),
                ops.get("record+gradient"),
                [ops.get("record"), ops.get("gradient")],
                entry,
            )
            if "solve_gradient" in ops:
                add(
                    "gradsolve one-call gradient",
                    ops.get("forward"),
                    ops.get("solve_gradient"),
                    [ops.get("forward"), ops.get("solve_gradient")],
                    entry,
                )
        elif name == "scipy":
            label = f"scipy RK45 ({entry['info']['trajectories_solved']} traj., scaled)"
            add(label, ops.get("forward"), None, [], entry)
        else:
            add(
                name,
                ops.get("forward"),
                ops.get("gradient"),
                [ops.get("forward"), ops.get("gradient")],
                entry,
            )
    return rows


HEADER = [
    "problem",
    "N",
    "dtype",
    "tool",
    "forward ms (min / median)",
    "gradient ms (min / median)",
    "compile s (fwd / grad)",
    "error (max / median)",
    "speed-up vs Diffrax (fwd / grad)",
]


def markdown_table(cases: list[dict]) -> str:
    """All cases as one markdown table."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for case in cases:
        for row in table_rows(case):
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def checks_lines(cases: list[dict]) -> list[str]:
    """One line per case: gradsolve's gradient against Diffrax's."""
    out = []
    for c in cases:
        g = c["tools"].get("gradsolve", {}).get("gradient_vs_diffrax")
        t = c["tools"].get("torchode", {}).get("gradient_vs_diffrax")
        text = f"{g:.2e}" if g is not None else "not available"
        extra = f" (torchode, its own steps: {t:.2e})" if t is not None else ""
        out.append(
            f"- {c['problem']}, N = {c['n']}, {c['dtype']}: gradsolve vs "
            f"Diffrax gradient, max relative difference {text}{extra}"
        )
    return out


def memory_lines(memory: dict | None) -> list[str]:
    """The peak-memory comparison as markdown lines."""
    if not memory:
        return []
    lines = [
        f"Peak memory of one gradient, {memory['problem']}, N = {memory['n']}, "
        f"{memory['dtype']} (each tool in its own subprocess; peak RSS = the "
        "child's VmHWM from /proc/self/status, which includes XLA compilation; "
        "XLA = `memory_analysis()` of the compiled gradient, temporaries + "
        "arguments + outputs):",
        "",
    ]
    for tool, m in memory["tools"].items():
        if "failed" in m:
            lines.append(f"- {tool}: failed ({m['failed'][:200]})")
            continue
        xla = m.get("xla_bytes")
        xla_text = f"{xla / 2**20:.1f} MiB" if xla is not None else "n/a"
        lines.append(
            f"- {tool}: peak RSS {m['peak_rss_mib']:.0f} MiB "
            f"({m['peak_rss_mib'] - m['setup_rss_mib']:.0f} MiB above the "
            f"process after imports and inputs); XLA {xla_text} "
            f"(temporaries {m.get('temp_bytes', 0) / 2**20:.1f} MiB)"
            + (f"; {m['note']}" if m.get("note") else "")
        )
    return lines


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return x


def write(out_dir: Path, stem: str, data: dict, markdown: str) -> tuple[Path, Path]:
    """Write `<stem>.json` and `<stem>.md` into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(_jsonable(data), indent=1) + "\n")
    md_path.write_text(markdown + "\n")
    return json_path, md_path
