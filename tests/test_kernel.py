"""The fused Pallas kernel (`kernel="pallas"`) against the XLA loop (`kernel="xla"`).

There is no GPU here: the kernel runs in Pallas interpret mode, which executes the
same kernel program on the CPU. Both paths must record the same mesh (times and step
counts) and save the same values, for ensembles whose trajectories take different
numbers of steps. The XLA loop itself is checked against Diffrax in `test_steps.py`.
"""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx
import pytest

import gradsolve as gs
from gradsolve._kernel_select import use_kernel

from .helpers import PROBLEMS


# The kernel's results are compared with the XLA loop's bit for bit.
pytestmark = pytest.mark.bitwise


LORENZ = PROBLEMS["lorenz"]
TERM = diffrax.ODETerm(LORENZ.f)
CTRL = gs.PIDController(rtol=1e-5, atol=1e-5)
KERNELS = ("xla", "pallas")


def _ensemble(n, dtype):
    # rho from 0 (decays in a few steps) to 28 (chaotic): ragged step counts.
    rho = jnp.linspace(0.0, 28.0, n)
    args = jnp.stack([jnp.full(n, 10.0), rho, jnp.full(n, 8 / 3)], 1).astype(dtype)
    y0s = jnp.tile(jnp.array([1.0, 0.0, 0.0], dtype), (n, 1))
    return y0s, args


def _solve_both(solver, ctrl, saveat, dtype, *, t0=0.0, t1=0.5, dt0=None, n=7, **kw):
    y0s, args = _ensemble(n, dtype)
    t0, t1 = jnp.asarray(t0, dtype), jnp.asarray(t1, dtype)
    dt0 = None if dt0 is None else jnp.asarray(dt0, dtype)
    out = []
    for kernel in ("xla", "pallas"):
        solve = lambda y0, p: gs.diffeqsolve(
            TERM,
            solver,
            t0,
            t1,
            dt0,
            y0,
            p,
            saveat=saveat,
            stepsize_controller=ctrl,
            kernel=kernel,
            **kw,
        )
        out.append(jax.jit(jax.vmap(solve))(y0s, args))
    return out


def _assert_same(xla, fused, *, rtol=0.0):
    """Same steps: bitwise here (interpret mode runs the same operations on the same
    CPU), with `rtol` for round-off where XLA fuses the constant step size's
    arithmetic differently. Saved values to round-off (16 ulps): the XLA
    loop interpolates a window of save times side by side, the kernel one at a
    time, and XLA may order the arithmetic of the two differently."""
    np.testing.assert_array_equal(fused.mesh.num_steps, xla.mesh.num_steps)
    for key in ("num_steps", "num_accepted_steps", "num_rejected_steps"):
        np.testing.assert_array_equal(fused.stats[key], xla.stats[key])
    np.testing.assert_array_equal(fused.result._value, xla.result._value)
    assert fused.ys.dtype == xla.ys.dtype and fused.mesh.ts.dtype == xla.mesh.ts.dtype
    np.testing.assert_allclose(fused.mesh.ts, xla.mesh.ts, rtol=rtol, atol=0)
    np.testing.assert_allclose(fused.ts, xla.ts, rtol=rtol, atol=0)
    # A dense output sums nine terms, some larger than the value: reordered, it
    # moves by a few units in the last place of the largest.
    ulps = 16 * np.finfo(xla.ys.dtype).eps
    np.testing.assert_allclose(fused.ys, xla.ys, rtol=max(rtol, ulps), atol=0)


