"""A neural ODE trained the way Diffrax's documentation trains one, three ways.

    python examples/neural_ode_diffrax_style.py          # all three, side by side
    python examples/neural_ode_diffrax_style.py --steps 200 --width 64

The program has the shape of a typical Diffrax training script: an `eqx.Module`
vector field (an MLP), a model that solves from `y0` and saves at `ts`, a batch of
time series drawn at random each step, an `optax` optimiser, and a schedule that
first fits the first 10% of each series, then the whole. Only the solve differs:

- `diffrax`: `diffrax.diffeqsolve(..., diffrax.Tsit5(), ...)`, as written;
- `swapped`: `gs.diffeqsolve(..., gs.Tsit5(), ...)`, the names swapped and nothing
  else: the gradient is the same derivative, through gradsolve's one-call adjoint;
- `mesh`: the meshes of the whole dataset are recorded (`gs.record`, vmapped) and
  each step replays the batch's meshes (`gs.replay`); the dataset is recorded again
  every `--record-every` steps, or at once when a replay reports its mesh stale;
- `floor` (for reference, not a way to train): the same step with no ODE solve
  (every prediction is the series' first value), which is what the optimiser,
  the batch and the dispatch of the compiled step cost without any solver.

Each way starts from the same weights and draws the same batches; the script prints
per phase the first step's time (compilation included), the median step time and
the loss. `diffrax` and `swapped` take the same steps, so their losses agree to
round-off; `mesh` differentiates over steps chosen at slightly older weights.
"""

import argparse
import time

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradsolve as gs


RTOL, ATOL = 1e-3, 1e-6


class Field(eqx.Module):
    """`dy/dt = tanh(MLP(y))`: a softplus MLP, squashed so the field stays bounded."""

    mlp: eqx.nn.MLP

    def __init__(self, size, width, depth, *, key):
        self.mlp = eqx.nn.MLP(
            size, size, width, depth, activation=jax.nn.softplus,
            final_activation=jnp.tanh, key=key,
        )  # fmt: skip

    def __call__(self, t, y, args):
        return self.mlp(y)


class NeuralODE(eqx.Module):
    field: Field

    def solve(self, ts, y0, solve=gs.diffeqsolve, solver=gs.Tsit5()):
        """The solution at `ts` from `y0`, by `solve` (Diffrax's or gradsolve's)."""
        term = diffrax.ODETerm(self.field)
        sol = solve(
            term, solver, ts[0], ts[-1], ts[1] - ts[0], y0,
            stepsize_controller=diffrax.PIDController(rtol=RTOL, atol=ATOL),
            saveat=diffrax.SaveAt(ts=ts),
        )  # fmt: skip
        return sol.ys

    def record(self, ts, y0):
        term = gs.ODETerm(self.field)
        ctrl = gs.PIDController(rtol=RTOL, atol=ATOL)
        return gs.record(
            term, gs.Tsit5(), ts[0], ts[-1], ts[1] - ts[0], y0,
            stepsize_controller=ctrl,
        )  # fmt: skip

    def replay(self, mesh, ts, y0):
        sol = gs.replay(
            mesh, gs.ODETerm(self.field), gs.Tsit5(), y0,
            saveat=gs.SaveAt(ts=ts), stale="ignore",
        )  # fmt: skip
        return sol.ys, sol.stats["max_error_ratio"]


def dataset(size, length, *, key):
    """Damped rotations of random initial states, `dy/dt = A tanh(y)`: series
    `(size, length, 2)` over `ts` in [0, 10]."""
    ts = jnp.linspace(0.0, 10.0, length)
    y0s = jax.random.uniform(key, (size, 2), minval=-0.6, maxval=1.0)
    A = jnp.array([[-0.1, 1.3], [-1.0, -0.1]])

    def series(y0):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, args: A @ jnp.tanh(y)), diffrax.Tsit5(),
            ts[0], ts[-1], 0.1, y0, saveat=diffrax.SaveAt(ts=ts),
            stepsize_controller=diffrax.PIDController(rtol=1e-8, atol=1e-8),
        )  # fmt: skip
        return sol.ys

    return ts, jax.vmap(series)(y0s)


