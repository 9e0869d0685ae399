"""Saving a `RecordedMesh` to a file and loading it back, checked end to end.

The file is

    MAGIC (8 bytes) | format version (uint32) | header length (uint32) |
    header (UTF-8 JSON) | payload | SHA-256 digest of everything before it (32 bytes)

The header holds the static fields (solver class and error norm, named from the
allow-list of `_mesh_names`; the recorded state's structure, shapes and dtypes) and
the shape and dtype of every array field (`t0`, `t1` and `result` included); the
payload is `eqx.tree_serialise_leaves` of the mesh. The digest covers header and
payload, so a flipped byte or a truncated file is reported, never loaded as a
different mesh (and so never turned into a wrong gradient). A file is replaced
whole (written beside it, then renamed over it): a failed save leaves the previous
file as it was, and a reader never sees half a file.
"""

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import secrets
import stat
import struct

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._mesh import RecordedMesh, StateStructure
from ._mesh_names import name_of, resolve


MAGIC = b"GSMESH\x00\x01"
# 2: solver classes and norms named from an allow-list ("gradsolve:Tsit5"); the
# recording's t0, t1 and state structure. (Version 1 files are refused, by version.)
FORMAT_VERSION = 2
_PREFIX = struct.Struct("<II")  # format version, header length
_DIGEST_BYTES = 32
_STATIC = ("norm", "solver_type", "state", "length")


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
    version, and a mesh that cannot be rebuilt in this session. A solver class or
    norm of your own must be registered with [`gradsolve.register_mesh_name`][].

    The file is replaced whole: the mesh is written to a temporary file in the same
    folder, flushed to disk, and renamed over `path`. A save that fails (disk full, a
    file-size limit, a killed process) leaves the previous file byte for byte, and a
    reader sees either the previous file or the new one, never part of one.

    **Arguments:**

    - `path`: the file to write (replaced if it exists).
    - `mesh`: a concrete mesh (not a tracer), e.g. from [`gradsolve.record`][],
        batched or not, trimmed or not.

    **Returns:**

    Nothing.

    **Raises:**

    `OSError` saying why the file could not be written (the previous one is kept).
    """
    if not isinstance(mesh, RecordedMesh):
        raise TypeError(f"save_mesh needs a gs.RecordedMesh; got {type(mesh)}.")
    if any(isinstance(x, jax.core.Tracer) for x in jtu.tree_leaves(mesh)):
        raise ValueError(
            "save_mesh needs a concrete mesh: call it outside jax.jit/vmap/grad, on "
            "the mesh that gs.record returned."
        )
    mesh = mesh.cut()  # The file holds the steps a replay takes.
    header = {
        "solver_type": name_of(mesh.solver_type, "solver class"),
        "norm": None if mesh.norm is None else name_of(mesh.norm, "norm"),
        "state": dataclasses.asdict(mesh.state),
        "fields": {name: _field_spec(getattr(mesh, name)) for name in _fields()},
        "x64": bool(jax.config.read("jax_enable_x64")),
    }
    payload = io.BytesIO()
    eqx.tree_serialise_leaves(payload, mesh)
    payload = payload.getvalue()
    header["payload_bytes"] = len(payload)
    header = json.dumps(header, sort_keys=True).encode()
    body = MAGIC + _PREFIX.pack(FORMAT_VERSION, len(header)) + header + payload
    _replace_file(path, body + hashlib.sha256(body).digest())


def _replace_file(path, data: bytes) -> None:
    """Replace `path` by a file holding `data`, all at once (see `save_mesh`)."""
    shown = os.fspath(path)
    # Through a symbolic link, the file it points to is replaced (as an in-place
    # write would); the link stays.
    target = os.path.realpath(path)
    folder, name = os.path.split(target)
    temporary = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.tmp")
    try:
        # Created as `open(path, "w")` would be: 0o666 less the umask.
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise _os_error(
            e,
            f"Cannot save the mesh to {shown!r}: a temporary file cannot be created "
            f"in {folder!r} ({e.strerror or e}). Check that the folder exists and is "
            "writable.",
        ) from e
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileNotFoundError):
            os.chmod(temporary, stat.S_IMODE(os.stat(target).st_mode))
        os.replace(temporary, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if not isinstance(e, OSError):
            raise
        raise _os_error(
            e,
            f"Saving the mesh to {shown!r} failed: {e.strerror or e} (writing "
            f"{len(data):,} bytes). The previous file, if any, is unchanged. Free "
            "disk space or raise the file-size limit, then save again.",
        ) from e
    _sync_folder(folder)


def _os_error(e: OSError, message: str) -> OSError:
    """An error of `e`'s kind and number with `message`."""
    return OSError(message) if e.errno is None else OSError(e.errno, message)


