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
