"""Saving a `RecordedMesh` to a file and loading it back, checked end to end.

The file is

    MAGIC (8 bytes) | format version (uint32) | header length (uint32) |
    header (UTF-8 JSON) | payload | SHA-256 digest of everything before it (32 bytes)

The header names the static fields (solver class, error norm) and the shape and dtype
of every array field; the payload is `eqx.tree_serialise_leaves` of the mesh. The
digest covers header and payload, so a flipped byte or a truncated file is reported,
never loaded as a different mesh (and so never turned into a wrong gradient).
"""

import dataclasses
import hashlib
import io
import json
import os
import struct
import sys

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._mesh import RecordedMesh


MAGIC = b"GSMESH\x00\x01"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<II")  # format version, header length
_DIGEST_BYTES = 32
_STATIC = ("norm", "solver_type")


def _qualified_name(obj, what: str) -> str:
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if module is None or "<" in name or _resolve(f"{module}:{name}") is not obj:
        raise ValueError(
            f"Cannot save a mesh whose {what} is {obj!r}: only module-level classes "
            "and functions can be named in the file. Define it at module level (not "
            "as a lambda or a nested function)."
        )
    return f"{module}:{name}"


def _resolve(qualified: str):
    """Look a `module:qualname` up among the modules already imported (a file never
    makes Python import anything)."""
    module_name, _, name = qualified.partition(":")
    obj = sys.modules.get(module_name)
    for part in name.split("."):
        obj = getattr(obj, part, None)
    return obj


def _field_spec(value) -> dict:
    if value is None:
        return {"kind": "none"}
    if isinstance(value, diffrax.RESULTS):
        leaf = np.asarray(jtu.tree_leaves(value)[0])
        return {"kind": "results", "shape": list(leaf.shape), "dtype": str(leaf.dtype)}
    leaf = np.asarray(value)
    return {"kind": "array", "shape": list(leaf.shape), "dtype": str(leaf.dtype)}


def _fields():
    return [f.name for f in dataclasses.fields(RecordedMesh) if f.name not in _STATIC]


def save_mesh(path: str | os.PathLike, mesh: RecordedMesh) -> None:
    """Save a [`gradsolve.RecordedMesh`][] to a file, to be loaded by
    [`gradsolve.load_mesh`][].

    The file records a format version, the mesh's solver class and error norm by
    name, the shape and dtype of each array, and a SHA-256 digest of its contents, so
    that loading detects a truncated or corrupted file, a file from another format
    version, and a mesh that cannot be rebuilt in this session.

    **Arguments:**

    - `path`: the file to write (overwritten if it exists).
    - `mesh`: a concrete mesh (not a tracer), e.g. from [`gradsolve.record`][],
        batched or not, trimmed or not.

    **Returns:**

    Nothing.
    """
    if not isinstance(mesh, RecordedMesh):
        raise TypeError(f"save_mesh needs a gs.RecordedMesh; got {type(mesh)}.")
    if any(isinstance(x, jax.core.Tracer) for x in jtu.tree_leaves(mesh)):
        raise ValueError(
            "save_mesh needs a concrete mesh: call it outside jax.jit/vmap/grad, on "
            "the mesh that gs.record returned."
        )
    header = {
        "solver_type": _qualified_name(mesh.solver_type, "solver class"),
        "norm": None if mesh.norm is None else _qualified_name(mesh.norm, "norm"),
        "fields": {name: _field_spec(getattr(mesh, name)) for name in _fields()},
        "x64": bool(jax.config.read("jax_enable_x64")),
    }
    payload = io.BytesIO()
    eqx.tree_serialise_leaves(payload, mesh)
    payload = payload.getvalue()
    header["payload_bytes"] = len(payload)
    header = json.dumps(header, sort_keys=True).encode()
    body = MAGIC + _PREFIX.pack(FORMAT_VERSION, len(header)) + header + payload
    with open(path, "wb") as f:
        f.write(body + hashlib.sha256(body).digest())


