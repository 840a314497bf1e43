"""The runtime with powerinfer-form predictors (they read the residual before the pre-FFN norm), on the static
decoder and on HF's layers, against HF's own generate with the same masks applied by hooks. CUDA paths are skipped
without a GPU; they run the same HybridFFN.to_host / StaticDecoder.pre code as the CPU ones."""

from __future__ import annotations

import copy

import pytest
import tiny
import torch
from hotneurons.artifacts.predictor_file import Predictor, Predictors
from hotneurons.artifacts.predictors import PredictorForm
from hotneurons.runtime.generate import RuntimeConfig, generate
from hotneurons.runtime.load import build_runtime
from test_predictor_form import with_random_gammas
from test_runtime import LOGIT_ATOL, NEW, PROMPT, make_placement

FAMILY = "llama-reglu"
CUDA_ATOL = 1e-3  # float32 GEMVs on the GPU sum in another order


def rounded_model(tiny_model_dir, seed: int = 0):
    """The tiny ReGLU LLaMA (FFN weights bf16-rounded, as the cold rows store them) with norm weights of both signs
    away from 1, so that reading the FFN input instead of the residual changes the logits' direction too."""
    return with_random_gammas(tiny.load_rounded(tiny_model_dir(FAMILY), FAMILY), seed)


class Reference:
    """HF's model with hooks: on each decode step (one token), a neuron is computed iff it is on the GPU or
    fc2 relu(fc1 v) >= threshold, v = the residual entering post_attention_layernorm; prefill is dense, as the
    runtime's. `post_masks` records what the same predictors would decide on the FFN input instead."""

    def __init__(self, lm, preds, placement):
        self.lm, self.preds, self.gpu = lm, preds, placement.gpu
        self.pre, self.x, self.changed = {}, {}, 0

    def __enter__(self):
        self.handles = []
        for i, layer in enumerate(self.lm.layers):
            self.handles.append(layer.post_attention_layernorm.register_forward_pre_hook(
                lambda m, a, i=i: self.pre.__setitem__(i, a[0])))
            self.handles.append(layer.mlp.register_forward_pre_hook(lambda m, a, i=i: self.x.__setitem__(i, a[0])))
            self.handles.append(layer.mlp.down_proj.register_forward_pre_hook(self.mask_hook(i)))
        return self

    def mask_hook(self, i):
        def hook(_mod, args):
            h = args[0]  # (1, s, n)
            if h.shape[1] != 1:
                return None
            p = self.preds.layers[i]

            def decide(v):
                return torch.relu(v @ p.fc1.weight.T) @ p.fc2.weight.T >= float(p.threshold)

            gpu = torch.as_tensor(self.gpu[i])
            keep = decide(self.pre[i]) | gpu
            self.changed += int((keep != (decide(self.x[i]) | gpu)).sum())
            return (h * keep,)
        return hook

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def random_predictors(lm, placement, hidden: int = 16, seed: int = 0) -> Predictors:
    """Random no-bias predictors of the powerinfer form, with one threshold T = the median of their logits over the
    prompt's residuals (so that about half the neurons fire, and r, the residual's scale, matters)."""
    d, n = lm.info["d_model"], lm.info["n_neurons"]
    torch.manual_seed(seed)
    layers = {i: Predictor(d, hidden, n).eval() for i in range(len(lm.layers))}
    ref = Reference(lm, Predictors(layers, {"layers": []}, {}), placement)
    ids = torch.tensor([lm.tokenizer(PROMPT)["input_ids"]])
    with ref, torch.no_grad():
        lm.model(input_ids=ids)
    with torch.no_grad():
        logits = torch.cat([layers[i](ref.pre[i]).flatten() for i in layers])
    T = float(logits.median())
    for p in layers.values():
        p.threshold.fill_(T)
    return Predictors(layers, {"layers": []}, {}, PredictorForm.POWERINFER)


def reference_greedy(lm, preds, placement):
    ref_lm = copy.deepcopy(lm)
    ids = list(lm.tokenizer(PROMPT)["input_ids"])
    with Reference(ref_lm, preds, placement) as ref, torch.no_grad():
        out = ref_lm.model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True)
    return ids, out.sequences[0, len(ids):].tolist(), [lg[0] for lg in out.logits], ref.changed


