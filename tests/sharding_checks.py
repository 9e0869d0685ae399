"""Sharded ensembles against the same ensembles on one device.

Run by `tests/test_sharding.py` in a fresh process, since the number of (simulated
CPU) devices is fixed when JAX starts: `XLA_FLAGS` must be set before JAX is
imported. Prints one JSON object of named checks; `--slow` adds larger cases.

The reference is the unsharded computation (`jax.vmap` on one device): the property
checked is that splitting an ensemble across devices changes nothing.
"""

import json
import os
import re
import sys
import time


os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402


jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import gradsolve as gs  # noqa: E402


COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute")
TERM, SOLVER = gs.ODETerm(lambda t, y, p: _lorenz(y, p)), gs.Tsit5()
CTRL = gs.PIDController(rtol=1e-6, atol=1e-6)
SAVEAT = gs.SaveAt(ts=jnp.linspace(0.0, 0.5, 4))


def _lorenz(y, p):
    sigma, rho, beta = p[0], p[1], p[2]
    return jnp.stack(
        [sigma * (y[1] - y[0]), y[0] * (rho - y[2]) - y[1], y[0] * y[1] - beta * y[2]]
    )


def ensemble(n):
    ps = jnp.stack([jnp.full(n, 10.0), jnp.linspace(0.0, 28.0, n), jnp.full(n, 8 / 3)])
    y0s = jnp.stack([jnp.linspace(0.5, 1.5, n), jnp.zeros(n), jnp.zeros(n)])
    return y0s.T, ps.T


def record_one(y0, p):
    return gs.record(TERM, SOLVER, 0.0, 0.5, None, y0, p, stepsize_controller=CTRL)


def solve_one(y0, p):
    sol = gs.diffeqsolve(
        TERM, SOLVER, 0.0, 0.5, None, y0, p, saveat=SAVEAT, stepsize_controller=CTRL
    )
    return sol.ys


def replay_loss(mesh, y0s, ps, sharding=None, args_axes=0, ensemble=False):
    replay = gs.replay_ensemble if ensemble else gs.replay
    extra = dict(chunk_size=2) if ensemble else {}
    sol = replay(
        mesh,
        TERM,
        SOLVER,
        y0s,
        ps,
        saveat=SAVEAT,
        args_axes=args_axes,
        stale="ignore",
        sharding=sharding,
        **extra,
    )
    return jnp.sum(sol.ys**2), sol.ys


def identical(a, b) -> bool:
    if jtu.tree_structure(a) != jtu.tree_structure(b):
        return False
    return all(
        np.asarray(x).shape == np.asarray(y).shape
        and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b))
    )


