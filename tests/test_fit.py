"""`gs.fit`: known parameters from synthetic noisy data, stale meshes re-recorded, the
same answer as an Optimistix fit with Diffrax gradients, both Jacobian modes, and
clear errors or result codes for bad input.

References are the true parameters of the synthetic data (simulated by Diffrax) and
fits computed entirely with Diffrax gradients (`examples/diffrax_fit.py`), both
stored with the tests (`references.py`).
"""

import contextlib
import logging
import pathlib
import re
import sys

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx
import pytest

import gradsolve as gs

from .references import StoredReferences, result_message
from .xla_settings import compiled_as_users_compile


EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import fit_lotka_volterra as lv  # noqa: E402


sys.path.insert(0, str(EXAMPLES.parent / "benchmarks"))
import fit_problems as fhn  # noqa: E402  (FitzHugh-Nagumo, as benchmarked)


# A fit replays meshes at parameters where they are stale on purpose (it checks the
# error ratio itself): no fit may warn about it.
pytestmark = pytest.mark.filterwarnings("error::gradsolve.StaleMeshWarning")

N = 16  # experiments; the examples' tests use the same size, so compilations are shared
# The synthetic data (simulated by Diffrax) and the fits with Diffrax gradients.
REFERENCES = StoredReferences(__file__)
# How many iterations more or fewer a converged fit may spend on another CPU.
FLOOR_ITERATIONS = 4


@pytest.fixture(scope="module")
def lv_data():
    y0s, ts, data = REFERENCES("lotka-volterra-data", lambda: lv.make_data(N))
    return jnp.asarray(y0s), jnp.asarray(ts), jnp.asarray(data)


def _diffrax_fit(lv_data, jac):
    """`(params, result message, iterations)` of the Lotka-Volterra fit with Diffrax
    gradients (`examples/diffrax_fit.py`), Jacobians in mode `jac`."""

    def compute():
        params, result, iterations, _ = lv.fit_diffrax(*lv_data, jac)
        return params, result_message(optx.RESULTS, result), np.asarray(iterations)

    # Where the optimiser stops on its round-off floor is round-off's choice: on
    # another CPU the same fit stopped two iterations earlier, with parameters
    # 2e-10 away (far inside the optimiser's tolerance).
    params, result, iterations = REFERENCES(
        f"diffrax-fit-{jac}",
        compute,
        rtol=lv.OPTIMISER.rtol,
        count_slack=FLOOR_ITERATIONS,
    )
    return params, str(result), int(iterations)


SUCCESS = str(result_message(optx.RESULTS, optx.RESULTS.successful))


@pytest.fixture(scope="module")
def lv_fwd(lv_data):
    # Meshes reused over rounds (the default with jac="bwd"): what most tests here
    # check; the per-evaluation way (the default with jac="fwd") is tested below.
    return lv.fit_gradsolve(*lv_data, "fwd", meshes="reused")


def test_lotka_volterra_recovers_known_parameters(lv_fwd):
    fit = lv_fwd
    assert fit.result == optx.RESULTS.successful
    np.testing.assert_allclose(fit.params, lv.TRUE_PARAMS, rtol=0.02)
    assert fit.stats["max_error_ratio"] <= 1
    # A fresh adaptive solve at the answer gives the values the fit replayed.
    assert fit.stats["validation_error"] < 1e-7
    # The answer of the run on the initial guess's (stale) mesh was refined on a
    # mesh recorded at it, and that mesh is fresh at the answer.
    assert fit.stats["stale_meshes"] >= 1 and fit.stats["records"] >= 2
    assert fit.stats["rounds"] + fit.stats["refinement_steps"] >= 2


def test_stale_mesh_is_detected_and_rerecorded(lv_data, lv_fwd):
    # The guess is 20% off; the steps chosen for it miss the tolerances at the answer.
    y0s, ts, _ = lv_data
    term, ctrl = gs.ODETerm(lv.lotka_volterra), lv.CONTROLLER

    def ratio(record_at, replay_at):
        meshes = jax.vmap(
            lambda y0: gs.record(
                term,
                gs.Tsit5(),
                0.0,
                ts[-1],
                None,
                y0,
                record_at,
                stepsize_controller=ctrl,
            )
        )(y0s)
        sol = gs.replay(meshes.trim(), term, gs.Tsit5(), y0s, replay_at, stale="ignore")
        return float(jnp.max(sol.stats["max_error_ratio"]))

    assert ratio(lv.GUESS, lv_fwd.params) > 1  # the first mesh really is stale there
    assert lv_fwd.stats["stale_meshes"] >= 1
    assert lv_fwd.stats["records"] >= 2
    assert ratio(lv_fwd.params, lv_fwd.params) <= 1


