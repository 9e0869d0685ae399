"""The residuals a fit minimises, over a recorded ensemble mesh, and their checks.

Every check of the user's inputs runs on the host, before anything is compiled, and
raises a `ValueError` that says what to change.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, PyTree

from ._fit_jacobian import block_mode, ensemble_residuals
from ._mesh import RecordedMesh
from ._replay import replay, replay_values
from ._sharding import Split, ensemble_map, replicated, resolve_split
from ._solve import record


def _identity(y, params):
    return y


class FitProblem(eqx.Module):
    """An ensemble of ODEs with observations: everything but the parameters.

    Arrays (initial states, times, data, weights) are fields, so that a new data set
    of the same shapes reuses every compiled function; the callables and the
    ensemble layout are static.
    """

    term: diffrax.ODETerm
    solver: object
    y0s: PyTree[Array] | None  # None when the initial states are fitted
    t0: Array
    ts: Array
    data: Array
    sqrt_weights: Array
    observe: Callable = eqx.field(static=True)
    params_axes: object = eqx.field(static=True)
    fit_y0: bool = eqx.field(static=True)
    # The devices the ensemble is split over (`None`: one device).
    devices: Split | None = eqx.field(static=True, default=None)

    def split(self, params):
        """`(parameters of the vector field, initial states)` of the fit variable."""
        if self.fit_y0:
            return params
        return params, self.y0s

    def record(self, params, controller, dt0, max_steps) -> RecordedMesh:
        """Record every trajectory's adaptive steps (untrimmed; no exception)."""
        theta, y0s = self.split(params)

        def one(y0, p):
            return record(
                self.term,
                self.solver,
                self.t0,
                self.ts[-1],
                dt0,
                y0,
                p,
                stepsize_controller=controller,
                max_steps=max_steps,
                throw=False,
            )

        return ensemble_map(one, (0, self.params_axes), self.devices)(y0s, theta)

    def observed(self, theta, ys):
        """Apply `observe(y, params)` to every saved state of every trajectory."""

        def per_trajectory(ys_i, p):
            return jax.vmap(lambda y: self.observe(y, p))(ys_i)

        axes = (0, self.params_axes)
        return ensemble_map(per_trajectory, axes, self.devices)(ys, theta)

    def predict(self, params, mesh: RecordedMesh):
        """Observables at `ts` from a replay over `mesh`, and its error ratio."""
        theta, y0s = self.split(params)
        sol = replay(
            mesh,
            self.term,
            self.solver,
            y0s,
            theta,
            saveat=diffrax.SaveAt(ts=self.ts),
            args_axes=self.params_axes,
            stale="ignore",  # the fit checks the ratio itself
            allow_partial=True,  # gs.fit replays only meshes that reached t1
            sharding=self.devices,
        )
        ratio = sol.stats.get("max_error_ratio")
        ratio = jnp.zeros(()) if ratio is None else jnp.max(ratio)
        return self.observed(theta, sol.ys), ratio

    @property
    def in_axes(self):
        """The `jax.vmap` axes of the fit variable over the ensemble."""
        return (self.params_axes, 0) if self.fit_y0 else self.params_axes

    def trajectory_residuals(
        self, params, y0, mesh, data, sqrt_weights, forward_only=False
    ):
        """One trajectory's weighted residuals, replayed over its own mesh (only
        its recorded steps if `forward_only`: differentiated in forward mode only).

        Unchecked: optimisers explore parameters where the mesh is stale, and
        `gs.fit` replays only meshes that reached the last observation."""
        theta, y0 = params if self.fit_y0 else (params, y0)
        ys = replay_values(
            mesh, self.term, self.solver, y0, theta, self.ts, forward_only
        )
        obs = jax.vmap(lambda y: self.observe(y, theta))(ys)
        return sqrt_weights * (obs - data)

    def residuals(self, params, mesh: RecordedMesh, mode: str | None):
        """Weighted residuals `sqrt(w) * (observe(y) - data)` of the whole ensemble
        (masked entries are 0). With `mode` `"fwd"` or `"bwd"`, their Jacobian is
        assembled from per-trajectory blocks computed in that mode (see
        `_fit_jacobian`); with `None` they are differentiated as written (the
        cheapest gradient of a sum of squares in reverse mode)."""
        inputs = (self.y0s, mesh, self.data, self.sqrt_weights)
        if mode is None:
            axes = (self.in_axes,) + (0,) * len(inputs)
            fn = ensemble_map(self.trajectory_residuals, axes, self.devices)
            return replicated(fn(params, *inputs), self.devices)
        # Blocks computed in forward mode differentiate the replay in no other.
        fn = functools.partial(self.trajectory_residuals, forward_only=mode == "fwd")
        return ensemble_residuals(
            params,
            fn=fn,
            in_axes=self.in_axes,
            inputs=inputs,
            mode=mode,
            split=self.devices,
        )

    def block_mode(self, params) -> str:
        """The cheaper mode of one trajectory's Jacobian block (on the host)."""
        return block_mode(math.prod(self.data.shape[1:]), params, self.in_axes)

    def materialise_mode(self, params) -> str:
        """The cheaper way to materialise the assembled Jacobian of all residuals:
        `"fwd"` (one tangent per entry of the fit variable) or `"bwd"` (one
        cotangent per residual). From shapes only."""
        size = sum(math.prod(jnp.shape(x)) for x in jtu.tree_leaves(params))
        return "fwd" if size <= math.prod(self.data.shape) else "bwd"


