"""Ensembles split across devices and hosts: every device runs its own trajectories.

Trajectories are independent, so an ensemble spreads over devices by splitting its
leading axis. XLA partitions `jax.vmap` of a solve over arrays split that way
(GSPMD), but a vmapped `while_loop` (an adaptive recording) stops only when every
trajectory of the batch has finished: XLA reduces the loop's predicate across
devices with an all-reduce on every step, so all devices step in lock-step. Here an
ensemble runs under `jax.shard_map` instead: each device runs its own vmapped loop
over its own trajectories, and nothing crosses devices except the reductions the
caller asks for (a loss summed over the ensemble; the gradient of a shared parameter,
which `shard_map`'s transpose sums with one all-reduce).

JAX splits an array into equal shards only. An ensemble whose size the number of
devices does not divide is padded (its last trajectory repeated) and the padding is
stripped from the results, which then have a size no equal split holds: XLA gathers
them. Large ensembles should have a size the device count divides.
"""

import contextlib
import functools
import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


class Split(NamedTuple):
    """The devices an ensemble axis is split over: `mesh` and its axis names."""

    mesh: object  # `jax.sharding.Mesh` or `AbstractMesh`
    axes: tuple[str, ...]

    @property
    def size(self) -> int:
        """The number of shards (devices along `axes`)."""
        return math.prod(self.mesh.shape[a] for a in self.axes)

    @property
    def spec(self) -> P:
        return P(self.axes if len(self.axes) > 1 else self.axes[0])

    def sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec)


def ensemble_sharding(devices=None, axis_name: str = "ensemble") -> NamedSharding:
    """A sharding that splits an ensemble's leading axis over devices.

    With several hosts (after `jax.distributed.initialize()`), `jax.devices()` lists
    every host's devices, so the default spans them all.

    **Arguments:**

    - `devices`: the devices to use, in order (default: `jax.devices()`).
    - `axis_name`: the name of the device mesh's one axis.

    **Returns:**

    A `jax.sharding.NamedSharding` over a one-axis `jax.sharding.Mesh`, splitting
    axis 0: pass it as `sharding=` to gradsolve's ensemble functions, or place arrays
    with `jax.device_put(x, sharding)` (one host) or
    `jax.make_array_from_process_local_data(sharding, local_rows)` (several hosts).
    """
    devices = jax.devices() if devices is None else list(devices)
    # Auto axes: outside the per-device solves (a loss over the ensemble), XLA
    # chooses the communication, as for any jitted JAX code.
    mesh = Mesh(
        np.array(devices), (axis_name,), axis_types=(jax.sharding.AxisType.Auto,)
    )
    return NamedSharding(mesh, P(axis_name))


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple | list) else (entry,)


def _split_of_sharding(sharding, ndim: int, what: str) -> Split | None:
    """The split of a `NamedSharding`'s axis 0 (`None` if not split)."""
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    for axis, entry in enumerate(spec[1:], start=1):
        if _axes(entry) and any(sharding.mesh.shape[a] > 1 for a in _axes(entry)):
            raise ValueError(
                f"{what} is split across devices along its axis {axis} "
                f"(PartitionSpec{tuple(sharding.spec)}), not only along its leading "
                "ensemble axis. gradsolve splits ensembles by trajectory: place it "
                "with jax.device_put(x, NamedSharding(mesh, P(axis_name))) or "
                "gs.ensemble_sharding()."
            )
    axes = tuple(a for a in _axes(spec[0]) if sharding.mesh.shape[a] > 1)
    return Split(sharding.mesh, axes) if axes else None


def _split_of(x, what: str) -> Split | None:
    """How the leading axis of one array is split over devices, if it is."""
    if isinstance(x, jax.core.Tracer):
        # Inside `jit`, only a mesh with Explicit axes shows the sharding in types.
        try:
            sharding = jax.typeof(x).sharding
        except Exception:
            return None
        if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
            return None
    elif isinstance(x, jax.Array):
        sharding = x.sharding
        if len(sharding.device_set) == 1 or sharding.is_fully_replicated:
            return None
        if not isinstance(sharding, NamedSharding):
            raise ValueError(
                f"{what} is split across devices by a {type(sharding).__name__}; "
                "gradsolve needs a jax.sharding.NamedSharding of the leading axis: "
                "place it with jax.device_put(x, gs.ensemble_sharding())."
            )
    else:
        return None
    return _split_of_sharding(sharding, np.ndim(x), what) if np.ndim(x) else None


def _mesh_key(mesh):
    # Inside `jit` an Explicit mesh is abstract: its devices are not known there.
    return (tuple(mesh.axis_names), tuple(mesh.axis_sizes))


def _same(a: Split, b: Split) -> bool:
    if (_mesh_key(a.mesh), a.axes) != (_mesh_key(b.mesh), b.axes):
        return False
    ids = [m.devices if isinstance(m, Mesh) else None for m in (a.mesh, b.mesh)]
    if any(x is None for x in ids):
        return True
    return [d.id for d in ids[0].flat] == [d.id for d in ids[1].flat]


