"""solver/batching.py: the cost model of batched decoding. The union share against exact enumeration of B tokens'
firings; the table at B = 1 against the batch-1 cost model; the union measured on token masks against its
independence estimate; the budget counting a KV cache slot per sequence (pi-solve --parallel)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hotneurons.common.hardware import get_hardware
from hotneurons.common.model_info import ModelInfo
from hotneurons.solver.batching import batch_table, measured_union, union_share
from hotneurons.solver.cost import build_problem, evaluate, layer_tables
from hotneurons.solver.place import solve_placement
from hotneurons.solver.synthetic import llama_model_meta, powerlaw_probs, write_synthetic_profile

HW = get_hardware("rtx4090")


def test_union_share_equals_enumeration():
    """P(any of B independent tokens fires) by summing over all 2^B outcomes."""
    for p in (0.0, 0.03, 0.4, 0.97, 1.0):
        for B in (1, 2, 3, 5):
            exact = sum(np.prod([p if f else 1 - p for f in fired]) for fired in itertools.product((0, 1), repeat=B)
                        if any(fired))
            assert union_share(np.array([p]), B)[0] == pytest.approx(exact, abs=1e-12)


def _problem(alpha: float, budget_frac: float = 0.3, probs: np.ndarray | None = None):
    shape = ModelInfo.from_meta(llama_model_meta("t", n_layers=4, d_model=256, n_neurons=1024, n_heads=4,
                                                 n_kv_heads=4, vocab_size=1000))
    tokens = 10_000
    probs = powerlaw_probs(1024, alpha, 0.1) if probs is None else probs
    counts = [np.sort(probs * tokens)[::-1] for _ in range(4)]
    full = 4 * 1024 * shape.neuron_params * 2.0
    p = build_problem(counts, tokens, shape, HW, 2.0, budget_frac * full, 0.0, 64, False)
    t = layer_tables(p)
    k = np.minimum(np.round(budget_frac * p.n_groups).astype(np.int64), p.n_groups)  # the hottest groups, a share
    return p, t, k, counts, shape


@pytest.mark.parametrize("alpha", [0.5, 1.2])
def test_batch_table(alpha):
    p, t, k, counts, shape = _problem(alpha)
    table = batch_table(p, t, k, counts, shape, HW, 2.0)
    rows = table["batches"]
    # B = 1 is the batch-1 cost model's own step
    assert rows["1"]["step_ms"] == pytest.approx(evaluate(p, k, t)["latency_ms"], rel=1e-9)
    rates = [rows[b]["tokens_per_s"] for b in ("1", "2", "4", "8")]
    per_token = [rows[b]["cold_rows_per_token"] for b in ("1", "2", "4", "8")]
    assert rates == sorted(rates) and per_token == sorted(per_token, reverse=True)  # sharing a row saves reads
    assert all(rows[b]["layer_split_tokens_per_s"] == pytest.approx(int(b) * rows["1"]["layer_split_tokens_per_s"])
               for b in rows)
    B = table["stops_paying_at"]
    assert B is None or rows.get(str(B), {"vs_layer_split": 0})["vs_layer_split"] < 1.0
    assert all(rows[b]["vs_layer_split"] >= 1.0 for b in rows if B is None or int(b) < B)


def test_skew_keeps_batching_cheap():
    """At the same mean firing rate, a skewed profile's cold union grows slower with B than a flat one's."""
    grow = {}
    for name, probs in (("flat", np.full(1024, 0.1)), ("skewed", powerlaw_probs(1024, 4.0, 0.1))):
        p, t, k, counts, shape = _problem(0.0, budget_frac=0.0, probs=probs)
        rows = batch_table(p, t, np.zeros_like(k), counts, shape, HW, 2.0)["batches"]
        grow[name] = rows["8"]["cold_rows_per_token"] / rows["1"]["cold_rows_per_token"]
    assert grow["skewed"] < grow["flat"] < 1.0
    assert grow["flat"] == pytest.approx((1 - 0.9 ** 8) / 8 / 0.1, rel=1e-3)


def test_measured_union_matches_independence(tmp_path):
    """Token masks drawn independently with per-neuron probabilities: the measured union per token matches the
    estimate within sampling error."""
    rng = np.random.default_rng(3)
    n, rows, L = 512, 4000, 2
    freq = powerlaw_probs(n, 1.0, 0.1)
    for l in range(L):
        np.save(tmp_path / f"layer_{l:03d}.mask.npy", np.packbits(rng.random((rows, n)) < freq, axis=1))
    cold = [np.arange(100, n)] * L  # the 100 hottest on the GPU
    got = measured_union(tmp_path, cold, draws=400)
    for B in (1, 2, 4, 8):
        want = L * union_share(freq[100:], B).sum() / B
        assert got[str(B)] == pytest.approx(want, rel=0.05)
    assert measured_union(tmp_path / "none", cold) is None


def test_parallel_counts_a_kv_slot_per_sequence(tmp_path):
    run = write_synthetic_profile(tmp_path / "run", "llama-7b", tokens=2000, n_layers=4)
    one = solve_placement(run, HW, vram_bytes=8 * 10**9, ctx=4096, reserve_bytes=0, write=False)
    four = solve_placement(run, HW, vram_bytes=8 * 10**9, ctx=4096, reserve_bytes=0, write=False, parallel=4)
    assert four.memory.gpu["kv_cache"] == 4 * one.memory.gpu["kv_cache"] and four.flags.parallel == 4
    assert four.budget.ffn_budget_bytes == one.budget.ffn_budget_bytes - 3 * one.memory.gpu["kv_cache"]
    assert set(one.batching["batches"]) == {"1", "2", "4", "8"}


def test_parallel_counts_kv_slots_for_experts_too(tmp_path):
    from hotneurons.solver.place_moe import solve_expert_placement
    from hotneurons.solver.synthetic import write_synthetic_moe_profile

    run = write_synthetic_moe_profile(tmp_path / "run", "qwen3-30b-a3b", tokens=2000)
    kw = dict(vram_bytes=12 * 10**9, ctx=4096, reserve_bytes=0, write=False)
    one, two = (solve_expert_placement(run, HW, parallel=p, **kw) for p in (1, 2))
    assert two.memory.gpu["kv_cache"] == 2 * one.memory.gpu["kv_cache"] and two.flags.parallel == 2


def test_predictor_bytes_given_frees_room(tmp_path):
    """solve_placement(predictor_bytes=...): the given bytes replace the estimate; fewer of them leave the FFN more
    room, as many more bytes as they free (bench/predictor_quant.py's what-if)."""
    run = write_synthetic_profile(tmp_path / "run", "llama-7b", tokens=2000, n_layers=4)
    big = solve_placement(run, HW, vram_bytes=8 * 10**9, ctx=4096, reserve_bytes=0, write=False,
                          predictor_bytes=10**9)
    small = solve_placement(run, HW, vram_bytes=8 * 10**9, ctx=4096, reserve_bytes=0, write=False,
                            predictor_bytes=4 * 10**8)
    assert big.memory.gpu["predictors"] == 10**9 and small.memory.gpu["predictors"] == 4 * 10**8
    assert small.budget.ffn_budget_bytes == big.budget.ffn_budget_bytes + 6 * 10**8
    assert small.gpu_neuron_share >= big.gpu_neuron_share and small.expected_tokens_per_s >= big.expected_tokens_per_s


def test_layer_split_streams_at_dram_not_the_cold_kernels_rate():
    # pi-solve --measure makes cpu_bw the cold kernel's rate on scattered rows and keeps DRAM's in dram_bw: the layer
    # split's CPU layers stream whole matrices, so only their rate moves with dram_bw; the hybrid's step does not
    from hotneurons.solver.batching import layer_split_ms

    p, t, k, counts, shape = _problem(1.2, budget_frac=0.1)
    slow = HW.replace(cpu_bw=HW.cpu_bw / 4)  # a cold kernel at a quarter of DRAM, DRAM unknown: cpu_bw for both
    measured = slow.replace(dram_bw=HW.cpu_bw)  # DRAM measured apart
    n, ms_slow = layer_split_ms(p, shape, slow, 2.0)
    n2, ms_measured = layer_split_ms(p, shape, measured, 2.0)
    assert n == n2 < p.n_layers and ms_measured < ms_slow
    _, ms_dram = layer_split_ms(p, shape, HW, 2.0)
    assert ms_measured == pytest.approx(ms_dram)  # streaming at DRAM's rate as a preset's cpu_bw gives it
    from hotneurons.common.hardware import PER_CORE_DRAM_BW

    assert measured.stream_bw == min(HW.cpu_bw, HW.cores * PER_CORE_DRAM_BW) == HW.stream_bw


def test_layer_split_fills_the_predictors_room_with_layers():
    from hotneurons.solver.batching import layer_split_ms

    p, t, k, counts, shape = _problem(1.2, budget_frac=0.1)
    n, ms = layer_split_ms(p, shape, HW, 2.0)
    n2, ms2 = layer_split_ms(p, shape, HW, 2.0, predictor_bytes=4 * p.budget_bytes)  # room for more layers
    assert n < n2 <= p.n_layers and ms2 < ms
