"""A whole fit as one compiled program: every residual evaluation records a mesh at
its own parameters and differentiates the replay over it.

The recording runs under `stop_gradient`, so the residuals are those of the adaptive
solve and their derivative is the discrete derivative of its accepted steps, which
is what Diffrax returns (its step-size controller is not differentiated either).
The optimiser therefore takes the path it takes on Diffrax, iteration for
iteration, while each Jacobian costs a recording and a replay's derivative instead
of a differentiated adaptive solve.
"""

import math

import diffrax
import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx

from ._fit_problem import FitProblem
from ._host_call import call_if
from ._mesh import bucket_length
from ._short_buffer import SHORT_BUFFER, trim_small
from ._solver.rosenbrock import AbstractRosenbrock


@eqx.filter_jit
def record_fit(problem: FitProblem, params, controller, dt0, max_steps):
    """Record every trajectory at `params`: `(mesh, every recording succeeded)`."""
    mesh = problem.record(params, controller, dt0, max_steps)
    return mesh, jnp.all(mesh.result == diffrax.RESULTS.successful)


def _record_short_first(problem: FitProblem, params, controller, dt0, max_steps):
    """`(mesh, recordings)`: the (untrimmed) mesh at `params`, or `None` if a
    recording failed, and how many recordings that took: first with a buffer of
    `SHORT_BUFFER` steps, 2.5x faster to fill than 4,096 (about a tenth of a
    FitzHugh-Nagumo fit's time), then with `max_steps` if needed. (Unlike
    `_short_buffer.record_with_short_buffer`, which records again only the
    trajectories that failed and trims, this keeps one untrimmed batch: the fit
    needs only its longest trajectory or, at the answer, its trimmed whole.)"""
    buffers = sorted({min(SHORT_BUFFER, max_steps), max_steps})
    for count, buffer in enumerate(buffers, start=1):
        mesh, ok = record_fit(problem, params, controller, dt0, buffer)
        if bool(ok):
            return mesh, count
    return None, len(buffers)


def _equal(a, b) -> bool:
    """Whether two PyTrees of arrays hold the same values, bit for bit."""
    leaves = zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in leaves)


def _closed(problem: FitProblem, mesh):
    """Whether every trajectory's recording reached the last observation, and the
    mesh closed there: a recording that stopped early ends at the last time it
    reached, and closed it can be replayed (to values the caller discards)."""
    recorded = jnp.all(mesh.result == diffrax.RESULTS.successful)
    closed = mesh.ts.at[..., -1].set(problem.ts[-1])
    return recorded, eqx.tree_at(lambda m: m.ts, mesh, closed)


def optimiser_options(optimiser, jac: str) -> dict:
    """Optimistix's option for how `optimiser` differentiates the residuals."""
    if isinstance(optimiser, optx.AbstractMinimiser):
        return {"autodiff_mode": jac}
    return {"jac": jac}


