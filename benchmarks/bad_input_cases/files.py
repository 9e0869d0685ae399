"""Family `files`: damaged, crafted and misplaced mesh files.

A good file written by `gs.save_mesh` is truncated, has a bit flipped, or has its
header rewritten (with the digest recomputed, so that only the content is at
fault); then `gs.load_mesh` reads it. Also paths that are folders or missing, and
things that are not meshes.
"""

import atexit
import hashlib
import json
import os
import pathlib
import re
import shutil
import struct
import tempfile
from collections.abc import Callable

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

import gradsolve as gs

from .case import Case
from .defaults import Y0
from .fixtures import base_mesh


MAGIC_LEN, PREFIX = 8, struct.Struct("<II")


def _parts(data: bytes):
    version, length = PREFIX.unpack(data[MAGIC_LEN : MAGIC_LEN + PREFIX.size])
    start = MAGIC_LEN + PREFIX.size
    header = data[start : start + length]
    payload = data[start + length : -32]
    return data[:MAGIC_LEN], version, header, payload


def _assemble(magic, version, header: bytes, payload: bytes, length=None) -> bytes:
    """A mesh file with a recomputed digest (so only the content is at fault)."""
    length = len(header) if length is None else length
    body = magic + PREFIX.pack(version, length) + header + payload
    return body + hashlib.sha256(body).digest()


def _edit_header(data: bytes, edit) -> bytes:
    magic, version, header, payload = _parts(data)
    header = json.loads(header)
    edit(header)
    return _assemble(magic, version, json.dumps(header).encode(), payload)


def _flip(data: bytes, index: int) -> bytes:
    out = bytearray(data)
    out[index] ^= 0x10
    return bytes(out)


