"""What a case is, and how its outcome is classified.

A [`Case`][] is one bad or unusual input: a call to gradsolve, what is due (an error
or an answer) and a reference to hold it to. [`classify`][] sorts what came back
into one of `OUTCOMES`; `fmt`, `describe`, `first_line` and `gradsolve_frame`
describe inputs and errors for the report.
"""

import dataclasses
import os
import re
import traceback
from collections.abc import Callable
from typing import Any

import diffrax
import jax
import jax.tree_util as jtu
import numpy as np


FAMILIES = (
    "times",
    "states",
    "controllers",
    "meshes",
    "files",
    "ensembles",
    "fitting",
)
OUTCOMES = (
    "clear error",
    "correct answer",
    "unclear error",
    "refused",
    "crash",
    "wrong answer",
)

# The exception types a clear error may have. JAX's tracer errors are `TypeError`s
# too, but they come from JAX's internals, not from a check: they are crashes.
CLEAR_TYPES = (ValueError, TypeError, RuntimeError)
JAX_INTERNAL = (
    jax.errors.ConcretizationTypeError,
    jax.errors.NonConcreteBooleanIndexError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.UnexpectedTracerError,
)


@dataclasses.dataclass
class Case:
    """One bad or unusual input.

    - `call`: runs gradsolve on it; returns what to compare (arrays, a dict, ...).
    - `expected`: `"error"` (the message must match the regular expression
        `keyword`, case-insensitive) or `"answer"` (equal to `reference()`, or
        accepted by `check`). Where the reference itself raises, an error is due
        instead: one matching `keyword`, or without `keyword` the reference's own
        error (gradsolve handed the input to Diffrax).
    - `reference`: Diffrax on the same input (or a closed form). For an `"error"`
        case whose reference returns a valid answer (successful, no NaN), that
        answer is due instead of the error.
    - `check`: for answers without a reference: `check(result)` returns `None` if
        the result is right, else what is wrong.
    - `errors`: the exception types of a clear error for this case.
    - `user_errors`: JAX's own exception types (crashes otherwise) that count as
        a clear error here: raised by the user's own code (a Python `if` on a traced
        value), they are the user's to fix, and JAX's message says how.
    """

    family: str
    name: str
    what: str
    call: Callable[[], Any]
    expected: str
    keyword: str | None = None
    reference: Callable[[], Any] | None = None
    check: Callable[[Any], str | None] | None = None
    rtol: float = 1e-9
    errors: tuple = CLEAR_TYPES
    user_errors: tuple = ()


def fmt(x) -> str:
    """A short, exact description of an input value."""
    if isinstance(x, jax.Array | np.ndarray | np.generic):
        a = np.asarray(x)
        body = np.array2string(a, threshold=8, separator=", ", precision=6)
        body = re.sub(r"\s*\n\s*", "", body)
        return f"array({body}, {a.dtype})"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {fmt(v)}" for k, v in x.items()) + "}"
    if isinstance(x, list):
        return "[" + ", ".join(fmt(v) for v in x) + "]"
    if isinstance(x, tuple):
        return "(" + ", ".join(fmt(v) for v in x) + ("," if len(x) == 1 else "") + ")"
    if isinstance(x, diffrax.SaveAt):
        sub, parts = x.subs, []
        if isinstance(sub, diffrax.SubSaveAt):
            parts = [f"{k}=True" for k in ("t0", "t1", "steps") if getattr(sub, k)]
            if sub.ts is not None:
                parts.append(f"ts={fmt(sub.ts)}")
        if x.dense:
            parts.append("dense=True")
        return "SaveAt(" + ", ".join(parts) + ")"
    if isinstance(x, diffrax.PIDController):
        parts = [f"rtol={x.rtol}", f"atol={x.atol}"]
        default = diffrax.PIDController(rtol=x.rtol, atol=x.atol)
        for field in dataclasses.fields(x):
            value = getattr(x, field.name)
            if field.name not in ("rtol", "atol") and value is not getattr(
                default, field.name
            ):
                parts.append(f"{field.name}={fmt(value)}")
        return "PIDController(" + ", ".join(parts) + ")"
    if isinstance(x, diffrax.StepTo):
        return f"StepTo(ts={fmt(x.ts)})"
    if isinstance(x, diffrax.ODETerm):
        return f"ODETerm({getattr(x.vector_field, '__name__', 'f')})"
    if isinstance(x, diffrax.AbstractSolver | diffrax.AbstractStepSizeController):
        return f"{type(x).__module__.split('.')[0]}.{type(x).__name__}()"
    if isinstance(x, type):
        return f"{x.__module__.split('.')[0]}.{x.__name__} (the class)"
    if callable(x):
        return getattr(x, "__name__", repr(x))
    text = repr(x)
    return text if len(text) < 80 else text[:77] + "..."


def describe(api: str, changes: dict, jit: bool = False) -> str:
    """`api(name=value, ...)`, the input of a case, for the report."""
    inner = ", ".join(f"{k}={fmt(v)}" for k, v in changes.items())
    return f"{api}({inner}){' under jax.jit' if jit else ''}"


# ------------------------------------------------------------ classification


def has_nan(tree) -> bool:
    for x in jtu.tree_leaves(tree):
        a = np.asarray(x)
        if a.dtype.kind in "fc" and np.isnan(a).any():
            return True
    return False


def reports_failure(tree) -> bool:
    """Whether a result says it failed (a `success` flag that is False)."""
    if isinstance(tree, dict) and "success" in tree:
        return not bool(np.all(tree["success"]))
    return False


def valid(tree) -> bool:
    """A reference's answer is valid: successful and without NaN."""
    return not reports_failure(tree) and not has_nan(tree)


