"""Programs written for Diffrax run unchanged with `gs.diffeqsolve` and gradsolve's
solvers swapped in: the same values, warnings and gradients as Diffrax's."""

import types
import warnings

import diffrax
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import gradsolve as gs

from .references import StoredReferences


REFERENCES = StoredReferences(__file__)


def _decay(t, y, args):
    return jtu.tree_map(lambda x: -0.8 * x, y)


TERM = diffrax.ODETerm(_decay)
PID = diffrax.PIDController(rtol=1e-7, atol=1e-9)


def _ours(t0, t1, dt0, y0, args=None, term=TERM, **kwargs):
    return gs.diffeqsolve(term, gs.Tsit5(), t0, t1, dt0, y0, args, **kwargs)


def _diffrax(t0, t1, dt0, y0, args=None, term=TERM, **kwargs):
    return diffrax.diffeqsolve(term, diffrax.Tsit5(), t0, t1, dt0, y0, args, **kwargs)


def _both(*args, **kwargs):
    """gradsolve's solution and Diffrax's, both solved now."""
    return _ours(*args, **kwargs), _diffrax(*args, **kwargs)


def _ours_and_stored(name, t0, t1, dt0, y0, args=None, term=TERM, **kwargs):
    """gradsolve's solution, and Diffrax's `ts` and `ys` stored under `name`."""
    ours = _ours(t0, t1, dt0, y0, args, term, **kwargs)

    def compute():
        sol = _diffrax(t0, t1, dt0, y0, args, term, **kwargs)
        return {"ts": sol.ts, "ys": sol.ys}

    return ours, types.SimpleNamespace(**REFERENCES(name, compute))


def _close(a, b, rtol=1e-12):
    for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b), strict=True):
        assert jnp.shape(x) == jnp.shape(y)
        assert jnp.result_type(x) == jnp.result_type(y)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=0)


def test_array_times_with_a_python_float_dt0():
    # As in a training loop: ts an array, t0 = ts[0], t1 = ts[-1], dt0 a literal.
    ts = jnp.linspace(0.0, 2.0, 9)
    ours, theirs = _ours_and_stored(
        "array-times-pid",
        ts[0],
        ts[-1],
        0.1,
        jnp.array([1.0, -0.5]),
        saveat=diffrax.SaveAt(ts=ts),
        stepsize_controller=PID,
    )
    _close(ours.ys, theirs.ys)
    ours, theirs = _ours_and_stored(  # constant step
        "array-times-constant", ts[0], ts[-1], 0.1, jnp.array([1.0, -0.5])
    )
    _close(ours.ys, theirs.ys)


@pytest.mark.parametrize("controller", [diffrax.ConstantStepSize(), PID])
def test_integer_times_under_strict_promotion(controller, request):
    case = request.node.callspec.id
    with jax.numpy_dtype_promotion("strict"):
        ours, theirs = _ours_and_stored(
            f"integer-times-{case}-saveat",
            jnp.int32(0),
            jnp.int32(2),
            0.25,
            jnp.array([1.0, 3.0]),
            stepsize_controller=controller,
            saveat=diffrax.SaveAt(ts=jnp.array([0.5, 1.0, 2.0])),
        )
        _close(ours.ys, theirs.ys)
        _close(ours.ts, theirs.ts)
        ours, theirs = _ours_and_stored(
            f"integer-times-{case}-python", 0, 2, 0.25, jnp.array([1.0, 3.0])
        )
        _close(ours.ys, theirs.ys)


def test_gradient_of_values_saved_at_ts_under_strict_promotion():
    # Diffrax's own tests run under strict dtype promotion and with implicit rank
    # promotion an error (`test_adjoint.py::test_against` with gs.diffeqsolve
    # swapped in once failed on both, in the adjoint's save times).
    ts = jnp.array([0.3, 1.1, 2.0])

    def loss(y0, k, module):
        sol = module.diffeqsolve(
            diffrax.ODETerm(lambda t, y, k: -k * y),
            module.Tsit5(),
            0.0,
            2.0,
            None,
            y0,
            k,
            stepsize_controller=PID,
            saveat=diffrax.SaveAt(t0=True, ts=ts, t1=True),
        )
        return jnp.sum(sol.ys)

    y0, k = jnp.array([1.0, -0.5]), jnp.array(0.8)
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        grad = lambda module: jax.grad(loss, argnums=(0, 1))(y0, k, module)
        ours = grad(gs)
        theirs = REFERENCES("strict-gradient-at-ts", lambda: grad(diffrax))
    _close(ours, theirs, rtol=1e-9)
    # y(t) = y0 exp(-k t), saved at 0, ts and 2.
    times = np.concatenate([[0.0], np.asarray(ts), [2.0]])
    np.testing.assert_allclose(ours[0], np.sum(np.exp(-0.8 * times)), rtol=1e-6)
    d_k = -np.sum(times * np.exp(-0.8 * times)) * float(jnp.sum(y0))
    np.testing.assert_allclose(ours[1], d_k, rtol=1e-6)


