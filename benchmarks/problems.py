"""The benchmark problems: Lorenz, Lotka-Volterra and a neural ODE ensemble.

Each problem gives the same vector field three times (JAX, PyTorch batched over the
ensemble, NumPy for one trajectory, for SciPy), the ensemble's inputs as NumPy arrays
(so every tool starts from identical numbers), and its default tolerances.

The gradient every tool computes is that of

    loss(args) = sum over trajectories and components of y(t1)**2

with respect to `args`: the per-trajectory parameters for Lorenz and Lotka-Volterra
(`args_axes = 0`), the shared MLP weights for the neural ODE (`args_axes = None`).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Problem:
    """One ensemble problem, described once for every tool.

    - `make_inputs(n, rng)` returns `(y0s, args)` as NumPy (float64): `y0s` has shape
      `(n, dim)`; `args` is an array with a leading axis `n` when `args_axes == 0`,
      or a pytree shared by all trajectories when `args_axes is None`.
    - `jax_vf(t, y, args)`: one trajectory (the JAX tools vmap it).
    - `torch_vf(t, y, args)`: the whole ensemble at once, `y` of shape `(n, dim)`.
    - `numpy_vf(t, y, args)`: one trajectory, for `scipy.integrate.solve_ivp`.
    - `tol64`, `tol32`: default rtol = atol in float64 and float32.
    - `max_steps`: passed identically to gradsolve and Diffrax (and torchode).
    """

    name: str
    description: str
    t0: float
    t1: float
    dim: int
    args_axes: int | None
    tol64: float
    tol32: float
    max_steps: int
    make_inputs: Callable[[int, np.random.Generator], tuple[np.ndarray, Any]]
    jax_vf: Callable
    torch_vf: Callable
    numpy_vf: Callable


# --- Lorenz: the DiffEqGPU.jl ensemble benchmark --------------------------------


def _lorenz_inputs(n, rng):
    rho = np.linspace(0.0, 21.0, n)
    args = np.stack([np.full(n, 10.0), rho, np.full(n, 8.0 / 3.0)], axis=1)
    y0s = np.tile(np.array([1.0, 0.0, 0.0]), (n, 1))
    return y0s, args


def _lorenz_jax(t, y, args):
    sigma, rho, beta = args[0], args[1], args[2]
    return jnp.stack(
        [sigma * (y[1] - y[0]), y[0] * (rho - y[2]) - y[1], y[0] * y[1] - beta * y[2]]
    )


def _lorenz_torch(t, y, args):
    import torch

    sigma, rho, beta = args[:, 0], args[:, 1], args[:, 2]
    x, yy, z = y[:, 0], y[:, 1], y[:, 2]
    return torch.stack([sigma * (yy - x), x * (rho - z) - yy, x * yy - beta * z], dim=1)


def _lorenz_numpy(t, y, args):
    sigma, rho, beta = args
    return np.array(
        [sigma * (y[1] - y[0]), y[0] * (rho - y[2]) - y[1], y[0] * y[1] - beta * y[2]]
    )


# --- Lotka-Volterra with per-trajectory parameters --------------------------------

LV_BASE = np.array([1.5, 1.0, 1.0, 3.0])


def _lv_inputs(n, rng):
    args = LV_BASE * rng.uniform(0.8, 1.2, size=(n, 4))
    y0s = np.tile(np.array([1.0, 1.0]), (n, 1))
    return y0s, args


def _lv_jax(t, y, args):
    a, b, c, d = args[0], args[1], args[2], args[3]
    return jnp.stack([a * y[0] - b * y[0] * y[1], c * y[0] * y[1] - d * y[1]])


def _lv_torch(t, y, args):
    import torch

    a, b, c, d = args[:, 0], args[:, 1], args[:, 2], args[:, 3]
    u, v = y[:, 0], y[:, 1]
    return torch.stack([a * u - b * u * v, c * u * v - d * v], dim=1)


def _lv_numpy(t, y, args):
    a, b, c, d = args
    return np.array([a * y[0] - b * y[0] * y[1], c * y[0] * y[1] - d * y[1]])


# --- Neural ODE: MLP 4 -> 64 -> 64 -> 4, tanh, shared weights ---------------------

NODE_DIM, NODE_WIDTH = 4, 64


def _node_inputs(n, rng):
    # The weights come from their own generator, so they are the same for every n.
    wrng = np.random.default_rng(1234)
    sizes = [(NODE_WIDTH, NODE_DIM), (NODE_WIDTH, NODE_WIDTH), (NODE_DIM, NODE_WIDTH)]
    args = {}
    for i, (fan_out, fan_in) in enumerate(sizes, start=1):
        args[f"W{i}"] = wrng.normal(0.0, 1.0 / np.sqrt(fan_in), size=(fan_out, fan_in))
        args[f"b{i}"] = wrng.normal(0.0, 0.1, size=(fan_out,))
    y0s = rng.normal(0.0, 1.0, size=(n, NODE_DIM))
    return y0s, args


def _node_jax(t, y, w):
    h = jnp.tanh(w["W1"] @ y + w["b1"])
    h = jnp.tanh(w["W2"] @ h + w["b2"])
    return w["W3"] @ h + w["b3"]


def _node_torch(t, y, w):
    import torch

    h = torch.tanh(y @ w["W1"].T + w["b1"])
    h = torch.tanh(h @ w["W2"].T + w["b2"])
    return h @ w["W3"].T + w["b3"]


def _node_numpy(t, y, w):
    h = np.tanh(w["W1"] @ y + w["b1"])
    h = np.tanh(w["W2"] @ h + w["b2"])
    return w["W3"] @ h + w["b3"]


PROBLEMS: dict[str, Problem] = {
    "lorenz": Problem(
        name="lorenz",
        description="Lorenz, t in [0, 1], y0 = [1, 0, 0], sigma = 10, "
        "rho = linspace(0, 21, N), beta = 8/3 (DiffEqGPU.jl benchmark); "
        "gradient w.r.t. (sigma, rho, beta) of every trajectory",
        t0=0.0,
        t1=1.0,
        dim=3,
        args_axes=0,
        tol64=1e-8,
        tol32=1e-5,
        max_steps=4096,
        make_inputs=_lorenz_inputs,
        jax_vf=_lorenz_jax,
        torch_vf=_lorenz_torch,
        numpy_vf=_lorenz_numpy,
    ),
    "lotka_volterra": Problem(
        name="lotka_volterra",
        description="Lotka-Volterra, t in [0, 10], y0 = [1, 1], (a, b, c, d) = "
        "(1.5, 1, 1, 3) times U[0.8, 1.2] per trajectory and parameter (seed 0); "
        "gradient w.r.t. the parameters of every trajectory",
        t0=0.0,
        t1=10.0,
        dim=2,
        args_axes=0,
        tol64=1e-8,
        tol32=1e-5,
        max_steps=4096,
        make_inputs=_lv_inputs,
        jax_vf=_lv_jax,
        torch_vf=_lv_torch,
        numpy_vf=_lv_numpy,
    ),
    "neural_ode": Problem(
        name="neural_ode",
        description="Neural ODE, t in [0, 5], MLP 4-64-64-4 with tanh, weights shared, "
        "y0 ~ N(0, 1) per trajectory (seed 0); gradient w.r.t. the MLP weights",
        t0=0.0,
        t1=5.0,
        dim=NODE_DIM,
        args_axes=None,
        tol64=1e-6,
        tol32=1e-5,
        max_steps=4096,
        make_inputs=_node_inputs,
        jax_vf=_node_jax,
        torch_vf=_node_torch,
        numpy_vf=_node_numpy,
    ),
}


def make_inputs(problem: Problem, n: int, seed: int = 0):
    """The ensemble's `(y0s, args)` in float64 NumPy, the same for every tool."""
    return problem.make_inputs(n, np.random.default_rng(seed))
