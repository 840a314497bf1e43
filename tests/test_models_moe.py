"""models/ on the mixtures of experts against transformers' own models (float32, eager attention), as
tests/test_models.py does for the dense families.

Each tiny model (tests/tiny.MOE_FAMILIES: Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE, OLMoE; and an OLMoE
with clip_qkv, built here) is loaded by HF, and our model is fed its weights under canonical names (weights/names.py:
each projection's experts stacked in one tensor), the FFN by models/moe.py. The FFN itself is checked in float64
against a plain loop over tokens and experts.
"""

from __future__ import annotations

import copy
import dataclasses

import gguf
import numpy as np
import pytest
import tiny
import torch
from hotneurons.common.kinds import Activation
from hotneurons.models import ModelConfig, build_model, moe
from hotneurons.weights.names import NameMap
from hotneurons.weights.qtensor import QTensor
from hotneurons.weights.safetensors_source import SafetensorsSource
from test_models import CTX, STEP_DEVICE, check_step_layer, ours  # dense_ffn dispatches MoE configs to models/moe.py
from transformers import AutoModelForCausalLM

FAMILIES = [*tiny.MOE_FAMILIES, "olmoe-clip"]


def _build_clip(folder):
    """OLMoE with q, k, v clamped to [-1, 1] (clip_qkv: tiny activations are clamped often)."""
    from transformers import OlmoeConfig

    torch.manual_seed(0)
    cfg = OlmoeConfig(vocab_size=tiny.VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, bos_token_id=256, eos_token_id=257,
                      pad_token_id=258, intermediate_size=16, num_experts=4, num_experts_per_tok=2, clip_qkv=1.0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    """reference(family) -> (folder, HF model, ModelConfig, {canonical name: tensor}), built once per module."""
    cache = {}

    def get(family):
        if family not in cache:
            folder = (tiny_model_dir(family) if family in tiny.MOE_FAMILIES
                      else _build_clip(tmp_path_factory.mktemp(family)))
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
            cfg = ModelConfig.from_hf(hf.config)
            weights = {k: v.detach().clone() for k, v in
                       NameMap(cfg.model_type, cfg.n_layers).tensors(hf.state_dict()).items()}
            cache[family] = folder, hf, cfg, weights
        return cache[family]

    return get


def prompt(n=12):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_equal_hf(reference, family):
    _, hf, cfg, weights = reference(family)
    assert cfg.family == "moe" and cfg.n_experts == 4 and cfg.n_experts_used == 2
    tokens = prompt()
    model, ffn = ours(cfg, weights)
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]
    torch.testing.assert_close(model.forward(tokens, 0, ffn), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_hf_generate(reference, family):
    """8 tokens one at a time through the static cache == HF generate's."""
    _, hf, cfg, weights = reference(family)
    tokens = prompt()
    model, ffn = ours(cfg, weights)
    with torch.no_grad():
        out = hf.generate(tokens[None], attention_mask=torch.ones_like(tokens[None]), max_new_tokens=8,
                          do_sample=False)
    expected = out[0, len(tokens):].tolist()
    got, logits = [], model.forward(tokens, 0, ffn)
    for pos in range(len(tokens), len(tokens) + 8):
        got.append(int(logits[-1].argmax()))
        logits = model.forward(torch.tensor(got[-1:]), pos, ffn)
    assert got == expected


@pytest.mark.parametrize("family", tiny.MOE_FAMILIES)
def test_config_reads_the_experts(reference, family):
    _, hf, cfg, _ = reference(family)
    c = hf.config
    assert cfg.n_ff_exp == cfg.n_ff == (getattr(c, "moe_intermediate_size", None) or c.intermediate_size)
    assert cfg.norm_topk == (family in ("mixtral", "qwen3-moe"))
    assert cfg.n_ff_shexp == (48 if family == "qwen2-moe" else 0)
    assert (cfg.qk_norm, cfg.qk_norm_whole) == {"qwen3-moe": (True, False), "olmoe": (True, True)}.get(family,
                                                                                                      (False, False))


@pytest.mark.parametrize("family", tiny.MOE_FAMILIES)
def test_safetensors_source_stacks_the_files_experts(reference, family):
    """The saved folder holds one tensor per expert (what transformers 5 writes): the source serves them stacked under
    llama.cpp's names, equal to the module's own stacked (gate_up_proj split) tensors; the rest stay views."""
    folder, _, cfg, weights = reference(family)
    src = SafetensorsSource(folder)
    assert set(src.infos) == set(weights) and not src.unmapped
    for name, w in weights.items():
        t = src.get(name)
        assert torch.equal(t, w) and src.infos[name].shape == tuple(w.shape), name
        assert (src.infos[name].converted == "stacked experts") == name.endswith("_exps.weight"), name
        assert src.is_mapped(t) != name.endswith("_exps.weight"), name
    E, n, d = cfg.n_experts, cfg.n_ff_exp, cfg.d_model
    assert src.infos["blk.1.ffn_gate_exps.weight"].shape == (E, n, d)
    assert src.infos["blk.1.ffn_down_exps.weight"].shape == (E, d, n)
    assert src.release("blk.0.ffn_up_exps.weight") >= 0


@pytest.mark.parametrize("family", tiny.MOE_FAMILIES)
def test_model_pulls_only_non_ffn_weights(reference, family):
    """Routers, experts and the shared expert are the FFN's (the engine's), not the decoder's."""
    _, _, cfg, weights = reference(family)
    asked, released = [], []
    build_model(cfg, lambda name: asked.append(name) or weights.get(name), "cpu", torch.float32, CTX, released.append)
    assert sorted(asked) == sorted(released)
    assert set(weights) - set(asked) == {n for n in weights if ".ffn_" in n and "norm" not in n}


# ---------------------------------------------------------------------------------------------------------------
# models/moe.py against a loop over tokens and experts


def _cfg(norm_topk: bool, shared: int) -> ModelConfig:
    return ModelConfig(family="moe", model_type="test", n_layers=1, d_model=32, n_heads=4, n_kv_heads=4,
                       head_dim=8, n_ff=24, vocab=16, activation=Activation.SWIGLU, act_fn="silu", norm="rms",
                       norm_eps=1e-6, max_positions=64, rope=None, n_experts=6, n_experts_used=3,
                       norm_topk=norm_topk, n_ff_exp=24, n_ff_shexp=shared)


def _weights(cfg: ModelConfig, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    E, n, d, s = cfg.n_experts, cfg.n_ff_exp, cfg.d_model, cfg.n_ff_shexp
    shapes = {"gate_inp": (E, d), "gate_exps": (E, n, d), "up_exps": (E, n, d), "down_exps": (E, d, n)}
    if s:
        shapes |= {"gate_shexp": (s, d), "up_shexp": (s, d), "down_shexp": (d, s), "gate_inp_shexp": (1, d)}
    return {f"blk.0.ffn_{k}.weight": torch.randn(shape, generator=g, dtype=dtype) for k, shape in shapes.items()}


def _loop(cfg: ModelConfig, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, as the routing is written in the HF modeling files."""
    def swiglu(x, gate, up, down):
        return down @ (torch.nn.functional.silu(gate @ x) * (up @ x))

    p, y = "blk.0.ffn_", torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(w[p + "gate_inp.weight"] @ x[t], -1)  # (E,)
        top = torch.argsort(probs, descending=True)[:cfg.n_experts_used]
        weights = probs[top] / probs[top].sum() if cfg.norm_topk else probs[top]
        for e, we in zip(top.tolist(), weights):
            y[t] += we * swiglu(x[t], w[p + "gate_exps.weight"][e], w[p + "up_exps.weight"][e],
                                w[p + "down_exps.weight"][e])
        if cfg.n_ff_shexp:
            y[t] += torch.sigmoid(w[p + "gate_inp_shexp.weight"] @ x[t]) * swiglu(
                x[t], w[p + "gate_shexp.weight"], w[p + "up_shexp.weight"], w[p + "down_shexp.weight"])
    return y


@pytest.mark.parametrize("norm_topk, shared", [(True, 0), (False, 0), (False, 40)])
def test_moe_ffn_equals_a_loop_over_tokens_and_experts_float64(monkeypatch, norm_topk, shared):
    cfg = _cfg(norm_topk, shared)
    w = _weights(cfg, torch.float64)
    x = torch.randn(9, cfg.d_model, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = _loop(cfg, w, x)
    got = moe.moe_ffn(w.get, cfg, 0, dtype=torch.float64)(x)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)
    monkeypatch.setattr(moe, "GATHER_BYTES", 1)  # a chunk of one token at a time (long prefills)
    torch.testing.assert_close(moe.moe_ffn(w.get, cfg, 0, dtype=torch.float64)(x), ref, atol=1e-10, rtol=1e-10)


def test_quantized_experts_equal_their_dequantized_floats():
    """A quantized stacked tensor comes as (E * out, in) rows: the FFN reads it as its floats."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    cfg = _cfg(True, 40)
    w = _weights(cfg, torch.float32)
    quantized, floats = dict(w), dict(w)
    for name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"):  # rows of d = 32: one Q8_0 block
        rows = w[name].reshape(-1, cfg.d_model).numpy()
        data = quantize(rows, GGMLQuantizationType.Q8_0)
        quantized[name] = QTensor(torch.from_numpy(np.ascontiguousarray(data)), "q8_0", rows.shape)
        floats[name] = torch.from_numpy(dequantize(data, GGMLQuantizationType.Q8_0).copy()).reshape(w[name].shape)
    x = torch.randn(5, cfg.d_model, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(moe.moe_ffn(quantized.get, cfg, 0)(x), moe.moe_ffn(floats.get, cfg, 0)(x),
                               atol=1e-5, rtol=1e-5)


def test_refusals_name_the_value():
    """Dense layers of a Qwen MoE, the stages that do not run experts yet, and moe_ffn on a dense config."""
    from hotneurons.common.model_source import ModelError
    from hotneurons.models.family import adapter_for
    from transformers import MixtralConfig, Qwen2MoeConfig

    small = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, num_experts=4)
    with pytest.raises(ValueError, match=r"dense FFN layers \(\[1\].*not supported"):
        ModelConfig.from_hf(Qwen2MoeConfig(**small, mlp_only_layers=[1]))
    with pytest.raises(ValueError, match=r"dense FFN layers \(\[0\].*decoder_sparse_step 2"):
        ModelConfig.from_hf(Qwen2MoeConfig(**small, decoder_sparse_step=2))
    with pytest.raises(ModelError, match="model type 'mixtral' is a mixture of experts.*not whole through"):
        adapter_for(MixtralConfig(hidden_size=32, num_attention_heads=4))
    with pytest.raises(ValueError, match="has no experts"):
        moe.moe_ffn(lambda name: None, dataclasses.replace(_cfg(True, 0), n_experts=0), 0)


# ---------------------------------------------------------------------------------------------------------------
# GGUF files in llama.cpp's layout (export/gguf_model.write_moe_gguf), read back in place (weights/gguf_source.py)


def _fp16_reference(hf, cfg):
    """A copy of the HF model with the weights the GGUF holds: matrices rounded to fp16, routers and norms F32."""
    rounded, names = copy.deepcopy(hf), NameMap(cfg.model_type, cfg.n_layers)
    with torch.no_grad():
        for hf_name, p in rounded.named_parameters():
            if p.dim() >= 2 and not any(".ffn_gate_inp" in part.name for part in names.parts(hf_name)):
                p.copy_(p.half().float())
    return rounded


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_read_in_place_equals_hf(reference, family, tmp_path):
    """The F16 GGUF of each family: its config reads back as the HF one's ModelConfig, its stacked experts as (E, out,
    in) views of the file, and our decoder on its tensors gives HF's logits on the same fp16-rounded weights (float32
    compute: the dense models' tolerance)."""
    from hotneurons.export.gguf_model import MOE_ARCH, vocab_from_tokenizer, write_moe_gguf
    from hotneurons.weights.gguf_source import GGUFSource

    _, hf, cfg, _ = reference(family)
    path = tmp_path / "m.gguf"
    write_moe_gguf(hf, path, vocab_from_tokenizer(tiny.byte_tokenizer(), tiny.VOCAB))
    tokens = prompt()
    with torch.no_grad():
        expected = _fp16_reference(hf, cfg)(tokens[None]).logits[0]
    with GGUFSource(path) as src:
        assert src.arch == MOE_ARCH[cfg.model_type]
        got = ModelConfig.from_hf(src.config)  # the file keeps eps as float32
        rope_dims = gguf.GGUFReader(path).fields[f"{src.arch}.rope.dimension_count"]
        assert int(rope_dims.parts[-1][0]) == cfg.head_dim  # llama.cpp checks it against the head size
        assert got.norm_eps == pytest.approx(cfg.norm_eps) and dataclasses.replace(got, norm_eps=cfg.norm_eps) == cfg
        E, n, d = cfg.n_experts, cfg.n_ff_exp, cfg.d_model
        for proj, shape in (("gate", (E, n, d)), ("up", (E, n, d)), ("down", (E, d, n))):
            name = f"blk.1.ffn_{proj}_exps.weight"
            t = src.get(name)
            assert src.infos[name].shape == shape and t.dtype == torch.float16 and src.is_mapped(t), name
        assert src.get("blk.0.ffn_gate_inp.weight").dtype == torch.float32  # routers F32, as llama.cpp's converter
        if cfg.n_ff_shexp:  # stored (d,) as llama.cpp's converter squeezes it, served (1, d)
            assert src.file.tensors["blk.0.ffn_gate_inp_shexp.weight"].shape == (d,)
            assert src.get("blk.0.ffn_gate_inp_shexp.weight").shape == (1, d)
        model, ffn = ours(cfg, src)
        torch.testing.assert_close(model.forward(tokens, 0, ffn), expected, atol=1e-4, rtol=0)


def test_gguf_block_format_experts_read_in_place(reference, tmp_path):
    """Stacked experts in a block format (Q8_0 gate and up: rows of d = 32, one block each) come as QTensors of
    (E * out, in) rows, views of the file; the decoder computes with their de-quantized values."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from hotneurons.export.gguf_model import Tensor, hf_state, moe_metadata, moe_tensors, write_gguf
    from hotneurons.weights.gguf_source import GGUFSource

    _, hf, cfg, _ = reference("qwen2-moe")
    q8, floats, tensors = GGMLQuantizationType.Q8_0, {}, []
    for t in moe_tensors(hf_state(hf), hf.config):
        if t.name.endswith(("gate_exps.weight", "up_exps.weight")):
            blocks = np.ascontiguousarray(quantize(t.data().astype(np.float32), q8))  # (E, n, 34) uint8
            floats[t.name] = torch.from_numpy(dequantize(blocks, q8).copy())  # (E, n, d)
            t = Tensor(t.name, blocks.shape, np.dtype(np.uint8), lambda b=blocks: b, ggml_type=int(q8))
        tensors.append(t)
    write_gguf(tmp_path / "q.gguf", "qwen2moe", lambda w: moe_metadata(w, hf.config, "q8"), tensors)
    tokens = prompt()
    with GGUFSource(tmp_path / "q.gguf") as src:
        E, n, d = cfg.n_experts, cfg.n_ff_exp, cfg.d_model
        q = src.get("blk.0.ffn_up_exps.weight")
        assert isinstance(q, QTensor) and q.shape == (E * n, d) and src.is_mapped(q)
        assert src.infos["blk.0.ffn_up_exps.weight"].shape == (E, n, d)
        model, ffn = ours(cfg, src)
        ref_model, ref_ffn = ours(cfg, {k: floats.get(k, src.get(k)) for k in src.infos})
        torch.testing.assert_close(model.forward(tokens, 0, ffn), ref_model.forward(tokens, 0, ref_ffn),
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ops_name", ["torch", "triton"])
def test_fused_step_layer_equals_reference_layer(reference, family, ops_name):
    """The decode step's fused form of the attention (test_models.check_step_layer) on the MoE families; OLMoE's clamp
    of q, k, v has none."""
    _, _, cfg, weights = reference(family)
    model, ffn = ours(cfg, weights, device=STEP_DEVICE)
    why = model.step_supported()
    assert (why is not None) == (family == "olmoe-clip"), why
    if why is None:
        check_step_layer(model, ffn, prompt(), ops_name)
