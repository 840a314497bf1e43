"""pi-generate on tiny random models: greedy tokens and logits equal HF `generate` on the same dense model.

The FFN weights are rounded to bfloat16 first (the cold rows are stored in bf16), so the hybrid runtime and HF
compute with identical weights; logits then agree within LOGIT_ATOL (float32 sums in another order).
The kernels, the static decoder, --pcie-share and sampling: test_kernels.py, test_static_decoder.py, test_balance.py,
test_sampling.py; on CUDA: test_runtime_gpu.py.
"""

import copy

import numpy as np
import pytest
import tiny
import torch
from hotneurons.artifacts.placement import Placement
from hotneurons.artifacts.predictor_file import Predictor, Predictors
from hotneurons.models.family import load_model
from hotneurons.runtime.generate import RuntimeConfig, generate
from hotneurons.runtime.load import build_runtime

LOGIT_ATOL = 1e-4
NEW = 12
PROMPT = "The quick brown fox"


def hf_greedy(lm, prompt_ids, n=NEW):
    out = lm.model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, output_logits=True,
                            return_dict_in_generate=True)
    return out.sequences[0, len(prompt_ids):].tolist(), [lg[0] for lg in out.logits]


def make_placement(lm, kind: str, seed: int = 0) -> Placement:
    n_layers, n = len(lm.layers), lm.info["n_neurons"]
    if kind in ("gpu", "cpu"):
        return Placement.uniform(n_layers, n, kind == "gpu")
    rng = np.random.default_rng(seed)
    return Placement(tuple(rng.random(n) < 0.5 for _ in range(n_layers)))


def check_equal(lm, cfg, placement=None, predictors=None, taus=None, atol=LOGIT_ATOL):
    ref = copy.deepcopy(lm)
    ids = list(lm.tokenizer(PROMPT)["input_ids"])
    want_ids, want_logits = hf_greedy(ref, ids)
    rt = build_runtime(lm, cfg, placement, predictors, taus)
    g = generate(rt, ids, NEW, keep_logits=True)
    assert g.token_ids == want_ids
    diff = max(float((a - b).abs().max()) for a, b in zip(g.logits, want_logits))
    assert diff < atol, diff
    return g


RELU = ["opt", "llama-reglu", "mistral-drelu", "falcon-relu"]


@pytest.mark.parametrize("family", RELU)
@pytest.mark.parametrize("where", ["gpu", "cpu", "mixed"])
def test_oracle_equals_hf(family, where, tiny_model_dir):
    lm = tiny.load_rounded(tiny_model_dir(family), family)
    g = check_equal(lm, RuntimeConfig(oracle=True, device="cpu"), make_placement(lm, where))
    s = g.stats
    assert s["mode"] == "oracle" and 0 < s["ffn_sparsity"] < 1
    assert s["gpu_activation_share"] == pytest.approx({"gpu": 1.0, "cpu": 0.0}.get(where, s["gpu_activation_share"]))
    p = lm.info["params"]
    untied_embedding = 4 * p["embedding"] if p["lm_head"] else 0  # float32 bytes, kept in CPU RAM
    assert (s["bytes_cpu"] == untied_embedding) == (where == "gpu")


@pytest.mark.parametrize("family", ["llama-swiglu", "qwen2-swiglu", "gemma-geglu", "falcon-gelu"])
def test_dense_equals_hf(family, tiny_model_dir):
    lm = tiny.load_rounded(tiny_model_dir(family), family)
    g = check_equal(lm, RuntimeConfig(mode="dense", device="cpu"), make_placement(lm, "mixed"))
    assert g.stats["ffn_sparsity"] == 0.0


@pytest.mark.parametrize("family", ["opt", "llama-swiglu"])
def test_layer_split_equals_hf(family, tiny_model_dir):
    lm = tiny.load_rounded(tiny_model_dir(family), family)
    g = check_equal(lm, RuntimeConfig(mode="layer-split", device="cpu", gpu_layers=1))
    assert g.stats["gpu_activation_share"] == 0.5 and g.stats["bytes_cpu"] > 0


@pytest.mark.parametrize("family", ["llama-reglu", "opt"])
def test_untied_input_embedding_stays_in_cpu_ram(family, tiny_model_dir):
    """An untied embedding is looked up on the CPU (the static decoder: into a host row layer 0 copies in), and
    neither the runtime nor layer-split counts it on the device; a tied one (OPT's) is the LM head and stays."""
    from hotneurons.runtime.load import layer_split_count
    from hotneurons.runtime.offload import OnCPUEmbedding

    lm = tiny.load_rounded(tiny_model_dir(family), family)
    p, size = lm.info["params"], 4  # float32
    untied = p["lm_head"] > 0
    assert untied == (family == "llama-reglu")
    per_layer = sum(t.numel() for t in lm.layers[0].parameters()) * size
    fixed = (p["total"] - p["embedding"] * untied) * size - len(lm.layers) * per_layer  # head, norms (tied: emb)
    assert layer_split_count(lm, fixed + per_layer, None, torch.float32) == 1
    assert layer_split_count(lm, fixed + per_layer - 1, None, torch.float32) == 0
    with pytest.raises(ValueError, match="raise --vram"):
        layer_split_count(lm, fixed - 1, None, torch.float32)
    g = check_equal(lm, RuntimeConfig(oracle=True, device="cpu"), make_placement(lm, "gpu"))
    emb = lm.model.get_input_embeddings()
    assert isinstance(emb, OnCPUEmbedding) == untied
    assert g.stats["bytes_cpu"] == p["embedding"] * size * untied
    if untied:
        assert emb.weight.device.type == "cpu" and emb.num_embeddings == lm.info["vocab_size"]
        on_device = [*lm.model.parameters(), *lm.model.buffers()]  # what model.to(device) moves
        assert all(t.data_ptr() != emb.weight.data_ptr() for t in on_device)


