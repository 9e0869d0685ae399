"""Peak memory of one ensemble gradient, gradsolve vs Diffrax, each in its own process.

Run by `run.py` (one subprocess per tool, so that neither sees the other's memory);
can also be run alone:

    python benchmarks/memory.py --tool diffrax --problem lorenz --n 16384

The child builds the inputs, notes its peak resident set size so far (`setup`), then
computes one gradient (gradsolve: record the mesh, trim it, then the gradient over
`gs.replay`; Diffrax: its default adjoint) and reports:

- `peak_rss_mib`: the child's peak resident set size at the end, read from `VmHWM`
  in /proc/self/status (`resource.getrusage(RUSAGE_SELF).ru_maxrss` where that is
  missing; on Linux ru_maxrss also carries the parent's peak over fork/exec, VmHWM
  does not). It counts everything the process did, XLA compilation included (and for
  gradsolve, the recording of the mesh);
- `xla_bytes`, `temp_bytes`: from `compiled.memory_analysis()` of the gradient's XLA
  executable alone: temporaries + arguments + outputs, and temporaries. These are
  exact for the executable and independent of compilation and allocator noise.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time


MARK = "MEMORY_JSON:"


def _rss_mib() -> float:
    """This process's peak resident set size in MiB (VmHWM, else ru_maxrss)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def child(tool: str, problem_name: str, n: int, dtype_name: str, tol: float | None):
    """Measure one tool in this process and print the result as one JSON line."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import tools
    from problems import PROBLEMS, make_inputs

    problem = PROBLEMS[problem_name]
    dtype = jnp.dtype(dtype_name)
    tol = tol or (problem.tol64 if dtype == jnp.float64 else problem.tol32)
    y0s, args = make_inputs(problem, n)
    build = tools.build_gradsolve if tool == "gradsolve" else tools.build_diffrax
    built = build(problem, y0s, args, tol, dtype)
    jax.block_until_ready(tools.to_jax((y0s, args), dtype))
    setup = _rss_mib()
    start = time.perf_counter()
    if tool == "gradsolve":
        built.tasks["record"]()
    compiled = built.compile_gradient()
    built.tasks["gradient"]()
    seconds = time.perf_counter() - start
    result = {
        "peak_rss_mib": _rss_mib(),
        "setup_rss_mib": setup,
        "seconds_incl_compile": seconds,
    }
    try:
        ma = compiled.memory_analysis()
        result["temp_bytes"] = int(ma.temp_size_in_bytes)
        result["xla_bytes"] = int(
            ma.temp_size_in_bytes
            + ma.argument_size_in_bytes
            + ma.output_size_in_bytes
            - ma.alias_size_in_bytes
        )
    except Exception as e:  # not every backend/version reports it
        result["xla_note"] = f"memory_analysis unavailable: {e}"
    if tool == "gradsolve":
        result["note"] = "RSS includes recording the mesh"
    print(MARK + json.dumps(result), flush=True)


def measure(
    problem: str,
    n: int,
    dtype_name: str,
    tol: float | None,
    timeout_s: float = 1800,
    log=print,
) -> dict:
    """Run the child for gradsolve and for Diffrax, one after the other."""
    out = {
        "problem": problem,
        "n": n,
        "dtype": dtype_name,
        "method": "peak RSS (VmHWM) of a child process per tool, and XLA "
        "memory_analysis() of the compiled gradient",
        "tools": {},
    }
    for tool in ("gradsolve", "diffrax"):
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--tool",
            tool,
            "--problem",
            problem,
            "--n",
            str(n),
            "--dtype",
            dtype_name,
        ]
        if tol is not None:
            cmd += ["--tol", str(tol)]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout_s
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(
                    f"exit code {proc.returncode}: {proc.stderr.strip()[-500:]}"
                )
            out["tools"][tool] = json.loads(lines[-1][len(MARK) :])
        except Exception as e:
            out["tools"][tool] = {"failed": f"{type(e).__name__}: {e}"}
        m = out["tools"][tool]
        if "failed" in m:
            log(f"  memory {tool}: FAILED {m['failed'][:300]}")
        else:
            xla = m.get("xla_bytes")
            log(
                f"  memory {tool:9s}: peak RSS {m['peak_rss_mib']:8.0f} MiB (setup "
                f"{m['setup_rss_mib']:.0f} MiB); XLA gradient executable "
                + (f"{xla / 2**20:.1f} MiB" if xla is not None else "n/a")
            )
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool", choices=["gradsolve", "diffrax"], required=True)
    parser.add_argument("--problem", default="lorenz")
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    parser.add_argument("--tol", type=float, default=None)
    a = parser.parse_args()
    child(a.tool, a.problem, a.n, a.dtype, a.tol)
