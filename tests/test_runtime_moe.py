"""HybridMoE (runtime/moe_ffn.py) against the reference mixture of experts (models/moe.moe_ffn on the same weights,
de-quantized) on tiny random layers shaped as each family's (top-k renormalised or not, Qwen2-MoE's shared expert),
for every placement kind (all experts on the device, all on the CPU, random masks), decode (one token) and prefill
(tokens grouped per expert), experts stored as F32, F16, Q8_0 and Q4_0 (rows of gguf-py's bytes, read in place).

Tolerance: both sides compute in float32 from the same de-quantized weights and the same routing (route() on the same
logits), in other orders of summation: atol 2e-5 x the output's scale, rtol 1e-4.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hotneurons.common.kinds import Activation
from hotneurons.models import ModelConfig, moe
from hotneurons.runtime.moe_ffn import HybridMoE
from hotneurons.weights.qtensor import QTensor

E, K, D, N, SHARED = 6, 3, 64, 32, 64
# the families' routing and shared-expert switches (models/config.py reads them from each HF config)
FAMILIES = {"mixtral": (True, 0), "qwen2-moe": (False, SHARED), "qwen3-moe": (True, 0), "olmoe": (False, 0)}
QTYPE = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
         "q6_k": gguf.GGMLQuantizationType.Q6_K}


def _cfg(family: str) -> ModelConfig:
    norm_topk, shared = FAMILIES[family]
    return ModelConfig(family="moe", model_type=family, n_layers=1, d_model=D, n_heads=4, n_kv_heads=4, head_dim=16,
                       n_ff=N, vocab=16, activation=Activation.SWIGLU, act_fn="silu", norm="rms", norm_eps=1e-6,
                       max_positions=64, rope=None, n_experts=E, n_experts_used=K, norm_topk=norm_topk, n_ff_exp=N,
                       n_ff_shexp=shared)


def _weights(cfg: ModelConfig, fmt: str, seed: int = 0) -> dict:
    """Layer 0's canonical MoE tensors: experts in `fmt` (f32 / f16: (E, out, in) tensors; block formats: QTensors of
    (E * out, in) rows, as weights/gguf_source serves them), router and shared expert float32."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"gate_inp": (E, D), "gate_exps": (E, N, D), "up_exps": (E, N, D), "down_exps": (E, D, N)}
    if cfg.n_ff_shexp:
        shapes |= {"gate_shexp": (SHARED, D), "up_shexp": (SHARED, D), "down_shexp": (D, SHARED),
                   "gate_inp_shexp": (1, D)}
    w = {}
    for k, shape in shapes.items():
        t = torch.randn(shape, generator=g) * (0.5 if k == "gate_inp" else 0.2)
        if k.endswith("_exps") and fmt in QTYPE:
            rows = t.reshape(-1, shape[-1]).numpy()
            t = QTensor(torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(rows, QTYPE[fmt]))), fmt,
                        rows.shape)
        elif k.endswith("_exps") and fmt == "f16":
            t = t.half()
        w[f"blk.0.ffn_{k}.weight"] = t
    return w


def _masks(seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"gpu": np.ones(E, bool), "cpu": np.zeros(E, bool), "mixed": rng.random(E) < 0.5}


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-5 * max(1.0, float(ref.abs().max())))