def relative(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def collectives(jitted, *args) -> dict:
    text = jitted.lower(*args).compile().as_text()
    return {k: len(re.findall(rf"= \S+ {k}(-start)?\(", text)) for k in COLLECTIVES}


def stays_split(tree, sharding) -> bool:
    return all(
        isinstance(x.sharding, NamedSharding)
        and x.sharding.mesh == sharding.mesh
        and tuple(x.sharding.spec)[:1] == tuple(sharding.spec)
        for x in jtu.tree_leaves(tree)
    )


def check_sizes(out, sizes, device_counts, slow):
    """Values, meshes and gradients on several device counts equal the unsharded."""
    grad = jax.jit(jax.grad(replay_loss, argnums=2, has_aux=True), static_argnums=(3,))
    solve_grad = jax.grad(
        lambda ps, y0s, f: (jnp.sum(f(solve_one)(y0s, ps) ** 2), f(solve_one)(y0s, ps)),
        has_aux=True,
    )
    for n in sizes:
        y0s, ps = ensemble(n)
        ref_mesh = jax.jit(jax.vmap(record_one))(y0s, ps).trim()
        ref_grad = grad(ref_mesh, y0s, ps, None)
        ref_shared = grad(ref_mesh, y0s, ps[0], None, None)
        ref_solve = jax.jit(solve_grad, static_argnums=2)(ps, y0s, jax.vmap)
        for k in device_counts:
            sharding = gs.ensemble_sharding(jax.devices()[:k])
            key = f"n{n}_d{k}"
            mesh = gs.sharded_vmap(record_one, sharding=sharding)(y0s, ps).trim()
            out[f"mesh_{key}"] = identical(mesh, ref_mesh)
            out[f"replay_grad_{key}"] = identical(
                grad(mesh, y0s, ps, sharding), ref_grad
            )
            if not slow and k != device_counts[-1]:
                continue
            shared = grad(mesh, y0s, ps[0], sharding, None)
            out[f"shared_grad_values_{key}"] = identical(shared[1], ref_shared[1])
            out[f"shared_grad_rel_{key}"] = relative(shared[0], ref_shared[0])
            split = lambda f: gs.sharded_vmap(f, sharding=sharding)
            got = jax.jit(solve_grad, static_argnums=2)(ps, y0s, split)
            out[f"diffeqsolve_values_rel_{key}"] = relative(got[1], ref_solve[1])
            out[f"diffeqsolve_grad_rel_{key}"] = relative(got[0], ref_solve[0])


def check_placement(out, slow):
    """Arrays placed on devices stay there, with no collective but those asked for."""
    sharding = gs.ensemble_sharding()
    y0s, ps = ensemble(16)
    ref_mesh = jax.vmap(record_one)(y0s, ps)
    y0s, ps = jax.device_put((y0s, ps), sharding)
    record = jax.jit(gs.sharded_vmap(record_one, sharding=sharding))
    out["record_collectives"] = collectives(record, y0s, ps)
    mesh = gs.sharded_vmap(record_one)(y0s, ps)  # placement inferred from y0s, ps
    out["record_inferred_identical"] = identical(mesh, ref_mesh)
    out["record_stays_split"] = stays_split(mesh, sharding)
    trimmed = mesh.trim()
    out["trim_identical"] = identical(trimmed, ref_mesh.trim())
    out["trim_stays_split"] = stays_split(trimmed, sharding)
    per = jax.jit(jax.grad(lambda ps, m: replay_loss(m, y0s, ps, sharding)[0]))
    out["grad_collectives"] = collectives(per, ps, trimmed)
    out["grad_stays_split"] = stays_split(per(ps, trimmed), sharding)
    shared = jax.jit(
        jax.grad(lambda p, m: replay_loss(m, y0s, p, sharding, args_axes=None)[0])
    )
    out["shared_grad_collectives"] = collectives(shared, ps[0], trimmed)
    sol = gs.replay(trimmed, TERM, SOLVER, y0s, ps, args_axes=0, saveat=SAVEAT)
    out["eager_replay_stays_split"] = stays_split((sol.ys, sol.stats), sharding)
    if slow:
        # For contrast: plain jax.vmap, left to XLA, steps all devices in lock-step.
        plain = jax.jit(jax.vmap(record_one))
        out["vmap_record_all_reduces"] = collectives(plain, y0s, ps)["all-reduce"]


def check_explicit_mesh(out):
    """A device mesh with Explicit axes (jax.make_mesh's default) works as well."""
    sharding = NamedSharding(jax.make_mesh((8,), ("e",)), P("e"))
    y0s, ps = ensemble(13)
    mesh = gs.sharded_vmap(record_one, sharding=sharding)(y0s, ps).trim()
    out["explicit_mesh_record"] = identical(mesh, jax.vmap(record_one)(y0s, ps).trim())


def check_chunked(out, n, k):
    sharding = gs.ensemble_sharding(jax.devices()[:k])
    y0s, ps = ensemble(n)
    ref_mesh = jax.jit(jax.vmap(record_one))(y0s, ps).trim()
    mesh = gs.record_ensemble(
        TERM,
        SOLVER,
        0.0,
        0.5,
        None,
        y0s,
        ps,
        args_axes=0,
        stepsize_controller=CTRL,
        chunk_size=2,
        sharding=sharding,
    )
    out[f"record_ensemble_n{n}_d{k}"] = identical(mesh, ref_mesh)
    grad = jax.jit(jax.grad(replay_loss, argnums=2, has_aux=True), static_argnums=(3,))
    want = grad(ref_mesh, y0s, ps, None)
    chunked = jax.jit(
        jax.grad(
            lambda ps: replay_loss(mesh, y0s, ps, sharding, ensemble=True), has_aux=True
        )
    )
    # Values at SaveAt(ts) are interpolated from stages computed for the chunk's
    # batch, which XLA may round differently: equal to round-off, as documented.
    got = chunked(ps)
    out[f"replay_ensemble_rel_n{n}_d{k}"] = max(
        relative(a, b) for a, b in zip(jtu.tree_leaves(got), jtu.tree_leaves(want))
    )


def check_fit(out, n, k):
    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
    )
    import fit_lotka_volterra as lv

    y0s, ts, data = lv.make_data(n, num_times=6)
    term = gs.ODETerm(lv.lotka_volterra)
    sharding = gs.ensemble_sharding(jax.devices()[:k])
    fits = [
        gs.fit(
            term,
            gs.Tsit5(),
            lv.GUESS,
            y0s,
            ts,
            data,
            stepsize_controller=lv.CONTROLLER,
            sharding=s,
        )
        for s in (None, sharding)
    ]
    key = f"n{n}_d{k}"
    out[f"fit_success_{key}"] = [int(f.result._value) for f in fits]
    out[f"fit_rel_{key}"] = relative(fits[1].params, fits[0].params)


