"""Family `meshes`: replays that do not fit their mesh.

Replays with another state, dtype, solver or problem, of failed and stale meshes,
with bad `stale=`, `saveat` or batch sizes.
"""

import functools
import warnings

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import gradsolve as gs

from .calls import solution_out
from .case import Case, describe, fmt
from .defaults import CTRL, KS, NAN, TERM, Y0, Y0S, K, decay, rotate
from .fixtures import (
    base_mesh,
    batched_mesh,
    failed_mesh,
    point_mesh,
    reversed_mesh,
    stepto,
)


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
    """The cases of family `meshes`, in the order they are run."""
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
    # Promoted to the mesh's float64 as the recording promotes them (as Diffrax
    # does): an answer is due, Diffrax's over the same steps.
    for name, y0 in (
        ("y0 int (promoted as recorded)", jnp.array([1, 2, 3])),
        ("y0 float32 (promoted as recorded)", Y0.astype(jnp.float32)),
    ):
        cases.append(
            Case(
                "meshes",
                name,
                f"gs.replay(mesh of y0=float64[3], ..., y0={fmt(y0)})",
                replay_call(base_mesh, y0=y0),
                "answer",
                state,
                reference=functools.partial(lambda y0: stepto(base_mesh(), y0=y0), y0),
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
