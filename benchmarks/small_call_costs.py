"""Where the time of a small ensemble's record + gradient goes, call by call, under
the protocol of `run.py` (`gc.collect()` before every timed call).

`python benchmarks/small_call_costs.py [--sizes 1,64] [--problems lorenz]`
(float64, the problems of `problems.py` at their float64 tolerance, loss =
sum(y(t1)**2)). For each case it prints the minimum and median over repeats, after
a compiling call, of the calls below. The `gc.collect()` before each call takes
0.1-0.2 s in this process, so a size takes ~3 minutes at the default 100 repeats:

- `gs.record_ensemble`: the whole recording as `run.py` times it;
- `its recording program`: the compiled `vmap` of `gs.record` it calls (the mesh
  with the full `max_steps` buffer, not trimmed);
- `trim()`: the trim of that mesh (a host read of the step counts, then one
  compiled call that cuts the buffer);
- `host read of num_steps`: `np.asarray(mesh.num_steps)` alone;
- `replay gradient`: `jax.grad` of the loss through `gs.replay` over the trimmed mesh;
- `gs.diffeqsolve forward`, `Diffrax forward`, `Diffrax gradient`: `jax.jit` of
  `vmap` of each solve (Diffrax: default adjoint);
- `empty program, 1 output` and `..., 7 outputs`: a compiled call that only adds
  zero to its inputs (7: as many arrays as a batched mesh holds): the floor of
  any compiled call on this machine under this protocol.
"""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
from harness import print_case_tables, time_alone
from problems import PROBLEMS
from tools import diffrax_final_states

import gradsolve as gs
from gradsolve._batch_record import batch_recorder


def case(name: str, n: int, repeats: int) -> list[tuple[str, float, float]]:
    problem = PROBLEMS[name]
    y0s, args = problem.make_inputs(n, np.random.default_rng(0))
    y0s, args = jnp.asarray(y0s), jnp.asarray(args)
    t0, t1 = jnp.asarray(problem.t0), jnp.asarray(problem.t1)
    ax, max_steps, tol = problem.args_axes, problem.max_steps, problem.tol64
    term, solver = gs.ODETerm(problem.jax_vf), gs.Tsit5()
    ctrl = gs.PIDController(rtol=tol, atol=tol)
    kw = dict(stepsize_controller=ctrl, max_steps=max_steps)

    def record_ensemble():
        return gs.record_ensemble(
            term, solver, t0, t1, None, y0s, args, args_axes=ax, **kw
        )

    recorder = batch_recorder(
        term, solver, t0, t1, None, ax, max_steps, True, dict(stepsize_controller=ctrl)
    )
    untrimmed = jax.block_until_ready(recorder(y0s, args))
    mesh = record_ensemble()

    def loss(a, m):
        return jnp.sum(gs.replay(m, term, solver, y0s, a, args_axes=ax).ys[:, -1] ** 2)

    replay_grad = jax.jit(jax.grad(loss))

    def gs_final(y0, a):
        return gs.diffeqsolve(term, solver, t0, t1, None, y0, a, **kw).ys[-1]

    gs_forward = jax.jit(jax.vmap(gs_final, in_axes=(0, ax)))
    dfx_finals = diffrax_final_states(problem, diffrax.Tsit5(), tol, t0, t1, max_steps)
    dfx_forward = jax.jit(dfx_finals)
    dfx_grad = jax.jit(jax.grad(lambda a: jnp.sum(dfx_finals(y0s, a) ** 2)))
    leaves = jax.tree_util.tree_leaves(untrimmed)
    add_zero = lambda xs: jax.tree_util.tree_map(lambda x: x + 0, xs)
    empty_1, empty_7 = jax.jit(add_zero), jax.jit(add_zero)
    tasks = {
        "gs.record_ensemble": record_ensemble,
        "its recording program": lambda: recorder(y0s, args),
        "trim()": untrimmed.trim,
        "host read of num_steps": lambda: np.asarray(untrimmed.num_steps),
        "replay gradient": lambda: replay_grad(args, mesh),
        "gs.diffeqsolve forward": lambda: gs_forward(y0s, args),
        "Diffrax forward": lambda: dfx_forward(y0s, args),
        "Diffrax gradient": lambda: dfx_grad(args),
        "empty program, 1 output": lambda: empty_1(y0s),
        "empty program, 7 outputs": lambda: empty_7(leaves),
    }
    return [
        (label, *time_alone(fn, repeats, collect_garbage=True))
        for label, fn in tasks.items()
    ]


def main(argv=None):
    print_case_tables(__doc__.split("\n")[0], case, argv, sizes="1,64", repeats=100)


if __name__ == "__main__":
    main()
