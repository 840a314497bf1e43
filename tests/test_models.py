"""models/: our decoders against transformers' own models (float32, eager attention), family by family.

Each tiny family (tests/tiny.py) and a few variants built here (OPT-350m's post-norm and projections, Gemma2's
softcaps and alternating windows, Gemma3 with a full-attention layer and linear rope scaling, LLaMA-3 rope scaling)
is loaded by HF, and our model is fed its state dict under canonical names (weights/names.py), the FFN by dense_ffn.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import tiny
import torch
from hotneurons.kernels.ops import Ops
from hotneurons.models import ModelConfig, build_model, dense_ffn
from hotneurons.weights.names import NameMap
from hotneurons.weights.qtensor import QTensor
from transformers import AutoModelForCausalLM

WINDOW_PROMPT = 24  # Gemma3's tiny window is 16: its prompts are longer
CTX = 48
# OPT-350m's projections, which weights/names.py does not map (yet)
OPT_PROJECTIONS = {"model.decoder.project_in.weight": "project_in.weight",
                   "model.decoder.project_out.weight": "project_out.weight"}


def _variants():
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, OPTConfig

    common = dict(vocab_size=tiny.VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256, bos_token_id=256, eos_token_id=257, pad_token_id=258)
    gated = dict(common, intermediate_size=48, num_key_value_heads=2)
    return {
        "opt-postnorm": lambda: OPTConfig(**common, ffn_dim=48, word_embed_proj_dim=16, do_layer_norm_before=False,
                                          activation_function="relu"),
        "gemma2-softcap": lambda: Gemma2Config(**gated, head_dim=8, hidden_activation="gelu_pytorch_tanh",
                                               sliding_window=8, attn_logit_softcapping=2.0,
                                               final_logit_softcapping=5.0, query_pre_attn_scalar=16),
        "gemma3-mixed": lambda: Gemma3TextConfig(
            **gated, head_dim=8, hidden_activation="gelu_pytorch_tanh", sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}),
        "llama3-rope": lambda: LlamaConfig(**gated, hidden_act="silu", rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 10000.0}),
    }


FAMILIES = [*tiny.FAMILIES, *_variants()]


def _build_variant(name, folder):
    """As tiny.build: random weights, a little larger than HF's init, saved the user's way."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_variants()[name]())
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return folder


def load_hf(folder, family, dtype):
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()
    if family == "mistral-drelu":
        tiny.make_drelu(types.SimpleNamespace(layers=hf.model.layers))
    return hf


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    """reference(family) -> (HF model, ModelConfig, {canonical name: tensor}), built once per module."""
    cache = {}

    def get(family):
        if family not in cache:
            folder = (tiny_model_dir(family) if family in tiny.FAMILIES
                      else _build_variant(family, tmp_path_factory.mktemp(family)))
            hf = load_hf(folder, family, torch.float32)
            cfg = ModelConfig.from_hf(hf.config, tiny.ACTIVATION_OVERRIDE.get(family))
            names = NameMap(cfg.model_type, cfg.n_layers)
            canonical = {k: names(k) or OPT_PROJECTIONS.get(k) for k in hf.state_dict()}
            weights = {canonical[k]: v.detach().clone() for k, v in hf.state_dict().items() if canonical[k]}
            if cfg.tied_embeddings:
                weights.pop("output.weight", None)
            cache[family] = hf, cfg, weights
        return cache[family]

    return get


def ours(cfg, weights, ctx=CTX, release=None, device="cpu"):
    """Our model of `weights` (a dict of canonical names), and a dense FFN callable for its forward."""
    model = build_model(cfg, weights.get, device, torch.float32, ctx, release)
    ffns = [dense_ffn(weights.get, cfg, i, device) for i in range(cfg.n_layers)]
    return model, lambda i, x: ffns[i](x)