def compare(got, want, rtol: float) -> str | None:
    """`None` if `got` equals `want` (to `rtol` of each leaf's scale), else why."""
    got_leaves = jtu.tree_flatten_with_path(got)[0]
    want_leaves = jtu.tree_flatten_with_path(want)[0]
    if jtu.tree_structure(got) != jtu.tree_structure(want):
        return f"structure {jtu.tree_structure(got)} != {jtu.tree_structure(want)}"
    for (path, a), (_, b) in zip(got_leaves, want_leaves):
        name = jtu.keystr(path) or "value"
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return f"{name}: shape {a.shape}, reference {b.shape}"
        if a.dtype != b.dtype:
            return f"{name}: dtype {a.dtype}, reference {b.dtype}"
        if a.dtype.kind not in "fc":
            if not np.array_equal(a, b):
                return f"{name}: {a!r}, reference {b!r}"
            continue
        if not np.array_equal(np.isnan(a), np.isnan(b)):
            return f"{name}: NaN at other places than the reference ({a!r}, {b!r})"
        finite = np.isfinite(b)
        if not np.array_equal(a[~finite & ~np.isnan(b)], b[~finite & ~np.isnan(b)]):
            return f"{name}: infinities differ from the reference"
        if not np.all(np.isfinite(a[finite])):
            return f"{name}: inf where the reference is finite"
        tol = max(rtol, 64 * float(np.finfo(b.dtype).eps) if rtol else 0.0)
        scale = np.max(np.abs(b[finite]), initial=0.0)
        error = np.max(np.abs(a[finite] - b[finite]), initial=0.0)
        if error > tol * max(scale, np.finfo(np.float64).tiny):
            return (
                f"{name}: differs from the reference by {error:.3g} "
                f"(scale {scale:.3g}, rtol {tol:.1g})"
            )
    return None


def first_line(e: BaseException | None, limit: int = 240) -> str:
    """The first line of an error's message (`""` for `None`), cut to `limit`."""
    if e is None:
        return ""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    # Equinox's runtime errors start with a stack trace; the message follows it.
    marked = [x for x in lines if x.startswith("equinox.EquinoxRuntimeError: ")]
    if marked:
        lines = [marked[0].split(": ", 1)[1]]
    text = lines[0] if lines else ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def gradsolve_frame(e: BaseException | None) -> str | None:
    """The innermost line of gradsolve the exception passed through."""
    if e is None:
        return None
    frames = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if f"{os.sep}gradsolve{os.sep}" in f.filename
    ]
    if not frames:
        return None
    f = frames[-1]
    path = f.filename[f.filename.rindex(f"{os.sep}gradsolve{os.sep}") + 1 :]
    return f"{path}:{f.lineno} ({f.name}): {f.line}"


def _short(tree) -> str:
    """A one-line summary of a small result, for the report."""
    if isinstance(tree, dict):
        items = (f"{k}={_short(v)}" for k, v in tree.items() if k != "ts")
        return "{" + ", ".join(items) + "}"
    if isinstance(tree, np.ndarray):
        return fmt(tree)
    text = repr(tree)
    return text if len(text) < 120 else text[:117] + "..."


def _message(e: BaseException) -> str:
    notes = "\n".join(getattr(e, "__notes__", []) or [])
    return f"{e}\n{notes}"


def classify(case: Case, got, error, ref, ref_error) -> tuple[str, str]:
    """Classify what gradsolve answered to one case.

    **Arguments:**

    - `case`: the [`Case`][].
    - `got`: what `case.call()` returned (as NumPy arrays), or `None` if it raised.
    - `error`: the exception `case.call()` raised, or `None`.
    - `ref`: what `case.reference()` returned (as NumPy arrays), or `None`.
    - `ref_error`: the exception `case.reference()` raised, or `None`.

    **Returns:**

    The outcome (one of `OUTCOMES`) and a detail saying why (`""` if none).
    """
    if case.expected == "answer":
        # An answer is due unless the reference itself refuses the input.
        answer_due = ref_error is None
    else:
        # An error is due unless Diffrax answers this input (validly).
        answer_due = ref is not None and valid(ref)
    detail = ""
    if error is not None:
        # JAX's own errors are crashes, unless the case names them as the user's.
        internal = isinstance(error, JAX_INTERNAL) and not isinstance(
            error, case.user_errors
        )
        if internal or not isinstance(error, case.errors + CLEAR_TYPES):
            outcome = "crash"
        elif answer_due:
            outcome = "refused"
            detail = "the reference answers this input"
        elif not isinstance(error, case.errors):
            outcome = "unclear error"
            detail = f"expected {' or '.join(t.__name__ for t in case.errors)}"
        elif (
            re.search(case.keyword, _message(error), re.IGNORECASE | re.DOTALL)
            if case.keyword is not None
            else ref_error is not None and str(error) == str(ref_error)
        ):
            outcome = "clear error"
        else:
            outcome = "unclear error"
            detail = (
                f"message does not match {case.keyword!r}"
                if case.keyword is not None
                else "not the reference's error, and no pattern to match"
            )
    elif answer_due:
        if case.check is not None:
            why = case.check(got)
        elif ref is not None:
            why = compare(got, ref, case.rtol)
        else:
            why = "no reference"
        outcome = "correct answer" if why is None else "wrong answer"
        detail = why or ""
    elif reports_failure(got):
        outcome = "unclear error"
        detail = f"no exception; the result reports a failure: {_short(got)}"
    else:
        outcome = "wrong answer"
        if ref_error is not None:
            detail = "returned an answer where the reference raises"
        elif ref is not None:
            detail = "returned an answer where the reference's is invalid (NaN/failed)"
        else:
            detail = "returned an answer where an error is due"
        detail += f": {_short(got)}"
    return outcome, detail