def test_refinement_ends_where_the_optimiser_run_ends(lv_data, lv_fwd, monkeypatch):
    # Without Gauss-Newton refinement the last run is Levenberg-Marquardt from the
    # previous answer on the mesh recorded there: the same minimum, to its tolerances.
    assert lv_fwd.stats["refinement_steps"] > 0
    monkeypatch.setattr(gs._fit, "REFINE_STEPS", 0)
    unrefined = lv.fit_gradsolve(*lv_data, "fwd", meshes="reused")
    assert unrefined.result == optx.RESULTS.successful
    assert unrefined.stats["rounds"] >= 2
    np.testing.assert_allclose(lv_fwd.params, unrefined.params, rtol=1e-7)
    norms = lv_fwd.stats["residual_norm"], unrefined.stats["residual_norm"]
    assert norms[0] <= norms[1] * (1 + 1e-9)


def test_fwd_and_bwd_give_the_same_fit(lv_data, lv_fwd):
    bwd = lv.fit_gradsolve(*lv_data, "bwd")
    assert bwd.result == optx.RESULTS.successful
    np.testing.assert_allclose(bwd.params, lv_fwd.params, rtol=1e-7)


def test_matches_a_fit_with_diffrax_gradients(lv_data, lv_fwd):
    # Diffrax's default (reverse-mode) adjoint, adaptive solves at every iteration.
    params, result, _ = _diffrax_fit(lv_data, "bwd")
    assert result == SUCCESS
    # The optimiser stops at rtol = atol = 1e-8; the two objectives differ by the
    # solver's tolerance (different step sequences), which moves the minimum by less.
    np.testing.assert_allclose(lv_fwd.params, params, rtol=1e-6)


def test_fitzhugh_nagumo_observing_one_component():
    y0s, ts, data = fhn.fitzhugh_nagumo_data(8, seed=1)
    fit = gs.fit(
        gs.ODETerm(fhn.fitzhugh_nagumo),
        gs.Tsit5(),
        fhn.FHN_GUESS,
        y0s,
        ts,
        data,
        observe=fhn.voltage,  # only the voltage is measured
    )
    assert fit.result == optx.RESULTS.successful
    np.testing.assert_allclose(fit.params, fhn.FHN_TRUE, rtol=0.05, atol=0.01)
    # The mesh returned was recorded at the answer: fresh there.
    term = gs.ODETerm(fhn.fitzhugh_nagumo)
    sol = gs.replay(fit.mesh, term, gs.Tsit5(), y0s, fit.params)
    assert float(jnp.max(sol.stats["max_error_ratio"])) <= 1


@pytest.mark.slow
def test_per_trajectory_parameters_and_initial_states(lv_data):
    y0s, ts, data = lv_data
    # The prey growth rate differs per experiment; the other rates are shared; the
    # initial states are fitted too, from a perturbed guess.
    growth = lv.TRUE_PARAMS[0] * (1 + 0.1 * jnp.sin(jnp.arange(N)))

    def field(t, y, p):
        return lv.lotka_volterra(t, y, jnp.concatenate([p["a"][None], p["bcd"]]))

    def simulate(y0, a):
        return diffrax.diffeqsolve(
            diffrax.ODETerm(field),
            diffrax.Dopri8(),
            0.0,
            ts[-1],
            None,
            y0,
            {"a": a, "bcd": lv.TRUE_PARAMS[1:]},
            saveat=diffrax.SaveAt(ts=ts),
            stepsize_controller=diffrax.PIDController(rtol=1e-11, atol=1e-11),
        ).ys

    clean = jax.vmap(simulate)(y0s, growth)
    noisy = clean * (1 + 0.005 * jax.random.normal(jax.random.PRNGKey(2), clean.shape))
    guess = {"a": jnp.full(N, 1.3), "bcd": jnp.array([1.1, 0.9, 2.8])}
    fit = gs.fit(
        gs.ODETerm(field),
        gs.Tsit5(),
        guess,
        y0s * 1.1,
        ts,
        noisy,
        params_axes={"a": 0, "bcd": None},
        fit_y0=True,
    )
    assert fit.result == optx.RESULTS.successful
    params, fitted_y0s = fit.params
    np.testing.assert_allclose(params["a"], growth, rtol=0.03)
    np.testing.assert_allclose(params["bcd"], lv.TRUE_PARAMS[1:], rtol=0.02)
    np.testing.assert_allclose(fitted_y0s, y0s, rtol=0.05)


