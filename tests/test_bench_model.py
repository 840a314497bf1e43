"""pi-bench's synthetic model (bench/bench_model.py): its power-law firing after calibration, at every position, the
exact predictor, the GPU layers a budget holds, and the model written as a GGUF for llama.cpp (bench/bench_llamacpp.py).
"""

import numpy as np
import pytest
import torch

from bench import bench_model as bm


def test_power_law_targets():
    p = bm.power_law(28672, seed=3)
    assert abs(p.mean() - 0.10) < 0.002
    assert abs(bm.share_of_top(p) - 0.80) < 0.01


def test_calibration_hits_power_law_targets():
    torch.manual_seed(0)
    lm = bm.build_model("tiny", 2, "cpu", seed=1)
    model = bm.calibrate(lm, "tiny", tokens=1024, seq=128, seed=1)
    freq = bm.realised(lm, "tiny", tokens=2048, seq=128, seed=5)  # fresh tokens
    for f, target in zip(freq, model.targets):
        assert abs(f.mean() - 0.10) < 0.01
        assert abs(bm.share_of_top(f) - 0.80) < 0.03
        assert np.corrcoef(f, target)[0, 1] > 0.98
    # the constant channel: nothing writes to residual channel 0, so every layer sees it
    for layer in lm.layers:
        assert float(layer.mlp.down_proj.weight.detach()[0].abs().max()) == 0.0
        assert float(layer.self_attn.o_proj.weight.detach()[0].abs().max()) == 0.0


def test_firing_statistics_hold_at_every_position(monkeypatch):
    """A shape wide enough that random attention outputs (~0.02^2 * d / sqrt(position) a channel) would swamp
    std-0.02 embeddings at early positions: calibrated over positions 0-255, the model fires ~10% of its neurons
    at the first positions too (where pi_bench decodes), not only on average."""
    monkeypatch.setitem(bm.SHAPES, "wide", (1024, 2816, 8, 2, 512))
    torch.manual_seed(0)
    lm = bm.build_model("wide", 2, "cpu", seed=3)
    bm.calibrate(lm, "wide", tokens=1024, seq=256, seed=3)
    rows = bm.active_by_position(lm, "wide", edges=(0, 16, 64, 256), seqs=4)
    assert [r["positions"] for r in rows] == ["0-16", "16-64", "64-256"]
    for r in rows:
        assert abs(r["mean_active"] - 0.10) < 0.012, rows


def test_exact_predictor_marks_the_neurons_that_fire():
    lm = bm.build_model("tiny", 2, "cpu", seed=2, gate_rank=7)
    model = bm.calibrate(lm, "tiny", tokens=512, seq=128, seed=2)
    ids = torch.randint(0, 320, (1, 64), generator=torch.Generator().manual_seed(9))
    for i in range(2):
        p = bm.exact_predictor(lm, "tiny", i, seed=2, rank=7).float()
        assert p.fc1.weight.shape == (16, 128)  # 2 * rank + 2 hidden units
        x = bm._ffn_input(lm, i, ids)  # (64, d) float32
        with torch.no_grad():
            gate = x.double() @ lm.layers[i].mlp.gate_proj.weight.double().T  # float64 reference
            logits = p(x)
        assert torch.allclose(logits.double(), gate, atol=2e-3 * float(gate.abs().max()))
        agree = (p.mask(x) == (gate > 0)).float().mean()
        assert agree > 0.995
    assert abs(bm.realised(lm, "tiny", tokens=1024, seq=128)[0].mean() - 0.10) < 0.015  # calibration still holds
    assert model.targets[0].shape == (1536,)


def test_gpu_layers_for_budget():
    b = bm.model_bytes("llama-2-70b", 12)
    assert b["total"] == pytest.approx(21.6e9, rel=0.01)  # the 21.6 GB
    assert bm.gpu_layers_for(int(0.3 * b["total"]), "llama-2-70b", 12) == 3  # the issue's -ngl 3


def test_gguf_round_trip(tmp_path):
    gguf = pytest.importorskip("gguf")
    from bench import bench_llamacpp as lcpp

    lm = bm.build_model("tiny", 2, "cpu", seed=2)
    path = tmp_path / "tiny.gguf"
    info = lcpp.write_gguf(lm.model, path, gguf)
    r = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 2 * 9 + 3
    assert info["tensor_bytes"] == sum(int(t.n_bytes) for t in r.tensors)
    w = lm.model.model.layers[1].mlp.gate_proj.weight.detach().numpy()
    got = np.asarray(tensors["blk.1.ffn_gate.weight"].data).reshape(w.shape)
    assert np.array_equal(got, w)
    assert tensors["blk.0.attn_k.weight"].data.shape[0] == 2 * 32  # kv heads x head dim (GQA)
    block_count = r.fields["llama.block_count"]
    assert int(block_count.parts[block_count.data[0]][0]) == 2
