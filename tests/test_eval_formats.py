"""pi-eval --row-format on tiny random models: the FFN rows rounded as the runtime stores them, against references
rounded independently with gguf-py (gguf.quants) and evaluated with the plain transformers model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hotneurons.artifacts.predictors import EvalReport
from hotneurons.common.corpus import iter_texts, token_batches
from hotneurons.models.family import load_model
from hotneurons.models.ffn_weights import FFNWeights, as_stored
from hotneurons.predictors.cli import eval_main
from hotneurons.predictors.evaluate import evaluate, format_table
from hotneurons.predictors.row_formats import RowFormatError, check_rows, parse_row_formats
from hotneurons.profiler.profile import ProfileConfig, profile_model
from hotneurons.weights.qtensor import QTensor
from hotneurons.weights.quants import quantize

gguf = pytest.importorskip("gguf")
EVAL = dict(tokens=300, seq_len=40, batch_size=2, progress=False)
NAME = "llama-swiglu"  # gated: gate, up and down rows all rounded


@pytest.fixture(scope="module")
def run(tiny_model_dir, text_corpus, tmp_path_factory):
    folder = tiny_model_dir(NAME)
    cfg = ProfileConfig(model=str(folder), dataset=str(text_corpus), tokens=300, seq_len=48, batch_size=3,
                        calibration_tokens=200, samples_per_layer=50, dtype="float64")
    out = tmp_path_factory.mktemp("fmt") / "run"
    profile_model(cfg, out, progress=False)
    return folder, out


def hf_model(folder):
    """The transformers model in float64, eager attention (its softmax float32, as our decoder's: test_streamed.py)."""
    lm = load_model(str(folder), dtype="float64")
    lm.model.set_attn_implementation("eager")
    return lm


def gguf_round(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rows of w (n, d) through gguf-py's quantize and dequantize: the reference, apart from our weights/quants."""
    t = getattr(gguf.GGMLQuantizationType, fmt.upper())
    a = w.detach().float().cpu().numpy()
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(gguf.quants.quantize(a, t), t), np.float32)).double()


def round_reference(lm, fmt: str) -> None:
    """In place: gate and up rows, and the down projection's columns as rows (down.T), rounded by gguf-py."""
    with torch.no_grad():
        for layer in lm.layers:
            for name, m in lm.adapter.layer_ffn(layer).items():
                if name == "down":
                    m.weight.copy_(gguf_round(m.weight.T, fmt).T)
                else:
                    m.weight.copy_(gguf_round(m.weight, fmt))


def plain_ppl(lm, corpus) -> float:
    """Perplexity by the plain transformers forward on the batches pi-eval builds (same tokens, same rows)."""
    batches = token_batches(lm.tokenizer, iter_texts(str(corpus)), EVAL["seq_len"], EVAL["batch_size"],
                            EVAL["tokens"])
    nll, n = 0.0, 0
    with torch.no_grad():
        for ids in batches:
            lp = torch.log_softmax(lm.model(input_ids=ids).logits[:, :-1].double(), -1)
            nll -= float(lp.gather(-1, ids[:, 1:, None]).sum())
            n += ids[:, 1:].numel()
    return math.exp(nll / n)


def test_bf16_rows_stay_within_bf16_rounding_of_float(run, text_corpus):
    """bf16 rows: perplexity within 0.5% of the unrounded rows (a relative rounding of 2^-9 a weight), not equal to
    it (the rows were rounded), and equal to the transformers model with its FFN weights rounded to bf16 by gguf-py."""
    folder, out = run
    rep = evaluate(out, modes=["dense"], dataset=str(text_corpus), dtype="float64", row_formats=["bf16"], **EVAL)
    fl, bf = rep["modes"]["dense"]["perplexity"], rep["row_formats"]["bf16"]["dense"]["perplexity"]
    assert bf != fl and bf == pytest.approx(fl, rel=5e-3)
    assert rep["row_formats"]["bf16"]["dense"]["ppl_vs_unrounded"] == pytest.approx(bf / fl - 1)
    lm = hf_model(folder)
    round_reference(lm, "bf16")
    assert bf == pytest.approx(plain_ppl(lm, text_corpus), rel=1e-7)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize("layer_by_layer", [True, False])
def test_block_rows_equal_gguf_reference(run, text_corpus, layer_by_layer, fmt):
    """q8_0 and q4_1 rows give the perplexity of the transformers model whose FFN rows gguf-py quantized and
    de-quantized, to 1e-7 relative (float64; the two paths' float32 softmaxes differ by ~1e-9), layer by layer from
    the file and on the whole transformers model, whose weights are put back afterwards."""
    folder, out = run
    ref_lm = hf_model(folder)
    round_reference(ref_lm, fmt)
    ref = plain_ppl(ref_lm, text_corpus)
    lm = None if layer_by_layer else hf_model(folder)
    before = None if lm is None else {k: v.clone() for k, v in lm.model.state_dict().items()}
    rep = evaluate(out, modes=["dense", "oracle"], dataset=str(text_corpus), dtype="float64", lm=lm,
                   row_formats=[fmt], write=False, **EVAL)
    q8 = rep["row_formats"][fmt]
    assert q8["dense"]["perplexity"] == pytest.approx(ref, rel=1e-7)
    assert q8["dense"]["perplexity"] != rep["modes"]["dense"]["perplexity"]
    assert q8["oracle"]["ppl_vs_dense"] == pytest.approx(q8["oracle"]["perplexity"] / q8["dense"]["perplexity"] - 1)
    if lm is not None:
        assert all(torch.equal(v, before[k]) for k, v in lm.model.state_dict().items())


