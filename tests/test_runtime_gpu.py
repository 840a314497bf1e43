"""pi-generate with real CUDA placement: greedy tokens equal HF `generate` (skipped without a GPU).

Same checks as tests/test_runtime.py, test_static_decoder.py and test_balance.py, with the hot part on CUDA (float32,
TF32 off) and the cold part by the Numba kernels, so x, the mask and the CPU partial sum cross PCIe through the pinned
buffers and side stream.
"""

import copy
import gc
import warnings

import pytest
import tiny
import torch
from hotneurons.runtime.generate import RuntimeConfig, generate
from hotneurons.runtime.load import build_runtime
from test_runtime import (
    NEW,
    PROMPT,
    RELU,
    always_on_predictors,
    check_equal,
    exact_predictors,
    make_placement,
)
from test_static_decoder import check_norm_and_softmax

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA_ATOL = 1e-3  # float32 GEMVs on the GPU sum in another order than the CPU reference


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("family", RELU)
@pytest.mark.parametrize("where", ["gpu", "cpu", "mixed"])
def test_cuda_oracle_equals_hf(family, where, tiny_model_dir):
    lm = tiny.load_rounded(tiny_model_dir(family), family)
    g = check_equal(lm, RuntimeConfig(oracle=True, device="cuda", dtype="float32"), make_placement(lm, where),
                    atol=CUDA_ATOL)
    assert g.stats["device"].startswith("cuda") and g.stats["mode"] == "oracle"


@pytest.mark.parametrize("family", ["llama-swiglu", "gemma-geglu"])
def test_cuda_dense_equals_hf(family, tiny_model_dir):
    lm = tiny.load_rounded(tiny_model_dir(family), family)
    check_equal(lm, RuntimeConfig(mode="dense", device="cuda", dtype="float32"), make_placement(lm, "mixed"),
                atol=CUDA_ATOL)


def test_cuda_predictor_path_equals_hf(tiny_model_dir):
    """The predictor runs on the GPU and its cold mask crosses to the host: a predictor firing everywhere is dense."""
    lm = tiny.load_rounded(tiny_model_dir("llama-reglu"), "llama-reglu")
    check_equal(lm, RuntimeConfig(device="cuda", dtype="float32"), make_placement(lm, "mixed"),
                always_on_predictors(lm, -1e30), atol=CUDA_ATOL)


def test_cuda_layer_split_equals_hf(tiny_model_dir):
    lm = tiny.load_rounded(tiny_model_dir("opt"), "opt")
    check_equal(lm, RuntimeConfig(mode="layer-split", device="cuda", dtype="float32", gpu_layers=1), atol=CUDA_ATOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_static_decoder_norm_and_softmax_round_as_hf(dtype):
    """The CUDA fused rms_norm may sum in another order than HF's mean: equal within the dtype's tolerance."""
    check_norm_and_softmax(dtype, "cuda", exact_norm=False)


@pytest.mark.parametrize("family", ["llama-reglu", "qwen2-swiglu", "qwen3-swiglu"])
def test_cuda_static_decoder_graphs_equal_hf(family, tiny_model_dir):
    """runtime/static_decoder.py with CUDA graphs, each launched before the previous layer's cold part and held by a
    host flag: the tokens and logits of HF generate."""
    lm = tiny.load_rounded(tiny_model_dir(family), family)
    preds = always_on_predictors(lm, -1e30) if family == "llama-reglu" else None
    cfg = RuntimeConfig(device="cuda", dtype="float32", mode="hybrid" if preds else "dense")
    g = check_equal(lm, cfg, make_placement(lm, "mixed"), preds, atol=CUDA_ATOL)
    assert g.stats["decode_steps"] > 0 and g.stats["graph_prelaunch"]


@pytest.mark.parametrize("ops", ["triton", "torch", "compile"])
@pytest.mark.parametrize("family", ["llama-reglu", "qwen3-swiglu"])
def test_cuda_pre_ops_equal_hf(family, ops, tiny_model_dir):
    """RuntimeConfig.ops: the step's norms, residual, RoPE, attention, GEMVs and predictor as kernels/fused.py's Triton
    kernels, torch's kernels or through torch.compile, captured in the layers' graphs: the tokens and logits of HF
    generate (Qwen3: its per-head q/k norms too). LLaMA-ReGLU with exact predictors: the masks reach their neurons."""
    lm = tiny.load_rounded(tiny_model_dir(family), family)
    preds = exact_predictors(lm) if family == "llama-reglu" else None
    cfg = RuntimeConfig(device="cuda", dtype="float32", mode="hybrid" if preds else "dense", ops=ops)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".* ops failed")  # no quiet fallback to the torch ops
        g = check_equal(lm, cfg, make_placement(lm, "mixed"), preds, atol=CUDA_ATOL)
    assert g.stats["decode_steps"] > 0 and g.stats["graph_prelaunch"] and g.stats["ops"] == ops
    assert (0.3 < g.stats["ffn_sparsity"] < 0.7) if preds else g.stats["ffn_sparsity"] == 0.0


