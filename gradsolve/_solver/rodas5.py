"""The Rosenbrock methods Rodas5 (Di Marzo 1993) and Rodas5P (Steinebach 2023)."""

from typing import ClassVar

from .rosenbrock import AbstractRosenbrock, RosenbrockTableau


# Both methods are stiffly accurate with 8 stages: the solution is the last stage
# (b_i = a_8i, b_8 = 1) and the error estimate is the last increment k_8. Their
# coefficients are in the transformed form of Hairer & Wanner, "Solving ODEs II",
# eq. IV.7.25, with the dense-output matrices H of OrdinaryDiffEq.jl
# (lib/OrdinaryDiffEqRosenbrockTableaus/src/rosenbrock_tableaus.jl: RODAS5*,
# RODAS5P*), which fit a fourth-order continuous extension to the stages.


def _stiffly_accurate(gamma, a, C, c, d, dense) -> RosenbrockTableau:
    b_sol = a[-1] + (1.0,)
    b_error = (0.0,) * (len(b_sol) - 1) + (1.0,)
    return RosenbrockTableau(
        gamma=gamma,
        a=a,
        C=C,
        c=c,
        d=d,
        b_sol=b_sol,
        b_error=b_error,
        dense=dense,
        order=5,
    )


# Di Marzo, "RODAS5(4) - Methodes de Rosenbrock d'ordre 5(4) adaptees aux problemes
# differentiels-algebriques", MSc thesis, University of Geneva (1993), as distributed
# with OrdinaryDiffEq.jl's `Rodas5`.
_rodas5_row5 = (
    -14.09640773051259,
    6.925207756232704,
    -41.47510893210728,
    2.343771018586405,
    24.13215229196062,
)
RODAS5_TABLEAU = _stiffly_accurate(
    gamma=0.19,
    a=(
        (2.0,),
        (3.040894194418781, 1.041747909077569),
        (2.576417536461461, 1.62208306077664, -0.9089668560264532),
        (2.760842080225597, 1.446624659844071, -0.3036980084553738, 0.2877498600325443),
        _rodas5_row5,
        _rodas5_row5 + (1.0,),
        _rodas5_row5 + (1.0, 1.0),
    ),
    C=(
        (-10.31323885133993,),
        (-21.04823117650003, -7.234992135176716),
        (32.22751541853323, -4.943732386540191, 19.44922031041879),
        (
            -20.69865579590063,
            -8.816374604402768,
            1.260436877740897,
            -0.7495647613787146,
        ),
        (
            -46.22004352711257,
            -17.49534862857472,
            -289.6389582892057,
            93.60855400400906,
            318.3822534212147,
        ),
        (
            34.20013733472935,
            -14.1553540271769,
            57.823356409884,
            25.83362985412365,
            1.408950972071624,
            -6.551835421242162,
        ),
        (
            42.57076742291101,
            -13.80770672017997,
            93.98938432427124,
            18.77919633714503,
            -31.5835918722337,
            -6.685968952921985,
            -5.810979938412932,
        ),
    ),
    c=(
        0.0,
        0.38,
        0.3878509998321533,
        0.483971893787384,
        0.457047700881958,
        1.0,
        1.0,
        1.0,
    ),
    d=(
        0.19,
        -0.1823079225333714636,
        -0.319231832186874912,
        0.3449828624725343,
        -0.377417564392089818,
        0.0,
        0.0,
        0.0,
    ),
    dense=(
        (
            27.354592673333357,
            -6.925207756232857,
            26.40037733258859,
            0.5635230501052979,
            -4.699151156849391,
            -1.6008677469422725,
            -1.5306074446748028,
            -1.3929872940716344,
        ),
        (
            44.19024239501722,
            1.3677947663381929e-13,
            202.93261852171622,
            -35.5669339789154,
            -181.91095152160645,
            3.4116351403665033,
            2.5793540257308067,
            2.2435122582734066,
        ),
        (
            -44.0988150021747,
            -5.755396159656812e-13,
            -181.26175034586677,
            56.99302194811676,
            183.21182741427398,
            -7.480257918273637,
            -5.792426076169686,
            -5.32503859794143,
        ),
    ),
)


