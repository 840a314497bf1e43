"""The meta.json "model" section (common/model_info.py): its three builders agree on one model, and it reads back.

models/family.model_info counts a transformers module's parameters, models/open.model_info a file's tensor table,
profiler/experts.py a mixture of experts' file through the latter. On one model they give one section, except where
they record different things on purpose: weight_dtype (the module's dtype as loaded; the file's stored format) and a
mixture of experts' n_neurons (the profile's one expert; the runtime's whole layer). Head counts and parameter counts
are checked against the transformers modules themselves.
"""

from __future__ import annotations

import pytest
import tiny
from hotneurons.common.artifacts import ArtifactError
from hotneurons.common.model_info import ModelInfo, ParamCounts
from hotneurons.models.family import adapter_for, load_model
from hotneurons.models.open import model_info, open_model


def file_info(path, activation: str | None = None, family: str | None = None) -> dict:
    source, sid, _, act = open_model(str(path), activation=activation)
    adapter = adapter_for(source.config, experts=True)
    return model_info(source, sid, act, family or adapter.name, adapter.gated)


def kv_heads_of(layer, head_dim: int, n_heads: int) -> int:
    """Key/value heads from the attention's weights: k_proj's rows, or Falcon's fused q, k, v rows (H + 2 kv heads)."""
    mods = dict(layer.named_modules())
    k = next((m for n, m in mods.items() if n.endswith("k_proj")), None)
    if k is not None:
        return k.out_features // head_dim
    qkv = next(m for n, m in mods.items() if n.endswith("query_key_value"))
    return (qkv.out_features // head_dim - n_heads) // 2


def check_reads_back(info: dict) -> None:
    assert ModelInfo.from_meta(info).to_meta() == info
    assert list(ModelInfo.from_meta(info).to_meta()) == list(info)  # the keys in meta.json's order


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_module_and_file_table_agree(family, tiny_model_dir):
    """A saved tiny model: transformers' module and the safetensors folder's table give the same section (float32 on
    disk and as loaded, so even weight_dtype agrees), which matches the module's own weights."""
    folder = tiny_model_dir(family)
    lm = load_model(str(folder), device="cpu", dtype="float32", activation=tiny.ACTIVATION_OVERRIDE.get(family))
    info = lm.info
    assert file_info(folder, tiny.ACTIVATION_OVERRIDE.get(family)) == info
    assert list(file_info(folder, tiny.ACTIVATION_OVERRIDE.get(family))) == list(info)
    check_reads_back(info)
    layer0 = lm.layers[0]
    assert info["num_key_value_heads"] == kv_heads_of(layer0, info["head_dim"], info["num_attention_heads"])
    p = info["params"]
    assert p["total"] == sum(x.numel() for x in lm.model.parameters())  # tied weights once
    ffn = ("mlp.", "fc1.", "fc2.")  # HF's names of the FFN: OPT's fc1 and fc2, the others' mlp
    assert p["ffn_per_layer"] == [sum(x.numel() for n, x in la.named_parameters() if n.startswith(ffn))
                                  for la in lm.layers]
    assert p["lm_head"] == (0 if lm.model.config.tie_word_embeddings else p["embedding"])


def test_module_and_gguf_table_agree_but_on_weight_dtype(tmp_path):
    """A Q4_0 GGUF: transformers de-quantizes it (weight_dtype float32, as loaded), the table records q4_0 (as stored);
    everything else, the fingerprint included, is one section."""
    from bench.memory_models import SHAPES, write_gguf_q4

    path = write_gguf_q4(SHAPES["small"], tmp_path / "m.gguf")
    module = load_model(str(path), device="cpu", dtype="float32", cache=False).info
    table = file_info(path)
    assert (module["weight_dtype"], table["weight_dtype"]) == ("float32", "q4_0")
    assert {**table, "weight_dtype": "float32"} == module
    check_reads_back(table)


@pytest.mark.parametrize("family", tiny.MOE_FAMILIES)
def test_experts_section_is_the_table_one_with_one_experts_neurons(family, tiny_model_dir):
    """The profiler's mixture-of-experts section (models/streamed_experts.open_experts) is models/open's with
    n_neurons one expert's; a layer's FFN parameters are the router's, experts' and shared expert's, as in
    transformers' module."""
    from hotneurons.models.streamed_experts import open_experts
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir(family)
    x = open_experts(str(folder))
    table = file_info(folder, family="moe")
    cfg = x.cfg
    assert (x.info["n_neurons"], table["n_neurons"]) == (cfg.n_ff_exp, cfg.n_experts * cfg.n_ff_exp)
    assert {**table, "n_neurons": cfg.n_ff_exp} == x.info
    check_reads_back(x.info)
    hf = AutoModelForCausalLM.from_pretrained(str(folder))
    assert x.info["params"]["total"] == sum(p.numel() for p in hf.parameters())
    assert x.info["params"]["ffn_per_layer"] == [sum(p.numel() for p in la.mlp.parameters()) for la in hf.model.layers]


def test_param_counts_from_layer_totals():
    p = ParamCounts.count(total=1000, embedding=300, lm_head=0, layers=[250, 240], ffn=[100, 90])
    assert p == ParamCounts(embedding=300, lm_head=0, other=210, attention_per_layer=(150, 150),
                            ffn_per_layer=(100, 90))
    assert p.total == 1000
    with pytest.raises(ValueError):  # a layer without its FFN count
        ParamCounts.count(total=1000, embedding=300, lm_head=0, layers=[250, 240], ffn=[100])


def test_older_and_hand_made_sections_read_with_their_defaults():
    """A section without source and dtype (synthetic profiles), without ffn_bias and lm_head, naming only its final norm
    (older profiles): the solver reads it, and writes back only what it holds (plus the total)."""
    old = {"name": "old", "gated": True, "n_layers": 2, "d_model": 8, "n_neurons": 16, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 10,
           "params": {"embedding": 80, "final_norm": 8, "attention_per_layer": [200, 200], "ffn_per_layer": [384, 384]}}
    info = ModelInfo.from_meta(old)
    assert (info.ffn_bias, info.params.lm_head, info.params.other, info.source, info.weight_dtype) == (
        False, 0, 8, None, None)
    assert info.to_meta() == {**{k: v for k, v in old.items() if k != "params"}, "ffn_bias": False,
                              "params": {"total": 80 + 8 + 400 + 768, "embedding": 80, "lm_head": 0, "other": 8,
                                         "attention_per_layer": [200, 200], "ffn_per_layer": [384, 384]}}
    assert (info.rows, info.neuron_params, info.ffn_fixed_params(0)) == (3, 24, 0)


@pytest.mark.parametrize("broken,message", [
    (lambda m: m.pop("head_dim"), "profile meta.json lacks model field 'head_dim': re-run pi-profile"),
    (lambda m: m["params"].pop("embedding"), "profile meta.json lacks model field 'embedding': re-run pi-profile"),
    (lambda m: m["params"]["ffn_per_layer"].pop(), "params per layer do not list 2 layers: re-run pi-profile"),
])
def test_a_broken_section_is_refused_in_one_line(broken, message):
    from hotneurons.solver.synthetic import llama_model_meta

    m = llama_model_meta("tiny", 2, 16, 24, 2, 1, 100)
    check_reads_back(m)
    broken(m)
    with pytest.raises(ArtifactError, match=message):
        ModelInfo.from_meta(m)
