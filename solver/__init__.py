"""Neuron placement: which FFN neurons live on the GPU (`pi-solve`). See docs/solver.md."""

import importlib

# loaded on first use: `pi-solve --help` stays quick
_LAZY = {"SolverError": ".cost", "solve_placement": ".place", "solve_expert_placement": ".place_moe"}

__all__ = ["SolverError", "solve_expert_placement", "solve_placement"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