# Steinebach, "Construction of Rosenbrock-Wanner method Rodas5P and numerical
# benchmarks within the Julia Differential Equations package", BIT Numer. Math. 63
# (2023) 27.
_rodas5p_row5 = (
    -7.502846399306121,
    2.561846144803919,
    -11.627539656261098,
    -0.18268767659942256,
    0.030198172008377946,
)
RODAS5P_TABLEAU = _stiffly_accurate(
    gamma=0.21193756319429014,
    a=(
        (3.0,),
        (2.849394379747939, 0.45842242204463923),
        (-6.954028509809101, 2.489845061869568, -10.358996098473584),
        (
            2.8029986275628964,
            0.5072464736228206,
            -0.3988312541770524,
            -0.04721187230404641,
        ),
        _rodas5p_row5,
        _rodas5p_row5 + (1.0,),
        _rodas5p_row5 + (1.0, 1.0),
    ),
    C=(
        (-14.155112264123755,),
        (-17.97296035885952, -2.859693295451294),
        (147.12150275711716, -1.41221402718213, 71.68940251302358),
        (
            165.43517024871676,
            -0.4592823456491126,
            42.90938336958603,
            -5.961986721573306,
        ),
        (
            24.854864614690072,
            -3.0009227002832186,
            47.4931110020768,
            5.5814197821558125,
            -0.6610691825249471,
        ),
        (
            30.91273214028599,
            -3.1208243349937974,
            77.79954646070892,
            34.28646028294783,
            -19.097331116725623,
            -28.087943162872662,
        ),
        (
            37.80277123390563,
            -3.2571969029072276,
            112.26918849496327,
            66.9347231244047,
            -40.06618937091002,
            -54.66780262877968,
            -9.48861652309627,
        ),
    ),
    c=(
        0.0,
        0.6358126895828704,
        0.4095798393397535,
        0.9769306725060716,
        0.4288403609558664,
        1.0,
        1.0,
        1.0,
    ),
    d=(
        0.21193756319429014,
        -0.42387512638858027,
        -0.3384627126235924,
        1.8046452872882734,
        2.325825639765069,
        0.0,
        0.0,
        0.0,
    ),
    dense=(
        (
            25.948786856663858,
            -2.5579724845846235,
            10.433815404888879,
            -2.3679251022685204,
            0.524948541321073,
            1.1241088310450404,
            0.4272876194431874,
            -0.17202221070155493,
        ),
        (
            -9.91568850695171,
            -0.9689944594115154,
            3.0438037242978453,
            -24.495224566215796,
            20.176138334709044,
            15.98066361424651,
            -6.789040303419874,
            -6.710236069923372,
        ),
        (
            11.419903575922262,
            2.8879645146136994,
            72.92137995996029,
            80.12511834622643,
            -52.072871366152654,
            -59.78993625266729,
            -0.15582684282751913,
            4.883087185713722,
        ),
    ),
)


class Rodas5(AbstractRosenbrock):
    r"""Rodas5: a stiffly accurate, L-stable Rosenbrock method of order 5 with an
    embedded order-4 error estimate and a fourth-order continuous extension.

    For stiff problems (chemical kinetics, pharmacology, circuits). Each step forms the
    Jacobian once by forward-mode autodiff and factorises one small matrix, reused by
    its 8 stages. Differentiable through the Jacobian and the linear solves, and also
    a valid Diffrax solver.

    ??? cite "Reference"

        ```bibtex
        @mastersthesis{dimarzo1993rodas5,
            author={Di Marzo, G.},
            title={{RODAS5(4)} -- M\'{e}thodes de {R}osenbrock d'ordre 5(4) adapt\'{e}es
                   aux probl\`{e}mes diff\'{e}rentiels-alg\'{e}briques},
            school={University of Geneva},
            year={1993}
        }
        @book{hairer1996stiff,
            author={Hairer, E. and Wanner, G.},
            title={Solving Ordinary Differential Equations {II}: Stiff and
                   Differential-Algebraic Problems},
            publisher={Springer},
            edition={2},
            year={1996}
        }
        ```
    """

    tableau: ClassVar[RosenbrockTableau] = RODAS5_TABLEAU


class Rodas5P(AbstractRosenbrock):
    r"""Rodas5P: Steinebach's refit of Rodas5, of order 5 with an order-4 error
    estimate and a fourth-order continuous extension; more robust than `Rodas5` at
    tight tolerances and on problems with time-dependent forcing.

    ??? cite "Reference"

        ```bibtex
        @article{steinebach2023rodas5p,
            author={Steinebach, G.},
            title={Construction of {R}osenbrock--{W}anner method {R}odas5{P} and
                   numerical benchmarks within the {J}ulia {D}ifferential {E}quations
                   package},
            journal={BIT Numerical Mathematics},
            volume={63},
            pages={27},
            year={2023}
        }
        ```
    """

    tableau: ClassVar[RosenbrockTableau] = RODAS5P_TABLEAU
