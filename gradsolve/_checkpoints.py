"""How many steps the one-call adjoint recomputes at a time (and so how often the
recording keeps a state for it).

`jax.grad` through `gs.diffeqsolve` walks back over the accepted steps in segments
(`_adjoint.py`), each recomputed from a kept state. Every segment costs a fixed
overhead (one iteration of a `while_loop`, one `jax.vjp` of a short `scan`) on top
of its steps. For a cheap vector field (Lorenz: tens of operations) that overhead
dominates a step, so segments of 8 steps are fastest; for a costly one (an MLP:
thousands of operations) the steps dominate, and segments of 1 step are fastest,
since they recompute nothing and waste no steps past the end of a short solve.
Measured on a 2-core CPU, float64, `max_steps=4096`, 64 trajectories: Lorenz
2.3 ms with segments of 8 against 3.5 ms with segments of 1, Lotka-Volterra 5.0
against 17 ms; an MLP 4-32-32-4 field 3.8 against 2.9 ms, a 4-step MLP 2-64-64-2
solve (32 trajectories, float32) 2.2 against 1.5 ms.

Segments of one step keep every state: `max_steps + 1` of them per trajectory. So
they are used only for a small state (at most `MAX_KEPT_STATE_BYTES`, four times a
step time in float64): the kept states then take at most four times the memory of
the mesh itself.

A state too large to be held as components (more than 32 elements) kept every 8
steps would take many times the mesh's memory (a 48-element float64 state, 4,096
steps: 197 KB per trajectory), written in full at every call: 1,024 trajectories
of a 48-state chain spent 75 ms of a 99 ms forward pass writing their 201 MB. Such
a state is kept less often (`checkpoint_spacing`), in blocks of segments that the
adjoint recomputes forward, one block at a time, before walking back over them.
"""

import math

import jax.numpy as jnp

from ._components import MAX_COMPONENTS
from ._representation import equations, leaves_field_jaxpr


# Segments of this many steps for a cheap field ...
CHEAP_FIELD_SEGMENT = 8
# ... and of one step for a field taking at least this many floating-point
# operations per evaluation (per trajectory).
COSTLY_FIELD_FLOPS = 1000
# ... and a state of at most this many bytes.
MAX_KEPT_STATE_BYTES = 32
# A large state is kept in blocks (`checkpoint_spacing`) only when its field takes at
# most this many floating-point operations per state element.
BLOCK_FIELD_FLOPS = 32


def _flops(jaxpr) -> int:
    """Floating-point operations of one evaluation of `jaxpr`: `2 m n k` for a
    matrix product, one per output element for any other primitive."""
    total = 0
    for eqn, subs in equations(jaxpr):
        if subs:
            continue
        out = sum(math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out *= 2 * math.prod(lhs[d] for d in contract)
        total += out
    return total


def _bytes(leaves) -> int:
    return sum(jnp.size(x) * jnp.result_type(x).itemsize for x in leaves)


def segment_length(problem, leaves, t) -> int:
    """The adjoint's segment length for `problem` (a `LeafProblem`) with a state of
    `leaves` at time `t`: 1 for a costly vector field and a small state, else
    `CHEAP_FIELD_SEGMENT`.

    The field is traced, not compiled, as `array_field_jaxpr` traces it: the
    decision is the same whether its arrays are constants or tracers of an
    enclosing `jit` or `vmap`, and inside a sharded ensemble."""
    if _bytes(leaves) > MAX_KEPT_STATE_BYTES:
        return CHEAP_FIELD_SEGMENT
    if _flops(leaves_field_jaxpr(problem, leaves, t)) >= COSTLY_FIELD_FLOPS:
        return 1
    return CHEAP_FIELD_SEGMENT


def checkpoint_spacing(problem, segment: int, leaves, max_steps: int, t) -> int:
    """How many steps apart the recording keeps a state for the adjoint of
    `problem` (a `LeafProblem`), given its `segment` length, a state of `leaves`,
    `max_steps` and a time `t`.

    `segment`, unless the state has more than `MAX_COMPONENTS` elements, is walked
    back `CHEAP_FIELD_SEGMENT` steps at a time, its field takes at most
    `BLOCK_FIELD_FLOPS` operations per element (a stencil, an elementwise law),
    and states kept every `segment` steps would take more bytes than the mesh's
    times: then the smallest multiple of `segment` at which they take no more.
    (The blocks' forward recomputation costs little for such a field; a
    48-element MLP field's gradient took 29 ms against 34 ms with it, 64
    trajectories.)"""
    size = sum(jnp.size(x) for x in leaves)
    if segment != CHEAP_FIELD_SEGMENT or size <= MAX_COMPONENTS:
        return segment
    state_bytes = _bytes(leaves)
    mesh_bytes = (max_steps + 1) * jnp.result_type(t).itemsize
    if (max_steps // segment + 1) * state_bytes <= mesh_bytes:
        return segment
    if _flops(leaves_field_jaxpr(problem, leaves, t)) > BLOCK_FIELD_FLOPS * size:
        return segment
    every = segment
    while (max_steps // every + 1) * state_bytes > mesh_bytes and every < max_steps:
        every += segment
    return every
