"""A pytest plugin that swaps gradsolve into Diffrax, for `diffrax_conformance.py`.

`GRADSOLVE_SWAP=solvers` makes `diffrax.Tsit5` and `diffrax.Dopri5` gradsolve's
solvers; `GRADSOLVE_SWAP=diffeqsolve` also makes `diffrax.diffeqsolve` gradsolve's
(whose fallback calls Diffrax's own function, not the patched name). `none` leaves
Diffrax alone. The patch is applied when pytest configures, before any test module
imports Diffrax's names.

With `GRADSOLVE_AFFECTED_ONLY=1`, test cases parametrised only by solvers that are
not gradsolve's (`diffrax.Kvaerno5()`, `diffrax.Euler()`, ...) are deselected: with
either swap their solves go to Diffrax unchanged, so they can only repeat the
baseline. The conformance script reports how many it deselected.
"""

import os


def pytest_configure(config):
    mode = os.environ.get("GRADSOLVE_SWAP", "none")
    if mode not in ("none", "solvers", "diffeqsolve"):
        raise ValueError(f"GRADSOLVE_SWAP={mode!r}: use none, solvers or diffeqsolve")
    if mode == "none":
        return
    import diffrax

    import gradsolve as gs

    diffrax.Tsit5 = gs.Tsit5
    diffrax.Dopri5 = gs.Dopri5
    if mode == "diffeqsolve":
        diffrax.diffeqsolve = gs.diffeqsolve


def _solvers_in(params):
    import diffrax

    out = []
    stack = list(params.values())
    while stack:
        value = stack.pop()
        if isinstance(value, (tuple, list)):
            stack.extend(value)
        elif isinstance(value, diffrax.AbstractSolver):
            out.append(value)
        elif isinstance(value, type) and issubclass(value, diffrax.AbstractSolver):
            out.append(value)
    return out


def pytest_collection_modifyitems(config, items):
    if os.environ.get("GRADSOLVE_AFFECTED_ONLY") != "1":
        return
    import gradsolve as gs

    def ours(s):
        cls = s if isinstance(s, type) else type(s)
        return issubclass(cls, gs.AbstractGradsolveSolver)

    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        solvers = _solvers_in(callspec.params) if callspec is not None else []
        if solvers and not any(ours(s) for s in solvers):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
