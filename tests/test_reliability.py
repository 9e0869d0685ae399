"""A mesh knows the solve it came from, and ensemble arguments are checked: a failed
recording, a mesh of another problem or a nonsensical chunk size is a `ValueError`
that names the fault and the fix, never a silent answer or a deep traceback."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradsolve as gs

from .helpers import PROBLEMS


LV = PROBLEMS["lotka_volterra"]
LORENZ = PROBLEMS["lorenz"]
PENDULUM = PROBLEMS["pendulum"]
TERM = diffrax.ODETerm(LV.f)
CTRL = diffrax.PIDController(rtol=1e-6, atol=1e-6)
RUNTIME = (eqx.EquinoxRuntimeError, jax.errors.JaxRuntimeError)
Y3 = jnp.stack([3 * LV.y0, LV.y0, 3 * LV.y0])


def _record(y0=LV.y0, t1=2.0, **kwargs):
    kwargs.setdefault("stepsize_controller", CTRL)
    return gs.record(TERM, gs.Tsit5(), 0.0, t1, None, y0, LV.args, **kwargs)


def test_failed_recording_is_not_replayed_silently():
    mesh = _record(max_steps=5, throw=False)
    assert mesh.result == diffrax.RESULTS.max_steps_reached
    assert float(mesh.t0) == 0.0 and float(mesh.t1) == 2.0
    reached = float(mesh.ts[-1])
    assert reached < 1.0
    replay = lambda m, **kw: gs.replay(m, TERM, gs.Tsit5(), LV.y0, LV.args, **kw)
    match = rf"recording that failed \(max_steps_reached at t={reached:.6g} of \[0, 2\]"
    with pytest.raises(ValueError, match=match + r".*allow_partial=True"):
        replay(mesh)
    with pytest.raises(RUNTIME, match="recording that failed"):
        jax.jit(lambda m: replay(m).ys)(mesh)
    sol = replay(mesh, allow_partial=True)
    assert float(sol.ts[-1]) == reached
    assert sol.result == diffrax.RESULTS.max_steps_reached
    # A successful recording replays as before, also inside jit.
    good = _record()
    assert float(good.t1) == float(good.ts[-1]) == 2.0
    jax.jit(lambda m: replay(m).ys)(good)


@pytest.mark.bitwise
def test_failed_trajectories_of_a_batched_mesh():
    # The second trajectory (a third of the others' populations) needs more steps.
    one = lambda y0: _record(y0, t1=6.0, max_steps=40, throw=False)
    mesh = jax.vmap(one)(Y3)
    ok = np.asarray(mesh.result == diffrax.RESULTS.successful)
    assert ok.tolist() == [True, False, True]
    assert mesh.t1.shape == mesh.num_steps.shape == (3,)
    args = (TERM, gs.Tsit5(), Y3, LV.args)
    with pytest.raises(ValueError, match=r"1 of 3 trajectories .*row 1: max_steps"):
        gs.replay(mesh, *args)
    with pytest.raises(ValueError, match="1 of 3 trajectories"):
        gs.replay_ensemble(mesh, *args, chunk_size=2)
    with pytest.raises(RUNTIME, match="recording that failed"):
        jax.jit(lambda m: gs.replay(m, *args).ys)(mesh)
    sol = gs.replay(mesh, *args, allow_partial=True)
    chunked = gs.replay_ensemble(mesh, *args, chunk_size=2, allow_partial=True)
    np.testing.assert_array_equal(sol.ys, chunked.ys)
    # The trajectories that succeeded replay alone without allow_partial, as here.
    good = jax.tree.map(lambda x: x[ok], mesh)
    alone = gs.replay(good, TERM, gs.Tsit5(), Y3[ok], LV.args)
    np.testing.assert_array_equal(sol.ys[ok], alone.ys)


@pytest.mark.bitwise
def test_each_trajectory_of_a_batch_records_as_it_does_alone():
    # Rows that stop at different times, one of them for want of steps, with save
    # times and forced step ends: under vmap the recording loop runs until the
    # last row stops and must leave every other row exactly as its own solve.
    ctrl = diffrax.PIDController(rtol=1e-6, atol=1e-6, step_ts=jnp.array([0.7, 3.1]))
    saveat = diffrax.SaveAt(ts=jnp.linspace(0.5, 5.5, 6))
    y0s = jnp.stack([3 * LV.y0, LV.y0, 0.2 * LV.y0, 2 * LV.y0])

    def solve(y0):
        sol = gs.diffeqsolve(
            TERM, gs.Tsit5(), 0.0, 6.0, None, y0, LV.args,
            saveat=saveat, stepsize_controller=ctrl, max_steps=60, throw=False,
        )  # fmt: skip
        return sol.mesh, sol.ys, sol.stats

    batched = jax.vmap(solve)(y0s)
    results = np.asarray(batched[0].result == diffrax.RESULTS.successful)
    assert not results.all() and results.any()
    steps = np.asarray(batched[0].num_steps)
    assert len(set(steps[results].tolist())) > 1
    for i, y0 in enumerate(y0s):
        alone = solve(y0)
        for got, want in zip(jax.tree.leaves(alone), jax.tree.leaves(batched)):
            np.testing.assert_array_equal(np.asarray(want)[i], np.asarray(got))


def test_mesh_of_another_problem_is_refused():
    lorenz = gs.record(
        diffrax.ODETerm(LORENZ.f),
        gs.Tsit5(),
        0.0,
        1.0,
        None,
        LORENZ.y0,
        LORENZ.args,
        stepsize_controller=CTRL,
    )
    assert lorenz.state.shapes == ((3,),) and lorenz.state.dtypes == ("float64",)
    with pytest.raises(ValueError, match=r"state .*float64\[3\] over \[0, 1\], but y0"):
        gs.replay(lorenz, TERM, gs.Tsit5(), LV.y0, LV.args)
    batched = jax.vmap(lambda y0: _record(y0))(Y3)
    with pytest.raises(ValueError, match=r"float64\[2\].*but y0 .*float64\[2, 1\]"):
        gs.replay(batched, TERM, gs.Tsit5(), Y3[..., None], LV.args)
    pendulum = gs.record(
        diffrax.ODETerm(PENDULUM.f),
        gs.Tsit5(),
        0.0,
        1.0,
        None,
        PENDULUM.y0,
        PENDULUM.args,
        stepsize_controller=CTRL,
    )
    as_tuple = (PENDULUM.y0["omega"], PENDULUM.y0["theta"])
    with pytest.raises(ValueError, match=r"recorded for a state PyTreeDef\(\{"):
        gs.replay(pendulum, diffrax.ODETerm(PENDULUM.f), gs.Tsit5(), as_tuple)
    # Another dtype: a float32 recording replayed with a float64 state.
    f32 = _record(LV.y0.astype(jnp.float32), t1=jnp.float32(2.0))
    with pytest.raises(ValueError, match=r"float32\[2\].*but y0 is .*float64\[2\]"):
        gs.replay(f32, TERM, gs.Tsit5(), LV.y0, LV.args)


def test_mesh_file_keeps_result_span_and_state(tmp_path):
    mesh = jax.vmap(lambda y0: _record(y0, t1=6.0, max_steps=40, throw=False))(Y3)
    gs.save_mesh(tmp_path / "m.gsmesh", mesh)
    loaded = gs.load_mesh(tmp_path / "m.gsmesh")
    assert loaded.state == mesh.state
    for name in ("t0", "t1", "num_steps"):
        np.testing.assert_array_equal(getattr(loaded, name), getattr(mesh, name))
    assert bool(jnp.all(loaded.result == mesh.result))
    with pytest.raises(ValueError, match="1 of 3 trajectories"):
        gs.replay(loaded, TERM, gs.Tsit5(), Y3, LV.args)


def _record_ensemble(y0=Y3, args=LV.args, **kwargs):
    kwargs.setdefault("stepsize_controller", CTRL)
    return gs.record_ensemble(TERM, gs.Tsit5(), 0.0, 1.0, None, y0, args, **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(chunk_size=0), "chunk_size must be a positive integer.*got 0"),
        (dict(chunk_size=-1), "chunk_size must be a positive integer.*got -1"),
        (dict(chunk_size=1.5), "chunk_size must be a positive integer.*got 1.5"),
        (dict(max_steps=0), "max_steps must be a positive integer.*got 0"),
        (dict(max_steps=-5), "max_steps must be a positive integer.*got -5"),
        (dict(memory_budget=-1), "memory_budget must be a positive integer"),
        (dict(y0=(Y3, 1.0)), r"y0\[1\] is a scalar \(shape \(\)\): gs.record_ens"),
        (dict(y0=(Y3, Y3[:2])), r"y0 has leading axis sizes \[2, 3\] \(y0\[1\] has"),
        (
            dict(args=(jnp.stack([LV.args] * 3), 2.0), args_axes=0),
            r"args\[1\] is a scalar .*args_axes=0 needs 3 rows",
        ),
    ],
)
def test_record_ensemble_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _record_ensemble(**kwargs)


def test_replay_ensemble_arguments_are_checked():
    mesh = _record_ensemble()
    args = (TERM, gs.Tsit5(), Y3, LV.args)
    for chunk_size in (0, -2):
        with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
            gs.replay_ensemble(mesh, *args, chunk_size=chunk_size)
    with pytest.raises(ValueError, match="gradient needs about") as info:
        gs.replay_ensemble(mesh, *args, memory_budget=100)
    assert "max_steps" not in str(info.value) and "mesh.trim()" in str(info.value)
    with pytest.raises(ValueError, match="needs a batched mesh"):
        gs.replay_ensemble(_record(), TERM, gs.Tsit5(), LV.y0, LV.args)
    # A scalar leaf is named, with its shape, not reported as a size mismatch.
    with pytest.raises(ValueError, match=r"holds 3 trajectories but y0\[1\] is a scal"):
        gs.replay(mesh, TERM, gs.Tsit5(), (Y3, 1.0), LV.args)
    pairs = (jnp.stack([LV.args] * 3), 2.0)
    with pytest.raises(ValueError, match=r"but args\[1\] is a scalar .*args_axes=0"):
        gs.replay(mesh, TERM, gs.Tsit5(), Y3, pairs, args_axes=0)
    with pytest.raises(ValueError, match=r"but y0 has leading axis sizes \[2\]:"):
        gs.replay_ensemble(mesh, TERM, gs.Tsit5(), Y3[:2], LV.args)
