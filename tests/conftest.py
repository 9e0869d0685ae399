import gc
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import pytest

from .xla_settings import FAST_COMPILE_FLAG, FAST_COMPILE_JAX, XLA_DEFAULTS


jax.config.update("jax_enable_x64", True)

_CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"


def pytest_configure(config):
    """One persistent compilation cache for the test run, shared by the xdist
    workers and the child processes the tests start (through the environment,
    which they inherit), removed when the run ends.

    Some programs are compiled more than once in a run: each worker compiles its
    own, and every test module starts with the in-memory caches cleared (see
    `_release_compiled_programs`). A program XLA has compiled once is read back
    instead: the same executable. Each run starts empty, so every program is still
    compiled once. (With the compilation as `_optimise_less` sets it, the default
    suite gains nothing from it: 386 s without it, 390-392 s with it, 2026-12-08;
    it once saved ~30 s of a 6-minute run.)
    """
    if hasattr(config, "workerinput"):
        return  # a worker: the controller's environment holds the cache
    _compile_fast()
    _optimise_less()
    if _CACHE_DIR not in os.environ:
        config._gradsolve_cache = tempfile.mkdtemp(prefix="gradsolve-xla-cache-")
        os.environ[_CACHE_DIR] = config._gradsolve_cache
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    # This process imported JAX before the environment said so.
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_DIR])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Compile a test marked `bitwise` with XLA's optimisations, the others as the
    run says (`FAST_COMPILE_JAX`), before any of its fixtures is set up.

    Without them (LLVM at -O0) XLA compiles the suite's programs ~40% faster, but
    two programs that compute the same values (a chunked replay and the batched
    one, gradsolve's steps and Diffrax's) may differ in the last bit, which
    `bitwise` tests assert they do not: users' programs are compiled with the
    optimisations, and so are these tests'. The switch is not part of JAX's
    in-memory cache keys: its compiled programs are dropped when it changes.
    """
    fast = os.environ.get(FAST_COMPILE_JAX) == "1"
    fast = fast and item.get_closest_marker("bitwise") is None
    if jax.config.read("jax_disable_most_optimizations") != fast:
        jax.clear_caches()
        jax.config.update("jax_disable_most_optimizations", fast)


def _compile_fast():
    """Add `FAST_COMPILE_FLAG` to `XLA_FLAGS` for this process and the ones it
    starts, before XLA reads them (at its first computation), if XLA accepts it:
    an unknown flag would abort every process.

    The suite compiles several hundred programs and runs most of them once or
    twice, so most of its time is XLA's: with its CPU fusion emitters off, the
    default suite took 449 s instead of 589 s (406 tests, 2026-12-07, 2-core AMD
    EPYC), every test passing either way. Left out when `XLA_DEFAULTS` is set to 1
    (CI runs the long tests so) or `XLA_FLAGS` already says how to fuse."""
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get(XLA_DEFAULTS) == "1" or "fusion_emitters" in flags:
        return
    flags = f"{flags} {FAST_COMPILE_FLAG}".strip()
    probe = "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"
    try:
        accepted = subprocess.run(
            [sys.executable, "-c", probe],
            env={**os.environ, "XLA_FLAGS": flags},
            capture_output=True,
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired):
        return  # XLA's defaults, then
    if accepted.returncode == 0:
        os.environ["XLA_FLAGS"] = flags


def _optimise_less():
    """Turn XLA's "most optimisations" off (`FAST_COMPILE_JAX`) for this process
    and the ones it starts, unless `XLA_DEFAULTS` is set to 1 or the variable is
    set already (`0` keeps them).

    With the fusion emitters off as well, the default suite took 383-392 s
    instead of 487 s (test time on the two workers 750 s instead of 941 s; 407
    tests, 2026-12-08, 2-core AMD EPYC): most of its programs run once or twice,
    and what LLVM at -O0 saves in compiling them outweighs what they lose in
    running. Tests marked `bitwise` keep the optimisations
    (`pytest_runtest_setup`)."""
    if os.environ.get(XLA_DEFAULTS) == "1":
        return
    # Read by JAX when it is imported (the workers, the child processes); this
    # process imported it already.
    os.environ.setdefault(FAST_COMPILE_JAX, "1")
    fast = os.environ[FAST_COMPILE_JAX] == "1"
    jax.config.update("jax_disable_most_optimizations", fast)


def pytest_unconfigure(config):
    cache = getattr(config, "_gradsolve_cache", None)
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program when a test module ends: a long session that
    keeps them all grew past 8 GiB and once crashed inside XLA's compiler."""
    yield
    jax.clear_caches()
    gc.collect()


# The longest files (`--durations=0`, 2026-12-08, the tests compiled as above), run
# first: `--dist loadfile` gives each free worker the next file, so long files
# started last would leave one worker running alone at the end
# (`--no-loadscope-reorder` keeps this order).
LONGEST_FIRST = (
    "test_fit.py",
    "test_large_ensembles.py",
    "test_gradients.py",
    "test_dropin.py",
    "test_memory_budget.py",
    "test_kernel.py",
    "test_rosenbrock.py",
    "test_forward_mode.py",
    "test_element_field.py",
    "test_fallback.py",
    "test_mesh_io.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
