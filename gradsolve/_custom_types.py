"""Type aliases used across gradsolve (jaxtyping, checked at runtime only in tests)."""

from collections.abc import Callable
from typing import Any, TypeAlias

from jaxtyping import Array, ArrayLike, Bool, Int, PyTree, Real, Shaped


RealScalarLike: TypeAlias = float | int | Real[ArrayLike, ""]
BoolScalar: TypeAlias = Bool[Array, ""]
IntScalar: TypeAlias = Int[Array, ""]
Times: TypeAlias = Real[Array, " steps_plus_one"]
Y: TypeAlias = PyTree[Shaped[ArrayLike, "?*y"], "Y"]
Args: TypeAlias = PyTree[Any]
# The state as the flat list of its leaves: the representation every step works on.
Leaves: TypeAlias = list[Array]
# A vector field on leaves, in the caller's time: ``(t, leaves) -> leaves``.
LeafField: TypeAlias = Callable[[Any, Leaves], Leaves]
