"""pi-serve with continuous batching (--parallel N, server/batcher.py): concurrent requests decoded together give
each its solo output (greedy, streamed or not, stop strings), /health shows the slots, clients that leave and time
limits free their slots, and a short run of bench/serve_stress.py's load (8 clients, random cancellations) loses
or corrupts nothing."""

from __future__ import annotations

import threading
import time

import pytest
from hotneurons.runtime.generate import generate, prompt_ids
from test_serve import FAMILY, client, health, load, running

openai = pytest.importorskip("openai")

PROMPTS = ["The quick brown fox", "Once upon a time", "1 2 3 4", "Hello"]


@pytest.fixture(scope="module")
def solo(tiny_model_dir):
    """Each prompt's greedy text alone, at 6 and 20 tokens."""
    rt = load(tiny_model_dir(FAMILY))
    return {(q, n): generate(rt, prompt_ids(rt, q), n).text for q in PROMPTS for n in (6, 20)}


def _together(s, jobs: list[tuple[str, int, bool]]) -> list[str]:
    """The jobs (prompt, max_tokens, stream) sent at once; their texts."""
    out: list = [None] * len(jobs)

    def one(k: int) -> None:
        q, n, stream = jobs[k]
        c = client(s)
        if stream:
            out[k] = "".join(ch.choices[0].text for ch in c.completions.create(
                model="any", prompt=q, max_tokens=n, temperature=0, stream=True) if ch.choices)
        else:
            out[k] = c.completions.create(model="any", prompt=q, max_tokens=n, temperature=0).choices[0].text

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("step", ["auto", "interleaved"])
def test_concurrent_requests_equal_their_solo_runs(tiny_model_dir, solo, step):
    """8 jobs, 3 at a time: each its solo text, batched (auto on a CPU) or interleaved (the batch-1 step in turn)."""
    with running(tiny_model_dir(FAMILY), parallel=3, max_queue=8, batch_step=step) as s:
        h = health(s)
        assert h["parallel"] == 3 and [x["state"] for x in h["slots"]] == ["free"] * 3
        assert h["batch_step"] == ("batched" if step == "auto" else step)
        jobs = [(q, n, k % 2 == 1) for k, (q, n) in enumerate((q, n) for n in (20, 6) for q in PROMPTS)]
        assert _together(s, jobs) == [solo[q, n] for q, n, _ in jobs]  # 8 jobs: 3 at a time, the rest queued
        h = health(s)
        assert (h["served"], h["running"], h["queued"]) == (8, 0, 0)
        assert [x["state"] for x in h["slots"]] == ["free"] * 3


def test_stop_strings_and_chat_in_a_batch(tiny_model_dir, solo):
    with running(tiny_model_dir(FAMILY), parallel=2) as s:
        full = solo["The quick brown fox", 20]
        cut = full[3:6]  # a stop string inside the text
        c = client(s)
        r = c.completions.create(model="any", prompt="The quick brown fox", max_tokens=20, temperature=0, stop=[cut])
        assert r.choices[0].text == full[:full.find(cut)] and r.choices[0].finish_reason == "stop"
        chat = c.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                         temperature=0)
        assert chat.choices[0].message.content is not None and chat.usage.completion_tokens <= 4


def test_a_batch_needs_our_decoder(tiny_model_dir):
    from hotneurons.runtime.generate import RuntimeConfig
    from hotneurons.runtime.load import load_runtime
    from hotneurons.server.serve import ServeConfig, Server

    rt = load_runtime(None, RuntimeConfig(mode="dense", device="cpu", static_decode=False), model=str(
        tiny_model_dir(FAMILY)))
    with pytest.raises(ValueError, match="--parallel 1"):
        Server(rt, ServeConfig(port=0, parallel=2))
    from hotneurons.runtime.batch import slots_allowed

    assert slots_allowed(rt) == 1  # pi-serve's default for it
    with pytest.raises(ValueError, match="--parallel 0"):
        ServeConfig(parallel=0)
    with pytest.raises(ValueError, match="--batch-step 'fast'"):
        ServeConfig(batch_step="fast")


