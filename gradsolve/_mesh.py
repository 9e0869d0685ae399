"""`RecordedMesh`: the accepted steps of an adaptive solve."""

import dataclasses
import re
from collections.abc import Callable

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int, Real

from ._custom_types import Times


def bucket_length(num_steps: int, max_steps: int) -> int:
    """The number of steps a trimmed mesh keeps: `num_steps` rounded up to one of
    four buckets per power of two (..., 64, 80, 96, 112, 128, 160, ...), at least 8.

    Bucketing means that a mesh whose longest trajectory grows from 100 to 110 steps
    keeps the same shape, so replays compiled for it are reused; four buckets per
    octave keep the padding (replayed as zero-length steps) under a quarter.
    """
    if num_steps <= 8:
        return min(8, max_steps)
    octave = 1 << (num_steps.bit_length() - 1)
    step = max(octave // 4, 8)
    return min(-(-num_steps // step) * step, max_steps)


@dataclasses.dataclass(frozen=True)
class StateStructure:
    """The PyTree structure, shapes and dtypes of one trajectory's state, as the
    recording saw it (after promotion to the time dtype): what a replay's `y0`
    must match. Hashable, so that it can be a static field.

    - `treedef`: `str` of the state's `jax.tree_util` structure (object addresses
        removed, so that it reads the same in another session).
    - `shapes`, `dtypes`: one entry per leaf, without a batch axis.
    """

    treedef: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @classmethod
    def of(cls, leaves, treedef) -> "StateStructure":
        """The structure of a state given as its leaves and `treedef`."""
        return cls(
            treedef=re.sub(r" at 0x[0-9a-fA-F]+", "", str(treedef)),
            shapes=tuple(tuple(int(n) for n in jnp.shape(x)) for x in leaves),
            dtypes=tuple(str(jnp.result_type(x)) for x in leaves),
        )

    def describe(self) -> str:
        leaves = ", ".join(f"{d}{list(s)}" for s, d in zip(self.shapes, self.dtypes))
        return f"{self.treedef} with leaves {leaves}"


class RecordedMesh(eqx.Module):
    """The steps an adaptive solve accepted, to be replayed with fixed steps.

    Produced by [`gradsolve.record`][] (or `gradsolve.diffeqsolve(...).mesh`) and
    consumed by [`gradsolve.replay`][]. A mesh recorded under `jax.vmap` has a leading
    batch axis on every array; `trim()` then shrinks the padding to the longest
    trajectory.

    **Fields:**

    - `ts`: the step boundaries in the caller's time, `ts[0] = t0`, then the end of
        each accepted step; after the last accepted step the final time is repeated,
        so padded steps have zero length and replay as no-ops. (A replay takes the
        first `max_steps`; more follow in a mesh trimmed without a copy.)
    - `num_steps`: the number of accepted steps.
    - `step_starts`: the start of each step, recorded only when the controller had
        `jump_ts` (a step after a jump starts just after the previous step's end);
        `None` otherwise.
    - `restarts`: whether each step re-evaluated its first stage (after a jump);
        `None` when there were no `jump_ts`.
    - `rtol`, `atol`: the tolerances the mesh was recorded at (`None` for a constant
        step size); `norm`: the controller's error norm.
    - `solver_type`: the class of the solver that recorded it.
    - `result`: the `diffrax.RESULTS` code of the recording solve. A replay refuses
        a mesh whose recording failed (it stops where the recording did) unless
        asked with `allow_partial=True`.
    - `t0`, `t1`: the interval the recording was asked to solve over (a failed
        recording stopped before `t1`: its `ts` end earlier).
    - `state`: the structure, shapes and dtypes of the recorded state (a
        `StateStructure`, per trajectory); a replay's `y0` must match it.
    - `length`: the number of steps a replay takes when it is fewer than `ts`
        holds (a mesh trimmed without a copy, see `trim`), else `None`. The steps
        after it are padding, as are those after `num_steps`.

    A batched mesh holds one `num_steps`, `result`, `t0` and `t1` per trajectory.
    """

    ts: Times
    num_steps: Int[Array, ""]
    step_starts: Real[Array, " steps"] | None
    restarts: Bool[Array, " steps"] | None
    rtol: Real[Array, ""] | None
    atol: Real[Array, ""] | None
    result: diffrax.RESULTS
    t0: Real[Array, ""]
    t1: Real[Array, ""]
    norm: Callable | None = eqx.field(static=True)
    solver_type: type = eqx.field(static=True)
    state: StateStructure = eqx.field(static=True)
    length: int | None = eqx.field(static=True, default=None)

    @property
    def max_steps(self) -> int:
        """The number of steps (accepted and padding) a replay over this mesh takes."""
        return self.ts.shape[-1] - 1 if self.length is None else self.length

    def cut(self) -> "RecordedMesh":
        """The mesh with its arrays cut to the `max_steps` steps a replay takes:
        itself unless it was trimmed without a copy. Works inside `jax.jit` too
        (a replay cuts the mesh it is given)."""
        if self.length is None:
            return self
        return _cut(self, self.length)

    @property
    def is_batched(self) -> bool:
        """Whether the mesh holds an ensemble (a leading batch axis)."""
        return self.ts.ndim == 2

    def trim(self, at_least: int = 0, copy: bool = True) -> "RecordedMesh":
        """Shrink the padding to the longest trajectory, rounded up to a bucket.

        Runs on the host (it needs concrete step counts), once per mesh, not inside
        `jax.jit`. The replay over the trimmed mesh gives the same result as over the
        original: only zero-length padding steps are removed. A mesh split across
        devices (or hosts) stays split: the longest trajectory is found by a reduction
        of the step counts (one integer crosses devices), and the padding is cut from
        the step axis on every device, so one bucket serves the whole ensemble.

        **Arguments:**

        - `at_least`: keep at least this many steps (if the mesh has them), e.g. the
            `max_steps` of an earlier mesh, so that replays compiled for it are reused.
        - `copy`: cut the arrays (one compiled call). With `copy=False` the mesh
            keeps its arrays and records the length (`length`), which every replay
            cuts inside its own program: no call at all, for a small mesh (of a few
            trajectories) whose cut would cost a third of its record + gradient.

        **Returns:**

        A `RecordedMesh` whose `max_steps` is the largest `num_steps` rounded up to
        a bucket (see `bucket_length`), or `at_least` if that is more.
        """
        return trimmed(self, at_least, copy)


def trimmed(mesh: RecordedMesh, at_least: int = 0, copy: bool = True) -> RecordedMesh:
    """`mesh.trim(at_least, copy)`. (A function: an Equinox module's method costs
    ~0.07 ms to look up, a fifth of a small ensemble's replay.)"""
    try:
        longest = _longest(mesh.num_steps)
    except jax.errors.ConcretizationTypeError as e:
        raise ValueError(
            "RecordedMesh.trim() needs concrete step counts: call it outside "
            "jax.jit/vmap, on a mesh returned by gs.record, once per mesh."
        ) from e
    length = bucket_length(longest, mesh.max_steps)
    length = min(max(length, at_least), mesh.max_steps)
    if length == mesh.ts.shape[-1] - 1:
        return mesh
    if not copy:
        return _with_length(mesh, length)
    return _cut_steps(mesh, length)


def _with_length(mesh: RecordedMesh, length: int) -> RecordedMesh:
    """`mesh`, its arrays shared, with `length` set. (Copied, not rebuilt: a
    module's `__init__` costs ~0.07 ms, a fifth of a small ensemble's replay.)"""
    new = object.__new__(type(mesh))
    new.__dict__.update(mesh.__dict__, length=length)
    return new


def _cut(mesh: RecordedMesh, length: int) -> RecordedMesh:
    """`mesh` with its arrays cut to `length` steps."""
    cut = lambda x, n: None if x is None else x[..., :n]
    return dataclasses.replace(
        mesh,
        ts=cut(mesh.ts, length + 1),
        step_starts=cut(mesh.step_starts, length),
        restarts=cut(mesh.restarts, length),
        length=None,
    )


# One compiled call: eager slices cost more than a small ensemble's recording.
_cut_steps = jax.jit(_cut, static_argnums=1)


def _longest(num_steps) -> int:
    """The largest step count, 0 for an empty ensemble."""
    if isinstance(num_steps, jax.core.Tracer):
        raise jax.errors.ConcretizationTypeError(num_steps)
    if isinstance(num_steps, jax.Array) and len(num_steps.sharding.device_set) > 1:
        # Reduced where the counts live: no copy of the ensemble to one place (and
        # across hosts only the replicated result can be read).
        if num_steps.size == 0:
            return 0
        return int(jnp.max(num_steps))
    return int(np.max(np.asarray(num_steps), initial=0))


def pad_after(values: Array, num_steps: Array) -> Array:
    """Repeat `values[num_steps]` in every later position (the mesh's padding)."""
    index = jnp.arange(values.shape[0])
    return jnp.where(index > num_steps, values[num_steps], values)
