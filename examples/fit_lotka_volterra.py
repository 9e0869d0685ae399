"""Fit Lotka-Volterra parameters to 64 noisy experiments, timed against Diffrax.

    python examples/fit_lotka_volterra.py            # 64 experiments, both jac modes
    python examples/fit_lotka_volterra.py --n 16 --jac fwd --plot lv.png

Each experiment starts from its own initial populations; all share the parameters
(a, b, c, d) of prey' = a x - b x y, predator' = c x y - d y. The data are the two
populations at 20 times in [0.25, 5], with 5% multiplicative noise. `gs.fit` runs
Levenberg-Marquardt on residuals replayed over a recorded mesh; the same Optimistix
fit with Diffrax gradients (`diffrax_fit.py`) solves and differentiates adaptively at
every iteration, with the same per-trajectory Jacobian blocks (forward mode here:
4 parameters, 40 residuals per experiment; `diffrax.ForwardMode()`). Both are timed
side by side, once with compilation and once without; `benchmarks/fit_benchmark.py`
repeats the timing.
"""

import argparse
import pathlib
import time

import jax


jax.config.update("jax_enable_x64", True)

import diffrax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optimistix as optx  # noqa: E402
from diffrax_fit import diffrax_fit  # noqa: E402

import gradsolve as gs  # noqa: E402


TRUE_PARAMS = jnp.array([1.5, 1.0, 1.0, 3.0])  # a, b, c, d
GUESS = TRUE_PARAMS * jnp.array([0.8, 1.2, 1.2, 0.8])
CONTROLLER = gs.PIDController(rtol=1e-8, atol=1e-8)
OPTIMISER = optx.LevenbergMarquardt(rtol=1e-8, atol=1e-8)


def lotka_volterra(t, y, p):
    a, b, c, d = p
    return jnp.stack([a * y[0] - b * y[0] * y[1], c * y[0] * y[1] - d * y[1]])


def make_data(n: int, num_times: int = 20, noise: float = 0.05, seed: int = 0):
    """`(y0s, ts, data)`: `n` experiments simulated by Diffrax at rtol = atol = 1e-11
    with the true parameters, observed with multiplicative Gaussian noise."""
    key_y0, key_noise = jax.random.split(jax.random.PRNGKey(seed))
    y0s = jax.random.uniform(key_y0, (n, 2), minval=0.5, maxval=2.0)
    ts = jnp.linspace(0.25, 5.0, num_times)

    def simulate(y0):
        return diffrax.diffeqsolve(
            diffrax.ODETerm(lotka_volterra),
            diffrax.Dopri8(),
            0.0,
            ts[-1],
            None,
            y0,
            TRUE_PARAMS,
            saveat=diffrax.SaveAt(ts=ts),
            stepsize_controller=diffrax.PIDController(rtol=1e-11, atol=1e-11),
        ).ys

    clean = jax.vmap(simulate)(y0s)
    data = clean * (1 + noise * jax.random.normal(key_noise, clean.shape))
    return y0s, ts, data


def fit_gradsolve(y0s, ts, data, jac, meshes="auto"):
    return gs.fit(
        gs.ODETerm(lotka_volterra),
        gs.Tsit5(),
        GUESS,
        y0s,
        ts,
        data,
        stepsize_controller=CONTROLLER,
        optimiser=OPTIMISER,
        jac=jac,
        meshes=meshes,
    )


def fit_diffrax(y0s, ts, data, jac):
    return diffrax_fit(
        lotka_volterra,
        GUESS,
        y0s,
        ts,
        data,
        stepsize_controller=CONTROLLER,
        optimiser=OPTIMISER,
        jac=jac,
    )


