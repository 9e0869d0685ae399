"""`Solution`: what `gradsolve.diffeqsolve` and `gradsolve.replay` return."""

import diffrax
import equinox as eqx
from jaxtyping import Array, PyTree, Real

from ._mesh import RecordedMesh


class Solution(eqx.Module):
    """The result of a fast-path solve, shaped like `diffrax.Solution`.

    **Fields:**

    - `t0`, `t1`: the interval of integration.
    - `ts`: the save times (unused slots, e.g. of `SaveAt(steps=True)`, hold `inf`).
    - `ys`: the saved states, a PyTree like `y0` with a leading axis matching `ts`.
    - `stats`: step counts (`num_steps`, `num_accepted_steps`, `num_rejected_steps`,
        `max_steps`) and, for a replay of an adaptive mesh, `max_error_ratio`: the
        largest embedded error estimate over the replayed steps relative to the
        recording tolerances (above 1 means the mesh is stale for these inputs).
    - `result`: a `diffrax.RESULTS` code.
    - `mesh`: the [`gradsolve.RecordedMesh`][] the values were computed on.
    - `interpolation`, `solver_state`, `controller_state`, `made_jump`,
        `event_mask`: always `None`, as in a `diffrax.Solution` solved without dense
        output, saved states or events (asking for any of them falls back to
        Diffrax).
    """

    t0: Real[Array, ""]
    t1: Real[Array, ""]
    ts: Real[Array, " saves"]
    ys: PyTree[Array]
    stats: dict
    result: diffrax.RESULTS
    mesh: RecordedMesh
    interpolation: None = None
    solver_state: None = None
    controller_state: None = None
    made_jump: None = None
    event_mask: None = None

    def evaluate(self, t0, t1=None, left=True):
        """Not available: the solve kept no dense interpolant (a `ValueError`, as
        `diffrax.Solution.evaluate` without `SaveAt(dense=True)`)."""
        raise ValueError(_NO_DENSE)

    def derivative(self, t, left=True):
        """Not available, as `evaluate`."""
        raise ValueError(_NO_DENSE)


_NO_DENSE = (
    "gradsolve solutions hold no dense interpolant. Save where you need values with "
    "SaveAt(ts=...), or pass SaveAt(dense=True) to gs.diffeqsolve, which then runs "
    "diffrax.diffeqsolve and returns its dense solution."
)