@pytest.mark.parametrize(
    "solver,dtype",
    [
        (gs.Tsit5(), jnp.float64),
        (gs.Tsit5(), jnp.float32),
        pytest.param(gs.Dopri5(), jnp.float64, marks=pytest.mark.slow),
        pytest.param(gs.Dopri5(), jnp.float32, marks=pytest.mark.slow),
    ],
    ids=["tsit5-float64", "tsit5-float32", "dopri5-float64", "dopri5-float32"],
)
def test_kernel_matches_xla(solver, dtype):
    ts = jnp.linspace(0.0, 0.5, 5).astype(dtype)
    ctrl = gs.PIDController(rtol=1e-5, atol=1e-5)
    saveat = gs.SaveAt(t0=True, ts=ts, t1=True)
    xla, fused = _solve_both(solver, ctrl, saveat, dtype)
    steps = np.asarray(xla.mesh.num_steps)
    assert steps.min() < steps.max()  # ragged: lanes finish at different times
    assert np.asarray(xla.stats["num_rejected_steps"]).max() > 0
    _assert_same(xla, fused)


@pytest.mark.parametrize("case", ["constant", "pid_options", "backwards", "max_steps"])
def test_kernel_matches_xla_controllers(case):
    saveat = gs.SaveAt(t1=True)
    kw = {}
    rtol = 0.0
    if case == "constant":
        ctrl, kw = gs.ConstantStepSize(), dict(dt0=0.02)
        # ConstantStepSize's `t0 + (t1 - t0) * (k / n)`: XLA may contract it into a
        # fused multiply-add in one program and not the other.
        rtol = 1e-14
    elif case == "pid_options":
        ctrl = gs.PIDController(
            rtol=1e-6,
            atol=1e-6,
            pcoeff=0.3,
            icoeff=0.4,
            dcoeff=0.1,
            dtmin=1e-5,
            dtmax=0.05,
            factormax=5.0,
            safety=0.8,
            norm=optx.max_norm,
        )
        kw = dict(dt0=0.01)
    elif case == "backwards":
        ctrl = gs.PIDController(rtol=1e-5, atol=1e-5)
        saveat = gs.SaveAt(ts=jnp.array([0.4, 0.3, 0.0]), t1=True)
        kw = dict(t0=0.4, t1=0.0)
    else:
        ctrl = gs.PIDController(rtol=1e-8, atol=1e-8)
        kw = dict(max_steps=40, throw=False)  # the first lanes finish, the last not
    xla, fused = _solve_both(gs.Tsit5(), ctrl, saveat, jnp.float64, **kw)
    if case == "max_steps":
        assert (xla.result == diffrax.RESULTS.max_steps_reached).any()
        assert (xla.result == diffrax.RESULTS.successful).any()
    _assert_same(xla, fused, rtol=rtol)


def test_record_single_trajectory():
    y0s, args = _ensemble(3, jnp.float64)
    record = lambda kernel: gs.record(
        TERM,
        gs.Tsit5(),
        0.0,
        0.5,
        None,
        y0s[2],
        args[2],
        kernel=kernel,
        stepsize_controller=CTRL,
    )
    ours, theirs = record("pallas"), record("xla")  # one trajectory: a block of one
    np.testing.assert_array_equal(ours.ts, theirs.ts)
    assert int(ours.num_steps) == int(theirs.num_steps)


@pytest.mark.slow
def test_gradient_with_the_kernel_option():
    # Under jax.grad the recording keeps states for the adjoint: it runs on XLA,
    # whatever `kernel` says, and the gradient is the XLA path's.
    y0s, args = _ensemble(3, jnp.float64)

    def loss(p, kernel):
        solve = lambda y0, q: (
            gs.diffeqsolve(
                TERM,
                gs.Tsit5(),
                0.0,
                0.5,
                None,
                y0,
                q,
                stepsize_controller=CTRL,
                kernel=kernel,
            ).ys
        )
        return jnp.sum(jax.vmap(solve)(y0s, p) ** 2)

    grad = lambda kernel: jax.jit(jax.grad(loss), static_argnums=1)(args, kernel)
    np.testing.assert_array_equal(grad("pallas"), grad("xla"))


