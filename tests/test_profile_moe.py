"""pi-profile on mixtures of experts (profiler/experts.py) against a brute-force float64 count.

The reference: transformers' own model in float64 (eager attention) gives each layer's FFN input (the output of
post_attention_layernorm); numpy then routes every token (softmax, top-k, renormalised where the config says) and
runs its experts one by one. Router counts are exact; weight sums equal to rtol 1e-5 when the profile computes in
float32; neuron counts exact for ReLU-activated experts (exact zeros) in float32 and, for SwiGLU ones, at the profile's
calibrated tau in float64 (in float32, a value within rounding of tau could flip).
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import tiny
import torch
from click.testing import CliRunner
from hotneurons.artifacts.profile import check_profile, read_expert_profile, read_profile
from hotneurons.common.artifacts import ArtifactError
from hotneurons.common.corpus import iter_texts, token_batches
from hotneurons.common.model_source import ModelError
from hotneurons.models import moe
from hotneurons.models.streamed import open_streamed
from hotneurons.models.streamed_experts import SHARED, ExpertFFN, open_experts
from hotneurons.profiler.cli import main as cli
from hotneurons.profiler.experts import whole_model_refusal
from hotneurons.profiler.profile import ProfileConfig, profile_model
from hotneurons.weights.names import NameMap
from test_models_moe import _cfg, _weights
from tiny import _moe_configs
from transformers import AutoModelForCausalLM

CASES = [(family, act, seed) for seed, (family, act) in
         enumerate((family, act) for family in tiny.MOE_FAMILIES for act in ("relu", "silu"))]


def build(family: str, act: str, folder, seed: int = 0):
    """tiny.build's model of `family`, its experts' activation `act` (relu: ReLU-gated experts, exact zeros)."""
    torch.manual_seed(seed)
    config = _moe_configs()[family]()
    config.hidden_act = act
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    tiny.byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(family, act):
        if (family, act) not in cache:
            cache[family, act] = build(family, act, tmp_path_factory.mktemp(f"{family}-{act}"))
        return cache[family, act]

    return get


def random_corpus(path, seed: int):
    """Fresh random text: letters, digits, spaces and punctuation, in documents of random lengths."""
    rng = np.random.default_rng(seed)
    alphabet = np.array(list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?-'\n"))
    with open(path, "w") as f:
        for _ in range(6):
            f.write(json.dumps({"text": "".join(rng.choice(alphabet, rng.integers(80, 200)))}) + "\n")
    return path


def brute_force(folder, cfg: ProfileConfig, taus: list[float] | None) -> dict[str, np.ndarray]:
    """The profile's counts, token by token and expert by expert, in float64 numpy: transformers' model runs the
    attention, each layer's MoE block is replaced by this loop (its output too: HF routes in float32, which would move
    the later layers' values by ~1e-7, enough to flip the value that defined tau)."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager").eval()
    c = hf.config
    w = {k: v.numpy() for k, v in NameMap(c.model_type, c.num_hidden_layers).tensors(hf.state_dict()).items()}
    L, E, k = c.num_hidden_layers, w["blk.0.ffn_gate_inp.weight"].shape[0], c.num_experts_per_tok
    n, n_sh = w["blk.0.ffn_gate_exps.weight"].shape[1], getattr(c, "shared_expert_intermediate_size", 0) or 0
    norm_topk = c.model_type == "mixtral" or bool(getattr(c, "norm_topk_prob", False))
    act = {"relu": lambda g: np.maximum(g, 0), "silu": lambda g: g / (1 + np.exp(-g))}[c.hidden_act]
    out = {"routed": np.zeros((L, E), np.int64), "weight_sum": np.zeros((L, E)),
           "counts": np.zeros((L, E, n), np.int64), "shared": np.zeros((L, n_sh), np.int64)}

    def ffn(i: int, hidden: torch.Tensor) -> torch.Tensor:
        p, tau = f"blk.{i}.ffn_", 0.0 if taus is None else taus[i]
        xs = hidden.reshape(-1, hidden.shape[-1]).numpy()  # (tokens, d)
        ys = np.zeros_like(xs)
        for x, y in zip(xs, ys):  # (d,) one token
            logits = w[p + "gate_inp.weight"] @ x  # (E,)
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            top = np.argsort(-probs, kind="stable")[:k]
            weights = probs[top] / probs[top].sum() if norm_topk else probs[top]
            for e, we in zip(top, weights):
                h = act(w[p + "gate_exps.weight"][e] @ x) * (w[p + "up_exps.weight"][e] @ x)  # (n,)
                out["routed"][i, e] += 1
                out["weight_sum"][i, e] += we
                out["counts"][i, e] += np.abs(h) > tau
                y += we * (w[p + "down_exps.weight"][e] @ h)
            if n_sh:
                h = act(w[p + "gate_shexp.weight"] @ x) * (w[p + "up_shexp.weight"] @ x)  # (n_sh,)
                out["shared"][i] += np.abs(h) > tau
                y += (w[p + "down_shexp.weight"] @ h) / (1 + np.exp(-(w[p + "gate_inp_shexp.weight"] @ x)))
        return torch.from_numpy(ys).reshape(hidden.shape)

    for i, layer in enumerate(hf.model.layers):
        layer.mlp.forward = lambda hidden, i=i: ffn(i, hidden)
    tok = open_experts(str(folder)).tokenizer
    with torch.no_grad():
        for ids in token_batches(tok, iter_texts(cfg.dataset, "text"), cfg.seq_len, cfg.batch_size, cfg.tokens):
            hf.model(input_ids=ids)
    return out


