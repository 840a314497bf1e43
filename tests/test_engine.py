"""The in-place engine (runtime/engine.py): a model read from its safetensors or GGUF file into our decoder and
hybrid FFNs, with no transformers model, gives HF `generate`'s greedy tokens; its layout's formats and memory
checks.

As in test_runtime.py, HF's reference model has its FFN weights rounded to what the cold rows store, so that both
compute with identical weights; logits then agree within LOGIT_ATOL.
"""

import copy

import numpy as np
import pytest
import tiny
import torch
from hotneurons.artifacts.placement import Placement
from hotneurons.common.memory import MemoryPlanError
from hotneurons.runtime.generate import RuntimeConfig, generate
from hotneurons.runtime.load import load_runtime

LOGIT_ATOL = 1e-4
NEW = 10
PROMPT = "The quick brown fox"


def hf_greedy(lm, ids, n=NEW):
    out = lm.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, output_logits=True,
                            return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), [lg[0] for lg in out.logits]


def run_engine(folder, cfg, placement=None):
    if placement is not None:  # a placement without a run directory: the engine's own entry
        from hotneurons.runtime.load import load_source_runtime

        return load_source_runtime(None, None, cfg, model=str(folder), placement=placement)
    return load_runtime(None, cfg, model=str(folder))


def rounded_folder(family, folder, tmp_path):
    """The tiny model with its FFN weights rounded to bf16, saved again: the file the engine reads then holds what
    its bf16 cold rows store, and HF's reference computes with the same weights."""
    lm = tiny.load_rounded(folder, family)
    out = tmp_path / f"{family}-rounded"
    lm.model.save_pretrained(out)
    lm.tokenizer.save_pretrained(out)
    return lm, out


def check(family, folder, cfg, tmp_path, placement=None, atol=LOGIT_ATOL):
    lm, folder = rounded_folder(family, folder, tmp_path)
    if callable(placement):
        placement = placement(lm.info["n_layers"], lm.info["n_neurons"])
    ids = list(lm.tokenizer(PROMPT)["input_ids"])
    want, want_logits = hf_greedy(copy.deepcopy(lm), ids)
    rt = run_engine(folder, cfg, placement)
    assert type(rt.lm).__name__ == "SourceModel"  # no transformers model object
    g = generate(rt, ids, NEW, keep_logits=True)
    assert g.token_ids == want
    diff = max(float((a - b).abs().max()) for a, b in zip(g.logits, want_logits))
    assert diff < atol, diff
    return rt, g


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_dense_equals_hf(family, tiny_model_dir, tmp_path):
    cfg = RuntimeConfig(mode="dense", device="cpu", cold_dtype="bf16", gpu_dtype="f32")
    if family == "mistral-drelu":
        pytest.skip("dReLU is read from a run's meta (activation), not from a config: covered by the oracle test")
    check(family, tiny_model_dir(family), cfg, tmp_path)


@pytest.mark.parametrize("family", ["opt", "llama-reglu", "falcon-relu"])
def test_oracle_mixed_placement_equals_hf(family, tiny_model_dir, tmp_path):
    folder = tiny_model_dir(family)
    rng = np.random.default_rng(0)

    def placement(L, n):
        return Placement(tuple(rng.random(n) < 0.5 for _ in range(L)))
    rt, g = check(family, folder, RuntimeConfig(oracle=True, device="cpu", cold_dtype="bf16", gpu_dtype="f32"),
                  tmp_path, placement)
    assert 0 < g.stats["ffn_sparsity"] < 1 and rt.bytes_cpu > 0