def _describe(split: Split) -> str:
    return f"axes {split.axes} of a device mesh {dict(split.mesh.shape)}"


def requested_split(sharding) -> Split | None:
    """The split a `sharding=` argument asks for (`None`: not split)."""
    if sharding is None or isinstance(sharding, Split):
        return sharding
    if isinstance(sharding, NamedSharding):
        return _split_of_sharding(sharding, len(sharding.spec), "sharding=")
    if isinstance(sharding, Mesh):
        axes = tuple(a for a in sharding.axis_names if sharding.shape[a] > 1)
        return Split(sharding, axes) if axes else None
    raise TypeError(
        "sharding= must be a jax.sharding.NamedSharding splitting axis 0 (e.g. "
        "gs.ensemble_sharding()), a jax.sharding.Mesh (split over all its axes) or "
        f"None; got {type(sharding).__name__}."
    )


def full_axes(in_axes, tree):
    """`in_axes` (a `jax.vmap` prefix of `tree`) broadcast to every leaf of `tree`."""
    return jtu.tree_map(
        lambda axis, sub: jtu.tree_map(lambda _: axis, sub),
        in_axes,
        tree,
        is_leaf=lambda x: x is None,
    )


def leaf_axes(tree, in_axes) -> tuple[list, list]:
    """The leaves of `tree` and the `jax.vmap` axis of each (`in_axes` is a prefix)."""
    leaves, treedef = jtu.tree_flatten(tree)
    axes = treedef.flatten_up_to(full_axes(in_axes, tree))
    for axis in set(axes) - {0, None}:
        raise ValueError(
            f"in_axes={axis}: the ensemble axis must be the leading one (0) or None "
            "(shared); move it first with jnp.moveaxis."
        )
    return leaves, axes


def _mapped_leaves(tree, in_axes) -> list:
    leaves, axes = leaf_axes(tree, in_axes)
    return [x for x, axis in zip(leaves, axes) if axis == 0]


def resolve_split(sharding, tree, in_axes, what: str = "the ensemble") -> Split | None:
    """The split to run an ensemble on: `sharding=` if given, else the split of its
    arrays (`tree`, with `jax.vmap`-style `in_axes`); `None` to run unsplit.

    Raises a `ValueError` when arrays are split differently from each other or from
    `sharding=`.
    """
    if (
        sharding is None
        and jax.device_count() == 1
        and set(jtu.tree_leaves(in_axes)) <= {0}
    ):
        # Nothing is split on one device (and the axes need no check): a small
        # ensemble's recording would spend a tenth of its time finding that out.
        return None
    found = []
    for x in _mapped_leaves(tree, in_axes):
        split = _split_of(x, what)
        if split is not None and not any(_same(split, f) for f in found):
            found.append(split)
    requested = requested_split(sharding)
    if requested is not None:
        for other in found:
            if not _same(other, requested):
                raise ValueError(
                    f"sharding= splits {what} over {_describe(requested)}, but its "
                    f"arrays are split over {_describe(other)}: place them with "
                    "jax.device_put(x, sharding) using the same sharding, or pass "
                    "sharding=None to follow the arrays."
                )
        return requested
    if len(found) > 1:
        parts = " and ".join(_describe(s) for s in found)
        raise ValueError(
            f"The arrays of {what} are split over different devices ({parts}): "
            "place them all with one sharding (jax.device_put(x, sharding)), or pass "
            "sharding= to choose one."
        )
    return found[0] if found else None


def batch_size(tree, in_axes) -> int:
    sizes = {
        jnp.shape(x)[0] if jnp.ndim(x) else None for x in _mapped_leaves(tree, in_axes)
    }
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            "Every array mapped over the ensemble needs the same leading axis (one "
            f"entry per trajectory); got leading sizes {sorted(map(str, sizes))}."
        )
    return sizes.pop()


def pad_rows(x, extra: int):
    # Padding repeats the last trajectory: a real trajectory, which solves as fast
    # and as safely as the others (zeros could be an invalid state).
    return jnp.concatenate([x, jnp.repeat(x[-1:], extra, axis=0)])


