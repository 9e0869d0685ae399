"""The problem every case starts from, and its default inputs.

y' = -k y on [0, 1] (`decay`), `y0 = [1, 2, 3]`, `k = 0.5`, solved with `gs.Tsit5`
and a `PIDController(rtol=1e-6, atol=1e-6)`; a case changes only what it names.
Also two other problems (`rotate`, `robertson`) and the batches of ensembles.
"""

import diffrax
import jax.numpy as jnp
import jax.tree_util as jtu

import gradsolve as gs


def decay(t, y, args):
    """y' = -k y on every leaf; `k = args` (0.5 when `args` is None)."""
    rate = 0.5 if args is None else args
    return jtu.tree_map(lambda x: -rate * x, y)


def rotate(t, y, args):
    """A fast rotation in the first two components: another problem, same state."""
    return jnp.stack([10.0 * y[1], -10.0 * y[0], -y[2]])


def robertson(t, y, args):
    k1, k2, k3 = 0.04, 3e7, 1e4
    return jnp.stack(
        [
            -k1 * y[0] + k3 * y[1] * y[2],
            k1 * y[0] - k2 * y[1] ** 2 - k3 * y[1] * y[2],
            k2 * y[1] ** 2,
        ]
    )


TERM = diffrax.ODETerm(decay)
CTRL = diffrax.PIDController(rtol=1e-6, atol=1e-6)
Y0 = jnp.array([1.0, 2.0, 3.0])
K = jnp.asarray(0.5)
Y0S = jnp.stack([Y0, 2 * Y0, 3 * Y0, 4 * Y0])
KS = jnp.array([0.5, 0.6, 0.7, 0.8])
DEFAULTS = dict(
    term=TERM,
    solver=gs.Tsit5(),
    t0=0.0,
    t1=1.0,
    dt0=None,
    y0=Y0,
    args=K,
    saveat=diffrax.SaveAt(t1=True),
    stepsize_controller=CTRL,
)
DEFAULTS_TEXT = (
    "unless named: term ODETerm(y' = -args * y), solver gs.Tsit5() (reference "
    "diffrax.Tsit5()), t0=0.0, t1=1.0, dt0=None, y0=array([1., 2., 3.]), "
    "args=array(0.5), saveat=SaveAt(t1=True), "
    "stepsize_controller=PIDController(rtol=1e-6, atol=1e-6); ensembles of 4 "
    "trajectories y0s=[1, 2, 3, 4] * y0, args=[0.5, 0.6, 0.7, 0.8] (args_axes=0); "
    "fits gs.fit(term (y' = -k y), gs.Tsit5(), params0=array(0.5), y0s=the first "
    "2 of those, ts=array([0.5, 1.]), data=y0s * exp(-0.7 ts), shape (2, 2, 3))"
)
# Diffrax's solver for each gradsolve solver (others are passed unchanged).
DIFFRAX_SOLVER = {gs.Tsit5: diffrax.Tsit5, gs.Dopri5: diffrax.Dopri5}


NAN, INF = float("nan"), float("inf")
