"""Stiff test problems with SciPy references (Radau at rtol=1e-12).

Robertson, Van der Pol, HIRES and OREGO are from Hairer & Wanner, "Solving ODEs II",
Section IV.10, and the "Test Set for IVP Solvers" (Mazzia & Magherini).
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from scipy.integrate import solve_ivp


@dataclasses.dataclass(frozen=True)
class StiffProblem:
    name: str
    f: Callable
    y0: tuple
    args: tuple
    t1: float
    # Absolute tolerance as a multiple of rtol: the scale below which a component is
    # considered negligible.
    atol_scale: float


def robertson(t, y, k):
    k1, k2, k3 = k
    return jnp.stack(
        [
            -k1 * y[0] + k3 * y[1] * y[2],
            k1 * y[0] - k2 * y[1] ** 2 - k3 * y[1] * y[2],
            k2 * y[1] ** 2,
        ]
    )


def van_der_pol(t, y, mu):
    # Time scaled by mu (Hairer & Wanner's VDPOL with epsilon = 1 / mu^2).
    (mu,) = mu
    return jnp.stack([y[1], mu**2 * ((1 - y[0] ** 2) * y[1] - y[0])])


def hires(t, y, p):
    del p
    y1, y2, y3, y4, y5, y6, y7, y8 = (y[i] for i in range(8))
    return jnp.stack(
        [
            -1.71 * y1 + 0.43 * y2 + 8.32 * y3 + 0.0007,
            1.71 * y1 - 8.75 * y2,
            -10.03 * y3 + 0.43 * y4 + 0.035 * y5,
            8.32 * y2 + 1.71 * y3 - 1.12 * y4,
            -1.745 * y5 + 0.43 * y6 + 0.43 * y7,
            -280.0 * y6 * y8 + 0.69 * y4 + 1.71 * y5 - 0.43 * y6 + 0.69 * y7,
            280.0 * y6 * y8 - 1.81 * y7,
            -280.0 * y6 * y8 + 1.81 * y7,
        ]
    )


def orego(t, y, p):
    del p
    y1, y2, y3 = y[0], y[1], y[2]
    return jnp.stack(
        [
            77.27 * (y2 + y1 * (1 - 8.375e-6 * y1 - y2)),
            (y3 - (1 + y1) * y2) / 77.27,
            0.161 * (y1 - y3),
        ]
    )


STIFF = {
    "robertson": StiffProblem(
        "robertson", robertson, (1.0, 0.0, 0.0), (0.04, 3e7, 1e4), 1e5, 1e-4
    ),
    "van_der_pol": StiffProblem(
        "van_der_pol", van_der_pol, (2.0, -0.66), (1e3,), 2.0, 1.0
    ),
    "hires": StiffProblem(
        "hires",
        hires,
        (1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0057),
        (0.0,),
        321.8122,
        1e-2,
    ),
    "orego": StiffProblem("orego", orego, (1.0, 2.0, 3.0), (0.0,), 360.0, 1.0),
}


# The state at `t1` from SciPy's Radau at rtol = 1e-12, atol = 1e-16 (what
# `scipy_reference` computes; `test_stored_references_are_scipys` checks that they
# still agree). Stored because SciPy, calling the field once per evaluation, takes
# ~27 s for the four.
REFERENCES = {
    "robertson": (0.017865921142322397, 7.274751468528724e-08, 0.9821340061101629),
    "van_der_pol": (1.7061674375431708, -0.8928100165511259),
    "hires": (
        0.000737131257332554,
        0.00014424857263161593,
        5.888729740967339e-05,
        0.001175651343283125,
        0.0023863561988309552,
        0.006238968252741638,
        0.0028499983951855014,
        0.002850001604814484,
    ),
    "orego": (1.0008148703185227, 1228.178521549905, 132.05549428466253),
}


def reference(name: str) -> np.ndarray:
    """The state at `t1` from SciPy's Radau at rtol=1e-12 (stored)."""
    return np.array(REFERENCES[name])


@functools.cache
def scipy_reference(name: str) -> np.ndarray:
    """The state at `t1` from SciPy's Radau at rtol=1e-12, computed now."""
    p = STIFF[name]
    args = jnp.array(p.args, dtype=jnp.float64)
    field = jax.jit(lambda t, y: p.f(t, y, args))
    jac = jax.jit(jax.jacfwd(lambda t, y: p.f(t, y, args), argnums=1))
    sol = solve_ivp(
        lambda t, y: np.asarray(field(t, y)),
        (0.0, p.t1),
        np.array(p.y0),
        method="Radau",
        rtol=1e-12,
        atol=1e-16,
        jac=lambda t, y: np.asarray(jac(t, y)),
    )
    assert sol.success, sol.message
    return sol.y[:, -1]