def test_host_memory_check_refuses(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HOTNEURONS_HOST_MEMORY", "1MB")
    with pytest.raises(MemoryPlanError, match="host memory but 0.00 GB is available"):
        load_runtime(None, RuntimeConfig(mode="dense", device="cpu"), model=str(tiny_model_dir("llama-reglu")))


# Weights that Q4_0 / Q4_1 / Q8_0 blocks hold exactly however they are grouped: Q4_0 stores s * (q - 8) with the
# block's largest-magnitude value at q = 0, so values in {-8, 0, 4} * s come back exact whether a block holds a -8
# (scale s) or not (scale -s / 2); Q8_0 stores amax / 127 * q, so values in {-127, 0, 127} * s do; Q4_1 stores
# min + (max - min) / 15 * q, so values in {-30, 0, 15} * s do (scales 3 s, 2 s, s for the pairs, each value a whole
# number of scales from the min, and a lone value as the min). Down rows are re-quantized along another axis than the
# file's, and hot columns are regrouped: both stay exact, so the engine must equal HF's float model on these weights
# up to float32 sums.
EXACT = {"q4_0": (-8.0, 0.0, 4.0), "q8_0": (-127.0, 0.0, 127.0), "q4_1": (-30.0, 0.0, 15.0)}
EXACT_SCALE = {"q4_0": 2.0 ** -5, "q8_0": 2.0 ** -9, "q4_1": 2.0 ** -7}


def exact_folder(family, folder, tmp_path, fmt):
    from hotneurons.models.family import load_model

    lm = load_model(str(folder), device="cpu", dtype="float32")
    gen = torch.Generator().manual_seed(1)
    levels = torch.tensor(EXACT[fmt]) * EXACT_SCALE[fmt]
    with torch.no_grad():
        for layer in lm.layers:
            for m in lm.adapter.layer_ffn(layer).values():
                m.weight.copy_(levels[torch.randint(0, 3, m.weight.shape, generator=gen)])
    out = tmp_path / f"{family}-{fmt}"
    lm.model.save_pretrained(out)
    lm.tokenizer.save_pretrained(out)
    return lm, out


def test_exact_levels_survive_every_block_format():
    """EXACT's premise, for every grouping a block can see: any 32 of a format's levels quantize (weights.quants, the
    bytes gguf-py writes) and de-quantize back to themselves."""
    from hotneurons.weights.quants import dequantize, quantize

    gen = torch.Generator().manual_seed(0)
    for fmt, levels in EXACT.items():
        lv = torch.tensor(levels) * EXACT_SCALE[fmt]
        picks = [torch.randint(0, 3, (64, 32), generator=gen)] + [  # any mix, then every pair and lone value
            torch.tensor([a, b] * 16).expand(4, 32) for a in range(3) for b in range(3)]
        w = lv[torch.cat(picks)]  # (rows, 32)
        assert torch.equal(dequantize(quantize(w, fmt), fmt, 32), w), fmt


def test_auto_keeps_the_formats_the_kernels_read():
    """`auto` for each stored FFN format: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K kept on both sides; the others to
    their nearest format a kernel reads (weights/formats.py), with the warning where 4- to 6-bit rows become q4_0 (a
    Q4_1 or Q4_K file's names `auto` as the way to keep them, a Q5_0 file's its conversion to q8_0)."""
    import warnings
    from types import SimpleNamespace

    from hotneurons.runtime.engine import auto_format, requantized
    from hotneurons.weights.formats import WeightFormat as F

    want = {F.Q4_0: "q4_0", F.Q4_1: "q4_1", F.Q8_0: "q8_0", F.Q4_K: "q4_k", F.Q5_K: "q5_k", F.Q6_K: "q6_k",
            F.Q5_0: "q8_0", F.Q5_1: "q8_0", F.Q2_K: "q4_0", F.Q3_K: "q4_0", F.IQ4_XS: "q8_0", F.IQ3_S: "q4_0"}
    for stored, fmt in want.items():
        assert auto_format(stored, "cpu", torch.float16) == fmt and auto_format(stored, "gpu", torch.float16) == fmt
        assert auto_format(stored, "gpu", torch.float32, device="cpu") == fmt
    q41 = SimpleNamespace(infos={"blk.0.ffn_up.weight": SimpleNamespace(fmt=F.Q4_1)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        requantized(q41, "q4_1", "q4_1")  # auto's choice: nothing re-quantized to q4_0, no warning
    with pytest.warns(UserWarning, match="re-quantized to q4_0.*--gpu-dtype auto reads them as stored"):
        requantized(q41, "q4_0", "q4_1")
    q4k = SimpleNamespace(infos={"blk.0.ffn_up.weight": SimpleNamespace(fmt=F.Q4_K)})
    with pytest.warns(UserWarning, match="re-quantized to q4_0.*--gpu-dtype auto reads them as stored"):
        requantized(q4k, "q4_0", "q4_0")
    q50 = SimpleNamespace(infos={"blk.0.ffn_up.weight": SimpleNamespace(fmt=F.Q5_0)})
    with pytest.warns(UserWarning, match="re-quantized to q4_0.*--gpu-dtype auto converts them to q8_0 instead"):
        requantized(q50, "q4_0", "q4_0")
    q3k = SimpleNamespace(infos={"blk.0.ffn_up.weight": SimpleNamespace(fmt=F.Q3_K)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        requantized(q3k, "q4_0", "q4_0")  # q4_0 is no coarser than Q3_K's grid: nothing to warn of


@pytest.mark.parametrize("mask", ["oracle", "predictor"])
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("family", ["llama-reglu", "opt"])
def test_block_rows_on_both_sides_equal_hf(family, fmt, mask, tiny_model_dir, tmp_path):
    """Cold rows and hot rows in blocks, mixed placement, predictor masks that mark every neuron (so the result is the
    dense one): the Numba block kernels on the cold side, qlinear on the hot side."""
    lm, folder = exact_folder(family, tiny_model_dir(family), tmp_path, fmt)
    ids = list(lm.tokenizer(PROMPT)["input_ids"])
    want, want_logits = hf_greedy(copy.deepcopy(lm), ids)
    run = tmp_path / "run"
    run.mkdir()
    from hotneurons.models.open import open_model
    from hotneurons.runtime.load import load_source_runtime

    if mask == "predictor":  # every neuron marked: the predictor path (cold_layer_q) with the dense result
        source, sid, mcfg, act = open_model(str(folder))
        from hotneurons.models.open import model_info

        tiny.write_predictors(run, model_info(source, sid, act, lm.adapter.name, lm.adapter.gated), -1e30)
    rt = load_source_runtime(run, None, RuntimeConfig(device="cpu", cold_dtype=fmt, gpu_dtype=fmt,
                                                      oracle=mask == "oracle"),
                             model=str(folder), placement=Placement(tuple(
                                 np.random.default_rng(i).random(lm.info["n_neurons"]) < 0.3
                                 for i in range(lm.info["n_layers"]))))
    assert {f.cold.fmt for f in rt.ffns} == {fmt} and all(f.hot_q is not None for f in rt.ffns)
    g = generate(rt, ids, NEW, keep_logits=True)
    assert g.token_ids == want
    assert max(float((a - b).abs().max()) for a, b in zip(g.logits, want_logits)) < LOGIT_ATOL


def test_q4_0_gguf_read_in_place_equals_hf(tmp_path):
    """A Q4_0 GGUF in llama.cpp's conventions (Q/K rows permuted, ReGLU recorded): every neuron on the device side in
    float32 gives the greedy tokens of transformers' own GGUF load (de-quantized whole); cold rows kept in the file's
    Q4_0 blocks (gate/up copied byte for byte) run too."""
    from hotneurons.models.family import load_model

    from bench.memory_models import SHAPES, write_gguf_q4

    path = write_gguf_q4(SHAPES["small"], tmp_path / "m.gguf")
    lm = load_model(str(path), device="cpu", dtype="float32", cache=False)
    assert lm.activation == "reglu"
    ids = list(lm.tokenizer(PROMPT)["input_ids"])
    want, want_logits = hf_greedy(lm, ids)
    rt = load_runtime(None, RuntimeConfig(mode="dense", device="cpu", gpu_dtype="f32"), model=str(path))
    g = generate(rt, ids, NEW, keep_logits=True)
    assert g.token_ids == want
    assert max(float((a - b).abs().max()) for a, b in zip(g.logits, want_logits)) < LOGIT_ATOL
    from hotneurons.runtime.load import load_source_runtime

    n, L = lm.info["n_neurons"], lm.info["n_layers"]
    rt = load_source_runtime(None, None, RuntimeConfig(device="cpu", oracle=True), model=str(path),
                             placement=Placement(tuple(np.arange(n) < n // 4 for _ in range(L))))
    assert rt.cfg.cold_dtype == "q4_0" and rt.cfg.gpu_dtype == "q4_0"  # auto: the file's format, on both sides
    assert all(f.cold.fmt == "q4_0" for f in rt.ffns)
    g = generate(rt, ids, NEW)
    assert len(g.token_ids) == NEW and 0 < g.stats["ffn_sparsity"] < 1


def test_powerinfer_file_runs_as_model_predictors_and_split(tmp_path):
    """PowerInfer's own file (PWRI: F16 weights, ffn_down_t, predictors, a .generated.gpuidx split) loads with no run
    directory as model + predictors (its threshold, the powerinfer input form) + placement. Written with a threshold
    every logit passes and a split of every neuron on the device, the result is the dense model's: HF's greedy tokens
    on the same (fp16-rounded) weights."""
    from hotneurons.export import roundtrip
    from hotneurons.export.gguf_model import hf_state, vocab_from_tokenizer
    from hotneurons.export.powerinfer import write_powerinfer
    from hotneurons.models.family import load_model

    folder = roundtrip.build_model(tmp_path / "model", hidden_size=32, intermediate_size=1024, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    lm = load_model(str(folder), device="cpu", dtype="float32")
    with torch.no_grad():  # the file stores 2-D weights in fp16: the reference computes with the same values
        for p in lm.model.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())
    g = torch.Generator().manual_seed(0)
    preds = [(torch.randn(8, 32, generator=g).half().float(), torch.randn(1024, 8, generator=g).half().float())
             for _ in range(2)]
    every = [np.ones(1024, dtype=bool) for _ in range(2)]
    summary = write_powerinfer(hf_state(lm.model), vocab_from_tokenizer(lm.tokenizer, lm.model.config.vocab_size),
                               preds, -1e30, [np.arange(1024)] * 2, every, 1 << 20, tmp_path / "out",
                               config=lm.model.config)
    path = tmp_path / "out" / summary["files"]["model"]
    ids = list(lm.tokenizer(PROMPT)["input_ids"])
    want, _ = hf_greedy(lm, ids)
    rt = load_runtime(None, RuntimeConfig(device="cpu", gpu_dtype="f32"), model=str(path))
    assert rt.mode == "hybrid" and all(f.prenorm and f.n_cold == 0 for f in rt.ffns)
    g = generate(rt, ids, NEW)
    assert g.token_ids == want and g.stats["ffn_sparsity"] == 0.0


def test_hybrid_from_a_model_file_alone_asks_for_predictors(tmp_path):
    """`pi-generate --model FILE.gguf` in the default hybrid mode has no predictors to read: one line naming the fix
    (it was a TypeError from a None run directory)."""
    from hotneurons.common.artifacts import ArtifactError

    from bench.memory_models import SHAPES, write_gguf_q4

    path = write_gguf_q4(SHAPES["small"], tmp_path / "m.gguf")
    with pytest.raises(ArtifactError, match="hybrid mode needs predictors: pass --run RUN"):
        load_runtime(None, RuntimeConfig(device="cpu"), model=str(path))
