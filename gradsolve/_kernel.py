"""The fused forward kernel: the whole adaptive solve of a block of trajectories in
one Pallas program.

A vmapped `while_loop` (the XLA recording) launches several kernels per step over the
whole ensemble, and finished trajectories keep paying until the slowest one ends.
Here each program instance of a Pallas grid integrates a block of `block` trajectories
(one per lane) from `t0` to `t1`: the state, stages and controller state stay in
registers, the lanes step together in one loop, each with its own `t`, step size and
counters, and a lane that has finished is masked out. Accepted times go straight to
the mesh in global memory at `(accepted index, lane)`, and `SaveAt(ts)` values at
`(save index, lane)`: masked stores with a per-lane index, which Triton lowers as
scattered stores.

The lane arithmetic (`_kernel_lane.py`) is the XLA loop's, so the steps are the
same. `kernel_loop` is a `custom_vmap`: called on one trajectory it runs a block of
one; under `jax.vmap` (how ensembles call `gs.record` and `gs.diffeqsolve`) its rule
runs the whole batch in one `pallas_call`. Off a GPU the kernel runs in Pallas
interpret mode (slow; used to test it against the XLA loop).
"""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._kernel_lane import LaneStatics, attempt, dense_save, lane_field


# Lanes per program instance: one per thread of four warps.
BLOCK = 128
_GROUPS = ("ti0", "ti1", "direction", "clip_floor", "tnext", "cstate", "y")
# `None`: interpret the kernel off a GPU. Set to `False` to lower it for a GPU from a
# machine without one (`jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))`,
# as `benchmarks/kernel_gpu.py --lower-only` does).
INTERPRET: bool | None = None
_COUNTS = ("num_steps", "num_accepted", "num_rejected", "result")
_SUCCESS = int(diffrax.RESULTS.successful._value)


def block_size(n: int) -> int:
    """A power of two (Triton's tensors must have one), at most `BLOCK`."""
    return min(BLOCK, max(8, 1 << max(n - 1, 0).bit_length()))


def _struct(x):
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def _count(x) -> int:
    n = 1
    for d in jnp.shape(x):
        n *= d
    return n


def _any(mask):
    # A reduction that every backend lowers (Triton has no boolean `or` reduction).
    return jnp.max(mask.astype(jnp.int32)) > 0


def _as_rows(x, n, npad):
    """A batched leaf `(n, *s)` as `(prod(s), npad)` rows, one column per lane, the
    padding lanes repeating the last trajectory (they then end with it)."""
    rows = jnp.reshape(x, (n, -1)).T
    if rows.dtype == jnp.bool_:
        rows = rows.astype(jnp.int32)
    return jnp.pad(rows, ((0, 0), (0, npad - n)), mode="edge")