@pytest.mark.parametrize("family,cfg,where", [
    ("llama-reglu", RuntimeConfig(oracle=True, device="cpu", cold_dtype="int8"), "cpu"),
    ("opt", RuntimeConfig(oracle=True, device="cpu", cold_dtype="int8"), "mixed"),
    ("falcon-gelu", RuntimeConfig(mode="dense", device="cpu", cold_dtype="int8"), "cpu"),
    ("llama-swiglu", RuntimeConfig(mode="layer-split", device="cpu", gpu_layers=1, cold_dtype="int8"), None)])
def test_int8_cold_rows_equal_hf_on_the_weights_they_stand_for(family, cfg, where, tiny_model_dir):
    lm = tiny.load_rounded(tiny_model_dir(family), family)
    tiny.round_ffns_to_int8(lm)
    g = check_equal(lm, cfg, None if where is None else make_placement(lm, where))
    assert g.stats["cold_dtype"] == "int8"


def test_int8_cold_rows_halve_the_cpu_bytes(tiny_model_dir):
    family = "llama-reglu"
    rts = {t: build_runtime(tiny.load_rounded(tiny_model_dir(family), family),
                            RuntimeConfig(mode="dense", device="cpu", cold_dtype=t),
                            make_placement(tiny.load_rounded(tiny_model_dir(family), family), "cpu"))
           for t in ("bf16", "int8")}
    b = {t: sum(f.cold_bytes() for f in rt.ffns) for t, rt in rts.items()}  # bytes_cpu less the untied embedding
    assert b["int8"] < 0.55 * b["bf16"]
    emb = 4 * rts["bf16"].lm.info["params"]["embedding"]  # float32, in CPU RAM
    assert all(rt.bytes_cpu == b[t] + emb for t, rt in rts.items())
    with pytest.raises(ValueError, match="unknown cold-row dtype 'int4'"):
        build_runtime(tiny.load_rounded(tiny_model_dir(family), family), RuntimeConfig(device="cpu", cold_dtype="int4"))


def always_on_predictors(lm, threshold: float) -> Predictors:
    d, n = lm.info["d_model"], lm.info["n_neurons"]
    torch.manual_seed(0)
    layers = {i: Predictor(d, 8, n, threshold).eval() for i in range(len(lm.layers))}
    return Predictors(layers, {"layers": []}, {})


def exact_predictors(lm) -> Predictors:
    """Predictors whose logits are each neuron's gate pre-activation: fc1 = [I; -I], fc2 = [G, -G], so that
    G relu(x) - G relu(-x) = G x; threshold 0. They mark exactly the neurons the ReLU gate opens, so computing only
    those is exact, and a mask given to the wrong neurons is not."""
    d, n = lm.info["d_model"], lm.info["n_neurons"]
    layers = {}
    for i, layer in enumerate(lm.layers):
        g = lm.adapter.layer_ffn(layer)["gate"].weight.detach().float()  # (n, d)
        p = Predictor(d, 2 * d, n, 0.0).eval()
        with torch.no_grad():
            p.fc1.weight.copy_(torch.cat((torch.eye(d), -torch.eye(d))))
            p.fc2.weight.copy_(torch.cat((g, -g), 1))
        layers[i] = p
    return Predictors(layers, {"layers": []}, {})


def test_exact_predictor_equals_hf(tiny_model_dir):
    """The predictor's masks reach the neurons they are for (fc2's rows are reordered cold first in HybridFFN): with a
    predictor that marks exactly the open gates, hybrid is HF's dense model while it skips half the neurons."""
    lm = tiny.load_rounded(tiny_model_dir("llama-reglu"), "llama-reglu")
    g = check_equal(lm, RuntimeConfig(device="cpu"), make_placement(lm, "mixed"), exact_predictors(lm))
    assert g.stats["mode"] == "hybrid" and 0.3 < g.stats["ffn_sparsity"] < 0.7
    assert 0 < g.stats["gpu_activation_share"] < 1


def test_predictor_that_fires_everywhere_equals_hf(tiny_model_dir):
    lm = tiny.load_rounded(tiny_model_dir("llama-reglu"), "llama-reglu")
    g = check_equal(lm, RuntimeConfig(device="cpu"), make_placement(lm, "mixed"), always_on_predictors(lm, -1e30))
    assert g.stats["mode"] == "hybrid" and g.stats["ffn_sparsity"] == 0.0


