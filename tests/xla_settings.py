"""How the tests have XLA compile (set up by `conftest.py`, read by tests whose
expectations depend on it). Imports nothing that starts XLA: `conftest.py` sets
`XLA_FLAGS` before XLA reads them."""

import os


# XLA's CPU fusion emitters off: the older elemental code generation, slower code
# but faster to compile (see `conftest.py`).
FAST_COMPILE_FLAG = "--xla_cpu_use_fusion_emitters=false"
# JAX's own switch for XLA's "most optimisations" off (LLVM at -O0, no expensive
# passes): programs that compile ~40% faster and run several times slower. Tests
# marked `bitwise` compare two compiled programs bit for bit, which holds only
# for code compiled with XLA's optimisations: they run with the switch off (see
# `conftest.py`).
FAST_COMPILE_JAX = "JAX_DISABLE_MOST_OPTIMIZATIONS"
# `GRADSOLVE_TEST_XLA_DEFAULTS=1`: the tests compile with XLA's defaults.
XLA_DEFAULTS = "GRADSOLVE_TEST_XLA_DEFAULTS"


def compiled_as_users_compile() -> bool:
    """Whether this run compiles with XLA's default code generation and
    optimisations (outside the tests marked `bitwise`, which always have them)."""
    fast_code = FAST_COMPILE_FLAG in os.environ.get("XLA_FLAGS", "").split()
    return not fast_code and os.environ.get(FAST_COMPILE_JAX) != "1"


def optimised(env: dict) -> dict:
    """`env` for a child process that compiles with XLA's optimisations, as users
    compile (whatever the run's `FAST_COMPILE_JAX`)."""
    return dict(env, **{FAST_COMPILE_JAX: "0"})