def _make_kernel(st, groups, structs, num_ts, num_comps, max_steps):
    """The kernel body for one block: load the lanes' inputs, step until every lane
    has finished, store the results."""
    solver = st.solver
    size = max_steps + 1

    def kernel(*refs):
        n_leaves = len(structs)
        in_refs = refs[: n_leaves + (1 if num_ts else 0)]
        out_refs = refs[len(in_refs) :]
        ts_ref = in_refs[-1] if num_ts else None
        mesh_ref, *rest = out_refs
        saved = num_comps if num_ts else 0
        ts_out, rest = rest[:saved], rest[saved:]
        yf_refs, (tprev_ref, counts_ref) = rest[:num_comps], rest[num_comps:]

        # Every leaf is loaded as its per-lane elements, one row of `block` each.
        elements = []
        for ref, s in zip(in_refs, structs):
            rows = [ref[r, :] for r in range(_count(s))]
            if s.dtype == jnp.bool_:
                rows = [r != 0 for r in rows]
            elements.append(rows)
        g, i = {}, 0
        for name, count in groups:
            g[name], i = elements[i : i + count], i + count
        lanes = jax.lax.iota(jnp.int32, g["ti0"][0][0].shape[0])
        ti0, ti1 = g["ti0"][0][0], g["ti1"][0][0]
        k = dict(
            ti1=ti1,
            direction=g["direction"][0][0],
            clip_floor=g["clip_floor"][0][0],
            f=g["f"],
            a=g["a"],
            c=g["c"],
        )
        zeros = jnp.zeros_like(lanes)
        c = dict(
            tprev=ti0,
            tnext=g["tnext"][0][0],
            y=[e[0] for e in g["y"]],
            cstate=[e[0] for e in g["cstate"]],
            result=zeros + _SUCCESS,
            num_steps=zeros,
            num_accepted=zeros,
            num_rejected=zeros,
            ts_index=zeros,
        )
        if solver.fsal:
            # (`direction * ti0` is the caller's `t0`: the product with +-1 is exact.)
            field = lambda k, t, y: lane_field(st, k)(t, y)
            c["f0"] = jax.vmap(field)(k, k["direction"] * ti0, c["y"])

        def fill(j, carry):
            mesh_ref[j, :] = ti1
            return carry

        jax.lax.fori_loop(1, size, fill, 0)
        mesh_ref[0, :] = ti0
        for ref, y in zip(ts_out, c["y"]):

            def zero(j, carry, ref=ref, y=y):
                ref[j, :] = jnp.zeros_like(y)
                return carry

            jax.lax.fori_loop(0, num_ts, zero, 0)

        def running(c):
            return (
                (c["tprev"] < ti1)
                & (c["num_steps"] < max_steps)
                & (c["result"] == _SUCCESS)
            )

        def body(c):
            run = running(c)
            step = {
                key: c[key]
                for key in ("tprev", "tnext", "y", "cstate", "f0")
                if key in c
            }
            a = jax.vmap(lambda s, k: attempt(st, s, k))(step, k)
            keep = a["keep"] & run
            row = jnp.minimum(c["num_accepted"] + 1, size - 1)
            plgpu.store(mesh_ref.at[row, lanes], c["tnext"], mask=keep)
            if num_ts:
                c["ts_index"] = _save(c, a, keep)
            new = dict(c)
            pick = lambda p, x, y: [jnp.where(p, u, v) for u, v in zip(x, y)]
            new["y"] = pick(keep, a["y1"], c["y"])
            if "f0" in c:
                new["f0"] = pick(keep, a["f1"], c["f0"])
            new["tprev"] = jnp.where(run, a["tprev"], c["tprev"])
            new["tnext"] = jnp.where(run, a["tnext"], c["tnext"])
            new["cstate"] = pick(run, a["cstate"], c["cstate"])
            fresh = run & (c["result"] == _SUCCESS)
            new["result"] = jnp.where(fresh, a["result"], c["result"])
            one = lambda p: p.astype(jnp.int32)
            new["num_steps"] = c["num_steps"] + one(run)
            new["num_accepted"] = c["num_accepted"] + one(keep)
            new["num_rejected"] = c["num_rejected"] + one(run & ~keep)
            return new

        def _save(c, a, keep):
            # Every `ts` inside an accepted step, interpolated as the XLA loop does.
            def pending(i):
                row = jnp.minimum(i, num_ts - 1)
                t = plgpu.load(ts_ref.at[row, lanes])
                return keep & (i < num_ts) & (t <= c["tnext"]), t, row

            def save_body(i):
                p, t, row = pending(i)
                y_t = jax.vmap(lambda *xs: dense_save(st, *xs))(
                    c["tprev"], c["tnext"], t, c["y"], a["y1"], a["ks"]
                )
                for ref, v, y in zip(ts_out, y_t, c["y"]):
                    plgpu.store(ref.at[row, lanes], v.astype(y.dtype), mask=p)
                return i + p.astype(jnp.int32)

            return jax.lax.while_loop(
                lambda i: _any(pending(i)[0]), save_body, c["ts_index"]
            )

        c = jax.lax.while_loop(lambda c: _any(running(c)), body, c)
        for ref, y in zip(yf_refs, c["y"]):
            ref[...] = y
        tprev_ref[...] = c["tprev"]
        for r, key in enumerate(
            ("num_steps", "num_accepted", "num_rejected", "result")
        ):
            counts_ref[r, :] = c[key]

    return kernel