def plot(path, y0s, ts, data, params):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fine = jnp.linspace(0.0, float(ts[-1]), 200)
    fig, axes = plt.subplots(2, 2, figsize=(9, 6), sharex=True)
    for i, ax in enumerate(axes.flat):
        sol = gs.diffeqsolve(
            gs.ODETerm(lotka_volterra),
            gs.Tsit5(),
            0.0,
            fine[-1],
            None,
            y0s[i],
            params,
            saveat=gs.SaveAt(ts=fine),
            stepsize_controller=CONTROLLER,
        )
        for k, (name, colour) in enumerate([("prey", "C0"), ("predator", "C1")]):
            ax.plot(ts, data[i, :, k], "o", color=colour, ms=3, label=f"{name} data")
            ax.plot(fine, sol.ys[:, k], "-", color=colour, label=f"{name} fit")
        ax.set_title(f"experiment {i}")
    axes[0, 0].legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("t")
    fig.suptitle("Lotka-Volterra: data (5% noise) and gs.fit")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(n=64, jacs=("fwd", "bwd"), plot_path="fit_lotka_volterra.png"):
    """Run the fits; print and return their parameters, errors and timings."""
    y0s, ts, data = make_data(n)
    print(f"Lotka-Volterra: {n} experiments, {len(ts)} times, 5% noise, float64")
    print(
        f"true parameters  {np.asarray(TRUE_PARAMS)}, initial guess {np.asarray(GUESS)}"
    )
    results = {}
    for jac in jacs:
        start = time.perf_counter()
        fit_gradsolve(y0s, ts, data, jac)  # compiles
        first_gs = time.perf_counter() - start
        fit = fit_gradsolve(y0s, ts, data, jac)
        p_dfx, result_dfx, iterations_dfx, first_dfx = fit_diffrax(y0s, ts, data, jac)
        p_dfx, result_dfx, iterations_dfx, run_dfx = fit_diffrax(y0s, ts, data, jac)
        error = float(jnp.max(jnp.abs(fit.params / TRUE_PARAMS - 1)))
        agree = float(jnp.max(jnp.abs(fit.params - p_dfx) / jnp.abs(p_dfx)))
        run_gs = fit.stats["wall_time"]
        results[jac] = dict(
            params=np.asarray(fit.params).tolist(),
            diffrax_params=np.asarray(p_dfx).tolist(),
            success=bool(fit.result == optx.RESULTS.successful),
            diffrax_success=bool(result_dfx == optx.RESULTS.successful),
            max_relative_error=error,
            agreement=agree,
            stats=fit.stats,
            diffrax_iterations=iterations_dfx,
            gradsolve_seconds=run_gs,
            diffrax_seconds=run_dfx,
            gradsolve_first_call_seconds=first_gs,
            diffrax_first_call_seconds=first_dfx,
            speedup=run_dfx / run_gs,
        )
        print(f"\njac={jac!r}  gs.fit: {optx.RESULTS[fit.result] or 'successful'}")
        print(f"  fitted parameters      {np.asarray(fit.params)}")
        print(f"  largest relative error {100 * error:.2f}% of the true values")
        print(
            f"  Diffrax-gradient fit   {np.asarray(p_dfx)} (relative gap {agree:.1e})"
        )
        print(
            f"  gs.fit: {fit.stats['rounds']} optimiser runs, {fit.stats['records']} "
            f"meshes, {fit.stats['iterations']} iterations and "
            f"{fit.stats['refinement_steps']} refinement steps; Diffrax fit: "
            f"{iterations_dfx} iterations"
        )
        print(
            f"  wall time: gs.fit {1e3 * run_gs:.0f} ms, Diffrax gradients "
            f"{1e3 * run_dfx:.0f} ms  ->  speed-up {run_dfx / run_gs:.1f}x "
            f"(first calls, with compilation: {first_gs:.1f} s vs {first_dfx:.1f} s)"
        )
    if plot_path:
        plot(plot_path, y0s, ts, data, jnp.asarray(results[jacs[0]]["params"]))
        print(f"\nplot of data and fit: {plot_path}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64, help="number of experiments")
    parser.add_argument("--jac", choices=["fwd", "bwd", "both"], default="both")
    parser.add_argument("--plot", default=str(pathlib.Path("fit_lotka_volterra.png")))
    args = parser.parse_args()
    jacs = ("fwd", "bwd") if args.jac == "both" else (args.jac,)
    main(args.n, jacs, args.plot)
