"""Shared test problems and comparisons. References come from Diffrax, SciPy or
closed forms, never from gradsolve itself."""

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    f: Callable
    y0: object
    args: object
    t0: float
    t1: float


def _linear(t, y, A):
    return A @ y


def _lorenz(t, y, p):
    sigma, rho, beta = p
    return jnp.stack(
        [sigma * (y[1] - y[0]), y[0] * (rho - y[2]) - y[1], y[0] * y[1] - beta * y[2]]
    )


def _lotka_volterra(t, y, p):
    a, b, c, d = p
    return jnp.stack([a * y[0] - b * y[0] * y[1], c * y[0] * y[1] - d * y[1]])


def _van_der_pol(t, y, mu):
    return jnp.stack([y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]])


def _pendulum(t, y, p):
    return {
        "theta": y["omega"],
        "omega": -p["g"] * jnp.sin(y["theta"]) - p["c"] * y["omega"],
    }


def _forced(t, y, p):
    omega, zeta, amplitude = p
    return jnp.stack(
        [
            y[1],
            -(omega**2) * y[0] - 2 * zeta * omega * y[1] + amplitude * jnp.cos(2 * t),
        ]
    )


LINEAR_A = jnp.array([[-0.5, 1.0, 0.0], [-1.0, -0.5, 0.2], [0.0, -0.3, -0.1]])

PROBLEMS = {
    "linear": Problem(
        "linear", _linear, jnp.array([1.0, 0.5, -0.3]), LINEAR_A, 0.0, 5.0
    ),
    "lorenz": Problem(
        "lorenz",
        _lorenz,
        jnp.array([1.0, 0.0, 0.0]),
        jnp.array([10.0, 28.0, 8 / 3]),
        0.0,
        1.0,
    ),
    "lotka_volterra": Problem(
        "lotka_volterra",
        _lotka_volterra,
        jnp.array([1.0, 0.5]),
        jnp.array([1.5, 1.0, 1.0, 3.0]),
        0.0,
        6.0,
    ),
    "van_der_pol": Problem(
        "van_der_pol", _van_der_pol, jnp.array([2.0, 0.0]), jnp.array(5.0), 0.0, 6.0
    ),
    "pendulum": Problem(
        "pendulum",
        _pendulum,
        {"theta": jnp.array(1.0), "omega": jnp.array(0.0)},
        {"g": jnp.array(9.81), "c": jnp.array(0.1)},
        0.0,
        4.0,
    ),
    "forced": Problem(
        "forced", _forced, jnp.array([1.0, 0.0]), jnp.array([1.3, 0.05, 0.7]), 0.0, 8.0
    ),
}


def max_relative_error(a, b) -> float:
    """Largest |a - b| over all leaves, relative to the largest |b| of each leaf."""
    errors = []
    for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape, (x.shape, y.shape)
        finite = np.isfinite(y)
        assert np.array_equal(finite, np.isfinite(x))
        if finite.any():
            scale = max(np.max(np.abs(y[finite])), 1e-300)
            errors.append(np.max(np.abs(x[finite] - y[finite])) / scale)
    return max(errors) if errors else 0.0


def tree_sum_squares(tree):
    return sum(jnp.sum(x**2) for x in jtu.tree_leaves(tree))


# Reads the program from stdin and runs it as a fresh `__main__` module, compiled
# under the name (and, after the blank lines prepended, at the line numbers) of the
# file it was taken from, so that a traceback points into that file.
_RUN_PASTED = """\
import sys, types
filename, skip = sys.argv[1], int(sys.argv[2])
del sys.argv[1:]
sys.modules["__main__"] = main = types.ModuleType("__main__")
exec(compile("\\n" * skip + sys.stdin.read(), filename, "exec"), vars(main))
"""


def run_fresh(
    source: str,
    cwd: os.PathLike,
    *,
    filename: str = "<string>",
    first_line: int = 1,
    timeout: float = 900,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run `source` alone in a new Python interpreter, as if pasted into one started
    in `cwd` (nothing of this process's JAX configuration or names leaks in).
    Tracebacks name `filename`, with `source` starting at line `first_line`; `env`
    adds to (or overrides) this process's environment variables. Returns the
    finished process, its output as text; raises `subprocess.TimeoutExpired`."""
    return subprocess.run(
        [sys.executable, "-c", _RUN_PASTED, filename, str(first_line - 1)],
        input=source,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
    )
