"""pi-export of a run over a Q4_0 GGUF model (export/powerinfer_gguf.py): the model's tensors byte for byte as stored,
ffn_down_t equal to gguf-py's Q4_0 of the stored down matrix's columns, the predictors with the norm folded in, the
source's metadata under PowerInfer's arch, the gpuidx the placement; the per-layer thresholds refused, or replaced by
--threshold with the replaced ones kept."""

from types import SimpleNamespace

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from hotneurons.export import export_run
    from hotneurons.export.roundtrip import write_profile_and_placement
    from hotneurons.models.family import adapter_for
    from hotneurons.models.open import model_info, open_model

    from bench.bench_70b import install_predictors
    from bench.bench_gguf import write_model

    work = tmp_path_factory.mktemp("pwri-gguf")
    path = work / "model.gguf"
    write_model("tiny", 2, path, "cpu", calibration_tokens=256, seq=64, rank=31, log=lambda *_: None)
    source, sid, _, act = open_model(str(path))
    ad = adapter_for(source.config)
    info = model_info(source, sid, act, ad.name, ad.gated)
    counts = np.random.default_rng(3).integers(0, 200, (2, info["n_neurons"]))  # (layers, neurons)
    write_profile_and_placement(work / "run", info, counts, 200, 0.25)
    install_predictors(work / "run", path)
    summary = export_run(work / "run", work / "out", threshold=0.0)
    return SimpleNamespace(work=work, path=path, source=source, run=work / "run", out=work / "out",
                           summary=summary, info=info)


def test_tensors_as_stored_down_rows_and_predictors(exported, tmp_path):
    from hotneurons.artifacts.placement import read_placement
    from safetensors.torch import load_file
    from test_export_powerinfer import field, read_gguf

    e = exported
    r = read_gguf(e.out / e.summary["files"]["model"], tmp_path)
    src = gguf.GGUFReader(str(e.path))
    t, s = {x.name: x for x in r.tensors}, {x.name: x for x in src.tensors}
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down_t", "fc1", "fc2"]
    assert set(t) == {"token_embd.weight", "output_norm.weight", "output.weight",
                      *(f"blk.{i}.{k}.weight" for i in range(2) for k in per_layer)}
    for name in ("token_embd.weight", "output.weight", "blk.1.attn_q.weight", "blk.0.ffn_gate.weight",
                 "blk.1.ffn_up.weight", "blk.0.ffn_norm.weight"):  # copied as stored
        assert t[name].tensor_type == s[name].tensor_type and np.array_equal(t[name].data, s[name].data), name
    Q4 = gguf.GGMLQuantizationType.Q4_0
    for i in range(2):
        down = gguf.quants.dequantize(s[f"blk.{i}.ffn_down.weight"].data, Q4)  # (d, n) float32
        ref = gguf.quants.quantize(np.ascontiguousarray(down.T), Q4)  # (n, row bytes): gguf-py's rows
        got = t[f"blk.{i}.ffn_down_t.weight"]
        assert got.tensor_type == Q4 and np.array_equal(np.asarray(got.data), ref)
    preds = load_file(str(e.path.with_suffix(".predictors.safetensors")))
    gamma = e.source.get("blk.1.ffn_norm.weight").float()
    fc1 = (preds["layers.1.fc1.weight"].float() * gamma).numpy().astype(np.float16)  # the norm folded in
    assert np.array_equal(np.asarray(t["blk.1.fc1.weight"].data), fc1)
    assert np.array_equal(np.asarray(t["blk.1.fc2.weight"].data), preds["layers.1.fc2.weight"].numpy())
    assert field(r, "general.architecture") == ["llama"] and field(r, "powerinfer.sparse_threshold") == [0.0]
    assert field(r, "llama.block_count") == [2] and field(r, "llama.feed_forward_length") == [e.info["n_neurons"]]
    assert field(r, "tokenizer.ggml.tokens") == field(src, "tokenizer.ggml.tokens")
    replaced = e.summary["source"]["replaced_thresholds"]
    assert replaced == pytest.approx([float(preds[f"layers.{i}.threshold"]) for i in range(2)])
    assert all(x < 0 for x in replaced)  # the bench's thresholds for recall 0.97
    placement = read_placement(e.run, e.info)
    assert e.summary["gpu_neurons_per_layer"] == [int(placement[i].sum()) for i in range(2)]
    neuron = 3 * e.info["d_model"] // 32 * 18  # Q4_0 rows of gate, up, down_t: bytes
    assert e.summary["vram_capacity"] == sum(e.summary["gpu_neurons_per_layer"]) * neuron


def test_per_layer_thresholds_refused_without_one_threshold(exported, tmp_path):
    from hotneurons.export import ExportError, export_run

    with pytest.raises(ExportError, match="threshold"):
        export_run(exported.run, tmp_path / "out")
    assert not (tmp_path / "out").exists()
