import gc

import jax
import pytest


jax.config.update("jax_enable_x64", True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program when a test module ends: a long session that
    keeps them all grew past 8 GiB and once crashed inside XLA's compiler."""
    yield
    jax.clear_caches()
    gc.collect()


# The longest files (`--durations=0`, 2026-12-05), run first: `--dist loadfile`
# gives each free worker the next file, so long files started last would leave one
# worker running alone at the end (`--no-loadscope-reorder` keeps this order).
LONGEST_FIRST = (
    "test_fit.py",
    "test_gradients.py",
    "test_large_ensembles.py",
    "test_rosenbrock.py",
    "test_dropin.py",
    "test_forward_mode.py",
    "test_kernel.py",
    "test_memory_budget.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
