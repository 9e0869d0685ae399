"""What record, replay and the adjoint need of a solver, and the explicit Runge--Kutta
step they share."""

import abc
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import ClassVar

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._custom_types import LeafField, Leaves


@dataclasses.dataclass(frozen=True)
class Coefficients:
    """A Butcher tableau as Python floats.

    Python floats keep the arithmetic in the state's dtype (weakly typed) and let zero
    coefficients be skipped when the step is traced, which shortens every stage.
    """

    a: tuple[tuple[float, ...], ...]
    b_sol: tuple[float, ...]
    b_error: tuple[float, ...]
    c: tuple[float, ...]
    fsal: bool

    @classmethod
    def from_tableau(cls, tableau: diffrax.ButcherTableau) -> "Coefficients":
        as_floats = lambda xs: tuple(float(x) for x in np.asarray(xs))
        return cls(
            a=tuple(as_floats(row) for row in tableau.a_lower),
            b_sol=as_floats(tableau.b_sol),
            b_error=as_floats(tableau.b_error),
            c=(0.0,) + as_floats(tableau.c),
            fsal=bool(tableau.fsal),
        )

    @property
    def num_stages(self) -> int:
        return len(self.b_sol)


def runtime_zero(t) -> Array:
    """`0` (in the dtype of `t`), computed from the time `t` (finite) so that the
    compiler cannot see it.

    A sum that starts from it is accumulated with fused multiply-adds in a fixed
    order (see `linear_combination`). A literal `0` would be folded away, and the
    first two products of the sum would then be fused in whichever order the
    backend's compiler prefers.
    """
    t = jnp.asarray(t)
    return t - t


def opaque(tree):
    """`tree` with its arrays passed through `jax.lax.optimization_barrier`: values the
    compiler cannot see into.

    A recording and its replay are different programs, and the caller may pass `y0`,
    `args` or the times as constants to one and as arguments to the other. XLA folds
    and reassociates arithmetic on constants (`(b * y0) * y1` becomes
    `(y0 * y1) * b` when `b` is a constant, and a constant subexpression is evaluated
    without fused multiply-adds), so the two would round differently. Taken through
    this barrier at the entry of both, the inputs are compiled the same way.
    """
    dynamic, static = eqx.partition(tree, eqx.is_array)
    return eqx.combine(jax.lax.optimization_barrier(dynamic), static)


def linear_combination(
    base: Leaves | None,
    weights: Sequence[float],
    terms: Sequence[Leaves],
    zero: Array | None = None,
) -> Leaves:
    """`base + sum_i weights[i] * terms[i]`, leaf by leaf, skipping zero weights.

    This is Diffrax's `y0 + tensordot(a, ks)` in its order of operations: the sum
    runs over the terms in order from `zero` (see `runtime_zero`), each term added
    as `acc + w * k` (which XLA compiles to a fused multiply-add, as its dot does),
    and `base` is added last. Skipping a zero weight changes nothing: the dot adds
    `0 * k = 0` there. Without `zero` the sum starts from the first product (its
    rounding then depends on how the compiler fuses the first two products).
    """
    pairs = [(w, term) for w, term in zip(weights, terms) if w != 0]
    num_leaves = len(base) if base is not None else len(terms[0])
    out = []
    for leaf in range(num_leaves):
        acc = None
        if zero is not None:
            like = terms[0][leaf]
            acc = jnp.broadcast_to(zero.astype(jnp.result_type(like)), jnp.shape(like))
        for w, term in pairs:
            contribution = w * term[leaf]
            acc = contribution if acc is None else acc + contribution
        if base is not None:
            acc = base[leaf] if acc is None else base[leaf] + acc
        out.append(acc)
    return out