def check_errors(out):
    y0s, ps = ensemble(16)
    mesh2d = jax.make_mesh(
        (2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    messages = {}
    bad = {
        "non_ensemble_axis": lambda: gs.sharded_vmap(jnp.sum)(
            jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh2d, P(None, "a")))
        ),
        "mismatched": lambda: gs.sharded_vmap(record_one)(
            jax.device_put(y0s, NamedSharding(mesh2d, P("a"))),
            jax.device_put(ps, NamedSharding(mesh2d, P("b"))),
        ),
        "mismatched_request": lambda: gs.sharded_vmap(
            record_one, sharding=gs.ensemble_sharding(jax.devices()[:2])
        )(jax.device_put(y0s, gs.ensemble_sharding()), ps),
        "explicit_mesh_vmap": lambda: jax.jit(jax.vmap(record_one))(
            *jax.device_put(
                (y0s, ps), NamedSharding(jax.make_mesh((8,), ("e",)), P("e"))
            )
        ),
        "bad_type": lambda: gs.sharded_vmap(record_one, sharding="devices")(y0s, ps),
        "in_axes": lambda: gs.sharded_vmap(
            record_one, in_axes=(1, 0), sharding=gs.ensemble_sharding()
        )(y0s.T, ps),
    }
    for name, call in bad.items():
        try:
            call()
            messages[name] = None
        except (ValueError, TypeError) as e:
            messages[name] = str(e)
    out["errors"] = messages


def main(slow: bool):
    out = {"devices": jax.device_count(), "seconds": {}}

    def run(name, check, *args):
        start = time.process_time()
        check(out, *args)
        out["seconds"][name] = round(time.process_time() - start, 1)

    run("errors", check_errors)
    run("placement", check_placement, slow)
    run("sizes", check_sizes, (13, 16) if slow else (13,), (1, 2, 4, 8), slow)
    run("explicit", check_explicit_mesh)
    run("chunked", check_chunked, 13, 4)
    if slow:  # two Optimistix fits compile for half a minute
        run("chunked_slow", check_chunked, 16, 8)
        run("fit", check_fit, 6, 4)
        run("fit_slow", check_fit, 16, 8)
    print(json.dumps(out))


if __name__ == "__main__":
    main(slow="--slow" in sys.argv)
