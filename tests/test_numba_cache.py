"""kernels.numba_cache_dir: Numba's cache folder changes with any kernel source (Numba checks only the decorated
function's own file), the oldest other folders go, and a child process keeps its parent's folder."""

import os
import subprocess
import sys
import time

from hotneurons import kernels


def test_folder_per_kernel_sources_and_pruning(tmp_path):
    here = kernels.numba_cache_dir(tmp_path)
    assert here.parent == tmp_path and here.is_dir() and len(here.name) == 16
    assert kernels.numba_cache_dir(tmp_path) == here  # the same sources: the same folder, kept
    (here / "k.nbi").write_bytes(b"x")
    here.rename(tmp_path / ("0" * 16))  # as if the sources had changed since
    olds = [tmp_path / f"{i:016x}" for i in range(1, kernels.NUMBA_KEEP + 2)]
    for i, d in enumerate(olds):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "f").write_bytes(b"x")
        os.utime(d, (time.time() - 100 + i, time.time() - 100 + i))
    os.utime(tmp_path / ("0" * 16), (time.time() - 1000, time.time() - 1000))  # the oldest
    again = kernels.numba_cache_dir(tmp_path)
    assert again.name == here.name and again.is_dir() and not (again / "k.nbi").exists()  # a fresh folder
    left = sorted(p.name for p in tmp_path.iterdir() if p != again)
    assert left == sorted(d.name for d in olds[-kernels.NUMBA_KEEP:])  # the NUMBA_KEEP newest others


def test_child_process_keeps_the_folder(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    code = "import os, hotneurons.kernels; print(os.environ['NUMBA_CACHE_DIR'])"
    parent = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    folder = parent.stdout.strip()
    assert os.path.dirname(folder) == str(tmp_path)
    env["NUMBA_CACHE_DIR"] = folder  # what the child of a process that imported the kernels inherits
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert child.stdout.strip() == folder