def make_step(way, optimiser):
    """The compiled training step of `way` ("diffrax", "swapped", "mesh" or
    "floor")."""
    solve, solver = {
        "diffrax": (diffrax.diffeqsolve, diffrax.Tsit5()),
        "swapped": (gs.diffeqsolve, gs.Tsit5()),
    }.get(way, (None, None))

    @eqx.filter_jit
    def step(model, opt_state, ts, ys, meshes):
        def loss(model):
            if way == "mesh":
                pred, ratio = jax.vmap(model.replay, (0, None, 0))(meshes, ts, ys[:, 0])
                ratio = jnp.max(ratio)
            elif way == "floor":
                # Depends on every weight (so the gradient and the update have
                # their usual size), and costs nothing to evaluate.
                weights = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
                tiny = 1e-12 * sum(jnp.sum(w) for w in weights)
                pred = jnp.broadcast_to(ys[:, :1], ys.shape) + tiny.astype(ys.dtype)
                ratio = jnp.zeros(())
            else:
                pred = jax.vmap(lambda y0: model.solve(ts, y0, solve, solver))(ys[:, 0])
                ratio = jnp.zeros(())
            return jnp.mean((ys - pred) ** 2), ratio

        (value, ratio), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
        updates, opt_state = optimiser.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, value, ratio

    return step


@eqx.filter_jit
def record_all(model, ts, y0s):
    return jax.vmap(model.record, (None, 0))(ts, y0s)


def train(way, *, steps, batch, width, depth, size, length, record_every, seed):
    """Train one way; returns per phase: first-step seconds, median step seconds,
    the losses, and (for `mesh`) how many times the dataset was recorded."""
    data_key, model_key, batch_key = jax.random.split(jax.random.key(seed), 3)
    ts_all, ys_all = dataset(size, length, key=data_key)
    model = NeuralODE(Field(2, width, depth, key=model_key))
    optimiser = optax.adabelief(3e-3)
    opt_state = optimiser.init(eqx.filter(model, eqx.is_inexact_array))
    step = make_step(way, optimiser)
    phases = []
    for fraction in (0.1, 1.0):
        n = max(int(length * fraction), 2)
        ts, ys = ts_all[:n], ys_all[:, :n]
        times, losses, records, meshes, age = [], [], 0, None, None
        for i in range(steps):
            key = jax.random.fold_in(batch_key, len(phases) * steps + i)
            idx = jax.random.choice(key, size, (batch,), replace=False)
            start = time.perf_counter()
            batch_meshes = None
            if way == "mesh":
                if meshes is None or age >= record_every:
                    meshes = record_all(model, ts, ys[:, 0]).trim(at_least=32)
                    records, age = records + 1, 0
                batch_meshes = jax.tree.map(lambda x: x[idx], meshes)
            new = step(model, opt_state, ts, ys[idx], batch_meshes)
            if way == "mesh" and not float(new[3]) <= 1.0:
                # The weights moved too far from the mesh's: record again and redo
                # the step on fresh meshes.
                meshes = record_all(model, ts, ys[:, 0]).trim(at_least=meshes.max_steps)
                records, age = records + 1, 0
                batch_meshes = jax.tree.map(lambda x: x[idx], meshes)
                new = step(model, opt_state, ts, ys[idx], batch_meshes)
            model, opt_state, value, _ = new
            losses.append(float(value))
            times.append(time.perf_counter() - start)
            age = None if age is None else age + 1
        phases.append(
            dict(
                first=times[0],
                median=float(np.median(times[1:])),
                losses=losses,
                records=records,
            )  # fmt: skip
        )
    return phases


def main(steps=100, batch=32, width=64, depth=2, size=256, length=100,
         record_every=10, seed=5678, ways=("diffrax", "swapped", "mesh")):  # fmt: skip
    results = {}
    for way in ways:
        results[way] = train(
            way, steps=steps, batch=batch, width=width, depth=depth, size=size,
            length=length, record_every=record_every, seed=seed,
        )  # fmt: skip
    print("| way | phase | first step (s) | median step (ms) | speed-up | "
          "final loss | records |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for way, phases in results.items():
        for p, phase in enumerate(phases):
            base = results.get("diffrax", results[way])[p]["median"]
            print(
                f"| {way} | {p + 1} | {phase['first']:.1f} | "
                f"{1e3 * phase['median']:.1f} | {base / phase['median']:.2f}x | "
                f"{phase['losses'][-1]:.4e} | {phase['records']} |"
            )
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--record-every", type=int, default=10)
    parser.add_argument("--ways", default="diffrax,swapped,mesh")
    opts = parser.parse_args()
    main(opts.steps, opts.batch, opts.width, record_every=opts.record_every,
         ways=tuple(opts.ways.split(",")))  # fmt: skip
