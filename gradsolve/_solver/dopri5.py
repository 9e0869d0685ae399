"""The Dormand--Prince 5(4) method."""

from typing import ClassVar

import diffrax
import numpy as np

from .base import AbstractExplicitSolver
from .interpolation import AbstractWeightedInterpolation, Weights


# Dormand & Prince, "A family of embedded Runge-Kutta formulae", J. Comp. Appl. Math.
# 6 (1980) 19-26, Table 2 (RK5(4)7M) for `a`, `b` and `c`. The embedded fourth-order
# weights bhat are Shampine's, "Some practical Runge-Kutta formulas", Math. Comp. 46
# (1986) 135-150, as in Diffrax's `Dopri5`; `b_error` is b - bhat.
_dopri5_tableau = diffrax.ButcherTableau(
    a_lower=(
        np.array([1 / 5]),
        np.array([3 / 40, 9 / 40]),
        np.array([44 / 45, -56 / 15, 32 / 9]),
        np.array([19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729]),
        np.array([9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656]),
        np.array([35 / 384, 0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84]),
    ),
    b_sol=np.array([35 / 384, 0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84, 0]),
    b_error=np.array(
        [
            35 / 384 - 1951 / 21600,
            0,
            500 / 1113 - 22642 / 50085,
            125 / 192 - 451 / 720,
            -2187 / 6784 + 12231 / 42400,
            11 / 84 - 649 / 6300,
            -1 / 60,
        ]
    ),
    c=np.array([1 / 5, 3 / 10, 4 / 5, 8 / 9, 1.0, 1.0]),
)

# Shampine, "Some practical Runge-Kutta formulas", Math. Comp. 46 (1986) 135-150:
# the solution at the midpoint of the step, y(1/2) = y0 + sum_i _c_mid[i] k_i.
_c_mid = (
    6025192743 / 30085553152 / 2,
    0.0,
    51252292925 / 65400821598 / 2,
    -2691868925 / 45128329728 / 2,
    187940372067 / 1594534317056 / 2,
    -1776094331 / 19743644256 / 2,
    11237099 / 235043384 / 2,
)


class _Dopri5Interpolation(AbstractWeightedInterpolation):
    """The quartic through `y0`, `y1`, `y(1/2)` with slopes `k_1` and `k_7` at the
    ends (Hairer, Norsett & Wanner, "Solving ODEs I", Section II.6), written as weights:
    the same polynomial as Diffrax's `FourthOrderPolynomialInterpolation`."""

    @staticmethod
    def weights(theta) -> Weights:
        t = theta
        t2 = t * t
        bump = 16 * t2 * (t - 1) ** 2  # the weight of y(1/2)
        w_y0 = 1 + t2 * (5 + t * (-14 + 8 * t))
        w_y1 = t2 * (-5 + t * (14 - 8 * t))
        w_f0 = t * (1 + t * (-4 + t * (5 - 2 * t)))
        w_f1 = t2 * (1 + t * (-3 + 2 * t))
        w_ks = [None if c == 0 else c * bump for c in _c_mid]
        w_ks[0] = w_ks[0] + w_f0
        w_ks[-1] = w_ks[-1] + w_f1
        return w_y0, w_y1, tuple(w_ks)


class Dopri5(AbstractExplicitSolver):
    r"""The Dormand--Prince 5/4 method.

    Fifth-order explicit Runge--Kutta method with an embedded fourth-order error
    estimate, 7 stages with first-same-as-last, and a fourth-order continuous
    extension for `SaveAt(ts=...)`. Takes the same steps as `diffrax.Dopri5` and is a
    valid Diffrax solver.

    ??? cite "Reference"

        ```bibtex
        @article{dormand1980family,
            author={Dormand, J. R. and Prince, P. J.},
            title={A family of embedded {R}unge--{K}utta formulae},
            journal={J. Comp. Appl. Math},
            year={1980},
            volume={6},
            pages={19--26}
        }
        ```
    """

    tableau: ClassVar[diffrax.ButcherTableau] = _dopri5_tableau
    interpolation_cls: ClassVar[type[_Dopri5Interpolation]] = _Dopri5Interpolation

    def order(self, terms):
        del terms
        return 5