def explicit_rk_step(
    coeffs: Coefficients,
    vf: LeafField,
    t0,
    t1,
    direction,
    y0: Leaves,
    f0: Leaves | None,
) -> tuple[Leaves, Leaves, list[Leaves], Leaves]:
    """One explicit Runge--Kutta step from `t0` to `t1` (internal, increasing time).

    Mirrors `diffrax.AbstractRungeKutta.step` for an `ODETerm`, operation for
    operation: the stage times are `t0 + c_i (t1 - t0)` (`t1` itself where
    `c_i = 1`), the increments are `k_i = f_i * control` with control the step in the
    caller's time, the stages, `y1` and the error estimate are summed as Diffrax's
    `tensordot` over the stages sums them (see `linear_combination`), and the first
    stage is `f0` when it is known (FSAL).

    **Arguments:**

    - `coeffs`: the tableau.
    - `vf`: the vector field on leaves, called with the caller's (signed) time.
    - `t0`, `t1`: the step, in internal time (`t0 <= t1`).
    - `direction`: `+1` or `-1`; the caller's time is `direction * t`.
    - `y0`: the state.
    - `f0`: the vector field at `(t0, y0)` if known, else `None`.

    **Returns:**

    `(y1, y_error, ks, f1)`: the new state, the embedded error estimate, the stage
    increments (used by the dense interpolants) and the vector field at the last stage
    (the next step's first stage for FSAL tableaux).
    """
    if isinstance(vf, LoopedStages):
        return _looped_rk_step(coeffs, vf, t0, t1, direction, y0, f0)
    h = t1 - t0
    control = direction * h
    fs = [vf(direction * t0, y0) if f0 is None else f0]
    ks = [[control * leaf for leaf in fs[0]]]
    zero = runtime_zero(t0)
    for row, c in zip(coeffs.a, coeffs.c[1:]):
        y_stage = linear_combination(y0, row, ks, zero)
        # Diffrax takes the stage at `c = 1` at `t1` itself, not at `t0 + (t1 - t0)`.
        t_stage = t1 if c == 1 else t0 + c * h
        f_stage = vf(direction * t_stage, y_stage)
        fs.append(f_stage)
        ks.append([control * leaf for leaf in f_stage])
    y1 = linear_combination(y0, coeffs.b_sol, ks, zero)
    y_error = linear_combination(None, coeffs.b_error, ks, zero)
    return y1, y_error, ks, fs[-1]


class LoopedStages:
    """A vector field (on leaves) whose explicit Runge--Kutta stages are computed in a
    loop over the stages, as Diffrax computes them, rather than unrolled.

    Chosen per field (see `_representation.py`): unrolled, XLA compiles a step as
    one program and fuses across stages, which suits matrix products; but the
    backward pass of a field that slices and concatenates its state, unrolled over
    seven stages, compiles on the CPU to a program ~10x slower than its forward
    pass, and in a loop it does not.
    """

    def __init__(self, vf: LeafField):
        self.vf = vf

    def __call__(self, t, y: Leaves) -> Leaves:
        return self.vf(t, y)


def _looped_rk_step(coeffs: Coefficients, vf, t0, t1, direction, y0, f0):
    """`explicit_rk_step` with its stages in a `fori_loop`: the stage increments
    kept in one buffer per leaf (stage first), each stage's state their weighted
    sum (a `tensordot` over the stages, as Diffrax sums them)."""
    stages = coeffs.num_stages
    h = t1 - t0
    control = direction * h
    a = np.zeros((stages, stages))
    for i, row in enumerate(coeffs.a):
        a[i + 1, : len(row)] = row
    first = vf(direction * t0, y0) if f0 is None else f0
    dtypes = [jnp.result_type(leaf) for leaf in y0]
    ks = [
        jnp.zeros((stages,) + jnp.shape(f), d).at[0].set(control * f)
        for f, d in zip(first, dtypes)
    ]
    c = jnp.asarray(coeffs.c, jnp.result_type(t0))

    def stage(i, carry):
        ks, _ = carry
        y_stage = [
            y + jnp.tensordot(jnp.asarray(a, d)[i], k, axes=1)
            for y, k, d in zip(y0, ks, dtypes)
        ]
        # Diffrax takes the stage at `c = 1` at `t1` itself, not at `t0 + (t1 - t0)`.
        t_stage = jnp.where(c[i] == 1, t1, t0 + c[i] * h)
        f_stage = vf(direction * t_stage, y_stage)
        ks = [k.at[i].set(control * f) for k, f in zip(ks, f_stage)]
        return ks, f_stage

    ks, last = jax.lax.fori_loop(1, stages, stage, (ks, first))

    def weighted(weights, base):
        out = []
        for k, d, y in zip(ks, dtypes, base or [None] * len(ks)):
            total = jnp.tensordot(jnp.asarray(weights, d), k, axes=1)
            out.append(total if y is None else y + total)
        return out

    y1 = weighted(coeffs.b_sol, y0)
    y_error = weighted(coeffs.b_error, None)
    return y1, y_error, [[k[i] for k in ks] for i in range(stages)], last


