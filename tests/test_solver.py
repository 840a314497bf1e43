"""The placement ILP against slow references: exhaustive enumeration, an exact multiple-choice knapsack DP,
a neuron-level cost evaluation, and the global top-k groups of the paper's objective."""

import itertools
import math

import numpy as np
import pytest
from hotneurons.common.hardware import get_hardware
from hotneurons.common.model_info import ModelInfo
from hotneurons.solver.cost import build_problem, comm_min_neurons, evaluate, layer_tables
from hotneurons.solver.ilp import solve_ilp
from hotneurons.solver.synthetic import llama_model_meta

HW = get_hardware("rtx4090")


def make_problem(rng, n_layers=3, n_neurons=20, group_size=4, budget_frac=0.3, comm=True, d_model=16, hw=HW,
                 distinct=False, sync_neurons=None):
    """A random instance. The sync latency is set to the CPU time of about `sync_neurons` hot neurons
    (random by default) so that the communication minimum C_l falls inside these tiny layers."""
    shape = ModelInfo.from_meta(llama_model_meta("tiny", n_layers, d_model, n_neurons, 2, 1, 100))
    tokens = 1000
    if sync_neurons is None:
        sync_neurons = float(rng.uniform(0, n_neurons / 2))
    hw = hw.replace(sync_latency_s=sync_neurons * 0.5 * shape.neuron_params * 2.0 / hw.effective_cpu_bw)
    counts = []
    for _ in range(n_layers):
        p = rng.beta(0.3, 2.0, n_neurons)  # skewed activation probabilities
        c = rng.binomial(tokens, p).astype(np.int64)
        if distinct:  # distinct group sums, so the top-k set is unique
            c = c * n_neurons * 10 + rng.permutation(n_neurons)
        counts.append(np.sort(c)[::-1])
    bpn = shape.neuron_params * 2.0
    budget = budget_frac * n_layers * n_neurons * bpn
    return build_problem(counts, tokens, shape, hw, 2.0, budget, 0, group_size, comm), counts


def brute_force(p, objective):
    """Every combination of per-layer group counts: the obviously-correct optimum."""
    t = layer_tables(p)
    best, best_k = None, None
    for k in itertools.product(*[range(g + 1) for g in p.n_groups]):
        ev = evaluate(p, np.array(k), t)
        if not ev["feasible"]:
            continue
        v = ev["latency_ms"] if objective == "latency" else -ev["gpu_activation_share"]
        if best is None or v < best - 1e-12:
            best, best_k = v, np.array(k)
    return best, best_k


def knapsack_dp(p, objective):
    """Exact multiple-choice knapsack over per-layer group counts; weights in neurons (bytes per neuron
    is the same in every layer), so capacity = floor(budget / bytes per neuron)."""
    t = layer_tables(p)
    bpn = p.bytes_per_neuron[0]
    assert np.all(p.bytes_per_neuron == bpn)
    cap = int(math.floor(p.budget_bytes / bpn + 1e-9))
    value = t.layer_ms if objective == "latency" else -t.counts  # (layers, G+1), minimise
    dp = np.zeros(cap + 1)  # best value using <= c neurons, over the layers so far
    for l in range(p.n_layers):
        new = np.full(cap + 1, np.inf)
        for k in range(int(p.n_groups[l]) + 1):
            if not t.allowed[l, k]:
                continue
            w = int(t.neurons[l, k])
            if w > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[w:] = dp[: cap + 1 - w] + value[l, k]
            new = np.minimum(new, cand)
        dp = new
    best = dp[cap]
    if objective == "latency":
        return best + p.global_ms
    return -best / t.counts[:, -1].sum()


def ilp_value(p, objective, **kw):
    r = solve_ilp(p, objective, mip_gap=0.0, time_limit=60, **kw)
    ev = evaluate(p, r.k)
    assert ev["feasible"], "ILP placement breaks a constraint"
    return (ev["latency_ms"] if objective == "latency" else ev["gpu_activation_share"]), r


@pytest.mark.parametrize("objective", ["latency", "activations"])
@pytest.mark.parametrize("seed", range(6))
def test_ilp_equals_exhaustive_enumeration(seed, objective):
    rng = np.random.default_rng(seed)
    p, _ = make_problem(rng, n_layers=3, n_neurons=int(rng.integers(9, 19)), group_size=int(rng.integers(2, 5)),
                        budget_frac=float(rng.uniform(0.05, 0.9)), comm=bool(seed % 2))
    got, r = ilp_value(p, objective)
    best, _ = brute_force(p, objective)
    want = best if objective == "latency" else -best
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert r.status == "optimal"


@pytest.mark.parametrize("objective", ["latency", "activations"])
@pytest.mark.parametrize("seed", range(4))
def test_ilp_equals_knapsack_dp_mid_size(seed, objective):
    rng = np.random.default_rng(100 + seed)
    p, _ = make_problem(rng, n_layers=8, n_neurons=int(rng.integers(100, 200)), group_size=int(rng.integers(4, 12)),
                        budget_frac=float(rng.uniform(0.1, 0.8)), comm=seed % 2 == 0)
    got, _ = ilp_value(p, objective)
    assert got == pytest.approx(knapsack_dp(p, objective), rel=1e-7)