@eqx.filter_jit
def fit_program(
    problem: FitProblem,
    optimiser,
    jac: str,
    mode: str | None,
    controller,
    dt0,
    length: int,
    max_iterations: int,
    params,
):
    """Run `optimiser` on the residuals, recording a mesh of at most `length` steps
    per trajectory at every evaluation.

    A recording that fails (for want of steps or otherwise) has no residuals: they
    are replaced by huge ones, which the optimiser rejects as a step that raised
    the loss. One that needs more than `length` steps is also noted on the host
    (`_note_overflow`), and the caller then runs again with a longer buffer.

    Returns `(params, result, iterations, evaluation)`: `evaluation` is
    `(at, residual_norm, mesh, recorded)` of an evaluation of the residuals at the
    parameters `at`, normally `params` (the evaluation in the optimiser's state):
    the norm of the weighted residuals there and the untrimmed mesh recorded there,
    whose recording succeeded if `recorded`.
    """

    def residuals(p, _):
        raw = problem.record(jax.lax.stop_gradient(p), controller, dt0, length)
        raw = jax.lax.stop_gradient(raw)
        recorded, mesh = _closed(problem, raw)
        r = problem.residuals(p, mesh, mode)
        # Noted on the host, at no cost unless it happens: the optimiser's path
        # went through parameters whose solves the buffer cannot hold.
        short = eqxi.unvmap_any(mesh.result == diffrax.RESULTS.max_steps_reached)
        r = call_if(short, _note_overflow, jnp.zeros((), jnp.int32), r)
        # Residuals far above any the fit has seen: the optimiser rejects the step
        # as one that raised the loss. (NaN would reach its termination test,
        # where every comparison with NaN is false.)
        r = jnp.where(recorded, r, 1 / jnp.finfo(r.dtype).eps)
        norm = jnp.sqrt(jnp.sum(r**2))
        return r, jax.lax.stop_gradient((p, norm, raw, recorded))

    sol = optx.least_squares(
        residuals,
        optimiser,
        params,
        None,
        has_aux=True,
        options=optimiser_options(optimiser, jac),
        max_steps=max_iterations,
        throw=False,
    )
    # Optimistix returns the auxiliary output of the accepted step before the
    # last; its solvers' states (Gauss-Newton, quasi-Newton) hold the last one's.
    evaluation = getattr(sol.state, "aux", sol.aux)
    return sol.value, sol.result, sol.stats["num_steps"], evaluation


_OVERFLOWS = [0]


def _note_overflow(_):
    _OVERFLOWS[0] += 1


# The buffer of a fit's recordings, over the longest mesh at the initial guess:
# parameters move during a fit, and so do the steps their solves take.
HEADROOM = 1.5

# The most times a fit runs again with a buffer twice as long (each compiles anew).
RERUNS = 2

# The buffer lengths earlier fits used, per problem structure: a later fit of the
# same shape reuses a longer one (up to twice its need) rather than compile anew.
_LENGTHS: dict = {}


def _structure_key(problem: FitProblem, params, optimiser):
    """What the compiled program depends on besides array values, or `None`."""
    leaves, treedef = jax.tree_util.tree_flatten((problem, params, optimiser))
    parts = tuple((x.shape, x.dtype) if eqx.is_array(x) else x for x in leaves)
    try:
        return _Key((treedef, parts))
    except TypeError:  # an unhashable static part: no reuse across fits
        return None


class _Key:
    """A dictionary key hashed once (hashing a problem's static parts, Equinox
    modules among them, costs a few hundredths of a millisecond each time)."""

    __slots__ = ("key", "hash")

    def __init__(self, key):
        self.key = key
        self.hash = hash(key)

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        same = isinstance(other, _Key) and self.hash == other.hash
        return same and self.key == other.key


def buffer_length(key, longest: int, max_steps: int) -> int:
    """The steps each recording of the fit may take: the longest mesh at the
    initial guess with head room, bucketed, or an earlier fit's (of the structure
    `key`) if that is at most twice as long and at most `max_steps`."""
    need = bucket_length(math.ceil(HEADROOM * max(longest, 1)), max_steps)
    earlier = None if key is None else _LENGTHS.get(key)
    if earlier is not None and need <= earlier <= min(2 * need, max_steps):
        return earlier
    return need