def test_stress_loses_and_corrupts_nothing(tiny_model_dir, solo):
    """8 clients for 20 s, 30% leaving mid-stream: every completed response is its solo text, nothing fails, and the
    server's counts add up (bench/serve_stress.py runs the same for 10 minutes)."""
    from bench.serve_stress import stress

    cases = [({"prompt": q, "max_tokens": n, "temperature": 0}, solo[q, n]) for q in PROMPTS for n in (6, 20)]
    with running(tiny_model_dir(FAMILY), parallel=4, max_queue=16) as s:
        got = stress(s.port, cases, 20, clients=8, cancel=0.3)
        assert got["failed"] == 0 and got["wrong"] == 0, got
        assert got["completed"] > 10 and got["cancelled"] > 0, got
        end = time.monotonic() + 20  # a request whose client just left ends at the server's next token
        while (h := health(s))["running"] or h["queued"]:
            assert time.monotonic() < end, h
            time.sleep(0.05)
        assert h["errors"] == 0
        assert h["served"] >= got["completed"] and h["served"] + h["dropped"] == got["completed"] + got["cancelled"]


def test_serve_bench_client_side(tiny_model_dir):
    """bench/serve_bench.py's clients and summary against a --parallel 2 server: every request answered, TTFT and
    inter-token latencies taken from the stream."""
    from bench.serve_bench import run_clients, summary

    with running(tiny_model_dir(FAMILY), parallel=2) as s:
        results, wall = run_clients(s.port, 3, 6, 5)
        plain, _ = run_clients(s.port, 2, 2, 5, endpoint="completions")  # no chat template needed
    row = summary("dense", 2, 3, results, [wall], [len(results)])
    assert row["ok"] == 6 and not row["errors"] and row["parallel"] == 2
    assert all(r["completion_tokens"] <= 5 and len(r["itl_s"]) <= 4 for r in results)
    assert row["ttft_median_s"] > 0 and (row["itl_median_s"] is None or row["itl_median_s"] > 0)
    assert [r["status"] for r in plain] == [200, 200] and all(0 < r["completion_tokens"] <= 5 for r in plain)
    assert all(r["ttft_s"] is not None and r["ttft_s"] > 0 for r in plain)
    # conversations of 2 turns: the second resends the first and its answer
    with running(tiny_model_dir(FAMILY), parallel=2) as s:
        chats, wall = run_clients(s.port, 2, 2, 5, turns=2)
        texts, _ = run_clients(s.port, 1, 1, 5, endpoint="completions", turns=2)
    assert sorted(r["turn"] for r in chats) == [1, 1, 2, 2] and all(r["status"] == 200 for r in chats)
    first = next(r for r in texts if r["turn"] == 1)
    second = next(r for r in texts if r["turn"] == 2)
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"] - 1
    assert set(summary("dense", 2, 2, chats, [wall], [4])["ttft_median_s_by_turn"]) == {"1", "2"}


def test_slots_past_the_budget_are_refused(tiny_model_dir):
    """The other requests' KV cache slots must fit --vram beside what the load holds (checked where the device is
    a GPU: the runtime's device is set so here, nothing runs on it)."""
    import dataclasses
    import types

    import torch
    from hotneurons.runtime.batch import slot_bytes, slots_allowed
    from hotneurons.server.batcher import Batcher
    from hotneurons.server.config import ServeConfig

    rt = load(tiny_model_dir(FAMILY))
    need = slot_bytes(rt.lm.decoder) * 3
    rt.device = torch.device("cuda")
    rt.cfg = dataclasses.replace(rt.cfg, vram=rt.bytes_gpu + need - 1)
    with pytest.raises(ValueError, match="pi-solve --parallel 4"):
        Batcher(types.SimpleNamespace(rt=rt, cfg=ServeConfig(parallel=4)))
    assert slots_allowed(rt) == 3 and slots_allowed(rt, cap=2) == 2  # pi-serve's default: what fits, <= 4
    rt.cfg = dataclasses.replace(rt.cfg, vram=rt.bytes_gpu - 1)
    assert slots_allowed(rt) == 1
    rt.cfg = dataclasses.replace(rt.cfg, vram=rt.bytes_gpu + need)
    assert slots_allowed(rt) == 4
    before = rt.bytes_gpu
    assert Batcher(types.SimpleNamespace(rt=rt, cfg=ServeConfig(parallel=4))).n == 4
    assert rt.bytes_gpu == before + need and rt.lm.decoder.n_slots == 4
    rt.device = torch.device("cpu")
    assert slots_allowed(rt) == 4  # RAM holds the CPU's slots: the cap


