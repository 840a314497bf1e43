"""The in-place engine on CUDA: hot rows in Q4_0/Q8_0 blocks through qlinear's Triton GEMV, cold rows in blocks on the
CPU, equal to HF's float model on weights the blocks hold exactly (test_engine.py's EXACT); the device's bytes as
counted equal what CUDA allocated."""

import copy

import numpy as np
import pytest
import torch
from test_engine import LOGIT_ATOL, NEW, PROMPT, exact_folder, hf_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype, atol", [("float32", 10 * LOGIT_ATOL), ("float16", 0.05)])
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("family", ["llama-reglu", "opt"])
def test_block_rows_on_cuda_equal_hf(family, fmt, dtype, atol, tiny_model_dir, tmp_path):
    from hotneurons.runtime.engine import load_source_runtime
    from hotneurons.runtime.generate import RuntimeConfig, generate
    from hotneurons.runtime.placement import Placement

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
