"""torchrun with 2 CPU processes (gloo) gets exactly the counts of one process on the same tokens."""

import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest


def _args(model, corpus, out):
    return ["--model", str(model), "--dataset", str(corpus), "--tokens", "1500", "--seq-len", "40",
            "--batch-size", "2", "--samples-per-layer", "101", "--calibration-tokens", "120", "--dtype", "float64",
            "--out", str(out), "--quiet"]


@pytest.mark.slow
def test_torchrun_gloo_counts_equal_single_process(tiny_model_dir, text_corpus, tmp_path):
    model = tiny_model_dir("qwen2-swiglu")  # thresholded: taus must agree across ranks too
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    single = subprocess.run([sys.executable, "-m", "hotneurons.profiler", *_args(model, text_corpus, tmp_path / "one")],
                            env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-2000:]
    dist = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", "29517", "-m", "hotneurons.profiler",
                           *_args(model, text_corpus, tmp_path / "two")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert dist.returncode == 0, dist.stderr[-3000:]
    a = pd.read_parquet(tmp_path / "one/profile/neurons.parquet")
    b = pd.read_parquet(tmp_path / "two/profile/neurons.parquet")
    pd.testing.assert_frame_equal(a, b)
    import json

    ma = json.loads((tmp_path / "one/profile/meta.json").read_text())
    mb = json.loads((tmp_path / "two/profile/meta.json").read_text())
    assert ma["tokens"] == mb["tokens"] == 1500 and mb["world_size"] == 2 and ma["taus"] == mb["taus"]
    assert mb["samples"]["count"] == 101
    x = np.load(tmp_path / "two/profile/samples/layer_001.x.npy")
    assert x.shape == (101, 32) and np.isfinite(x).all() and (np.abs(x).sum(1) > 0).all()
