"""Chunked recording and replay give the unchunked results bit for bit; memory
estimates choose the chunks and refuse what cannot fit."""

import dataclasses

import diffrax
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import gradsolve as gs
from gradsolve._ensemble import MODEST_RECORDING, SMALL_RECORDING
from gradsolve._memory import RUNTIME_BYTES, record_footprint
from gradsolve._short_buffer import SHORT_BUFFER

from .helpers import PROBLEMS


# Chunked and unchunked results are compared bit for bit.
pytestmark = pytest.mark.bitwise


L = PROBLEMS["lorenz"]
TERM = diffrax.ODETerm(L.f)
CTRL = diffrax.PIDController(rtol=1e-6, atol=1e-6)
N = 10
PARAMS = jnp.stack([jnp.full(N, 10.0), jnp.linspace(0, 28, N), jnp.full(N, 8 / 3)], 1)
Y0S = jnp.tile(L.y0, (N, 1))


def _record_one(y0, p):
    return gs.record(TERM, gs.Tsit5(), 0.0, 1.0, None, y0, p, stepsize_controller=CTRL)


@pytest.fixture(scope="module")
def mesh():
    return jax.vmap(_record_one)(Y0S, PARAMS).trim()


def _assert_identical(a, b):
    # A small ensemble's mesh may be trimmed without a copy: compared as replayed.
    cut = lambda x: x.cut() if isinstance(x, gs.RecordedMesh) else x
    a, b = jtu.tree_map(cut, (a, b), is_leaf=lambda x: isinstance(x, gs.RecordedMesh))
    assert jtu.tree_structure(a) == jtu.tree_structure(b)
    for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _record_ensemble(**kwargs):
    return gs.record_ensemble(
        TERM,
        gs.Tsit5(),
        0.0,
        1.0,
        None,
        Y0S,
        PARAMS,
        args_axes=0,
        stepsize_controller=CTRL,
        **kwargs,
    )


@pytest.mark.parametrize("chunk_size", [3, 4, 10])
def test_chunked_record_is_the_vmapped_record(mesh, chunk_size):
    _assert_identical(_record_ensemble(chunk_size=chunk_size), mesh)


def _loss(replay, mesh, saveat, **kwargs):
    def loss(params):
        sol = replay(
            mesh, TERM, gs.Tsit5(), Y0S, params, args_axes=0, saveat=saveat, **kwargs
        )
        return jnp.sum(sol.ys**2), sol.ys

    return jax.grad(loss, has_aux=True)


@pytest.mark.parametrize(
    "saveat",
    [gs.SaveAt(t1=True), gs.SaveAt(ts=jnp.linspace(0, 1, 5))],
    ids=["t1", "ts"],
)
def test_chunked_replay_gradient_is_the_batched_one(mesh, saveat):
    (want_grad, want_ys) = _loss(gs.replay, mesh, saveat)(PARAMS)
    (got_grad, got_ys) = _loss(gs.replay_ensemble, mesh, saveat, chunk_size=3)(PARAMS)
    if saveat.subs.ts is None:
        _assert_identical((got_grad, got_ys), (want_grad, want_ys))
    else:
        # XLA compiles the dense-output interpolation differently for another batch
        # size (operation fusion): equal to round-off (amplified by Lorenz's chaos
        # in the gradient).
        np.testing.assert_allclose(got_ys, want_ys, rtol=1e-14, atol=1e-14)
        np.testing.assert_allclose(got_grad, want_grad, rtol=1e-12)


def test_budget_sets_the_chunks(mesh):
    # A budget of XLA's fixed runtime bytes and about four trajectories' gradients.
    per = gs.estimate_memory(1, mesh.max_steps, Y0S)["gradient"]
    budget = RUNTIME_BYTES + 4 * per
    want = _loss(gs.replay, mesh, gs.SaveAt(t1=True))(PARAMS)
    got = _loss(gs.replay_ensemble, mesh, gs.SaveAt(t1=True), memory_budget=budget)
    _assert_identical(got(PARAMS), want)
    with pytest.raises(ValueError, match="One trajectory's gradient needs about"):
        gs.replay_ensemble(
            mesh, TERM, gs.Tsit5(), Y0S, PARAMS, args_axes=0, memory_budget=per // 2
        )
    per_record = gs.estimate_memory(1, 4096, Y0S)["record"]
    chunked = gs.record_ensemble(
        TERM,
        gs.Tsit5(),
        0.0,
        1.0,
        None,
        Y0S,
        PARAMS,
        args_axes=0,
        stepsize_controller=CTRL,
        # Half the budget records, half holds the mesh returned.
        memory_budget=2 * (RUNTIME_BYTES + 3 * per_record),
    )
    _assert_identical(chunked, mesh)


def test_estimates_cover_the_buffers():
    """At least the arrays a recording and a gradient must hold."""
    est = gs.estimate_memory(1000, 4096, Y0S)
    assert est["record"] >= 1000 * 4097 * 8  # the recorded times
    assert est["gradient"] >= 1000 * 4096 * 3 * 8  # one state per step
    double = gs.estimate_memory(2000, 4096, Y0S)
    assert double["gradient"] == 2 * est["gradient"]