def test_nan_data_masked_by_zero_weights(lv_data, lv_fwd):
    y0s, ts, data = lv_data
    missing = np.zeros(data.shape, bool)
    missing[::3, 5::7, 0] = True
    weights = jnp.asarray(~missing, float)
    with_nan = jnp.where(missing, jnp.nan, data)
    with_junk = jnp.where(missing, 1e3, data)
    fits = [
        gs.fit(gs.ODETerm(lv.lotka_volterra), gs.Tsit5(), lv.GUESS, y0s, ts, d,
               weights=weights)
        for d in (with_nan, with_junk)
    ]  # fmt: skip
    assert all(f.result == optx.RESULTS.successful for f in fits)
    np.testing.assert_allclose(fits[0].params, fits[1].params, rtol=1e-12)
    np.testing.assert_allclose(fits[0].params, lv.TRUE_PARAMS, rtol=0.02)
    with pytest.raises(ValueError, match="weights .* 0 at those entries"):
        gs.fit(gs.ODETerm(lv.lotka_volterra), gs.Tsit5(), lv.GUESS, y0s, ts, with_nan)
    partly = jnp.where(jnp.asarray(missing[..., :1]), 1.0, weights[..., :1])
    with pytest.raises(ValueError, match="whose weight is not 0"):
        gs.fit(gs.ODETerm(lv.lotka_volterra), gs.Tsit5(), lv.GUESS, y0s, ts, with_nan,
               weights=jnp.broadcast_to(partly, data.shape))  # fmt: skip


@contextlib.contextmanager
def compiled_programs():
    """Collect the names of the programs XLA compiles inside the block (from JAX's
    compilation log)."""
    names = []

    class Collect(logging.Handler):
        def emit(self, record):
            found = re.match(r"Compiling (\S+) with", record.getMessage())
            if found:
                names.append(found.group(1))

    logger = logging.getLogger("jax._src.interpreters.pxla")
    handler = Collect(level=logging.DEBUG)
    logger.addHandler(handler)
    try:
        with jax.log_compiles():
            yield names
    finally:
        logger.removeHandler(handler)


# The compiled programs of gs.fit (record, optimiser run, refinement, replay; the
# one program of the per-evaluation way).
FIT_PROGRAMS = {
    "jit(fit_program)",
    "jit(record_fit)",
    "jit(_round)",
    "jit(gauss_newton_refine)",
    "jit(_assess)",
}


