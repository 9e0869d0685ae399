"""The memory an ensemble's recording, replay and gradient need, and chunks that fit.

The estimates count the arrays XLA allocates on top of the inputs (temporaries and
outputs), per trajectory, from the state size, the steps, what is saved and the
solver: the words below were fitted to `compiled.memory_analysis()` of the compiled
programs (Tsit5 and Rodas5, states of 3 to 48 elements, 24 to 512 steps,
`SaveAt(t1=True)` and `SaveAt(ts=...)`; `python benchmarks/memory_calibration.py`
compares them), and checked against the peak resident memory of a child process
(`tests/test_memory_budget.py`).

A word is one element of the state's (or the time's, if wider) dtype. With `n`
state elements, `S` steps, `m` terms of the dense output (7 stages of Tsit5, 3 rows
of Rodas5's), `k` saved values and `p` per-trajectory arguments, one trajectory
takes, in words, in a chunk (working arrays) + in the whole batch (results):

- record with a buffer of `S` steps: `2 (S + 1) + 6 n + 4 n^2 + 8 + p`, + the
    mesh returned, which `gs.record_ensemble` counts once its steps are known;
- replay: `4 S + 4 n + 4 n^2 + 8 + p`, + `(m + 3) n S` for `SaveAt(ts=...)`
    (`n S + (m + 2) n k` for a state held as components, which keeps only the
    states and computes the stages of the save times' steps again) or `n S` for
    `SaveAt(steps=True)`; + `2 k (n + 1) + 8`;
- gradient: `S ((1 + c) n + 3) + 30 n + 5 n^2 + n^3 / 4 + 8 + 3 p`, + the same for
    saving; + `2 (n + p)` (the cotangents of `y0` and `args`), + `(k + 1) (n + 1)`
    if `k > 1`.

The `n^2` and `n^3` terms are a Rosenbrock solver's Jacobian, its inverse and the
elimination's working matrices (zero for explicit solvers; fitted on states of 8 to
32 elements, where XLA's figure for a gradient grows faster than `n^2`); the
recording's time buffer and its trimmed copy give its `2 (S + 1)`; a replay keeps
the step times it scans over and the error ratio of every step (`4 S`); reverse mode
keeps the state at every step (per-step checkpoints), and the field too (`c = 1`)
for an FSAL solver on a state held in array form (more than `MAX_COMPONENTS`
elements; a smaller state whose field is costly is held in array form as well, and
takes `n S` words more than counted), and recomputes one step's stages at a time
(`30 n`).
"""

import math
import os

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from ._components import MAX_COMPONENTS
from ._solver.rosenbrock import AbstractRosenbrock


# Bytes a compiled call adds on top of its arrays, whatever the chunk: XLA's
# runtime and the allocator's rounding, measured at up to about 1 MiB above
# `memory_analysis()` (after compilation, which is not counted). Budgets are
# reduced by this much before they are split into chunks.
RUNTIME_BYTES = 2 * 2**20


def available_memory() -> int:
    """Bytes free on the default device: the accelerator's free memory, else the
    host's `MemAvailable`."""
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def default_budget() -> int:
    """Half the available memory: room for the caller's own arrays and copies."""
    return available_memory() // 2


def _elements(tree, batched: bool = True) -> int:
    """Elements of one trajectory's share of `tree` (without its batch axis)."""
    skip = 1 if batched else 0
    return sum(math.prod(jnp.shape(x)[skip:]) for x in jtu.tree_leaves(tree))


def _word(y0) -> int:
    """Bytes of one word: the state's element, or the time's if that is wider."""
    sizes = [_itemsize(x) for x in jtu.tree_leaves(y0)]
    # The default float (the time's dtype unless given), without creating an array.
    return max(sizes + [8 if jax.config.read("jax_enable_x64") else 4])


def _itemsize(x) -> int:
    """Bytes of one element of `x` as JAX holds it (`jnp.result_type` costs more
    than a small ensemble's bookkeeping should)."""
    dtype = getattr(x, "dtype", None)
    if isinstance(x, jax.Array) and dtype is not None:
        return dtype.itemsize
    return jnp.result_type(x).itemsize


def _solver_terms(solver) -> tuple[int, bool, bool]:
    """`(m, fsal, implicit)`: the dense output's terms per step, whether the field
    at the end of a step is carried to the next, and whether a Jacobian is formed.
    `None` stands for Tsit5."""
    if solver is None:
        return 7, True, False
    if isinstance(solver, AbstractRosenbrock):
        return len(solver.tableau.dense), False, True
    coefficients = getattr(solver, "coefficients", None)
    if coefficients is None:
        return 7, True, False
    return coefficients().num_stages, bool(solver.fsal), False


class Footprint:
    """Bytes per trajectory of one ensemble computation: `chunk` for every
    trajectory of a chunk (its working arrays) and `batch` for every trajectory of
    the ensemble (its results)."""

    def __init__(self, chunk: float, batch: float, word: int):
        self.chunk = int(math.ceil(chunk * word))
        self.batch = int(math.ceil(batch * word))

    def bytes(self, batch: int, chunk: int | None = None) -> int:
        """The bytes of `batch` trajectories in chunks of `chunk` (default: one)."""
        chunk = batch if chunk is None else min(chunk, batch)
        return chunk * self.chunk + batch * self.batch


