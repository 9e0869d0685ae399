"""`memory_budget` bounds the memory that `gs.record_ensemble`, `gs.replay_ensemble`
and a gradient through it use, measured in a child process; `gs.estimate_memory`
matches XLA's own accounting of the compiled programs.

Peak memory is measured in a fresh process (this file run as a script), which
builds the inputs, runs the call once (compiling it), releases what it freed
(`malloc_trim`), notes its resident memory (the starting level), resets its peak
(`/proc/self/clear_refs`, else it samples `VmRSS` every millisecond from a thread),
runs the call again and reads its peak resident memory (`VmHWM`). Compilation is
not counted: its memory depends on the program, not on the chunks.

    python tests/test_memory_budget.py '{"path": "gradient", "n": 32768, "budget": 16}'

prints one JSON line per spec (a spec or a list of them; budgets in MiB; see
`measure` for the keys).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest


MIB = 2**20
SCRIPT = pathlib.Path(__file__)
ROOT = SCRIPT.parents[1]
# The bound: peak memory above the starting level within 1.25 budgets.
TOLERANCE = 1.25


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class _Peak:
    """Peak resident memory from now on: reset `VmHWM` where Linux allows it, else
    sample `VmRSS` every millisecond (which can miss a peak shorter than that)."""

    def __init__(self):
        import threading

        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM"
            return
        except OSError:
            self.method = "sampled VmRSS"
        self.high = _status("VmRSS")
        self.done = threading.Event()

        def sample():
            while not self.done.wait(0.001):
                self.high = max(self.high, _status("VmRSS"))

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()

    def read(self) -> int:
        if self.method == "VmHWM":
            return _status("VmHWM")
        self.done.set()
        self.thread.join()
        return max(self.high, _status("VmRSS"))


def _settle():
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _problem(name: str, n: int):
    """`(f, y0s, params)` of an ensemble of `n`: `"lorenz"` (3 states) or
    `"chain<d>"`, `d` coupled states (where a Rosenbrock solver's Jacobian
    weighs)."""
    import jax.numpy as jnp

    if name == "lorenz":

        def f(t, y, p):
            return jnp.stack(
                [
                    p[0] * (y[1] - y[0]),
                    y[0] * (p[1] - y[2]) - y[1],
                    y[0] * y[1] - p[2] * y[2],
                ]
            )

        y0 = jnp.array([1.0, 0.0, 0.0])
        params = [jnp.full(n, 10.0), jnp.linspace(0.0, 28.0, n), jnp.full(n, 8 / 3)]
    else:

        def f(t, y, p):
            return p[0] * jnp.sin(y[::-1]) - p[1] * y + p[2]

        y0 = jnp.linspace(0.1, 1.0, int(name.removeprefix("chain")))
        params = [jnp.full(n, 2.0), jnp.linspace(0.5, 1.5, n), jnp.full(n, 0.3)]
    return f, jnp.tile(y0, (n, 1)), jnp.stack(params, 1)


def _planned(path, mesh, solver, y0s, params, budget):
    """The estimate of the replay's (or gradient's) program for the chunk size
    `gs.replay_ensemble` chooses (`None` for gradsolve versions without these
    functions)."""
    try:
        from gradsolve._memory import fit_chunk, replay_footprint
        from gradsolve._replay_chunks import replay_chunks_footprint
    except ImportError:
        return None
    import gradsolve as gs

    n = mesh.ts.shape[0]
    need = replay_chunks_footprint(mesh, y0s, solver, params, 0, gs.SaveAt(t1=True))
    chunk = n if budget is None else fit_chunk(n, need, budget, "gradient", "")
    fp = replay_footprint(mesh.max_steps, y0s, solver, params)
    return (fp if path == "replay" else need).bytes(n, chunk)


def child(spec: dict) -> dict:
    """Measure one call in this process; see `measure`."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import gradsolve as gs

    path, n = spec["path"], spec["n"]
    solver = gs.Rodas5() if spec.get("solver") == "rodas5" else gs.Tsit5()
    tol = spec.get("tol", 1e-8)
    t1 = spec.get("t1", 1.0)
    max_steps = spec.get("max_steps", 4096)
    budget = None if spec.get("budget") is None else int(spec["budget"] * MIB)
    f, y0s, params = _problem(spec.get("problem", "lorenz"), n)
    term = gs.ODETerm(f)
    ctrl = gs.PIDController(rtol=tol, atol=tol)
    common = dict(args_axes=0, memory_budget=budget)
    out = dict(spec)
    try:  # gradsolve versions without `solver=` count an explicit solver
        estimate = lambda *a: gs.estimate_memory(*a, solver=solver, args=params)
        estimate(1, 8, y0s)
    except TypeError:
        estimate = lambda *a: gs.estimate_memory(*a)

    if path == "record":
        out["estimate"] = estimate(n, max_steps, y0s)["record"]

        def call():
            mesh = gs.record_ensemble(
                term, solver, 0.0, t1, None, y0s, params, stepsize_controller=ctrl,
                max_steps=max_steps, **common,
            )  # fmt: skip
            out["steps"] = mesh.max_steps
            return jax.block_until_ready(mesh)
    else:
        mesh = gs.record_ensemble(
            term, solver, 0.0, t1, None, y0s, params, args_axes=0,
            stepsize_controller=ctrl, max_steps=max_steps,
        )  # fmt: skip
        out["steps"] = mesh.max_steps
        out["estimate"] = estimate(n, mesh.max_steps, y0s)[path]

        def replay(p, mesh, y0s):
            sol = gs.replay_ensemble(
                mesh, term, solver, y0s, p, stale="ignore", **common
            )
            # The solution without its mesh (an output of a compiled program is a
            # copy): what gs.replay_ensemble's own compiled program returns.
            return eqx.tree_at(lambda s: s.mesh, sol, None)

        loss = lambda p, mesh, y0s: jnp.sum(replay(p, mesh, y0s).ys ** 2)
        fn = replay if path == "replay" else jax.grad(loss)
        compiled = jax.jit(fn).lower(params, mesh, y0s).compile()
        ma = compiled.memory_analysis()
        out["xla"] = int(
            ma.temp_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
        )
        out["planned"] = _planned(path, mesh, solver, y0s, params, budget)
        call = lambda: jax.block_until_ready(compiled(params, mesh, y0s))
    call()  # compiles (and a first run)
    _settle()
    start = _status("VmRSS")
    peak = _Peak()
    call()
    out["peak_above_start"] = peak.read() - start
    out["start"] = start
    out["method"] = peak.method
    return out


