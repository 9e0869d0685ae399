"""Family `times`: bad and unusual times.

Non-finite, zero, wrong-sign, integer, boolean, array and reversed times,
`saveat.ts` unsorted, out of range, with NaN, empty or 2-d, and derivatives with
respect to `t1`; through `gs.diffeqsolve` and `gs.record`, eagerly and under
`jax.jit`.
"""

import functools

import diffrax
import jax
import jax.numpy as jnp
import numpy as np

import gradsolve as gs

from .calls import solve_cases
from .case import Case
from .defaults import CTRL, INF, NAN, TERM, Y0, K


def times_cases() -> list[Case]:
    """The cases of family `times`, in the order they are run."""
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