@pytest.mark.parametrize("way", ["at once", "one chunk", "chunks"])
def test_short_first_buffer_gives_the_full_recording(way):
    # Decay rates over five decades: 7 to ~1,600 steps, so some trajectories
    # outgrow the first, short buffer and are recorded again; one runs out of
    # max_steps and must fail as it does in a single recording. Three ways: a
    # small ensemble at once with max_steps, a larger one in one chunk (short
    # buffer first), and chunks.
    rates = jnp.array([0.1, 1.0, 1e3, 10.0, 3e3, 1e4])
    if way == "one chunk":
        rates = jnp.tile(rates, 32)
    term = diffrax.ODETerm(lambda t, y, k: -k * y + jnp.sin(t))
    y0s = jnp.ones((rates.size, 2))
    kw = dict(stepsize_controller=CTRL, max_steps=1200)
    kwargs = dict(kw, chunk_size=4) if way == "chunks" else kw
    full = record_footprint(1200, y0s, gs.Tsit5(), rates).bytes(rates.size)
    assert (full <= SMALL_RECORDING) == (way != "one chunk")
    assert full <= MODEST_RECORDING

    def one(y0, k):
        return gs.record(term, gs.Tsit5(), 0.0, 3.0, None, y0, k, throw=False, **kw)

    want = jax.vmap(one)(y0s, rates).trim()
    got = gs.record_ensemble(
        term, gs.Tsit5(), 0.0, 3.0, None, y0s, rates, args_axes=0, throw=False, **kwargs
    )
    steps = np.asarray(want.num_steps)
    ok = np.asarray(want.result == diffrax.RESULTS.successful)
    assert steps[ok].min() < SHORT_BUFFER < steps[ok].max() and not ok.all()
    _assert_identical(got, want)
    with pytest.raises(Exception, match="max_steps=1200"):
        gs.record_ensemble(
            term, gs.Tsit5(), 0.0, 3.0, None, y0s, rates, args_axes=0, **kwargs
        )


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 4])
def test_chunked_replay_with_shared_args(mesh, chunk_size):
    # One parameter vector shared by every trajectory: the values are bitwise the
    # unchunked ones; its gradient is a sum over the ensemble that the chunks add in
    # another order, so it agrees to round-off, not bit for bit.
    shared = PARAMS[3]

    def loss(replay, **kwargs):
        def f(p):
            sol = replay(mesh, TERM, gs.Tsit5(), Y0S, p, stale="ignore", **kwargs)
            return jnp.sum(sol.ys**2), sol.ys

        return jax.grad(f, has_aux=True)(shared)

    want_grad, want_ys = loss(gs.replay)
    got_grad, got_ys = loss(gs.replay_ensemble, chunk_size=chunk_size)
    _assert_identical(got_ys, want_ys)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-13)


def _compilations(fn):
    """The number of XLA compilations while `fn()` runs."""
    count = [0]

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        jax.block_until_ready(fn())
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return count[0]


def test_recordings_with_the_same_settings_compile_once():
    record = lambda y0s, params: gs.record_ensemble(
        TERM, gs.Tsit5(), 0.0, 1.0, None, y0s, params, args_axes=0,
        stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-6),
    )  # fmt: skip
    first = record(Y0S, PARAMS)
    # New values, a new (equal) controller: nothing to compile.
    y0s, params = Y0S * 1.001, PARAMS * 1.001
    assert _compilations(lambda: record(y0s, params)) == 0
    again = record(Y0S, PARAMS)
    _assert_identical(again, first)


@dataclasses.dataclass
class _Decay:
    """A vector field that cannot be hashed (a dataclass compared by value)."""

    rate: float

    def __call__(self, t, y, args):
        return -self.rate * args * y


def test_settings_that_cannot_be_hashed_fail_as_in_one_recording():
    # `gs.record` needs a hashable vector field; the ensemble reports it as
    # `gs.record` does, not with an error of its own.
    term = diffrax.ODETerm(_Decay(0.5))
    rates = jnp.linspace(0.5, 2.0, 4)
    y0s = jnp.ones((4, 2))
    with pytest.raises(ValueError, match="Non-hashable static arguments"):
        gs.record(term, gs.Tsit5(), 0.0, 1.0, None, y0s[0], rates[0])
    with pytest.raises(ValueError, match="Non-hashable static arguments"):
        gs.record_ensemble(term, gs.Tsit5(), 0.0, 1.0, None, y0s, rates, args_axes=0)


def test_trim_without_copy_replays_as_the_cut_mesh(tmp_path):
    # `trim(copy=False)` keeps the buffers and records the length: every replay
    # takes that many steps (cut in its own program), with the values and
    # gradients of the cut mesh bit for bit, and saving writes the cut mesh.
    untrimmed = jax.vmap(_record_one)(Y0S, PARAMS)
    cut, kept = untrimmed.trim(), untrimmed.trim(copy=False)
    assert kept.ts.shape == untrimmed.ts.shape and kept.length == cut.max_steps
    assert kept.max_steps == cut.max_steps < untrimmed.max_steps
    _assert_identical(kept.cut(), cut)
    _assert_identical(kept.trim(), cut)
    saveat = gs.SaveAt(steps=True)
    (got_grad, got_ys) = jax.jit(_loss(gs.replay, kept, saveat))(PARAMS)
    want = jax.jit(_loss(gs.replay, cut, saveat))(PARAMS)
    _assert_identical((got_grad, got_ys), want)
    # One value per replayed step: the buffer's padding was not replayed.
    assert got_ys.shape[1] == cut.max_steps
    sol = gs.replay_ensemble(kept, TERM, gs.Tsit5(), Y0S, PARAMS, args_axes=0)
    assert np.all(np.asarray(sol.stats["max_steps"]) == cut.max_steps)
    gs.save_mesh(tmp_path / "mesh.gsmesh", kept)
    loaded = gs.load_mesh(tmp_path / "mesh.gsmesh")
    assert loaded.length is None
    _assert_identical(loaded, cut)


def test_small_ensembles_are_trimmed_without_a_copy(mesh):
    # Recorded at once with their full buffers, which they keep: the mesh is
    # the one a cut would give (see the test above), its length the bucket's.
    got = _record_ensemble()
    assert got.ts.shape[1] == 4097 and got.length == mesh.max_steps
    _assert_identical(got, mesh)