def _has_kernel(kernel, **kw):
    y0s, args = _ensemble(4, jnp.float64)
    solver = kw.pop("solver", gs.Tsit5())
    record = lambda y0, p: gs.record(
        TERM,
        solver,
        0.0,
        0.5,
        None,
        y0,
        p,
        kernel=kernel,
        stepsize_controller=CTRL,
        **kw,
    )
    return "pallas_call" in str(jax.make_jaxpr(jax.vmap(record))(y0s, args))


def test_auto_picks_xla_off_a_gpu():
    assert jax.default_backend() != "gpu"  # the tests run on a CPU
    assert not use_kernel("auto", None)
    assert not _has_kernel("auto")
    assert not _has_kernel("xla")
    assert _has_kernel("pallas")


def test_unsupported_problems_fall_back_or_name_the_fix():
    # `auto` falls back to XLA without a word; `pallas` says why it cannot run.
    with pytest.raises(ValueError, match="kernel='pallas' cannot run .* Rodas5"):
        _has_kernel("pallas", solver=gs.Rodas5())
    assert not _has_kernel("auto", solver=gs.Rodas5())
    y0, p = LORENZ.y0, LORENZ.args
    with pytest.raises(ValueError, match=r"SaveAt\(steps=True\).*kernel='xla'"):
        gs.diffeqsolve(
            TERM,
            gs.Tsit5(),
            0.0,
            0.1,
            0.01,
            y0,
            p,
            saveat=gs.SaveAt(steps=True),
            kernel="pallas",
        )
    with pytest.raises(ValueError, match="kernel='pallas' cannot run .* Kvaerno5"):
        gs.diffeqsolve(TERM, diffrax.Kvaerno5(), 0.0, 0.1, 0.01, y0, p, kernel="pallas")
    big = lambda t, y, w: jnp.tanh(w @ y)  # 100 weights: no longer a few scalars
    with pytest.raises(ValueError, match="100 elements"):
        gs.diffeqsolve(
            diffrax.ODETerm(big),
            gs.Tsit5(),
            0.0,
            0.1,
            0.01,
            jnp.ones(10),
            jnp.eye(10),
            kernel="pallas",
        )
    with pytest.raises(ValueError, match="kernel='gpu' is not an option"):
        gs.record(TERM, gs.Tsit5(), 0.0, 0.1, 0.01, y0, p, kernel="gpu")


def test_pytree_state_closure_and_batched_times():
    # A dict state, a time-dependent field closing over a batched rate, and a
    # per-trajectory `t1` and `ts`: each is a per-lane input of the kernel.
    def solve(k, t1, kernel):
        field = lambda t, y, a: {"x": y["v"], "v": -(k**2) * y["x"] + jnp.cos(a * t)}
        return gs.diffeqsolve(
            diffrax.ODETerm(field),
            gs.Dopri5(),
            0.0,
            t1,
            None,
            {"x": jnp.array(1.0), "v": jnp.array(0.0)},
            2.0,
            saveat=gs.SaveAt(ts=jnp.array([0.25, 0.5, 1.0]) * t1, t1=True),
            stepsize_controller=CTRL,
            max_steps=64,
            kernel=kernel,
        )

    ks, t1s = jnp.logspace(-1, 1, 4), jnp.linspace(0.5, 2.0, 4)
    xla, fused = (jax.vmap(lambda k, t1: solve(k, t1, c))(ks, t1s) for c in KERNELS)
    assert len(set(np.asarray(xla.mesh.num_steps).tolist())) > 1
    np.testing.assert_array_equal(fused.mesh.num_steps, xla.mesh.num_steps)
    # `cos(a t)` of a time may be evaluated by differently vectorised code in the
    # two programs: round-off, which the steps carry on.
    np.testing.assert_allclose(fused.mesh.ts, xla.mesh.ts, rtol=1e-13)
    for key in ("x", "v"):
        np.testing.assert_allclose(fused.ys[key], xla.ys[key], rtol=1e-12)
    empty = jax.vmap(lambda k, t1: solve(k, t1, "pallas"))(ks[:0], t1s[:0])
    assert empty.ys["x"].shape == (0, 4)
