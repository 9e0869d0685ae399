"""How a state is held while stepping (`representation=` of the solvers): the
automatic choice, and both forced forms agreeing with Diffrax and with each other.

A Lorenz field is a few scalar operations per state element: held as components.
A small MLP field is matrix products: unrolled into scalars it would be hundreds of
operations per evaluation, so it is held as arrays."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import pytest

import gradsolve as gs
from gradsolve._components import Layout, operation_budget
from gradsolve._problem import LeafProblem
from gradsolve._representation import (
    COMPONENT_OPS_FLOOR,
    COMPONENT_OPS_RATIO,
    Representation,
    array_field_jaxpr,
    choose_layout,
    component_field_jaxpr,
    count_operations,
)
from gradsolve._solver.base import LoopedStages

from .helpers import PROBLEMS, max_relative_error
from .references import StoredReferences


REFERENCES = StoredReferences(__file__)
LORENZ = PROBLEMS["lorenz"]
MLP = eqx.nn.MLP(2, 2, 8, 1, activation=jnp.tanh, key=jax.random.key(0))
# Forced onto components, a matrix-product field compiles slowly (the reason auto
# keeps it as arrays): the forced forms are compared on a narrower one.
NARROW_MLP = eqx.nn.MLP(2, 2, 4, 1, activation=jnp.tanh, key=jax.random.key(1))
CTRL = gs.PIDController(rtol=1e-8, atol=1e-8)


def mlp_field(t, y, model):
    return model(y)


def _layout(f, y0, args, representation="auto"):
    leaves, treedef = jtu.tree_flatten(y0)
    problem = LeafProblem(f=f, args=args, treedef=treedef)
    return choose_layout(leaves, problem, representation)


def test_auto_holds_a_small_scalar_field_as_components():
    assert _layout(LORENZ.f, LORENZ.y0, LORENZ.args) is not None


def test_auto_holds_a_matrix_product_field_as_arrays():
    assert _layout(mlp_field, jnp.array([0.5, -0.2]), MLP) is None


def test_auto_holds_a_field_with_control_flow_as_arrays():
    # Interpolated forcing (searchsorted is a scan): not straight-line arithmetic.
    grid = jnp.linspace(0.0, 1.0, 50)

    def forced(t, y, args):
        return -y + jnp.interp(t, grid, jnp.sin(grid))

    assert _layout(forced, jnp.array([1.0, 0.5]), None) is None


def test_auto_decides_alike_under_jit_and_vmap():
    # The recording and its replay run in different contexts: the choice must not
    # depend on whether args are constants or tracers.
    eager = _layout(LORENZ.f, LORENZ.y0, LORENZ.args) is not None

    @jax.jit
    def traced(args):
        return jnp.asarray(_layout(LORENZ.f, LORENZ.y0, args) is not None)

    batched = jax.vmap(traced)(jnp.stack([LORENZ.args] * 2))
    assert eager and bool(traced(LORENZ.args)) and bool(batched.all())


@pytest.mark.parametrize("width,depth", [(2, 1), (4, 1), (8, 1), (32, 2)])
def test_auto_stops_unrolling_past_the_limit_and_decides_as_a_full_count(width, depth):
    # The trace on components stops at the limit (an MLP with a 32-wide layer is
    # 800 operations unrolled); the decision is the one a full count gives.
    model = eqx.nn.MLP(2, 2, width, depth, activation=jnp.tanh, key=jax.random.key(2))
    y0 = jnp.array([0.5, -0.2])
    problem = LeafProblem(f=mlp_field, args=model, treedef=jtu.tree_structure(y0))
    on_arrays = array_field_jaxpr(problem, [y0.shape], [y0.dtype], y0.dtype)
    limit = max(COMPONENT_OPS_FLOOR, COMPONENT_OPS_RATIO * count_operations(on_arrays))
    layout = Layout.of([y0])
    full = count_operations(component_field_jaxpr(problem, layout, y0.dtype))
    assert (_layout(mlp_field, y0, model) is not None) == (full <= limit)
    with operation_budget(limit) as exceeded:
        budgeted = count_operations(component_field_jaxpr(problem, layout, y0.dtype))
    # Counted operations are equations of the full trace: past the budget, the
    # field is past the limit.
    assert not exceeded() or full > limit
    if width == 32:
        assert exceeded() and budgeted < full / 2


def test_forced_representations_override_auto():
    assert _layout(mlp_field, jnp.array([0.5, -0.2]), MLP, "components") is not None
    assert _layout(LORENZ.f, LORENZ.y0, LORENZ.args, "array") is None


def test_bad_representation_is_a_clear_error():
    with pytest.raises(ValueError, match="representation='auto'"):
        _layout(LORENZ.f, LORENZ.y0, LORENZ.args, "matrix")


def _diffrax_grad(f, y0, args, t1):
    saveat = diffrax.SaveAt(ts=jnp.linspace(0.1, t1, 4))

    def loss(args):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(f), diffrax.Tsit5(), 0.0, t1, None, y0, args,
            stepsize_controller=CTRL, saveat=saveat,
        )  # fmt: skip
        return jnp.sum(sol.ys**2), sol.ys

    grad, ys = eqx.filter_jit(eqx.filter_grad(loss, has_aux=True))(args)
    # Stored as the gradient's array leaves (a model cannot be stored).
    return _array_leaves(grad), ys


def _array_leaves(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


CASES = {
    "lorenz": (LORENZ.f, LORENZ.y0, LORENZ.args, 0.5),
    "mlp": (mlp_field, jnp.array([0.5, -0.2]), NARROW_MLP, 2.0),
}


@pytest.mark.parametrize(
    "case,representation",
    [
        # Forced against the automatic choice; the automatic forms themselves (as
        # every other test runs them) are long tests here.
        ("mlp", "components"),
        ("lorenz", "array"),
        pytest.param("lorenz", "components", marks=pytest.mark.slow),
        pytest.param("mlp", "array", marks=pytest.mark.slow),
    ],
)
def test_forced_representation_matches_diffrax(case, representation, request):
    f, y0, args, t1 = CASES[case]
    solver = gs.Tsit5(representation=representation)
    saveat = gs.SaveAt(ts=jnp.linspace(0.1, t1, 4))
    grad_ref, ys_ref = REFERENCES(
        f"forced-{request.node.callspec.id}", lambda: _diffrax_grad(f, y0, args, t1)
    )

    def loss(args):
        sol = gs.diffeqsolve(
            gs.ODETerm(f), solver, 0.0, t1, None, y0, args, stepsize_controller=CTRL,
            saveat=saveat,
        )  # fmt: skip
        return jnp.sum(sol.ys**2), sol.ys

    grad, ys = eqx.filter_jit(eqx.filter_grad(loss, has_aux=True))(args)
    assert max_relative_error(ys, ys_ref) < 1e-12
    grad = _array_leaves(grad)
    assert len(grad) == len(grad_ref)
    assert max_relative_error(grad, grad_ref) < 1e-9

    # A mesh recorded in one form replays in the other: same values, and fresh.
    other = "array" if representation == "components" else "components"
    mesh = gs.record(
        gs.ODETerm(f), solver, 0.0, t1, None, y0, args, stepsize_controller=CTRL
    )
    sol = gs.replay(
        mesh, gs.ODETerm(f), gs.Tsit5(representation=other), y0, args, saveat=saveat
    )
    assert max_relative_error(sol.ys, ys_ref) < 1e-12
    assert sol.stats["max_error_ratio"] <= 1.0


def diffusion_chain(t, y, rates):
    # Neighbours coupled through slices and a concatenation (a discretised
    # diffusion with a quadratic sink): held in array form past 32 states.
    inner = y[2:] - 2 * y[1:-1] + y[:-2]
    laplacian = jnp.concatenate([y[1:2] - y[:1], inner, y[-2:-1] - y[-1:]])
    return rates[0] * laplacian - rates[1] * y * y


CHAIN_Y0 = jnp.linspace(0.1, 1.0, 40)
CHAIN_RATES = jnp.array([0.5, 0.3])


def _representation(f, y0, args, representation="auto"):
    leaves, treedef = jtu.tree_flatten(y0)
    problem = LeafProblem(f=f, args=args, treedef=treedef)
    return Representation(leaves, problem, representation)


def test_array_form_loops_the_stages_of_a_slicing_field_only():
    chain = _representation(diffusion_chain, CHAIN_Y0, CHAIN_RATES)
    assert chain.layout is None and chain.stage_loop
    # Matrix products: the stages stay unrolled, slicing or not.
    mlp = _representation(mlp_field, jnp.array([0.5, -0.2]), MLP)
    assert mlp.layout is None and not mlp.stage_loop
    sliced_mlp = _representation(
        lambda t, y, model: jnp.concatenate([model(y[:2]), -y[2:]]),
        jnp.array([0.5, -0.2, 1.0]),
        MLP,
    )
    assert sliced_mlp.layout is None and not sliced_mlp.stage_loop
    # On components there are no stages to loop over as arrays.
    lorenz = _representation(LORENZ.f, LORENZ.y0, LORENZ.args)
    assert lorenz.layout is not None and not lorenz.stage_loop


@pytest.mark.parametrize("first_stage_known", [False, True])
def test_looped_and_unrolled_stages_agree(first_stage_known):
    problem = LeafProblem(
        f=diffusion_chain, args=CHAIN_RATES, treedef=jtu.tree_structure(CHAIN_Y0)
    )
    y0 = [CHAIN_Y0]
    f0 = problem.vf(0.3, y0) if first_stage_known else None
    step = jax.jit(
        lambda looped: gs.Tsit5().step_leaves(
            LoopedStages(problem.vf) if looped else problem.vf, 0.3, 0.55, -1, y0, f0
        ),
        static_argnums=0,
    )
    (y1, error, ks, f1), looped = step(False), step(True)
    assert jax.tree.structure((y1, error, ks, f1)) == jax.tree.structure(looped)
    assert max_relative_error(looped[0], y1) < 1e-14
    assert max_relative_error(looped[2:], (ks, f1)) < 1e-14
    # The error estimate is a difference of increments: round-off on their scale.
    scale = max(float(jnp.max(jnp.abs(k[0]))) for k in ks)
    assert float(jnp.max(jnp.abs(looped[1][0] - error[0]))) < 1e-14 * scale


def test_looped_stages_match_diffrax_and_replay_fresh():
    # The chain's gradient with respect to its rates, one-call and over a
    # recorded mesh, against Diffrax's.
    t1 = 2.0
    grad_ref, ys_ref = REFERENCES(
        "looped-stages-chain",
        lambda: _diffrax_grad(diffusion_chain, CHAIN_Y0, CHAIN_RATES, t1),
    )
    saveat = gs.SaveAt(ts=jnp.linspace(0.1, t1, 4))
    term = gs.ODETerm(diffusion_chain)

    def one_call(rates):
        sol = gs.diffeqsolve(
            term, gs.Tsit5(), 0.0, t1, None, CHAIN_Y0, rates, stepsize_controller=CTRL,
            saveat=saveat,
        )  # fmt: skip
        return jnp.sum(sol.ys**2), sol.ys

    mesh = gs.record(
        term, gs.Tsit5(), 0.0, t1, None, CHAIN_Y0, CHAIN_RATES,
        stepsize_controller=CTRL,
    )  # fmt: skip

    def over_mesh(rates):
        sol = gs.replay(mesh, term, gs.Tsit5(), CHAIN_Y0, rates, saveat=saveat)
        return jnp.sum(sol.ys**2), (sol.ys, sol.stats["max_error_ratio"])

    grad, ys = jax.jit(jax.grad(one_call, has_aux=True))(CHAIN_RATES)
    assert max_relative_error(ys, ys_ref) < 1e-12
    assert max_relative_error([grad], grad_ref) < 1e-9
    grad, (ys, ratio) = jax.jit(jax.grad(over_mesh, has_aux=True))(CHAIN_RATES)
    assert max_relative_error(ys, ys_ref) < 1e-12
    assert max_relative_error([grad], grad_ref) < 1e-9
    assert ratio <= 1.0