def test_a_second_fit_of_the_same_shape_compiles_nothing(lv_data):
    y0s, ts, data = lv_data

    def fit(guess, y0s, data):
        return gs.fit(gs.ODETerm(lv.lotka_volterra), gs.Tsit5(), guess, y0s, ts, data,
                      stepsize_controller=lv.CONTROLLER,
                      optimiser=lv.OPTIMISER)  # fmt: skip

    first = fit(lv.GUESS, y0s, data)
    new_data = data * (1 + 0.01 * jnp.cos(jnp.arange(data.size).reshape(data.shape)))
    new_guess = lv.GUESS * 1.05
    new_y0s = y0s * 1.1
    jax.block_until_ready((new_data, new_guess, new_y0s))
    with compiled_programs() as names:
        second = fit(new_guess, new_y0s, new_data)
    assert first.result == second.result == optx.RESULTS.successful
    assert names == []


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(data=lambda d: d[:, :-1]), r"data has shape .* need data of shape"),
        (dict(data=lambda d: d[:-1]), r"data has shape .* need data of shape"),
        (dict(y0s=lambda y: y[0, 0]), "one initial state per trajectory"),
        (dict(y0s=lambda y: y[:-1]), r"15 trajectories \(y0s\) .* need data of shape"),
        (dict(ts=lambda t: t[::-1]), "strictly increasing"),
        (dict(params_axes=0), "per-trajectory by params_axes"),
        (dict(weights=-1.0), "non-negative"),
        (dict(jac="rev"), 'jac must be "fwd" or "bwd"'),
        (dict(max_rounds=1), "max_rounds must be at least 2"),
        (dict(y0s=lambda y: y[:0], data=lambda d: d[:0]), "no trajectories"),
        (dict(weights=0.0), "weights are all zero"),
        (dict(params0=lambda p: p.at[1].set(jnp.nan)), r"params0 holds NaN or inf"),
        (dict(params0=lambda p: p.at[0].set(jnp.inf)), r"params0 holds NaN or inf"),
        (dict(ts=lambda t: t.at[3].set(jnp.nan)), r"ts holds NaN or inf at positions"),
        (dict(ts=lambda t: t.at[-1].set(jnp.inf)), r"ts holds NaN or inf at positions"),
        (dict(t0=jnp.nan), "initial time must be a finite number"),
        (dict(dt0=jnp.nan), "initial step must be a positive finite number"),
        (dict(dt0=0.0), "initial step must be a positive finite number"),
        (dict(max_steps=0), "max_steps=0: it must be a positive integer"),
        (dict(max_steps=2.5), "max_steps=2.5: it must be a positive integer"),
    ],
)
def test_bad_input_gets_a_clear_error(lv_data, change, match):
    y0s, ts, data = lv_data
    kwargs = dict(y0s=y0s, ts=ts, data=data, params0=lv.GUESS)
    change = dict(change)
    for key in ("y0s", "ts", "data", "params0"):
        if key in change:
            kwargs[key] = change.pop(key)(kwargs[key])
    with compiled_programs() as names, pytest.raises(ValueError, match=match):
        gs.fit(
            gs.ODETerm(lv.lotka_volterra),
            gs.Tsit5(),
            kwargs["params0"],
            kwargs["y0s"],
            kwargs["ts"],
            kwargs["data"],
            **change,
        )
    # Raised on the host, before any of the fit's programs is compiled.
    assert not FIT_PROGRAMS & set(names)


def test_observables_shape_is_kept_per_input_shapes_and_still_checked(lv_data):
    # The shape of `observe`'s output is kept per function and input shapes: a
    # refit on new data of that shape does not trace it again, data of another
    # shape is still an error, and another state shape is checked on its own.
    from gradsolve._fit_problem import make_problem

    traces = []

    def every_other(y, p):
        traces.append(None)
        return y[::2]  # the prey alone for Lotka-Volterra's two populations

    y0s, ts, data = lv_data

    def problem(data, y0s=y0s):
        return make_problem(gs.ODETerm(lv.lotka_volterra), gs.Tsit5(), lv.GUESS, y0s,
                            ts, data, observe=every_other, weights=None, t0=0.0,
                            params_axes=None, fit_y0=False)  # fmt: skip

    problem(data[..., :1])
    problem(2 * data[..., :1])
    assert len(traces) == 1
    with pytest.raises(ValueError, match=r"data has shape .* need data of shape"):
        problem(data)
    # Another state shape is another trace, with its own check.
    want = rf"need data of shape \({N}, {len(ts)}, 2\)"
    with pytest.raises(ValueError, match=want):
        problem(data[..., :1, :1], y0s=jnp.concatenate([y0s, y0s], axis=1))
    assert len(traces) == 2


def test_diverging_fit_returns_a_result_code():
    # y' = p y^2 from y(0) = 1 blows up at t = 1/p: no solution reaches t = 2.
    def blow_up(t, y, p):
        return p * y**2

    ts = jnp.linspace(0.1, 2.0, 5)
    fit = gs.fit(
        gs.ODETerm(blow_up),
        gs.Tsit5(),
        jnp.array(1.0),
        jnp.ones((3, 1)),
        ts,
        jnp.ones((3, 5, 1)),
        max_steps=64,
    )
    assert fit.result == optx.RESULTS.nonlinear_divergence
    assert fit.mesh is None
    assert "diverged" in optx.RESULTS[fit.result]


