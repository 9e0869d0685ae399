"""Diffrax's results, computed once and stored with the tests.

Most tests compare gradsolve with Diffrax, and compiling Diffrax's programs (its
gradients above all) was a large share of the default suite's time. A test asks for
a reference by name, with the function that computes it from Diffrax:

    references = StoredReferences(__file__)
    want = references("lorenz-gradient", lambda: jax.grad(diffrax_loss)(y0, args))

and gets the value stored in `tests/references/<test module>.npz`. The environment
variable `GRADSOLVE_REFERENCES` chooses what happens instead:

- unset or `stored`: the stored value; a name that is not stored is an error that
  says how to store it;
- `recompute`: Diffrax computes the value afresh, it must equal the stored one to
  round-off (or to the tolerance a test gives a value that round-off decides, such
  as where an optimiser stops), and the test runs against the fresh value. The
  long test `test_references.py` runs every module with stored references this
  way, so the stored values stay Diffrax's (of the installed version) and never
  drift;
- `update`: Diffrax computes the value and it is stored (run a module alone, with
  `-n 0`, after adding or changing a reference).

Values are pytrees of dicts, tuples, lists, `None` and arrays, stored as NumPy
arrays with their structure as JSON, so a stored value is bit for bit what Diffrax
returned.
"""

import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


MODES = ("stored", "recompute", "update")
# Stored and recomputed values may differ by the round-off of a different CPU's code.
RECOMPUTE_RTOL = 1e-12


def mode() -> str:
    value = os.environ.get("GRADSOLVE_REFERENCES", "stored")
    if value not in MODES:
        raise ValueError(f"GRADSOLVE_REFERENCES={value!r}: use one of {MODES}.")
    return value


def _encode(tree, arrays: list) -> Any:
    if tree is None:
        return None
    if isinstance(tree, dict):
        return {"dict": {str(k): _encode(v, arrays) for k, v in tree.items()}}
    if isinstance(tree, (tuple, list)):
        kind = "tuple" if isinstance(tree, tuple) else "list"
        return {kind: [_encode(v, arrays) for v in tree]}
    if not isinstance(tree, (np.ndarray, np.generic, jax.Array, bool, int, float)):
        raise TypeError(f"Store arrays, not {type(tree).__name__}: unpack it first.")
    arrays.append(np.asarray(tree))
    return {"array": len(arrays) - 1}


def _decode(spec, arrays) -> Any:
    if spec is None:
        return None
    ((kind, value),) = spec.items()
    if kind == "dict":
        return {k: _decode(v, arrays) for k, v in value.items()}
    if kind in ("tuple", "list"):
        items = [_decode(v, arrays) for v in value]
        return tuple(items) if kind == "tuple" else items
    return arrays[f"a{value}"]


def result_message(results, result) -> np.ndarray:
    """The message of `result`, a code of `results` (`diffrax.RESULTS` or
    `optimistix.RESULTS`; empty for success): the form in which a result is stored
    and compared."""
    return np.asarray(str(results[result]))


def assert_same(
    fresh, stored, name: str, rtol: float = RECOMPUTE_RTOL, count_slack: int = 0
):
    """`fresh` and `stored` have the same structure, shapes and dtypes, floating
    values equal to `rtol` of each array's largest magnitude and integer values
    (counts) within `count_slack` of each other."""
    fresh_leaves, fresh_structure = jax.tree.flatten(fresh)
    stored_leaves, stored_structure = jax.tree.flatten(stored)
    assert fresh_structure == stored_structure, (name, fresh_structure)
    for x, y in zip(fresh_leaves, stored_leaves):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype, (name, x.dtype, y.dtype)
        if np.issubdtype(y.dtype, np.integer):
            difference = np.abs(x.astype(np.int64) - y.astype(np.int64))
            assert np.all(difference <= count_slack), (
                f"Diffrax's {name!r} changed: {x} against {y} (slack {count_slack})"
            )
            continue
        if not np.issubdtype(y.dtype, np.inexact):
            np.testing.assert_array_equal(x, y, err_msg=name)
            continue
        finite = np.isfinite(y)
        np.testing.assert_array_equal(np.isfinite(x), finite, err_msg=name)
        np.testing.assert_array_equal(x[~finite], y[~finite], err_msg=name)
        if finite.any():
            scale = np.max(np.abs(y[finite]))
            error = np.max(np.abs(x[finite] - y[finite]))
            assert error <= rtol * scale, (
                f"Diffrax's {name!r} changed: {error:.3g} against {scale:.3g}; if "
                "Diffrax changed on purpose, store it again (GRADSOLVE_REFERENCES="
                "update)."
            )


class StoredReferences:
    """Diffrax's results for one test module (see the module's docstring)."""

    def __init__(self, test_file: str):
        test_file = pathlib.Path(test_file)
        self.test_file = test_file
        self.path = test_file.parent / "references" / f"{test_file.stem}.npz"
        self._values = None

    def _load(self) -> dict:
        if self._values is None:
            self._values = {}
            if self.path.exists():
                with np.load(self.path) as arrays:
                    structure = json.loads(str(arrays["structure"]))
                    loaded = {k: arrays[k] for k in arrays.files}
                self._values = {k: _decode(s, loaded) for k, s in structure.items()}
        return self._values

    def _save(self):
        arrays, structure = [], {}
        for name, value in sorted(self._values.items()):
            structure[name] = _encode(value, arrays)
        self.path.parent.mkdir(exist_ok=True)
        np.savez_compressed(
            self.path,
            structure=np.array(json.dumps(structure, sort_keys=True)),
            **{f"a{i}": a for i, a in enumerate(arrays)},
        )

    def __call__(
        self,
        name: str,
        compute: Callable[[], Any],
        rtol: float = RECOMPUTE_RTOL,
        count_slack: int = 0,
    ) -> Any:
        """The reference called `name`; `compute()` returns it from Diffrax.

        `rtol` and `count_slack` say how far a recomputed value may be from the
        stored one (see `assert_same`): round-off for most references, more for
        a value that round-off decides, such as where an optimiser stops.
        """
        values = self._load()
        how = mode()
        if how == "stored":
            if name not in values:
                raise LookupError(
                    f"No stored Diffrax reference {name!r} in {self.path}. Store it: "
                    f"GRADSOLVE_REFERENCES=update python -m pytest {self.test_file} "
                    "-n 0"
                )
            return values[name]
        fresh = jax.tree.map(np.asarray, compute())
        if how == "recompute":
            if name not in values:
                raise LookupError(f"{name!r} is not stored in {self.path}.")
            assert_same(fresh, values[name], name, rtol, count_slack)
        else:
            values[name] = fresh
            self._save()
        return fresh