def test_cuda_no_garbage_collection_while_a_graph_waits_for_the_host(tiny_model_dir):
    """A collection inside a cold part could run the finalizer that unregisters another runtime's page-locked rows
    (cold_rows.host_mapped); cudaHostUnregister waits for the device, which waits for the flag this thread sets after
    the cold part: a deadlock (seen in this suite). So automatic collection is off during each step's cold parts."""
    lm = tiny.load_rounded(tiny_model_dir("llama-reglu"), "llama-reglu")
    rt = build_runtime(lm, RuntimeConfig(device="cuda", dtype="float32"), make_placement(lm, "mixed"),
                       always_on_predictors(lm, -1e30))
    seen = []
    for f in rt.ffns:
        real = f.cold_rows
        f.cold_rows = lambda *a, _real=real: (seen.append(gc.isenabled()), _real(*a))[1]
    g = generate(rt, list(lm.tokenizer(PROMPT)["input_ids"]), NEW)
    assert g.stats["graph_prelaunch"] and len(seen) >= len(rt.ffns) * (NEW - 1)
    assert not any(seen) and gc.isenabled()


def test_cuda_prelaunched_graphs_equal_launch_after_cold_and_survive_an_error(tiny_model_dir):
    """The same steps with and without prelaunch give the same tokens and logits (up to the last float32 bits, which
    the cold kernel's dynamic work sharing moves); an error in a cold part while the next graph waits on the GPU for
    its flag leaves the stream free, and decoding goes on correctly. The two runtimes share one Predictors: building
    the second must not move the first's predictor weights from under its graphs."""
    lm = tiny.load_rounded(tiny_model_dir("llama-reglu"), "llama-reglu")
    ids = list(lm.tokenizer(PROMPT)["input_ids"])
    preds, placement = always_on_predictors(lm, -1e30), make_placement(lm, "mixed")
    runs = {}
    for prelaunch in (True, False):
        cfg = RuntimeConfig(device="cuda", dtype="float32", prelaunch=prelaunch)
        rt = build_runtime(copy.deepcopy(lm), cfg, placement, preds)
        runs[prelaunch] = (rt, generate(rt, ids, NEW, keep_logits=True))
        assert runs[prelaunch][1].stats["graph_prelaunch"] == prelaunch
    a, b = runs[True][1], runs[False][1]
    assert a.token_ids == b.token_ids
    assert max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits)) < 1e-5

    rt = runs[True][0]
    f = rt.ffns[0]
    real = f.cold_rows

    def broken(x, *flags_and_layer):
        raise KeyboardInterrupt("stopped in a cold part")

    f.cold_rows = broken
    with pytest.raises(KeyboardInterrupt):
        generate(rt, ids, NEW)
    assert gc.isenabled()  # the step turned automatic collection off, and on again on its way out
    f.cold_rows = real
    torch.cuda.synchronize()  # would hang if the graph launched before the error still waited for its flag
    c = generate(rt, ids, NEW, keep_logits=True)
    assert c.token_ids == a.token_ids
    assert max(float((x - y).abs().max()) for x, y in zip(c.logits, a.logits)) < CUDA_ATOL


