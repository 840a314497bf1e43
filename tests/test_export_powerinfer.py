"""pi-export --format powerinfer: the files read back (names, shapes, dtypes, values), the gpuidx equals the placement,
the activation files the profile, the refusals; and, where PowerInfer's `main` is built (POWERINFER_MAIN), its greedy
tokens equal ours and HF's on a small ReGLU LLaMA with exact predictors."""

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from hotneurons.artifacts.placement import read_placement
from hotneurons.export import ExportError, exact_predictors, export_run, to_powerinfer
from hotneurons.export import roundtrip as rt
from hotneurons.export.cli import main as cli
from hotneurons.export.gguf_model import (
    GGML_I32,
    NEVER_MERGE,
    POWERINFER_I32,
    Tensor,
    permute_qk,
    retype_ints,
    vocab_from_tokenizer,
)
from hotneurons.export.powerinfer import gpu_index_tensors, powerinfer_arch, write_gpu_index
from hotneurons.export.predictors import write_predictors
from transformers import LlamaConfig

gguf = pytest.importorskip("gguf")
MAIN = os.environ.get("POWERINFER_MAIN")
BUILD = ("set POWERINFER_MAIN to PowerInfer's `main` (python -m bench.powerinfer_check --out DIR builds it "
         "from ../shared/vendor/PowerInfer-src.tgz, or: cmake -S PowerInfer -B build -DLLAMA_BUILD_TESTS=OFF "
         "-DCMAKE_BUILD_TYPE=Release && cmake --build build --target main)")


def read_gguf(path: Path, tmp: Path, ints: Sequence[Tensor] = ()):
    """GGUFReader over a copy whose PWRI magic is put back to GGUF (the rest of the file is GGUF v3) and whose int32
    tensors `ints` get back today's type number (PowerInfer's ggml numbers I32 18)."""
    data = bytearray(path.read_bytes())
    assert bytes(data[:8]) == b"PWRI\x03\x00\x00\x00"
    data[:4] = b"GGUF"
    copy = tmp / (path.name + ".as-gguf")
    copy.write_bytes(data)
    retype_ints(copy, ints, POWERINFER_I32, GGML_I32)
    return gguf.GGUFReader(str(copy))


def field(r, key):
    f = r.fields[key]
    return [bytes(f.parts[i]).decode() if f.types[-1] == gguf.GGUFValueType.STRING else f.parts[i][0]
            for i in f.data]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    work = tmp_path_factory.mktemp("export")
    folder = rt.build_model(work / "model")
    run = rt.make_run(folder, work / "run", form="normed")
    summary = export_run(run, work / "out")
    from hotneurons.models.family import load_model

    lm = load_model(str(folder), device="cpu", dtype="float32")
    return SimpleNamespace(work=work, folder=folder, run=run, out=work / "out", summary=summary, lm=lm,
                           state=dict(lm.model.state_dict()), cfg=lm.model.config)


