"""The in-place engine on CUDA: hot rows in Q4_0/Q4_1/Q8_0 blocks through qlinear's Triton GEMV, cold rows in blocks
on the CPU, equal to HF's float model on weights the blocks hold exactly (test_engine.py's EXACT); the device's bytes
as counted equal what CUDA allocated."""

import copy

import numpy as np
import pytest
import torch
from test_engine import LOGIT_ATOL, NEW, PROMPT, exact_folder, hf_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype, atol", [("float32", 10 * LOGIT_ATOL), ("float16", 0.05)])
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("family", ["llama-reglu", "opt"])
def test_block_rows_on_cuda_equal_hf(family, fmt, dtype, atol, tiny_model_dir, tmp_path):
    from hotneurons.artifacts.placement import Placement
    from hotneurons.runtime.generate import RuntimeConfig, generate
    from hotneurons.runtime.load import load_source_runtime

    lm, folder = exact_folder(family, tiny_model_dir(family), tmp_path, fmt)
    ids = list(lm.tokenizer(PROMPT)["input_ids"])
    want, want_logits = hf_greedy(copy.deepcopy(lm), ids)
    placement = Placement(tuple(np.random.default_rng(i).random(lm.info["n_neurons"]) < 0.3
                                for i in range(lm.info["n_layers"])))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    rt = load_source_runtime(None, None, RuntimeConfig(device="cuda", dtype=dtype, cold_dtype=fmt, gpu_dtype=fmt,
                                                       oracle=True), model=str(folder), placement=placement)
    held = torch.cuda.memory_allocated() - before
    assert held == pytest.approx(rt.bytes_gpu, rel=0.05, abs=64 << 10), (held, rt.bytes_gpu)
    g = generate(rt, ids, NEW, keep_logits=True)
    diff = max(float((a - b).abs().max()) for a, b in zip(g.logits, want_logits))
    assert diff < atol, diff
    if dtype == "float32":
        assert g.token_ids == want


@pytest.mark.parametrize("cold, hot", [("q4_0", "q4_0"), ("q4_1", "q4_1"), ("bf16", "f32")])
@pytest.mark.parametrize("family", ["llama-reglu", "opt", "gemma3-geglu"])
def test_graph_steps_equal_eager_steps(family, cold, hot, tiny_model_dir, tmp_path):
    """Decode steps replayed as CUDA graphs (runtime/source_steps.py, prelaunched where the driver can) against the
    same steps run eagerly, with random predictors (real sparsity: cold rows computed by the CPU between the graphs)
    and a mixed placement: the same tokens and logits. llama-reglu's untied embedding is looked up on the host and
    copied in by layer 0's graph; gemma3 has sliding-window layers and norms after attention and FFN. The graphs'
    default ops (Triton) give the same tokens."""
    import tiny
    from hotneurons.artifacts.placement import Placement
    from hotneurons.models.open import model_info, open_model
    from hotneurons.runtime.generate import RuntimeConfig, generate
    from hotneurons.runtime.load import load_source_runtime

    folder = tiny_model_dir(family)
    source, sid, mcfg, act = open_model(str(folder))
    from hotneurons.models.family import adapter_for

    ad = adapter_for(source.config)
    info = model_info(source, sid, act, ad.name, ad.gated)
    run = tmp_path / "run"
    run.mkdir()
    tiny.write_predictors(run, info, 0.0)
    placement = Placement(tuple(np.random.default_rng(i).random(info["n_neurons"]) < 0.3
                                for i in range(info["n_layers"])))
    ids = list(range(3, 12))
    runs = {}
    for name, graphs, ops in (("eager", False, "torch"), ("graphs", True, "torch"), ("triton", True, "auto")):
        rt = load_source_runtime(run, None, RuntimeConfig(device="cuda", dtype="float32", cold_dtype=cold,
                                                          gpu_dtype=hot, cuda_graphs=graphs, ops=ops),
                                 model=str(folder), placement=placement)
        runs[name] = generate(rt, ids, 8, keep_logits=True, stop_at_eos=False)
        assert (rt.fast._graphs is not None) == graphs
    assert runs["graphs"].token_ids == runs["eager"].token_ids == runs["triton"].token_ids
    diff = max(float((a - b).abs().max()) for a, b in zip(runs["graphs"].logits, runs["eager"].logits))
    assert diff < 1e-4, diff
    assert 0 < runs["graphs"].stats["ffn_sparsity"] < 1
