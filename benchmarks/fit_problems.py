"""The fitting problems of `fit_benchmark.py`: data, `gs.fit` and the same
Optimistix fit with Diffrax gradients (`examples/diffrax_fit.py`), for each.

- `lotka_volterra`: `examples/fit_lotka_volterra.py` (4 shared parameters, both
  populations observed, Tsit5 against Tsit5 at rtol = atol = 1e-8).
- `fitzhugh_nagumo`: FitzHugh-Nagumo's `(a, b, c)` (Ramsay et al. 2007, eq. 2) from
  the voltage alone, 25 times in [0.5, 10], additive noise 0.02; initial states
  uniform in [-1, 1]; Tsit5 against Tsit5 at rtol = atol = 1e-8.
- `robertson`: `examples/fit_robertson.py` (log-rates eleven decades apart, relative
  residuals), `gs.Rodas5` against Diffrax's `Kvaerno5` at rtol = 1e-6, atol = 1e-10.
  The example has 4 initial mixtures; more experiments repeat them.
"""

import dataclasses
import pathlib
import sys
from collections.abc import Callable

import diffrax
import jax
import jax.numpy as jnp
import optimistix as optx


ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import fit_lotka_volterra as lv  # noqa: E402
import fit_robertson as rob  # noqa: E402
from diffrax_fit import diffrax_fit  # noqa: E402

import gradsolve as gs  # noqa: E402


OPTIMISER = optx.LevenbergMarquardt(rtol=1e-8, atol=1e-8)


@dataclasses.dataclass(frozen=True)
class FitCase:
    name: str
    make_data: Callable  # n -> (y0s, ts, data)
    gradsolve: Callable  # (y0s, ts, data, jac, meshes) -> gs.FitResult
    diffrax: Callable  # (y0s, ts, data, jac) -> (params, result, iterations, s)
    # The number of experiments benchmarked unless `--n` says otherwise.
    experiments: int = 64
    # gs.fit's ways with its meshes that are timed (its `meshes=` values).
    meshes: tuple = ("reused", "per_evaluation")


def fitzhugh_nagumo(t, y, p):
    # Ramsay et al. (2007), "Parameter estimation for differential equations", eq. 2.
    a, b, c = p
    v, w = y
    return jnp.stack([c * (v - v**3 / 3 + w), -(v - a + b * w) / c])


FHN_TRUE = jnp.array([0.2, 0.2, 3.0])
FHN_GUESS = jnp.array([0.25, 0.15, 2.7])
FHN_CONTROLLER = gs.PIDController(rtol=1e-8, atol=1e-8)


def voltage(y, p):
    return y[:1]


def fitzhugh_nagumo_data(n: int, seed: int = 0):
    """`(y0s, ts, data)`: `n` experiments simulated by Diffrax (Dopri8, 1e-11) with
    the true parameters, the voltage observed with additive noise 0.02."""
    key_y0, key_noise = jax.random.split(jax.random.PRNGKey(seed))
    y0s = jax.random.uniform(key_y0, (n, 2), minval=-1.0, maxval=1.0)
    ts = jnp.linspace(0.5, 10.0, 25)

    def simulate(y0):
        return diffrax.diffeqsolve(
            diffrax.ODETerm(fitzhugh_nagumo),
            diffrax.Dopri8(),
            0.0,
            10.0,
            None,
            y0,
            FHN_TRUE,
            saveat=diffrax.SaveAt(ts=ts),
            stepsize_controller=diffrax.PIDController(rtol=1e-11, atol=1e-11),
        ).ys[:, :1]

    clean = jax.vmap(simulate)(y0s)
    return y0s, ts, clean + 0.02 * jax.random.normal(key_noise, clean.shape)


def _fhn_gradsolve(y0s, ts, data, jac, meshes):
    return gs.fit(gs.ODETerm(fitzhugh_nagumo), gs.Tsit5(), FHN_GUESS, y0s, ts, data,
                  stepsize_controller=FHN_CONTROLLER, optimiser=OPTIMISER, jac=jac,
                  observe=voltage, meshes=meshes)  # fmt: skip


def _fhn_diffrax(y0s, ts, data, jac):
    return diffrax_fit(fitzhugh_nagumo, FHN_GUESS, y0s, ts, data,
                       stepsize_controller=FHN_CONTROLLER, optimiser=OPTIMISER,
                       jac=jac, observe=voltage)  # fmt: skip


def _rob_data(n: int):
    y0s, ts, data = rob.make_data(4, 16)
    reps = -(-n // 4)
    tile = lambda x: jnp.concatenate([x] * reps)[:n]
    return tile(y0s), ts, tile(data)


def _rob_gradsolve(y0s, ts, data, jac, meshes):
    return gs.fit(gs.ODETerm(rob.robertson), gs.Rodas5(), rob.GUESS, y0s, ts, data,
                  stepsize_controller=rob.CONTROLLER, optimiser=OPTIMISER, jac=jac,
                  weights=1 / data**2, meshes=meshes)  # fmt: skip


def _rob_diffrax(y0s, ts, data, jac):
    return diffrax_fit(rob.robertson, rob.GUESS, y0s, ts, data,
                       stepsize_controller=rob.CONTROLLER, optimiser=OPTIMISER,
                       jac=jac, solver=diffrax.Kvaerno5(), weights=1 / data**2,
                       max_steps=100_000)  # fmt: skip


CASES = {
    "lotka_volterra": FitCase(
        "lotka_volterra", lv.make_data, lv.fit_gradsolve, lv.fit_diffrax
    ),
    "fitzhugh_nagumo": FitCase(
        "fitzhugh_nagumo", fitzhugh_nagumo_data, _fhn_gradsolve, _fhn_diffrax, 32
    ),
    "robertson": FitCase("robertson", _rob_data, _rob_gradsolve, _rob_diffrax, 4),
}
