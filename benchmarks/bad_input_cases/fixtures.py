"""Recordings and solves shared by several families.

Meshes recorded once (cached) and replayed, saved or batched by the `meshes`,
`files` and `ensembles` cases; the reference of a replay (`stepto`); solves of the
batch under `jax.vmap`.
"""

import functools

import diffrax
import jax

import gradsolve as gs

from .calls import solution_out
from .defaults import CTRL, KS, TERM, Y0, Y0S, K


@functools.cache
def base_mesh():
    return gs.record(TERM, gs.Tsit5(), 0.0, 1.0, None, Y0, K, stepsize_controller=CTRL)


@functools.cache
def batched_mesh():
    one = lambda y0, k: gs.record(
        TERM, gs.Tsit5(), 0.0, 1.0, None, y0, k, stepsize_controller=CTRL
    )
    return jax.vmap(one)(Y0S, KS).trim()


@functools.cache
def failed_mesh():
    tight = diffrax.PIDController(rtol=1e-10, atol=1e-10)
    return gs.record(
        TERM,
        gs.Tsit5(),
        0.0,
        1.0,
        None,
        Y0,
        K,
        stepsize_controller=tight,
        max_steps=3,
        throw=False,
    )


@functools.cache
def reversed_mesh():
    return gs.record(TERM, gs.Tsit5(), 1.0, 0.0, None, Y0, K, stepsize_controller=CTRL)


@functools.cache
def point_mesh():
    return gs.record(TERM, gs.Tsit5(), 0.5, 0.5, None, Y0, K, stepsize_controller=CTRL)


def stepto(mesh, y0=Y0, args=K, saveat=None, term=TERM):
    """Diffrax over the mesh's accepted steps: the reference of a replay."""
    n = int(mesh.num_steps)
    ts = mesh.ts[: n + 1]
    sol = diffrax.diffeqsolve(
        term,
        diffrax.Tsit5(),
        ts[0],
        ts[-1],
        None,
        y0,
        args,
        saveat=diffrax.SaveAt(t1=True) if saveat is None else saveat,
        stepsize_controller=diffrax.StepTo(ts=ts),
    )
    return solution_out(sol)


def vmapped(y0s, ks):
    """`gs.diffeqsolve` under `jax.vmap` over `y0s` and `ks` (as `args`)."""

    def one(y0, k):
        sol = gs.diffeqsolve(TERM, gs.Tsit5(), 0.0, 1.0, None, y0, k, **_CTRL_KW)
        return solution_out(sol)

    return jax.vmap(one)(y0s, ks)


def vmapped_diffrax(y0s, ks):
    """`diffrax.diffeqsolve` under `jax.vmap` over `y0s` and `ks` (as `args`)."""

    def one(y0, k):
        sol = diffrax.diffeqsolve(
            TERM, diffrax.Tsit5(), 0.0, 1.0, None, y0, k, **_CTRL_KW
        )
        return solution_out(sol)

    return jax.vmap(one)(y0s, ks)


_CTRL_KW = dict(stepsize_controller=CTRL)
