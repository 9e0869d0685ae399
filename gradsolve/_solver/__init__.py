from .base import (
    AbstractExplicitSolver as AbstractExplicitSolver,
    AbstractGradsolveSolver as AbstractGradsolveSolver,
)
from .dopri5 import Dopri5 as Dopri5
from .rodas5 import Rodas5 as Rodas5, Rodas5P as Rodas5P
from .rosenbrock import (
    AbstractRosenbrock as AbstractRosenbrock,
    RosenbrockTableau as RosenbrockTableau,
)
from .tsit5 import Tsit5 as Tsit5