@pytest.mark.parametrize("family, act, seed", CASES)
def test_counts_equal_brute_force(models, family, act, seed, tmp_path):
    folder = models(family, act)
    dtype = "float32" if act == "relu" else "float64"  # see the module's docstring
    cfg = ProfileConfig(model=str(folder), dataset=str(random_corpus(tmp_path / "c.jsonl", seed)),
                        tokens=400, seq_len=40, batch_size=2, calibration_tokens=160, dtype=dtype)
    meta = profile_model(cfg, tmp_path / "run", progress=False)
    experts, neurons, _ = read_expert_profile(tmp_path / "run")
    ref = brute_force(folder, cfg, meta.taus)
    L, E, n = ref["counts"].shape
    assert meta.tokens == 400 and meta.samples is None and meta.rule == ("nonzero" if act == "relu" else "abs>tau")
    assert (meta.experts.n_experts, meta.experts.n_ff_exp, meta.experts.n_ff_shexp) == (E, n, ref["shared"].shape[1])
    assert experts[["layer", "expert"]].to_numpy().tolist() == [[i, e] for i in range(L) for e in range(E)]
    np.testing.assert_array_equal(experts["count"].to_numpy().reshape(L, E), ref["routed"])
    assert (ref["routed"].sum(1) == meta.tokens * meta.experts.n_experts_used).all()
    np.testing.assert_allclose(experts["weight_sum"].to_numpy().reshape(L, E), ref["weight_sum"], rtol=1e-5, atol=0)
    routed = neurons[neurons.expert >= 0]
    shared = neurons[neurons.expert == SHARED]
    got = (routed["count"].to_numpy().reshape(L, E, n), shared["count"].to_numpy().reshape(L, -1))
    for g, want in zip(got, (ref["counts"], ref["shared"])):
        if act == "silu" and torch.cuda.is_available():  # CUDA's float64 sums round apart from numpy's: a value
            # within an ulp of tau may fall on the other side; at most one count in a hundred, by one
            diff = np.abs(g - want)
            assert diff.max() <= 1 and (diff > 0).mean() <= 0.01, (diff.max(), (diff > 0).mean())
        else:
            np.testing.assert_array_equal(g, want)
    # the summary: over routed (token, expert) pairs; at the calibrated tau near the target sparsity
    sparsity = 1 - ref["counts"].sum((1, 2)) / (meta.tokens * meta.experts.n_experts_used * n)
    np.testing.assert_allclose(meta.sparsity_per_layer, sparsity, atol=1e-3 if torch.cuda.is_available() else 1e-6)
    if act == "silu":
        assert all(abs(s - 0.5) < 0.1 for s in meta.sparsity_per_layer)


