"""bench/bench_gguf.py: the pi-bench model written layer by layer into a Q4_0 GGUF fires as calibrated when read back
by our decoder, and its exact predictors mark the neurons whose stored gate fires (0.97 of them at its
threshold, and not many more)."""

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    from bench.bench_gguf import write_model

    path = tmp_path_factory.mktemp("bench-gguf") / "tiny.gguf"
    info = write_model("tiny", 2, path, "cpu", calibration_tokens=512, seq=64, rank=31, log=lambda *_: None)
    return path, info


def test_read_back_fires_as_calibrated_and_predictors_agree(written):
    from hotneurons.models import build_model
    from hotneurons.models.config import ModelConfig
    from hotneurons.weights.formats import WeightFormat
    from hotneurons.weights.source import open_source
    from safetensors.torch import load_file

    path, info = written
    src = open_source(str(path), None)
    assert str(src.activation) == "reglu" and src.infos["blk.0.ffn_gate.weight"].fmt == WeightFormat.Q4_0
    cfg = ModelConfig.from_hf(src.config, "reglu")
    m = build_model(cfg, lambda n: src.get(n) if n in src.infos else None, "cpu", torch.float32, ctx=128)
    preds = load_file(info["predictors"])
    ids = torch.randint(0, src.config.vocab_size, (128,), generator=torch.Generator().manual_seed(5))  # fresh tokens
    h = m.embed(ids, 0)
    for i in range(2):
        h2, x = m.attention(i, h, 0)  # (T, d)
        gate, up, down = (src.get(f"blk.{i}.ffn_{k}.weight").dequantize(torch.float32) for k in ("gate", "up", "down"))
        pre = x @ gate.T  # (T, n) the stored gate's pre-activations
        fired = (pre > 0).float().mean().item()
        assert 0.06 < fired < 0.16, fired  # calibrated to 10% on other tokens
        logits = torch.relu(x @ preds[f"layers.{i}.fc1.weight"].float().T) @ preds[f"layers.{i}.fc2.weight"].float().T
        active = pre > 0
        marked = logits >= preds[f"layers.{i}.threshold"]
        recall = float((active & marked).sum() / active.sum())
        assert recall > 0.93, recall  # kept at 0.97 on the calibration tokens
        assert float(marked.float().mean()) < 2 * fired  # and it marks few more than fire
        h = h2 + (torch.relu(pre) * (x @ up.T)) @ down.T
    assert np.isfinite(h.numpy()).all()
    assert info["gguf_bytes"] == path.stat().st_size and 0.08 < info["calibration"]["mean_fired_as_stored"] < 0.13