def prompt(family, n=12):
    n = WINDOW_PROMPT if family.startswith("gemma") else n
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_equal_hf(reference, family):
    hf, cfg, weights = reference(family)
    tokens = prompt(family)
    model, ffn = ours(cfg, weights)
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]
    torch.testing.assert_close(model.forward(tokens, 0, ffn), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_hf_generate(reference, family):
    """8 tokens one at a time through the static cache == HF generate's (none of these prompts meets EOS)."""
    hf, cfg, weights = reference(family)
    tokens = prompt(family)
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


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_tensor_positions_equal_one_prefill(reference, family):
    """Prefill in chunks == in one; decode steps with the position as a device tensor (the CUDA-graph path: the whole
    cache under a mask) == with an int (only the filled slots); reset() starts over at 0."""
    _, cfg, weights = reference(family)
    tokens = prompt(family)
    model, ffn = ours(cfg, weights)
    whole = model.forward(tokens, 0, ffn)
    model.reset()
    cut = [0, 5, len(tokens) - 3, len(tokens)]
    parts = [model.forward(tokens[a:b], a, ffn) for a, b in zip(cut, cut[1:])]
    # the same float32 sums, but a chunk's matmul may split them over threads in another order: a few roundings of
    # the largest logit apart, whatever the thread count
    tol = dict(atol=max(1e-5, 4e-6 * float(whole.abs().max())), rtol=0)
    torch.testing.assert_close(torch.cat(parts), whole, **tol)

    steps = torch.tensor([7, 100, 3])
    by_int = [model.forward(steps[j:j + 1], len(tokens) + j, ffn) for j in range(3)]
    model.reset()
    model.forward(tokens, torch.tensor(0), ffn)
    by_tensor = [model.forward(steps[j:j + 1], torch.tensor(len(tokens) + j), ffn) for j in range(3)]
    torch.testing.assert_close(torch.cat(by_tensor), torch.cat(by_int), **tol)


# where transformers rounds to bf16 where we keep float32: Falcon's softmax, Gemma2's logit softcap
BF16_LOOSE = {"falcon-relu": 0.1, "falcon-gelu": 0.1, "gemma2-softcap": 0.1}


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_prefill_close_to_hf_bf16(reference, family):
    """In bf16 the norms, rope and attention round where transformers' do (LLaMA's norm casts before its weight,
    Gemma's after (1 + w); OPT scales q first)."""
    hf, cfg, weights = reference(family)
    tokens = prompt(family)
    weights = {k: w.bfloat16() for k, w in weights.items()}
    model = build_model(cfg, weights.get, "cpu", torch.bfloat16, CTX)
    ffns = [dense_ffn(weights.get, cfg, i, dtype=torch.bfloat16) for i in range(cfg.n_layers)]
    got = model.forward(tokens, 0, lambda i, x: ffns[i](x))
    with torch.no_grad():  # loaded in bf16 (converting the float32 one would round its rope frequencies too)
        expected = load_hf(hf.name_or_path, family, torch.bfloat16)(tokens[None]).logits[0].float()
    torch.testing.assert_close(got, expected, atol=BF16_LOOSE.get(family, 0.02), rtol=0)


def _q8_0(w: torch.Tensor) -> QTensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    data = quantize(w.float().numpy(), GGMLQuantizationType.Q8_0)  # (rows, row bytes) uint8
    return QTensor(torch.from_numpy(np.ascontiguousarray(data)), "q8_0", tuple(w.shape))


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_attention_weights_equal_their_dequantized_floats(reference, family):
    """Q8_0 QTensors for every 2-D non-FFN weight (embeddings, attention, head): the same logits as the floats they
    stand for, and the model keeps them quantized."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    _, cfg, weights = reference(family)
    quantized, floats = dict(weights), dict(weights)
    for name, w in weights.items():
        if w.dim() == 2 and ".ffn_" not in name and w.shape[1] % 32 == 0:
            quantized[name] = _q8_0(w)
            back = dequantize(quantized[name].data.numpy(), GGMLQuantizationType.Q8_0)
            floats[name] = torch.from_numpy(back.copy()).reshape(w.shape)
    tokens = prompt(family)
    model_q, ffn = ours(cfg, quantized)
    model_f, _ = ours(cfg, floats)
    torch.testing.assert_close(model_q.forward(tokens, 0, ffn), model_f.forward(tokens, 0, ffn), atol=1e-4, rtol=0)
    assert isinstance(model_q.layers[0].wo, QTensor)
    assert isinstance(model_q.tok_embd, QTensor) == isinstance(quantized["token_embd.weight"], QTensor)


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_model_pulls_only_non_ffn_weights_and_releases_each(reference, family):
    _, cfg, weights = reference(family)
    asked, released = [], []

    def get(name):
        asked.append(name)
        return weights.get(name)

    build_model(cfg, get, "cpu", torch.float32, CTX, released.append)
    assert sorted(asked) == sorted(released) and len(set(asked)) == len(asked)
    assert set(asked) <= set(weights) | {"output.weight"}  # output.weight: asked, absent when tied
    assert set(weights) - set(asked) == {n for n in weights if ".ffn_" in n and "norm" not in n}


def test_refusals_name_the_value():
    from transformers import LlamaConfig

    yarn = LlamaConfig(hidden_size=32, num_attention_heads=4, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "original_max_position_embeddings": 64})
    with pytest.raises(ValueError, match="rope scaling 'yarn' is not supported"):
        ModelConfig.from_hf(yarn)
    cfg = ModelConfig.from_hf(LlamaConfig(hidden_size=32, num_attention_heads=4, max_position_embeddings=64))
    with pytest.raises(ValueError, match="ctx 65 is past the 64 positions"):
        build_model(cfg, lambda name: None, "cpu", torch.float32, 65)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family, quantized", [(f, False) for f in ("llama-swiglu", "qwen3-swiglu", "gemma3-geglu",
                                                                     "gemma2-softcap", "falcon-gelu", "opt")]
                         + [("llama-swiglu", True)])
def test_decode_step_replays_as_a_cuda_graph(reference, family, quantized):
    """The decode step has static shapes: captured once as a CUDA graph, the token and position device tensors that
    the replays refill, it gives the eager steps' logits at each next position."""
    _, cfg, weights = reference(family)
    dev = torch.device("cuda")
    if quantized:
        weights = {k: _q8_0(w) if w.dim() == 2 and ".ffn_" not in k else w for k, w in weights.items()}
    weights = {k: w.to(dev) for k, w in weights.items()}
    model = build_model(cfg, weights.get, dev, torch.float32, CTX)
    ffns = [dense_ffn(weights.get, cfg, i, dev) for i in range(cfg.n_layers)]

    def ffn(i, x):
        return ffns[i](x)

    tokens, steps = prompt(family).to(dev), [5, 77, 130, 9]
    model.forward(tokens, 0, ffn)
    eager = [model.forward(torch.tensor([t], device=dev), len(tokens) + j, ffn) for j, t in enumerate(steps)]

    model.reset()
    model.forward(tokens, 0, ffn)
    tok = torch.tensor([steps[0]], device=dev)  # (1,) the step's token
    pos = torch.tensor(len(tokens), device=dev)  # () its position
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: writes the cache slot that the first replay writes again
        model.forward(tok, pos, ffn)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model.forward(tok, pos, ffn)  # (1, vocab)
    replayed = []
    for j, t in enumerate(steps):
        tok.fill_(t)
        pos.fill_(len(tokens) + j)
        graph.replay()
        replayed.append(out.clone())
    torch.testing.assert_close(torch.cat(replayed), torch.cat(eager), atol=1e-4, rtol=0)


@pytest.mark.parametrize("T,H,K,S,softcap", [(1, 8, 2, 7, 0.0), (5, 12, 4, 9, 0.0), (3, 4, 4, 6, 30.0)])
def test_grouped_attention_equals_float64_per_head(T, H, K, S, softcap):
    """models.common.attend (kv heads batched, no copy of the cache per query head) against each query head's
    attention over its kv head in float64, on random inputs and a random mask."""
    from hotneurons.models.common import attend

    g = torch.Generator().manual_seed(T * 100 + H)
    q, keys, values = (torch.randn(*s, 16, generator=g) for s in ((T, H), (K, S), (K, S)))
    mask = torch.rand(T, S, generator=g) > 0.3
    mask[:, 0] = True
    out = attend(q, keys, values, mask, 0.25, softcap)  # (T, H * hd)
    ref = torch.zeros(T, H, 16, dtype=torch.float64)
    for h in range(H):
        kv = h // (H // K)
        s = q[:, h].double() @ keys[kv].double().T * 0.25  # (T, S)
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        ref[:, h] = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ values[kv].double()
    torch.testing.assert_close(out.double(), ref.reshape(T, H * 16), atol=2e-6, rtol=0)


def test_cached_step_equals_full_forward_without_deprecation_warnings(recwarn):
    """models.family.step, the cached forward the transformers paths decode with: the last position's logits equal a
    full forward's over the whole sequence, and no call warns about the cache argument's name."""
    from hotneurons.models.family import step
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     vocab_size=50)).eval()
    ids = torch.randint(0, 50, (1, 7))
    with torch.no_grad():
        logits, cache = step(m, ids[:, :5])
        for t in (5, 6):
            logits, cache = step(m, ids[:, t:t + 1], cache)
        full = m(input_ids=ids).logits
    torch.testing.assert_close(logits[0, -1], full[0, -1], atol=1e-5, rtol=1e-5)
    assert not [w for w in recwarn if "past_key_values" in str(w.message)]