def check(lm, cfg, placement, preds, atol):
    ids, want, want_logits, changed = reference_greedy(lm, preds, placement)
    assert changed > 0  # the FFN input would have given other masks: the test tells the inputs apart
    rt = build_runtime(lm, cfg, placement, preds)
    g = generate(rt, ids, NEW, keep_logits=True)
    assert g.token_ids == want
    diff = max(float((a - b).abs().max()) for a, b in zip(g.logits, want_logits))
    assert diff < atol, diff
    assert 0 < g.stats["ffn_sparsity"] < 1
    return rt


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("where", ["mixed", "cpu"])
def test_powerinfer_predictors_equal_the_hooked_reference(static, where, tiny_model_dir):
    lm = rounded_model(tiny_model_dir)
    placement = make_placement(lm, where)
    preds = random_predictors(lm, placement)
    rt = check(lm, RuntimeConfig(device="cpu", static_decode=static), placement, preds, LOGIT_ATOL)
    assert (rt.fast is not None) == static and all(f.prenorm for f in rt.ffns)


def exact_prenorm_predictors(lm) -> Predictors:
    """fc1 = [I; -I] diag(gamma), fc2 = [G, -G], T = 0: logits = G diag(gamma) x_pre = r * (G x_post), whose sign is
    the gate's: the powerinfer form of an exact ReGLU predictor (what pi-export writes for oracle-like checks)."""
    d, n = lm.info["d_model"], lm.info["n_neurons"]
    layers = {}
    for i, layer in enumerate(lm.layers):
        g = lm.adapter.layer_ffn(layer)["gate"].weight.detach().float()  # (n, d)
        gamma = layer.post_attention_layernorm.weight.detach().float()  # (d,)
        p = Predictor(d, 2 * d, n, 0.0).eval()
        with torch.no_grad():
            p.fc1.weight.copy_(torch.cat((torch.eye(d), -torch.eye(d))) * gamma)
            p.fc2.weight.copy_(torch.cat((g, -g), 1))
        layers[i] = p
    return Predictors(layers, {"layers": []}, {}, PredictorForm.POWERINFER)


@pytest.mark.parametrize("static", [True, False])
def test_exact_prenorm_predictor_equals_dense_hf(static, tiny_model_dir):
    lm = rounded_model(tiny_model_dir)
    ref = copy.deepcopy(lm)
    ids = list(lm.tokenizer(PROMPT)["input_ids"])
    out = ref.model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    rt = build_runtime(lm, RuntimeConfig(device="cpu", static_decode=static), make_placement(lm, "mixed"),
                       exact_prenorm_predictors(lm))
    g = generate(rt, ids, NEW, keep_logits=True)
    assert g.token_ids == out.sequences[0, len(ids):].tolist()
    assert max(float((a - b[0]).abs().max()) for a, b in zip(g.logits, out.logits)) < LOGIT_ATOL
    assert 0.3 < g.stats["ffn_sparsity"] < 0.7


def test_a_family_without_the_norm_is_refused(tiny_model_dir):
    lm = tiny.load_rounded(tiny_model_dir("opt"), "opt")
    d, n = lm.info["d_model"], lm.info["n_neurons"]
    preds = Predictors({i: Predictor(d, 8, n) for i in range(len(lm.layers))}, {"layers": []}, {},
                       PredictorForm.POWERINFER)
    with pytest.raises(ValueError, match="opt models do not have: use the normed form"):
        build_runtime(lm, RuntimeConfig(device="cpu"), make_placement(lm, "mixed"), preds)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("ops", ["torch", "triton"])
def test_cuda_powerinfer_predictors_equal_the_hooked_reference(static, ops, tiny_model_dir):
    """CUDA graphs: the static decoder's layer graphs (predictor on h2) and HybridFFN's own (a static residual)."""
    if not static and ops == "triton":
        pytest.skip("the HF path has no ops choice")
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        lm = rounded_model(tiny_model_dir)
        placement = make_placement(lm, "mixed")
        preds = random_predictors(lm, placement)
        rt = check(lm, RuntimeConfig(device="cuda", dtype="float32", static_decode=static, ops=ops), placement, preds,
                   CUDA_ATOL)
        assert (rt.fast is not None) == static
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
