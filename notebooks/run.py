"""Execute a notebook in place (outputs saved), e.g. `python notebooks/run.py notebooks/profile.ipynb`.

Environment variables reach the notebook (RUN=... picks the run directory it reads).
"""

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

for name in [a for a in sys.argv[1:] if not a.startswith("--")]:
    path = Path(name)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    if "--no-save" not in sys.argv:
        nbformat.write(nb, path)
    print(f"executed {path}")