@pytest.mark.parametrize("norm_topk, shared", [(True, 0), (False, 0), (False, 40)])
def test_expert_ffn_equals_moe_ffn_float64(norm_topk, shared):
    """The profiler's FFN (each expert on its routed tokens) gives models/moe.moe_ffn's output; its hooks see every
    routed (token, expert) pair once and the shared expert on every token."""
    cfg = _cfg(norm_topk, shared)
    w = _weights(cfg, torch.float64, seed=3)
    x = torch.randn(11, cfg.d_model, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    p, E = "blk.0.ffn_", cfg.n_experts
    sh = None if not shared else tuple(w[p + k + ".weight"] for k in ("gate_shexp", "up_shexp", "down_shexp",
                                                                       "gate_inp_shexp"))
    ffn = ExpertFFN(w[p + "gate_inp.weight"], w[p + "gate_exps.weight"], w[p + "up_exps.weight"],
                    w[p + "down_exps.weight"], sh)

    class Seen:
        rows: dict[int, int] = {}

        def on_route(self, i, weights, idx):
            self.idx = idx

        def on_expert(self, i, e, h):
            self.rows[e] = h.shape[0]

    seen = Seen()
    got = ffn(cfg, x, [seen], 0)
    torch.testing.assert_close(got, moe.moe_ffn(w.get, cfg, 0, dtype=torch.float64)(x), atol=1e-10, rtol=1e-10)
    assert seen.rows == {**{e: int((seen.idx == e).sum()) for e in range(E) if (seen.idx == e).any()},
                         **({SHARED: 11} if shared else {})}


def test_cli_gguf_and_folder(models, text_corpus, tmp_path):
    """pi-profile on a tiny MoE GGUF file and on its safetensors folder: the same model, the same tables."""
    from hotneurons.export import gguf_model as gm

    folder = models("qwen2-moe", "silu")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    gm.write_moe_gguf(hf, tmp_path / "m.gguf", gm.vocab_from_tokenizer(tiny.byte_tokenizer(), tiny.VOCAB))
    tables = {}
    for name, model in (("gguf", tmp_path / "m.gguf"), ("folder", folder)):
        run = tmp_path / name
        res = CliRunner().invoke(cli, ["--model", str(model), "--dataset", str(text_corpus), "--tokens", "300",
                                       "--seq-len", "32", "--batch-size", "2", "--calibration-tokens", "64",
                                       "--out", str(run), "--quiet", "--json"])
        assert res.exit_code == 0, res.output
        meta = json.loads(res.output[res.output.index("{"):])
        assert meta["experts"] == {"n_experts": 4, "n_experts_used": 2, "n_ff_exp": 16, "n_ff_shexp": 48,
                                   "norm_topk": False}
        assert meta["model"]["family"] == "moe" and meta["model"]["n_neurons"] == 16 and meta["samples"] is None
        assert meta["config"]["layer_by_layer"] and not (run / "profile/samples").exists()
        experts = pd.read_parquet(run / "profile/experts.parquet")
        neurons = pd.read_parquet(run / "profile/neurons.parquet")
        assert {c: str(t) for c, t in experts.dtypes.items()} == {"layer": "int32", "expert": "int32",
                                                                  "count": "int64", "weight_sum": "float64"}
        assert {c: str(t) for c, t in neurons.dtypes.items()} == {"layer": "int32", "expert": "int32",
                                                                  "neuron": "int32", "count": "int64"}
        assert len(experts) == 2 * 4 and len(neurons) == 2 * (4 * 16 + 48)
        assert sorted(neurons.expert.unique()) == [-1, 0, 1, 2, 3]
        assert experts.groupby("layer")["count"].sum().tolist() == [300 * 2] * 2
        assert check_profile(run).experts.n_experts == 4
        df, _ = read_profile(run)
        assert "expert" in df.columns
        tables[name] = experts
    # the GGUF holds fp16 experts: the same routing up to a token or two, the same weights to fp16 rounding
    assert (tables["gguf"]["count"] - tables["folder"]["count"]).abs().max() <= 4
    res = CliRunner().invoke(cli, ["--model", str(folder), "--whole-model", "--dataset", str(text_corpus),
                                   "--out", str(tmp_path / "whole"), "--quiet", "--tokens", "100"])
    assert res.exit_code == 1 and res.output.count("\n") <= 2, res.output
    assert "is a mixture of experts" in res.output and "drop --whole-model" in res.output


def test_resume_equals_an_uninterrupted_run(models, text_corpus, tmp_path):
    folder = models("mixtral", "relu")
    cfg = ProfileConfig(model=str(folder), dataset=str(text_corpus), tokens=400, seq_len=40, batch_size=2)
    profile_model(cfg, tmp_path / "a", progress=False)
    with pytest.raises(KeyboardInterrupt):
        profile_model(cfg, tmp_path / "b", progress=False, checkpoint_every=2, _stop_after=3)
    profile_model(cfg, tmp_path / "b", progress=False, resume=True)
    for table in ("experts.parquet", "neurons.parquet"):
        pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "a/profile" / table),
                                      pd.read_parquet(tmp_path / "b/profile" / table))


def test_refusals(models, tiny_model_dir, text_corpus, tmp_path):
    """Other stages still refuse a mixture of experts; read_expert_profile refuses a dense profile."""
    folder = models("olmoe", "silu")
    with pytest.raises(ModelError, match="mixture of experts.*not whole through transformers"):
        open_streamed(str(folder))
    hub = whole_model_refusal("org/some-moe", "org/some-moe", None)  # a hub id: through transformers, not counted
    assert "huggingface-cli download org/some-moe --local-dir DIR" in str(hub) and "\n" not in str(hub)
    dense = ProfileConfig(model=str(tiny_model_dir("opt")), dataset=str(text_corpus), tokens=64, seq_len=32,
                          samples_per_layer=0)
    meta = profile_model(dense, tmp_path, progress=False)
    assert meta.experts is None and "experts" not in json.loads((tmp_path / "profile/meta.json").read_text())
    assert read_profile(tmp_path)[0].columns.tolist() == ["layer", "neuron", "count"]
    with pytest.raises(ArtifactError, match="a dense model.*read_profile"):
        read_expert_profile(tmp_path)
