import gc
import os
import shutil
import tempfile

import jax
import pytest


jax.config.update("jax_enable_x64", True)

# The variable that names the run's compilation cache, for the workers to share.
_CACHE = "GRADSOLVE_TEST_COMPILATION_CACHE"


def pytest_configure(config):
    """One persistent compilation cache per test run, shared by its workers and
    removed at its end: many tests compile programs other tests have compiled
    (the same solve of the same problem, in other files or after
    `jax.clear_caches()`), and read them back instead. A fresh run starts empty,
    so every program is still compiled by XLA at least once."""
    if _CACHE not in os.environ:  # the controlling process (or a run without xdist)
        os.environ[_CACHE] = tempfile.mkdtemp(prefix="gradsolve-tests-xla-")
        config.stash[_owner] = os.environ[_CACHE]
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_owner = pytest.StashKey[str]()


def pytest_unconfigure(config):
    path = config.stash.get(_owner, None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
        del os.environ[_CACHE]


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program when a test module ends: a long session that
    keeps them all grew past 8 GiB and once crashed inside XLA's compiler."""
    yield
    jax.clear_caches()
    gc.collect()
