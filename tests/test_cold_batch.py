"""kernels/cold_batch.py: B tokens' cold neurons with each row of their masks' union read once, against the float64
reference of each token over its own mask (tests/cold_ref.py on the weights the stored rows stand for: gguf-py's
de-quantization for block rows) and against the batch-1 kernel run token by token, on fresh random rows, tokens and
masks."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hotneurons.kernels.cold_batch import MAX_BATCH, union
from hotneurons.runtime import cold_rows as C
from hotneurons.runtime.batch import ffn_rows_batch
from test_kernels import random_rows
from test_kernels import reference as reference_float
from test_kernels_q import FMTS, gguf_rows
from test_kernels_q import reference as reference_q


@pytest.mark.parametrize("dtype", ["bf16", "int8", *FMTS])
@pytest.mark.parametrize("act", ["swiglu", "relu", "drelu"])
@pytest.mark.parametrize("B", [1, 3, 7])
def test_batch_kernel_equals_each_token_alone(dtype, act, B):
    rng = np.random.default_rng(zlib.crc32(repr((dtype, act, B)).encode()))
    d, n = 96, 70
    rows = gguf_rows(rng, act, d, n, dtype) if dtype in FMTS else random_rows(rng, act, d, n, dtype)
    xs = rng.standard_normal((B, d)).astype(np.float32)
    masks = rng.random((B, n)) < rng.uniform(0.05, 0.6, (B, 1))  # (B, n) each token its own density
    if B > 1:
        masks[0] = False  # a token that marks nothing
    idx, member = union(masks)
    out = np.full((B, d), np.nan, np.float32)  # must be overwritten
    part = np.full((3, B, d), np.nan, np.float32)  # scratch: its contents must not matter
    ffn_rows_batch(act, xs, idx, member, rows, out, part)
    ref = reference_q if dtype in FMTS else reference_float
    for b in range(B):
        mine = np.flatnonzero(masks[b]).astype(np.int64)
        want = ref(act, xs[b], mine, rows)
        np.testing.assert_allclose(out[b], want, rtol=1e-4, atol=2e-6 * max(1.0, float(np.abs(want).max(initial=0))))
        alone = C.ffn_rows(act, xs[b], mine, rows, np.empty(d, np.float32))
        np.testing.assert_allclose(out[b], alone, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(alone).max())))


def test_union():
    masks = np.array([[1, 0, 0, 1, 0], [0, 0, 0, 1, 1], [0, 0, 0, 0, 0]], bool)
    idx, member = union(masks)
    assert idx.tolist() == [0, 3, 4] and member.tolist() == [1, 3, 2]
    with pytest.raises(ValueError, match="at most 64"):
        union(np.zeros((MAX_BATCH + 1, 4), bool))


def test_rate_bench_runs_small(tmp_path):
    """bench/cold_batch_rate.py at a toy size: both ways timed, the union no larger than the marks."""
    from bench.cold_batch_rate import main

    fig = main(["--out", str(tmp_path / "r.json"), "--neurons", "300", "--d", "64", "--batches", "1,3", "--reps", "2"])
    for B, r in fig["batches"].items():
        assert r["union_rows"] <= r["marked_rows"] and r["batched_ms"] > 0 and r["token_by_token_ms"] > 0
    assert fig["batches"]["1"]["union_rows"] == fig["batches"]["1"]["marked_rows"]
    assert (tmp_path / "r.json").exists()
