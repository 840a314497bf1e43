"""Neuron placement: which FFN neurons live on the GPU (`pi-solve`). See docs/solver.md."""

from .cost import SolverError
from .place import solve_placement

__all__ = ["SolverError", "solve_placement"]
