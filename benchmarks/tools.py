"""Each tool's forward solve and gradient for one problem and ensemble, ready to time.

A builder returns a `Built`: zero-argument callables (`tasks`) that run one operation
to completion (results blocked on), plus callables that return the final states and
the gradient as NumPy, for the accuracy checks, which are never timed.

Every tool solves the same problem from the same numbers (`problems.make_inputs`),
with Tsit5 (RK45 = Dormand-Prince 5(4) for SciPy), the same rtol/atol, the RMS error
norm, an integral step-size controller, `dt0` chosen by the tool's own heuristic, and
saves only the final state. The loss is `sum(y(t1)**2)` over the ensemble.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
from problems import Problem

import gradsolve as gs


@dataclass
class Built:
    """A tool, built for one problem/ensemble/dtype/tolerance.

    - `tasks`: operation name -> callable timed by the harness. gradsolve's
      `gradient` uses the mesh left by the last `record` call, so `record` comes first.
    - `states`: operation name -> callable returning the final states `(n, dim)`
      (for SciPy, of the trajectories in `subset` only).
    - `gradient`: callable returning the gradient leaves as a list of NumPy arrays,
      or `None` where the tool has no gradient here.
    - `time_scale`: operation -> factor applied to measured times (SciPy: n / subset).
    - `steps`: callable, after the timed calls, giving the accepted steps per
      trajectory (min/max) the tool took, or `None`.
    - `subset`: for SciPy, the indices of the trajectories it solves.
    - `compile_gradient`: callable returning the compiled XLA executable of the
      gradient (for `memory_analysis()`), JAX tools only.
    - `warmup_calls`: untimed calls before the timed rounds (the first compiles).
    - `info`: anything else worth keeping in the JSON.
    """

    tool: str
    tasks: dict[str, Callable[[], Any]]
    states: dict[str, Callable[[], np.ndarray]]
    gradient: Callable[[], list[np.ndarray]] | None = None
    time_scale: dict[str, float] = field(default_factory=dict)
    steps: Callable[[], dict] | None = None
    subset: np.ndarray | None = None
    compile_gradient: Callable[[], Any] | None = None
    warmup_calls: int = 1
    info: dict = field(default_factory=dict)


def to_jax(tree, dtype):
    """NumPy pytree -> JAX arrays of `dtype`."""
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype=dtype), tree)


def leaves_numpy(tree) -> list[np.ndarray]:
    """The leaves of a JAX/NumPy pytree as float64 NumPy arrays, in tree order."""
    return [np.asarray(x, dtype=np.float64) for x in jax.tree_util.tree_leaves(tree)]


def _block_mesh(mesh):
    jax.block_until_ready((mesh.ts, mesh.num_steps))
    return mesh


# --- gradsolve --------------------------------------------------------------------


def build_gradsolve(problem: Problem, y0s, args, tol: float, dtype) -> Built:
    """gradsolve: `forward` = jit(vmap(gs.diffeqsolve)), `record` =
    `gs.record_ensemble` (a trimmed ensemble mesh), `gradient` =
    jit(grad(loss over gs.replay)) with the mesh of the last `record` (record +
    gradient is the sum of the two times), `solve_gradient` =
    jit(grad(loss over vmap(gs.diffeqsolve))): one call, no mesh kept."""
    term, solver = gs.ODETerm(problem.jax_vf), gs.Tsit5()
    ctrl = gs.PIDController(rtol=tol, atol=tol)
    t0, t1 = jnp.asarray(problem.t0, dtype), jnp.asarray(problem.t1, dtype)
    ax, ms = problem.args_axes, problem.max_steps
    y0s, args = to_jax(y0s, dtype), to_jax(args, dtype)

    def one_solve(y0, a):
        sol = gs.diffeqsolve(
            term, solver, t0, t1, None, y0, a, stepsize_controller=ctrl, max_steps=ms
        )
        return sol.ys[-1]

    @jax.jit
    def forward(y0s, args):
        return jax.vmap(one_solve, in_axes=(0, ax))(y0s, args)

    def loss(args, mesh, y0s):
        sol = gs.replay(mesh, term, solver, y0s, args, args_axes=ax)
        return jnp.sum(sol.ys[:, -1] ** 2)

    grad = jax.jit(jax.grad(loss))

    @jax.jit
    @jax.grad
    def solve_gradient(args, y0s):
        return jnp.sum(jax.vmap(one_solve, in_axes=(0, ax))(y0s, args) ** 2)

    held = {}

    def record():
        held["mesh"] = _block_mesh(
            gs.record_ensemble(
                term,
                solver,
                t0,
                t1,
                None,
                y0s,
                args,
                args_axes=ax,
                stepsize_controller=ctrl,
                max_steps=ms,
            )
        )
        return held["mesh"]

    def gradient():
        return jax.block_until_ready(grad(args, held["mesh"], y0s))

    def mesh_info():
        steps = np.asarray(held["mesh"].num_steps)
        return {
            "steps_min": int(steps.min()),
            "steps_max": int(steps.max()),
            "mesh_length": int(held["mesh"].max_steps),
        }

    return Built(
        tool="gradsolve",
        tasks={
            "forward": lambda: jax.block_until_ready(forward(y0s, args)),
            "record": record,
            "gradient": gradient,
            "solve_gradient": lambda: jax.block_until_ready(solve_gradient(args, y0s)),
        },
        states={"forward": lambda: np.asarray(forward(y0s, args), np.float64)},
        gradient=lambda: leaves_numpy(gradient()),
        steps=mesh_info,
        compile_gradient=lambda: grad.lower(args, held["mesh"], y0s).compile(),
    )


# --- Diffrax ----------------------------------------------------------------------


def diffrax_final_states(problem, solver, tol, t0, t1, max_steps):
    """`(y0s, args) -> final states` of the ensemble with `diffrax.diffeqsolve`
    (default adjoint: RecursiveCheckpointAdjoint), vmapped, not jitted."""
    term = diffrax.ODETerm(problem.jax_vf)
    ctrl = diffrax.PIDController(rtol=tol, atol=tol)

    def one(y0, a):
        sol = diffrax.diffeqsolve(
            term,
            solver,
            t0,
            t1,
            None,
            y0,
            a,
            stepsize_controller=ctrl,
            max_steps=max_steps,
        )
        return sol.ys[-1]

    return jax.vmap(one, in_axes=(0, problem.args_axes))


def build_diffrax(problem: Problem, y0s, args, tol: float, dtype) -> Built:
    """Diffrax: `forward` = jit(vmap(diffrax.diffeqsolve)) with Tsit5 and a
    PIDController; `gradient` = jit(grad) of the loss with the default adjoint."""
    t0, t1 = jnp.asarray(problem.t0, dtype), jnp.asarray(problem.t1, dtype)
    finals = diffrax_final_states(
        problem, diffrax.Tsit5(), tol, t0, t1, problem.max_steps
    )
    y0s, args = to_jax(y0s, dtype), to_jax(args, dtype)
    forward = jax.jit(finals)
    grad = jax.jit(jax.grad(lambda a, y: jnp.sum(finals(y, a) ** 2)))
    return Built(
        tool="diffrax",
        tasks={
            "forward": lambda: jax.block_until_ready(forward(y0s, args)),
            "gradient": lambda: jax.block_until_ready(grad(args, y0s)),
        },
        states={"forward": lambda: np.asarray(forward(y0s, args), np.float64)},
        gradient=lambda: leaves_numpy(grad(args, y0s)),
        compile_gradient=lambda: grad.lower(args, y0s).compile(),
    )


def reference(
    problem: Problem,
    y0s,
    args,
    dtype,
    tol: float = 1e-13,
    with_gradient: bool = False,
    max_steps: int = 100_000,
):
    """A tight solution with Diffrax Dopri8 at rtol = atol = `tol` in float64.

    The inputs are first rounded to `dtype`, then solved in float64, so a float32
    run is compared with the exact solution of the float32 problem. Returns the final
    states `(n, dim)` and, if asked, the gradient leaves (Diffrax's default adjoint;
    the discrete adjoint of a solve this tight approximates the exact gradient).
    """
    f64 = jnp.float64
    y0s = to_jax(to_jax(y0s, dtype), f64)
    args = to_jax(to_jax(args, dtype), f64)
    finals = diffrax_final_states(
        problem, diffrax.Dopri8(), tol, f64(problem.t0), f64(problem.t1), max_steps
    )
    states = np.asarray(jax.jit(finals)(y0s, args))
    if not with_gradient:
        return states, None
    grad = jax.jit(jax.grad(lambda a, y: jnp.sum(finals(y, a) ** 2)))
    return states, leaves_numpy(grad(args, y0s))


# --- torchode ---------------------------------------------------------------------


def torchode_status() -> tuple[bool, str]:
    """Whether torch and torchode import, and the reason when they do not."""
    try:
        import torch  # noqa: F401
        import torchode  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return False, f"torchode not available ({type(e).__name__}: {e})"
    return True, ""


def build_torchode(problem: Problem, y0s, args, tol: float, dtype) -> Built:
    """torchode (PyTorch, CPU, eager): Tsit5 with an IntegralController, every
    trajectory its own steps (batched). `forward` under `torch.no_grad()`;
    `gradient` by backpropagation through the solver loop (`AutoDiffAdjoint`), with
    `backprop_through_step_size_control=False`, i.e. the discrete adjoint of the
    accepted steps, like Diffrax and gradsolve."""
    import torch
    import torchode as to

    tdtype = torch.float64 if dtype == jnp.float64 else torch.float32
    n = y0s.shape[0]
    y0 = torch.tensor(np.asarray(y0s), dtype=tdtype)
    targs = jax.tree_util.tree_map(
        lambda x: torch.tensor(np.asarray(x), dtype=tdtype), args
    )
    term = to.ODETerm(problem.torch_vf, with_args=True)
    step = to.Tsit5(term=term)
    ctrl = to.IntegralController(atol=tol, rtol=tol, term=term)
    adjoint = to.AutoDiffAdjoint(
        step,
        ctrl,
        max_steps=problem.max_steps,
        backprop_through_step_size_control=False,
    )
    ivp = to.InitialValueProblem(
        y0=y0,
        t_start=torch.full((n,), problem.t0, dtype=tdtype),
        t_end=torch.full((n,), problem.t1, dtype=tdtype),
    )
    held = {}

    def solve(a):
        sol = adjoint.solve(ivp, args=a)
        if not bool(torch.all(sol.status == 0)):
            codes = sol.status.unique().tolist()
            raise RuntimeError(f"torchode failed: status codes {codes}")
        held["stats"] = sol.stats
        return sol.ys[:, -1]

    def forward():
        with torch.no_grad():
            return solve(targs)

    def gradient():
        leaves, treedef = jax.tree_util.tree_flatten(targs)
        leaves = [x.detach().clone().requires_grad_(True) for x in leaves]
        y1 = solve(jax.tree_util.tree_unflatten(treedef, leaves))
        return torch.autograd.grad((y1**2).sum(), leaves)

    def steps_info():
        accepted = held["stats"]["n_accepted"]
        return {"steps_min": int(accepted.min()), "steps_max": int(accepted.max())}

    return Built(
        tool="torchode",
        tasks={"forward": forward, "gradient": gradient},
        states={"forward": lambda: forward().double().numpy()},
        gradient=lambda: [g.double().numpy() for g in gradient()],
        steps=steps_info,
        warmup_calls=2,
        info={"torch_threads": torch.get_num_threads()},
    )


# --- SciPy ------------------------------------------------------------------------


def build_scipy(problem: Problem, y0s, args, tol: float, dtype, cap: int) -> Built:
    """SciPy `solve_ivp(method="RK45")` in a Python loop over single trajectories,
    for orientation. At most `cap` trajectories (evenly spread over the ensemble) are
    solved; the time is scaled by n / cap. Always float64 (SciPy's RK45 is)."""
    from scipy.integrate import solve_ivp

    n = y0s.shape[0]
    subset = np.unique(np.linspace(0, n - 1, min(cap, n)).round().astype(int))
    y0s = np.asarray(y0s, np.float64)
    cast = lambda x: np.asarray(np.asarray(x, dtype=dtype), np.float64)  # noqa: E731
    y0s = cast(y0s)
    args = jax.tree_util.tree_map(cast, args)

    def args_of(i):
        return args[i] if problem.args_axes == 0 else args

    def forward():
        out = np.empty((len(subset), problem.dim))
        for k, i in enumerate(subset):
            sol = solve_ivp(
                problem.numpy_vf,
                (problem.t0, problem.t1),
                y0s[i],
                method="RK45",
                rtol=tol,
                atol=tol,
                args=(args_of(i),),
            )
            if sol.status != 0:
                raise RuntimeError(f"solve_ivp failed: {sol.message}")
            out[k] = sol.y[:, -1]
        return out

    return Built(
        tool="scipy",
        tasks={"forward": forward},
        states={"forward": forward},
        time_scale={"forward": n / len(subset)},
        subset=subset,
        info={"trajectories_solved": len(subset)},
    )
