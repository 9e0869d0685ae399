"""Whether a mesh fits what it is replayed with: its ensemble size, its state, and a
recording that reached `t1`.

Every check runs once per call, outside the replay's loop: structure and shapes in
Python, a concrete mesh's result codes on the host, a traced mesh's with one
`eqx.error_if`.
"""

import dataclasses

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._mesh import RecordedMesh, StateStructure


def _leaf_shapes(tree, name: str) -> list[tuple[str, tuple]]:
    leaves = jtu.tree_flatten_with_path(tree)[0]
    return [(name + jtu.keystr(path), jnp.shape(x)) for path, x in leaves]


def rows_fault(tree, name: str, batch: int | None) -> tuple[int | None, str | None]:
    """Whether every leaf of `tree` has a leading axis of `batch` (of one common
    size when `batch` is `None`). Returns the size and what is wrong (`None` if
    nothing), naming the first leaf at fault and its shape."""
    shapes = _leaf_shapes(tree, name)
    if not shapes:
        return batch, f"{name} has no arrays"
    if batch is None:
        batch = next((s[0] for _, s in shapes if s), None)
    scalars = [path for path, shape in shapes if not shape]
    if scalars:
        return batch, f"{scalars[0]} is a scalar (shape ())"
    sizes = sorted({shape[0] for _, shape in shapes})
    if sizes == [batch]:
        return batch, None
    path, shape = next((p, s) for p, s in shapes if s[0] != batch)
    detail = f" ({path} has shape {shape})" if len(shapes) > 1 else ""
    return batch, f"{name} has leading axis sizes {sizes}{detail}"


def check_batch(mesh: RecordedMesh, y0, args, args_axes) -> None:
    """A batched mesh's `y0` (and `args` with `args_axes=0`) have one row per
    recorded trajectory."""
    batch = mesh.ts.shape[0]
    _, fault = rows_fault(y0, "y0", batch)
    if fault is not None:
        raise ValueError(
            f"The mesh holds {batch} trajectories but {fault}: pass one initial "
            f"state per recorded trajectory (every leaf of y0 with leading axis "
            f"{batch}), or record a mesh for this ensemble with gs.record."
        )
    if args_axes == 0:
        _, fault = rows_fault(args, "args", batch)
        if fault is not None:
            raise ValueError(
                f"The mesh holds {batch} trajectories but {fault}, with "
                "args_axes=0: pass one set of args per trajectory (every leaf with "
                f"leading axis {batch}), or args_axes=None to share them."
            )


def check_state(mesh: RecordedMesh, y0: list, treedef, dtypes: bool = True) -> None:
    """`y0` (one trajectory's leaves) has the recorded state's structure and shapes,
    and with `dtypes` (once promoted as the recording promoted it) its dtypes."""
    got = StateStructure.of(y0, treedef)
    if not dtypes:
        got = dataclasses.replace(got, dtypes=mesh.state.dtypes)
    if got == mesh.state:
        return
    raise ValueError(
        f"This mesh was recorded for a state {mesh.state.describe()}{_span(mesh)}, "
        f"but y0 is {got.describe()}. A mesh fits only the problem it was recorded "
        "for: replay it with a y0 like the recorded one (one trajectory's y0 per row "
        "of a batched mesh), or record a mesh for this problem with gs.record."
    )


def _span(mesh: RecordedMesh) -> str:
    """`" over [t0, t1]"` of an unbatched concrete mesh, else `""`."""
    if mesh.is_batched or isinstance(mesh.t0, jax.core.Tracer):
        return ""
    return f" over [{float(mesh.t0):.6g}, {float(mesh.t1):.6g}]"


_FIX = (
    "raise max_steps, loosen rtol/atol, or use gs.Rodas5 if the problem is stiff; "
    "or pass allow_partial=True to replay the part that was recorded"
)
TRACED_FAILURE = (
    "This mesh comes from a recording that failed (mesh.result is not successful): "
    "it stops before t1, and so would its replay. Record it again (" + _FIX + ")."
)


def _result_name(code: int) -> str:
    names = getattr(diffrax.RESULTS, "_name_to_item", {})
    for name, item in names.items():
        if int(np.asarray(jtu.tree_leaves(item)[0])) == code:
            return name
    return f"result code {code}"


def failed_rows(mesh: RecordedMesh) -> np.ndarray:
    """The rows (flattened) of a concrete mesh whose recording did not succeed,
    compared on the host: the result codes are copied there anyway, and an eager
    comparison on the device is one more dispatch per recording."""
    (codes,) = jtu.tree_leaves(mesh.result)
    return _unsuccessful(np.asarray(codes))


def _unsuccessful(codes: np.ndarray) -> np.ndarray:
    """The (flattened) positions of result codes on the host other than success."""
    (successful,) = jtu.tree_leaves(diffrax.RESULTS.successful)
    return np.flatnonzero(codes != np.asarray(successful))


def check_complete(mesh: RecordedMesh) -> bool:
    """Raise if a concrete mesh holds a failed recording. Returns whether it was
    checked: `False` for a traced mesh (check it with `error_if_incomplete`)."""
    codes = jtu.tree_leaves(mesh.result)[0]
    if isinstance(codes, jax.core.Tracer):
        return False
    if isinstance(codes, jax.Array) and not codes.is_fully_addressable:
        # Across hosts: count where the codes lie; no process holds them all.
        count = int(jnp.sum(codes != 0))
        if count:
            raise ValueError(
                f"{count} of {codes.size} trajectories of this mesh come from "
                "recordings that failed (see mesh.result): their replays stop "
                f"before t1. Record them again ({_FIX})."
            )
        return True
    codes = np.asarray(codes).reshape(-1)
    failed = _unsuccessful(codes)
    if failed.size == 0:
        return True
    row = int(failed[0])
    code = int(codes[row])
    reached = float(np.asarray(mesh.ts).reshape(codes.size, -1)[row, -1])
    t0 = float(np.asarray(mesh.t0).reshape(-1)[row])
    t1 = float(np.asarray(mesh.t1).reshape(-1)[row])
    where = f"{_result_name(code)} at t={reached:.6g} of [{t0:.6g}, {t1:.6g}]"
    if mesh.is_batched:
        what = (
            f"{failed.size} of {codes.size} trajectories of this mesh come from "
            f"recordings that failed (the first, row {row}: {where}): their replays "
            "would stop there too. Record them again"
        )
    else:
        what = (
            f"This mesh comes from a recording that failed ({where}): a replay over "
            "it would stop there too. Record it again"
        )
    raise ValueError(f"{what} ({_FIX}).")


def error_if_incomplete(tree, mesh: RecordedMesh):
    """`tree`, with an error (also inside `jit`) if `mesh`'s recording failed."""
    return eqx.error_if(tree, mesh.result != diffrax.RESULTS.successful, TRACED_FAILURE)