def measure(*specs: dict) -> list[dict]:
    """Run `child(spec)` for every spec, one after another, in a fresh process and
    return their dicts.

    A spec has `path` (`"record"`, `"replay"` or `"gradient"`), `n` trajectories,
    `budget` in MiB (`None`: no `memory_budget`), `solver` (`"tsit5"` or
    `"rodas5"`), `problem` (`"lorenz"` or `"chain"`), `t1`, `tol`, `max_steps`.
    The dict adds `estimate` (`gs.estimate_memory` of the path for the whole
    batch), `peak_above_start` (bytes) and `steps` (of the trimmed mesh); for a
    replay (`gs.replay_ensemble` under `jax.jit`) or its gradient, `xla`
    (`memory_analysis()` of the compiled program: temporaries and outputs) and
    `planned` (the estimate of that program, chunked as `memory_budget` says).
    """
    # Compiled as users compile, with XLA's optimisations (which the default suite
    # turns off, `conftest.py`): the memory measured is that of users' programs,
    # and without them these calls run longer than their compilation saves.
    from .xla_settings import optimised  # here: this file also runs as a script

    env = optimised(dict(os.environ, JAX_PLATFORMS="cpu"))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    done = subprocess.run(
        [sys.executable, str(SCRIPT), json.dumps(list(specs))],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.strip().splitlines()]


def _name(spec: dict) -> str:
    solver = spec.get("solver", "tsit5")
    problem = spec.get("problem", "lorenz")
    return f"{spec['path']}-{solver}-{problem}-n{spec['n']}-{spec['budget']}MiB"