def _run(st, groups, inputs, ts, n, max_steps, time_dtype):
    """Run the kernel on `n` trajectories: `inputs` (a list of batched leaves, in
    the order of `groups`) and `ts` (`(n, num_ts)` or `None`)."""
    structs = [
        jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x)) for x in inputs
    ]
    num_comps = dict(groups)["y"]
    start = sum(c for _, c in groups[: _GROUPS.index("y")])
    y_dtypes = [structs[start + j].dtype for j in range(num_comps)]
    num_ts = 0 if ts is None else ts.shape[1]
    size = max_steps + 1
    if n == 0:
        empty = lambda shape, dtype: jnp.zeros((0,) + shape, dtype)
        return dict(
            mesh_ts=empty((size,), time_dtype),
            ts_values=[empty((num_ts,), d) for d in y_dtypes],
            y=[empty((), d) for d in y_dtypes],
            tprev=empty((), time_dtype),
            counts=jnp.zeros((0, 4), jnp.int32),
        )
    block = block_size(n)
    npad = -(-n // block) * block
    rows = [_as_rows(x, n, npad) for x in inputs]
    spec = lambda k: pl.BlockSpec((k, block), lambda i: (0, i))
    lane_spec = pl.BlockSpec((block,), lambda i: (i,))
    in_specs = [spec(r.shape[0]) for r in rows]
    if num_ts:
        rows.append(_as_rows(ts, n, npad))
        in_specs.append(spec(num_ts))
    out_shape = [jax.ShapeDtypeStruct((size, npad), time_dtype)]
    out_specs = [spec(size)]
    if num_ts:
        out_shape += [jax.ShapeDtypeStruct((num_ts, npad), d) for d in y_dtypes]
        out_specs += [spec(num_ts)] * num_comps
    out_shape += [jax.ShapeDtypeStruct((npad,), d) for d in y_dtypes]
    out_specs += [lane_spec] * num_comps
    out_shape += [
        jax.ShapeDtypeStruct((npad,), time_dtype),
        jax.ShapeDtypeStruct((4, npad), jnp.int32),
    ]
    out_specs += [lane_spec, spec(4)]
    kernel = _make_kernel(st, groups, structs, num_ts, num_comps, max_steps)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(npad // block,),
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=(jax.default_backend() != "gpu" if INTERPRET is None else INTERPRET),
        compiler_params=plgpu.CompilerParams(num_warps=max(1, block // 32)),
        name="gradsolve_record",
    )(*rows)
    mesh, *rest = outs
    ts_values = rest[:num_comps] if num_ts else []
    rest = rest[num_comps:] if num_ts else rest
    y_final, (tprev, counts) = rest[:num_comps], rest[num_comps:]
    if not num_ts:
        ts_values = [jnp.zeros((npad, 0), d).T for d in y_dtypes]
    return dict(
        mesh_ts=mesh.T[:n],
        ts_values=[v.T[:n] for v in ts_values],
        y=[v[:n] for v in y_final],
        tprev=tprev[:n],
        counts=counts[:, :n].T,
    )


def kernel_loop(
    problem, f, solver, controller, error_order, representation, lane, ts, max_steps
):
    """The stepping loop of `_record.record_loop`, run by the fused kernel.

    **Arguments:**

    - `problem`: the `LeafProblem`: its `args` and state structure.
    - `f`: its vector field with the arrays it closes over made explicit
        (`eqx.filter_closure_convert`), passed to the kernel as inputs.
    - `solver`, `controller` (wrapped for the direction), `error_order`.
    - `representation`: the state's `Representation` (components).
    - `lane`: this trajectory's `ti0`, `ti1`, `direction`, `clip_floor`, `tnext`
        (the controller's first step end), `cstate` (its state) and `y` (the
        initial components), in internal time.
    - `ts`: the `SaveAt(ts)` times in internal time, or `None`.
    - `max_steps`: the limit on step attempts.

    **Returns:**

    The XLA loop's final carry, as far as the recording reads it: `tprev`, `y`,
    `num_steps`, `num_accepted`, `num_rejected`, `result`, `mesh_ts`, `ts_values`.
    """
    f_dyn, f_static = eqx.partition(f, eqx.is_array)
    a_dyn, a_static = eqx.partition(problem.args, eqx.is_array)
    c_dyn, c_static = eqx.partition(controller, eqx.is_array)
    f_leaves, f_tree = jtu.tree_flatten(f_dyn)
    a_leaves, a_tree = jtu.tree_flatten(a_dyn)
    c_leaves, c_tree = jtu.tree_flatten(c_dyn)
    cstate_leaves, cstate_tree = jtu.tree_flatten(lane["cstate"])
    st = LaneStatics(
        solver=solver,
        error_order=error_order,
        representation=representation,
        treedef=problem.treedef,
        f_tree=f_tree,
        f_static=f_static,
        f_structs=tuple(_struct(x) for x in f_leaves),
        a_tree=a_tree,
        a_static=a_static,
        a_structs=tuple(_struct(x) for x in a_leaves),
        c_tree=c_tree,
        c_static=c_static,
        c_structs=tuple(_struct(x) for x in c_leaves),
        cstate_tree=cstate_tree,
    )
    parts = dict(lane, cstate=cstate_leaves, f=f_leaves, a=a_leaves, c=c_leaves)
    groups, inputs = [], []
    for name in _GROUPS + ("f", "a", "c"):
        leaves = parts[name] if isinstance(parts[name], list) else [parts[name]]
        groups.append((name, len(leaves)))
        inputs.extend(jnp.asarray(x) for x in leaves)
    time_dtype = jnp.result_type(lane["ti0"])

    def batch(inputs, ts, n):
        return _run(st, groups, inputs, ts, n, max_steps, time_dtype)

    @jax.custom_batching.custom_vmap
    def run(inputs, ts):
        add = lambda x: None if x is None else x[None]
        out = batch([add(x) for x in inputs], add(ts), 1)
        return jtu.tree_map(lambda x: x[0], out)

    @run.def_vmap
    def _rule(axis_size, in_batched, inputs, ts):
        # (Unbatched inputs may arrive as Python or NumPy constants.)
        grow = lambda x, b: x if b else jnp.broadcast_to(x, (axis_size,) + jnp.shape(x))
        inputs = [grow(x, b) for x, b in zip(inputs, in_batched[0])]
        if ts is not None:
            ts = grow(ts, in_batched[1])
        out = batch(inputs, ts, axis_size)
        return out, jtu.tree_map(lambda _: True, out)

    out = run(inputs, ts)
    counts = out["counts"]
    int_dtype = jnp.asarray(0).dtype
    count = lambda r: counts[..., r].astype(int_dtype)
    result = eqx.tree_at(lambda r: r._value, diffrax.RESULTS.successful, counts[..., 3])
    return dict(
        tprev=out["tprev"],
        y=out["y"],
        num_steps=count(0),
        num_accepted=count(1),
        num_rejected=count(2),
        result=result,
        mesh_ts=out["mesh_ts"],
        ts_values=out["ts_values"],
    )
