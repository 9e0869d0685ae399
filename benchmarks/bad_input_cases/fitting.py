"""Family `fitting`: `gs.fit` with bad experiments, data or settings.

No experiments, data of the wrong shape, NaN parameters, zero or negative
weights, unsorted times, unknown options, ... against a control fit of
y' = -k y to data made with k = 0.7.
"""

import diffrax
import jax.numpy as jnp
import optimistix as optx

import gradsolve as gs

from .case import Case
from .defaults import INF, NAN, TERM, Y0S


FIT_TS = jnp.array([0.5, 1.0])
FIT_Y0S = Y0S[:2]
FIT_DATA = FIT_Y0S[:, None, :] * jnp.exp(-0.7 * FIT_TS)[None, :, None]


def fit_call(**kw):
    """`gs.fit` on the control fit's inputs updated by `kw`."""
    args = dict(params0=jnp.asarray(0.5), y0s=FIT_Y0S, ts=FIT_TS, data=FIT_DATA)
    args.update(kw)
    positional = [args.pop(k) for k in ("params0", "y0s", "ts", "data")]
    solver = args.pop("solver", gs.Tsit5())

    def call():
        fit = gs.fit(TERM, solver, *positional, **args)
        return {
            "params": fit.params,
            "success": fit.result == optx.RESULTS.successful,
            "result": optx.RESULTS[fit.result],
        }

    return call


def _fit_check(out):
    if not bool(out["success"]):
        return "result is not successful"
    error = abs(float(out["params"]) - 0.7)
    return None if error < 1e-6 else f"params={float(out['params'])!r}, not 0.7"


def fitting_cases() -> list[Case]:
    """The cases of family `fitting`, in the order they are run."""
    cases = [
        Case(
            "fitting",
            "control: a good fit",
            "gs.fit(term, gs.Tsit5(), params0, y0s, ts, data), converging to 0.7",
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
        ("NaN in ts", dict(ts=FIT_TS.at[0].set(NAN)), "ts=[nan, 1.0]", r"\bts\b.*NaN"),
        ("t0 NaN", dict(t0=NAN), "t0=nan", r"\bt0\b|initial time"),
        ("dt0 zero", dict(dt0=0.0), "dt0=0.0", r"dt0|initial step"),
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
                f"gs.fit(term, gs.Tsit5(), params0, y0s, ts, data), but {text}",
                fit_call(**kw),
                "error",
                keyword,
            )
        )
    return cases
