"""pi-relufy on a tiny random SwiGLU LLaMA: distillation, the three activations' outputs, resume, bad inputs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, replace

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hotneurons.artifacts.profile import read_profile
from hotneurons.common.corpus import iter_texts, token_batches
from hotneurons.models.family import load_model
from hotneurons.profiler.cli import main as profile_cli
from hotneurons.relufy.config import RelufyInterrupted
from hotneurons.relufy.distill import relufy
from hotneurons.relufy.relufy import RelufyConfig, RelufyError, l1_at, lr_at, preset
from safetensors.torch import load_file

FAT_THRESHOLD = 0.5  # fatrelu: large against gate values of std ~1.7, so the threshold visibly matters


def tiny_cfg(corpus, **kw) -> RelufyConfig:
    """The "tiny" preset (seq 32, batch 4, checkpoints every 4 steps) on the local corpus: 16 steps by default."""
    base = dict(dataset=str(corpus), eval_dataset=str(corpus), tokens=2048, lr=1e-3)
    return replace(preset("tiny"), **{**base, **kw})


@pytest.fixture(scope="module")
def swiglu(tiny_model_dir):
    return tiny_model_dir("llama-swiglu")


@pytest.fixture(scope="module")
def teacher(swiglu):
    """The original model, loaded once and handed to `relufy` (which copies it and leaves it untouched)."""
    return load_model(str(swiglu), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def relufied(teacher, text_corpus, tmp_path_factory):
    """relufied(activation) -> output folder of a short relufy run with that activation (built once)."""
    root = tmp_path_factory.mktemp("relufied")
    cache = {}

    def get(activation: str):
        if activation not in cache:
            cfg = tiny_cfg(text_corpus, tokens=512, activation=activation,
                           fat_threshold=FAT_THRESHOLD if activation == "fatrelu" else 0.0)
            relufy(None, root / activation, cfg, lm=teacher, device="cpu", progress=False)
            cache[activation] = root / activation
        return cache[activation]

    return get


def head_tail(curve: list[dict], key: str, n: int = 4) -> tuple[float, float]:
    """Mean of `key` over the first and the last n curve rows (single batches are noisy)."""
    return float(np.mean([c[key] for c in curve[:n]])), float(np.mean([c[key] for c in curve[-n:]]))


# ---------------------------------------------------------------------------------------------------------------
# Training


def test_distillation_lowers_kl_and_writes_a_sane_summary(swiglu, teacher, text_corpus, tmp_path):
    cfg = tiny_cfg(text_corpus, tokens=8192)  # 64 steps at lr 1e-3: KL roughly halves on any seed
    before = {k: v.clone() for k, v in teacher.model.state_dict().items()}
    s = relufy(str(swiglu), tmp_path / "out", cfg, device="cpu", progress=False)

    first, last = head_tail(s["curve"], "kl")
    assert last < 0.7 * first, (first, last)

    assert s["activation"] == "relu" and s["config"] == asdict(cfg) and s["model"] == str(swiglu)
    assert s["steps"] == cfg.steps == 64 and s["tokens"] == 64 * 4 * 32
    assert s["pool_rows"] == 2 * (cfg.corpus_tokens // cfg.seq_len)  # corpus rows + as many teacher rows
    assert s["pool_tokens"] == s["pool_rows"] * cfg.seq_len
    steps = [c["step"] for c in s["curve"]]
    assert steps == sorted(set(steps)) and steps[-1] == cfg.steps and len(steps) <= cfg.steps
    for c in s["curve"]:
        assert c["tokens"] == c["step"] * 4 * 32 and 0 < c["lr"] <= cfg.lr + 1e-12 and c["l1_weight"] == 0
        assert math.isfinite(c["loss"]) and c["kl"] >= 0 and c["loss"] == pytest.approx(c["kl"], rel=1e-6)
        assert 0 <= c["sparsity"] <= 1
    assert s["curve"][-1]["lr"] == pytest.approx(cfg.lr / 10, rel=0.05)  # cosine to lr / 10

    ev = s["eval"]
    assert ev["tokens"] == (cfg.eval_tokens // cfg.seq_len) * (cfg.seq_len - 1)
    for name in ("original", "swapped_untrained", "relufied"):
        e = ev[name]
        assert 1 < e["perplexity"] < 10 * 259 and e["tokens"] == ev["tokens"]  # vocabulary of 259
        assert len(e["ffn_sparsity_per_layer"]) == 2
        assert e["ffn_sparsity"] == pytest.approx(np.mean(e["ffn_sparsity_per_layer"]), abs=1e-12)
    assert ev["original"]["ffn_sparsity"] == 0  # SiLU is never exactly 0
    assert 0.3 < ev["swapped_untrained"]["ffn_sparsity"] < 0.7  # ReLU of a random gate: about half
    assert ev["perplexity_ratio"] == pytest.approx(ev["relufied"]["perplexity"] / ev["original"]["perplexity"])

    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["chat_template.jinja", "config.json", "generation_config.json", "meta.json", "model.safetensors",
         "summary.json", "tokenizer.json", "tokenizer_config.json"])
    assert not (tmp_path / ".out.partial").exists()
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(s))
    meta = json.loads((out / "meta.json").read_text())
    assert meta["stage"] == "relufy" and meta["config"] == asdict(cfg)
    assert meta["inputs"]["model"]["activation"] == "swiglu"
    assert all(torch.equal(v, before[k]) for k, v in teacher.model.state_dict().items())  # teacher untouched


def test_l1_raises_ffn_sparsity(teacher, text_corpus, tmp_path):
    """With a strong staged L1 the exact-zero share climbs well above the swap's ~50%; without, it stays."""
    runs = {l1: relufy(None, tmp_path / f"l1-{l1}", tiny_cfg(text_corpus, tokens=8192, lr=3e-3, l1=l1),
                       lm=teacher, device="cpu", progress=False) for l1 in (0.0, 6.0)}
    rise, curve_rise = {}, {}
    for l1, s in runs.items():
        ev = s["eval"]
        rise[l1] = ev["relufied"]["ffn_sparsity"] - ev["swapped_untrained"]["ffn_sparsity"]
        first, last = head_tail(s["curve"], "sparsity")
        curve_rise[l1] = last - first
    # held-out text: +0.22 to +0.34 with L1 over tiny models and seeds, within +-0.01 without
    assert rise[6.0] > 0.15 and abs(rise[0.0]) < 0.03, rise
    assert curve_rise[6.0] > 0.1 and abs(curve_rise[0.0]) < 0.03, curve_rise  # the training batches agree

    # staged (l1_stages 4) over the first half (l1_ramp 0.5): none for 8 of the 64 steps, the full weight from 33
    weights = [c["l1_weight"] for c in runs[6.0]["curve"]]
    assert weights == [0.0] * 8 + [1.5] * 8 + [3.0] * 8 + [4.5] * 8 + [6.0] * 32


