"""bench: pi-bench (our systems against llama.cpp and HF accelerate on one model, with the cost floor from ceilings
measured in the same run), its result writer, and the scripts that reproduce the docs' figures.

bench/ sits beside the package's rooms in a checkout and is not in the wheel: scripts run as `python -m bench.NAME`
from the checkout's root after `pip install -e .`, pi-bench from anywhere (common/cli.bench_main finds the checkout).
The package never imports bench; bench imports the package (hotneurons.X) and the tests' tiny models (tests.tiny)."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout's root: the package's rooms, bench/ and tests/

# Some stages run a child as `python -m bench.X`: the checkout on PYTHONPATH lets it find bench from any directory.
_PATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *_PATH])
