"""A state too large to be held as components whose field reads it element by
element, as kinetics models are written (`y[i]` by `y[i]`, the rates stacked): held
as arrays, its field evaluated on the state's elements (`ElementField`)."""

import diffrax
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import pytest

import gradsolve as gs
from gradsolve import _representation
from gradsolve._component_field import ElementField
from gradsolve._components import Layout
from gradsolve._problem import LeafProblem
from gradsolve._representation import Representation

from .helpers import max_relative_error
from .references import StoredReferences


REFERENCES = StoredReferences(__file__)
SPECIES = 34
Y0 = jnp.linspace(0.2, 1.2, SPECIES)
RATES = jnp.linspace(0.5, 1.5, SPECIES)
CTRL = gs.PIDController(rtol=1e-8, atol=1e-8)


def network(t, y, k):
    # Species i is made from species i - 1 and exchanges with species i + 5.
    n = y.shape[0]
    rates = []
    for i in range(n):
        made = k[i - 1] * y[i - 1] * y[i - 1] if i else 0.0
        rates.append(made - k[i] * y[i] * y[i] + 0.05 * (y[(i + 5) % n] - y[i]))
    return jnp.stack(rates)


def mixed(t, y, args):
    # Three leaves, one of them 2-D, one of them empty; element reads of the
    # state and of `args`, a matrix product (too large to unroll) and a
    # reduction over the state.
    w, k = args
    a, b = y["a"], y["b"]
    n = a.shape[0]
    rates = [k[i] * a[i] - a[(i + 1) % n] * b[i % 2, i % 3] for i in range(n)]
    a_rates = jnp.stack(rates) + 0.1 * jnp.tanh(w @ a)
    return {"a": a_rates, "b": -b * jnp.sum(a) * t, "empty": -0.8 * y["empty"]}


def _representation_of(f, y0, args, representation="auto"):
    leaves, treedef = jtu.tree_flatten(y0)
    return Representation(leaves, LeafProblem(f, args, treedef), representation)


def test_a_large_field_written_element_by_element_reads_elements():
    network_rep = _representation_of(network, Y0, RATES)
    assert network_rep.layout is None and network_rep.elements is not None
    assert _representation_of(network, Y0, RATES, "array").elements is None
    # At most 32 elements the state is held as components.
    small = _representation_of(network, Y0[:30], RATES[:30])
    assert small.layout is not None and small.elements is None

    # Fields on the whole state take many times more operations on elements.
    def slices(t, y, k):
        return k[0] * jnp.concatenate([y[1:] - y[:-1], y[:1]]) - y * y

    def elementwise(t, y, k):
        return -k * y + jnp.sin(y)

    def matrix(t, y, w):
        return w @ y - y * y

    def decay(t, y, k):
        # One operation on arrays, 34 on elements: below the components' floor
        # of 64, which large states do not get.
        return jtu.tree_map(lambda x: -0.5 * x, y)

    w = jnp.ones((SPECIES, SPECIES)) / SPECIES
    cases = [(slices, RATES), (elementwise, RATES), (matrix, w), (decay, None)]
    for field, args in cases:
        rep = _representation_of(field, Y0, args)
        assert rep.layout is None and rep.elements is None
    # So with an empty leaf beside the state (nothing to stack back).
    rep = _representation_of(decay, (Y0, jnp.zeros((2, 0))), None)
    assert rep.layout is None and rep.elements is None


def test_solvers_say_where_they_read_elements():
    # Explicit solvers wherever "auto"; Rosenbrock solvers in differentiated
    # steps only (their forward step is a forward-mode pass, cheaper on arrays).
    for differentiated in (False, True):
        assert gs.Tsit5().reads_elements(differentiated)
        assert not gs.Tsit5(representation="array").reads_elements(differentiated)
        assert gs.Rodas5().reads_elements(differentiated) == differentiated


def test_elements_only_up_to_the_limit(monkeypatch):
    monkeypatch.setattr(_representation, "MAX_ELEMENT_FIELD", SPECIES - 1)
    assert _representation_of(network, Y0, RATES).elements is None


def test_element_field_equals_the_field_on_arrays():
    y0 = {"a": Y0, "b": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)}
    y0["empty"] = jnp.zeros((2, 0))
    w = jnp.cos(jnp.arange(SPECIES**2, dtype=float)).reshape(SPECIES, SPECIES)
    args = (w, RATES)
    leaves, treedef = jtu.tree_flatten(y0)
    problem = LeafProblem(mixed, args, treedef)
    rep = Representation(leaves, problem)
    assert rep.elements is not None

    def on_elements(t, leaves, args):
        return ElementField(mixed, args, treedef, Layout.of(leaves))(t, leaves)

    def on_arrays(t, leaves, args):
        return LeafProblem(mixed, args, treedef).vf(t, leaves)

    out, vjp = jax.vjp(on_arrays, 0.7, leaves, args)
    out_e, vjp_e = jax.vjp(on_elements, 0.7, leaves, args)
    assert max_relative_error(out_e, out) < 1e-14
    cotangent = [jnp.sin(3.0 * x + 1.0) for x in out]
    assert max_relative_error(vjp_e(cotangent), vjp(cotangent)) < 1e-13
    # Under vmap, as the solvers evaluate it.
    batch = [jnp.stack([x, 2 * x]) for x in leaves]
    assert max_relative_error(
        jax.vmap(on_elements, (None, 0, None))(0.7, batch, args),
        jax.vmap(on_arrays, (None, 0, None))(0.7, batch, args),
    ) < 1e-14  # fmt: skip


