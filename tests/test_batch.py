"""runtime/batch.py: several sequences decoded together, each in its own cache slot at its own position, give each
sequence's batch-1 greedy tokens and logits (tiny random models read in place, sparse predictor masks on a mixed
placement, block rows on both sides; a mixture of experts with half its experts cold)."""

from __future__ import annotations

import numpy as np
import pytest
import tiny
import torch
from hotneurons.artifacts.placement import Placement
from hotneurons.models.open import model_info, open_model
from hotneurons.runtime.batch import UnionStats, batch_step, generate_batch, slot_bytes, step_batch
from hotneurons.runtime.generate import RuntimeConfig, generate
from hotneurons.runtime.load import load_source_runtime
from test_runtime_moe import moe_gguf  # noqa: F401 (the fixture)

PROMPTS = [[5, 17, 42, 9, 33], [101, 7], [64, 3, 250, 12, 88, 19, 4]]  # different lengths: positions differ
NEW = 8
ATOL = 1e-4  # logits: one product over B rows against B products of one row


def _runtime(family, folder, tmp_path, fmt, device="cpu"):
    """Mixed placement (30% hot), block rows, random predictors at threshold 0 (about half the neurons marked, a
    different set per token)."""
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    source, sid, _, act = open_model(str(folder))
    info = model_info(source, sid, act, "llama" if "llama" in family else family, "glu" in family)
    tiny.write_predictors(run, info, 0.0)
    cfg = RuntimeConfig(device=device, dtype="float32", cold_dtype=fmt, gpu_dtype=fmt if fmt != "bf16" else "auto")
    return load_source_runtime(run, None, cfg, model=str(folder), placement=Placement(tuple(
                                   np.random.default_rng(i).random(info["n_neurons"]) < 0.3
                                   for i in range(info["n_layers"]))))


def _solo(rt, prompts):
    """Each prompt alone (batch 1): its greedy tokens and the logits of each step."""
    out = []
    for p in prompts:
        g = generate(rt, p, NEW, stop_at_eos=False, keep_logits=True)
        out.append((g.token_ids, g.logits))
    return out


@pytest.mark.parametrize("fmt", ["q4_0", "bf16"])
@pytest.mark.parametrize("family", ["llama-reglu", "opt"])
def test_batch_equals_batch_one(family, fmt, tiny_model_dir, tmp_path):
    rt = _runtime(family, tiny_model_dir(family), tmp_path, fmt)
    assert all(f.mask == "predictor" for f in rt.ffns)
    generate(rt, PROMPTS[0], NEW, stop_at_eos=False)
    marked = sum(f.cold_marks[1] for f in rt.ffns) / sum(f.cold_marks[0] * f.n_cold for f in rt.ffns)
    assert 0.2 < marked < 0.8  # the predictor marks a part of the cold neurons: a mask per token matters
    solo = _solo(rt, PROMPTS)
    got = generate_batch(rt, PROMPTS, NEW, stop_at_eos=False)
    assert got == [ids for ids, _ in solo]
    # one step of all three at the positions after their prompts and first tokens: logits as batch 1's second step
    dec = rt.lm.decoder
    for b, p in enumerate(PROMPTS):
        with dec.slot(b):
            rt.lm.prefill(rt, p)
    stats = UnionStats()
    logits = step_batch(rt, [s[0][0] for s in solo], [len(p) for p in PROMPTS], [0, 1, 2], stats)
    u = stats.summary()["3"]  # one step of 3 tokens: the union read once, each token's marks counted
    assert u["steps"] == 1 and u["union_rows_per_token"] * 3 <= u["marked_rows_per_token"] * 3
    assert u["union_rows_per_token"] * 3 >= u["marked_rows_per_token"] and 1 / 3 <= u["union_over_marked"] <= 1
    for b, (_, lg) in enumerate(solo):
        torch.testing.assert_close(logits[b], lg[1], rtol=0, atol=ATOL)
    # the slots are another order of the same sequences: the same logits
    for b, p in enumerate(PROMPTS):
        with dec.slot(2 - b):
            rt.lm.prefill(rt, p)
    again = step_batch(rt, [s[0][0] for s in solo][::-1], [len(p) for p in PROMPTS][::-1], [0, 1, 2])
    torch.testing.assert_close(again.flip(0), logits, rtol=0, atol=ATOL)
    assert dec.n_slots == 3 and slot_bytes(dec) == 2 * dec.k_cache.numel() * dec.k_cache.element_size()


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_moe_batch_equals_batch_one(moe_gguf, family):  # noqa: F811 (the imported fixture)
    """A mixture of experts (half its experts cold, a random mask): the B tokens routed each on its own."""
    path, _, _ = moe_gguf(family)
    rt = load_source_runtime(None, None, RuntimeConfig(device="cpu"), model=str(path),
                             placement=np.random.default_rng(5).random((2, 4)) < 0.5)
    solo = _solo(rt, PROMPTS)
    assert generate_batch(rt, PROMPTS, NEW, stop_at_eos=False) == [ids for ids, _ in solo]
    assert generate_batch(rt, PROMPTS, NEW, stop_at_eos=False, step="interleaved") == [ids for ids, _ in solo]


