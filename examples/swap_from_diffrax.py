"""A Diffrax script moved to gradsolve by changing two names.

    python examples/swap_from_diffrax.py

This is an ordinary Diffrax gradient computation (a damped pendulum, the gradient of
the final energy with respect to the damping and the initial angle). The only
changes from the Diffrax version are `diffrax.Tsit5` -> `gradsolve.Tsit5` and
`diffrax.diffeqsolve` -> `gradsolve.diffeqsolve`; the script checks that the
gradient equals Diffrax's.
"""

import jax


jax.config.update("jax_enable_x64", True)

import diffrax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import gradsolve  # noqa: E402


def pendulum(t, y, args):
    g, damping = args
    theta, omega = y
    return jnp.stack([omega, -g * jnp.sin(theta) - damping * omega])


def final_energy(args, theta0, tsit5, diffeqsolve):
    sol = diffeqsolve(
        diffrax.ODETerm(pendulum),
        tsit5(),  # was: diffrax.Tsit5()
        t0=0.0,
        t1=5.0,
        dt0=None,
        y0=jnp.stack([theta0, 0.0]),
        args=args,
        saveat=diffrax.SaveAt(t1=True),
        stepsize_controller=diffrax.PIDController(rtol=1e-8, atol=1e-8),
    )
    theta, omega = sol.ys[-1]
    return 0.5 * omega**2 + args[0] * (1 - jnp.cos(theta))


def main():
    args, theta0 = jnp.array([9.81, 0.3]), jnp.array(1.0)
    grad = jax.jit(jax.grad(final_energy, argnums=(0, 1)), static_argnums=(2, 3))
    ours = grad(args, theta0, gradsolve.Tsit5, gradsolve.diffeqsolve)
    theirs = grad(args, theta0, diffrax.Tsit5, diffrax.diffeqsolve)
    difference = max(
        float(jnp.max(jnp.abs(a - b) / jnp.abs(b))) for a, b in zip(ours, theirs)
    )
    print(f"gradsolve gradient: {ours[0]}, {ours[1]}")
    print(f"Diffrax gradient  : {theirs[0]}, {theirs[1]}")
    print(f"largest relative difference: {difference:.1e}")
    return difference


if __name__ == "__main__":
    main()