def test_model_gguf_reads_back(exported, tmp_path):
    e, cfg = exported, exported.cfg
    L, d, n = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    r = read_gguf(e.out / e.summary["files"]["model"], tmp_path)
    t = {x.name: x for x in r.tensors}
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down_t", "fc1", "fc2"]
    assert set(t) == {"token_embd.weight", "output_norm.weight", "output.weight",
                      *(f"blk.{i}.{k}.weight" for i in range(L) for k in per_layer)}
    for x in r.tensors:  # 2-D F16, 1-D F32
        assert x.tensor_type.name == ("F16" if len(x.data.shape) == 2 else "F32"), x.name
    s = e.state

    def got(name):
        return np.asarray(t[name].data)

    def f16(w):
        return w.detach().numpy().astype(np.float16)

    assert np.array_equal(got("blk.1.ffn_down_t.weight"), f16(s["model.layers.1.mlp.down_proj.weight"].T))  # (n, d)
    assert got("blk.1.ffn_down_t.weight").shape == (n, d)
    assert np.array_equal(got("output.weight"), f16(s["lm_head.weight"]))
    assert np.array_equal(got("blk.2.attn_k.weight"), f16(permute_qk(s["model.layers.2.self_attn.k_proj.weight"], 2)))
    assert np.array_equal(got("blk.0.ffn_norm.weight"), s["model.layers.0.post_attention_layernorm.weight"].numpy())
    gate, gamma = s["model.layers.2.mlp.gate_proj.weight"], s["model.layers.2.post_attention_layernorm.weight"]
    assert np.array_equal(got("blk.2.fc1.weight"), f16(torch.cat((gate * gamma, -gate * gamma))))  # (2n, d): γ folded
    assert np.array_equal(got("blk.2.fc2.weight"), f16(torch.cat((torch.eye(n), -torch.eye(n)), 1)))  # (n, 2n)
    assert field(r, "general.architecture") == ["llama"]
    assert field(r, "powerinfer.sparse_threshold") == [0.0]
    assert field(r, "llama.feed_forward_length") == [n] and field(r, "llama.attention.head_count_kv") == [2]
    tok = e.lm.tokenizer
    assert field(r, "tokenizer.ggml.model") == ["gpt2"]
    assert field(r, "tokenizer.ggml.tokens") == tok.convert_ids_to_tokens(list(range(len(tok))))
    assert field(r, "tokenizer.ggml.merges") == [" ".join(m) for m in rt.MERGES]
    assert field(r, "tokenizer.ggml.eos_token_id") == [tok.eos_token_id]


def test_gpu_index_equals_the_placement(exported, tmp_path):
    e = exported
    placement = read_placement(e.run, e.lm.info)
    masks = [placement[i] for i in range(e.cfg.num_hidden_layers)]
    r = read_gguf(e.out / e.summary["files"]["gpu_index"], tmp_path, gpu_index_tensors(masks))
    L = e.cfg.num_hidden_layers
    assert [x.name for x in r.tensors] == [f"blk.{i}.{k}" for i in range(L) for k in ("gpu_idx", "gpu_bucket")]
    for i in range(L):
        mask = placement[i]
        idx, bucket = (np.asarray(r.tensors[2 * i + j].data) for j in (0, 1))
        assert idx.dtype == np.int32 and np.array_equal(idx, mask.astype(np.int32))
        assert bucket.dtype == np.int32 and np.array_equal(bucket, np.flatnonzero(mask))
    assert field(r, "general.architecture") == ["generic.gpu_index"]
    assert field(r, "split.vram_capacity") == [e.summary["vram_capacity"]]
    assert e.summary["vram_capacity"] == sum(int(placement[i].sum()) for i in range(L)) * 3 * e.cfg.hidden_size * 2


def test_gpu_index_of_a_layer_without_gpu_neurons(tmp_path):
    masks = [np.zeros(8, bool), np.arange(8) % 3 == 0]
    write_gpu_index(tmp_path / "x.gpuidx", masks, 123)
    with pytest.raises(ValueError):  # as written, the int32 tensors carry PowerInfer's type number, not today's
        read_gguf(tmp_path / "x.gpuidx", tmp_path).tensors[0].data
    r = read_gguf(tmp_path / "x.gpuidx", tmp_path, gpu_index_tensors(masks))
    assert [np.asarray(x.data).tolist() for x in r.tensors] == [[0] * 8, [], [1, 0, 0, 1, 0, 0, 1, 0], [0, 3, 6]]


def test_activation_files_equal_the_profile_counts(exported):
    df = pd.read_parquet(exported.run / "profile" / "neurons.parquet")
    for i in range(exported.cfg.num_hidden_layers):
        a = torch.load(exported.out / "activation" / f"activation_{i}.pt", weights_only=True)
        want = df[df.layer == i].sort_values("neuron")["count"].to_numpy()
        assert a.dtype == torch.int64 and a.shape == (exported.cfg.intermediate_size,)
        assert np.array_equal(a.numpy(), want) and want.sum() > 0
    summary = json.loads((exported.out / "export.json").read_text())
    assert summary["source"]["predictor_form"] == "normed" and summary["source"]["folded_norm_into_fc1"]


