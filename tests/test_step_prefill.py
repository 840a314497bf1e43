"""RuntimeConfig.step_prefill (runtime/generate.step_prefill): a short prompt fed through the decode step a token at a
time gives the tokens of one prefill pass where both compute the same neurons (a mixture of experts, routed exactly
either way; dense mode), leaves decode's counts to the generated tokens, and is on by default only for a mixture of
experts on CUDA graphs (whose eager pass costs ~0.2 s at any length)."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch
from hotneurons.runtime.generate import STEP_PREFILL_MOE, RuntimeConfig, generate, step_prefill
from hotneurons.runtime.load import load_runtime, load_source_runtime
from test_runtime_moe import moe_gguf  # noqa: F401 (the fixture)

PROMPT = [5, 17, 42, 9, 33, 101, 7, 64]


def _moe(path, n):
    return load_source_runtime(None, None, RuntimeConfig(device="cpu", step_prefill=n), model=str(path),
                               placement=np.random.default_rng(5).random((2, 4)) < 0.5)


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_moe_prompt_by_steps_equals_one_pass(moe_gguf, family):  # noqa: F811 (the imported fixture)
    path, _, _ = moe_gguf(family)
    one = generate(_moe(path, 0), PROMPT, 8, stop_at_eos=False, keep_logits=True)
    rt = _moe(path, len(PROMPT))
    steps = generate(rt, PROMPT, 8, stop_at_eos=False, keep_logits=True)
    assert not one.stats["prefill_by_steps"] and steps.stats["prefill_by_steps"]
    assert steps.token_ids == one.token_ids
    for a, b in zip(steps.logits, one.logits):  # float32 on the CPU: one product over 8 rows against 8 of one
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    # decode's counts are the generated tokens' only (the prompt's steps are not decode)
    assert int(rt.ffns[0].read_counts()[0]) == steps.stats["decode_steps"]
    longer = generate(rt, PROMPT + [3], 2, stop_at_eos=False)  # one token past the limit: one pass
    assert not longer.stats["prefill_by_steps"]


def test_dense_prompt_by_steps_equals_one_pass(tiny_model_dir):
    folder = tiny_model_dir("llama-reglu")
    rts = [load_runtime(None, RuntimeConfig(mode="dense", device="cpu", step_prefill=n), model=str(folder))
           for n in (0, 64)]
    a, b = (generate(rt, PROMPT, 10, stop_at_eos=False) for rt in rts)
    assert b.stats["prefill_by_steps"] and a.token_ids == b.token_ids


def test_the_default_is_on_for_a_mixture_of_experts_on_graphs_only(moe_gguf):  # noqa: F811
    path, _, _ = moe_gguf("qwen3-moe")
    rt = _moe(path, None)
    assert step_prefill(rt) == 0  # the CPU: no graphs
    graphs = dataclasses.replace(rt, fast=types.SimpleNamespace(graphs=True))
    assert step_prefill(graphs) == STEP_PREFILL_MOE
    assert step_prefill(dataclasses.replace(graphs, ffns=[])) == 0  # not a mixture of experts
    assert step_prefill(dataclasses.replace(graphs, cfg=RuntimeConfig(step_prefill=3))) == 3  # the flag wins


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_moe_on_cuda_graphs_steps_a_short_prompt_by_default(moe_gguf, family):  # noqa: F811
    """On CUDA (float32 compute, the decode step's graphs): the default feeds a short prompt through the step, with
    the tokens and, to rounding, the logits of one pass."""
    path, _, _ = moe_gguf(family)

    def rt(n):
        return load_source_runtime(None, None, RuntimeConfig(device="cuda", dtype="float32", step_prefill=n),
                                   model=str(path), placement=np.random.default_rng(5).random((2, 4)) < 0.5)
    steps = generate(rt(None), PROMPT, 8, stop_at_eos=False, keep_logits=True)
    one = generate(rt(0), PROMPT, 8, stop_at_eos=False, keep_logits=True)
    assert steps.stats["prefill_by_steps"] and not one.stats["prefill_by_steps"]
    assert steps.token_ids == one.token_ids
    for a, b in zip(steps.logits, one.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-3)