class Files:
    """A folder with a good mesh file, and a damaged copy of it per case."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="gs_bad_inputs_")
        atexit.register(shutil.rmtree, self.folder, True)
        self._good = None

    def good(self) -> bytes:
        if self._good is None:
            path = os.path.join(self.folder, "good.gsmesh")
            gs.save_mesh(path, base_mesh())
            self._good = pathlib.Path(path).read_bytes()
        return self._good

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name + ".gsmesh")

    def load(self, name: str, damage: Callable[[bytes], bytes]) -> Callable:
        def call():
            path = self.path(name)
            pathlib.Path(path).write_bytes(damage(self.good()))
            return gs.load_mesh(path).ts

        return call


def _set(header, keys, value):
    node = header
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value


def _saved(files: Files, name: str, change) -> Callable:
    """Save an altered (but well-formed) mesh with gs.save_mesh, then load it."""

    def call():
        path = files.path(name)
        gs.save_mesh(path, change(base_mesh()))
        return gs.load_mesh(path).ts

    return call


def files_cases() -> list[Case]:
    """The cases of family `files`, in the order they are run.

    Each call builds a fresh folder of files (removed at exit).
    """
    files = Files()
    header_at = MAGIC_LEN + PREFIX.size + 4

    def damaged(name, what, damage, detail):
        path = files.path(name)
        return Case(
            "files",
            name,
            f"gs.load_mesh of a mesh file {what}",
            files.load(name, damage),
            "error",
            re.escape(path) + ".*" + detail,
            errors=(ValueError,),
        )

    def header_edit(keys, value):
        return lambda d: _edit_header(d, lambda h: _set(h, keys, value))

    cases = [
        damaged("truncated", "without its last 100 bytes", lambda d: d[:-100], "trunc"),
        damaged("truncated-10", "cut to 10 bytes", lambda d: d[:10], "trunc"),
        damaged("empty", "of 0 bytes", lambda d: b"", "trunc|empty|not a"),
        damaged(
            "flipped-payload",
            "with a bit flipped in the payload",
            lambda d: _flip(d, len(d) - 100),
            "corrupt",
        ),
        damaged(
            "flipped-header",
            "with a bit flipped in the header",
            lambda d: _flip(d, header_at),
            "corrupt",
        ),
        damaged(
            "flipped-digest",
            "with a bit flipped in the digest",
            lambda d: _flip(d, len(d) - 1),
            "corrupt",
        ),
        damaged(
            "wrong-magic",
            "whose marker is b'NOTAMESH'",
            lambda d: b"NOTAMESH" + d[MAGIC_LEN:],
            "not a gradsolve mesh file",
        ),
        damaged(
            "norm-sys-exit",
            "whose header names 'sys:exit' as norm (digest recomputed)",
            header_edit(["norm"], "sys:exit"),
            "sys:exit",
        ),
        damaged(
            "solver-os-system",
            "whose header names 'os:system' as solver (digest recomputed)",
            header_edit(["solver_type"], "os:system"),
            "os:system",
        ),
        damaged(
            "norm-builtins-eval",
            "whose header names 'builtins:eval' as norm (digest recomputed)",
            header_edit(["norm"], "builtins:eval"),
            "builtins:eval",
        ),
        damaged(
            "norm-number",
            "whose header has 42 as norm (digest recomputed)",
            header_edit(["norm"], 42),
            "norm|malformed",
        ),
        damaged(
            "version-1",
            "of format version 1 (digest recomputed)",
            lambda d: _assemble(_parts(d)[0], 1, *_parts(d)[2:]),
            "version",
        ),
        damaged(
            "version-99",
            "of format version 99 (digest recomputed)",
            lambda d: _assemble(_parts(d)[0], 99, *_parts(d)[2:]),
            "version",
        ),
        damaged(
            "header-not-utf8",
            "whose header is not UTF-8 (digest recomputed)",
            lambda d: _assemble(_parts(d)[0], 2, b"\xff\xfe{", _parts(d)[3]),
            "malformed",
        ),
        damaged(
            "header-a-list",
            "whose header is the JSON list [] (digest recomputed)",
            lambda d: _assemble(_parts(d)[0], 2, b"[]", _parts(d)[3]),
            "malformed",
        ),
        damaged(
            "header-length-past-end",
            "whose header length runs past the end (digest recomputed)",
            lambda d: _assemble(*_parts(d), length=10**6),
            "malformed|trunc",
        ),
        damaged(
            "payload-bytes-wrong",
            "whose header misstates payload_bytes (digest recomputed)",
            header_edit(["payload_bytes"], 3),
            "malformed|payload",
        ),
        damaged(
            "ts-shape-wrong",
            "whose header gives ts the shape [3] (digest recomputed)",
            header_edit(["fields", "ts", "shape"], [3]),
            "malformed|inconsistent|could not be read",
        ),
        damaged(
            "ts-shape-negative",
            "whose header gives ts the shape [-1] (digest recomputed)",
            header_edit(["fields", "ts", "shape"], [-1]),
            "malformed",
        ),
        damaged(
            "dtype-object",
            "whose header gives ts the dtype 'object' (digest recomputed)",
            header_edit(["fields", "ts", "dtype"], "object"),
            "malformed",
        ),
        damaged(
            "state-missing",
            "whose header has no state (digest recomputed)",
            lambda d: _edit_header(d, lambda h: h.pop("state")),
            "malformed|state",
        ),
        damaged(
            "state-int-dtype",
            "whose header records an int32 state (digest recomputed)",
            header_edit(["state", "dtypes"], ["int32"]),
            "malformed|state",
        ),
        damaged(
            "fields-extra",
            "whose header lists an extra field (digest recomputed)",
            header_edit(["fields", "extra"], {"kind": "none"}),
            "fields",
        ),
        damaged(
            "fields-not-a-table",
            "whose header's fields is a string (digest recomputed)",
            header_edit(["fields"], "ts"),
            "malformed|fields",
        ),
    ]
    too_many = lambda m: eqx.tree_at(lambda m: m.num_steps, m, jnp.asarray(10**6))
    bad_code = lambda m: eqx.tree_at(
        lambda m: m.result, m, jtu.tree_map(lambda c: jnp.full_like(c, 99), m.result)
    )
    for name, change, detail in (
        ("num-steps-past-end", too_many, "inconsistent|steps"),
        ("result-code-99", bad_code, "inconsistent|result"),
    ):
        path = files.path(name)
        cases.append(
            Case(
                "files",
                name,
                f"gs.load_mesh of gs.save_mesh(mesh with {name.replace('-', ' ')})",
                _saved(files, name, change),
                "error",
                re.escape(path) + ".*" + detail,
                errors=(ValueError,),
            )
        )
    folder = files.folder
    missing = os.path.join(folder, "missing.gsmesh")
    nowhere = os.path.join(folder, "no-such-folder", "mesh.gsmesh")
    cases += [
        Case(
            "files",
            "a directory as path (load)",
            f"gs.load_mesh({folder!r}), a directory",
            lambda: gs.load_mesh(folder).ts,
            "error",
            re.escape(folder),
            errors=(ValueError, IsADirectoryError),
        ),
        Case(
            "files",
            "a missing file (load)",
            f"gs.load_mesh({missing!r}), no such file",
            lambda: gs.load_mesh(missing).ts,
            "error",
            re.escape(missing),
            errors=(ValueError, FileNotFoundError),
        ),
        Case(
            "files",
            "a directory as path (save)",
            f"gs.save_mesh({folder!r}, mesh), a directory",
            lambda: gs.save_mesh(folder, base_mesh()),
            "error",
            re.escape(folder),
            errors=(ValueError, OSError),
        ),
        Case(
            "files",
            "a missing folder (save)",
            f"gs.save_mesh({nowhere!r}, mesh)",
            lambda: gs.save_mesh(nowhere, base_mesh()),
            "error",
            r"no-such-folder",
            errors=(ValueError, OSError),
        ),
        Case(
            "files",
            "not a mesh (save)",
            "gs.save_mesh(path, {'ts': array})",
            lambda: gs.save_mesh(files.path("dict"), {"ts": Y0}),
            "error",
            r"RecordedMesh",
        ),
        Case(
            "files",
            "a traced mesh (save inside jit)",
            "jax.jit(lambda m: gs.save_mesh(path, m))(mesh)",
            lambda: eqx.filter_jit(lambda m: gs.save_mesh(files.path("jit"), m))(
                base_mesh()
            ),
            "error",
            r"concrete",
        ),
        Case(
            "files",
            "control: save and load",
            "gs.load_mesh(gs.save_mesh(path, mesh)) against mesh",
            lambda: _round_trip(files),
            "answer",
            reference=lambda: jtu.tree_leaves(base_mesh()),
            rtol=0.0,
        ),
    ]
    return cases


def _round_trip(files: Files):
    path = files.path("round-trip")
    gs.save_mesh(path, base_mesh())
    return jtu.tree_leaves(gs.load_mesh(path))