def test_jacobian_blocks_match_autodiff_of_the_ensemble():
    # The block-assembled Jacobian (both block modes, seen through jax.jacfwd and
    # jax.jacrev) against JAX differentiating the plain vmapped residuals.
    from gradsolve._fit_jacobian import block_mode, ensemble_residuals

    def fn(p, x):
        return jnp.sin(p["s"][0] * x) * p["t"][0] + p["s"][1] * p["t"][1] ** 2 * x**2

    key_x, key_s, key_t = jax.random.split(jax.random.PRNGKey(3), 3)
    x = jax.random.normal(key_x, (5, 3))  # 5 trajectories, 3 residuals each
    params = {
        "s": jax.random.normal(key_s, (2,)),  # shared
        "t": jax.random.normal(key_t, (5, 2)),  # per trajectory
    }
    in_axes = {"s": None, "t": 0}
    plain = jax.vmap(fn, in_axes=(in_axes, 0))
    expected = jax.jacfwd(plain)(params, x)
    for mode in ("fwd", "bwd"):
        f = lambda p: ensemble_residuals(
            p, fn=fn, in_axes=in_axes, inputs=(x,), mode=mode
        )
        for jacobian in (jax.jacfwd, jax.jacrev):
            got = jacobian(f)(params)
            jax.tree.map(np.testing.assert_allclose, got, expected)
    assert block_mode(3, params, in_axes) == "bwd"  # 4 entries > 3 residuals
    assert block_mode(4, params, in_axes) == "fwd"


def test_jacobian_blocks_with_axes_for_whole_subtrees():
    # `in_axes` a prefix of the parameters, as gs.fit passes it when it fits initial
    # states: shared parameters (a dict) and per-trajectory states (an array).
    from gradsolve._fit_jacobian import ensemble_residuals

    def fn(p, x):
        theta, y0 = p
        return jnp.cos(theta["a"] * x) * y0[0] + theta["b"] * y0[1] * x

    key_x, key_y = jax.random.split(jax.random.PRNGKey(4))
    x = jax.random.normal(key_x, (4, 6))
    params = (
        {"a": jnp.array(0.7), "b": jnp.array(-1.3)},
        jax.random.normal(key_y, (4, 2)),
    )
    in_axes = (None, 0)
    expected = jax.jacfwd(jax.vmap(fn, in_axes=(in_axes, 0)))(params, x)
    for mode in ("fwd", "bwd"):
        f = lambda p: ensemble_residuals(
            p, fn=fn, in_axes=in_axes, inputs=(x,), mode=mode
        )
        got = jax.jacfwd(f)(params)
        jax.tree.map(np.testing.assert_allclose, got, expected)


def test_optimistix_materialises_the_jacobian_in_fewer_passes(lv_data):
    # Assembled from blocks, the Jacobian is the same either way: Optimistix gets
    # the direction with fewer passes, tangents per entry of the fit variable or
    # cotangents per residual, whatever `jac` says.
    from gradsolve._fit_problem import make_problem

    y0s, ts, data = lv_data
    kwargs = dict(observe=None, weights=None, t0=0.0, sharding=None)
    problem, params = make_problem(
        gs.ODETerm(lv.lotka_volterra), gs.Tsit5(), lv.GUESS, y0s, ts, data,
        params_axes=None, fit_y0=False, **kwargs,
    )  # fmt: skip
    assert problem.materialise_mode(params) == "fwd"  # 4 entries, 2 * 20 * N
    # One observation of the prey per experiment, the initial states fitted too:
    # 4 + 2 N entries against N residuals.
    first = lambda y, p: y[:1]
    problem, params = make_problem(
        gs.ODETerm(lv.lotka_volterra), gs.Tsit5(), lv.GUESS, y0s, ts[-1:],
        data[:, -1:, :1], params_axes=None, fit_y0=True, **dict(kwargs, observe=first),
    )  # fmt: skip
    assert problem.materialise_mode(params) == "bwd"


