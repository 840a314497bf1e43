"""hotneurons.bench: pi-bench (our systems against llama.cpp and HF accelerate on one model, with the cost floor
from ceilings measured in the same run), its result writer, and the scripts that reproduce the docs' figures.

Scripts run as `python -m hotneurons.bench.NAME` or `python bench/NAME.py` from a checkout after `pip install -e .`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout (the repository root is the package)


def tests_module(name: str):
    """A helper module of the checkout's tests/ folder (e.g. `tiny`: tiny random models of every family), loaded by
    path: tests/ is not part of the installed package, and the scripts that need it run from a checkout."""
    path = ROOT / "tests" / f"{name}.py"
    if not path.exists():
        raise SystemExit(f"{path} not found: this script runs from a checkout of the repository")
    spec = importlib.util.spec_from_file_location(f"hotneurons_tests_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