def test_schedules():
    cfg = RelufyConfig(tokens=100 * 32 * 256, lr=1e-3, warmup=0.1, l1=2.0, l1_ramp=0.5)  # 100 steps
    assert [lr_at(s, cfg) for s in (0, 9)] == pytest.approx([1e-4, 1e-3])  # linear warmup over 10 steps
    assert lr_at(99, cfg) == pytest.approx(1e-4, rel=0.01)  # cosine down to lr / 10
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(9, 99))
    assert [l1_at(s, cfg) for s in (0, 12, 13, 25, 49, 50, 99)] == [0, 0, 0.5, 1.0, 1.5, 2.0, 2.0]
    linear = replace(cfg, l1_stages=0)
    assert [l1_at(s, linear) for s in (0, 10, 25, 50, 70)] == pytest.approx([0, 0.4, 1.0, 2.0, 2.0])
    assert l1_at(0, replace(cfg, l1_ramp=0)) == 2.0  # no ramp: the full weight at once
    assert l1_at(50, replace(cfg, l1=0)) == 0
    assert [l1_at(s, replace(cfg, l1_until=0.7)) for s in (50, 69, 70, 99)] == [2.0, 2.0, 0, 0]  # then KL alone


# ---------------------------------------------------------------------------------------------------------------
# The output folder: who loads it, what it computes, what the profiler counts