@pytest.mark.parametrize("step", ["auto", "interleaved"])
def test_short_prompts_by_the_decode_step_equal_their_solo_runs(tiny_model_dir, solo, step):
    """--step-prefill: each prompt fed through the batch's step a token at a time (dense mode computes the same
    neurons either way): every text is its solo one-pass run's."""
    from hotneurons.runtime.generate import RuntimeConfig
    from hotneurons.runtime.load import load_runtime
    from hotneurons.server.serve import ServeConfig, Server

    rt = load_runtime(None, RuntimeConfig(mode="dense", device="cpu", step_prefill=64),
                      model=str(tiny_model_dir(FAMILY)))
    with Server(rt, ServeConfig(port=0, parallel=2, batch_step=step)) as s:
        jobs = [(q, 6, k % 2 == 0) for k, q in enumerate(PROMPTS)]
        assert _together(s, jobs) == [solo[q, n] for q, n, _ in jobs]


@pytest.mark.parametrize("step", ["auto", "interleaved"])
def test_a_slot_keeps_its_chat_for_the_next_turn(tiny_model_dir, step):
    """The prompt cache with --parallel 2: a request whose prompt extends the last one's (its prompt and text) takes
    that slot and computes the rest only (/health: the tokens each free slot holds); its text is what the whole
    prompt gives afresh. Another request in between, in the other slot, leaves it alone."""
    from hotneurons.server.batcher import Batcher

    rt = load(tiny_model_dir(FAMILY))
    fed = []
    real = Batcher._prefill_one

    def spy(self):
        fed.extend(s.fed for s in self.active if s.prefilling and not s.job.gone)
        real(self)

    with pytest.MonkeyPatch.context() as mp, running(tiny_model_dir(FAMILY), parallel=2, batch_step=step) as s:
        mp.setattr(Batcher, "_prefill_one", spy)
        c = client(s)
        first = c.completions.create(model="any", prompt="Once upon a time", max_tokens=6, temperature=0)
        held = [x.get("cached_tokens") for x in health(s)["slots"]]
        assert sorted(held)[0] == 0 and sorted(held)[1] > 0  # one slot holds the first request
        c.completions.create(model="any", prompt="1 2 3 4", max_tokens=6, temperature=0)  # the other slot
        prompt = "Once upon a time" + first.choices[0].text + " and"
        fed.clear()
        got = c.completions.create(model="any", prompt=prompt, max_tokens=6, temperature=0).choices[0].text
    assert fed and fed[0] >= len(prompt_ids(rt, "Once upon a time"))  # the history came from the cache
    assert got == generate(rt, prompt_ids(rt, prompt), 6).text


def test_slot_choice_keeps_conversations():
    """A prompt takes the slot whose tokens mostly start it, else the one that holds the fewest; never all of a
    prompt (its last token's logits are computed)."""
    import types

    from hotneurons.server.batcher import Batcher, common_prefix

    assert common_prefix([], [1, 2]) == 0 and common_prefix([1, 2, 3], [1, 2, 3]) == 2
    assert common_prefix([1, 2, 9], [1, 2, 3, 4]) == 2 and common_prefix([1], [1]) == 0
    b = types.SimpleNamespace(held=[[1, 2, 3, 4, 5, 6], [], [1, 7, 7]])
    pick = Batcher._pick.__get__(b)
    assert pick([0, 1, 2], [1, 2, 3, 4, 5, 6, 8]) == (0, 6)  # the conversation goes on
    assert pick([0, 1, 2], [1, 9]) == (1, 0)  # a shared first token only: the empty slot, not a conversation's
    assert pick([0, 2], [1, 7, 7, 7]) == (2, 3)
    assert pick([0, 2], [5]) == (2, 0)  # nothing shared: the slot that holds the fewest