def test_cli_reports_every_format_and_refuses_a_bad_one(run, text_corpus):
    folder, out = run
    args = ["--run", str(out), "--dataset", str(text_corpus), "--tokens", "120", "--seq-len", "40", "--quiet",
            "--dtype", "float64", "--mode", "dense"]
    res = CliRunner().invoke(eval_main, [*args, "--row-format", "q4_0,q8_0", "--row-format", "q4_1", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert list(rep["row_formats"]) == ["q4_0", "q8_0", "q4_1"] and list(rep["row_formats"]["q4_0"]) == ["dense"]
    ppl = {f: r["dense"]["perplexity"] for f, r in rep["row_formats"].items()}
    assert abs(ppl["q8_0"] / rep["modes"]["dense"]["perplexity"] - 1) < abs(ppl["q4_0"] / ppl["q8_0"] - 1)
    saved = EvalReport.load(out / "eval" / "eval.json")  # read back through the schema
    assert saved.row_formats["q4_1"]["dense"].ppl_vs_unrounded == rep["row_formats"]["q4_1"]["dense"][
        "ppl_vs_unrounded"]
    table = format_table(saved)
    assert "vs unrounded" in table and any(line.startswith("q4_1 dense") for line in table.splitlines())
    for bad in ("q5_k", "q8_0,int8"):
        res = CliRunner().invoke(eval_main, [*args, "--row-format", bad])
        assert res.exit_code != 0
        msg = res.output.strip()
        assert "\n" not in msg and f"unknown row format '{bad.split(',')[-1]}'" in msg, msg
        assert "bf16, q8_0, q4_0, q4_1" in msg and "--row-format" in msg
    assert "row_formats" not in json.loads(CliRunner().invoke(eval_main, [*args, "--json"]).stdout)


def test_row_format_names_and_row_lengths():
    assert parse_row_formats(["bf16,Q8_0", "q8_0"]) == ["bf16", "q8_0"] and parse_row_formats(None) == []
    with pytest.raises(RowFormatError, match=r"^unknown row format 'f16': choose one of bf16, q8_0, q4_0, q4_1$"):
        parse_row_formats(["f16"])
    check_rows(parse_row_formats(["bf16"]), 48)  # float rows take any length
    with pytest.raises(RowFormatError, match=r"rows of 48 \(d_model\) are not a whole number of them: leave q4_0 "):
        check_rows(parse_row_formats(["q4_0"]), 48)


def test_stored_rows_keep_a_files_blocks_and_quantize_down_along_d_model():
    """A weight stored in the asked format stays byte for byte (a GGUF's Q8_0 gate and up rows); the down projection
    (d, n), blocked along n in the file, becomes rows along d_model: down.T rounded by gguf-py."""
    torch.manual_seed(0)
    n, d = 64, 96
    gate, up, down = torch.randn(n, d), torch.randn(n, d), torch.randn(d, n)
    q = lambda t: QTensor(quantize(t, "q8_0"), "q8_0", tuple(t.shape))  # noqa: E731
    w = FFNWeights(up=q(up), down=q(down), gate=q(gate))
    r = as_stored(w, "q8_0")
    assert torch.equal(r.up, w.up.dequantize()) and torch.equal(r.gate, w.gate.dequantize())
    assert r.down is None and torch.equal(r.down_t.double(), gguf_round(w.down.dequantize().T, "q8_0"))
    r = as_stored(FFNWeights(up=up, down=down, gate=gate), "q4_1", dtype=torch.float64)
    assert r.up.dtype == torch.float64 and torch.equal(r.up, gguf_round(up, "q4_1"))
    assert torch.equal(r.down_t, gguf_round(down.T, "q4_1"))


def test_formats_stage_markdown():
    """bench/relufy_real.py --stage formats: the record's markdown, before the relufied model exists and after."""
    from bench.relufy_real import formats_md

    row = lambda p, v, b: {"perplexity": p, "ppl_vs_unrounded": v, "bytes_per_weight": b, "seconds": 1.0}  # noqa: E731
    model = {"model": "m.gguf", "dataset": "eval", "tokens": 511, "device": "cpu", "dtype": "torch.float32",
             "true_sparsity": 0.5, "rows": {"unrounded": row(10.0, 0.0, None), "q4_0": row(11.0, 0.1, 0.5625)}}
    rec = {"machine_kind": "cpu", "created": "2026-11-26T05:00:00",
           "figures": {"relufy": None, "models": {"original": model},
                       "commands": [{"command": "pi-eval --run r", "seconds": 2.0, "rc": 0}]}}
    md = formats_md(rec)
    assert "Relufied: not made" in md and "| q4_0 | 0.5625 | 11.000 | +10.00% | 1.0 |" in md
    assert "| unrounded | as read | 10.000 | +0.00% |" in md and "- `pi-eval --run r` (2.0 s, rc 0)" in md
    rec["figures"]["relufy"] = {"activation": "relu", "tokens": 2_000_000, "teacher_text": 0.0, "seconds": 90.0,
                                "perplexity_original": 28.0, "perplexity_relufied": 35.0, "perplexity_ratio": 1.25,
                                "ffn_sparsity": 0.66}
    assert "Relufied: relu, 2,000,000 tokens" in formats_md(rec)
