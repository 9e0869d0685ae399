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


def check_rows(tree, name: str, batch: int | None, fix: str) -> int:
    """Every leaf of `tree` has a leading axis of `batch` (of one common size when
    `batch` is `None`); returns that size. The error names the first leaf that
    differs and its shape."""
    shapes = _leaf_shapes(tree, name)
    if not shapes:
        raise ValueError(f"{name} has no arrays; {fix}")
    if batch is None:
        batch = next((s[0] for _, s in shapes if s), None)
    for path, shape in shapes:
        if not shape:
            raise ValueError(
                f"{name} needs a leading batch axis on every leaf, but {path} is a "
                f"scalar (shape ()); {fix}"
            )
        if shape[0] != batch:
            sizes = sorted({s[0] for _, s in shapes if s})
            raise ValueError(
                f"{name} has leading axis sizes {sizes} ({path} has shape {shape}), "
                f"where {batch} is needed; {fix}"
            )
    return batch


def check_batch(mesh: RecordedMesh, y0, args, args_axes) -> None:
    """A batched mesh's `y0` (and `args` with `args_axes=0`) have one row per
    recorded trajectory."""
    batch = mesh.ts.shape[0]
    try:
        check_rows(
            y0,
            "y0",
            batch,
            "pass one initial state per recorded trajectory (y0 with leading axis "
            f"{batch}), or record a mesh for this ensemble with gs.record.",
        )
        if args_axes == 0:
            check_rows(
                args,
                "args (args_axes=0)",
                batch,
                "pass one set of args per trajectory, or args_axes=None to share "
                "them.",
            )
    except ValueError as e:
        raise ValueError(f"The mesh holds {batch} trajectories but {e}") from None


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
    failed = np.flatnonzero(codes != 0)
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