def test_empty_state():
    ours, theirs = _ours_and_stored("empty-state-none", 0.0, 1.0, 0.1, None)
    assert ours.ys is None and theirs.ys is None
    ours, theirs = _ours_and_stored(
        "empty-state-zero-size", 0.0, 1.0, 0.1, {"a": jnp.zeros((0,))}
    )
    _close(ours.ys, theirs.ys)


# Held as components, and as arrays (the long tests).
@pytest.mark.parametrize("size", [1, pytest.param(40, marks=pytest.mark.slow)])
def test_zero_size_leaf_next_to_others(size):
    y0 = (jnp.linspace(1.0, 2.0, size), jnp.zeros((0,)), jnp.zeros((2, 0)))
    ts = jnp.array([0.3, 1.0])
    ours, theirs = _ours_and_stored(
        f"zero-size-leaf-{size}",
        0.0,
        1.0,
        None,
        y0,
        stepsize_controller=PID,
        saveat=diffrax.SaveAt(ts=ts),
    )
    _close(ours.ys, theirs.ys)

    def loss(solve, y0):
        sol = solve(
            0.0, 1.0, None, y0, stepsize_controller=PID, saveat=diffrax.SaveAt(ts=ts)
        )
        return jnp.sum(sol.ys[0] ** 2)

    theirs = REFERENCES(
        f"zero-size-leaf-{size}-gradient", lambda: jax.grad(loss, 1)(_diffrax, y0)
    )
    _close(jax.grad(loss, 1)(_ours, y0), theirs, rtol=1e-9)


def test_saved_solver_and_controller_state_resume():
    saveat = diffrax.SaveAt(
        t1=True, solver_state=True, controller_state=True, made_jump=True
    )
    y0 = jnp.array([1.0, 2.0])
    first, theirs = _both(0.0, 1.0, 0.1, y0, saveat=saveat, stepsize_controller=PID)
    for name in ("solver_state", "controller_state", "made_jump"):
        _close(getattr(first, name), getattr(theirs, name))
    # Resume from the saved state, as Diffrax documents.
    resumed, resumed_theirs = _both(
        1.0,
        2.0,
        0.1,
        first.ys[-1],
        stepsize_controller=PID,
        solver_state=first.solver_state,
        controller_state=first.controller_state,
        made_jump=first.made_jump,
    )
    _close(resumed.ys, resumed_theirs.ys)
    np.testing.assert_allclose(resumed.ys[-1], y0 * np.exp(-0.8 * 2.0), rtol=1e-6)


def test_complex_state_warns_as_diffrax():
    y0 = jnp.array([1.0 + 2.0j, -0.5j])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, theirs = _both(0.0, 1.0, None, y0, stepsize_controller=PID)
    messages = [str(w.message) for w in caught if "omplex" in str(w.message)]
    assert len(messages) == 2 and messages[0] == messages[1]
    _close(ours.ys, theirs.ys)


