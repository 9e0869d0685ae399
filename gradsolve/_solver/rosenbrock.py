"""Rosenbrock methods: linearly implicit one-step methods for stiff problems."""

import dataclasses
import math
from typing import ClassVar

import diffrax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._custom_types import Leaves
from .._problem import LeafProblem
from .._representation import Representation
from .base import AbstractGradsolveSolver, linear_combination
from .interpolation import AbstractWeightedInterpolation, Weights
from .linear import linearise, system


# The dense output is a polynomial of degree at most this plus one.
MAX_DENSE_ROWS = 3


@dataclasses.dataclass(frozen=True)
class RosenbrockTableau:
    r"""The coefficients of an `s`-stage Rosenbrock method, as Python floats.

    They are those of Hairer & Wanner, "Solving ODEs II", Section IV.7, eq. (7.25),
    the form OrdinaryDiffEq.jl also uses: for a step of size `h` from `(t0, y0)`,
    with `J = df/dy` and `f_t = df/dt` at `(t0, y0)`,

    $(I/(\gamma h) - J) k_i = f(t_0 + c_i h, y_0 + \sum_{j<i} a_{ij} k_j)
        + \sum_{j<i} (C_{ij} / h) k_j + d_i h f_t$,

    $y_1 = y_0 + \sum_i b_i k_i$, the error estimate is $\sum_i e_i k_i$ and the
    dense output is $y(\theta) = (1 - \theta) y_0 + \theta y_1
    + \theta (1 - \theta) \sum_j \theta^{j} \sum_i H_{ji} k_i$.

    Construction checks the shapes and the consistency conditions that these
    coefficients must satisfy in this form: $c_i = \sum_j a_{ij} d_j$ (the stage
    times), $\sum_i b_i d_i = 1$ (order one) and $\sum_i e_i d_i = 0$ (the error
    estimate vanishes on a consistent step).
    """

    gamma: float
    a: tuple[tuple[float, ...], ...]
    C: tuple[tuple[float, ...], ...]
    c: tuple[float, ...]
    d: tuple[float, ...]
    b_sol: tuple[float, ...]
    b_error: tuple[float, ...]
    dense: tuple[tuple[float, ...], ...]
    order: int

    def __post_init__(self):
        s = len(self.b_sol)
        lengths = (len(self.c), len(self.d), len(self.b_error))
        if lengths != (s, s, s) or any(len(row) != s for row in self.dense):
            raise ValueError(
                "c, d, b_sol, b_error and the dense rows need one entry a stage."
            )
        if len(self.dense) > MAX_DENSE_ROWS:
            raise ValueError(f"At most {MAX_DENSE_ROWS} rows of dense coefficients.")
        for name, rows in (("a", self.a), ("C", self.C)):
            if len(rows) != s - 1 or any(len(r) != i + 1 for i, r in enumerate(rows)):
                raise ValueError(f"{name} must be strictly lower triangular.")
        values = [self.gamma, *self.c, *self.d, *self.b_sol, *self.b_error]
        values += [x for rows in (self.a, self.C, self.dense) for r in rows for x in r]
        if not all(math.isfinite(x) for x in values) or self.gamma <= 0:
            raise ValueError("Rosenbrock coefficients must be finite, with gamma > 0.")
        tol = 1e-10
        for i, row in enumerate(self.a, start=1):
            if abs(sum(a * d for a, d in zip(row, self.d)) - self.c[i]) > tol:
                raise ValueError(f"Stage {i + 1}: c != sum_j a_ij d_j.")
        if abs(sum(b * d for b, d in zip(self.b_sol, self.d)) - 1) > tol:
            raise ValueError("The method is not consistent: sum_i b_i d_i != 1.")
        if abs(sum(e * d for e, d in zip(self.b_error, self.d))) > tol:
            raise ValueError("The error estimate is inconsistent: sum_i e_i d_i != 0.")

    @property
    def num_stages(self) -> int:
        return len(self.b_sol)


def rosenbrock_step(
    tableau: RosenbrockTableau, vf, t0, t1, control, y0: Leaves
) -> tuple[Leaves, Leaves, list[Leaves]]:
    """One Rosenbrock step.

    **Arguments:**

    - `vf`: the vector field `(t, leaves) -> leaves`, on the time axis of `t0`, `t1`.
    - `t0`, `t1`: the step.
    - `control`: the step in the ODE's own time (`t1 - t0`, or its negative when
        integrating backwards with a field of reversed time).
    - `y0`: the state, as leaves or as scalar components.

    **Returns:**

    `(y1, y_error, dense)`: the new state, the embedded error estimate, and the data of
    the dense output (`sum_i H_ji k_i` for each row `j` of `tableau.dense`).

    The equations are those of `RosenbrockTableau` multiplied by `gamma h`, so the
    matrix is `I - gamma h J`: it tends to the identity as `h -> 0`. A singular
    matrix gives a non-finite error estimate, and the step is rejected like any
    failed step.
    """
    gamma = tableau.gamma
    h = t1 - t0
    f0, f_t, jac = linearise(vf, t0, y0)
    # The stage times are in the time's dtype; the arithmetic on the state is in the
    # state's (a float32 state with float64 times stays float32, as in Diffrax).
    dtype = jnp.result_type(*y0)
    control = jnp.asarray(control, dtype)
    gamma_control = gamma * control
    matrix = system(jac, gamma_control)
    # `h f_t` is the change of the field over the step from time alone: `control * h`
    # times the derivative in the time of `vf` is `h^2` times that in the ODE's time.
    time_term = [(control * jnp.asarray(h, dtype)) * x for x in f_t]
    ks = []
    for i in range(tableau.num_stages):
        if i == 0:
            f_i = f0
        else:
            y_i = linear_combination(y0, tableau.a[i - 1], ks)
            f_i = vf(t0 + tableau.c[i] * h, y_i)
        rhs = [gamma_control * x for x in f_i]
        if tableau.d[i] != 0:
            rhs = [r + (gamma * tableau.d[i]) * x for r, x in zip(rhs, time_term)]
        if i > 0:
            rhs = linear_combination(rhs, [gamma * C for C in tableau.C[i - 1]], ks)
        ks.append(matrix.solve(rhs))
    y1 = linear_combination(y0, tableau.b_sol, ks)
    y_error = linear_combination(None, tableau.b_error, ks)
    dense = [linear_combination(None, row, ks) for row in tableau.dense]
    return y1, y_error, dense