def _per_trajectory_leaves(params_axes, theta) -> list:
    """The leaves of `theta` that `params_axes` maps over the ensemble."""
    marked = jtu.tree_map(
        lambda axis, p: [x for x in jtu.tree_leaves(p) if axis == 0],
        params_axes,
        theta,
        is_leaf=lambda x: x is None,
    )
    return jtu.tree_leaves(marked)


def _leading_sizes(tree) -> set:
    return {np.shape(x)[0] if np.ndim(x) else None for x in jtu.tree_leaves(tree)}


def make_problem(
    term,
    solver,
    params0,
    y0s,
    ts,
    data,
    *,
    observe,
    weights,
    t0,
    params_axes,
    fit_y0,
    sharding=None,
) -> tuple[FitProblem, PyTree]:
    """Check the inputs of `gs.fit` and build the problem and the initial variable."""
    ts = ts if isinstance(ts, jax.Array) else jnp.asarray(ts)
    if ts.ndim != 1 or ts.shape[0] < 1:
        raise ValueError(
            f"ts must be a 1-d array of observation times; got shape {ts.shape}."
        )
    dtype = jnp.result_type(ts.dtype, float)
    ts = _as_array(ts, dtype)
    t0 = _as_array(t0, dtype)
    ts_np = np.asarray(ts)
    if not np.all(np.isfinite(ts_np)):
        raise ValueError(
            f"ts holds NaN or inf at positions {np.flatnonzero(~np.isfinite(ts_np))}: "
            "observation times must be finite numbers."
        )
    if not np.isfinite(float(t0)):
        raise ValueError(
            f"t0 is {float(t0)}: the initial time must be a finite number."
        )
    if np.any(np.diff(ts_np) <= 0) or ts_np[0] < float(t0):
        raise ValueError(
            f"ts must be strictly increasing and start at or after t0={float(t0)}; "
            "sort the observation times (and data along its second axis) or lower t0."
        )
    if ts_np[-1] <= float(t0):
        raise ValueError("The last observation time must lie after t0.")
    sizes = _leading_sizes(y0s)
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            "y0s must hold one initial state per trajectory: every leaf needs the "
            f"same leading ensemble axis; got leading sizes {sorted(map(str, sizes))}."
            " For a single trajectory use y0[None]."
        )
    (batch,) = sizes
    if batch == 0:
        raise ValueError(
            "y0s holds no trajectories (its leading axis has size 0): a fit needs at "
            "least one experiment."
        )
    _check_finite_params(params0)
    y0s = jtu.tree_map(lambda x: _as_array(x, jnp.result_type(x, dtype)), y0s)
    if observe is None:
        observe = _identity
    theta0 = params0
    try:
        per_trajectory = _per_trajectory_leaves(params_axes, theta0)
    except ValueError as e:
        raise ValueError(
            "params_axes must be None, 0, or a PyTree prefix of params0 with None "
            f"(shared) or 0 (one entry per trajectory) at each node: {e}"
        ) from None
    axes_sizes = {np.shape(x)[0] if np.ndim(x) else 0 for x in per_trajectory}
    if axes_sizes - {batch}:
        raise ValueError(
            f"The entries of params0 marked per-trajectory by params_axes have leading "
            f"axis sizes {sorted(axes_sizes)} but the ensemble has {batch} "
            "trajectories (the leading axis of y0s): give one entry per trajectory."
        )
    params0 = (theta0, y0s) if fit_y0 else theta0
    data = jnp.asarray(data)
    if not jnp.issubdtype(data.dtype, jnp.floating):
        data = data.astype(dtype)
    derivative = getattr(solver, "derivative_representation", None)
    if derivative is not None and derivative != solver.representation:
        # Every evaluation's replay is differentiated: record and replay in the
        # form the solver's steps differentiate fastest in.
        solver = dataclasses.replace(solver, representation=derivative)
    out = _observed_shape(observe, y0s, theta0, params_axes)
    want = (batch, ts.shape[0]) + out.shape
    if data.shape != want:
        raise ValueError(
            f"data has shape {data.shape}, but {batch} trajectories (y0s) observed at "
            f"{ts.shape[0]} times (ts) with observe(y, params) of shape {out.shape} "
            f"need data of shape {want}: data[i, j] is trajectory i observed at ts[j]."
        )
    sqrt_weights, data = _weights(weights, data)
    problem = FitProblem(
        term=term,
        solver=solver,
        y0s=None if fit_y0 else y0s,
        t0=t0,
        ts=ts,
        data=data,
        sqrt_weights=sqrt_weights,
        observe=observe,
        params_axes=params_axes,
        fit_y0=fit_y0,
    )
    return _place(problem, params0, batch, sharding)