@pytest.mark.parametrize("family", ["llama-reglu", "opt"])
def test_interleaved_equals_batch_one(family, tiny_model_dir, tmp_path):
    """The batch-1 step for each sequence in turn (step_each), each sequence's cache moved into the model's own
    tensors first: each sequence's batch-1 tokens, on the fused step (llama) and the reference one (opt)."""
    rt = _runtime(family, tiny_model_dir(family), tmp_path, "q4_0")
    assert rt.fast is not None
    solo = _solo(rt, PROMPTS)
    assert generate_batch(rt, PROMPTS, NEW, stop_at_eos=False, step="interleaved") == [ids for ids, _ in solo]
    # and mixed with batched steps and prefills in between: the slots still hold their own sequences
    dec = rt.lm.decoder
    for b, p in enumerate(PROMPTS):
        with dec.slot(b):
            rt.lm.prefill(rt, p)
    first = [s[0][0] for s in solo]
    pos = [len(p) for p in PROMPTS]
    a = batch_step(rt, "interleaved")(first[::-1], pos[::-1], [2, 1, 0])  # order changes which cache is resident
    b = step_batch(rt, [s[0][1] for s in solo], [q + 1 for q in pos], [0, 1, 2])
    for i, (_, lg) in enumerate(solo):
        torch.testing.assert_close(a.flip(0)[i], lg[1], rtol=0, atol=ATOL)
        torch.testing.assert_close(b[i], lg[2], rtol=0, atol=ATOL)


def test_interleaved_keeps_each_logits_from_a_static_output(tiny_model_dir, tmp_path, monkeypatch):
    """A graph step returns its static output buffer, which the next replay overwrites: step_each keeps each
    sequence's logits (the fast step here writes into one buffer, as replayed graphs do)."""
    rt = _runtime("llama-reglu", tiny_model_dir("llama-reglu"), tmp_path, "bf16")
    solo = _solo(rt, PROMPTS)
    step, static = rt.fast.step, torch.zeros(rt.lm.info["vocab_size"])

    def graph_like(token, position):
        return static.copy_(step(token, position))

    monkeypatch.setattr(rt.fast, "step", graph_like)
    assert generate_batch(rt, PROMPTS, NEW, stop_at_eos=False, step="interleaved") == [ids for ids, _ in solo]


@pytest.mark.parametrize("swap_bytes", [None, 1])
def test_slots_resident_moves_sequences(tiny_model_dir, tmp_path, monkeypatch, swap_bytes):
    """models/slots.py: resident(b) puts slot b's keys and values in the own tensors (in one copy, or a layer at a
    time where the spare room is small); every slot still reads its own sequence through slot(); positions past
    those written are not copied."""
    if swap_bytes is not None:
        monkeypatch.setattr("hotneurons.models.slots.SWAP_BYTES", swap_bytes)
    rt = _runtime("llama-reglu", tiny_model_dir("llama-reglu"), tmp_path, "bf16")
    dec = rt.lm.decoder
    dec.add_slots(3)
    for b in range(3):
        with dec.slot(b):
            dec.k_cache[:, :, :4 + b].fill_(b + 1)
            dec.k_cache[-1, :, :4 + b].fill_(b + 10)  # the last layer apart: each layer moves
            dec.wrote(4 + b)
    own = dec.k_cache
    dec.resident(2)
    assert dec.k_cache is own and float(own[0, 0, 5, 0]) == 3 and float(own[0, 0, 6, 0]) == 0
    dec.resident(1)
    dec.resident(1)  # already there: nothing moves
    for b in range(3):
        with dec.slot(b):
            assert float(dec.k_cache[0, 0, 0, 0]) == b + 1 and float(dec.k_cache[0, 0, 4 + b, 0]) == 0
            assert float(dec.k_cache[-1, 0, 3 + b, 0]) == b + 10
    own[:, :, 5] = 99  # past resident sequence 1's 5 positions: not its own
    dec.free_slot(2)  # sequence 2 ended: an exchange moves only sequence 1's 5 positions
    dec.resident(2)
    with dec.slot(1):
        assert float(dec.k_cache[0, 0, 4, 0]) == 2 and float(dec.k_cache[0, 0, 5, 0]) != 99
    with dec.slot(1), pytest.raises(RuntimeError, match="inside slot"):
        dec.resident(0)
    with pytest.raises(ValueError, match="cannot be dropped"):
        dec.add_slots(2)
    dec.add_slots(4)  # more slots: the moved sequences stay where they are
    for b in range(2):
        with dec.slot(b):
            assert float(dec.k_cache[0, 0, 0, 0]) == b + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("step", ["batched", "interleaved"])
