"""Tsitouras' 5(4) method."""

from typing import ClassVar

import diffrax
import numpy as np

from .base import AbstractExplicitSolver
from .interpolation import AbstractWeightedInterpolation, Weights


# Tsitouras, "Runge--Kutta pairs of order 5(4) satisfying only the first column
# simplifying assumption", Comput. Math. Appl. 62 (2011) 770-775, Table 1 (the
# coefficients to 20 significant digits, as also used by OrdinaryDiffEq.jl and
# Diffrax). `b_error` is b - bhat, with bhat from the same table.
_b = np.array(
    [
        0.09646076681806522951816731316512876,
        0.01,
        0.47988965041449957477524953229059652,
        1.37900857410374189319227482185687277,
        -3.29006951543608067990104758571136385,
        2.32471052409977398241535591839876580,
        0.0,
    ]
)
_bhat = np.array(
    [
        0.09468075576583945807478876255758923,
        0.00918356554034325309677636393664531,
        0.48777052842476157078556425996312282,
        1.23429756693047898565510967388423765,
        -2.70771234998352545488110997505932167,
        1.86662841817058703575371939956621150,
        1 / 66,
    ]
)
_tsit5_tableau = diffrax.ButcherTableau(
    a_lower=(
        np.array([0.161]),
        np.array([-0.00848065549235698854442687425023077, 0.33548065549235698854]),
        np.array(
            [
                2.89715305710549343213043259419293876,
                -6.35944848997507484314815991238382563,
                4.36229543286958141101772731819088686,
            ]
        ),
        np.array(
            [
                5.32586482843925660442887792084051132,
                -11.74888356406282787774717033978577296,
                7.49553934288983620830460478456435816,
                -0.09249506636175524925650207933207192,
            ]
        ),
        np.array(
            [
                5.86145544294642002865925148698264789,
                -12.92096931784710929170611868178335940,
                8.15936789857615864318040079453925349,
                -0.07158497328140099722453054252582974,
                -0.02826905039406838290900305721271224,
            ]
        ),
        _b[:6],
    ),
    b_sol=_b,
    b_error=_b - _bhat,
    c=np.array([0.161, 0.327, 0.9, 0.98002554090450968572981028628702460, 1.0, 1.0]),
)


class _Tsit5Interpolation(AbstractWeightedInterpolation):
    """Tsitouras' fourth-order continuous extension of Tsit5 (same reference, Section
    4), in the factored form Diffrax uses, so that dense output agrees with
    `diffrax.Tsit5` to round-off."""

    @staticmethod
    def weights(theta) -> Weights:
        t = theta
        t2 = t * t
        return (
            None,
            None,
            (
                -1.0530884977290216
                * t
                * (t - 1.3299890189751412)
                * (t2 - 1.4364028541716351 * t + 0.7139816917074209),
                0.1017 * t2 * (t2 - 2.1966568338249754 * t + 1.2949852507374631),
                2.490627285651252793
                * t2
                * (t2 - 2.38535645472061657 * t + 1.57803468208092486),
                -16.54810288924490272
                * (t - 1.21712927295533244)
                * (t - 0.61620406037800089)
                * t2,
                47.37952196281928122
                * (t - 1.203071208372362603)
                * (t - 0.658047292653547382)
                * t2,
                -34.87065786149660974 * (t - 1.2) * (t - 0.666666666666666667) * t2,
                2.5 * (t - 1) * (t - 0.6) * t2,
            ),
        )


class Tsit5(AbstractExplicitSolver):
    r"""Tsitouras' 5/4 method.

    Fifth-order explicit Runge--Kutta method with an embedded fourth-order error
    estimate, 7 stages with first-same-as-last, and a fourth-order continuous
    extension for `SaveAt(ts=...)`. Takes the same steps as `diffrax.Tsit5` and is a
    valid Diffrax solver.

    ??? cite "Reference"

        ```bibtex
        @article{tsitouras2011runge,
          title={Runge--Kutta pairs of order 5(4) satisfying only the first column
                 simplifying assumption},
          author={Tsitouras, Ch},
          journal={Computers \& Mathematics with Applications},
          volume={62},
          number={2},
          pages={770--775},
          year={2011}
        }
        ```
    """

    tableau: ClassVar[diffrax.ButcherTableau] = _tsit5_tableau
    interpolation_cls: ClassVar[type[_Tsit5Interpolation]] = _Tsit5Interpolation

    def order(self, terms):
        del terms
        return 5
