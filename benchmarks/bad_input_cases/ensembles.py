"""Family `ensembles`: `gs.record_ensemble` and `gs.replay_ensemble` misused.

`chunk_size`, `memory_budget`, batch mismatches, scalar leaves, `args_axes`,
unbatched and stale meshes.
"""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np

import gradsolve as gs

from .case import Case, describe
from .defaults import CTRL, KS, TERM, Y0S
from .fixtures import base_mesh, batched_mesh, vmapped_diffrax


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
    return vmapped_diffrax(Y0S, KS)["ys"]


def ensembles_cases() -> list[Case]:
    """The cases of family `ensembles`, in the order they are run."""
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