def test_minimiser_with_reverse_mode_gradient(lv_data, lv_fwd):
    # A minimiser with jac="bwd" differentiates the sum of squares in one reverse
    # pass (no Jacobian blocks): the same minimum as the least-squares fit.
    fit = gs.fit(
        gs.ODETerm(lv.lotka_volterra),
        gs.Tsit5(),
        lv.GUESS,
        *lv_data,
        optimiser=optx.BFGS(rtol=1e-10, atol=1e-10),
        jac="bwd",
    )
    assert fit.result == optx.RESULTS.successful
    np.testing.assert_allclose(fit.params, lv_fwd.params, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.bitwise
def test_minimiser_with_meshes_recorded_per_evaluation(lv_data, lv_fwd):
    # BFGS with forward-mode gradients (one compiled program): the mesh returned
    # is the one recorded at the answer, and so is the residual norm.
    fit = gs.fit(gs.ODETerm(lv.lotka_volterra), gs.Tsit5(), lv.GUESS, *lv_data,
                 stepsize_controller=lv.CONTROLLER, jac="fwd", meshes="per_evaluation",
                 optimiser=optx.BFGS(rtol=1e-10, atol=1e-10))  # fmt: skip
    assert fit.result == optx.RESULTS.successful
    np.testing.assert_allclose(fit.params, lv_fwd.params, rtol=1e-5)
    term, (y0s, ts, data) = gs.ODETerm(lv.lotka_volterra), lv_data
    record = lambda y0: gs.record(term, gs.Tsit5(), 0.0, ts[-1], None, y0, fit.params,
                                  stepsize_controller=lv.CONTROLLER)  # fmt: skip
    fresh = jax.vmap(record)(y0s).trim()
    np.testing.assert_array_equal(fit.mesh.ts, fresh.ts)
    save = diffrax.SaveAt(ts=ts)
    ys = gs.replay(fresh, term, gs.Tsit5(), y0s, fit.params, saveat=save).ys
    norm = jnp.linalg.norm(ys - data)
    np.testing.assert_allclose(fit.stats["residual_norm"], norm, rtol=1e-12)


def _per_evaluation_fit(y0s, ts, data, **kwargs):
    return gs.fit(gs.ODETerm(lv.lotka_volterra), gs.Tsit5(), lv.GUESS, y0s, ts, data,
                  stepsize_controller=lv.CONTROLLER, optimiser=lv.OPTIMISER,
                  meshes="per_evaluation", **kwargs)  # fmt: skip


@pytest.mark.parametrize("jac", ["fwd", "bwd"])
def test_per_evaluation_meshes_follow_the_diffrax_fit(lv_data, jac):
    # A mesh recorded at every evaluation: the residuals are the adaptive solve's
    # and their derivative Diffrax's, so the optimiser takes the same steps until
    # the loss reaches its round-off floor and ends at the same parameters. How
    # long it wanders on that floor is round-off's choice: 12 iterations here
    # against Diffrax's 31 with XLA's default code generation, 32 against 31 with
    # the fusion emitters off (as `conftest.py` compiles the tests; its residual
    # norm the same to 2e-14 either way), so the count is compared with XLA's
    # defaults only (as users compile: `GRADSOLVE_TEST_XLA_DEFAULTS=1`).
    fit = _per_evaluation_fit(*lv_data, jac=jac)
    params, result, iterations = _diffrax_fit(lv_data, jac)
    assert fit.result == optx.RESULTS.successful and result == SUCCESS
    if compiled_as_users_compile():
        assert fit.stats["iterations"] <= iterations
    np.testing.assert_allclose(fit.params, params, rtol=lv.OPTIMISER.rtol)
    assert fit.mesh is not None and fit.stats["residual_norm"] > 0
    # One recording per evaluation (the short first buffer needs no sizing).
    assert fit.stats["records"] == fit.stats["iterations"]


def _fit_noting_buffers(lv_data, monkeypatch, **settings):
    """A per-evaluation fit with `gradsolve._fit_program`'s `settings`, and the
    buffer length of each run of its compiled program."""
    import gradsolve._fit_program as program

    for name, value in dict(settings, _LENGTHS={}).items():
        monkeypatch.setattr(program, name, value)
    runs = []
    original = program.fit_program
    monkeypatch.setattr(
        program, "fit_program", lambda *a: runs.append(a[6]) or original(*a)
    )
    return _per_evaluation_fit(*lv_data), runs


def test_per_evaluation_buffer_too_short_runs_again(lv_data, monkeypatch):
    # A buffer no longer than the initial guess's meshes: the optimiser's path
    # needs more steps somewhere, and the fit runs again with a longer one rather
    # than stop where the buffer ends.
    reference = _per_evaluation_fit(*lv_data)
    # Sized at the initial guess, without head room.
    fit, runs = _fit_noting_buffers(
        lv_data, monkeypatch, HEADROOM=1.0, UNSIZED_ENTRIES=0
    )
    assert len(runs) >= 2 and runs[1] > runs[0]
    assert fit.result == optx.RESULTS.successful
    np.testing.assert_allclose(fit.params, reference.params, rtol=1e-10)


def test_per_evaluation_short_unsized_buffer_is_sized_and_run_again(
    lv_data, monkeypatch
):
    # The first run's buffer, not sized by a recording, is too short for the
    # solves: the fit records at the initial guess, sizes the buffer on it and runs
    # again, to the answer of a fit whose buffer was long enough.
    reference = _per_evaluation_fit(*lv_data)
    fit, runs = _fit_noting_buffers(lv_data, monkeypatch, UNSIZED_BUFFER=8)
    assert runs[0] == 8 and len(runs) == 2 and runs[1] > 8
    assert fit.result == optx.RESULTS.successful
    # The recording that sized the buffer is counted.
    assert fit.stats["records"] == fit.stats["iterations"] + 1
    np.testing.assert_allclose(fit.params, reference.params, rtol=1e-10)


def test_per_evaluation_second_fit_of_the_same_shape_compiles_nothing(lv_data):
    y0s, ts, data = lv_data
    _per_evaluation_fit(y0s, ts, data)
    new_data = data * (1 + 0.01 * jnp.cos(jnp.arange(data.size).reshape(data.shape)))
    new_y0s = y0s * 1.1
    jax.block_until_ready((new_data, new_y0s))
    with compiled_programs() as names:
        fit = _per_evaluation_fit(new_y0s, ts, new_data)
    assert fit.result == optx.RESULTS.successful
    assert names == []


def test_a_fit_program_traces_its_replay_once(monkeypatch):
    # The residuals and their Jacobian blocks replay the same trajectories. JAX
    # traces the blocks (a custom derivative's rule) under another abstract-mesh
    # context than the residuals, which alone would trace the replay a second time.
    import gradsolve._replay as replay_module

    traces = []
    steps = replay_module.mesh_steps

    def counted(mesh):
        traces.append(mesh)
        return steps(mesh)

    monkeypatch.setattr(replay_module, "mesh_steps", counted)
    term = gs.ODETerm(lambda t, y, k: -k * y)
    ts = jnp.array([0.5, 1.0, 2.0])
    y0s = jnp.array([[1.0], [2.0]])
    data = y0s[:, None, :] * jnp.exp(-0.7 * ts)[None, :, None]
    ctrl = gs.PIDController(rtol=1e-8, atol=1e-8)
    fit = gs.fit(term, gs.Tsit5(), jnp.asarray(0.5), y0s, ts, data, jac="fwd",
                 stepsize_controller=ctrl, meshes="per_evaluation")  # fmt: skip
    assert fit.result == optx.RESULTS.successful
    np.testing.assert_allclose(fit.params, 0.7, rtol=1e-6)
    assert len(traces) == 1


def test_max_steps_holds_after_an_earlier_fit_of_the_same_shape(monkeypatch):
    # A later fit of the same structure reuses an earlier fit's buffer length
    # (no new compilation), but never one longer than its own `max_steps`: a fit
    # whose solves need more steps fails as it does in a fresh process.
    term = gs.ODETerm(lambda t, y, k: -k * y)
    ts = jnp.array([0.5, 1.0, 2.0])
    y0s = jnp.array([[1.0], [2.0]])
    data = y0s[:, None, :] * jnp.exp(-0.7 * ts)[None, :, None]
    ctrl = gs.PIDController(rtol=1e-8, atol=1e-8)

    def fit(**kwargs):
        return gs.fit(term, gs.Tsit5(), jnp.asarray(0.5), y0s, ts, data,
                      stepsize_controller=ctrl, **kwargs)  # fmt: skip

    first = fit()
    assert first.result == optx.RESULTS.successful
    assert first.stats["mesh_steps"] > 4
    short = fit(max_steps=4)
    assert short.result != optx.RESULTS.successful
    monkeypatch.setattr("gradsolve._fit_program._LENGTHS", {})
    fresh = fit(max_steps=4)
    assert short.result == fresh.result
    np.testing.assert_array_equal(short.params, fresh.params)
