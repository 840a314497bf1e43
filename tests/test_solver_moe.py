"""pi-solve on mixtures of experts: the expert ILP against brute force, the baselines, the CLI and its artifacts."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from hotneurons.artifacts.experts import ExpertPlacement, read_expert_placement
from hotneurons.artifacts.placement import PlacementSummary
from hotneurons.solver.cli import main
from hotneurons.solver.experts import (
    ExpertProblem,
    baselines,
    evaluate_experts,
    expert_tables,
    n_cpu_moe_layers,
    solve_experts,
)
from hotneurons.solver.synthetic import write_synthetic_moe_profile

TOL = 1e-6  # relative: the ILP is solved with gap 0, the rows are scaled to ~1


def problem(seed: int, L: int = 2, E: int = 4, budget_experts: float = 2.5, group_size: int = 0, n: int = 5,
            sync_ms: float = 0.01, gpu_bw: float = 1e12, neurons: bool = False) -> ExpertProblem:
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 1000, (L, E)).astype(np.float64)  # (layers, experts)
    eb = rng.uniform(1e6, 2e6, L)  # (layers,) bytes, layers differ
    nc = None
    if group_size or neurons:  # neurons alone: whole ReLU-family experts with their neuron counts
        nc = -np.sort(-np.minimum(rng.integers(0, 400, (L, E, n)), counts[:, :, None]), axis=2).astype(np.float64)
    return ExpertProblem(tokens=1000, counts=counts, expert_bytes=eb, cold_bytes=0.9 * eb, gpu_bw=gpu_bw, cpu_bw=5e10,
                         sync_ms=np.full(L, sync_ms), fixed_ms=np.full(L, 0.1), global_ms=0.2,
                         budget_bytes=budget_experts * eb.mean(), group_size=group_size, neuron_counts=nc)


def test_whole_relu_experts_price_their_active_neurons():
    # whole experts with neuron counts: a routed cold expert costs the CPU its active neurons' rows, as neuron groups
    # price k = 0; on the GPU (k = 1) nothing
    p = problem(3, neurons=True)
    t = expert_tables(p)
    g = expert_tables(problem(3, group_size=2))  # the same draws, neuron groups
    full = p.cold_bytes / p.cpu_bw * 1e3  # (layers,) ms for a whole expert
    for l, e in itertools.product(range(2), range(4)):
        want = sum(p.neuron_counts[l, e, j] / p.tokens for j in range(5)) / 5 * full[l]  # float64 by hand
        assert t.cpu_ms[l, e, 0] == pytest.approx(want, rel=1e-12) == g.cpu_ms[l, e, 0]
        assert t.cpu_ms[l, e, 1] == 0 and t.gpu_ms[l, e, 1] == pytest.approx(problem(3).counts[l, e] / 1000
                                                                              * p.expert_bytes[l] / p.gpu_bw * 1e3)
    assert (t.cpu_ms[:, :, 0] <= expert_tables(problem(3)).cpu_ms[:, :, 0] + 1e-15).all()  # never above dense
    best = brute_force(p)
    r = solve_experts(p, "latency", mip_gap=0.0)
    assert evaluate_experts(p, r.k, t)["latency_ms"] == pytest.approx(best["latency"], rel=TOL)


def brute_force(p: ExpertProblem) -> dict:
    t = expert_tables(p)
    L, E = p.shape
    best = {"latency": np.inf, "activations": -np.inf}
    for ks in itertools.product(range(p.n_groups + 1), repeat=L * E):
        ev = evaluate_experts(p, np.array(ks).reshape(L, E), t)
        if ev["feasible"]:
            best["latency"] = min(best["latency"], ev["latency_ms"])
            best["activations"] = max(best["activations"], ev["gpu_share_routed"])
    return best


@pytest.mark.parametrize("seed", range(6))
def test_whole_experts_equal_brute_force(seed):
    # 2 layers x 4 experts: all 2^8 placements; a slow GPU in some seeds so that max(GPU, CPU) binds on both sides
    p = problem(seed, budget_experts=[0.5, 1.5, 2.5, 4.0, 6.5, 8.0][seed], gpu_bw=1e12 if seed % 2 else 6e10)
    best = brute_force(p)
    for objective in ("latency", "activations"):
        r = solve_experts(p, objective, mip_gap=0.0)
        ev = evaluate_experts(p, r.k, expert_tables(p))
        assert ev["feasible"] and set(np.unique(r.k)) <= {0, 1}
        got = ev["latency_ms"] if objective == "latency" else ev["gpu_share_routed"]
        assert got == pytest.approx(best[objective], rel=TOL, abs=1e-12)
        if objective == "latency":  # the solver's objective is the placement-dependent part of the latency
            assert r.objective == pytest.approx(got - p.fixed_ms.sum() - p.global_ms, rel=TOL, abs=1e-12)


@pytest.mark.parametrize("seed,n,group", [(0, 5, 2), (1, 5, 2), (2, 4, 2), (3, 6, 3)])
def test_neuron_groups_equal_brute_force(seed, n, group):
    # 2 layers x 2 ReLU experts, G = 2..3 groups (a short last group where n % group): (G+1)^4 placements
    p = problem(seed, E=2, budget_experts=1.3, group_size=group, n=n)
    best = brute_force(p)
    for objective in ("latency", "activations"):
        r = solve_experts(p, objective, mip_gap=0.0)
        ev = evaluate_experts(p, r.k, expert_tables(p))
        assert ev["feasible"]
        got = ev["latency_ms"] if objective == "latency" else ev["gpu_share_routed"]
        assert got == pytest.approx(best[objective], rel=TOL, abs=1e-12)


def test_budget_respected_on_random_instances():
    for seed in range(10):
        p = problem(seed, L=6, E=8, budget_experts=np.random.default_rng(seed).uniform(0, 40))
        for objective in ("latency", "activations"):
            r = solve_experts(p, objective)
            assert expert_tables(p).bytes[np.arange(6)[:, None], r.k].sum() <= p.budget_bytes * (1 + 1e-9)


def test_n_cpu_moe_equals_brute_force_count():
    for seed in range(20):
        p = problem(seed, L=5, E=3, budget_experts=np.random.default_rng(seed).uniform(0, 16))
        fits = [N for N in range(6) if 3 * p.expert_bytes[N:].sum() <= p.budget_bytes]
        assert n_cpu_moe_layers(p) == min(fits)
        b = baselines(p, solve_experts(p).k)
        assert b["n_cpu_moe"]["n"] == min(fits) and b["n_cpu_moe"]["fits"]
        assert b["n_cpu_moe"]["gpu_share_routed"] == pytest.approx((5 - min(fits)) / 5)
        assert b["uniform"]["fits"]  # the same count of experts per layer as ours, ids 0..m-1


def test_expert_placement_constructors():
    u = ExpertPlacement.uniform(3, 4, 2)
    assert u.gpu.tolist() == [[True, True, False, False]] * 3
    c = ExpertPlacement.n_cpu_moe(3, 4, 1)
    assert c.gpu.sum(1).tolist() == [0, 4, 4]
    counts = np.array([[1, 1, 1, 1], [3, 1, 0, 0], [0, 0, 0, 4]])
    assert c.gpu_share(counts) == pytest.approx(2 / 3)
    assert u.gpu_share(counts) == pytest.approx((0.5 + 1.0 + 0.0) / 3)


def _solve(run, *args):
    return CliRunner().invoke(main, ["--run", str(run), "--hardware", "rtx4090", "--json", "--time-limit", "20",
                                     *args])


@pytest.mark.parametrize("activation", ["swiglu", "reglu"])
def test_cli_writes_expert_placement(tmp_path, activation):
    run = write_synthetic_moe_profile(tmp_path / "run", "qwen1.5-moe-a2.7b", tokens=2000, n_layers=3,
                                      activation=activation)
    r = _solve(run, "--vram", "2GB", "--dtype", "q4_0")  # the default: whole experts, what the runtime computes
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["experts"]["mode"] == "whole experts"
    r = _solve(run, "--vram", "2GB", "--dtype", "q4_0", "--expert-neurons", "auto")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    x = s["experts"]
    assert x["mode"] == ("neuron groups" if activation == "reglu" else "whole experts")
    assert x["expert_bytes"][0] == 3 * 2048 * 1408 * 18 // 32  # q4_0: 18 bytes per 32 weights
    assert s["memory"]["gpu"]["total"] <= 2e9 and s["layers"] == []
    assert set(x["baselines"]) == {"n_cpu_moe", "uniform"} and 0 <= x["baselines"]["n_cpu_moe"]["n"] <= 3
    assert x["gpu_share_routed"] >= x["baselines"]["n_cpu_moe"]["gpu_share_routed"] - 1e-9 or \
        s["expected_latency_ms"] <= x["baselines"]["n_cpu_moe"]["expected_latency_ms"] + 1e-9
    pdir = run / "placement"
    PlacementSummary.load(pdir / "summary.json")
    df = pd.read_parquet(pdir / "experts.parquet")
    assert list(df.columns) == ["layer", "expert", "gpu", "count", "rank"] and len(df) == 3 * 60
    assert str(df["layer"].dtype) == "int32" and str(df["rank"].dtype) == "int32" and df["gpu"].dtype == bool
    assert (df.groupby("layer")["count"].apply(lambda c: (np.diff(c.to_numpy()) <= 0).all())).all()  # hottest first
    assert df.groupby("layer")["gpu"].sum().tolist() == x["gpu_experts_per_layer"]
    info = json.loads((run / "profile" / "meta.json").read_text())["model"]
    ep = read_expert_placement(run, info)
    assert ep.gpu.shape == (3, 60) and ep.gpu.sum() == sum(x["gpu_experts_per_layer"])
    if activation == "reglu":
        nd = pd.read_parquet(pdir / "placement.parquet")
        assert list(nd.columns) == ["layer", "expert", "neuron", "gpu", "count", "rank"] and len(nd) == 3 * 60 * 1408
        assert ep.neurons.shape == (3, 60, 1408) and ep.neurons[ep.gpu].all()
        gpu_bytes = ep.neurons.sum() * x["expert_bytes"][0] / 1408
        assert gpu_bytes == pytest.approx(s["memory"]["gpu"]["experts"], rel=1e-6)
    else:
        assert ep.neurons is None and not (pdir / "placement.parquet").exists()


def test_budget_below_the_non_expert_part_is_one_line(tmp_path):
    run = write_synthetic_moe_profile(tmp_path / "run", "mixtral-8x7b", tokens=500, n_layers=2)
    r = _solve(run, "--vram", "1GB")
    assert r.exit_code == 1
    msg = r.stderr.strip()
    assert "\n" not in msg and "1.00 GB" in msg and "raise the VRAM budget to at least" in msg and "--vram" in msg
    assert not (run / "placement").exists()
    r = _solve(run, "--vram", "24GB", "--expert-neurons", "on")  # SwiGLU experts have no neuron groups
    assert r.exit_code == 1 and "--expert-neurons" in r.stderr and "\n" not in r.stderr.strip()