@pytest.mark.parametrize("family", ["llama-reglu", "opt"])
def test_batch_on_cuda_equals_batch_one(family, step, tiny_model_dir, tmp_path):
    """On CUDA (float32 compute; batch 1 through its CUDA graphs and mapped rows as loaded), the batch's greedy tokens
    are each prompt's batch-1 ones, batched (eager) or interleaved (the graphs over each cache in turn)."""
    rt = _runtime(family, tiny_model_dir(family), tmp_path, "q4_0", "cuda")
    solo = _solo(rt, PROMPTS)
    assert generate_batch(rt, PROMPTS, NEW, stop_at_eos=False, step=step) == [ids for ids, _ in solo]


def test_refusals(tiny_model_dir, tmp_path):
    rt = _runtime("llama-reglu", tiny_model_dir("llama-reglu"), tmp_path, "bf16")
    with pytest.raises(ValueError, match="every slot once"):
        step_batch(rt, [1, 2], [3, 4], [0, 0])
    with pytest.raises(ValueError, match="slot 3 does not exist"):
        step_batch(rt, [1], [3], [3])
    with pytest.raises(ValueError, match="at least one token"):
        generate_batch(rt, [[1], []])


def test_batch_decode_bench_runs_small(tiny_model_dir, tmp_path):
    """bench/batch_decode.py on a tiny model (CPU): a rate per B, batch 1's beside it, the union counted."""
    from bench.batch_decode import measure

    rt = _runtime("llama-reglu", tiny_model_dir("llama-reglu"), tmp_path, "q4_0")
    from bench.batch_decode import report

    got = measure(rt, [1, 3], prompt=5, gen=4, steps=("batched", "interleaved"))
    for kind in ("batches", "interleaved"):
        assert set(got[kind]) == {"1", "3"} and all(r["decode_tok_s"] > 0 for r in got[kind].values())
    assert got["batch1_generate"]["decode_tokens_per_s"] > 0 and set(got["union"]) == {"1", "3"}
    llama = {"batches": {"3": {"decode_tok_s": 2.0}}}
    rows = report(got, llama)["rows"]
    assert rows["3"]["ours_over_llamacpp"] == got["batches"]["3"]["decode_tok_s"] / 2.0
    assert rows["3"]["interleaved_over_llamacpp"] == got["interleaved"]["3"]["decode_tok_s"] / 2.0
    assert "llamacpp_decode_tok_s" not in rows["1"] and rows["1"]["interleaved_over_batch1"] > 0


def test_prompt_latency_bench_on_a_dense_hybrid(tiny_model_dir, tmp_path):
    """bench/prompt_latency.py on a tiny dense hybrid (CPU): per length both paths timed; one token is a decode step
    either way (the same logits), longer prompts' one pass computes the FFN dense where the steps take the
    predictor's masks (a difference is reported, not bounded)."""
    from bench.prompt_latency import measure

    rt = _runtime("llama-reglu", tiny_model_dir("llama-reglu"), tmp_path, "q4_0")
    got = measure(rt, [1, 4], reps=1)
    assert set(got["lengths"]) == {"1", "4"} and not got["graphs"]
    one = got["lengths"]["1"]["prefill"][str(got["offload_tokens_default"])]
    assert one["max_abs_logit_diff"] < ATOL and one["prefill_s"] > 0
    assert all(r["steps_s"] > 0 for r in got["lengths"].values())