def _sync_folder(folder: str) -> None:
    """Flush the rename to disk too (where the file system allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _malformed(where: str, detail: str) -> ValueError:
    return ValueError(
        f"{where} has a malformed header: {detail}. It was not written by "
        "gs.save_mesh (or was altered); save the mesh again with gs.save_mesh."
    )


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
    if start + header_len > len(body):
        raise _malformed(where, f"its length ({header_len}) runs past the file's end")
    try:
        header = json.loads(body[start : start + header_len].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _malformed(where, f"it is not UTF-8 JSON ({e})") from e
    if not isinstance(header, dict):
        raise _malformed(where, f"it is a JSON {type(header).__name__}, not an object")
    payload = body[start + header_len :]
    if header.get("payload_bytes") != len(payload):
        raise _malformed(
            where,
            f"payload_bytes is {header.get('payload_bytes')!r} but the payload has "
            f"{len(payload)} bytes",
        )
    return header, payload


# The dtypes a mesh's arrays can have: times, counts, flags and result codes.
_DTYPES = ("bool", "int32", "int64", "float16", "bfloat16", "float32", "float64")


def _array_template(name: str, spec, where: str):
    """A shape-dtype placeholder for one field, from its (checked) header entry."""
    kinds = ("none", "array", "results")
    if not isinstance(spec, dict) or spec.get("kind") not in kinds:
        raise _malformed(where, f"field {name!r} has the entry {spec!r}")
    if spec["kind"] == "none":
        return None
    shape, dtype = spec.get("shape"), spec.get("dtype")
    if not (
        isinstance(shape, list)
        and len(shape) <= 8
        and all(type(n) is int and n >= 0 for n in shape)
    ):
        raise _malformed(where, f"field {name!r} has the shape {shape!r}")
    if dtype not in _DTYPES:
        raise _malformed(where, f"field {name!r} has the dtype {dtype!r}")
    leaf = jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))
    if spec["kind"] == "results":
        treedef = jtu.tree_structure(diffrax.RESULTS.successful)
        leaf = jtu.tree_unflatten(treedef, [leaf])
    return leaf


def _check_shapes(values: dict, where: str) -> None:
    """The per-trajectory fields have the batch shape of `ts` (one or none)."""
    ts = values["ts"]
    if ts is None or len(ts.shape) == 0 or ts.shape[-1] == 0:
        shape = getattr(ts, "shape", None)
        raise _malformed(where, f"its step times have the shape {shape}")
    batch = ts.shape[:-1]
    for name in ("num_steps", "result", "t0", "t1"):
        leaves = jtu.tree_leaves(values[name])
        shape = leaves[0].shape if leaves else None
        if shape != batch:
            raise _malformed(
                where, f"{name} has the shape {shape} for step times of {ts.shape}"
            )


def _check_values(mesh: RecordedMesh, where: str) -> None:
    """Result codes and step counts a replay can use."""
    codes = np.asarray(jtu.tree_leaves(mesh.result)[0])
    if codes.size and (codes.min() < 0 or codes.max() >= len(diffrax.RESULTS)):
        raise ValueError(
            f"{where} is inconsistent: it holds result codes outside diffrax.RESULTS "
            f"(0 to {len(diffrax.RESULTS) - 1}). Record the mesh again."
        )
    steps = np.asarray(mesh.num_steps)
    if steps.size and (steps.min() < 0 or steps.max() > mesh.max_steps):
        raise ValueError(
            f"{where} is inconsistent: it counts {steps.max()} or {steps.min()} "
            f"steps in a mesh of {mesh.max_steps}. Record the mesh again."
        )


def _state(spec, where: str) -> StateStructure:
    """The recorded state's structure, from its (checked) header entry."""
    try:
        treedef, shapes, dtypes = spec["treedef"], spec["shapes"], spec["dtypes"]
        ok = (
            isinstance(treedef, str)
            and len(shapes) == len(dtypes) > 0
            and all(isinstance(d, str) and jnp.dtype(d).kind in "fc" for d in dtypes)
            and all(
                isinstance(s, list) and all(type(n) is int and n >= 0 for n in s)
                for s in shapes
            )
        )
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise _malformed(where, f"its state structure is {spec!r}")
    return StateStructure(treedef, tuple(tuple(s) for s in shapes), tuple(dtypes))