def _read_header(data: bytes, where: str) -> tuple[dict, bytes]:
    """Check marker, digest, version and length; return the header and payload."""
    start = len(MAGIC) + _PREFIX.size
    if not data.startswith(MAGIC[: len(data)]):
        raise ValueError(
            f"{where} is not a gradsolve mesh file (it does not start with the mesh "
            "file marker); save meshes with gs.save_mesh."
        )
    if len(data) < start + _DIGEST_BYTES:
        raise ValueError(f"{where} is truncated: it ends inside the file header.")
    version, header_len = _PREFIX.unpack(data[len(MAGIC) : start])
    body, digest = data[:-_DIGEST_BYTES], data[-_DIGEST_BYTES:]
    if hashlib.sha256(body).digest() != digest:
        try:  # an intact header tells a truncated file from a corrupted one
            header = json.loads(data[start : start + header_len].decode())
            expected = start + header_len + int(header["payload_bytes"])
            truncated = len(data) < expected + _DIGEST_BYTES
        except Exception:
            expected, truncated = None, len(data) < start + header_len + _DIGEST_BYTES
        if truncated:
            written = "" if expected is None else f" of {expected + _DIGEST_BYTES}"
            raise ValueError(
                f"{where} is truncated: it has {len(data)} bytes{written}. Save the "
                "mesh again with gs.save_mesh."
            )
        raise ValueError(
            f"{where} is corrupted: its SHA-256 checksum does not match its contents. "
            "Do not use it; save the mesh again with gs.save_mesh."
        )
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{where} has mesh format version {version}, but this gradsolve reads "
            f"version {FORMAT_VERSION}. Record the mesh again with gs.record (or "
            "load it with the gradsolve version that saved it)."
        )
    header = json.loads(body[start : start + header_len].decode())
    return header, body[start + header_len :]


def _template(header: dict, where: str):
    """A mesh with the file's structure, its arrays as shape-dtype placeholders."""
    fields = header["fields"]
    if sorted(fields) != sorted(_fields()):
        raise ValueError(
            f"{where} holds a mesh with fields {sorted(fields)}, but this gradsolve's "
            f"RecordedMesh has {sorted(_fields())}. Record the mesh again."
        )
    if any(
        spec.get("dtype") == "float64" for spec in fields.values()
    ) and not jax.config.read("jax_enable_x64"):
        raise ValueError(
            f"{where} holds a float64 mesh but float64 is disabled in this session. "
            'Enable it first with jax.config.update("jax_enable_x64", True).'
        )
    values = {}
    for name, spec in fields.items():
        if spec["kind"] == "none":
            values[name] = None
            continue
        leaf = jax.ShapeDtypeStruct(tuple(spec["shape"]), np.dtype(spec["dtype"]))
        if spec["kind"] == "results":
            treedef = jtu.tree_structure(diffrax.RESULTS.successful)
            leaf = jtu.tree_unflatten(treedef, [leaf])
        values[name] = leaf
    for name in _STATIC:
        qualified = header[name]
        values[name] = None if qualified is None else _resolve(qualified)
        if qualified is not None and values[name] is None:
            module = qualified.partition(":")[0]
            raise ValueError(
                f"{where} was recorded with {name} {qualified}, which is not defined "
                f"in this session. Import {module} before loading the mesh."
            )
    if not (
        isinstance(values["solver_type"], type)
        and issubclass(values["solver_type"], diffrax.AbstractSolver)
    ):
        raise ValueError(f"{where} names {header['solver_type']}, not a solver class.")
    return RecordedMesh(**values)


def load_mesh(path: str | os.PathLike) -> RecordedMesh:
    """Load a [`gradsolve.RecordedMesh`][] saved by [`gradsolve.save_mesh`][].

    Every byte is checked against the file's SHA-256 digest before anything is
    rebuilt, and every array against the shape and dtype the header recorded. Whether
    the mesh fits the problem it is then used for is checked by
    [`gradsolve.replay`][]: the solver class, the ensemble size, and (through its
    error estimate, see `stale=`) the tolerances the steps were chosen for.

    **Arguments:**

    - `path`: a file written by [`gradsolve.save_mesh`][].

    **Returns:**

    The saved `RecordedMesh`, with JAX arrays.

    **Raises:**

    `ValueError` naming the file and the fault: not a mesh file, another format
    version, truncated, corrupted (checksum mismatch), float64 data with float64
    disabled, or a solver class or norm that is not defined in this session.
    """
    where = f"The mesh file {os.fspath(path)!r}"
    with open(path, "rb") as f:
        data = f.read()
    header, payload = _read_header(data, where)
    like = _template(header, where)
    try:
        mesh = eqx.tree_deserialise_leaves(io.BytesIO(payload), like)
    except Exception as e:
        raise ValueError(f"{where} could not be read: {e}") from e
    for got, want in zip(jtu.tree_leaves(mesh), jtu.tree_leaves(like)):
        if got.shape != want.shape or got.dtype != want.dtype:
            raise ValueError(
                f"{where} is inconsistent: an array of shape {got.shape} and dtype "
                f"{got.dtype} where its header says {want.shape}, {want.dtype}."
            )
    return jtu.tree_map(jnp.asarray, mesh)
