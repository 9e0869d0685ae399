"""Train a neural ODE on spirals, reusing recorded meshes until they go stale.

    python examples/neural_ode.py                 # 300 steps, 32 spirals
    python examples/neural_ode.py --steps 60 --plot loss.png

The model is an `eqx.Module` holding an MLP vector field and `gs.Tsit5()`. Each
training step differentiates a fixed-step replay over the current mesh; the replay's
own error estimate (`stats["max_error_ratio"]`) says when the weights have moved so
far that the mesh misses the training tolerance, and only then is the ensemble
recorded again. Meshes are recorded ten times tighter than that tolerance, so that
one mesh serves many steps, and are padded to a fixed length (`trim(at_least=...)`)
so that the compiled training step is reused for every new mesh. Data: the damped
cubic spiral dy/dt = (y**3) A of the torchdiffeq examples, from 32 initial states.
"""

import argparse
import time

import jax


jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import gradsolve as gs  # noqa: E402


T1 = 1.5
TS = jnp.linspace(0.1, T1, 16)
TOLERANCE = 1e-5  # the accuracy the training asks of every replay
# Meshes are recorded 10x tighter; a replay whose error ratio (relative to the
# recording tolerance) exceeds STALE misses TOLERANCE itself: the mesh is stale.
CONTROLLER = gs.PIDController(rtol=TOLERANCE / 10, atol=TOLERANCE / 10)
STALE = 10.0
MESH_STEPS = 32  # meshes are padded to at least this: one compiled training step
SPIRAL = jnp.array([[-0.1, 2.0], [-2.0, -0.1]])


class NeuralODE(eqx.Module):
    mlp: eqx.nn.MLP
    solver: gs.Tsit5

    def __init__(self, key):
        self.mlp = eqx.nn.MLP(2, 2, 16, 2, activation=jnp.tanh, key=key)
        self.solver = gs.Tsit5()

    @staticmethod
    def field(t, y, mlp):
        return mlp(y)

    def record(self, y0s):
        """One mesh for the ensemble (no gradient)."""
        term = gs.ODETerm(self.field)
        return jax.vmap(
            lambda y0: gs.record(
                term, self.solver, 0.0, T1, None, y0, self.mlp,
                stepsize_controller=CONTROLLER,
            )
        )(y0s)  # fmt: skip

    def replay(self, mesh, y0s):
        term = gs.ODETerm(self.field)
        saveat = gs.SaveAt(ts=TS)
        # The training loop checks the error ratio itself (and re-records).
        return gs.replay(
            mesh, term, self.solver, y0s, self.mlp, saveat=saveat, stale="ignore"
        )


def spirals(n, key):
    y0s = jax.random.uniform(key, (n, 2), minval=-1.5, maxval=1.5)

    def one(y0):
        sol = gs.diffeqsolve(
            gs.ODETerm(lambda t, y, a: (y**3) @ a),
            gs.Tsit5(),
            0.0,
            T1,
            None,
            y0,
            SPIRAL,
            saveat=gs.SaveAt(ts=TS),
            stepsize_controller=gs.PIDController(rtol=1e-10, atol=1e-10),
        )
        return sol.ys

    return y0s, jax.vmap(one)(y0s)


@eqx.filter_jit
def record(model, y0s):
    return model.record(y0s)


@eqx.filter_jit
def train_step(model, opt_state, mesh, y0s, data, learning_rate):
    def loss(model):
        sol = model.replay(mesh, y0s)
        return jnp.mean((sol.ys - data) ** 2), jnp.max(sol.stats["max_error_ratio"])

    (value, ratio), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
    model, opt_state = adam(model, grads, opt_state, learning_rate)
    return model, opt_state, value, ratio


def adam(model, grads, state, learning_rate, b1=0.9, b2=0.999, eps=1e-8):
    """One Adam step (Kingma and Ba, 2015, Algorithm 1) on the model's arrays."""
    m, v, k = state
    g = eqx.filter(grads, eqx.is_inexact_array)
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g**2, v, g)
    k = k + 1
    step = jax.tree.map(
        lambda m, v: (
            -learning_rate * (m / (1 - b1**k)) / (jnp.sqrt(v / (1 - b2**k)) + eps)
        ),
        m,
        v,
    )
    return eqx.apply_updates(model, step), (m, v, k)


def main(steps=300, n=32, learning_rate=1e-2, plot_path="neural_ode.png", seed=0):
    """Train; print and return the losses, error ratios, record count, the mesh
    lengths used (one compilation of the training step each) and the time."""
    start = time.perf_counter()
    key_data, key_model = jax.random.split(jax.random.PRNGKey(seed))
    y0s, data = spirals(n, key_data)
    model = NeuralODE(key_model)
    params = eqx.filter(model, eqx.is_inexact_array)
    zeros = jax.tree.map(jnp.zeros_like, params)
    opt_state = (zeros, zeros, jnp.zeros((), int))
    mesh = record(model, y0s).trim(at_least=MESH_STEPS)
    records, losses, ratios, lengths = 1, [], [], {mesh.max_steps}
    for step in range(steps):
        new_model, new_state, loss, ratio = train_step(
            model, opt_state, mesh, y0s, data, learning_rate
        )
        if not float(ratio) <= STALE:
            # The weights moved since the mesh was recorded: this replay missed the
            # tolerance, so record again and redo the step on the fresh mesh.
            mesh = record(model, y0s).trim(at_least=mesh.max_steps)
            records += 1
            lengths.add(mesh.max_steps)
            new_model, new_state, loss, ratio = train_step(
                model, opt_state, mesh, y0s, data, learning_rate
            )
        model, opt_state = new_model, new_state
        losses.append(float(loss))
        ratios.append(float(ratio))
        if step % max(steps // 8, 1) == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {float(loss):.3e}  mesh error ratio "
                  f"{float(ratio):5.2f}  meshes recorded {records}")  # fmt: skip
    seconds = time.perf_counter() - start
    print(
        f"loss {losses[0]:.3e} -> {losses[-1]:.3e} "
        f"({losses[0] / losses[-1]:.0f}x lower) in {steps} steps, {records} meshes "
        f"recorded, mesh lengths {sorted(lengths)}, {seconds:.1f} s with compilation"
    )
    if plot_path:
        plot(plot_path, losses, model, mesh, y0s, data)
        print(f"plot of the loss curve and the fit: {plot_path}")
    return dict(
        losses=losses,
        ratios=ratios,
        records=records,
        mesh_lengths=sorted(lengths),
        seconds=seconds,
    )


def plot(path, losses, model, mesh, y0s, data):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ys = model.replay(mesh, y0s).ys
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.semilogy(losses)
    ax1.set_xlabel("training step")
    ax1.set_ylabel("mean squared error")
    ax1.set_title("loss")
    for i in range(min(6, len(y0s))):
        ax2.plot(data[i, :, 0], data[i, :, 1], "o", color=f"C{i}", ms=3)
        ax2.plot(ys[i, :, 0], ys[i, :, 1], "-", color=f"C{i}")
    ax2.set_title("spirals: data (dots) and neural ODE (lines)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--plot", default="neural_ode.png")
    args = parser.parse_args()
    main(args.steps, args.n, plot_path=args.plot)