def _template(header: dict, where: str):
    """A mesh with the file's structure, its arrays as shape-dtype placeholders."""
    fields = header.get("fields")
    if not isinstance(fields, dict):
        raise _malformed(where, "it has no table of fields")
    if sorted(fields) != sorted(_fields()):
        raise ValueError(
            f"{where} holds a mesh with fields {sorted(fields)}, but this gradsolve's "
            f"RecordedMesh has {sorted(_fields())}. Record the mesh again."
        )
    values = {name: _array_template(name, spec, where) for name, spec in fields.items()}
    _check_shapes(values, where)
    if any(
        spec.get("dtype") == "float64" for spec in fields.values()
    ) and not jax.config.read("jax_enable_x64"):
        raise ValueError(
            f"{where} holds a float64 mesh but float64 is disabled in this session. "
            'Enable it first with jax.config.update("jax_enable_x64", True).'
        )
    solver_type = resolve(header.get("solver_type"), "solver class", where)
    if not (
        isinstance(solver_type, type)
        and issubclass(solver_type, diffrax.AbstractSolver)
    ):
        raise ValueError(
            f"{where} names {header.get('solver_type')!r} as its solver class, but "
            "that name stands for something else in this session (registered with "
            "gs.register_mesh_name); register the solver class under it."
        )
    values["solver_type"] = solver_type
    values["state"] = _state(header.get("state"), where)
    norm = header.get("norm")
    values["norm"] = None if norm is None else resolve(norm, "norm", where)
    if isinstance(values["norm"], type) or not (
        values["norm"] is None or callable(values["norm"])
    ):
        raise ValueError(
            f"{where} names {norm!r} as its norm, but that name stands for "
            f"{values['norm']!r}, not a norm function. Save the mesh again."
        )
    return RecordedMesh(**values)


def load_mesh(path: str | os.PathLike) -> RecordedMesh:
    """Load a [`gradsolve.RecordedMesh`][] saved by [`gradsolve.save_mesh`][].

    Every byte is checked against the file's SHA-256 digest before anything is
    rebuilt, and every array against the shape and dtype the header recorded. The
    solver class and norm the file names are looked up among gradsolve's solvers,
    Optimistix's norms and the objects registered with
    [`gradsolve.register_mesh_name`][]: loading never imports a module. Whether the
    mesh fits the problem it is then used for is checked by [`gradsolve.replay`][]:
    the solver class, the ensemble size, and (through its error estimate, see
    `stale=`) the tolerances the steps were chosen for.

    **Arguments:**

    - `path`: a file written by [`gradsolve.save_mesh`][].

    **Returns:**

    The saved `RecordedMesh`, with JAX arrays.

    **Raises:**

    `ValueError` naming the file and the fault: not a mesh file, another format
    version, truncated, corrupted (checksum mismatch), a malformed header, float64
    data with float64 disabled, or a solver class or norm that a mesh file may not
    name (not registered in this session).
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
    _check_values(mesh, where)
    return jtu.tree_map(jnp.asarray, mesh)
