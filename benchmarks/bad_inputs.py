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
```

Prints a markdown table (per family: tried, clear errors, correct answers, unclear
errors, refused, crashes, wrong answers) and every case that is neither a clear
error nor a correct answer, with its input and what happened. A full run writes
`benchmarks/results/bad_inputs.json`. Every problem is tiny (y' = -k y on [0, 1]
unless named): compilation dominates, a few minutes on one CPU core.
"""

import argparse
import collections
import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import platform
import re
import struct
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import jax


jax.config.update("jax_enable_x64", True)

import diffrax  # noqa: E402
import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import numpy as np  # noqa: E402
import optimistix as optx  # noqa: E402

import gradsolve as gs  # noqa: E402


HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results" / "bad_inputs.json"
FAMILIES = (
    "times",
    "states",
    "controllers",
    "meshes",
    "files",
    "ensembles",
    "fitting",
)
OUTCOMES = (
    "clear error",
    "correct answer",
    "unclear error",
    "refused",
    "crash",
    "wrong answer",
)

# The exception types a clear error may have. JAX's tracer errors are `TypeError`s
# too, but they come from JAX's internals, not from a check: they are crashes.
CLEAR_TYPES = (ValueError, TypeError, RuntimeError)
JAX_INTERNAL = (
    jax.errors.ConcretizationTypeError,
    jax.errors.NonConcreteBooleanIndexError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.UnexpectedTracerError,
)


# ------------------------------------------------------------------ the problems


def decay(t, y, args):
    """y' = -k y on every leaf; `k = args` (0.5 when `args` is None)."""
    rate = 0.5 if args is None else args
    return jtu.tree_map(lambda x: -rate * x, y)


def rotate(t, y, args):
    """A fast rotation in the first two components: another problem, same state."""
    return jnp.stack([10.0 * y[1], -10.0 * y[0], -y[2]])


def robertson(t, y, args):
    k1, k2, k3 = 0.04, 3e7, 1e4
    return jnp.stack(
        [
            -k1 * y[0] + k3 * y[1] * y[2],
            k1 * y[0] - k2 * y[1] ** 2 - k3 * y[1] * y[2],
            k2 * y[1] ** 2,
        ]
    )


TERM = diffrax.ODETerm(decay)
CTRL = diffrax.PIDController(rtol=1e-6, atol=1e-6)
Y0 = jnp.array([1.0, 2.0, 3.0])
K = jnp.asarray(0.5)
Y0S = jnp.stack([Y0, 2 * Y0, 3 * Y0, 4 * Y0])
KS = jnp.array([0.5, 0.6, 0.7, 0.8])
DEFAULTS = dict(
    term=TERM,
    solver=gs.Tsit5(),
    t0=0.0,
    t1=1.0,
    dt0=None,
    y0=Y0,
    args=K,
    saveat=diffrax.SaveAt(t1=True),
    stepsize_controller=CTRL,
)
DEFAULTS_TEXT = (
    "unless named: term ODETerm(y' = -args * y), solver gs.Tsit5() (reference "
    "diffrax.Tsit5()), t0=0.0, t1=1.0, dt0=None, y0=array([1., 2., 3.]), "
    "args=array(0.5), saveat=SaveAt(t1=True), "
    "stepsize_controller=PIDController(rtol=1e-6, atol=1e-6); ensembles of 4 "
    "trajectories y0s=[1, 2, 3, 4] * y0, args=[0.5, 0.6, 0.7, 0.8] (args_axes=0)"
)
# Diffrax's solver for each gradsolve solver (others are passed unchanged).
DIFFRAX_SOLVER = {gs.Tsit5: diffrax.Tsit5, gs.Dopri5: diffrax.Dopri5}


# ---------------------------------------------------------------------- the cases


@dataclasses.dataclass
class Case:
    """One bad or unusual input.

    - `call`: runs gradsolve on it; returns what to compare (arrays, a dict, ...).
    - `expected`: `"error"` (the message must match the regular expression
        `keyword`, case-insensitive) or `"answer"` (equal to `reference()`, or
        accepted by `check`).
    - `reference`: Diffrax on the same input (or a closed form). For an `"error"`
        case whose reference returns a valid answer (successful, no NaN), that
        answer is due instead of the error.
    - `check`: for answers without a reference: `check(result)` returns `None` if
        the result is right, else what is wrong.
    - `errors`: the exception types of a clear error for this case.
    """

    family: str
    name: str
    what: str
    call: Callable[[], Any]
    expected: str
    keyword: str | None = None
    reference: Callable[[], Any] | None = None
    check: Callable[[Any], str | None] | None = None
    rtol: float = 1e-9
    errors: tuple = CLEAR_TYPES


def fmt(x) -> str:
    """A short, exact description of an input value."""
    if isinstance(x, jax.Array | np.ndarray | np.generic):
        a = np.asarray(x)
        body = np.array2string(a, threshold=8, separator=", ", precision=6)
        return f"array({body}, {a.dtype})"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {fmt(v)}" for k, v in x.items()) + "}"
    if isinstance(x, list):
        return "[" + ", ".join(fmt(v) for v in x) + "]"
    if isinstance(x, tuple):
        return "(" + ", ".join(fmt(v) for v in x) + ("," if len(x) == 1 else "") + ")"
    if isinstance(x, diffrax.SaveAt):
        sub, parts = x.subs, []
        if isinstance(sub, diffrax.SubSaveAt):
            parts = [f"{k}=True" for k in ("t0", "t1", "steps") if getattr(sub, k)]
            if sub.ts is not None:
                parts.append(f"ts={fmt(sub.ts)}")
        if x.dense:
            parts.append("dense=True")
        return "SaveAt(" + ", ".join(parts) + ")"
    if isinstance(x, diffrax.PIDController):
        parts = [f"rtol={x.rtol}", f"atol={x.atol}"]
        for name in ("dtmin", "dtmax"):
            if getattr(x, name) is not None:
                parts.append(f"{name}={getattr(x, name)}")
        return "PIDController(" + ", ".join(parts) + ")"
    if isinstance(x, diffrax.StepTo):
        return f"StepTo(ts={fmt(x.ts)})"
    if isinstance(x, diffrax.ODETerm):
        return f"ODETerm({getattr(x.vector_field, '__name__', 'f')})"
    if isinstance(x, diffrax.AbstractSolver | diffrax.AbstractStepSizeController):
        return f"{type(x).__module__.split('.')[0]}.{type(x).__name__}()"
    if isinstance(x, type):
        return f"{x.__module__.split('.')[0]}.{x.__name__} (the class)"
    if callable(x):
        return getattr(x, "__name__", repr(x))
    text = repr(x)
    return text if len(text) < 80 else text[:77] + "..."


def describe(api: str, changes: dict, jit: bool = False) -> str:
    inner = ", ".join(f"{k}={fmt(v)}" for k, v in changes.items())
    return f"{api}({inner}){' under jax.jit' if jit else ''}"


# What the calls return, as plain comparable trees.


def solution_out(sol):
    success = sol.result == diffrax.RESULTS.successful
    return {"ts": sol.ts, "ys": sol.ys, "success": success}


def mesh_out(mesh):
    """The accepted step ends of a concrete mesh, and whether it succeeded."""
    n = int(mesh.num_steps)
    return {
        "steps": np.asarray(mesh.ts)[1 : n + 1],
        "success": bool(mesh.result == diffrax.RESULTS.successful),
    }


def steps_out(sol):
    """Diffrax's accepted step ends from a solve with `SaveAt(steps=True)` last."""
    ts = sol.ts[-1] if isinstance(sol.ts, list | tuple) else sol.ts
    n = int(sol.stats["num_accepted_steps"])
    return {
        "steps": np.asarray(ts)[:n],
        "success": bool(sol.result == diffrax.RESULTS.successful),
    }


def as_traced(x):
    """Python numbers become arrays, so that `jit` traces them (not static)."""
    if isinstance(x, float | int) and not isinstance(x, bool):
        return jnp.asarray(x)
    return x


def _split(inputs):
    kw = dict(DEFAULTS)
    kw.update(inputs)
    term, solver = kw.pop("term"), kw.pop("solver")
    pos = [kw.pop(k) for k in ("t0", "t1", "dt0", "y0", "args")]
    return term, solver, pos, kw


def gs_call(api: str, inputs: dict, jit: bool = False) -> Callable:
    """`gs.diffeqsolve` or `gs.record` on `DEFAULTS` updated by `inputs`."""
    fn = {"diffeqsolve": gs.diffeqsolve, "record": gs.record}[api]
    post = solution_out if api == "diffeqsolve" else mesh_out

    def call():
        term, solver, pos, kw = _split(inputs)
        if not jit:
            return post(fn(term, solver, *pos, **kw))
        pos = [as_traced(x) for x in pos]
        inner = lambda pos, kw: fn(term, solver, *pos, **kw)
        out = eqx.filter_jit(inner)(pos, kw)
        return post(out)

    return call


class InconsistentReference(Exception):
    """Diffrax returned, but not at the times it was asked for (e.g. `ts=[0.]` for
    `t1=nan`): no answer to hold gradsolve to."""


def _requested_times(t0, t1, sub) -> list:
    """The save times a `SubSaveAt` asks for, in Diffrax's order of output."""
    ts = [] if sub.ts is None else list(np.asarray(sub.ts, np.float64).reshape(-1))
    return [t0] * bool(sub.t0) + ts + [t1] * bool(sub.t1)


def _check_times(saved, t0, t1, sub) -> None:
    want = np.asarray(_requested_times(t0, t1, sub), np.float64)
    got = np.asarray(saved, np.float64).reshape(-1)
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-6, atol=0):
        raise InconsistentReference(
            f"Diffrax returns, but saved at times {got} where {want} were asked for"
        )


def diffrax_call(api: str, inputs: dict) -> Callable:
    """Diffrax on the same inputs; for a recording, its accepted steps.

    Raises `InconsistentReference` when Diffrax's saved times are not the ones
    asked for (it then has no answer to compare with)."""

    def call():
        term, solver, pos, kw = _split(inputs)
        solver = DIFFRAX_SOLVER.get(type(solver), lambda: solver)()
        saveat = kw.get("saveat", diffrax.SaveAt(t1=True))
        times = lambda: (float(np.asarray(x, np.float64).ravel()[0]) for x in pos[:2])
        if api == "diffeqsolve":
            sol = diffrax.diffeqsolve(term, solver, *pos, **kw)
            t0, t1 = times()
            sub = saveat.subs
            if isinstance(sub, diffrax.SubSaveAt) and not sub.steps:
                _check_times(sol.ts, t0, t1, sub)
            return solution_out(sol)
        subs = [diffrax.SubSaveAt(t1=True), diffrax.SubSaveAt(steps=True)]
        if saveat.subs.ts is not None:  # checked by Diffrax too
            subs.insert(0, diffrax.SubSaveAt(ts=saveat.subs.ts))
        kw["saveat"] = diffrax.SaveAt(subs=subs)
        kw.pop("kernel", None)
        sol = diffrax.diffeqsolve(term, solver, *pos, **kw)
        t0, t1 = times()
        _check_times(sol.ts[-2], t0, t1, subs[-2])
        if saveat.subs.ts is not None:
            _check_times(sol.ts[0], t0, t1, subs[0])
        return steps_out(sol)

    return call


def solve_cases(
    family,
    name,
    expected,
    keyword=None,
    *,
    apis=("diffeqsolve",),
    jit=(False,),
    reference=True,
    rtol=1e-9,
    **inputs,
) -> list[Case]:
    """The cases of one input for each API and each of eager/`jit`."""
    out = []
    for api in apis:
        for j in jit:
            label = f"{name} [{api}{', jit' if j else ''}]"
            out.append(
                Case(
                    family,
                    label,
                    describe(f"gs.{api}", inputs, j),
                    gs_call(api, inputs, j),
                    expected,
                    keyword,
                    reference=diffrax_call(api, inputs) if reference else None,
                    rtol=rtol,
                )
            )
    return out


# --------------------------------------------------------------- family: times

NAN, INF = float("nan"), float("inf")


def times_cases() -> list[Case]:
    both = ("diffeqsolve", "record")
    eager_jit = (False, True)
    cases = []
    for arg in ("t0", "t1", "dt0"):
        for value, label in ((NAN, "nan"), (INF, "inf"), (-INF, "-inf")):
            inputs = {arg: value}
            if arg != "dt0":
                inputs["dt0"] = None
            cases += solve_cases(
                "times",
                f"{arg}={label}",
                "error",
                rf"\b{arg}\b.*(nan|inf|finite)",
                apis=both,
                jit=eager_jit,
                **inputs,
            )
    cases += solve_cases(
        "times", "dt0=0", "error", r"\bdt0\b", apis=both, jit=eager_jit, dt0=0.0
    )
    for name, inputs in (
        ("dt0<0 forwards", dict(dt0=-0.1)),
        ("dt0>0 backwards", dict(t0=1.0, t1=0.0, dt0=0.1)),
    ):
        cases += solve_cases(
            "times",
            name,
            "error",
            r"\bdt0\b.*sign",
            apis=both,
            jit=eager_jit,
            **inputs,
        )
    # t0 == t1: y0 at every save, as Diffrax.
    for name, inputs in (
        ("t0==t1", dict(t0=0.5, t1=0.5)),
        ("t0==t1 with dt0", dict(t0=0.5, t1=0.5, dt0=0.1)),
        (
            "t0==t1, SaveAt(t0, t1, ts=[t0])",
            dict(
                t0=0.5,
                t1=0.5,
                saveat=diffrax.SaveAt(t0=True, t1=True, ts=jnp.array([0.5])),
            ),
        ),
        (
            "t0==t1, SaveAt(steps)",
            dict(t0=0.5, t1=0.5, saveat=diffrax.SaveAt(steps=True)),
        ),
    ):
        cases += solve_cases("times", name, "answer", jit=(False, True), **inputs)
    cases += solve_cases("times", "t0==t1", "answer", apis=("record",), t0=0.5, t1=0.5)
    # saveat.ts out of order or range, NaN, 2-d. (An empty or 0-d ts never gets
    # here: Diffrax's SaveAt makes an empty one None and refuses a 0-d one.)
    for name, ts, keyword in (
        ("saveat.ts unsorted", [0.6, 0.2], r"saveat\.ts.*sort"),
        ("saveat.ts beyond t1", [0.5, 1.5], r"saveat\.ts.*within"),
        ("saveat.ts before t0", [-0.1, 0.5], r"saveat\.ts.*within"),
        ("saveat.ts with NaN", [0.2, NAN], r"saveat\.ts.*(nan|finite)"),
    ):
        saveat = diffrax.SaveAt(ts=jnp.array(ts))
        cases += solve_cases(
            "times", name, "error", keyword, apis=both, jit=eager_jit, saveat=saveat
        )
    cases += solve_cases(
        "times",
        "saveat.ts 2-d",
        "error",
        r"saveat\.ts|\bts\b",
        apis=both,
        saveat=diffrax.SaveAt(ts=jnp.array([[0.2], [0.5]])),
    )
    # Unusual but valid times: as Diffrax.
    for name, inputs in (
        ("int times", dict(t0=0, t1=1)),
        ("int times, float dt0", dict(t0=0, t1=1, dt0=0.1)),
        ("int64 array times", dict(t0=jnp.asarray(0), t1=jnp.asarray(1))),
        ("int32 array times", dict(t0=jnp.int32(0), t1=jnp.int32(1))),
        ("0-d float array times", dict(t0=jnp.asarray(0.0), t1=jnp.asarray(1.0))),
        ("numpy float64 times", dict(t0=np.float64(0.0), t1=np.float64(1.0))),
        ("float32 times, float64 y0", dict(t0=jnp.float32(0), t1=jnp.float32(1))),
        ("int saveat.ts", dict(saveat=diffrax.SaveAt(ts=jnp.array([0, 1])))),
        (
            "saveat.ts single time",
            dict(saveat=diffrax.SaveAt(ts=jnp.array([0.5]))),
        ),
        (
            "saveat.ts = [t0, t1]",
            dict(saveat=diffrax.SaveAt(ts=jnp.array([0.0, 1.0]))),
        ),
        (
            "saveat.ts repeated time",
            dict(saveat=diffrax.SaveAt(ts=jnp.array([0.5, 0.5]))),
        ),
        (
            "SaveAt(t0, t1, ts)",
            dict(saveat=diffrax.SaveAt(t0=True, t1=True, ts=jnp.array([0.3]))),
        ),
        ("SaveAt(steps)", dict(saveat=diffrax.SaveAt(steps=True))),
        ("reversed t0>t1", dict(t0=1.0, t1=0.0)),
        ("reversed, dt0<0", dict(t0=1.0, t1=0.0, dt0=-0.1)),
        (
            "reversed, ts decreasing",
            dict(t0=1.0, t1=0.0, saveat=diffrax.SaveAt(ts=jnp.array([0.8, 0.2]))),
        ),
        ("negative times", dict(t0=-1.0, t1=-0.25)),
        ("dt0 > t1 - t0", dict(dt0=5.0)),
    ):
        cases += solve_cases("times", name, "answer", r"\bt[01]\b|dt0|ts", **inputs)
    cases += solve_cases(
        "times", "bool times", "answer", r"\bt[01]\b|bool|real", t0=False, t1=True
    )
    cases += solve_cases(
        "times",
        "int64 array times",
        "answer",
        jit=(True,),
        t0=jnp.asarray(0),
        t1=jnp.asarray(1),
    )
    cases += solve_cases(
        "times",
        "reversed t0>t1",
        "answer",
        apis=("record",),
        jit=eager_jit,
        t0=1.0,
        t1=0.0,
    )
    cases += solve_cases(
        "times",
        "reversed, ts increasing",
        "error",
        r"saveat\.ts.*sort",
        apis=both,
        t0=1.0,
        t1=0.0,
        saveat=diffrax.SaveAt(ts=jnp.array([0.2, 0.8])),
    )
    cases += solve_cases(
        "times", "t1 shape (1,)", "error", r"\bt1\b|scalar|shape", t1=jnp.array([1.0])
    )
    cases += solve_cases(
        "times", "t1 complex", "error", r"\bt1\b|real", t1=jnp.asarray(1.0 + 0j)
    )
    cases += solve_cases("times", "t1 a string", "error", r"\bt1\b|number", t1="1.0")
    cases += time_derivative_cases()
    return cases


def _solve_ys(t1, api=gs.diffeqsolve, solver=None):
    solver = gs.Tsit5() if solver is None else solver
    sol = api(TERM, solver, 0.0, t1, None, Y0, K, stepsize_controller=CTRL)
    return jnp.sum(sol.ys)


def _record_ts(t1):
    return jnp.sum(gs.record(TERM, gs.Tsit5(), 0.0, t1, None, Y0, K).ts)


def time_derivative_cases() -> list[Case]:
    """Derivatives with respect to t1: Diffrax's through gs.diffeqsolve (it falls
    back), a clear error through gs.record or with jax.grad outside jax.jit."""
    ref = lambda: jax.grad(
        functools.partial(_solve_ys, api=diffrax.diffeqsolve, solver=diffrax.Tsit5())
    )(jnp.asarray(1.0))
    t1 = jnp.asarray(1.0)
    return [
        Case(
            "times",
            "d/dt1 through gs.diffeqsolve",
            "jax.grad(lambda t1: sum(gs.diffeqsolve(..., t1, ...).ys))(1.0)",
            lambda: jax.grad(_solve_ys)(t1),
            "answer",
            reference=ref,
        ),
        Case(
            "times",
            "d/dt1 through gs.diffeqsolve, jit(grad)",
            "jax.jit(jax.grad(lambda t1: sum(gs.diffeqsolve(..., t1, ...).ys)))(1.0)",
            lambda: jax.jit(jax.grad(_solve_ys))(t1),
            "answer",
            reference=ref,
        ),
        Case(
            "times",
            "d/dt1 through gs.diffeqsolve, grad(jit)",
            "jax.grad(jax.jit(lambda t1: sum(gs.diffeqsolve(..., t1, ...).ys)))(1.0)",
            lambda: jax.grad(jax.jit(_solve_ys))(t1),
            "answer",
            r"jax\.grad.*jax\.jit|inside.*jit|step times",
            reference=ref,
        ),
        Case(
            "times",
            "d/dt1 through gs.record",
            "jax.grad(lambda t1: sum(gs.record(..., t1, ...).ts))(1.0)",
            lambda: jax.grad(_record_ts)(t1),
            "error",
            r"step times fixed",
        ),
    ]


# -------------------------------------------------------------- family: states


def wrong_shape(t, y, args):
    return -y[:1]


def wrong_structure(t, y, args):
    return (-y, y)


def complex_field(t, y, args):
    return (-y).astype(jnp.complex128)


def int_field(t, y, args):
    return jnp.round(-10 * y).astype(jnp.int32)


def float32_field(t, y, args):
    return (-0.5 * y).astype(jnp.float32)


def bool_field(t, y, args):
    return y > 0


def nan_field(t, y, args):
    return jnp.full_like(y, jnp.nan)


def nan_late_field(t, y, args):
    return -y * jnp.sqrt(0.5 - t)


def raising_field(t, y, args):
    raise ValueError("rate constant missing from args (raised by the user's field)")


def python_if_field(t, y, args):
    return -y if y[0] > 0 else y


def list_field(t, y, args):
    return [-y[0], -y[1]]


def constant_field(t, y, args):
    return -0.5


def states_cases() -> list[Case]:
    cases = []
    for value, label in ((NAN, "nan"), (INF, "inf"), (-INF, "-inf")):
        y0 = Y0.at[1].set(value)
        cases += solve_cases(
            "states",
            f"y0 with {label}",
            "error",
            r"\by0\b.*(nan|inf)",
            apis=("diffeqsolve", "record"),
            jit=(False, True),
            y0=y0,
        )
    cases += solve_cases(
        "states",
        "args nan",
        "error",
        r"\bargs\b.*(nan|inf)",
        jit=(False, True),
        args=jnp.asarray(NAN),
    )
    cases += solve_cases(
        "states",
        "dict y0 with one inf leaf",
        "error",
        r"\by0\b.*(nan|inf)",
        y0={"a": Y0, "b": jnp.array([INF])},
    )
    for name, y0 in (
        ("int64 y0", jnp.array([1, 2, 3])),
        ("int32 y0", jnp.array([1, 2, 3], jnp.int32)),
        ("uint8 y0", jnp.array([1, 2, 3], jnp.uint8)),
        ("bool y0", jnp.array([True, False, True])),
        ("y0 None", None),
        ("y0 empty dict", {}),
        ("0-d array y0", jnp.asarray(1.0)),
        ("Python float y0", 1.0),
        ("Python list y0", [1.0, 2.0]),
        (
            "nested dict/tuple y0",
            {"a": Y0, "b": (jnp.asarray(3.0), jnp.ones((2, 2)))},
        ),
        ("zero-size y0", jnp.zeros((0,))),
        ("zero-size leaf beside another", {"a": jnp.zeros((0, 2)), "b": Y0}),
        ("float32 y0, float64 args", Y0.astype(jnp.float32)),
        ("float32/float64 leaves", (Y0.astype(jnp.float32), Y0)),
        ("complex y0", Y0.astype(jnp.complex128)),
    ):
        cases += solve_cases("states", name, "answer", r"\by0\b|dtype", y0=y0)
    cases += solve_cases(
        "states",
        "float32 throughout",
        "answer",
        t0=jnp.float32(0),
        t1=jnp.float32(1),
        y0=Y0.astype(jnp.float32),
        args=jnp.float32(0.5),
        stepsize_controller=diffrax.PIDController(rtol=1e-4, atol=1e-4),
        rtol=1e-5,
    )
    cases += solve_cases(
        "states", "nested y0", "answer", apis=("record",), y0={"a": Y0, "b": (K,)}
    )
    cases += solve_cases("states", "args None", "answer", args=None)
    cases += solve_cases(
        "states", "args 0-d int", "answer", args=jnp.asarray(1, jnp.int32)
    )
    for name, field, keyword in (
        ("field returns wrong shape", wrong_shape, r"shape"),
        ("field returns wrong structure", wrong_structure, r"structure"),
        ("field returns a list for an array", list_field, r"structure"),
        ("field returns complex", complex_field, r"dtype"),
        ("field returns int32", int_field, r"dtype"),
        ("field returns float32", float32_field, r"dtype"),
        ("field returns bool", bool_field, r"dtype"),
        ("field returns NaN everywhere", nan_field, r"nan"),
        ("field NaN from t=0.5 on", nan_late_field, r"nan"),
        ("field raises ValueError", raising_field, r"rate constant missing"),
        ("field branches on y in Python", python_if_field, r"vector field|concrete"),
    ):
        cases += solve_cases(
            "states",
            name,
            "error",
            keyword,
            apis=("diffeqsolve", "record"),
            term=diffrax.ODETerm(field),
            max_steps=64,
        )
    cases += solve_cases(
        "states",
        "field returns a Python float",
        "answer",
        term=diffrax.ODETerm(constant_field),
        y0=jnp.asarray(1.0),
    )
    cases += vmap_state_cases()
    return cases


def _vmapped(y0s, ks):
    def one(y0, k):
        sol = gs.diffeqsolve(TERM, gs.Tsit5(), 0.0, 1.0, None, y0, k, **_CTRL_KW)
        return solution_out(sol)

    return jax.vmap(one)(y0s, ks)


def _vmapped_diffrax(y0s, ks):
    def one(y0, k):
        sol = diffrax.diffeqsolve(
            TERM, diffrax.Tsit5(), 0.0, 1.0, None, y0, k, **_CTRL_KW
        )
        return solution_out(sol)

    return jax.vmap(one)(y0s, ks)


_CTRL_KW = dict(stepsize_controller=CTRL)


def vmap_state_cases() -> list[Case]:
    bad = Y0S.at[2, 1].set(NAN)
    return [
        Case(
            "states",
            "vmap: one y0 row with NaN",
            "jax.vmap(gs.diffeqsolve)(y0s with y0s[2, 1] = nan, args)",
            lambda: _vmapped(bad, KS),
            "error",
            r"\by0\b.*(nan|inf)",
            reference=lambda: _vmapped_diffrax(bad, KS),
        ),
        Case(
            "states",
            "vmap over 0 trajectories",
            "jax.vmap(gs.diffeqsolve)(y0s of shape (0, 3), args of shape (0,))",
            lambda: _vmapped(Y0S[:0], KS[:0]),
            "answer",
            check=lambda out: (
                None
                if np.shape(out["ys"]) == (0, 1, 3)
                else f"ys shape {np.shape(out['ys'])}, expected (0, 1, 3)"
            ),
        ),
    ]


# --------------------------------------------------------- family: controllers


def controllers_cases() -> list[Case]:
    cases = []
    pid = diffrax.PIDController
    for name, ctrl, keyword in (
        ("rtol<0", pid(rtol=-1e-6, atol=1e-6), r"\brtol\b"),
        ("atol<0", pid(rtol=1e-6, atol=-1e-6), r"\batol\b"),
        ("rtol=atol=0", pid(rtol=0.0, atol=0.0), r"\brtol\b|\batol\b"),
        ("rtol=nan", pid(rtol=NAN, atol=1e-6), r"\brtol\b"),
        ("atol=nan", pid(rtol=1e-6, atol=NAN), r"\batol\b"),
        ("rtol=inf", pid(rtol=INF, atol=1e-6), r"\brtol\b"),
        ("dtmax=0", pid(rtol=1e-6, atol=1e-6, dtmax=0.0), r"\bdtmax\b"),
        ("dtmin > dtmax", pid(rtol=1e-6, atol=1e-6, dtmin=0.5, dtmax=0.1), r"dtm"),
    ):
        cases += solve_cases(
            "controllers",
            name,
            "error",
            keyword,
            apis=("diffeqsolve", "record"),
            stepsize_controller=ctrl,
        )
    for name, ctrl in (
        ("rtol=0 (absolute only)", pid(rtol=0.0, atol=1e-6)),
        ("atol=0 (relative only)", pid(rtol=1e-6, atol=0.0)),
        ("dtmin > t1 - t0", pid(rtol=1e-6, atol=1e-6, dtmin=2.0)),
        ("dtmax tiny", pid(rtol=1e-6, atol=1e-6, dtmax=0.05)),
        ("factormax < 1", pid(rtol=1e-6, atol=1e-6, factormax=0.9)),
    ):
        cases += solve_cases(
            "controllers",
            name,
            "answer",
            r"rtol|atol|dtm|factor",
            apis=("diffeqsolve", "record"),
            stepsize_controller=ctrl,
        )
    for value in (0, -1, 1.5, True):
        cases += solve_cases(
            "controllers",
            f"max_steps={value!r}",
            "error",
            r"max_steps",
            apis=("diffeqsolve", "record"),
            max_steps=value,
        )
    cases += solve_cases("controllers", "max_steps=None", "answer", max_steps=None)
    cases += solve_cases(
        "controllers", "max_steps=np.int64(64)", "answer", max_steps=np.int64(64)
    )
    cases += solve_cases(
        "controllers",
        "max_steps=2 reached",
        "error",
        r"max_steps=2.*reached",
        apis=("diffeqsolve", "record"),
        jit=(False, True),
        max_steps=2,
    )
    cases += solve_cases(
        "controllers",
        "max_steps reached, throw=False",
        "answer",
        max_steps=2,
        throw=False,
    )
    constant = diffrax.ConstantStepSize()
    cases += solve_cases(
        "controllers",
        "ConstantStepSize, dt0=None",
        "error",
        r"\bdt0\b",
        apis=("diffeqsolve", "record"),
        stepsize_controller=constant,
    )
    cases += solve_cases(
        "controllers",
        "ConstantStepSize, dt0 not dividing",
        "answer",
        apis=("diffeqsolve", "record"),
        stepsize_controller=constant,
        dt0=0.3,
    )
    step_to = diffrax.StepTo
    cases += solve_cases(
        "controllers",
        "StepTo",
        "answer",
        stepsize_controller=step_to(ts=jnp.array([0.0, 0.4, 1.0])),
    )
    for name, ctrl, dt0, keyword in (
        ("StepTo with dt0", step_to(ts=jnp.array([0.0, 0.4, 1.0])), 0.1, r"dt0"),
        (
            "StepTo not starting at t0",
            step_to(ts=jnp.array([0.1, 0.4, 1.0])),
            None,
            r"\bts\b|\bt0\b",
        ),
        (
            "StepTo unsorted",
            step_to(ts=jnp.array([0.0, 0.7, 0.4, 1.0])),
            None,
            r"\bts\b|sort|increas",
        ),
    ):
        cases += solve_cases(
            "controllers",
            name,
            "error",
            keyword,
            apis=("diffeqsolve", "record"),
            stepsize_controller=ctrl,
            dt0=dt0,
        )
    # Solvers gradsolve does not have: gs.diffeqsolve falls back to Diffrax.
    cases += solve_cases(
        "controllers",
        "diffrax.Euler, constant steps",
        "answer",
        solver=diffrax.Euler(),
        stepsize_controller=constant,
        dt0=0.1,
    )
    cases += solve_cases(
        "controllers",
        "diffrax.Euler, PIDController",
        "error",
        r"error estimate|adaptive|embedded",
        solver=diffrax.Euler(),
    )
    cases += solve_cases(
        "controllers", "diffrax.Bosh3, PIDController", "answer", solver=diffrax.Bosh3()
    )
    cases += solve_cases(
        "controllers",
        "diffrax.Bosh3 through gs.record",
        "error",
        r"gs\.record cannot record|solver",
        apis=("record",),
        reference=False,
        solver=diffrax.Bosh3(),
    )
    cases += solve_cases(
        "controllers",
        "Dopri5",
        "answer",
        apis=("diffeqsolve", "record"),
        solver=gs.Dopri5(),
    )
    cases += solve_cases(
        "controllers",
        "adjoint=BacksolveAdjoint",
        "answer",
        adjoint=diffrax.BacksolveAdjoint(),
    )
    for name, solver in (
        ("solver the class gs.Tsit5", gs.Tsit5),
        ("solver None", None),
    ):
        cases += solve_cases(
            "controllers",
            name,
            "error",
            r"solver",
            apis=("diffeqsolve", "record"),
            reference=False,
            solver=solver,
        )
    cases += solve_cases(
        "controllers",
        "terms a plain function",
        "error",
        r"term|ODETerm",
        apis=("diffeqsolve", "record"),
        reference=False,
        term=decay,
    )
    cases += solve_cases(
        "controllers",
        "kernel='bogus'",
        "error",
        r"kernel",
        apis=("diffeqsolve", "record"),
        reference=False,
        kernel="bogus",
    )
    cases += solve_cases(
        "controllers",
        "Robertson on gs.Tsit5",
        "error",
        r"stiff.*gs\.Rodas5",
        term=diffrax.ODETerm(robertson),
        t1=100.0,
        y0=jnp.array([1.0, 0.0, 0.0]),
        args=None,
        stepsize_controller=pid(rtol=1e-6, atol=1e-6),
        max_steps=2000,
    )
    return cases


# -------------------------------------------------------------- family: meshes


@functools.cache
def base_mesh():
    return gs.record(TERM, gs.Tsit5(), 0.0, 1.0, None, Y0, K, stepsize_controller=CTRL)


@functools.cache
def batched_mesh():
    one = lambda y0, k: gs.record(
        TERM, gs.Tsit5(), 0.0, 1.0, None, y0, k, stepsize_controller=CTRL
    )
    return jax.vmap(one)(Y0S, KS).trim()


@functools.cache
def failed_mesh():
    tight = diffrax.PIDController(rtol=1e-10, atol=1e-10)
    return gs.record(
        TERM,
        gs.Tsit5(),
        0.0,
        1.0,
        None,
        Y0,
        K,
        stepsize_controller=tight,
        max_steps=3,
        throw=False,
    )


@functools.cache
def reversed_mesh():
    return gs.record(TERM, gs.Tsit5(), 1.0, 0.0, None, Y0, K, stepsize_controller=CTRL)


@functools.cache
def point_mesh():
    return gs.record(TERM, gs.Tsit5(), 0.5, 0.5, None, Y0, K, stepsize_controller=CTRL)


def stepto(mesh, y0=Y0, args=K, saveat=None, term=TERM):
    """Diffrax over the mesh's accepted steps: the reference of a replay."""
    n = int(mesh.num_steps)
    ts = mesh.ts[: n + 1]
    sol = diffrax.diffeqsolve(
        term,
        diffrax.Tsit5(),
        ts[0],
        ts[-1],
        None,
        y0,
        args,
        saveat=diffrax.SaveAt(t1=True) if saveat is None else saveat,
        stepsize_controller=diffrax.StepTo(ts=ts),
    )
    return solution_out(sol)


def replay_call(mesh_fn, *, term=TERM, solver=None, y0=Y0, args=K, jit=False, **kw):
    solver = gs.Tsit5() if solver is None else solver

    def call():
        mesh = mesh_fn()
        if not jit:
            return solution_out(gs.replay(mesh, term, solver, y0, args, **kw))
        inner = lambda mesh, y0, args: gs.replay(mesh, term, solver, y0, args, **kw)
        return solution_out(eqx.filter_jit(inner)(mesh, y0, args))

    return call


def _stale_check(out):
    ratio, warned = out
    if not warned:
        return f"no StaleMeshWarning (max_error_ratio={ratio:.3g})"
    if not ratio > 1:
        return f"warned, but max_error_ratio={ratio:.3g} <= 1"
    return None


def _stale_replay(term, args):
    def call():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sol = gs.replay(base_mesh(), term, gs.Tsit5(), Y0, args)
            ratio = float(sol.stats["max_error_ratio"])
            jax.effects_barrier()
        warned = any(issubclass(w.category, gs.StaleMeshWarning) for w in caught)
        return ratio, warned

    return call


def _partial_out(sol):
    return {"ys": sol.ys, "success": sol.result == diffrax.RESULTS.successful}


def meshes_cases() -> list[Case]:
    state = r"recorded for a state"
    cases = [
        Case(
            "meshes",
            "control: replay of a fresh mesh",
            "gs.replay(mesh, term, gs.Tsit5(), y0, args)",
            replay_call(base_mesh),
            "answer",
            reference=lambda: stepto(base_mesh()),
        ),
        Case(
            "meshes",
            "control: replay under jit",
            "jax.jit(gs.replay)(mesh, term, gs.Tsit5(), y0, args)",
            replay_call(base_mesh, jit=True),
            "answer",
            reference=lambda: stepto(base_mesh()),
        ),
    ]
    for name, y0 in (
        ("y0 another structure (dict)", {"a": Y0}),
        ("y0 another structure (list)", [Y0[0], Y0[1], Y0[2]]),
        ("y0 another shape", jnp.ones(4)),
        ("y0 another dtype (float32)", Y0.astype(jnp.float32)),
        ("y0 complex", Y0.astype(jnp.complex128)),
    ):
        cases.append(
            Case(
                "meshes",
                name,
                f"gs.replay(mesh of y0=float64[3], ..., y0={fmt(y0)})",
                replay_call(base_mesh, y0=y0),
                "error",
                state,
            )
        )
    y0_int = jnp.array([1, 2, 3])
    cases.append(
        Case(
            "meshes",
            "y0 int (promoted as recorded)",
            f"gs.replay(mesh, ..., y0={fmt(y0_int)})",
            replay_call(base_mesh, y0=y0_int),
            "answer",
            reference=lambda: stepto(base_mesh(), y0=y0_int),
        )
    )
    for name, kw, keyword in (
        ("y0 NaN", dict(y0=Y0.at[0].set(NAN)), r"\by0\b.*(nan|inf)"),
        ("args NaN", dict(args=jnp.asarray(NAN)), r"\bargs\b.*(nan|inf)"),
        ("another solver (gs.Dopri5)", dict(solver=gs.Dopri5()), r"recorded with"),
        ("a Diffrax solver", dict(solver=diffrax.Tsit5()), r"gradsolve solver"),
        ("terms a plain function", dict(term=decay), r"ODETerm|term"),
        (
            "saveat.ts outside the mesh",
            dict(saveat=diffrax.SaveAt(ts=jnp.array([0.5, 1.5]))),
            r"saveat\.ts",
        ),
        (
            "saveat.ts unsorted",
            dict(saveat=diffrax.SaveAt(ts=jnp.array([0.5, 0.2]))),
            r"saveat\.ts",
        ),
        ("SaveAt(dense=True)", dict(saveat=diffrax.SaveAt(dense=True)), r"SaveAt"),
        ("stale='bogus'", dict(stale="bogus"), r"\bstale\b"),
        ("sharding on a single mesh", dict(sharding="cpu"), r"sharding"),
    ):
        cases.append(
            Case(
                "meshes",
                name,
                describe("gs.replay", kw),
                replay_call(base_mesh, **kw),
                "error",
                keyword,
            )
        )
    cases += [
        Case(
            "meshes",
            "mesh=None",
            "gs.replay(None, term, gs.Tsit5(), y0, args)",
            replay_call(lambda: None),
            "error",
            r"\bmesh\b|RecordedMesh",
        ),
        Case(
            "meshes",
            "a Solution as the mesh",
            "gs.replay(gs.diffeqsolve(...), term, gs.Tsit5(), y0, args)",
            replay_call(
                lambda: gs.diffeqsolve(
                    TERM, gs.Tsit5(), 0.0, 1.0, None, Y0, K, stepsize_controller=CTRL
                )
            ),
            "error",
            r"\bmesh\b|RecordedMesh",
        ),
        Case(
            "meshes",
            "failed recording (max_steps, throw=False)",
            "gs.replay(gs.record(..., max_steps=3, throw=False, rtol=atol=1e-10), ...)",
            replay_call(failed_mesh),
            "error",
            r"recording that failed.*allow_partial",
        ),
        Case(
            "meshes",
            "failed recording, jit",
            "jax.jit(gs.replay)(mesh recorded with max_steps=3, throw=False, ...)",
            replay_call(failed_mesh, jit=True),
            "error",
            r"recording that failed.*allow_partial",
        ),
        Case(
            "meshes",
            "failed recording, allow_partial=True",
            "gs.replay(mesh recorded with max_steps=3, throw=False, ..., "
            "allow_partial=True)",
            lambda: _partial_out(
                gs.replay(failed_mesh(), TERM, gs.Tsit5(), Y0, K, allow_partial=True)
            ),
            "answer",
            reference=lambda: {
                "ys": stepto(failed_mesh())["ys"],
                "success": np.asarray(False),
            },
        ),
        Case(
            "meshes",
            "another problem (rotation field)",
            "gs.replay(mesh of y' = -0.5 y, ODETerm(rotation at rate 10), ...)",
            _stale_replay(diffrax.ODETerm(rotate), K),
            "answer",
            check=_stale_check,
        ),
        Case(
            "meshes",
            "args moved far (k 0.5 -> 8)",
            "gs.replay(mesh recorded at args=0.5, ..., args=8.0)",
            _stale_replay(TERM, jnp.asarray(8.0)),
            "answer",
            check=_stale_check,
        ),
        Case(
            "meshes",
            "stale='error' on a stale mesh",
            "gs.replay(mesh recorded at args=0.5, ..., args=8.0, stale='error')",
            replay_call(base_mesh, args=jnp.asarray(8.0), stale="error"),
            "error",
            r"\bstale\b",
        ),
        Case(
            "meshes",
            "stale='error' on a stale mesh, jit",
            "jax.jit(gs.replay)(mesh at args=0.5, ..., args=8.0, stale='error')",
            replay_call(base_mesh, args=jnp.asarray(8.0), stale="error", jit=True),
            "error",
            r"\bstale\b",
        ),
        Case(
            "meshes",
            "stale='ignore' on a stale mesh",
            "gs.replay(mesh recorded at args=0.5, ..., args=8.0, stale='ignore')",
            replay_call(base_mesh, args=jnp.asarray(8.0), stale="ignore"),
            "answer",
            reference=lambda: stepto(base_mesh(), args=jnp.asarray(8.0)),
        ),
        Case(
            "meshes",
            "reversed mesh (t0 > t1)",
            "gs.replay(gs.record(..., t0=1.0, t1=0.0, ...), ...)",
            replay_call(reversed_mesh),
            "answer",
            reference=lambda: stepto(reversed_mesh()),
        ),
        Case(
            "meshes",
            "mesh of t0 == t1",
            "gs.replay(gs.record(..., t0=0.5, t1=0.5, ...), ...)",
            lambda: replay_call(point_mesh)()["ys"],
            "answer",
            reference=lambda: Y0[None],
        ),
        Case(
            "meshes",
            "batched mesh, y0 of 3 rows",
            "gs.replay(mesh of 4 trajectories, ..., y0s[:3], args, args_axes=0)",
            replay_call(batched_mesh, y0=Y0S[:3], args=KS, args_axes=0),
            "error",
            r"4 trajectories.*\by0\b",
        ),
        Case(
            "meshes",
            "batched mesh, args of 3 rows",
            "gs.replay(mesh of 4 trajectories, ..., y0s, args[:3], args_axes=0)",
            replay_call(batched_mesh, y0=Y0S, args=KS[:3], args_axes=0),
            "error",
            r"4 trajectories.*\bargs\b",
        ),
        Case(
            "meshes",
            "batched mesh, single y0",
            "gs.replay(mesh of 4 trajectories, ..., y0 (one state), args)",
            replay_call(batched_mesh, y0=Y0, args=K),
            "error",
            r"4 trajectories.*\by0\b",
        ),
        Case(
            "meshes",
            "trim() under jit",
            "jax.jit(lambda m: m.trim())(mesh)",
            lambda: jax.jit(lambda m: m.trim())(base_mesh()),
            "error",
            r"trim\(\).*concrete",
        ),
    ]
    return cases


# --------------------------------------------------------------- family: files

MAGIC_LEN, PREFIX = 8, struct.Struct("<II")


def _parts(data: bytes):
    version, length = PREFIX.unpack(data[MAGIC_LEN : MAGIC_LEN + PREFIX.size])
    start = MAGIC_LEN + PREFIX.size
    header = data[start : start + length]
    payload = data[start + length : -32]
    return data[:MAGIC_LEN], version, header, payload


def _assemble(magic, version, header: bytes, payload: bytes, length=None) -> bytes:
    """A mesh file with a recomputed digest (so only the content is at fault)."""
    length = len(header) if length is None else length
    body = magic + PREFIX.pack(version, length) + header + payload
    return body + hashlib.sha256(body).digest()


def _edit_header(data: bytes, edit) -> bytes:
    magic, version, header, payload = _parts(data)
    header = json.loads(header)
    edit(header)
    return _assemble(magic, version, json.dumps(header).encode(), payload)


def _flip(data: bytes, index: int) -> bytes:
    out = bytearray(data)
    out[index] ^= 0x10
    return bytes(out)


class Files:
    """A folder with a good mesh file, and a damaged copy of it per case."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="gs_bad_inputs_")
        self._good = None

    def good(self) -> bytes:
        if self._good is None:
            path = os.path.join(self.folder, "good.gsmesh")
            gs.save_mesh(path, base_mesh())
            self._good = pathlib.Path(path).read_bytes()
        return self._good

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name + ".gsmesh")

    def load(self, name: str, damage: Callable[[bytes], bytes]) -> Callable:
        def call():
            path = self.path(name)
            pathlib.Path(path).write_bytes(damage(self.good()))
            return gs.load_mesh(path).ts

        return call


def _set(header, keys, value):
    node = header
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value


def _saved(files: Files, name: str, change) -> Callable:
    """Save an altered (but well-formed) mesh with gs.save_mesh, then load it."""

    def call():
        path = files.path(name)
        gs.save_mesh(path, change(base_mesh()))
        return gs.load_mesh(path).ts

    return call


def files_cases() -> list[Case]:
    files = Files()
    header_at = MAGIC_LEN + PREFIX.size + 4

    def damaged(name, what, damage, detail):
        path = files.path(name)
        return Case(
            "files",
            name,
            f"gs.load_mesh of a mesh file {what}",
            files.load(name, damage),
            "error",
            re.escape(path) + ".*" + detail,
            errors=(ValueError,),
        )

    def header_edit(keys, value):
        return lambda d: _edit_header(d, lambda h: _set(h, keys, value))

    cases = [
        damaged("truncated", "without its last 100 bytes", lambda d: d[:-100], "trunc"),
        damaged("truncated-10", "cut to 10 bytes", lambda d: d[:10], "trunc"),
        damaged("empty", "of 0 bytes", lambda d: b"", "trunc|empty|not a"),
        damaged(
            "flipped-payload",
            "with a bit flipped in the payload",
            lambda d: _flip(d, len(d) - 100),
            "corrupt",
        ),
        damaged(
            "flipped-header",
            "with a bit flipped in the header",
            lambda d: _flip(d, header_at),
            "corrupt",
        ),
        damaged(
            "flipped-digest",
            "with a bit flipped in the digest",
            lambda d: _flip(d, len(d) - 1),
            "corrupt",
        ),
        damaged(
            "wrong-magic",
            "whose marker is b'NOTAMESH'",
            lambda d: b"NOTAMESH" + d[MAGIC_LEN:],
            "not a gradsolve mesh file",
        ),
        damaged(
            "norm-sys-exit",
            "whose header names 'sys:exit' as norm (digest recomputed)",
            header_edit(["norm"], "sys:exit"),
            "sys:exit",
        ),
        damaged(
            "solver-os-system",
            "whose header names 'os:system' as solver (digest recomputed)",
            header_edit(["solver_type"], "os:system"),
            "os:system",
        ),
        damaged(
            "norm-builtins-eval",
            "whose header names 'builtins:eval' as norm (digest recomputed)",
            header_edit(["norm"], "builtins:eval"),
            "builtins:eval",
        ),
        damaged(
            "norm-number",
            "whose header has 42 as norm (digest recomputed)",
            header_edit(["norm"], 42),
            "norm|malformed",
        ),
        damaged(
            "version-1",
            "of format version 1 (digest recomputed)",
            lambda d: _assemble(_parts(d)[0], 1, *_parts(d)[2:]),
            "version",
        ),
        damaged(
            "version-99",
            "of format version 99 (digest recomputed)",
            lambda d: _assemble(_parts(d)[0], 99, *_parts(d)[2:]),
            "version",
        ),
        damaged(
            "header-not-utf8",
            "whose header is not UTF-8 (digest recomputed)",
            lambda d: _assemble(_parts(d)[0], 2, b"\xff\xfe{", _parts(d)[3]),
            "malformed",
        ),
        damaged(
            "header-a-list",
            "whose header is the JSON list [] (digest recomputed)",
            lambda d: _assemble(_parts(d)[0], 2, b"[]", _parts(d)[3]),
            "malformed",
        ),
        damaged(
            "header-length-past-end",
            "whose header length runs past the end (digest recomputed)",
            lambda d: _assemble(*_parts(d), length=10**6),
            "malformed|trunc",
        ),
        damaged(
            "payload-bytes-wrong",
            "whose header misstates payload_bytes (digest recomputed)",
            header_edit(["payload_bytes"], 3),
            "malformed|payload",
        ),
        damaged(
            "ts-shape-wrong",
            "whose header gives ts the shape [3] (digest recomputed)",
            header_edit(["fields", "ts", "shape"], [3]),
            "malformed|inconsistent|could not be read",
        ),
        damaged(
            "ts-shape-negative",
            "whose header gives ts the shape [-1] (digest recomputed)",
            header_edit(["fields", "ts", "shape"], [-1]),
            "malformed",
        ),
        damaged(
            "dtype-object",
            "whose header gives ts the dtype 'object' (digest recomputed)",
            header_edit(["fields", "ts", "dtype"], "object"),
            "malformed",
        ),
        damaged(
            "state-missing",
            "whose header has no state (digest recomputed)",
            lambda d: _edit_header(d, lambda h: h.pop("state")),
            "malformed|state",
        ),
        damaged(
            "state-int-dtype",
            "whose header records an int32 state (digest recomputed)",
            header_edit(["state", "dtypes"], ["int32"]),
            "malformed|state",
        ),
        damaged(
            "fields-extra",
            "whose header lists an extra field (digest recomputed)",
            header_edit(["fields", "extra"], {"kind": "none"}),
            "fields",
        ),
        damaged(
            "fields-not-a-table",
            "whose header's fields is a string (digest recomputed)",
            header_edit(["fields"], "ts"),
            "malformed|fields",
        ),
    ]
    too_many = lambda m: eqx.tree_at(lambda m: m.num_steps, m, jnp.asarray(10**6))
    bad_code = lambda m: eqx.tree_at(
        lambda m: m.result, m, jtu.tree_map(lambda c: jnp.full_like(c, 99), m.result)
    )
    for name, change, detail in (
        ("num-steps-past-end", too_many, "inconsistent|steps"),
        ("result-code-99", bad_code, "inconsistent|result"),
    ):
        path = files.path(name)
        cases.append(
            Case(
                "files",
                name,
                f"gs.load_mesh of gs.save_mesh(mesh with {name.replace('-', ' ')})",
                _saved(files, name, change),
                "error",
                re.escape(path) + ".*" + detail,
                errors=(ValueError,),
            )
        )
    folder = files.folder
    missing = os.path.join(folder, "missing.gsmesh")
    nowhere = os.path.join(folder, "no-such-folder", "mesh.gsmesh")
    cases += [
        Case(
            "files",
            "a directory as path (load)",
            f"gs.load_mesh({folder!r}), a directory",
            lambda: gs.load_mesh(folder).ts,
            "error",
            re.escape(folder),
            errors=(ValueError,),
        ),
        Case(
            "files",
            "a missing file (load)",
            f"gs.load_mesh({missing!r}), no such file",
            lambda: gs.load_mesh(missing).ts,
            "error",
            re.escape(missing),
            errors=(ValueError, FileNotFoundError),
        ),
        Case(
            "files",
            "a directory as path (save)",
            f"gs.save_mesh({folder!r}, mesh), a directory",
            lambda: gs.save_mesh(folder, base_mesh()),
            "error",
            re.escape(folder),
            errors=(ValueError, OSError),
        ),
        Case(
            "files",
            "a missing folder (save)",
            f"gs.save_mesh({nowhere!r}, mesh)",
            lambda: gs.save_mesh(nowhere, base_mesh()),
            "error",
            r"no-such-folder",
            errors=(ValueError, OSError),
        ),
        Case(
            "files",
            "not a mesh (save)",
            "gs.save_mesh(path, {'ts': array})",
            lambda: gs.save_mesh(files.path("dict"), {"ts": Y0}),
            "error",
            r"RecordedMesh",
        ),
        Case(
            "files",
            "a traced mesh (save inside jit)",
            "jax.jit(lambda m: gs.save_mesh(path, m))(mesh)",
            lambda: eqx.filter_jit(lambda m: gs.save_mesh(files.path("jit"), m))(
                base_mesh()
            ),
            "error",
            r"concrete",
        ),
        Case(
            "files",
            "control: save and load",
            "gs.load_mesh(gs.save_mesh(path, mesh)) against mesh",
            lambda: _round_trip(files),
            "answer",
            reference=lambda: jtu.tree_leaves(base_mesh()),
            rtol=0.0,
        ),
    ]
    return cases


def _round_trip(files: Files):
    path = files.path("round-trip")
    gs.save_mesh(path, base_mesh())
    return jtu.tree_leaves(gs.load_mesh(path))


# ----------------------------------------------------------- family: ensembles


def _ensemble_steps(mesh):
    """Each trajectory's accepted step ends, from a batched mesh."""
    ts, counts = np.asarray(mesh.ts), np.asarray(mesh.num_steps)
    return [ts[i, 1 : int(n) + 1] for i, n in enumerate(counts)]


def _diffrax_ensemble_steps(y0s, ks):
    def one(y0, k):
        sol = diffrax.diffeqsolve(
            TERM,
            diffrax.Tsit5(),
            0.0,
            1.0,
            None,
            y0,
            k,
            saveat=diffrax.SaveAt(steps=True),
            stepsize_controller=CTRL,
        )
        return sol.ts, sol.stats["num_accepted_steps"]

    ts, counts = jax.vmap(one)(y0s, ks)
    return [np.asarray(ts)[i, : int(n)] for i, n in enumerate(np.asarray(counts))]


def record_ensemble_call(y0=Y0S, args=KS, **kw):
    kw.setdefault("args_axes", 0)
    kw.setdefault("stepsize_controller", CTRL)

    def call():
        mesh = gs.record_ensemble(TERM, gs.Tsit5(), 0.0, 1.0, None, y0, args, **kw)
        return _ensemble_steps(mesh)

    return call


def replay_ensemble_call(mesh_fn=None, y0=Y0S, args=KS, **kw):
    kw.setdefault("args_axes", 0)

    def call():
        mesh = batched_mesh() if mesh_fn is None else mesh_fn()
        sol = gs.replay_ensemble(mesh, TERM, gs.Tsit5(), y0, args, **kw)
        return sol.ys

    return call


def _diffrax_ensemble_ys():
    return _vmapped_diffrax(Y0S, KS)["ys"]


def ensembles_cases() -> list[Case]:
    cases = []
    kinds = (
        ("record_ensemble", record_ensemble_call),
        ("replay_ensemble", replay_ensemble_call),
    )
    for api, make in kinds:
        bad = [("chunk_size", v) for v in (0, -1, 1.5, True)]
        bad += [("memory_budget", v) for v in (0, -1, 1.5)]
        for arg, value in bad:
            cases.append(
                Case(
                    "ensembles",
                    f"{arg}={value!r} [{api}]",
                    f"gs.{api}(..., {arg}={value!r})",
                    make(**{arg: value}),
                    "error",
                    rf"\b{arg}\b",
                )
            )
        for name, kw, keyword in (
            ("args of 3 rows", dict(args=KS[:3]), r"\bargs\b"),
            (
                "scalar leaf in y0",
                dict(y0={"a": Y0S, "b": jnp.asarray(1.0)}),
                r"scalar",
            ),
            ("memory_budget=1000 bytes", dict(memory_budget=1000), r"budget|memory"),
            ("sharding='cpu'", dict(sharding="cpu"), r"sharding"),
        ):
            cases.append(
                Case(
                    "ensembles",
                    f"{name} [{api}]",
                    describe(f"gs.{api}", kw),
                    make(**kw),
                    "error",
                    keyword,
                )
            )
    cases += [
        Case(
            "ensembles",
            "max_steps=0 [record_ensemble]",
            "gs.record_ensemble(..., max_steps=0)",
            record_ensemble_call(max_steps=0),
            "error",
            r"max_steps",
        ),
        Case(
            "ensembles",
            "y0 leaves of 4 and 3 rows [record_ensemble]",
            "gs.record_ensemble(..., y0={'a': y0s (4 rows), 'b': 3 rows})",
            record_ensemble_call(y0={"a": Y0S, "b": Y0S[:3]}),
            "error",
            r"leading axis",
        ),
        Case(
            "ensembles",
            "args_axes=1 [record_ensemble]",
            "gs.record_ensemble(..., args (shape (4,)), args_axes=1)",
            record_ensemble_call(args_axes=1),
            "error",
            r"args_axes|axis",
        ),
        Case(
            "ensembles",
            "unknown keyword [record_ensemble]",
            "gs.record_ensemble(..., colour='red')",
            record_ensemble_call(colour="red"),
            "error",
            r"colour",
        ),
        Case(
            "ensembles",
            "chunk_size=3 of 4 [record_ensemble]",
            "gs.record_ensemble(..., chunk_size=3)",
            record_ensemble_call(chunk_size=3),
            "answer",
            reference=lambda: _diffrax_ensemble_steps(Y0S, KS),
        ),
        Case(
            "ensembles",
            "chunk_size=100 of 4 [record_ensemble]",
            "gs.record_ensemble(..., chunk_size=100)",
            record_ensemble_call(chunk_size=100),
            "answer",
            reference=lambda: _diffrax_ensemble_steps(Y0S, KS),
        ),
        Case(
            "ensembles",
            "0 trajectories [record_ensemble]",
            "gs.record_ensemble(..., y0 of shape (0, 3), args of shape (0,))",
            record_ensemble_call(y0=Y0S[:0], args=KS[:0]),
            "answer",
            reference=lambda: [],
        ),
        Case(
            "ensembles",
            "y0 of 3 rows [replay_ensemble]",
            "gs.replay_ensemble(mesh of 4 trajectories, ..., y0s[:3])",
            replay_ensemble_call(y0=Y0S[:3]),
            "error",
            r"4 trajectories.*\by0\b",
        ),
        Case(
            "ensembles",
            "unbatched mesh [replay_ensemble]",
            "gs.replay_ensemble(mesh of one trajectory, ..., y0s)",
            replay_ensemble_call(base_mesh),
            "error",
            r"batched mesh",
        ),
        Case(
            "ensembles",
            "stale='error' on a stale mesh [replay_ensemble]",
            "gs.replay_ensemble(mesh, ..., args=10 * args, stale='error')",
            replay_ensemble_call(args=10 * KS, stale="error"),
            "error",
            r"\bstale\b",
        ),
        Case(
            "ensembles",
            "chunk_size=3 of 4 [replay_ensemble]",
            "gs.replay_ensemble(mesh, ..., chunk_size=3)",
            replay_ensemble_call(chunk_size=3),
            "answer",
            reference=_diffrax_ensemble_ys,
        ),
        Case(
            "ensembles",
            "chunk_size=100 of 4 [replay_ensemble]",
            "gs.replay_ensemble(mesh, ..., chunk_size=100)",
            replay_ensemble_call(chunk_size=100),
            "answer",
            reference=_diffrax_ensemble_ys,
        ),
    ]
    return cases


# ------------------------------------------------------------- family: fitting

FIT_TS = jnp.array([0.5, 1.0])
FIT_Y0S = Y0S[:2]
FIT_DATA = FIT_Y0S[:, None, :] * jnp.exp(-0.7 * FIT_TS)[None, :, None]


def fit_call(**kw):
    args = dict(params0=jnp.asarray(0.5), y0s=FIT_Y0S, ts=FIT_TS, data=FIT_DATA)
    args.update(kw)
    positional = [args.pop(k) for k in ("params0", "y0s", "ts", "data")]
    solver = args.pop("solver", gs.Tsit5())

    def call():
        fit = gs.fit(TERM, solver, *positional, **args)
        return {
            "params": fit.params,
            "success": fit.result == optx.RESULTS.successful,
        }

    return call


def _fit_check(out):
    if not bool(out["success"]):
        return "result is not successful"
    error = abs(float(out["params"]) - 0.7)
    return None if error < 1e-6 else f"params={float(out['params'])!r}, not 0.7"


def fitting_cases() -> list[Case]:
    base = (
        "gs.fit(ODETerm(y' = -k y), gs.Tsit5(), params0=0.5, y0s (2 x 3), "
        "ts=[0.5, 1.0], data = y0s * exp(-0.7 ts) (2 x 2 x 3)"
    )
    cases = [
        Case(
            "fitting",
            "control: a good fit",
            base + ")",
            fit_call(),
            "answer",
            check=_fit_check,
        )
    ]
    zero_weights = jnp.zeros(FIT_DATA.shape)
    nan_data = FIT_DATA.at[0, 0, 0].set(NAN)
    for name, kw, text, keyword in (
        (
            "zero experiments",
            dict(y0s=Y0S[:0], data=FIT_DATA[:0]),
            "y0s of shape (0, 3), data of shape (0, 2, 3)",
            r"experiment|trajector|empty|no data|y0s",
        ),
        (
            "data of the wrong shape",
            dict(data=jnp.zeros((2, 3, 3))),
            "data of shape (2, 3, 3)",
            r"\bdata\b.*shape",
        ),
        (
            "data 2-d",
            dict(data=FIT_DATA[:, :, 0]),
            "data of shape (2, 2)",
            r"\bdata\b.*shape",
        ),
        ("params0 NaN", dict(params0=jnp.asarray(NAN)), "params0=nan", r"params0"),
        ("params0 inf", dict(params0=jnp.asarray(INF)), "params0=inf", r"params0"),
        (
            "all weights zero",
            dict(weights=zero_weights),
            "weights=zeros(2, 2, 3)",
            r"weights",
        ),
        (
            "negative weights",
            dict(weights=-jnp.ones(FIT_DATA.shape)),
            "weights=-ones(2, 2, 3)",
            r"weights",
        ),
        ("NaN data, no weights", dict(data=nan_data), "data[0, 0, 0]=nan", r"nan"),
        (
            "ts unsorted",
            dict(ts=FIT_TS[::-1]),
            "ts=[1.0, 0.5]",
            r"\bts\b.*(increasing|sort)",
        ),
        ("ts before t0", dict(t0=0.7), "t0=0.7 (after ts[0])", r"\bts\b|\bt0\b"),
        ("ts 2-d", dict(ts=FIT_TS[None]), "ts of shape (1, 2)", r"\bts\b"),
        (
            "scalar leaf in y0s",
            dict(y0s=(FIT_Y0S, jnp.asarray(1.0))),
            "y0s=(y0s, 1.0)",
            r"y0s",
        ),
        (
            "params_axes=0 on a scalar",
            dict(params_axes=0),
            "params_axes=0 with params0=0.5 (a scalar)",
            r"params_axes|per-trajectory|per trajectory",
        ),
        ("jac='bogus'", dict(jac="bogus"), "jac='bogus'", r"\bjac\b"),
        ("optimiser=None", dict(optimiser=None), "optimiser=None", r"optimiser"),
        ("max_rounds=1", dict(max_rounds=1), "max_rounds=1", r"max_rounds"),
        ("max_steps=0", dict(max_steps=0), "max_steps=0", r"max_steps"),
        (
            "a Diffrax solver",
            dict(solver=diffrax.Tsit5()),
            "solver=diffrax.Tsit5()",
            r"solver|gs\.record cannot",
        ),
        (
            "observe of the wrong shape",
            dict(observe=lambda y, p: y[:2]),
            "observe=lambda y, p: y[:2] (data has 3 per time)",
            r"observe|\bdata\b.*shape",
        ),
    ):
        cases.append(
            Case(
                "fitting",
                name,
                base + ", " + text + ")",
                fit_call(**kw),
                "error",
                keyword,
            )
        )
    return cases


BUILDERS = {
    "times": times_cases,
    "states": states_cases,
    "controllers": controllers_cases,
    "meshes": meshes_cases,
    "files": files_cases,
    "ensembles": ensembles_cases,
    "fitting": fitting_cases,
}


# --------------------------------------------------------------------- the runner


def to_numpy(tree):
    tree = jax.block_until_ready(tree)
    return jtu.tree_map(lambda x: np.asarray(x) if eqx.is_array_like(x) else x, tree)


def has_nan(tree) -> bool:
    for x in jtu.tree_leaves(tree):
        a = np.asarray(x)
        if a.dtype.kind in "fc" and np.isnan(a).any():
            return True
    return False


def reports_failure(tree) -> bool:
    """Whether a result says it failed (a `success` flag that is False)."""
    if isinstance(tree, dict) and "success" in tree:
        return not bool(np.all(tree["success"]))
    return False


def valid(tree) -> bool:
    """A reference's answer is valid: successful and without NaN."""
    return not reports_failure(tree) and not has_nan(tree)


def compare(got, want, rtol: float) -> str | None:
    """`None` if `got` equals `want` (to `rtol` of each leaf's scale), else why."""
    got_leaves = jtu.tree_flatten_with_path(got)[0]
    want_leaves = jtu.tree_flatten_with_path(want)[0]
    if jtu.tree_structure(got) != jtu.tree_structure(want):
        return f"structure {jtu.tree_structure(got)} != {jtu.tree_structure(want)}"
    for (path, a), (_, b) in zip(got_leaves, want_leaves):
        name = jtu.keystr(path) or "value"
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return f"{name}: shape {a.shape}, reference {b.shape}"
        if a.dtype != b.dtype:
            return f"{name}: dtype {a.dtype}, reference {b.dtype}"
        if a.dtype.kind not in "fc":
            if not np.array_equal(a, b):
                return f"{name}: {a!r}, reference {b!r}"
            continue
        if not np.array_equal(np.isnan(a), np.isnan(b)):
            return f"{name}: NaN at other places than the reference ({a!r}, {b!r})"
        finite = np.isfinite(b)
        if not np.array_equal(a[~finite & ~np.isnan(b)], b[~finite & ~np.isnan(b)]):
            return f"{name}: infinities differ from the reference"
        if not np.all(np.isfinite(a[finite])):
            return f"{name}: inf where the reference is finite"
        tol = max(rtol, 64 * float(np.finfo(b.dtype).eps) if rtol else 0.0)
        scale = np.max(np.abs(b[finite]), initial=0.0)
        error = np.max(np.abs(a[finite] - b[finite]), initial=0.0)
        if error > tol * max(scale, np.finfo(np.float64).tiny):
            return (
                f"{name}: differs from the reference by {error:.3g} "
                f"(scale {scale:.3g}, rtol {tol:.1g})"
            )
    return None


def first_line(e: BaseException | None, limit: int = 240) -> str:
    if e is None:
        return ""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    # Equinox's runtime errors start with a stack trace; the message follows it.
    marked = [x for x in lines if x.startswith("equinox.EquinoxRuntimeError: ")]
    if marked:
        lines = [marked[0].split(": ", 1)[1]]
    text = lines[0] if lines else ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _message(e: BaseException) -> str:
    notes = "\n".join(getattr(e, "__notes__", []) or [])
    return f"{e}\n{notes}"


def run_case(case: Case) -> dict:
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
    if case.expected == "answer":
        # An answer is due unless the reference itself refuses the input.
        answer_due = ref_error is None
    else:
        # An error is due unless Diffrax answers this input (validly).
        answer_due = ref is not None and valid(ref)
    detail = ""
    if error is not None:
        if isinstance(error, JAX_INTERNAL) or not isinstance(
            error, case.errors + CLEAR_TYPES
        ):
            outcome = "crash"
        elif answer_due:
            outcome = "refused"
            detail = "the reference answers this input"
        elif not isinstance(error, case.errors):
            outcome = "unclear error"
            detail = f"expected {' or '.join(t.__name__ for t in case.errors)}"
        elif case.keyword is None or re.search(
            case.keyword, _message(error), re.IGNORECASE | re.DOTALL
        ):
            outcome = "clear error"
        else:
            outcome = "unclear error"
            detail = f"message does not match {case.keyword!r}"
    elif answer_due:
        if case.check is not None:
            why = case.check(got)
        elif ref is not None:
            why = compare(got, ref, case.rtol)
        else:
            why = "no reference"
        outcome = "correct answer" if why is None else "wrong answer"
        detail = why or ""
    elif reports_failure(got):
        outcome = "unclear error"
        detail = "no exception; the result reports a failure"
    else:
        outcome = "wrong answer"
        if ref_error is not None:
            detail = "returned an answer where the reference raises"
        elif ref is not None:
            detail = "returned an answer where the reference's is invalid (NaN/failed)"
        else:
            detail = "returned an answer where an error is due"
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
    counts = collections.defaultdict(collections.Counter)
    for r in records:
        counts[r["family"]][r["outcome"]] += 1
    head = ["family", "tried"] + [o + "s" for o in OUTCOMES]
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
        if r["reference"]:
            lines.append(f"  - Diffrax/reference: {r['reference']}")
    return "\n".join(lines)


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, action="append")
    parser.add_argument("--json", type=pathlib.Path, default=None)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--match", default=None, help="only cases whose name matches")
    return parser.parse_args()


def main():
    opts = _parse()
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
    wall = time.perf_counter() - start
    print(f"\n{len(records)} inputs tried in {wall:.0f} s.\n")
    print(table(records))
    print("\nNot a clear error or a correct answer:\n")
    print(exceptions_list(records) or "(none)")
    out = opts.json if opts.json else (RESULTS if opts.family is None else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        summary = collections.Counter(r["outcome"] for r in records)
        report = {
            "description": __doc__.splitlines()[0],
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


if __name__ == "__main__":
    main()