def test_comm_constraint_binds_in_the_small_instances():
    """Guard against a vacuous test suite: the minimum is strictly inside some layers and changes the optimum."""
    import dataclasses
    changed = inside = 0
    for seed in range(6):
        rng = np.random.default_rng(seed)
        p, _ = make_problem(rng, n_layers=3, n_neurons=int(rng.integers(9, 19)), group_size=int(rng.integers(2, 5)),
                            budget_frac=float(rng.uniform(0.05, 0.9)), comm=True)
        inside += int(((p.min_groups > 1) & (p.min_groups < p.n_groups)).sum())
        free = dataclasses.replace(p, min_groups=np.zeros_like(p.min_groups))
        changed += sum(brute_force(p, o)[0] != brute_force(free, o)[0] for o in ("latency", "activations"))
    assert inside >= 3 and changed >= 2


def test_dp_agrees_with_brute_force():
    """The two references agree with each other, so a bug would have to be in both."""
    for seed in range(4):
        rng = np.random.default_rng(200 + seed)
        p, _ = make_problem(rng, n_layers=3, n_neurons=14, group_size=3, budget_frac=0.4, comm=True)
        for obj in ("latency", "activations"):
            best, _ = brute_force(p, obj)
            assert knapsack_dp(p, obj) == pytest.approx(best if obj == "latency" else -best, rel=1e-9)


@pytest.mark.parametrize("seed", range(12))
def test_constraints_hold_on_random_instances(seed):
    rng = np.random.default_rng(300 + seed)
    hw = HW.replace(cpu_bw=float(rng.uniform(10e9, 300e9)))
    n = int(rng.integers(5, 300))
    p, _ = make_problem(rng, n_layers=int(rng.integers(1, 10)), n_neurons=n, group_size=int(rng.integers(1, 70)),
                        budget_frac=float(rng.uniform(0, 1.2)), comm=bool(rng.integers(2)), hw=hw,
                        sync_neurons=float(rng.choice([0.0, 3.0, n / 4, 10.0 * n])))
    for objective in ("latency", "activations"):
        r = solve_ilp(p, objective)
        t = layer_tables(p)
        rows = np.arange(p.n_layers)
        assert t.bytes[rows, r.k].sum() <= p.budget_bytes + 1e-6  # memory
        assert np.all((r.k == 0) | (r.k >= p.min_groups))  # communication minimum
        assert np.all((r.k >= 0) & (r.k <= p.n_groups))
        assert r.gap <= 1e-3 + 1e-9


def test_paper_objective_without_comm_is_global_top_k_groups():
    rng = np.random.default_rng(7)
    gs, n = 8, 64  # n divisible by gs: every group has the same bytes
    p, _ = make_problem(rng, n_layers=5, n_neurons=n, group_size=gs, comm=False, distinct=True, sync_neurons=n)
    group_bytes = gs * p.bytes_per_neuron[0]
    for m in (0, 1, 7, 13, 22, 40):
        budget = (m + 0.5) * group_bytes  # room for m groups, not m + 1
        q = build_like(p, budget)
        r = solve_ilp(q, "activations", mip_gap=0.0)
        chosen = {(l, g) for l in range(q.n_layers) for g in range(r.k[l])}
        order = np.argsort(-q.group_counts, axis=None)[:m]  # global top-m groups by count
        top = {tuple(int(x) for x in np.unravel_index(i, q.group_counts.shape)) for i in order}
        assert chosen == top


def build_like(p, budget):
    import dataclasses
    return dataclasses.replace(p, budget_bytes=float(budget))


def test_tables_match_neuron_level_costs():
    """The per-layer tables the ILP and the references use, against a direct per-neuron computation."""
    rng = np.random.default_rng(11)
    p, counts = make_problem(rng, n_layers=4, n_neurons=37, group_size=5, comm=True)
    t = layer_tables(p)
    bpn = p.bytes_per_neuron[0]
    for l, c in enumerate(counts):
        for k in range(p.n_groups[l] + 1):
            on_gpu = np.arange(len(c)) < min(k * p.group_size, len(c))  # hottest first
            gpu_ms = on_gpu.sum() * bpn / HW.gpu_bw * 1e3
            cpu_ms = (c[~on_gpu].sum() / p.tokens) * bpn / HW.effective_cpu_bw * 1e3
            sync = p.sync_ms[l] if (~on_gpu).any() else 0.0
            assert t.bytes[l, k] == on_gpu.sum() * bpn
            assert t.counts[l, k] == c[on_gpu].sum()
            assert t.layer_ms[l, k] == pytest.approx(p.fixed_ms[l] + sync + max(gpu_ms, cpu_ms), rel=1e-12)


