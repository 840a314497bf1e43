"""The compute kernels, CPU and GPU: Numba kernels over the cold FFN rows (cold.py: bf16 / int8 rows; cold_q.py and
cold_q_ir.py: llama.cpp's Q8_0 / Q4_0 / Q4_1 blocks), their Numba helpers (intrinsics.py, activations.py), the DRAM
read ceiling (dram.py), Triton kernels (qgemv.py: GEMVs over block weights; fused.py: a decode step's fused ops), the
linear layer over float or block weights that the models call (qlinear.py) and the torch reference ops of a decode
step with their one dispatch (ops.py)."""

import hashlib
import os
import sys
from pathlib import Path

from hotneurons.common.hardware import openmp_wait_policy

openmp_wait_policy()  # before torch loads: sleeping or spinning OpenMP threads (see its docstring)

NUMBA_KEEP = 3  # cache folders of other kernel sources kept (other checkouts, a branch switched back to)


def numba_cache_dir(root: Path | None = None) -> Path:
    """Numba's cache folder for this version of the kernels: a folder named by a hash of every kernel source.

    Numba's own cache (cache=True) checks only the decorated function's file, while the cold kernels are assembled
    from IR helpers in others (cold_q_ir.py, ir_util.py, cold_k.py, intrinsics.py...): an edit there would keep
    running the old machine code. A new hash starts an empty folder; the oldest of the others beyond NUMBA_KEEP go.
    NUMBA_CACHE_DIR, where set, is the root (else ~/.cache/hotneurons/numba, XDG_CACHE_HOME honoured)."""
    h = hashlib.sha256()
    for f in sorted(Path(__file__).parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    name = h.hexdigest()[:16]
    if root is None:
        given = os.environ.get("NUMBA_CACHE_DIR")
        if given and Path(given).name == name:  # set by this function in a parent process
            return Path(given)
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        root = Path(given) if given else cache / "hotneurons" / "numba"
    here = root / name
    if not here.exists():
        try:
            here.mkdir(parents=True)
            others = sorted((p for p in root.iterdir() if p.is_dir() and p != here), key=lambda p: p.stat().st_mtime)
            for old in others[:max(0, len(others) - NUMBA_KEEP)]:
                for f in sorted(old.rglob("*"), reverse=True):
                    f.rmdir() if f.is_dir() else f.unlink()
                old.rmdir()
        except OSError:  # a read-only home: Numba then compiles at every start, as with no cache
            pass
    return here


def _use_numba_cache() -> None:
    here = str(numba_cache_dir())
    if "numba" in sys.modules:  # imported before the kernels: its config already read the environment
        import numba.core.config

        numba.core.config.CACHE_DIR = here
    else:
        os.environ["NUMBA_CACHE_DIR"] = here


_use_numba_cache()
