"""hotneurons.bench: pi-bench (our systems against llama.cpp and HF accelerate on one model, with the cost floor
from ceilings measured in the same run), its result writer, and the scripts that reproduce the docs' figures.

Scripts run as `python -m hotneurons.bench.NAME` or `python bench/NAME.py` from a checkout after `pip install -e .`."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout (the repository root is the package)
