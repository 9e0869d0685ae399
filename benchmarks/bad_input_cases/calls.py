"""The calls a case makes: gradsolve's, and Diffrax's as the reference.

[`solve_cases`][] makes the cases of one input to `gs.diffeqsolve`/`gs.record`,
eagerly and under `jax.jit`, each held to Diffrax's `diffrax.diffeqsolve` on the
same input; `solution_out`, `mesh_out` and `steps_out` turn what the calls return
into plain trees that can be compared.
"""

from collections.abc import Callable

import diffrax
import equinox as eqx
import jax.numpy as jnp
import numpy as np

import gradsolve as gs

from .case import Case, describe
from .defaults import DEFAULTS, DIFFRAX_SOLVER


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
            ok = bool(sol.result == diffrax.RESULTS.successful)
            if ok and isinstance(sub, diffrax.SubSaveAt) and not sub.steps:
                _check_times(sol.ts, t0, t1, sub)
            return solution_out(sol)
        subs = [diffrax.SubSaveAt(t1=True), diffrax.SubSaveAt(steps=True)]
        if saveat.subs.ts is not None:  # checked by Diffrax too
            subs.insert(0, diffrax.SubSaveAt(ts=saveat.subs.ts))
        kw["saveat"] = diffrax.SaveAt(subs=subs)
        kw.pop("kernel", None)
        sol = diffrax.diffeqsolve(term, solver, *pos, **kw)
        t0, t1 = times()
        if bool(sol.result == diffrax.RESULTS.successful):
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
    reference_inputs=None,
    user_errors=(),
    rtol=1e-9,
    **inputs,
) -> list[Case]:
    """The cases of one input for each API and each of eager/`jit`.

    `reference_inputs` replace `inputs` for Diffrax where it needs another spelling
    of the same input; `user_errors` are JAX's exception types that count as a clear
    error here (see `Case`)."""
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
                    reference=(
                        diffrax_call(api, {**inputs, **(reference_inputs or {})})
                        if reference
                        else None
                    ),
                    rtol=rtol,
                    user_errors=tuple(user_errors),
                )
            )
    return out