def _check(result: dict):
    budget = result["budget"] * MIB
    # In one piece it would not fit: the chunks are what keeps it in the budget.
    assert result["estimate"] > budget, result
    assert result["peak_above_start"] <= TOLERANCE * budget, result
    if result.get("planned") is not None:
        # The estimate covers XLA's own accounting of the program, by < 35 %.
        assert result["xla"] <= result["planned"] <= 1.35 * result["xla"], result


# Small enough for the default suite (one child process).
QUICK = [
    dict(path="gradient", n=32768, budget=16),
    dict(path="record", n=4096, budget=16),
    dict(path="replay", n=16384, budget=16, solver="rodas5", problem="chain8"),
]


@pytest.fixture(scope="module")
def quick():
    return measure(*QUICK)


@pytest.mark.parametrize("case", range(len(QUICK)), ids=[_name(c) for c in QUICK])
def test_peak_memory_within_the_budget(quick, case):
    _check(quick[case])


def _sweep(budget: int) -> list[dict]:
    """Every path, with ensembles that need more than `budget` MiB in one piece
    (Rodas5's gradient, slow on CPU, up to 256 MiB, with twice the trajectories of
    Tsit5's: its estimate per trajectory is smaller)."""
    cases = [
        dict(path="gradient", n=176 * budget),
        dict(path="replay", n=384 * budget),
        dict(path="record", n=256 * budget),
        # Beyond the first buffer's 512 steps: recorded again in parts.
        dict(path="record", n=24 * budget, t1=20.0),
        dict(path="record", n=512 * budget, solver="rodas5", problem="chain8"),
        dict(path="replay", n=512 * budget, solver="rodas5", problem="chain8"),
    ]
    if budget <= 256:
        cases.append(
            dict(path="gradient", n=256 * budget, solver="rodas5", problem="chain8")
        )
    return [dict(case, budget=budget) for case in cases]


@pytest.mark.slow
@pytest.mark.parametrize("budget", [16, 64, 256, 1024])
def test_peak_memory_within_the_budget_sweep(budget):
    for result in measure(*_sweep(budget)):
        _check(result)


def _lorenz_ensemble(n: int):

    import gradsolve as gs

    f, y0s, params = _problem("lorenz", n)
    ctrl = gs.PIDController(rtol=1e-6, atol=1e-6)
    return gs.ODETerm(f), y0s, params, dict(args_axes=0, stepsize_controller=ctrl)


def test_budget_below_the_fixed_overhead_is_an_error():
    import gradsolve as gs
    from gradsolve._memory import RUNTIME_BYTES

    term, y0s, params, kw = _lorenz_ensemble(10)
    with pytest.raises(ValueError, match="cannot hold the recording of 10 traj"):
        gs.record_ensemble(
            term, gs.Tsit5(), 0.0, 1.0, None, y0s, params,
            memory_budget=RUNTIME_BYTES, **kw,
        )  # fmt: skip
    mesh = gs.record_ensemble(term, gs.Tsit5(), 0.0, 1.0, None, y0s, params, **kw)
    with pytest.raises(ValueError, match="XLA's runtime about"):
        gs.replay_ensemble(
            mesh, term, gs.Tsit5(), y0s, params, args_axes=0,
            memory_budget=RUNTIME_BYTES,
        )  # fmt: skip


def test_mesh_larger_than_half_the_budget_is_an_error():
    # Room for four trajectories' recordings, but not for the mesh of 64.
    import gradsolve as gs
    from gradsolve._memory import RUNTIME_BYTES, record_footprint

    term, y0s, params, kw = _lorenz_ensemble(64)
    per = record_footprint(150, y0s, None, params).chunk
    with pytest.raises(ValueError, match="The mesh of 64 trajectories takes about"):
        gs.record_ensemble(
            term, gs.Tsit5(), 0.0, 1.0, None, y0s, params, max_steps=150,
            memory_budget=RUNTIME_BYTES + 8 * per, **kw,
        )  # fmt: skip


if __name__ == "__main__":
    import jax

    jax.config.update("jax_enable_x64", True)
    specs = json.loads(sys.argv[1])
    for spec in [specs] if isinstance(specs, dict) else specs:
        print(json.dumps(child(spec)), flush=True)
