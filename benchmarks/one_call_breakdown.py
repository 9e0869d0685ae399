"""Where the time of a gradient through `gs.diffeqsolve` (the one-call gradient) goes,
next to the two-call path (record, trim, replay gradient) over the same ensemble.

`python benchmarks/one_call_breakdown.py [--sizes 64,4096] [--problems lorenz]`
(float64, the problems of `problems.py` at their float64 tolerance, loss =
sum(y(t1)**2)). For each case it prints the minimum and median over repeats, after
a compiling call, of:

- `one-call gradient`: `jax.jit(jax.grad(loss))` through `gs.diffeqsolve`;
- `its forward`: the same program's forward pass with everything its pullback
  needs (`jax.vjp` returning the pullback: the recording with its kept states);
- `its pullback`: that pullback applied, alone;
- `record, max_steps buffer` and `record, 512-step buffer`: `jax.vmap(gs.record)`
  with the problem's `max_steps` and with 512 (what `gs.record_ensemble` tries
  first);
- `replay gradient`: `jax.grad` of the loss through `gs.replay` over the trimmed
  mesh;
- `fresh buffer`: filling a new `(N, max_steps + 1)` float64 array, against
  `pass over a resident buffer` (the same array updated in place): what a buffer
  sized by `max_steps` costs before a single step is taken.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from harness import print_case_tables, time_alone
from problems import PROBLEMS

import gradsolve as gs


def case(name: str, n: int, repeats: int) -> list[tuple[str, float, float]]:
    problem = PROBLEMS[name]
    y0s, args = problem.make_inputs(n, np.random.default_rng(0))
    y0s, args = jnp.asarray(y0s), jnp.asarray(args)
    term, solver = gs.ODETerm(problem.jax_vf), gs.Tsit5()
    tol = problem.tol64
    ctrl = gs.PIDController(rtol=tol, atol=tol)
    t0, t1, max_steps = problem.t0, problem.t1, problem.max_steps

    def final(y0, a):
        sol = gs.diffeqsolve(
            term, solver, t0, t1, None, y0, a, stepsize_controller=ctrl,
            max_steps=max_steps,
        )  # fmt: skip
        return sol.ys[-1]

    def loss(a):
        return jnp.sum(jax.vmap(final)(y0s, a) ** 2)

    def recorder(steps):
        one = lambda y0, a: gs.record(
            term, solver, t0, t1, None, y0, a, stepsize_controller=ctrl,
            max_steps=steps,
        )  # fmt: skip
        return jax.jit(jax.vmap(one))

    gradient = jax.jit(jax.grad(loss))
    forward = jax.jit(lambda a: jax.vjp(loss, a)[1])
    pullback = jax.jit(lambda pb: pb(jnp.ones(())))
    residuals = forward(args)
    full, short = recorder(max_steps), recorder(min(512, max_steps))
    mesh = short(y0s, args).trim()

    def replay_loss(a):
        sol = gs.replay(mesh, term, solver, y0s, a, args_axes=0, stale="ignore")
        return jnp.sum(sol.ys[:, -1] ** 2)

    replay_gradient = jax.jit(jax.grad(replay_loss))
    fill = jax.jit(lambda x: jnp.broadcast_to(x, (n, max_steps + 1)) * 1.0)
    update = jax.jit(lambda buffer: buffer * 1.0, donate_argnums=0)
    resident = [fill(jnp.ones(()))]

    def in_place():
        resident[0] = update(resident[0])
        return resident[0]

    rows = [
        ("one-call gradient", lambda: gradient(args)),
        ("its forward (with what the pullback needs)", lambda: forward(args)),
        ("its pullback", lambda: pullback(residuals)),
        (f"record, max_steps = {max_steps} buffer", lambda: full(y0s, args)),
        ("record, 512-step buffer", lambda: short(y0s, args)),
        ("replay gradient over the trimmed mesh", lambda: replay_gradient(args)),
        (f"fresh ({n}, {max_steps + 1}) buffer", lambda: fill(jnp.ones(()))),
        ("pass over a resident buffer", in_place),
    ]
    return [(label, *time_alone(fn, repeats)) for label, fn in rows]


def main(argv=None):
    print_case_tables(__doc__.split("\n")[0], case, argv, sizes="64,4096", repeats=20)


if __name__ == "__main__":
    sys.exit(main())