class RosenbrockInterpolation(AbstractWeightedInterpolation):
    r"""The continuous extension of a Rosenbrock step,
    $y(\theta) = (1 - \theta) y_0 + \theta y_1 + \theta (1 - \theta)
    \sum_j \theta^j D_j$, with `k` holding the $D_j$ (see `RosenbrockTableau`)."""

    @staticmethod
    def weights(theta) -> Weights:
        w_dense, power = [], theta * (1 - theta)
        for _ in range(MAX_DENSE_ROWS):
            w_dense.append(power)
            power = power * theta
        return 1 - theta, theta, tuple(w_dense)


class AbstractRosenbrock(diffrax.AbstractAdaptiveSolver, AbstractGradsolveSolver):
    """A Rosenbrock method for ODEs that gradsolve records and replays, and that is
    also a complete Diffrax solver (`diffrax.diffeqsolve(term, gs.Rodas5(), ...)`).

    The Jacobian `df/dy` (and `df/dt`) is formed once a step by forward-mode automatic
    differentiation of the vector field, and `I - gamma h J` is factorised once and
    reused by every stage. Concrete solvers provide `tableau`.
    """

    tableau: ClassVar[RosenbrockTableau]
    term_structure: ClassVar = diffrax.AbstractTerm
    interpolation_cls: ClassVar = RosenbrockInterpolation

    @property
    def derivative_representation(self) -> str:
        """`"array"` for `"auto"`: a Rosenbrock step on scalar components (its
        Jacobian and linear solves unrolled) runs forward fast but differentiates
        slowly. With Rodas5 and 64 trajectories, the one-call gradient took 118 ms
        (Robertson), 453 ms (a 4-species chain) and 25 ms (Lorenz) on components
        against 21, 43 and 9 ms in array form, which also compiled in 1/3 to 3/4
        of the time (van der Pol's 2 components: 38 against 33 ms); a Robertson
        fit took 28 s to its first answer and 64 ms after on components, 18 s and
        29 ms in array form."""
        return "array" if self.representation == "auto" else self.representation

    def reads_elements(self, differentiated: bool) -> bool:
        """In differentiated steps only: a step's Jacobian is a forward-mode pass
        over the field, cheaper on arrays, whose reverse pass is cheaper on
        elements. A 36-species network written species by species (16
        trajectories): the forward solve took 10.6 ms on arrays and 17.6 ms on
        elements; the one-call gradient 164 ms (181 s to compile) on arrays,
        90 ms (76 s) with its walk back on elements."""
        return self.representation == "auto" and differentiated

    @property
    def fsal(self) -> bool:
        return False

    def order(self, terms):
        del terms
        return self.tableau.order

    def step_leaves(self, vf, t0, t1, direction, y0, f0):
        del f0
        y1, y_error, dense = rosenbrock_step(
            self.tableau,
            lambda t, y: vf(direction * t, y),
            t0,
            t1,
            direction * (t1 - t0),
            y0,
        )
        return y1, y_error, dense, None

    def init(self, terms, t0, t1, y0, args):
        _check_ode(terms)
        return None

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        leaves, treedef = jtu.tree_flatten(y0)
        problem = LeafProblem(f=terms.vf, args=args, treedef=treedef)
        representation = Representation(
            leaves, problem, self.representation, t0, self.reads_elements(False)
        )
        y1, y_error, dense = rosenbrock_step(
            self.tableau,
            representation.field(problem),
            t0,
            t1,
            terms.contr(t0, t1),
            representation.split(leaves),
        )

        def as_tree(comps):
            merged = representation.merge(comps)
            return jtu.tree_unflatten(
                treedef, [x.astype(ref.dtype) for x, ref in zip(merged, leaves)]
            )

        y1 = as_tree(y1)
        stacked = [jnp.stack(x) for x in zip(*[representation.merge(d) for d in dense])]
        dense_info = dict(y0=y0, y1=y1, k=jtu.tree_unflatten(treedef, stacked))
        return y1, as_tree(y_error), dense_info, None, diffrax.RESULTS.successful

    def func(self, terms, t0, y0, args):
        return terms.vf(t0, y0, args)


def _check_ode(terms):
    inner = terms.term if isinstance(terms, diffrax._term.WrapTerm) else terms
    if not isinstance(inner, diffrax.ODETerm):
        raise ValueError(
            f"Rosenbrock methods solve ODEs: pass a diffrax.ODETerm, not "
            f"{type(inner).__name__}."
        )
