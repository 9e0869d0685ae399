"""The names a mesh file may use for a mesh's solver class and error norm.

A mesh file names these objects rather than storing them. Loading looks the names up
in an allow-list, never in Python's modules: gradsolve's solvers and Optimistix's
norms, plus what the user registers with [`gradsolve.register_mesh_name`][]. So a
crafted file cannot make loading import a module or hand `gs.replay` an arbitrary
function to call (`"sys:exit"` as the norm).
"""

import optimistix as optx


# Names of gradsolve's and Optimistix's own objects: stable public names, not the
# private modules they are defined in, so files outlive a reorganisation.
_OWN: dict[str, object] = {}
_REGISTERED: dict[str, object] = {}


def _own() -> dict[str, object]:
    if not _OWN:
        from ._solver import Dopri5, Rodas5, Rodas5P, Tsit5

        for solver in (Tsit5, Dopri5, Rodas5, Rodas5P):
            _OWN[f"gradsolve:{solver.__name__}"] = solver
        for norm in (optx.rms_norm, optx.max_norm, optx.two_norm):
            _OWN[f"optimistix:{norm.__name__}"] = norm
    return _OWN


def register_mesh_name(obj, name: str | None = None):
    """Allow mesh files to name `obj`: a solver class or an error norm of your own.

    [`gradsolve.save_mesh`][] writes a mesh's solver class and its controller's
    error norm into the file by name, and [`gradsolve.load_mesh`][] turns the name
    back into the object by looking it up among gradsolve's solvers, Optimistix's
    norms (`optx.rms_norm`, `optx.max_norm`, `optx.two_norm`) and the objects
    registered here, nothing else. Register your own norm or solver class in the
    session that saves the mesh and in the one that loads it. Usable as a decorator.

    **Arguments:**

    - `obj`: the solver class or norm function.
    - `name`: the name written to the file; by default `"module:qualname"` of a
        module-level `obj`. Registering a name again replaces the earlier object;
        gradsolve's own names cannot be taken.

    **Returns:**

    `obj`, unchanged.
    """
    if name is None:
        module = getattr(obj, "__module__", None)
        qualname = getattr(obj, "__qualname__", None)
        if not module or not qualname or "<" in qualname:
            raise ValueError(
                f"Cannot name {obj!r} by its module and qualified name: only "
                "module-level classes and functions have one. Define it at module "
                "level (not as a lambda or a nested function), or pass name=."
            )
        name = f"{module}:{qualname}"
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string; got {name!r}.")
    own = _own()
    if name in own and own[name] is not obj:
        raise ValueError(
            f"{name!r} is gradsolve's name for {own[name]!r}; choose another."
        )
    if not any(x is obj for x in own.values()):
        _REGISTERED[name] = obj
    return obj


def name_of(obj, what: str) -> str:
    """The name a file uses for `obj`; an error if `obj` is not on the allow-list."""
    for names in (_own(), _REGISTERED):
        for name, known in names.items():
            if known is obj:
                return name
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", "")
    if module is None or "<" in qualname:
        fix = (
            "Define it at module level (not as a lambda or a nested function), then "
            "register it with gs.register_mesh_name"
        )
    else:
        fix = f"Register it first with gs.register_mesh_name({qualname})"
    raise ValueError(
        f"Cannot save a mesh whose {what} is {obj!r}: a mesh file names only "
        "gradsolve's solvers, Optimistix's norms and objects registered with "
        f"gs.register_mesh_name. {fix}, in the session that saves the mesh and in "
        "the one that loads it."
    )


def resolve(name, what: str, where: str):
    """The object a file's `name` stands for; a `ValueError` naming the file and the
    name for anything not on the allow-list (no module is imported or searched)."""
    if not isinstance(name, str):
        raise ValueError(
            f"{where} has a malformed header: its {what} should be a name, not "
            f"{name!r}. Save the mesh again with gs.save_mesh."
        )
    for names in (_own(), _REGISTERED):
        if name in names:
            return names[name]
    raise ValueError(
        f"{where} names the {what} {name!r}, which is not one a mesh file may "
        "name: only gradsolve's solvers, Optimistix's norms and objects registered "
        "with gs.register_mesh_name are. If it is your own and you trust the file, "
        "register it (gs.register_mesh_name) before loading."
    )
