"""Family `states`: bad and unusual states and vector fields.

`y0` with NaN/inf, of integer, boolean, complex or float32 dtype, `None`, scalar,
nested, with zero-size leaves; vector fields returning the wrong shape, structure
or dtype, or NaN; batches under `jax.vmap`.
"""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np

from .calls import solve_cases
from .case import Case
from .defaults import INF, KS, NAN, Y0, Y0S, K
from .fixtures import vmapped, vmapped_diffrax


def wrong_shape(t, y, args):
    return -y[:1]


def wrong_structure(t, y, args):
    return (-y, y)


def complex_field(t, y, args):
    return (-y).astype(jnp.complex128)


def int_field(t, y, args):
    return jnp.ones(y.shape, jnp.int32)  # y' = 1, exactly, as integers


def float32_field(t, y, args):
    return (-0.5 * y).astype(jnp.float32)


def bool_field(t, y, args):
    return y > 0


def nan_field(t, y, args):
    return jnp.full_like(y, jnp.nan)


def nan_late_field(t, y, args):
    return -y * jnp.sqrt(0.5 - t)


def raising_field(t, y, args):
    raise ValueError("rate constant missing from args (raised by the user's field)")


def python_if_field(t, y, args):
    return -y if y[0] > 0 else y


def list_field(t, y, args):
    return [-y[0], -y[1]]


def constant_field(t, y, args):
    return -0.5


def states_cases() -> list[Case]:
    """The cases of family `states`, in the order they are run."""
    cases = []
    for value, label in ((NAN, "nan"), (INF, "inf"), (-INF, "-inf")):
        y0 = Y0.at[1].set(value)
        cases += solve_cases(
            "states",
            f"y0 with {label}",
            "error",
            r"\by0\b.*(nan|inf)",
            apis=("diffeqsolve", "record"),
            jit=(False, True),
            y0=y0,
        )
    cases += solve_cases(
        "states",
        "args nan",
        "error",
        r"\bargs\b.*(nan|inf)",
        jit=(False, True),
        args=jnp.asarray(NAN),
    )
    cases += solve_cases(
        "states",
        "dict y0 with one inf leaf",
        "error",
        r"\by0\b.*(nan|inf)",
        y0={"a": Y0, "b": jnp.array([INF])},
    )
    for name, y0 in (
        ("int64 y0", jnp.array([1, 2, 3])),
        ("int32 y0", jnp.array([1, 2, 3], jnp.int32)),
        ("uint8 y0", jnp.array([1, 2, 3], jnp.uint8)),
        ("bool y0", jnp.array([True, False, True])),
        ("y0 None", None),
        ("y0 empty dict", {}),
        ("0-d array y0", jnp.asarray(1.0)),
        ("Python float y0", 1.0),
        ("Python list y0", [1.0, 2.0]),
        (
            "nested dict/tuple y0",
            {"a": Y0, "b": (jnp.asarray(3.0), jnp.ones((2, 2)))},
        ),
        ("zero-size y0", jnp.zeros((0,))),
        ("zero-size leaf beside another", {"a": jnp.zeros((0, 2)), "b": Y0}),
        ("float32 y0, float64 args", Y0.astype(jnp.float32)),
        ("float32/float64 leaves", (Y0.astype(jnp.float32), Y0)),
        ("complex y0", Y0.astype(jnp.complex128)),
    ):
        cases += solve_cases("states", name, "answer", r"\by0\b|dtype", y0=y0)
    cases += solve_cases(
        "states",
        "float32 throughout",
        "answer",
        t0=jnp.float32(0),
        t1=jnp.float32(1),
        y0=Y0.astype(jnp.float32),
        args=jnp.float32(0.5),
        stepsize_controller=diffrax.PIDController(rtol=1e-4, atol=1e-4),
        rtol=1e-5,
    )
    cases += solve_cases(
        "states", "nested y0", "answer", apis=("record",), y0={"a": Y0, "b": (K,)}
    )
    cases += solve_cases("states", "args None", "answer", args=None)
    cases += solve_cases(
        "states", "args 0-d int", "answer", args=jnp.asarray(1, jnp.int32)
    )
    for name, field, keyword in (
        ("field returns wrong shape", wrong_shape, r"shape"),
        ("field returns wrong structure", wrong_structure, r"structure"),
        ("field returns a list for an array", list_field, r"structure"),
        ("field returns complex", complex_field, r"dtype"),
        ("field returns int32", int_field, r"dtype"),
        ("field returns float32", float32_field, r"dtype"),
        ("field returns bool", bool_field, r"dtype"),
        ("field returns NaN everywhere", nan_field, r"nan"),
        ("field NaN from t=0.5 on", nan_late_field, r"nan"),
        ("field raises ValueError", raising_field, r"rate constant missing"),
        ("field branches on y in Python", python_if_field, r"raised by the vector"),
    ):
        # JAX's own error for a Python `if` on a traced value is the user's to fix,
        # and says how (`jnp.where`, `lax.cond`); gradsolve keeps its type (as
        # Diffrax does) and notes that the vector field raised it.
        jax_errors = (
            (jax.errors.TracerBoolConversionError,) if field is python_if_field else ()
        )
        cases += solve_cases(
            "states",
            name,
            "error",
            keyword,
            apis=("diffeqsolve", "record"),
            user_errors=jax_errors,
            term=diffrax.ODETerm(field),
            max_steps=64,
        )
    cases += solve_cases(
        "states",
        "field returns a Python float",
        "answer",
        term=diffrax.ODETerm(constant_field),
        y0=jnp.asarray(1.0),
    )
    cases += vmap_state_cases()
    return cases


def vmap_state_cases() -> list[Case]:
    """Batches of states under `jax.vmap`: one row with NaN, no rows."""
    bad = Y0S.at[2, 1].set(NAN)
    return [
        Case(
            "states",
            "vmap: one y0 row with NaN",
            "jax.vmap(gs.diffeqsolve)(y0s with y0s[2, 1] = nan, args)",
            lambda: vmapped(bad, KS),
            "error",
            r"\by0\b.*(nan|inf)",
            reference=lambda: vmapped_diffrax(bad, KS),
        ),
        Case(
            "states",
            "vmap over 0 trajectories",
            "jax.vmap(gs.diffeqsolve)(y0s of shape (0, 3), args of shape (0,))",
            lambda: vmapped(Y0S[:0], KS[:0]),
            "answer",
            check=lambda out: (
                None
                if np.shape(out["ys"]) == (0, 1, 3)
                else f"ys shape {np.shape(out['ys'])}, expected (0, 1, 3)"
            ),
        ),
    ]
