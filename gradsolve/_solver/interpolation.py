"""Dense output of one step as a linear combination of the step's data.

Every interpolant used here is linear in `(y0, y1, k_1, ..., k_s)` with weights that
depend only on the normalised time `theta`. Writing them that way lets one definition
serve Diffrax (`evaluate`, through `diffrax.AbstractLocalInterpolation`), the replay
(which evaluates the weights for many save times at once) and the adjoint.
"""

import abc
from collections.abc import Sequence

import diffrax
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, PyTree, Shaped

from .._custom_types import Leaves, RealScalarLike, Y


# `(w_y0, w_y1, (w_k1, ..., w_ks))`; `None` marks a weight that is identically zero.
Weights = tuple[Array | None, Array | None, Sequence[Array | None]]


def normalised_time(t0, t, t1):
    """`(t - t0) / (t1 - t0)`, and 0 for an empty step (as `diffrax`'s
    `linear_rescale`)."""
    empty = t0 == t1
    return jnp.where(empty, 0, t - t0) / jnp.where(empty, 1, t1 - t0)


def combine(weights: Weights, y0: Leaves, y1: Leaves, ks: Sequence[Leaves]) -> Leaves:
    """Evaluate the dense output from its weights, leaf by leaf."""
    w_y0, w_y1, w_ks = weights
    out = []
    for leaf in range(len(y0)):
        acc = y0[leaf] if w_y0 is None else w_y0 * y0[leaf]
        if w_y1 is not None:
            acc = acc + w_y1 * y1[leaf]
        for w, k in zip(w_ks, ks):
            if w is not None:
                acc = acc + w * k[leaf]
        out.append(acc)
    return out


class AbstractWeightedInterpolation(diffrax.AbstractLocalInterpolation):
    """Dense output of one explicit Runge--Kutta step, given by `weights(theta)`.

    Constructed by Diffrax exactly as its own local interpolations are
    (`interpolation_cls(t0=..., t1=..., y0=..., y1=..., k=...)`), with `k` holding the
    stage increments along a leading axis.
    """

    t0: RealScalarLike
    t1: RealScalarLike
    y0: Y
    y1: Y
    k: PyTree[Shaped[Array, "stages ?*y"], "Y"]

    @staticmethod
    @abc.abstractmethod
    def weights(theta: Array) -> Weights:
        """The weights of `y0`, `y1` and each stage increment at `theta` in
        `[0, 1]`; `None` for a weight that is zero for every `theta`."""

    def evaluate(
        self, t0: RealScalarLike, t1: RealScalarLike | None = None, left: bool = True
    ) -> Y:
        del left
        if t1 is not None:
            return jtu.tree_map(
                lambda a, b: b - a, self.evaluate(t0), self.evaluate(t1)
            )
        theta = normalised_time(self.t0, t0, self.t1)
        y0, treedef = jtu.tree_flatten(self.y0)
        y1 = jtu.tree_leaves(self.y1)
        k = jtu.tree_leaves(self.k)
        num_stages = k[0].shape[0] if k else 0
        ks = [[leaf[i] for leaf in k] for i in range(num_stages)]
        # Real weights times a complex state, or float64 times float32: promoted as
        # Diffrax's own interpolations promote them, also under strict promotion.
        with jax.numpy_dtype_promotion("standard"):
            weights = self.weights(theta)
            out = combine(weights, y0, y1, ks)
        out = [leaf.astype(ref.dtype) for leaf, ref in zip(out, y0)]
        return jtu.tree_unflatten(treedef, out)
