"""bench/anon_breakdown.layout_bytes: the runtime's host-side structures counted from their arrays."""

import types

import numpy as np
import torch


def test_layout_bytes_counts_host_predictors_and_skips_blocks():
    from bench.anon_breakdown import layout_bytes

    io = types.SimpleNamespace(x_np=np.zeros(8, np.float32), mask_words=np.zeros(2, np.uint64), part=None,
                               out=np.zeros(8, np.float32), idx=np.zeros(4, np.int64))
    host = types.SimpleNamespace(io=io, cold_bytes=lambda: 100, pred_fc1=torch.zeros(4, 8, dtype=torch.float16),
                                 pred_fc2=torch.zeros(16, 4, dtype=torch.float16))
    blocks = types.SimpleNamespace(io=None, cold_bytes=lambda: 50, pred_fc1=object(), pred_fc2=None)  # q8_0 blocks
    got = layout_bytes(types.SimpleNamespace(ffns=[host, blocks]))
    assert got == {"cold_rows": 150, "host_io_pinned": 32 + 16 + 32 + 32, "predictors_on_host": (32 + 64) * 2}
