"""The stored Diffrax references (`references.py`) are what the installed Diffrax
computes: every module that stores some runs again with each one recomputed."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from . import references
from .xla_settings import optimised


TESTS = pathlib.Path(__file__).parent


def _modules_with_references() -> list[str]:
    stored = sorted((TESTS / "references").glob("test_*.npz"))
    return [str(TESTS / f"{path.stem}.py") for path in stored]


def test_every_stored_module_exists():
    modules = _modules_with_references()
    assert modules
    assert all(pathlib.Path(m).exists() for m in modules)


def test_round_trip_keeps_structure_and_bits(tmp_path, monkeypatch):
    stored = references.StoredReferences(str(tmp_path / "test_example.py"))
    value = {"a": (np.array([1.0, np.inf]), None), "b": [np.float32(0.1), 3]}
    monkeypatch.setenv("GRADSOLVE_REFERENCES", "update")
    stored("case", lambda: value)
    monkeypatch.delenv("GRADSOLVE_REFERENCES")
    fresh = references.StoredReferences(str(tmp_path / "test_example.py"))
    loaded = fresh("case", None)
    assert isinstance(loaded["a"], tuple) and loaded["a"][1] is None
    np.testing.assert_array_equal(loaded["a"][0], value["a"][0])
    assert loaded["b"][0].dtype == np.float32 and loaded["b"][0] == np.float32(0.1)
    with pytest.raises(LookupError, match="GRADSOLVE_REFERENCES=update"):
        fresh("missing", None)


def test_a_changed_reference_is_reported():
    with pytest.raises(AssertionError, match="changed"):
        references.assert_same(np.array([1.0, 2.0]), np.array([1.0, 2.0 + 1e-9]), "x")
    references.assert_same(np.array([1.0, 2.0]), np.array([1.0, 2.0 + 1e-13]), "x")
    with pytest.raises(AssertionError):
        references.assert_same(np.array([1.0, np.inf]), np.array([1.0, 2.0]), "x")


@pytest.mark.slow
def test_stored_references_are_what_diffrax_computes():
    # Recomputed as they were stored, with XLA's optimisations (which the default
    # suite turns off, `conftest.py`): the comparison is to round-off.
    env = optimised(dict(os.environ, GRADSOLVE_REFERENCES="recompute"))
    modules = _modules_with_references()
    # The slow tests too: they read stored references of their own.
    command = [sys.executable, "-m", "pytest", "-q", "-m", "", "-n", "2", *modules]
    result = subprocess.run(command, env=env, cwd=TESTS.parent)
    assert result.returncode == 0
