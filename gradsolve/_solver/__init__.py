from .base import AbstractExplicitSolver as AbstractExplicitSolver
from .dopri5 import Dopri5 as Dopri5
from .tsit5 import Tsit5 as Tsit5