def test_relu_output_loads_in_plain_transformers(relufied):
    from transformers import AutoModelForCausalLM

    out = relufied("relu")
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_act"] == "relu" and "fat_threshold" not in config
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = load_model(str(out), dtype="float32")
    assert ours.activation == "reglu"  # ReLU(gate) * up: transformers' own LLaMA with hidden_act relu
    ids = torch.randint(0, 259, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = plain(input_ids=ids).logits
        b = ours.model(input_ids=ids).logits
    assert a.shape == (3, 40, 259)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)

    plain64 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)  # and it computes ReGLU
    x = torch.randn(256, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for layer in plain64.model.layers:
        mlp = layer.mlp
        g, u = x @ mlp.gate_proj.weight.detach().T, x @ mlp.up_proj.weight.detach().T
        with torch.no_grad():
            torch.testing.assert_close(mlp(x), ffn_values("relu", g, u) @ mlp.down_proj.weight.T, atol=1e-10, rtol=0)


def ffn_values(activation: str, g: torch.Tensor, u: torch.Tensor, t: float = 0.0) -> torch.Tensor:
    """h, what enters the down projection, from the gate and up projections by the formula."""
    if activation == "drelu":
        return torch.relu(g) * torch.relu(u)
    if activation == "fatrelu":
        return g * (g > t) * u
    return torch.relu(g) * u  # relu: ReGLU


def ffn_weights(lm, layer) -> dict[str, torch.Tensor]:
    return {k: m.weight.detach() for k, m in lm.adapter.layer_ffn(layer).items()}


@pytest.mark.parametrize("activation", ["drelu", "fatrelu"])
def test_drelu_fatrelu_outputs_load_only_through_our_loader(activation, relufied):
    from transformers import AutoModelForCausalLM

    out = relufied(activation)
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_act"] == activation
    t = FAT_THRESHOLD if activation == "fatrelu" else 0.0
    if activation == "fatrelu":
        assert config["fat_threshold"] == FAT_THRESHOLD
    with pytest.raises(Exception, match=activation):  # no such activation in transformers' table
        AutoModelForCausalLM.from_pretrained(out)

    lm = load_model(str(out), dtype="float64")
    assert lm.activation == activation and lm.info["activation"] == activation
    x = torch.randn(256, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for layer in lm.layers:
        w = ffn_weights(lm, layer)
        g, u = x @ w["gate"].T, x @ w["up"].T
        with torch.no_grad():
            y = lm.adapter.ffn_module(layer)(x)
        ref = ffn_values(activation, g, u, t) @ w["down"].T
        torch.testing.assert_close(y, ref, atol=1e-10, rtol=0)
        assert (ffn_values("relu", g, u) @ w["down"].T - ref).abs().max() > 1e-2  # the inputs tell the kinds apart
        if activation == "fatrelu":
            assert ((g > 0) & (g <= t)).double().mean() > 0.05  # values the threshold zeroes and ReLU keeps
        else:
            assert ((g > 0) & (u < 0)).double().mean() > 0.05  # values dReLU zeroes and ReGLU keeps


@pytest.mark.parametrize("activation", ["relu", "drelu", "fatrelu"])
def test_profiler_counts_exact_zeros(activation, relufied, text_corpus, tmp_path):
    out = relufied(activation)
    res = CliRunner().invoke(profile_cli, ["--model", str(out), "--dataset", str(text_corpus), "--tokens", "2048",
                                           "--seq-len", "256", "--out", str(tmp_path / "run"),
                                           "--samples-per-layer", "0", "--quiet", "--json"])
    assert res.exit_code == 0, res.output
    df, meta = read_profile(tmp_path / "run")
    assert meta["taus"] is None and meta["model"]["activation"] == {"relu": "reglu"}.get(activation, activation)
    counts = df.pivot(index="layer", columns="neuron", values="count").to_numpy()  # (layers, neurons)

    # reference: h by the formula from the FFN input and the weights, the same token rows, (h != 0) counted
    lm = load_model(str(out), dtype="float32")
    t = FAT_THRESHOLD if activation == "fatrelu" else 0.0
    xs: dict[int, torch.Tensor] = {}
    handles = [lm.adapter.ffn_module(layer).register_forward_pre_hook(
        lambda m, a, i=i: xs.__setitem__(i, a[0].reshape(-1, a[0].shape[-1]))) for i, layer in enumerate(lm.layers)]
    ref = np.zeros_like(counts)
    tokens = 0
    # pi-profile's batches (its default batch size; sequences within the tiny model's 256 positions, which the
    # layer-by-layer path refuses to pass)
    for ids in token_batches(lm.tokenizer, iter_texts(str(text_corpus)), 256, 8, 2048):
        tokens += ids.numel()
        with torch.no_grad():
            lm.model.base_model(input_ids=ids, use_cache=False)
        for i, layer in enumerate(lm.layers):
            w = ffn_weights(lm, layer)
            g, u = torch.nn.functional.linear(xs[i], w["gate"]), torch.nn.functional.linear(xs[i], w["up"])
            ref[i] += (ffn_values(activation, g, u, t) != 0).sum(0).numpy()
    for h in handles:
        h.remove()
    assert tokens == meta["tokens"] == 2048
    np.testing.assert_array_equal(counts, ref)
    assert 0.2 * counts.size * tokens < counts.sum() < 0.8 * counts.size * tokens  # sparse, not degenerate


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints and resume


def interrupt_at(k: int):
    def on_step(step, stats):
        if step == k:
            raise KeyboardInterrupt

    return on_step


def test_resume_after_interrupt_matches_an_uninterrupted_run(teacher, text_corpus, tmp_path):
    cfg = tiny_cfg(text_corpus, l1=1.0)  # 16 steps, checkpoints at 4, 8, 12; L1 stages and the lr schedule move
    full = relufy(None, tmp_path / "a", cfg, lm=teacher, device="cpu", progress=False)

    with pytest.raises(RelufyError) as e:
        relufy(None, tmp_path / "b", cfg, lm=teacher, device="cpu", progress=False, on_step=interrupt_at(6))
    msg = str(e.value)
    assert "\n" not in msg and "step 6" in msg and "step 4 are kept" in msg and ".b.partial" in msg and "resume" in msg
    partial = tmp_path / ".b.partial"
    assert json.loads((partial / "checkpoint/state.json").read_text())["step"] == 4
    assert not (tmp_path / "b").exists()

    resumed = relufy(None, tmp_path / "b", cfg, lm=teacher, device="cpu", progress=False, resume=True)
    assert not partial.exists()
    a, b = load_file(str(tmp_path / "a/model.safetensors")), load_file(str(tmp_path / "b/model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), k
    assert resumed["curve"] == full["curve"]  # same batches, losses and schedule step by step
    assert resumed["eval"] == full["eval"]


def test_resume_with_other_settings_is_refused(teacher, text_corpus, tmp_path):
    cfg = tiny_cfg(text_corpus)
    with pytest.raises(RelufyError, match="step 4 are kept"):
        relufy(None, tmp_path / "out", cfg, lm=teacher, device="cpu", progress=False, on_step=interrupt_at(5))
    partial = tmp_path / ".out.partial"
    with pytest.raises(RelufyError) as e:
        relufy(None, tmp_path / "out", replace(cfg, lr=2e-3), lm=teacher, device="cpu", progress=False, resume=True)
    assert "\n" not in str(e.value) and "other settings (lr)" in str(e.value)
    assert (partial / "checkpoint/state.json").exists()  # the refusal keeps the checkpoint
    with pytest.raises(RelufyError, match="interrupted relufy") as e:  # a fresh start must say resume or force
        relufy(None, tmp_path / "out", cfg, lm=teacher, device="cpu", progress=False)
    assert (partial / "checkpoint/state.json").exists() and not (tmp_path / "out").exists()
    s = relufy(None, tmp_path / "out", cfg, lm=teacher, device="cpu", progress=False, resume=True)
    assert s["curve"][-1]["step"] == cfg.steps and (tmp_path / "out/model.safetensors").exists()


def test_interrupt_before_first_checkpoint_keeps_the_teacher_text(teacher, text_corpus, tmp_path):
    cfg = tiny_cfg(text_corpus)
    with pytest.raises(RelufyError, match="the teacher text and the checkpoint of step 0 are kept"):
        relufy(None, tmp_path / "out", cfg, lm=teacher, device="cpu", progress=False, on_step=interrupt_at(4))
    partial = tmp_path / ".out.partial"  # step 4's checkpoint comes after on_step: only step 0's was written
    pool = load_file(str(partial / "pool.safetensors"))["pool"]
    assert json.loads((partial / "checkpoint/state.json").read_text())["step"] == 0
    s = relufy(None, tmp_path / "out", cfg, lm=teacher, device="cpu", progress=False, resume=True)
    assert s["pool_tokens"] == pool.numel() and s["curve"][-1]["step"] == cfg.steps and not partial.exists()


def test_interrupt_while_building_the_pool_keeps_nothing(teacher, text_corpus, tmp_path, monkeypatch):
    import hotneurons.relufy.distill as distill

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(distill, "build_pool", interrupted)
    with pytest.raises(KeyboardInterrupt):
        relufy(None, tmp_path / "out", tiny_cfg(text_corpus), lm=teacher, device="cpu", progress=False)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RelufyError, match="no interrupted relufy"):
        relufy(None, tmp_path / "out", tiny_cfg(text_corpus), lm=teacher, device="cpu", progress=False, resume=True)


# ---------------------------------------------------------------------------------------------------------------
# Bad inputs through the command line


def listing(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(root.rglob("*"))}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["no-gated-ffn", "unknown-activation", "zero-tokens", "exists", "nothing-to-resume"])
def test_cli_refuses_bad_inputs(case, swiglu, tiny_model_dir, text_corpus, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    model = tiny_model_dir("opt") if case == "no-gated-ffn" else swiglu
    args = ["--model", str(model), "--out", str(out), "--preset", "tiny", "--dataset", str(text_corpus), "--quiet"]
    args += {"unknown-activation": ["--activation", "gelu"], "zero-tokens": ["--tokens", "0"],
             "nothing-to-resume": ["--resume"]}.get(case, [])
    if case == "exists":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    before = listing(work)

    res = subprocess.run([sys.executable, "-m", "hotneurons.relufy", *args], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    usage = case == "unknown-activation"  # click's usage errors exit 2, the command's own refusals 1
    assert res.returncode == (2 if usage else 1), res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, res.stderr
    if not usage:
        assert res.stderr.splitlines() == errors  # nothing but the one line: no warnings, no progress bars
    assert {"no-gated-ffn": "no LLaMA-style gated FFN", "unknown-activation": "'gelu' is not one of",
            "zero-tokens": "0 tokens", "exists": "exists: pass --force",
            "nothing-to-resume": "run without --resume"}[case] in errors[0]
    assert listing(work) == before  # nothing written, an existing folder untouched


def test_gate_cos_penalty_matches_reference_and_ignores_rescaling(teacher):
    """The gate-cos term equals mean ReLU(cos(x, w_i)) computed in float64 from the FFN inputs, and rescaling a
    neuron (gate row * a, down column / a: the same function) leaves it unchanged while mean |h| moves."""
    from hotneurons.models.family import decoder_layers
    from hotneurons.relufy.relufy import FFNValues, plain_model

    model = plain_model(teacher, torch.float32, "cpu", "relu")
    layers = decoder_layers(model, model.config)
    ids = torch.randint(0, model.config.vocab_size - 3, (2, 24), generator=torch.Generator().manual_seed(5))
    xs = []
    grab = [teacher.adapter.layer_ffn(layer)["gate"].register_forward_pre_hook(lambda m, a: xs.append(a[0]))
            for layer in layers]

    def penalties() -> tuple[float, float]:
        out = []
        for penalty in ("gate-cos", "h"):
            vals = FFNValues(model, teacher.adapter, keep=True, penalty=penalty)
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)
            out.append(float(vals.l1()))
            vals.close()
        return out[0], out[1]

    cos0, h0 = penalties()
    for g in grab:
        g.remove()
    ref = []
    for layer, x in zip(layers, xs[:len(layers)]):
        w = teacher.adapter.layer_ffn(layer)["gate"].weight.double()  # (neurons, d)
        x = x.double()  # (batch, seq, d)
        cos = (x @ w.T) / (x.norm(dim=-1, keepdim=True) * w.norm(dim=1))  # (batch, seq, neurons)
        ref.append(torch.relu(cos).mean().item())
    assert cos0 == pytest.approx(float(np.mean(ref)), rel=1e-4)

    with torch.no_grad():
        for layer in layers:
            ffn = teacher.adapter.layer_ffn(layer)
            ffn["gate"].weight.mul_(4.0)
            ffn["down"].weight.div_(4.0)
    cos1, h1 = penalties()
    assert cos1 == pytest.approx(cos0, rel=1e-4) and h1 > 2 * h0


def test_gate_cos_raises_ffn_sparsity(teacher, text_corpus, tmp_path):
    """A staged gate-cos penalty turns neurons off on held-out text (the L1 test's setting)."""
    cfg = tiny_cfg(text_corpus, tokens=8192, lr=3e-3, l1=30.0, penalty="gate-cos")
    ev = relufy(None, tmp_path / "cos", cfg, lm=teacher, device="cpu", progress=False)["eval"]
    assert ev["relufied"]["ffn_sparsity"] - ev["swapped_untrained"]["ffn_sparsity"] > 0.1, ev


def test_pool_is_no_larger_than_the_training_reads(teacher, text_corpus):
    """A small budget builds a pool of about the rows its steps read (half corpus, half teacher text), not the corpus's
    worth of teacher text, whose generation is the slow part on a CPU."""
    from hotneurons.relufy.relufy import build_pool, corpus_rows

    cfg = tiny_cfg(text_corpus, tokens=512)  # 4 steps of 4 rows of 32 tokens
    needed = cfg.steps * cfg.batch_size
    assert len(corpus_rows(teacher.tokenizer, cfg, cfg.dataset, cfg.corpus_tokens)) > needed  # the cap matters
    pool = build_pool(teacher.model, teacher.tokenizer, cfg, progress=False)
    assert pool.shape[1] == cfg.seq_len and needed <= len(pool) <= needed + 1


def test_teacher_text_bar_moves_every_decoding_step(teacher, text_corpus, monkeypatch):
    """The teacher-text bar moves as tokens are sampled (a batch's generate() runs for minutes on a CPU), and ends at
    the rows' exact token count; the rows are those of a run without the bar."""
    import hotneurons.relufy.relufy as rr

    updates = []

    class Bar:
        def __init__(self, total, **kw):
            self.total, self.n = total, 0

        def update(self, k):
            updates.append(k)
            self.n += k

        def refresh(self):
            pass

        def close(self):
            pass

    cfg = tiny_cfg(text_corpus, gen_batch=4)
    prompts = rr.corpus_rows(teacher.tokenizer, cfg, cfg.dataset, 2048)[:6, :cfg.prompt_tokens]  # (6, 8): 2 batches
    plain = rr.teacher_rows(teacher.model, prompts, cfg, 0, progress=False)
    monkeypatch.setattr(rr, "tqdm", Bar)
    rows = rr.teacher_rows(teacher.model, prompts, cfg, 0, progress=True)
    torch.testing.assert_close(rows, plain, rtol=0, atol=0)
    assert sum(updates) == rows.numel() == 6 * cfg.seq_len
    assert len(updates) >= 2 * (cfg.seq_len - cfg.prompt_tokens)  # a move a decoding step, not one a batch


def test_cli_ctrl_c_says_what_was_kept(monkeypatch, tmp_path):
    """Ctrl-C in pi-relufy: exit code 130 and one `interrupted:` line naming what is kept (not click's `Aborted!`)."""
    from click.testing import CliRunner
    from hotneurons.relufy import distill
    from hotneurons.relufy.cli import main

    def stopped(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(distill, "relufy", stopped)
    r = CliRunner().invoke(main, ["--out", str(tmp_path / "out"), "--preset", "tiny", "--quiet"])
    assert r.exit_code == 130 and "interrupted: stopped before the teacher text was built" in r.output, r.output
    (distill.partial_dir(tmp_path / "out") / "checkpoint").mkdir(parents=True)
    (distill.partial_dir(tmp_path / "out") / "checkpoint" / "state.json").write_text("{}")
    r = CliRunner().invoke(main, ["--out", str(tmp_path / "out"), "--preset", "tiny", "--quiet"])
    assert r.exit_code == 130 and "--resume" in r.output and "Aborted" not in r.output, r.output

    def stopped_in_training(*a, **k):  # the training loop's interrupt, as distill.relufy raises it
        raise RelufyInterrupted("interrupted at step 6: the teacher text and the checkpoint of step 4 are kept in "
                                "'x'; continue with resume")

    monkeypatch.setattr(distill, "relufy", stopped_in_training)
    r = CliRunner().invoke(main, ["--out", str(tmp_path / "out"), "--preset", "tiny", "--quiet", "--resume"])
    assert r.exit_code == 130 and "interrupted: interrupted at step 6" in r.output, r.output
    assert "with --resume" in r.output and r.output.strip().count("\n") == 0, r.output


@pytest.mark.parametrize("mode", ["dense", "layer-split"])
def test_fatrelu_output_is_refused_by_pi_generate_in_one_line(mode, relufied):
    """pi-generate's kernels take no FATReLU threshold: every mode refuses the model with the fix, before decoding."""
    from click.testing import CliRunner
    from hotneurons.runtime.cli import main as generate_main

    args = ["--model", str(relufied("fatrelu")), "-p", "hello", "-n", "2", "--device", "cpu", "--mode", mode]
    if mode == "layer-split":
        args += ["--gpu-layers", "1"]
    res = CliRunner().invoke(generate_main, args)
    assert res.exit_code != 0
    assert "FATReLU's threshold is in none of them: relufy with --activation relu or drelu" in res.output, res.output


def test_cpu_batch_in_parts_equals_the_whole_batch(teacher, text_corpus, tmp_path, monkeypatch):
    """On the CPU a batch runs in parts of `micro_rows` rows (the logits of 32 x 256 tokens held ~12 GB), gradients
    accumulated: the same steps as the whole batch at once, to float32 rounding."""
    import hotneurons.relufy.distill as distill

    cfg = tiny_cfg(text_corpus, l1=1.0)
    assert distill.micro_rows(cfg.seq_len, teacher.model.config.vocab_size) >= cfg.batch_size  # tiny: one part
    whole = relufy(None, tmp_path / "a", cfg, lm=teacher, device="cpu", progress=False)
    monkeypatch.setattr(distill, "LOGITS_BYTES", 1)  # one row a part
    assert distill.micro_rows(cfg.seq_len, teacher.model.config.vocab_size) == 1
    parts = relufy(None, tmp_path / "b", cfg, lm=teacher, device="cpu", progress=False)
    for a, b in zip(whole["curve"], parts["curve"]):
        assert a["step"] == b["step"] and a["sparsity"] == pytest.approx(b["sparsity"], abs=0.02)
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-3, abs=1e-5) and a["l1"] == pytest.approx(b["l1"], rel=1e-3)
    a, b = load_file(str(tmp_path / "a/model.safetensors")), load_file(str(tmp_path / "b/model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=1e-3, msg=k)