def fit_per_evaluation(
    problem, params, optimiser, jac, mode, controller, dt0, max_steps,
    max_iterations,
):  # fmt: skip
    """`gs.fit` with a mesh recorded at every evaluation (one compiled program).

    Returns `(params, result, iterations, residual_norm, mesh, recordings)`, with
    `mesh` the trimmed mesh at `params` (`None` if its recording failed) and
    `recordings` those made outside the compiled program, or `None` when the
    recording at the initial guess that sizes the buffer fails or the optimiser's
    path still needs more steps than a buffer of `RERUNS` doublings holds (trial
    points whose solves take many steps): the caller then fits with reused meshes,
    which records only where the optimiser lands.

    The buffer is that of an earlier fit of the same structure, else `UNSIZED_BUFFER`
    steps for an ensemble where that is small (`_unsized_start`), else sized on a
    recording at the initial guess; an unsized buffer that proves too short is
    sized that way before the next run.
    """
    key = _structure_key(problem, params, optimiser)
    recordings = 0
    earlier = length = None if key is None else _LENGTHS.get(key)
    if length is not None:
        # An earlier fit's buffer, but never more steps than this fit allows.
        length = min(length, max_steps)
    if length is None and _unsized_start(problem, mode, max_steps):
        # No recording to size the buffer (its compilation is a tenth of a small
        # fit's first call): this buffer holds most fits' solves, and one that
        # outgrows it is sized below and run again.
        length = min(UNSIZED_BUFFER, max_steps)
    elif length is None:
        length, recordings = _sized(problem, params, controller, dt0, max_steps, key)
        if length is None:
            return None
    sized = recordings > 0
    for _ in range(RERUNS + 1):
        _OVERFLOWS[0] = 0
        value, result, iterations, evaluation = fit_program(
            problem, optimiser, jac, mode, controller, dt0, length, max_iterations,
            params,
        )  # fmt: skip
        jax.effects_barrier()  # every noted overflow has reached the host
        if not _OVERFLOWS[0]:
            if key is not None and (earlier is None or length > earlier):
                # (Looked up once: comparing two keys compares their modules.)
                _LENGTHS[key] = length
            at, norm, mesh, recorded = evaluation
            # One read of the scalars the host needs (each read is a transfer).
            recorded, iterations, norm = jax.device_get((recorded, iterations, norm))
            if not _equal(at, value):
                # An optimiser whose state holds no evaluation: the mesh recorded
                # again, the norm that of the accepted step before.
                mesh, again = _record_short_first(
                    problem, value, controller, dt0, max_steps
                )
                recorded, recordings = mesh is not None, recordings + again
            mesh = trim_small(mesh) if bool(recorded) else None
            return value, result, int(iterations), float(norm), mesh, recordings
        if length >= max_steps:
            break
        # The optimiser's path needs more steps than the buffer holds.
        if not sized:
            sized = True
            length, count = _sized(problem, params, controller, dt0, max_steps, key)
            recordings += count
            if length is None:
                return None
        else:
            length = bucket_length(2 * length, max_steps)
    return None


# The steps of a fit's first buffer when it is not sized by a recording: room for
# the solves of most small fits at tight tolerances (Lotka-Volterra's 75,
# FitzHugh-Nagumo's 130-190 at rtol 1e-8). Every evaluation costs more with a
# longer buffer (FitzHugh-Nagumo's Jacobian: 3.9 ms with 192 steps, 5.9 ms with
# 512); one too short costs a recording and a second compilation.
UNSIZED_BUFFER = 256

# The most entries (trajectories times steps) of a fit's first buffer that is not
# sized by a recording first: 64 MiB per float64 array of the mesh.
UNSIZED_ENTRIES = 1 << 23


def _unsized_start(problem: FitProblem, mode: str | None, max_steps: int) -> bool:
    """Whether a fit starts with `UNSIZED_BUFFER` steps, unsized: when its
    Jacobian blocks replay only the recorded steps (forward mode, an explicit
    solver: see `replay_one`), and the buffer is small for this ensemble. Other
    replays run over the whole buffer, which must then fit the solves tightly
    (a Rodas5 Robertson fit took 108 ms with 256 steps, 69 ms with 128)."""
    if mode != "fwd" or isinstance(problem.solver, AbstractRosenbrock):
        return False
    trajectories = problem.data.shape[0]
    return trajectories * min(UNSIZED_BUFFER, max_steps) <= UNSIZED_ENTRIES


def _sized(problem, params, controller, dt0, max_steps, key):
    """`(length, recordings)`: the buffer length from a recording at `params` (see
    `buffer_length`), `None` if that recording fails, and the recordings made."""
    first, count = _record_short_first(problem, params, controller, dt0, max_steps)
    if first is None:
        return None, count
    longest = jax.device_get(jnp.max(first.num_steps))
    return buffer_length(key, int(longest), max_steps), count