def test_complex_state_saved_at_ts_backwards_under_strict_promotion():
    # Diffrax runs gs.Tsit5 here (the complex state falls back): its dense output
    # multiplies real weights by complex stages.
    y0 = jnp.array([1.0 + 0.5j, 0.2j])
    saveat = diffrax.SaveAt(ts=jnp.array([0.7, 0.3]))
    with jax.numpy_dtype_promotion("strict"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours, theirs = _ours_and_stored(
            "complex-backwards-strict",
            1.0,
            0.0,
            -0.1,
            y0,
            stepsize_controller=PID,
            saveat=saveat,
        )
    _close(ours.ys, theirs.ys)


def _forced_sum(switch, module):
    """y' = -y + H(t - switch), integrated with steps clipped to the switch time;
    returns the integral of y. Its derivative in `switch` flows through the step
    times alone (H does not depend on `switch` away from it)."""

    def field(t, y, forcing):
        return -y[0] + forcing(t), y[0]

    controller = diffrax.ClipStepSizeController(
        diffrax.PIDController(rtol=1e-8, atol=1e-8), step_ts=switch[None]
    )
    sol = module.diffeqsolve(
        diffrax.ODETerm(field),
        module.Tsit5(),
        0.0,
        1.0,
        None,
        (1.0, 0.0),
        args=lambda s: jnp.where(s < switch, 0.0, 1.0),
        stepsize_controller=controller,
    )
    return sol.ys[1][0]


def test_gradient_through_controller_step_times():
    grad = lambda module: jax.jit(jax.grad(lambda s: _forced_sum(s, module)))(0.4)
    ours = grad(gs)
    theirs = REFERENCES("controller-step-times-gradient", lambda: grad(diffrax))
    np.testing.assert_allclose(ours, theirs, rtol=1e-10)
    # And the derivative is the right one: d/ds of int_0^1 y = -(1 - e^{-(1 - s)}).
    np.testing.assert_allclose(ours, -(1 - np.exp(-0.6)), rtol=1e-6)


def test_gradient_with_respect_to_a_function_in_args():
    def loss(k, module):
        sol = module.diffeqsolve(
            diffrax.ODETerm(lambda t, y, rate: rate(y)),
            module.Tsit5(),
            0.0,
            1.5,
            None,
            jnp.array([1.0, 2.0]),
            args=lambda y: -k * y,  # the parameter lives in a closure
            stepsize_controller=PID,
        )
        return jnp.sum(sol.ys)

    ours = jax.grad(loss)(0.7, gs)
    theirs = REFERENCES(
        "function-in-args-gradient", lambda: jax.grad(loss)(0.7, diffrax)
    )
    np.testing.assert_allclose(ours, theirs, rtol=1e-10)
    np.testing.assert_allclose(ours, -1.5 * 3.0 * np.exp(-1.05), rtol=1e-6)


def test_time_derivatives_are_diffraxs():
    def loss(t1, module):
        sol = module.diffeqsolve(
            TERM,
            module.Tsit5(),
            0.0,
            t1,
            None,
            jnp.array([2.0]),
            stepsize_controller=PID,
        )
        return sol.ys[0, 0]

    transforms = {"grad": jax.grad, "jit-grad": lambda f: jax.jit(jax.grad(f))}
    for transform_name, transform in transforms.items():
        ours = transform(lambda t1: loss(t1, gs))(1.3)
        theirs = REFERENCES(
            f"time-derivative-{transform_name}",
            lambda: transform(lambda t1: loss(t1, diffrax))(1.3),
        )
        np.testing.assert_allclose(ours, theirs, rtol=1e-12)
    # gs.record holds step times fixed: a clear error, eagerly and inside jit.
    record = lambda t1: gs.record(
        TERM, gs.Tsit5(), 0.0, t1, None, jnp.array([2.0]), stepsize_controller=PID
    ).ts[1]
    for transform in (jax.grad, lambda f: jax.grad(jax.jit(f))):
        with pytest.raises(ValueError, match="hold the step times fixed"):
            transform(record)(1.3)


def test_fallback_does_not_recurse_when_diffrax_points_at_gradsolve(monkeypatch):
    # A program (or Diffrax's own test suite) may patch diffrax.diffeqsolve.
    original = diffrax.diffeqsolve
    monkeypatch.setattr(diffrax, "diffeqsolve", gs.diffeqsolve)
    args = (TERM, diffrax.Kvaerno5(), 0.0, 1.0, None, jnp.array([1.0]))
    ours = diffrax.diffeqsolve(*args, stepsize_controller=PID)
    theirs = original(*args, stepsize_controller=PID)
    _close(ours.ys, theirs.ys)


def test_solution_fields_without_dense_output_or_saved_state():
    ours, theirs = _both(0.0, 1.0, 0.1, jnp.array([1.0]))
    for sol in (ours, theirs):
        for name in ("solver_state", "controller_state", "made_jump"):
            assert getattr(sol, name) is None
        with pytest.raises(ValueError):
            sol.evaluate(0.2, 0.8)
        with pytest.raises(ValueError):
            sol.derivative(0.2)


@pytest.mark.parametrize("ts", [[0.0], [3.0], [0.8, 0.5]])
def test_bad_save_times_raise_what_diffrax_raises(ts):
    # Diffrax reports these from inside its compiled solve, as a RuntimeError;
    # gradsolve reports them before solving, as an error that is both.
    for solve in (diffrax.diffeqsolve, gs.diffeqsolve):
        with pytest.raises(RuntimeError, match="saveat.ts"):
            solve(
                diffrax.ODETerm(lambda t, y, args: -y), gs.Tsit5(), 0.5, 2.0, 0.1,
                1.0, saveat=diffrax.SaveAt(ts=jnp.array(ts)),
            )  # fmt: skip


def test_signature_is_diffraxs_plus_kernel():
    import inspect

    ours = inspect.signature(gs.diffeqsolve).parameters
    theirs = inspect.signature(diffrax.diffeqsolve).parameters
    assert set(ours) - set(theirs) == {"kernel"}
    for name, p in theirs.items():
        assert ours[name].kind == p.kind, name
        assert repr(ours[name].default) == repr(p.default), name


def test_deprecated_discrete_terminating_event_falls_back_with_the_warning():
    event = diffrax.DiscreteTerminatingEvent(lambda state, **kw: state.tprev > 2)
    args = (diffrax.ODETerm(lambda t, y, a: y), gs.Tsit5(), 0.0, jnp.inf, 1.0, 1.0)
    with pytest.warns(match="discrete_terminating_event"):
        ours = gs.diffeqsolve(*args, discrete_terminating_event=event)
    with pytest.warns(match="discrete_terminating_event"):
        theirs = diffrax.diffeqsolve(*args, discrete_terminating_event=event)
    _close(ours.ys, theirs.ys)