# float32 throughout: the fused ops round where torch does; sums (norms, softmax, the GEMVs) add in another order
STEP_TOL = dict(atol=2e-5, rtol=2e-5)
STEP_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton kernels take CUDA tensors only
REFUSED = {"opt", "falcon-relu", "falcon-gelu", "gemma-geglu", "gemma3-geglu", "opt-postnorm", "gemma2-softcap",
           "gemma3-mixed"}


def check_step_layer(model, ffn, tokens: torch.Tensor, ops_name: str) -> None:
    """Prefill `tokens`, then one decode token through layers 0 and 1 both ways from the same cache: the reference
    (layer 1's input = layer 0's h2 + its FFN's output, given as a device sum plus a float32 cold sum) and step_layer
    in its graph form (whole cache, masked) and its eager form (the filled slots)."""
    d, dev = model.cfg.d_model, model.device
    if ops_name == "triton":
        pytest.importorskip("triton")
    ops = Ops.named(ops_name)
    model.forward(tokens.to(dev), 0, ffn)
    caches = model.k_cache.clone(), model.v_cache.clone()
    pos = len(tokens)
    g = torch.Generator().manual_seed(pos)
    h = torch.randn(1, d, generator=g).to(dev)  # (1, d) layer 0's input
    hot, cold = torch.randn(1, d, generator=g).to(dev), torch.randn(d, generator=g).to(dev)  # layer 0's FFN sums
    h2_ref, x_ref = model.attention(0, h, pos)
    h2b_ref, xb_ref = model.attention(1, h2_ref + (hot + cold), pos)
    k_ref, v_ref = model.k_cache[:, :, pos].clone(), model.v_cache[:, :, pos].clone()  # (layers, K, hd)
    p = torch.tensor([pos], device=dev)
    # eager steps run the torch ops (graph_steps: the fused attention reads a whole contiguous cache)
    for filled in (None,) if ops_name == "triton" else (None, pos + 1):
        model.k_cache.copy_(caches[0])
        model.v_cache.copy_(caches[1])
        model.step_begin(p)
        h2, x, h2b, xb = (torch.full((1, d), float("nan"), device=dev) for _ in range(4))
        model.step_layer(0, h, p, ops, h2, x, filled)
        model.step_layer(1, (h2, hot, cold), p, ops, h2b, xb, filled)
        for got, want in ((h2, h2_ref), (x, x_ref), (h2b, h2b_ref), (xb, xb_ref)):
            torch.testing.assert_close(got, want, **STEP_TOL)
        torch.testing.assert_close(model.k_cache[:, :, pos], k_ref, **STEP_TOL)
        torch.testing.assert_close(model.v_cache[:, :, pos], v_ref, **STEP_TOL)
        assert torch.equal(model.k_cache[:, :, :pos], caches[0][:, :, :pos])  # no other slot written


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ops_name", ["torch", "triton"])
def test_fused_step_layer_equals_reference_layer(reference, family, ops_name):
    """A decoder's fused decode step (Llama.step_begin / step_layer: a few kernels a layer) against its reference
    layer, through the torch ops and kernels/fused.py's Triton kernels; the families without one say why."""
    hf, cfg, weights = reference(family)
    model, ffn = ours(cfg, weights, device=STEP_DEVICE)
    why = model.step_supported()
    assert (why is not None) == (family in REFUSED), why
    if why is None:
        check_step_layer(model, ffn, prompt(family), ops_name)