class AbstractGradsolveSolver(eqx.Module):
    """A solver whose steps gradsolve can record, replay and differentiate.

    Concrete solvers are also complete Diffrax solvers. For gradsolve they provide:

    - `step_leaves`: one step on the state as a list of leaves (or scalar components,
        see `_components.py`);
    - `fsal`: whether the field at the end of a step is the next step's first stage;
    - `interpolation_cls`, whose `weights(theta)` give the dense output as a linear
        combination of `y0`, `y1` and the step's dense data (`step_leaves`' third
        output).

    The `representation` option says how the state is held while stepping:
    `"auto"` (default) holds a small floating-point state as scalar components when
    its vector field stays small unrolled on them, else as arrays; `"components"`
    and `"array"` force one or the other (see "How it works"). Values agree between
    the two to round-off, and a mesh recorded under one replays under the other.
    """

    interpolation_cls: eqx.AbstractClassVar[
        Callable[..., diffrax.AbstractLocalInterpolation]
    ]
    representation: str = eqx.field(default="auto", static=True, kw_only=True)

    @property
    def derivative_representation(self) -> str:
        """The `representation` in which steps that are differentiated hold the
        state (the one-call adjoint's, `gs.fit`'s): the solver's own, unless a
        subclass knows better for `"auto"`."""
        return self.representation

    def reads_elements(self, differentiated: bool) -> bool:
        """Whether a large state whose field reads it element by element, held as
        arrays, has its field evaluated on its elements
        (`_component_field.ElementField`), in steps that are `differentiated`
        (replayed, or walked back by the one-call adjoint) or not (recorded):
        with `representation="auto"`."""
        del differentiated
        return self.representation == "auto"

    @property
    @abc.abstractmethod
    def fsal(self) -> bool:
        """Whether `step_leaves` returns the field at the end of the step, to be
        passed as the next step's `f0`."""

    @abc.abstractmethod
    def step_leaves(
        self, vf: LeafField, t0, t1, direction, y0: Leaves, f0: Leaves | None
    ) -> tuple[Leaves, Leaves, list[Leaves], Leaves | None]:
        """One step from `t0` to `t1` (internal, increasing time; the caller's time is
        `direction * t`), with `f0` the field at the start when known.

        Returns `(y1, y_error, dense, f1)`: the new state, the embedded error
        estimate, the data of the dense output and, for an FSAL solver, the field at
        the end of the step (else `None`).
        """


class AbstractExplicitSolver(diffrax.AbstractERK, AbstractGradsolveSolver):
    """An explicit Runge--Kutta solver that gradsolve can record and replay.

    It is also a complete `diffrax` solver: `diffrax.diffeqsolve(term, gs.Tsit5(), ...)`
    runs Diffrax's own Runge--Kutta implementation on the same tableau, which is how
    features outside gradsolve's fast path fall back to Diffrax.

    Concrete solvers provide `tableau` (a `diffrax.ButcherTableau`),
    `interpolation_cls` (whose `weights(theta)` gives the dense output as a linear
    combination of `y0`, `y1` and the stage increments) and `order`.
    """

    tableau: ClassVar[diffrax.ButcherTableau]
    interpolation_cls: ClassVar[Callable[..., diffrax.AbstractLocalInterpolation]]

    @property
    def fsal(self) -> bool:
        return self.coefficients().fsal

    @classmethod
    @functools.cache
    def coefficients(cls) -> Coefficients:
        return Coefficients.from_tableau(cls.tableau)

    def step_leaves(self, vf, t0, t1, direction, y0, f0):
        return explicit_rk_step(self.coefficients(), vf, t0, t1, direction, y0, f0)