def _as_array(x, dtype) -> Array:
    """`jnp.asarray(x, dtype)`, without a dispatched conversion when `x` is already
    such an array (a fit's checks run at every call, before its one program)."""
    if isinstance(x, jax.Array) and x.dtype == dtype and not x.weak_type:
        return x  # (a weakly typed one would be another program's input)
    if isinstance(x, jax.core.Tracer):
        return jnp.asarray(x, dtype)
    if isinstance(x, int | float) and not isinstance(x, bool):
        return _filled(x, (), np.dtype(dtype))
    return jax.device_put(np.asarray(x, dtype))


def _ones(shape: tuple, dtype: np.dtype) -> Array:
    """An array of ones on the device, made once per shape and dtype when small
    (a large one costs little next to its fit, and is not kept alive)."""
    if math.prod(shape) > _FILLED_KEPT_ENTRIES:
        return jax.device_put(np.ones(shape, dtype))
    return _filled(1, shape, dtype)


_FILLED_KEPT_ENTRIES = 1 << 16


@functools.lru_cache(maxsize=16)
def _filled(value: int | float, shape: tuple, dtype: np.dtype) -> Array:
    """An array of `value` on the device, made once per value, shape and dtype
    (arrays are immutable; putting one on the device costs a tenth of a small fit's
    host work)."""
    return jax.device_put(np.full(shape, value, dtype))


# `observe`'s output shapes, per function and input shapes: `jax.eval_shape` costs
# a tenth of a small fit's host work even when JAX has the trace cached, which a
# refit of the same problem need not pay again.
_OBSERVED_SHAPES: dict = {}
_OBSERVED_SHAPES_KEPT = 64


def _observed_shape(observe, y0s, theta, params_axes) -> jax.ShapeDtypeStruct:
    """The shape of `observe(y, params)` for one trajectory's `y` and `params`
    (raises a `ValueError` unless it returns one array)."""
    # One trajectory's shapes (structs: slicing the arrays would run eagerly).
    row = lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x))
    one_state = jtu.tree_map(row, y0s)
    one_theta = jax.tree.map(
        lambda axis, p: jtu.tree_map(lambda x: row(x) if axis == 0 else x, p),
        params_axes,
        theta,
        is_leaf=lambda x: x is None,
    )
    key = _shapes_key(observe, one_state, one_theta)
    out = None if key is None else _OBSERVED_SHAPES.get(key)
    if out is None:
        try:
            out = jax.eval_shape(observe, one_state, one_theta)
        except Exception as e:
            e.add_note("(raised by observe(y, params), traced by gs.fit)")
            raise
        if key is not None:
            if len(_OBSERVED_SHAPES) >= _OBSERVED_SHAPES_KEPT:
                _OBSERVED_SHAPES.pop(next(iter(_OBSERVED_SHAPES)))
            _OBSERVED_SHAPES[key] = out
    if not isinstance(out, jax.ShapeDtypeStruct):
        raise ValueError(
            "observe(y, params) must return one array of observables; got "
            f"{jtu.tree_structure(out)}. Stack the observables into an array."
        )
    return out