def record_footprint(steps: int, y0, solver=None, args=None) -> Footprint:
    """A recording with a buffer of `steps` steps (and its trimmed copy)."""
    n, p = _elements(y0), 0 if args is None else _elements(args)
    _, _, implicit = _solver_terms(solver)
    jac = 4 * n * n if implicit else 0
    chunk = 2 * (steps + 1) + 6 * n + jac + 8 + p
    # The mesh returned is the trimmed copy, counted in the chunk: joining the
    # chunks' meshes is `gs.record_ensemble`'s to count, once their steps are known.
    return Footprint(chunk, 0, _word(y0))


def replay_footprint(
    steps: int,
    y0,
    solver=None,
    args=None,
    *,
    saves: int = 1,
    dense: bool = False,
    keep_states: bool = False,
    gradient: bool = False,
) -> Footprint:
    """A replay over `steps` steps saving `saves` values per trajectory, `dense`
    when they are interpolated (`SaveAt(ts=...)`), `keep_states` when every step's
    state is kept (`SaveAt(steps=True)`); its reverse-mode derivative if
    `gradient`."""
    n, p = _elements(y0), 0 if args is None else _elements(args)
    m, fsal, implicit = _solver_terms(solver)
    # A state this small is held as components (see `choose_layout`): the field is
    # not carried from step to step (`Representation.carries_fsal`), and
    # with an explicit solver `SaveAt(ts=...)` keeps the states only, computing the
    # stages of the save times' steps again after the scan (`values_at_saves`).
    components = n <= MAX_COMPONENTS
    if dense and components and not implicit:
        saved = steps * n + saves * (m + 2) * n
    else:
        saved = steps * ((m + 3) * n if dense else n if keep_states else 0)
    if gradient:
        jac = (5 * n * n + n**3 / 4) if implicit else 0
        carried = fsal and not components
        chunk = steps * ((1 + carried) * n + 3) + saved + 30 * n + jac + 8 + 3 * p
        batch = 2 * (n + p) + ((saves + 1) * (n + 1) if saves > 1 else 0)
    else:
        jac = 4 * n * n if implicit else 0
        chunk = 4 * steps + saved + 4 * n + jac + 8 + p
        batch = 2 * saves * (n + 1) + 8
    return Footprint(chunk, batch, _word(y0))


def estimate_memory(
    batch: int, max_steps: int, y0, *, saves: int = 1, solver=None, args=None
) -> dict:
    """Estimate the bytes that recording, replaying and differentiating an ensemble
    in one piece will need on top of their inputs, before allocating anything.

    The estimates are those of XLA's own accounting of the compiled programs
    (`compiled.memory_analysis()`: temporaries and outputs), to within a few percent
    above for the states of 3 to 48 elements they were fitted on (see
    `gradsolve/_memory.py`); the peak resident memory measured in a fresh process
    adds less than `RUNTIME_BYTES` (2 MiB) to them, whatever the batch.

    **Arguments:**

    - `batch`: the number of trajectories.
    - `max_steps`: the steps per trajectory: `max_steps` for a recording, the
        trimmed `mesh.max_steps` for a replay.
    - `y0`: the batched initial state (only shapes and dtypes are read).
    - `saves`: the number of saved values per trajectory; more than one counts
        as `SaveAt(ts=...)`, whose interpolation keeps every step's stages.
    - `solver`: the solver (default: one like `gs.Tsit5()`); a Rosenbrock solver
        (`gs.Rodas5()`) adds its Jacobian.
    - `args`: per-trajectory arguments, batched like `y0` (default: shared ones,
        which do not grow with the batch).

    **Returns:**

    A dict of byte counts: `record` (`jax.vmap` of `gs.record` with a buffer of
    `max_steps` steps, then `trim()`), `replay` (forward) and `gradient` (reverse
    mode through the replay).
    """
    dense = saves > 1
    kw = dict(solver=solver, args=args, saves=saves, dense=dense)
    return dict(
        record=record_footprint(max_steps, y0, solver, args).bytes(batch),
        replay=replay_footprint(max_steps, y0, **kw).bytes(batch),
        gradient=replay_footprint(max_steps, y0, gradient=True, **kw).bytes(batch),
    )


def fit_chunk(
    batch: int,
    footprint: Footprint,
    budget: int,
    what: str,
    fix: str,
    share: float = 1.0,
) -> int:
    """The most trajectories per chunk that keep `batch` trajectories within
    `share` of `budget` bytes (less `RUNTIME_BYTES`); an error that says what to
    change if not even one fits."""
    per = footprint.chunk
    if per > budget * share:
        raise ValueError(
            f"One trajectory's {what} needs about {per:,} bytes, more than the "
            f"memory budget of {budget:,} bytes allows: {fix}, or raise "
            "memory_budget."
        )
    results = batch * footprint.batch
    room = int((budget - RUNTIME_BYTES) * share) - results
    if room < per:
        floor = int((results + per) / share) + RUNTIME_BYTES
        raise ValueError(
            f"memory_budget={budget:,} bytes cannot hold the {what} of {batch:,} "
            f"trajectories: their results take about {results:,} bytes, one "
            f"trajectory's working arrays {per:,} and XLA's runtime about "
            f"{RUNTIME_BYTES:,} (measured, whatever the chunk). Raise memory_budget "
            f"to at least {floor:,}, or pass fewer trajectories per call."
        )
    return max(1, min(batch, room // per))