def _diffrax_ensemble(y0s, k, saveat):
    def loss(k):
        def one(y0):
            sol = diffrax.diffeqsolve(
                diffrax.ODETerm(network), diffrax.Tsit5(), 0.0, 2.0, None, y0, k,
                stepsize_controller=diffrax.PIDController(rtol=1e-8, atol=1e-8),
                saveat=saveat,
            )  # fmt: skip
            return sol.ys

        ys = jax.vmap(one)(y0s)
        return jnp.sum(ys**2), ys

    return jax.jit(jax.grad(loss, has_aux=True))(k)


def test_element_field_gradient_matches_diffrax_and_replays_fresh():
    y0s = Y0 * jnp.array([[1.0], [0.8], [1.3]])
    ts = jnp.linspace(0.3, 2.0, 4)
    grad_ref, ys_ref = REFERENCES(
        "network-ensemble",
        lambda: _diffrax_ensemble(y0s, RATES, diffrax.SaveAt(ts=ts)),
    )
    term, saveat = gs.ODETerm(network), gs.SaveAt(ts=ts)

    def one_call(k):
        def one(y0):
            sol = gs.diffeqsolve(
                term, gs.Tsit5(), 0.0, 2.0, None, y0, k, stepsize_controller=CTRL,
                saveat=saveat,
            )  # fmt: skip
            return sol.ys

        ys = jax.vmap(one)(y0s)
        return jnp.sum(ys**2), ys

    grad, ys = jax.jit(jax.grad(one_call, has_aux=True))(RATES)
    assert max_relative_error(ys, ys_ref) < 1e-12
    assert max_relative_error(grad, grad_ref) < 1e-9

    mesh = gs.record_ensemble(
        term, gs.Tsit5(), 0.0, 2.0, None, y0s, RATES, stepsize_controller=CTRL
    ).trim()

    def over_mesh(k):
        sol = gs.replay(mesh, term, gs.Tsit5(), y0s, k, saveat=saveat)
        return jnp.sum(sol.ys**2), (sol.ys, sol.stats["max_error_ratio"])

    grad, (ys, ratio) = jax.jit(jax.grad(over_mesh, has_aux=True))(RATES)
    assert max_relative_error(ys, ys_ref) < 1e-12
    assert max_relative_error(grad, grad_ref) < 1e-9
    assert jnp.all(ratio <= 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("solver", [gs.Dopri5(), gs.Tsit5()])
def test_element_field_forward_and_reverse_agree(solver):
    # jacfwd and jacrev of a replay walk the element field both ways.
    mesh = gs.record(gs.ODETerm(network), solver, 0.0, 1.0, None, Y0, RATES,
                     stepsize_controller=CTRL)  # fmt: skip

    def final(k):
        return gs.replay(mesh, gs.ODETerm(network), solver, Y0, k).ys[-1, :4]

    forward, reverse = jax.jacfwd(final)(RATES), jax.jacrev(final)(RATES)
    assert max_relative_error(forward, reverse) < 1e-12


@pytest.mark.bitwise
def test_rosenbrock_step_on_elements_equals_it_on_arrays():
    # A Rodas5 step linearises the field (a forward-mode pass over it) and
    # differentiates through that: on elements as on arrays, to round-off.
    y0, k = Y0[:4], RATES[:4]
    treedef = jtu.tree_structure(y0)

    def step(y0, k, on_elements):
        vf = LeafProblem(network, k, treedef).vf
        if on_elements:
            vf = ElementField(network, k, treedef, Layout.of([y0]))
        y1, error, _, _ = gs.Rodas5().step_leaves(vf, 0.1, 0.4, 1, [y0], None)
        return y1, error

    def pullback(y0, k, on_elements):
        out, vjp = jax.vjp(lambda y0, k: step(y0, k, on_elements), y0, k)
        return out, vjp(jax.tree.map(jnp.cos, out))

    arrays = jax.jit(pullback, static_argnums=2)(y0, k, False)
    elements = jax.jit(pullback, static_argnums=2)(y0, k, True)
    assert max_relative_error(elements, arrays) < 1e-13


@pytest.mark.slow
def test_rosenbrock_walks_back_on_elements():
    # Rodas5 records on arrays and walks back on elements: the one-call gradient
    # against forward mode over a replay of its mesh.
    ts = jnp.linspace(0.5, 2.0, 3)
    term, solver, saveat = gs.ODETerm(network), gs.Rodas5(), gs.SaveAt(ts=ts)
    ctrl = gs.PIDController(rtol=1e-7, atol=1e-9)

    def one_call(k):
        sol = gs.diffeqsolve(term, solver, 0.0, 2.0, None, Y0, k,
                             stepsize_controller=ctrl, saveat=saveat)  # fmt: skip
        return jnp.sum(sol.ys**2)

    mesh = gs.record(term, solver, 0.0, 2.0, None, Y0, RATES, stepsize_controller=ctrl)

    def over_mesh(k):
        return jnp.sum(gs.replay(mesh, term, solver, Y0, k, saveat=saveat).ys ** 2)

    direction = jnp.sin(jnp.arange(SPECIES, dtype=float))
    grad = jax.jit(jax.grad(one_call))(RATES)
    _, tangent = jax.jit(lambda k, v: jax.jvp(over_mesh, (k,), (v,)))(RATES, direction)
    assert abs(jnp.vdot(grad, direction) - tangent) < 1e-9 * abs(tangent)
