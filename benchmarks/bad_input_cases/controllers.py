"""Family `controllers`: step size controllers, solvers and their settings.

Tolerances negative, zero or NaN, `max_steps`, `dtmin`/`dtmax`,
`ConstantStepSize`/`StepTo` misuse, solvers gradsolve does not have (which fall
back to Diffrax), a stiff problem on an explicit solver.
"""

import diffrax
import jax.numpy as jnp
import numpy as np

import gradsolve as gs

from .calls import solve_cases
from .case import Case
from .defaults import INF, NAN, decay, robertson


def controllers_cases() -> list[Case]:
    """The cases of family `controllers`, in the order they are run."""
    cases = []
    pid = diffrax.PIDController
    # The message must name the setting as the fault ("rtol=-1e-06 ...", "rtol
    # must ..."), not only advise to "loosen rtol/atol" as any failed solve does.
    named = lambda *names: r"\b(" + "|".join(names) + r")\b\s*(=|is|are|must|cannot)"
    for name, ctrl, keyword in (
        ("rtol<0", pid(rtol=-1e-6, atol=1e-6), named("rtol")),
        ("atol<0", pid(rtol=1e-6, atol=-1e-6), named("atol")),
        ("rtol=atol=0", pid(rtol=0.0, atol=0.0), named("rtol", "atol")),
        ("rtol=nan", pid(rtol=NAN, atol=1e-6), named("rtol")),
        ("atol=nan", pid(rtol=1e-6, atol=NAN), named("atol")),
        ("rtol=inf", pid(rtol=INF, atol=1e-6), named("rtol")),
        ("dtmax=0", pid(rtol=1e-6, atol=1e-6, dtmax=0.0), r"\bdtmax\b"),
        (
            "dtmin > dtmax",
            pid(rtol=1e-6, atol=1e-6, dtmin=0.5, dtmax=0.1),
            r"\bdtmin\b.*\bdtmax\b|\bdtmax\b.*\bdtmin\b",
        ),
        ("factormax < 1", pid(rtol=1e-6, atol=1e-6, factormax=0.9), r"factormax"),
    ):
        cases += solve_cases(
            "controllers",
            name,
            "error",
            keyword,
            apis=("diffeqsolve", "record"),
            stepsize_controller=ctrl,
        )
    for name, ctrl, keyword in (
        ("rtol=0 (absolute only)", pid(rtol=0.0, atol=1e-6), named("rtol")),
        ("atol=0 (relative only)", pid(rtol=1e-6, atol=0.0), named("atol")),
        ("dtmin > t1 - t0", pid(rtol=1e-6, atol=1e-6, dtmin=2.0), r"\bdtmin\b"),
        ("dtmax tiny", pid(rtol=1e-6, atol=1e-6, dtmax=0.05), r"\bdtmax\b"),
    ):
        cases += solve_cases(
            "controllers",
            name,
            "answer",
            keyword,
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
        "controllers",
        "max_steps=np.int64(64)",
        "answer",
        r"max_steps",
        # Diffrax needs a Python int here (it branches on max_steps in Python).
        reference_inputs=dict(max_steps=64),
        max_steps=np.int64(64),
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
            solver=solver,
        )
    cases += solve_cases(
        "controllers",
        "terms a plain function",
        "error",
        r"term|ODETerm",
        apis=("diffeqsolve", "record"),
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
