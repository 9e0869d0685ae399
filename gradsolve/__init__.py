"""gradsolve: record an adaptive ODE solve's steps; replay them to differentiate."""

from diffrax import (
    RESULTS as RESULTS,
    ClipStepSizeController as ClipStepSizeController,
    ConstantStepSize as ConstantStepSize,
    ODETerm as ODETerm,
    PIDController as PIDController,
    SaveAt as SaveAt,
    StepTo as StepTo,
)

from ._ensemble import (
    estimate_memory as estimate_memory,
    record_ensemble as record_ensemble,
    replay_ensemble as replay_ensemble,
)
from ._fit import FitResult as FitResult, fit as fit
from ._mesh import RecordedMesh as RecordedMesh
from ._mesh_io import load_mesh as load_mesh, save_mesh as save_mesh
from ._mesh_names import register_mesh_name as register_mesh_name
from ._replay import replay as replay
from ._sharding import (
    ensemble_sharding as ensemble_sharding,
    sharded_vmap as sharded_vmap,
)
from ._solution import Solution as Solution
from ._solve import diffeqsolve as diffeqsolve, record as record
from ._solver import (
    AbstractExplicitSolver as AbstractExplicitSolver,
    AbstractGradsolveSolver as AbstractGradsolveSolver,
    AbstractRosenbrock as AbstractRosenbrock,
    Dopri5 as Dopri5,
    Rodas5 as Rodas5,
    Rodas5P as Rodas5P,
    RosenbrockTableau as RosenbrockTableau,
    Tsit5 as Tsit5,
)
from ._stale import StaleMeshWarning as StaleMeshWarning


__version__ = "0.1.0"