def _shapes_key(fn, *trees):
    """A hashable key of `fn` and the shapes and dtypes of `trees`, or `None` when
    some part is not hashable (the result is then not kept)."""
    try:
        described = []
        for tree in trees:
            leaves, treedef = jtu.tree_flatten(tree)
            shapes = tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves)
            described.append((treedef, shapes))
        key = (fn, tuple(described))
        hash(key)
    except TypeError:
        return None
    return key


def _place(problem: FitProblem, params0, batch: int, sharding):
    """Split the problem's per-experiment arrays (and per-experiment parameters)
    over the devices `sharding` asks for, or that `y0s` and `data` lie on."""
    in_axes = (problem.in_axes, 0, 0)
    inputs = (params0, problem.y0s, problem.data)
    split = resolve_split(sharding, inputs, in_axes, "gs.fit's ensemble")
    if split is None or batch == 0:
        return problem, params0
    problem = dataclasses.replace(problem, devices=split)
    if batch % split.size:
        # Equal shards cannot hold this ensemble: it is padded at every call.
        return problem, params0
    is_none = lambda x: x is None
    fields = lambda p: (p.y0s, p.data, p.sqrt_weights)
    placed = tuple(
        None if x is None else jax.device_put(x, split.sharding())
        for x in fields(problem)
    )
    problem = eqx.tree_at(fields, problem, placed, is_leaf=is_none)
    return problem, params0


def _check_finite_params(params0):
    """NaN or infinite initial parameters are an error (a solve from them cannot
    tell the optimiser anything)."""
    for path, x in jtu.tree_leaves_with_path(eqx.filter(params0, eqx.is_array_like)):
        try:
            finite = bool(np.all(np.isfinite(np.asarray(x))))
        except (TypeError, jax.errors.ConcretizationTypeError):
            continue  # traced: checked by the solves
        if not finite:
            raise ValueError(
                f"params0{jtu.keystr(path)} holds NaN or inf: start the fit from "
                "finite parameters."
            )


def _weights(weights, data):
    """`sqrt(weights)` and the data with masked entries (weight 0) set to 0.

    The weights always have data's shape, so that fits with and without weights
    share compiled code.
    """
    missing = ~np.isfinite(np.asarray(data))
    if weights is None:
        if missing.any():
            raise ValueError(
                f"data contains {int(missing.sum())} NaN or inf entries. Pass weights "
                "(an array broadcastable to data's shape) with 0 at those entries to "
                "leave them out of the fit, or remove them from data."
            )
        return _ones(data.shape, np.dtype(data.dtype)), data
    weights = np.asarray(weights, dtype=np.asarray(data).dtype)
    try:
        weights = np.broadcast_to(weights, data.shape)
    except ValueError:
        raise ValueError(
            f"weights of shape {weights.shape} do not broadcast to data's shape "
            f"{data.shape}; pass one weight per observation (or a broadcastable shape)."
        ) from None
    if not np.all(np.isfinite(weights)) or np.any(weights < 0):
        raise ValueError("weights must be finite and non-negative.")
    if not np.any(weights > 0):
        raise ValueError(
            "weights are all zero: no observation is left to fit. Give the "
            "observations to fit a positive weight."
        )
    unmasked = missing & (weights != 0)
    if unmasked.any():
        raise ValueError(
            f"data contains {int(unmasked.sum())} NaN or inf entries whose weight is "
            "not 0. Set weights to 0 at those entries to leave them out of the fit."
        )
    data = jnp.where(jnp.asarray(missing), 0, data)
    return jnp.asarray(np.sqrt(weights)), data  # broadcast above
