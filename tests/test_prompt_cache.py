"""generate(reuse=True) (runtime/generate._reusable): a prompt that starts with the tokens the decoder's cache still
holds from the last generate computes only the rest, with the tokens and logits of the whole prompt computed afresh;
anything else that wrote a cache since (another prompt's pass, a reset, a batch's slots) leaves nothing to reuse;
pi-serve --parallel 1 reuses a chat's history unless --no-prompt-cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hotneurons.runtime.engine import forward
from hotneurons.runtime.generate import RuntimeConfig, generate
from hotneurons.runtime.load import load_runtime, load_source_runtime
from test_runtime_moe import moe_gguf  # noqa: F401 (the fixture)

FIRST = [5, 17, 42, 9, 33, 101, 7, 64]


def _dense(folder, **kw):
    return load_runtime(None, RuntimeConfig(mode="dense", device="cpu", **kw), model=str(folder))


def _turns(rt, fresh):
    """A first generate, then a prompt that extends it (its tokens, 6 of its 8 generated ones, a new turn): the
    second's reuse against the same prompt on `fresh`, a runtime that never saw the first."""
    a = generate(rt, FIRST, 8, stop_at_eos=False, reuse=True)
    assert a.stats["prompt_tokens_reused"] == 0
    second = FIRST + a.token_ids[:6] + [3, 250, 12]
    b = generate(rt, second, 8, stop_at_eos=False, keep_logits=True, reuse=True)
    ref = generate(fresh, second, 8, stop_at_eos=False, keep_logits=True)
    assert b.stats["prompt_tokens_reused"] == len(FIRST) + 6  # the rest differs from what the cache holds
    assert b.token_ids == ref.token_ids
    for x, y in zip(b.logits, ref.logits):  # float32: two passes over the prompt against one
        torch.testing.assert_close(x, y, rtol=0, atol=1e-4)
    return second


@pytest.mark.parametrize("step_prefill", [0, 64])
def test_a_chat_turn_reuses_the_cached_history(tiny_model_dir, step_prefill):
    folder = tiny_model_dir("llama-reglu")
    rt = _dense(folder, step_prefill=step_prefill)
    second = _turns(rt, _dense(folder))
    again = generate(rt, second, 4, stop_at_eos=False, reuse=True)  # the same prompt: all but its last token
    assert again.stats["prompt_tokens_reused"] == len(second) - 1
    assert generate(rt, second, 4, stop_at_eos=False).stats["prompt_tokens_reused"] == 0  # not asked


def test_a_mixture_of_experts_reuses_too(moe_gguf):  # noqa: F811 (the imported fixture)
    path, _, _ = moe_gguf("qwen3-moe")

    def rt():
        return load_source_runtime(None, None, RuntimeConfig(device="cpu"), model=str(path),
                                   placement=np.random.default_rng(5).random((2, 4)) < 0.5)
    _turns(rt(), rt())


def test_another_write_leaves_nothing_to_reuse(tiny_model_dir):
    rt = _dense(tiny_model_dir("llama-reglu"))
    generate(rt, FIRST, 4, stop_at_eos=False)
    forward(rt, [1, 2, 3], 0)  # another prompt's pass over the same positions
    assert generate(rt, FIRST + [9], 4, stop_at_eos=False, reuse=True).stats["prompt_tokens_reused"] == 0
    generate(rt, FIRST, 4, stop_at_eos=False)
    rt.lm.decoder.reset()
    assert generate(rt, FIRST + [9], 4, stop_at_eos=False, reuse=True).stats["prompt_tokens_reused"] == 0
    generate(rt, FIRST, 4, stop_at_eos=False)
    rt.lm.decoder.add_slots(2)
    with rt.lm.decoder.slot(1):  # a batch's sequence in another slot moves the version too
        forward(rt, [1, 2, 3], 0)
    assert generate(rt, FIRST + [9], 4, stop_at_eos=False, reuse=True).stats["prompt_tokens_reused"] == 0


def test_serve_reuses_a_chat_history_unless_told(tiny_model_dir):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from hotneurons.server.serve import ServeConfig, Server

    folder = tiny_model_dir("llama-reglu")
    fresh = _dense(folder)
    for cache in (True, False):
        seen = []

        def spy(*args, **kw):
            g = generate(*args, **kw)
            seen.append(g.stats["prompt_tokens_reused"])
            return g

        with Server(_dense(folder), ServeConfig(port=0, prompt_cache=cache), spy) as s:
            c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=20)
            first = c.completions.create(model="any", prompt="The quick brown fox", max_tokens=6, temperature=0)
            prompt = "The quick brown fox" + first.choices[0].text + " and then"
            got = c.completions.create(model="any", prompt=prompt, max_tokens=6, temperature=0).choices[0].text
        from hotneurons.runtime.generate import prompt_ids

        assert got == generate(fresh, prompt_ids(fresh, prompt), 6).text
        assert seen[0] == 0 and (seen[1] > 0) == cache
