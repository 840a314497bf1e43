"""runtime/static_decoder.py: decode steps over a static KV cache (CUDA graphs on CUDA) equal the same runtime decoding
through HF layers; which models it takes; its fused q/k/v weight; its norm and softmax rounding as HF's."""

import copy
import zlib

import pytest
import tiny
import torch
from hotneurons.kernels import ops
from hotneurons.runtime.generate import RuntimeConfig, generate
from hotneurons.runtime.load import build_runtime
from test_runtime import LOGIT_ATOL, NEW, PROMPT, always_on_predictors, make_placement


@pytest.mark.parametrize("family,where", [("llama-reglu", "mixed"), ("mistral-drelu", "cpu"), ("qwen2-swiglu", "gpu"),
                                         ("qwen3-swiglu", "gpu")])
def test_static_decoder_equals_hf_decode(family, where, tiny_model_dir):
    """runtime/static_decoder.py (static KV cache; CUDA graphs on CUDA) against the same runtime decoding through HF
    layers."""
    lm = tiny.load_rounded(tiny_model_dir(family), family)
    ids = list(lm.tokenizer(PROMPT)["input_ids"])
    placement = make_placement(lm, where)
    preds = always_on_predictors(lm, -1e30)
    mode = {"mode": "dense"} if family.endswith("swiglu") else {}
    rt_hf = build_runtime(copy.deepcopy(lm), RuntimeConfig(device="cpu", static_decode=False, **mode), placement,
                          None if mode else preds)
    rt = build_runtime(lm, RuntimeConfig(device="cpu", **mode), placement, None if mode else preds)
    assert rt.fast is not None and rt_hf.fast is None
    a = generate(rt, ids, NEW, keep_logits=True)
    b = generate(rt_hf, ids, NEW, keep_logits=True)
    assert a.token_ids == b.token_ids
    assert max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits)) < LOGIT_ATOL
    assert a.stats["ffn_sparsity"] == b.stats["ffn_sparsity"]
    # past the static cache the same call decodes through HF
    rt.fast.capacity = len(ids) + 3
    c = generate(rt, ids, NEW, keep_logits=True)
    assert c.token_ids == b.token_ids


def test_static_decoder_not_for_other_families(tiny_model_dir):
    from hotneurons.runtime.static_decoder import supported

    for family in ("opt", "falcon-relu", "gemma-geglu"):
        lm = tiny.load_rounded(tiny_model_dir(family), family)
        rt = build_runtime(lm, RuntimeConfig(mode="dense", device="cpu"))
        assert rt.fast is None and supported(lm, rt.ffns) is not None


def test_static_decoder_reads_q_k_v_as_one_weight_without_a_second_copy(tiny_model_dir):
    """The fused q/k/v weight is the Linear modules' memory (their weights are row slices of it), so the bytes the
    runtime counted are the bytes held: the parameters once, plus the static KV cache it allocated."""
    from hotneurons.runtime.offload import count_bytes

    lm = tiny.load_rounded(tiny_model_dir("qwen2-swiglu"), "qwen2-swiglu")  # q/k/v biases
    rt = build_runtime(lm, RuntimeConfig(mode="dense", device="cpu"))
    for layer, (w, b) in zip(lm.layers, rt.fast.qkv):
        a = layer.self_attn
        rows = [a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features]
        assert w.shape[0] == sum(rows) and b.shape == (sum(rows),)
        starts = [0, rows[0], rows[0] + rows[1]]
        for m, s in zip((a.q_proj, a.k_proj, a.v_proj), starts):
            assert m.weight.data_ptr() == w[s].data_ptr() and m.bias.data_ptr() == b[s:].data_ptr()
    cache = sum(t.numel() * t.element_size() for t in (*rt.fast.k, *rt.fast.v))  # the static KV cache, counted too
    assert count_bytes(lm, rt.ffns, []) == (rt.bytes_gpu - cache, rt.bytes_cpu)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_static_decoder_norm_and_softmax_round_as_hf(dtype):
    check_norm_and_softmax(dtype, "cpu", exact_norm=True)


@torch.inference_mode()  # as the decoder runs
def check_norm_and_softmax(dtype: torch.dtype, device: str, exact_norm: bool) -> None:
    """The two-kernel RMSNorm (torch's fused rms_norm in the input dtype, then the weight) and the softmax in the
    scores' dtype against HF's forms (float32 inside, then a cast), on fresh random inputs."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(int(zlib.crc32(str(dtype).encode())))
    norm = LlamaRMSNorm(512, eps=1e-5)
    norm.weight.data = 1 + 0.1 * torch.randn(512, generator=g)
    norm = norm.to(device, dtype)
    same = torch.equal if exact_norm else lambda a, b: torch.testing.assert_close(a, b) is None
    for scale in (0.01, 1.0, 30.0):
        h = (scale * torch.randn(1, 1, 512, generator=g)).to(device, dtype)
        assert same(ops.rms_norm(norm, h), norm(h))
        out = torch.empty(1, 1, 512, dtype=dtype, device=device)
        assert ops.rms_norm(norm, h, out=out) is out and same(out, norm(h))
    q = torch.randn(1, 2, 3, 16, generator=g).to(device, dtype)  # (1, kv heads, G, hd)
    keys, values = (torch.randn(1, 2, 10, 16, generator=g).to(device, dtype) for _ in range(2))
    filled = 7
    mask = torch.where(torch.arange(10) < filled, 0.0, float("-inf")).to(device, dtype).view(1, 1, 1, 10)
    s = torch.matmul(q, keys.transpose(-1, -2)).float()[..., :filled]  # HF: float32 softmax of the filled slots
    ref = torch.matmul(torch.softmax(s, -1).to(dtype), values[:, :, :filled])
    torch.testing.assert_close(ops.attend(q, keys, values, mask), ref)
    torch.testing.assert_close(ops.attend(q, keys[:, :, :filled], values[:, :, :filled], None), ref)