def test_exact_predictor_is_the_gate_sign(exported):
    """fc2 ReLU(fc1 x_pre) = W_gate diag(γ) x_pre = rms(x_pre) · gate(x_post): the gate's sign, from the pre-norm
    residual; the normed twin on x_post gives gate(x_post) itself."""
    e = exported
    norm = e.lm.model.model.layers[1].post_attention_layernorm
    x_pre = torch.randn(50, e.cfg.hidden_size) * 3
    x_post = norm(x_pre)
    gate = e.lm.model.model.layers[1].mlp.gate_proj(x_post)
    rms = (x_pre.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt()
    (f1, f2), = exact_predictors(e.state, 3, "powerinfer")[1:2]
    assert torch.allclose(f2 @ torch.relu(f1 @ x_pre.T), (gate * rms).T, atol=1e-4)
    (g1, g2), = exact_predictors(e.state, 3, "normed")[1:2]
    assert torch.allclose(g2 @ torch.relu(g1 @ x_post.T), gate.T, atol=1e-5)
    folded, t = to_powerinfer([(g1, g2)], [0.0], "normed", [norm.weight])
    assert t == 0.0 and torch.equal(folded[0][0], f1)


def test_refused_models():
    base = dict(hidden_size=64, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2)
    ok = LlamaConfig(**base, hidden_act="relu")
    assert powerinfer_arch(ok, "reglu") == "llama" and powerinfer_arch(ok, "drelu") == "bamboo"
    cases = [
        (ok, "swiglu", "activation 'swiglu' cannot run on PowerInfer.*pi-relufy --activation relu"),
        (ok, "fatrelu", "FATReLU with threshold 0 cannot run"),
        (SimpleNamespace(model_type="qwen2"), "reglu", "model type 'qwen2' is not LLaMA-shaped"),
        (LlamaConfig(**{**base, "intermediate_size": 1000}), "reglu", "FFN width 1000 <= 1000"),
        (LlamaConfig(**base, head_dim=32), "reglu", "head_dim 32 x 4 heads != hidden size 64"),
        (LlamaConfig(**base, attention_bias=True), "reglu", "attention_bias = true"),
        (LlamaConfig(**base, rope_scaling={"rope_type": "linear", "factor": 2.0}), "reglu", "RoPE scaling 'linear'"),
    ]
    for cfg, act, msg in cases:
        with pytest.raises(ExportError, match=msg) as e:
            powerinfer_arch(cfg, act)
        assert "\n" not in str(e.value)


def test_refused_predictors(exported, tmp_path):
    e = exported
    run = tmp_path / "run"
    shutil.copytree(e.run, run)
    L = e.cfg.num_hidden_layers
    layers = exact_predictors(e.state, L, "normed")
    write_predictors(run, e.lm.info, layers, 0.5, "normed")  # normed, threshold != 0: no exact equivalent
    with pytest.raises(ExportError, match="normed predictors .* only with threshold 0, but layer 0's is 0.5.*"
                                          "pi-train-predictors --form powerinfer"):
        export_run(run, tmp_path / "a")
    write_predictors(run, e.lm.info, exact_predictors(e.state, L), 0.0, "powerinfer")
    summary = json.loads((run / "predictors" / "summary.json").read_text())
    summary["layers"][1]["threshold"] = -0.25  # powerinfer form, but not one threshold
    (run / "predictors" / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ExportError, match="2 different thresholds .* PowerInfer applies one to every layer"):
        export_run(run, tmp_path / "a")
    with pytest.raises(ExportError, match="recall 0.9 has no tabulated threshold"):
        export_run(run, tmp_path / "a", recall=0.9)
    from safetensors.torch import load_file, save_file

    t = load_file(str(run / "predictors" / "predictors.safetensors"))
    t["layers.0.fc1.bias"] = torch.zeros(t["layers.0.fc1.weight"].shape[0])
    save_file(t, str(run / "predictors" / "predictors.safetensors"))
    with pytest.raises(ExportError, match="has biases .*layers.0.fc1.bias.* PowerInfer's predictor has none"):
        export_run(run, tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_output_folder_is_replaced_only_with_force_and_kept_on_failure(exported, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(ExportError, match="exists: pass --force"):
        export_run(exported.run, out)
    from hotneurons.export import powerinfer

    def broken(folder, counts):
        raise OSError("disk full")

    monkeypatch.setattr(powerinfer, "write_activations", broken)
    with pytest.raises(OSError, match="disk full"):
        export_run(exported.run, out, force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "mine.txt").read_text() == "keep"
    monkeypatch.undo()
    export_run(exported.run, out, force=True)
    assert not (out / "mine.txt").exists() and (out / "model.powerinfer.gguf").exists()


def test_cli_json_and_one_line_errors(exported, tmp_path):
    res = CliRunner().invoke(cli, ["--run", str(exported.run), "--out", str(tmp_path / "o"), "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s["format"] == "powerinfer" and s["arch"] == "llama" and s["sparse_threshold"] == 0.0
    res = CliRunner().invoke(cli, ["--run", str(exported.run), "--out", str(tmp_path / "o")])
    assert res.exit_code == 1 and res.output.count("\n") == 1 and "pass --force" in res.output
    res = CliRunner().invoke(cli, ["--run", str(tmp_path / "nothing"), "--out", str(tmp_path / "p")])
    assert res.exit_code == 1 and "no profile in" in res.output and res.output.count("\n") == 1
    res = CliRunner().invoke(cli, ["--run", str(exported.run), "--out", str(tmp_path / "p"), "--vram-capacity", "12"])
    assert res.exit_code == 2 and "--vram-capacity" in res.output


def test_vocabularies():
    from tiny import byte_tokenizer
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    v = vocab_from_tokenizer(byte_tokenizer(), 262)  # no merges: the one that never applies; rows past the tokenizer
    assert v.model == "gpt2" and v.merges == [] and v.tokens[258:] == ["<pad>", "[PAD259]", "[PAD260]", "[PAD261]"]
    assert v.types[256:] == [3, 3, 3, 5, 5, 5]
    w = SimpleNamespace(calls=[])

    class Writer:
        def __getattr__(self, name):
            return lambda *a: w.calls.append((name, a))

    v.add_to(Writer())
    assert ("add_token_merges", ([NEVER_MERGE],)) in w.calls
    # a LLaMA-style tokenizer: byte fallback, "▁" for spaces -> llama.cpp's SentencePiece vocabulary
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}, "▁": 259, "a": 260,
             "b": 261, "▁a": 262, "▁ab": 263}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁a", "b")], byte_fallback=True, unk_token="<unk>"))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    v = vocab_from_tokenizer(tok, 264)
    assert v.model == "llama" and v.types[:4] == [2, 3, 3, 6] and v.types[259] == 1
    assert v.scores[262:] == [0.0, -1.0] and v.scores[259] == 0.0 and (v.bos, v.eos, v.unk) == (1, 2, 0)


@pytest.mark.slow
@pytest.mark.parametrize("form,activation", [("normed", "reglu"), ("powerinfer", "reglu"), ("powerinfer", "drelu")])
def test_powerinfer_main_equals_ours_and_hf(form, activation, tmp_path):
    """PowerInfer's `main` (CPU, greedy) on the exported model (arch llama, or bamboo for dReLU): the same prompt
    tokens, and the same 16 new tokens as our runtime (hybrid, the same exact predictor and placement) and HF generate.
    A threshold above every logit (nothing computed) changes them: the FFN and its predictor are live."""
    res = rt.roundtrip(tmp_path, Path(MAIN) if MAIN else None, form=form, activation=activation)
    assert res["model"]["arch"] == {"reglu": "llama", "drelu": "bamboo"}[activation]
    assert res["ours_vs_hf_matched"] == 16 and 0.3 < res["ours"]["ffn_sparsity"] < 0.7
    if not MAIN:
        pytest.skip(BUILD)
    assert res["prompt_ids_equal"] and res["all_equal"], res["powerinfer"]
    os.environ["LLAMA_SPARSE_PRED_THRESHOLD"] = "1e30"
    try:
        off = rt.powerinfer_tokens(Path(MAIN), tmp_path / "export" / "model.powerinfer.gguf", rt.PROMPT, 16,
                                   logdir=tmp_path / "off")
    finally:
        del os.environ["LLAMA_SPARSE_PRED_THRESHOLD"]
    assert off["tokens"] != res["hf"]["tokens"]