@eqx.filter_jit
def run_sharded(fn, args: tuple, in_axes: tuple, split: Split, vmap: bool = False):
    """`fn(*args)` with the ensemble split over `split`: `fn` runs on every device
    with that device's rows of the mapped leaves (those `in_axes` marks 0) and all
    of the shared ones (`None`), and returns per-trajectory outputs (every array
    output has a leading ensemble axis). With `vmap`, `fn` is per trajectory and is
    mapped with `jax.vmap(fn, in_axes)` on each device.
    """
    batch = batch_size(args, in_axes)
    extra = -batch % split.size
    leaves, axes = leaf_axes(args, in_axes)
    treedef = jtu.tree_structure(args)
    kind = [
        (0 if a == 0 else 1) if eqx.is_array(x) else 2 for x, a in zip(leaves, axes)
    ]
    mapped = [
        pad_rows(x, extra) if extra else x for x, k in zip(leaves, kind) if k == 0
    ]
    shared = [x for x, k in zip(leaves, kind) if k == 1]
    body = jax.vmap(fn, in_axes=in_axes) if vmap else fn
    static_out = []
    explicit = jax.sharding.AxisType.Explicit in getattr(split.mesh, "axis_types", ())
    if explicit:
        # On a mesh with Explicit axes, shard_map takes only inputs already placed
        # as its specs say (and slices only outputs whose placement is explicit).
        whole = NamedSharding(split.mesh, P())
        mapped = [jax.sharding.reshard(x, split.sharding()) for x in mapped]
        shared = [jax.sharding.reshard(x, whole) for x in shared]

    def local(mapped, shared):
        inputs = (iter(mapped), iter(shared))
        rebuilt = [x if k == 2 else next(inputs[k]) for x, k in zip(leaves, kind)]
        out = body(*jtu.tree_unflatten(treedef, rebuilt))
        dynamic, static = eqx.partition(out, eqx.is_array)
        static_out.append(static)
        return dynamic

    out = jax.shard_map(
        local,
        mesh=split.mesh,
        in_specs=(split.spec, P()),
        out_specs=split.spec,
        # Equinox's checks (`eqx.error_if`) are not written for shard_map's
        # varying-value types; every output here is per trajectory anyway.
        check_vma=False,
    )(mapped, shared)
    if extra:
        whole = NamedSharding(split.mesh, P())
        gather = (
            (lambda x: jax.sharding.reshard(x, whole)) if explicit else (lambda x: x)
        )
        out = jtu.tree_map(lambda x: gather(x)[:batch], out)
    return eqx.combine(out, static_out[0])


@contextlib.contextmanager
def explained_explicit_mesh(name: str):
    """Re-raise JAX's failure to trace `jax.vmap` of a while loop over arrays split
    on a mesh with Explicit axes (JAX 0.10) with the fix."""
    try:
        yield
    except ValueError as e:
        if "is not found in mesh" not in str(e):
            raise
        raise ValueError(
            f"jax.vmap of {name} cannot be traced on arrays split over a device mesh "
            "with Explicit axes (jax.make_mesh's default): JAX fails to batch its "
            "adaptive loop there. Use gs.sharded_vmap(f, sharding=...) around the "
            f"per-trajectory function that calls {name}, which runs each device's "
            "trajectories under jax.shard_map, or a mesh with Auto axes "
            "(axis_types=(jax.sharding.AxisType.Auto,)) such as gs.ensemble_sharding()."
        ) from e


def ensemble_map(fn, in_axes: tuple, split: Split | None):
    """`jax.vmap(fn, in_axes)`, run split over `split`'s devices when given."""
    if split is None:
        return jax.vmap(fn, in_axes=in_axes)
    return lambda *args: run_sharded(fn, args, in_axes, split, vmap=True)


def replicated(tree, split: Split | None):
    """`tree` gathered onto every device of `split` (unchanged without one)."""
    if split is None:
        return tree
    sharding = NamedSharding(split.mesh, P())
    return jax.lax.with_sharding_constraint(tree, sharding)


def sharded_vmap(fn, in_axes=0, *, sharding=None):
    """`jax.vmap` over an ensemble split across devices: each device maps `fn` over
    its own trajectories.

    Use it where you would write `jax.vmap(fn)` over an ensemble on several devices
    (or hosts): around `gs.record`, `gs.diffeqsolve`, `gs.replay` of one
    trajectory, or a per-trajectory loss. Each device runs its own vmapped solve, so
    adaptive solves on different devices step independently, and no value crosses
    devices: the outputs stay split along their leading axis like the inputs. Under
    `jax.grad`, the gradient of a shared (`in_axes=None`) input is summed across
    devices, its one reduction. The values are those of `jax.vmap(fn, in_axes)`.

    An ensemble whose size the number of devices does not divide is padded with
    copies of its last trajectory, and the padding is stripped from the outputs;
    JAX holds arrays only in equal shards, so those outputs are gathered.

    **Arguments:**

    - `fn`: the per-trajectory function.
    - `in_axes`: as for `jax.vmap`, but only `0` (split over the devices) or `None`
        (shared by every trajectory, copied to every device).
    - `sharding`: where to split the ensemble: a `jax.sharding.NamedSharding` of the
        leading axis (e.g. [`gradsolve.ensemble_sharding`][]), a `jax.sharding.Mesh`
        (split over all its axes), or `None`: follow the inputs' own sharding
        (arrays placed with `jax.device_put`; inside `jax.jit` only a mesh with
        Explicit axes shows it, so pass `sharding=` there). Unsplit inputs and
        `sharding=None` give plain `jax.vmap`.

    **Returns:**

    A function of the same arguments as `jax.vmap(fn, in_axes)`, returning its
    outputs with their leading axis split like the ensemble.
    """

    @functools.wraps(fn)
    def mapped(*args):
        split = resolve_split(sharding, args, in_axes, "the ensemble")
        if split is None or batch_size(args, in_axes) == 0:
            return jax.vmap(fn, in_axes=in_axes)(*args)
        axes = in_axes if isinstance(in_axes, tuple | list) else (in_axes,) * len(args)
        return run_sharded(fn, args, tuple(axes), split, vmap=True)

    return mapped
