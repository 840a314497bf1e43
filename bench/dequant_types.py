"""De-quantization rate of every GGUF tensor type (weights/quants.py, quants_iq.py) against gguf-py's numpy
(gguf.quants.dequantize), and of the conversion at load into the type's nearest kernel format (weights/qtensor.convert):
million weights a second on random valid blocks of a (rows, 4096) matrix, the best of `--repeat` runs, on the CPU
(torch's threads) and, where there is one, a CUDA device.

  python -m bench.dequant_types --out bench/results/<date>-<kind>-dequant-types.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import warnings
from pathlib import Path


def _best(fn, repeat: int, sync=None) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import gguf
    import numpy as np
    import torch
    from hotneurons.weights.formats import FORMATS, nearest
    from hotneurons.weights.qtensor import QTensor, convert
    from hotneurons.weights.quants import dequantize

    from tests.blocks import random_rows  # valid random blocks of every type

    warnings.simplefilter("ignore")
    cuda = torch.cuda.is_available()
    n = a.rows * a.cols
    rows = []
    for fmt, s in FORMATS.items():
        if s.ggml_type is None or s.block == 1:
            continue
        b = random_rows(np.random.default_rng(0), fmt, a.rows, a.cols, scale=0.05)
        t = torch.from_numpy(b)
        row = {"format": str(fmt), "to": str(nearest(fmt))}
        dequantize(t[:16], fmt, a.cols)
        row["torch_cpu_mw_s"] = n / _best(lambda: dequantize(t, fmt, a.cols), a.repeat) / 1e6
        try:
            ref = gguf.quants.dequantize
            row["gguf_py_mw_s"] = n / _best(lambda: ref(b, gguf.GGMLQuantizationType(s.ggml_type)), a.repeat) / 1e6
        except NotImplementedError:
            row["gguf_py_mw_s"] = None
        if nearest(fmt) != fmt:
            q = QTensor(t, fmt, (a.rows, a.cols))
            row["convert_cpu_mw_s"] = n / _best(lambda: convert(q, nearest(fmt)), a.repeat) / 1e6
        if cuda:
            tc = t.cuda()
            dequantize(tc[:16], fmt, a.cols)
            sync = torch.cuda.synchronize
            row["torch_cuda_mw_s"] = n / _best(lambda: dequantize(tc, fmt, a.cols), a.repeat, sync) / 1e6
            if nearest(fmt) != fmt:
                qc = QTensor(tc, fmt, (a.rows, a.cols))
                row["convert_cuda_mw_s"] = n / _best(lambda: convert(qc, nearest(fmt)), a.repeat, sync) / 1e6
        rows.append(row)
        print(json.dumps(row), flush=True)
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
               "cuda": torch.cuda.get_device_name() if cuda else None}
    out = {"machine": machine,
           "shape": [a.rows, a.cols], "repeat": a.repeat, "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
