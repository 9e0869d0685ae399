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

from ._fit import FitResult as FitResult, fit as fit
from ._mesh import RecordedMesh as RecordedMesh
from ._replay import replay as replay
from ._solution import Solution as Solution
from ._solve import diffeqsolve as diffeqsolve, record as record
from ._solver import (
    AbstractExplicitSolver as AbstractExplicitSolver,
    Dopri5 as Dopri5,
    Tsit5 as Tsit5,
)


__version__ = "0.1.0"