def _x(T: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("fmt", ["f32", "q8_0", "q4_0"])
@pytest.mark.parametrize("where", ["gpu", "cpu", "mixed"])
def test_equals_reference_decode_and_prefill(family, fmt, where):
    cfg = _cfg(family)
    w = _weights(cfg, fmt)
    ref = moe.moe_ffn(w.get, cfg, 0)
    ffn = HybridMoE(0, cfg, w.get, _masks()[where])
    x = _x(9)
    _close(ffn(x), ref(x))  # prefill: 9 tokens
    for t in range(3):  # decode: one token at a time
        _close(ffn(x[t:t + 1]), ref(x[t:t + 1]))


@pytest.mark.parametrize("fmt", ["f16", "q4_0"])
def test_random_masks_and_counts(fmt):
    """Random placements; decode counts each routed pair on its side."""
    cfg = _cfg("qwen2-moe")
    w = _weights(cfg, fmt, seed=4)
    ref = moe.moe_ffn(w.get, cfg, 0)
    rng = np.random.default_rng(5)
    for _ in range(3):
        mask = rng.random(E) < 0.4
        ffn = HybridMoE(0, cfg, w.get, mask)
        x = _x(5, seed=int(rng.integers(100)))
        _close(ffn(x), ref(x))
        ffn.reset_counts()
        for t in range(5):
            _close(ffn(x[t:t + 1]), ref(x[t:t + 1]))
        c = ffn.read_counts()
        assert c[0] == 5 and c[1] == 5 * K * N and c[2] + c[3] == c[1]
        assert ffn.expert_counts.sum() == 5 * K
        assert c[2] == N * ffn.expert_counts[mask].sum()


def test_cold_experts_read_in_place():
    """Cold rows are views of the stored bytes (the mmapped file's), GPU experts on a CPU run views too; device bytes
    count the GPU experts only."""
    cfg = _cfg("mixtral")
    w = _weights(cfg, "q4_0")
    mask = _masks()["mixed"]
    ffn = HybridMoE(0, cfg, w.get, mask)
    assert ffn.in_place
    for proj, rows in zip(("gate", "up", "down"), ffn.cold):
        assert np.shares_memory(rows, w[f"blk.0.ffn_{proj}_exps.weight"].data.numpy())
    per_expert = sum(w[f"blk.0.ffn_{p}_exps.weight"].data.numel() // E for p in ("gate", "up", "down"))
    assert ffn.device_bytes() == mask.sum() * per_expert + E * D * 4
    assert ffn.cold_bytes() == (~mask).sum() * per_expert


def test_other_block_formats_are_requantized():
    """Q5_0 experts (no kernel reads them): the cold experts only, re-quantized to q8_0 into a compact stack; the GPU
    experts on a CPU run stay the file's rows. Equal to the reference within q8_0's rounding of the weights."""
    cfg = dataclass_replace(_cfg("olmoe"), d_model=256, n_ff_exp=256, n_ff=256)
    g = torch.Generator().manual_seed(6)
    w = {"blk.0.ffn_gate_inp.weight": torch.randn(E, 256, generator=g) * 0.1}
    for k in ("gate_exps", "up_exps", "down_exps"):
        rows = (torch.randn(E * 256, 256, generator=g) * 0.2).numpy()
        blocks = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q5_0)
        w[f"blk.0.ffn_{k}.weight"] = QTensor(torch.from_numpy(blocks), "q5_0", (E * 256, 256))
    mask = np.array([True, False, False, True, False, False])
    ffn = HybridMoE(0, cfg, w.get, mask)
    assert not ffn.in_place and ffn.cold[0].shape[0] == 4 * 256
    x = torch.randn(4, 256, generator=g)
    ref = moe.moe_ffn(w.get, cfg, 0)(x)
    torch.testing.assert_close(ffn(x), ref, rtol=0, atol=0.02 * float(ref.abs().max()))


def dataclass_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


def test_refusals():
    cfg = _cfg("mixtral")
    w = _weights(cfg, "f32")
    with pytest.raises(ValueError, match="placement has .* entries, the layer 6 experts"):
        HybridMoE(0, cfg, w.get, np.ones(5, bool))
    with pytest.raises(ValueError, match="has no experts"):
        HybridMoE(0, dataclass_replace(cfg, n_experts=0), w.get, np.ones(0, bool))


# ---------------------------------------------------------------------------------------------------------------
# The engine: a tiny MoE file (tests/test_models_moe.py's models) read in place into our decoder with HybridMoE layers,
# greedy tokens equal to HF's on the weights the file holds


NEW = 8


@pytest.fixture(scope="module")
def moe_gguf(tiny_model_dir, tmp_path_factory):
    """moe_gguf(family) -> (F16 GGUF path, HF model with the fp16-rounded weights the file holds), once per family."""
    import tiny
    from hotneurons.export.gguf_model import vocab_from_tokenizer, write_moe_gguf
    from test_models_moe import _fp16_reference
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(family):
        if family not in cache:
            folder = tiny_model_dir(family)
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
            path = tmp_path_factory.mktemp(family) / "m.gguf"
            write_moe_gguf(hf, path, vocab_from_tokenizer(tiny.byte_tokenizer(), tiny.VOCAB))
            cache[family] = path, _fp16_reference(hf, ModelConfig.from_hf(hf.config)), folder
        return cache[family]

    return get


def _hf_greedy(hf, ids, n=NEW):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


PROMPT_IDS = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe", "qwen3-moe", "olmoe"])
@pytest.mark.parametrize("where", ["gpu", "cpu", "mixed"])
def test_engine_gguf_greedy_equals_hf(moe_gguf, family, where):
    from hotneurons.runtime.generate import RuntimeConfig, generate
    from hotneurons.runtime.load import load_source_runtime

    path, hf, _ = moe_gguf(family)
    L, E = hf.config.num_hidden_layers, 4
    mask = {"gpu": np.ones((L, E), bool), "cpu": np.zeros((L, E), bool),
            "mixed": np.random.default_rng(len(family)).random((L, E)) < 0.5}[where]
    rt = load_source_runtime(None, None, RuntimeConfig(device="cpu"), model=str(path), placement=mask)
    assert type(rt.lm).__name__ == "SourceModel" and all(type(f).__name__ == "HybridMoE" for f in rt.ffns)
    g = generate(rt, PROMPT_IDS, NEW, stop_at_eos=False)
    assert g.token_ids == _hf_greedy(hf, PROMPT_IDS)
    s = g.stats
    assert s["ffn_sparsity"] == pytest.approx(1 - 2 / 4)  # k / E of the experts' neurons run
    assert s["gpu_activation_share"] == pytest.approx(1.0 if where == "gpu" else 0.0) or where == "mixed"


def test_engine_safetensors_folder_default_placement(moe_gguf):
    """A safetensors folder (float32, experts stacked by the source), no placement: every expert on the device."""
    from hotneurons.runtime.generate import RuntimeConfig, generate
    from hotneurons.runtime.load import load_runtime
    from transformers import AutoModelForCausalLM

    _, _, folder = moe_gguf("qwen2-moe")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    rt = load_runtime(None, RuntimeConfig(device="cpu"), model=str(folder))
    assert all(f.gpu.all() for f in rt.ffns)
    assert generate(rt, PROMPT_IDS, NEW, stop_at_eos=False).token_ids == _hf_greedy(hf, PROMPT_IDS)


def test_pi_generate_on_a_moe_gguf(moe_gguf):
    """The CLI, as a user runs it on a GGUF: the same greedy tokens as HF."""
    import json

    from click.testing import CliRunner
    from hotneurons.runtime.cli import main

    path, hf, _ = moe_gguf("mixtral")
    res = CliRunner().invoke(main, ["--model", str(path), "--device", "cpu", "--prompt", "Hello world", "-n",
                                    str(NEW), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    ids = list(__import__("tiny").byte_tokenizer()("Hello world")["input_ids"])
    want = _hf_greedy(hf, ids)
    assert out["token_ids"] == want[:len(out["token_ids"])] and out["stats"]["mode"] == "hybrid"


def test_memory_plan_counts_the_gpu_experts(moe_gguf):
    from hotneurons.runtime.memory import plan_moe_bytes
    from hotneurons.runtime.moe_load import default_mask
    from hotneurons.weights.gguf_source import GGUFSource

    path, _, _ = moe_gguf("olmoe")
    with GGUFSource(path) as src:
        exps = sum(t.nbytes for n, t in src.infos.items() if n.endswith("_exps.weight"))
        info = {"n_layers": 2, "num_key_value_heads": 2, "head_dim": 8}
        full = plan_moe_bytes(src, np.ones((2, 4), bool), torch.float32, 16, info)
        half = plan_moe_bytes(src, np.arange(4)[None].repeat(2, 0) < 2, torch.float32, 16, info)
        assert full.gpu - half.gpu == exps // 2 and half.host - full.host == exps // 2
        assert default_mask(src, 2, 4, torch.float32, 16, info, half.gpu + 10).sum(axis=1).tolist() == [2, 2]


def test_engine_q8_0_experts_mixed_formats(moe_gguf, tmp_path):
    """A GGUF whose experts' gate and up are Q8_0 (rows of d = 32: one block) and down F16 (rows of 16: no block
    format), half the experts on the device: the engine's logits equal our reference decoder's (models/moe.py) on the
    file's tensors, prompt and decode steps."""
    import tiny
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    from hotneurons.export.gguf_model import (
        Tensor,
        hf_state,
        moe_metadata,
        moe_tensors,
        vocab_from_tokenizer,
        write_gguf,
    )
    from hotneurons.runtime.engine import forward
    from hotneurons.runtime.generate import RuntimeConfig
    from hotneurons.runtime.load import load_source_runtime
    from hotneurons.weights.gguf_source import GGUFSource
    from test_models import ours

    _, hf, _ = moe_gguf("qwen2-moe")
    q8, tensors = GGMLQuantizationType.Q8_0, []
    for t in moe_tensors(hf_state(hf), hf.config):
        if t.name.endswith(("gate_exps.weight", "up_exps.weight")):
            blocks = np.ascontiguousarray(quantize(t.data().astype(np.float32), q8))  # (E, n, 34)
            t = Tensor(t.name, blocks.shape, np.dtype(np.uint8), lambda b=blocks: b, ggml_type=int(q8))
        tensors.append(t)
    path = tmp_path / "q.gguf"
    vocab = vocab_from_tokenizer(tiny.byte_tokenizer(), tiny.VOCAB)
    write_gguf(path, "qwen2moe", lambda w: (moe_metadata(w, hf.config, "q8"), vocab.add_to(w)), tensors)
    mask = np.array([[True, False, True, False], [False, False, True, True]])
    rt = load_source_runtime(None, None, RuntimeConfig(device="cpu"), model=str(path), placement=mask)
    assert all(f.in_place for f in rt.ffns)
    with GGUFSource(path) as src:
        cfg = ModelConfig.from_hf(src.config)
        model, ffn = ours(cfg, {k: src.get(k) for k in src.infos})
        ids = torch.tensor(PROMPT_IDS)
        want = model.forward(ids, 0, ffn)[-1]
        torch.testing.assert_close(forward(rt, PROMPT_IDS, 0), want, atol=1e-4, rtol=0)
        for pos in range(len(ids), len(ids) + 3):
            nxt = int(want.argmax())
            want = model.forward(torch.tensor([nxt]), pos, ffn)[-1]
            torch.testing.assert_close(forward(rt, [nxt], pos), want, atol=1e-4, rtol=0)


def _step_pieces(ffn: HybridMoE, x: torch.Tensor, flags=None) -> torch.Tensor:
    """One decode token through the graph steps' pieces: to_host, device_part, the CPU's cold_rows, cold_sum."""
    ffn.to_host(x)
    y = ffn.device_part(x)
    ffn.cold_rows(x, flags)
    return y + ffn.cold_sum().to(y.dtype)


@pytest.mark.parametrize("family", ["qwen2-moe", "mixtral", "olmoe"])
@pytest.mark.parametrize("fmt", ["f32", "q4_0"])
@pytest.mark.parametrize("where", ["gpu", "cpu", "mixed"])
def test_decode_pieces_equal_reference(family, fmt, where):
    """The graph steps' split of a decode token (runtime/graph_steps.py): GPU experts gathered from device-side ids
    (a cold slot computes stack expert 0 at weight 0), the CPU's experts from the host buffers; equal to the
    reference, and the expert counts of both sides agree."""
    cfg = _cfg(family)
    w = _weights(cfg, fmt, seed=5)
    ref = moe.moe_ffn(w.get, cfg, 0)
    ffn = HybridMoE(0, cfg, w.get, _masks()[where], "cpu", torch.float32)
    ffn.host_io(torch.device("cpu"))
    x = _x(6, seed=8)
    for t in range(6):
        _close(_step_pieces(ffn, x[t:t + 1]), ref(x[t:t + 1]))
    assert ffn.expert_counts.sum() == 6 * K and (ffn.fired.numpy() == ffn.expert_counts).all()
    assert ffn.counts[2] == ffn.expert_counts[ffn.gpu].sum()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_decode_cold_experts_on_the_int_route(fmt, monkeypatch):
    """cold_q.XQ_EXPERTS (the cold experts' default route where the CPU has VNNI): the CPU's part of a decode token
    equals the float route's on x as the int route quantizes it (cold_q.quantize_x), to float32 sums; so the route
    ran and added only x's rounding (the conftest holds the float route for the other reference tests)."""
    from hotneurons.kernels import cold_q

    if not cold_q.XQ_OK:
        pytest.skip("the int route needs AVX-512 VNNI on this CPU")
    cfg = _cfg("mixtral")
    w = _weights(cfg, fmt, seed=9)
    ffn = HybridMoE(0, cfg, w.get, np.zeros(E, bool), "cpu", torch.float32)  # every expert cold
    io = ffn.host_io(torch.device("cpu"))
    x = _x(3, seed=10)
    for t in range(3):
        ffn.to_host(x[t:t + 1])
        q, dx = np.zeros(D, np.int8), np.zeros(D // 32, np.float32)
        cold_q.quantize_x(io.x_np.reshape(-1).copy(), q, dx)
        xq = np.repeat(dx, 32) * q  # (D,) x as the int route sees it
        x_true = io.x_np.reshape(-1).copy()
        out = {}
        for route, x_in in (("int", x_true), ("float on xq", xq), ("float", x_true)):
            monkeypatch.setattr(cold_q, "XQ_EXPERTS", route == "int")
            io.x_np.reshape(-1)[:] = x_in
            ffn.cold_rows(None)
            out[route] = ffn.cold_sum().clone()
        _close(out["int"], out["float on xq"])
        assert not torch.allclose(out["int"], out["float"], rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# CUDA: the GPU experts in GpuQ (the Triton GEMV for a token, de-quantized chunks for a prompt), the CPU's in Numba


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["f32", "q8_0", "q4_0"])
@pytest.mark.parametrize("where", ["gpu", "cpu", "mixed"])
@pytest.mark.parametrize("family", ["qwen2-moe", "mixtral"])
def test_cuda_equals_reference(family, fmt, where):
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = _cfg(family)
    w = _weights(cfg, fmt)
    ref = moe.moe_ffn(w.get, cfg, 0)
    ffn = HybridMoE(0, cfg, w.get, _masks()[where], "cuda", torch.float32)
    if where != "cpu":
        assert all(t.device.type == "cuda" for e in ffn.experts.values() for t in
                   [p if isinstance(p, torch.Tensor) else p.qs for p in e])
    x = _x(9)
    _close(ffn(x.cuda()).cpu(), ref(x))
    for t in range(3):
        _close(ffn(x[t:t + 1].cuda()).cpu(), ref(x[t:t + 1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_greedy_equals_hf(moe_gguf):
    from hotneurons.runtime.generate import RuntimeConfig, generate
    from hotneurons.runtime.load import load_source_runtime

    torch.backends.cuda.matmul.allow_tf32 = False
    path, hf, _ = moe_gguf("qwen2-moe")
    mask = np.array([[True, False, True, False], [False, True, True, False]])
    rt = load_source_runtime(None, None, RuntimeConfig(device="cuda", dtype="float32"), model=str(path),
                             placement=mask)
    g = generate(rt, PROMPT_IDS, NEW, stop_at_eos=False)
    assert g.token_ids == _hf_greedy(hf, PROMPT_IDS)
    assert 0 < g.stats["gpu_activation_share"] < 1 and g.stats["bytes_gpu"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["f32", "q4_0"])
@pytest.mark.parametrize("where", ["gpu", "mixed"])
@pytest.mark.parametrize("family", ["qwen2-moe", "qwen3-moe"])
def test_cuda_graph_pieces_equal_reference(family, fmt, where):
    """to_host and device_part captured in one CUDA graph, replayed for new tokens, the CPU's part between."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = _cfg(family)
    w = _weights(cfg, fmt, seed=5)
    ref = moe.moe_ffn(w.get, cfg, 0)
    ffn = HybridMoE(0, cfg, w.get, _masks()[where], "cuda", torch.float32)
    ffn.host_io(torch.device("cuda"))
    xs = torch.zeros(1, D, device="cuda")
    for _ in range(2):  # warm-up: Triton compiles outside the capture
        ffn.to_host(xs)
        ffn.device_part(xs)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ffn.to_host(xs)
        y = ffn.device_part(xs)
    x = _x(5, seed=9)
    for t in range(5):
        xs.copy_(x[t:t + 1])
        g.replay()
        torch.cuda.synchronize()
        ffn.cold_rows(xs)
        _close((y + ffn.cold_sum()).cpu(), ref(x[t:t + 1]))


def test_gguf_tokenizer_without_merges_reads_back(moe_gguf):
    """A byte-level vocabulary with no merges is written with llama.cpp's required merges array holding a merge that
    never applies (export/gguf_model.NEVER_MERGE); read back (weights/gguf_tokenizer.py, where it never applies either,
    as in llama.cpp) it tokenizes as the model's own tokenizer."""
    import tiny
    from hotneurons.weights.gguf_source import GGUFSource

    path, _, _ = moe_gguf("mixtral")
    text = "Hello, experts! ÿ 42"
    want = tiny.byte_tokenizer()
    with GGUFSource(path) as src:
        got = src.tokenizer()
    assert got(text)["input_ids"] == want(text)["input_ids"]
    assert got.decode(got(text)["input_ids"]) == text