def test_ffn_probe_sees_each_decode_call_in_order(tiny_model_dir):
    """HybridFFN.probe (bench timelines): called at each decode call's marks in order, layer by layer; generate
    decodes through HF's layers while one is set (the static decoder calls no marks), with the same tokens."""
    lm = tiny.load_rounded(tiny_model_dir("llama-reglu"), "llama-reglu")
    rt = build_runtime(lm, RuntimeConfig(device="cpu"), make_placement(lm, "mixed"), always_on_predictors(lm, -1e30))
    ids = list(lm.tokenizer(PROMPT)["input_ids"])
    plain = generate(rt, ids, NEW)
    seen = []
    for f in rt.ffns:
        f.probe = lambda f, mark: seen.append((f.layer, mark))
    assert generate(rt, ids, NEW).token_ids == plain.token_ids
    marks = ("start", "cpu_start", "cpu_end", "end")  # on the CPU: no marks around a GPU hot part
    assert seen == [(f.layer, m) for _ in range(NEW - 1) for f in rt.ffns for m in marks]


def test_build_runtime_leaves_the_callers_predictors_alone(tiny_model_dir):
    """Module.to moves in place: a runtime must take copies, or building a second one (another dtype or device)
    would move the weights that the first one's CUDA graphs read."""
    lm = tiny.load_rounded(tiny_model_dir("llama-reglu"), "llama-reglu")
    preds = always_on_predictors(lm, -1e30)
    before = {i: p.fc1.weight for i, p in preds.layers.items()}
    rt = build_runtime(copy.deepcopy(lm), RuntimeConfig(device="cpu", dtype="bfloat16"), make_placement(lm, "mixed"),
                       preds)
    assert all(preds.layers[i].fc1.weight is w and w.dtype == torch.float32 for i, w in before.items())
    assert all(f.pred_fc1.dtype == f.pred_fc2.dtype == torch.bfloat16 for f in rt.ffns)


def test_predictor_that_never_fires_keeps_only_hot_neurons(tiny_model_dir):
    lm = tiny.load_rounded(tiny_model_dir("opt"), "opt")
    rt = build_runtime(lm, RuntimeConfig(device="cpu"), make_placement(lm, "mixed"), always_on_predictors(lm, 1e30))
    g = generate(rt, list(lm.tokenizer(PROMPT)["input_ids"]), 4)
    assert g.stats["ffn_sparsity"] == 1.0 and len(g.token_ids) == 4
    # 3 decode steps, the first left out of the median step; one token decodes no step, so it has none
    assert g.stats["decode_step_ms_median"] > 0
    assert generate(rt, list(lm.tokenizer(PROMPT)["input_ids"]), 1).stats["decode_step_ms_median"] is None


def test_gated_ffn_with_biases_is_refused(tmp_path):
    """The kernels have no gate/up bias for gated FFNs: such a model must be refused, not run wrongly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=tiny.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, hidden_act="relu", mlp_bias=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tiny.byte_tokenizer().save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="gate/up biases"):
        build_runtime(lm, RuntimeConfig(mode="dense", device="cpu"))


def test_both_model_types_decode_alike(tiny_model_dir, tmp_path):
    """runtime/lm.DecodeModel's two classes on one tiny LLaMA (FFN weights rounded to bf16, dense): our decoder reading
    the folder in place (SourceModel) and transformers' (LoadedModel, --hf-decode) answer the interface alike, and
    their prefill and steps, driven by hand as generate's loop drives them, give the same logits at each position."""
    from dataclasses import replace

    from hotneurons.runtime.load import load_runtime

    lm = tiny.load_rounded(tiny_model_dir("llama-reglu"), "llama-reglu")
    folder = tmp_path / "rounded"
    lm.model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    cfg = RuntimeConfig(mode="dense", device="cpu", cold_dtype="bf16", gpu_dtype="f32")
    ours = load_runtime(None, cfg, model=str(folder))
    theirs = load_runtime(None, replace(cfg, static_decode=False), model=str(folder))
    assert (type(ours.lm).__name__, type(theirs.lm).__name__) == ("SourceModel", "LoadedModel")
    a, b = ours.lm, theirs.lm
    assert a.vocab == b.vocab == lm.model.config.vocab_size and a.eos == b.eos and len(a.layers) == len(b.layers)
    assert a.static_ctx == a.ctx <= b.ctx == lm.model.config.max_position_embeddings and b.static_ctx is None
    ids = list(lm.tokenizer(PROMPT)["input_ids"])
    x, y = a.prefill(ours, ids), b.prefill(theirs, ids)  # (vocab,) each
    for pos in range(len(ids), len(ids) + 4):
        torch.testing.assert_close(x, y, rtol=0, atol=LOGIT_ATOL)
        token = int(y.argmax())
        x, y = a.step(ours, token, pos), b.step(theirs, token, pos)
    torch.testing.assert_close(x, y, rtol=0, atol=LOGIT_ATOL)