def test_cuda_int8_cold_rows_equal_hf_on_the_weights_they_stand_for(tiny_model_dir):
    """int8 cold rows with the static decoder's graphs and the predictor path on CUDA."""
    lm = tiny.load_rounded(tiny_model_dir("llama-reglu"), "llama-reglu")
    tiny.round_ffns_to_int8(lm)
    cfg = RuntimeConfig(device="cuda", dtype="float32", cold_dtype="int8")
    g = check_equal(lm, cfg, make_placement(lm, "mixed"), always_on_predictors(lm, -1e30), atol=CUDA_ATOL)
    assert g.stats["cold_dtype"] == "int8" and g.stats["decode_steps"] > 0


@pytest.mark.parametrize("family,mode,int8", [("llama-reglu", "hybrid", False), ("qwen2-swiglu", "dense", False),
                                             ("llama-reglu", "hybrid", True)])
def test_cuda_cold_rows_read_over_pcie_equal_hf(family, mode, int8, tiny_model_dir, monkeypatch):
    """After the calibration tokens the GPU computes the first marked cold neurons of each token from page-locked,
    mapped host rows (graphs captured again with that shape), the CPU the rest: HF's tokens and logits. The share is
    measured (pcie_share None), then moved by two timed balancing rounds, each with graphs captured again."""
    import hotneurons.runtime.balance as B

    monkeypatch.setattr(B, "CALIBRATION_TOKENS", 4)
    monkeypatch.setattr(B, "BALANCE_ROUNDS", 2)
    monkeypatch.setattr(B, "BALANCE_TOKENS", 2)
    lm = tiny.load_rounded(tiny_model_dir(family), family)
    if int8:
        tiny.round_ffns_to_int8(lm)
    cfg = RuntimeConfig(device="cuda", dtype="float32", mode=mode, cold_dtype="int8" if int8 else "bf16")
    preds = always_on_predictors(lm, -1e30) if mode == "hybrid" else None
    g = check_equal(lm, cfg, make_placement(lm, "cpu" if mode == "dense" else "mixed"), preds, atol=CUDA_ATOL)
    rounds = g.stats["pcie_balance"]
    assert len(rounds) == 2 and 0 < rounds[0]["share"] < 1 and rounds[0]["cold_ms"] > 0
    assert 0 <= g.stats["pcie_share"] <= 0.95 and g.stats["graph_prelaunch"]


def test_cuda_share_rechecks_equal_hf(tiny_model_dir, monkeypatch):
    """Re-checks of the balanced share on CUDA (one step after each series, each starting a new series: graphs
    captured again after a re-check's host clock): HF's tokens and logits."""
    import hotneurons.runtime.balance as B

    for name, v in (("CALIBRATION_TOKENS", 1), ("BALANCE_ROUNDS", 1), ("BALANCE_TOKENS", 1), ("RECHECK_TOKENS", 1),
                    ("RECHECK_GAIN", 0.0)):
        monkeypatch.setattr(B, name, v)
    lm = tiny.load_rounded(tiny_model_dir("llama-reglu"), "llama-reglu")
    cfg = RuntimeConfig(device="cuda", dtype="float32")
    g = check_equal(lm, cfg, make_placement(lm, "mixed"), always_on_predictors(lm, -1e30), atol=CUDA_ATOL)
    rounds = g.stats["pcie_balance"]
    first = next(i for i, r in enumerate(rounds) if r.get("recheck"))
    assert len(rounds) > first + 1 and not rounds[first + 1].get("recheck")  # the new series' round came after it
    assert g.stats["graph_prelaunch"]