def test_comm_minimum_matches_its_definition():
    rng = np.random.default_rng(3)
    for _ in range(50):
        f = np.sort(rng.beta(0.5, 2, int(rng.integers(1, 60))))[::-1]
        cpu, gpu, sync = rng.uniform(0.1, 2), rng.uniform(0.01, 0.5), rng.uniform(0, 3)
        C = comm_min_neurons(f, cpu, gpu, sync)
        ok = [c for c in range(1, len(f) + 1) if sum(f[j] * cpu - gpu for j in range(c)) >= sync]
        assert C == (ok[0] if ok else len(f))


def test_large_budget_puts_everything_on_gpu_only_when_it_pays():
    rng = np.random.default_rng(5)
    p, _ = make_problem(rng, n_layers=3, n_neurons=40, group_size=8, budget_frac=2.0)
    r = solve_ilp(p, "activations", mip_gap=0.0)
    assert np.all(r.k == p.n_groups)  # the paper's objective fills the GPU
    r = solve_ilp(p, "latency", mip_gap=0.0)
    best, _ = brute_force(p, "latency") if np.prod(p.n_groups + 1) < 5000 else (None, None)
    assert evaluate(p, r.k)["latency_ms"] == pytest.approx(best, rel=1e-9)


def test_byte_tables_are_weights_formats():
    """pi-solve's bytes per weight are weights.formats' (the one table), under its old names too (fp32, fp16)."""
    from hotneurons.solver.cost import ACT_BYTES, COLD_BYTES, DTYPE_BYTES
    from hotneurons.weights.formats import FORMATS, bytes_per_weight

    assert {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}.items() <= DTYPE_BYTES.items()
    assert {"q4_k", "q5_k", "q6_k"} <= DTYPE_BYTES.keys() and "int8" not in DTYPE_BYTES  # int8 is cold rows only
    for name, b in DTYPE_BYTES.items():
        assert b == bytes_per_weight(name)
        assert ACT_BYTES[name] == (b if b >= 2 else 2.0)  # block formats keep a 16-bit KV cache
    assert COLD_BYTES == {"bf16": 2.0, "int8": 1 + 4 / 64, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
                          "q4_k": 144 / 256, "q5_k": 176 / 256, "q6_k": 210 / 256}
    assert all(COLD_BYTES[f.value] == s.bytes_per_weight for f, s in FORMATS.items() if s.cpu_kernel)


@pytest.mark.parametrize("always", [1, 2])
def test_gate_first_tables_match_neuron_level_costs(always):
    """A gated model decoded by its own gates (runtime/gated.py): every cold neuron costs `always` rows a token, an
    active one its other rows too; the tables and the ILP (against brute force) price it so."""
    rng = np.random.default_rng(12 + always)
    p0, counts = make_problem(rng, n_layers=3, n_neurons=24, group_size=4, comm=True)
    shape = ModelInfo.from_meta(llama_model_meta("tiny", 3, 16, 24, 2, 1, 100))
    p = build_problem(counts, p0.tokens, shape, HW.replace(sync_latency_s=p0.sync_ms[0] / 1e3), 2.0, p0.budget_bytes,
                      0, 4, True, always_rows=always)
    t = layer_tables(p)
    bpn = p.bytes_per_neuron[0]
    row = shape.d_model * 2.0  # bytes of one row
    for l, c in enumerate(counts):
        for k in range(p.n_groups[l] + 1):
            cold = np.arange(len(c)) >= min(k * p.group_size, len(c))
            cpu_ms = (cold.sum() * always * row + c[cold].sum() / p.tokens * (bpn - always * row)) \
                / HW.effective_cpu_bw * 1e3
            assert t.cpu_ms[l, k] == pytest.approx(cpu_ms, rel=1e-12)
    for objective in ("latency", "activations"):
        want, _ = brute_force(p, objective)
        got, _ = ilp_value(p, objective)
        assert (got if objective == "latency" else -got) == pytest.approx(want, rel=1e-9)


def test_activations_cross_pcie_at_their_own_bytes():
    """A block format's weights (q4_0: 18/32 bytes) leave the activations 16-bit: the per-layer round trip moves 2 d
    values of act_bytes each (and a byte a neuron of mask), not of the weights' bytes."""
    shape = ModelInfo.from_meta(llama_model_meta("tiny", 2, 64, 128, 2, 1, 100))
    counts = [np.arange(128, 0, -1, dtype=np.int64)] * 2
    hw = HW.replace(sync_latency_s=0.0)
    p_w, p_a = (build_problem(counts, 100, shape, hw, 18 / 32, 1e6, 0, 16, True, act_bytes=a) for a in (None, 2.0))
    assert p_a.sync_ms[0] == pytest.approx((2 * 64 * 2.0 + 128) / hw.pcie_bw * 1e3)
    assert p_w.sync_ms[0] == pytest.approx((2 * 64 * 18 / 32 + 128) / hw.pcie_bw * 1e3)
