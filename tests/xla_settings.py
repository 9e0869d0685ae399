"""How the tests have XLA compile (set up by `conftest.py`, read by tests whose
expectations depend on it). Imports nothing that starts XLA: `conftest.py` sets
`XLA_FLAGS` before XLA reads them."""

import os


# XLA's CPU fusion emitters off: the older elemental code generation, slower code
# but faster to compile (see `conftest.py`).
FAST_COMPILE_FLAG = "--xla_cpu_use_fusion_emitters=false"
# `GRADSOLVE_TEST_XLA_DEFAULTS=1`: the tests compile with XLA's defaults.
XLA_DEFAULTS = "GRADSOLVE_TEST_XLA_DEFAULTS"


def compiled_as_users_compile() -> bool:
    """Whether this run compiles with XLA's default code generation."""
    return FAST_COMPILE_FLAG not in os.environ.get("XLA_FLAGS", "").split()
