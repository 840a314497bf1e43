"""The expert placement ILP for mixtures of experts (see docs/solver.md, "Mixtures of experts").

Per layer l and expert e an integer k_le: groups of the expert's hottest neurons on the GPU, out of G. In whole-expert
mode G = 1 (k_le is the binary "expert e lives on the GPU"); in neuron-group mode (ReLU-family experts with a neuron
profile) G = ceil(n_ff_exp / group), the prefix of the expert's neurons sorted by count, as the dense ILP places a
layer's. Every per-expert quantity is a table over k (`ExpertTables`), exact and piecewise linear in k: bytes and GPU
time linear (up to the short last group, through full_le), CPU time convex, the GPU's share of the expert's work
concave, so one row per breakpoint writes each exactly, as solver/ilp.py does per layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from hotneurons.artifacts.placement import Objective
from hotneurons.common.kinds import choose

from .cost import SolverError
from .ilp import IlpResult, _pulp, new_var, run_highs


@dataclass(frozen=True)
class ExpertProblem:
    """One instance. Routed work: a token reaches expert e of layer l with probability counts[l, e] / tokens."""

    tokens: int  # tokens profiled
    counts: np.ndarray  # (layers, experts) float64 tokens whose top-k includes the expert
    expert_bytes: np.ndarray  # (layers,) bytes of one expert (gate, up, down) in its format on the GPU
    cold_bytes: np.ndarray  # (layers,) bytes of one expert as the CPU reads it
    gpu_bw: float  # bytes/s
    cpu_bw: float  # bytes/s (HardwareSpec.effective_cpu_bw)
    sync_ms: np.ndarray  # (layers,) ms per layer in which some expert is not wholly on the GPU
    fixed_ms: np.ndarray  # (layers,) ms of attention, router, shared expert (placement-independent, GPU)
    global_ms: float  # ms per token outside the layers (LM head, final norm)
    budget_bytes: float  # GPU bytes left for experts
    group_size: int = 0  # neurons per group; 0: whole experts only
    # (layers, experts, n_ff_exp) float64, hottest first per expert: neuron groups' order, and with whole experts the
    # CPU's work on a routed cold ReLU-family expert (its active neurons only)
    neuron_counts: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.counts.shape

    @property
    def n_groups(self) -> int:
        """G: k_le ranges over 0..G."""
        if not self.group_size:
            return 1
        return -(-self.neuron_counts.shape[2] // self.group_size)


@dataclass(frozen=True)
class ExpertTables:
    """Per (layer, expert) and k = 0..G groups on the GPU."""

    neurons: np.ndarray  # (G+1,) neurons on the GPU (whole-expert mode: 0 or 1 expert's worth, as a fraction 0, 1)
    bytes: np.ndarray  # (layers, G+1) bytes on the GPU (the same for every expert of a layer)
    gpu_ms: np.ndarray  # (layers, experts, G+1) expected ms per token the GPU spends on the expert
    cpu_ms: np.ndarray  # (layers, experts, G+1) expected ms per token the CPU spends on it
    share: np.ndarray  # (layers, experts, G+1) share of the expert's work the GPU does (1 at k = G)


def expert_tables(p: ExpertProblem) -> ExpertTables:
    L, E = p.shape
    G = p.n_groups
    prob = p.counts / max(p.tokens, 1)  # (layers, experts) routing probability
    full_gpu = p.expert_bytes / p.gpu_bw * 1e3  # (layers,) ms to read an expert from GPU memory
    full_cpu = p.cold_bytes / p.cpu_bw * 1e3  # (layers,) ms to read it from DRAM
    if not p.group_size:
        frac = np.array([0.0, 1.0])  # (2,) the expert's rows on the GPU
        share = np.broadcast_to(frac, (L, E, 2)).copy()
        cold_work = 1.0 - share  # a routed cold expert is read whole
        if p.neuron_counts is not None:  # ReLU-family experts: only the neurons that fire (the runtime's expert
            # predictors mark them; neuron-group mode prices k = 0 alike)
            cold_work = cold_work * (p.neuron_counts.sum(2) / np.maximum(p.counts, 1) / p.neuron_counts.shape[2]
                                     )[:, :, None]  # (layers, experts, 2) share of rows read a routing
        cpu = prob[:, :, None] * full_cpu[:, None, None] * cold_work  # (layers, experts, 2)
    else:
        n = p.neuron_counts.shape[2]
        nk = np.minimum(np.arange(G + 1) * p.group_size, n)  # (G+1,) neurons on the GPU
        frac = nk / n
        cum = np.concatenate([np.zeros((L, E, 1)), np.cumsum(p.neuron_counts, axis=2)], axis=2)[:, :, nk]  # (L, E, G+1)
        total = cum[:, :, -1:]  # (layers, experts, 1) activations of the expert's neurons
        # the GPU's share of the expert's work: activations served; an expert that never fired: rows
        share = np.where(total > 0, cum / np.maximum(total, 1e-300), frac[None, None, :])
        # the CPU computes only the active cold neurons of a routed expert (exact for ReLU, given a predictor),
        # as the dense cost model prices a cold neuron
        cpu = (total - cum) / max(p.tokens, 1) / n * full_cpu[:, None, None]
    gpu = prob[:, :, None] * frac[None, None, :] * full_gpu[:, None, None]  # hot rows read when routed
    return ExpertTables(frac, p.expert_bytes[:, None] * frac[None, :], gpu, cpu, share)


def evaluate_experts(p: ExpertProblem, k: np.ndarray, t: ExpertTables | None = None) -> dict:
    """Cost-model figures and feasibility of k: (layers, experts) groups on the GPU (whole mode: 0 or 1)."""
    t = t or expert_tables(p)
    L, E = p.shape
    G = p.n_groups
    k = np.asarray(k, dtype=np.int64)  # (layers, experts)
    li, ei = np.meshgrid(np.arange(L), np.arange(E), indexing="ij")
    gpu_ms = t.gpu_ms[li, ei, k].sum(1)  # (layers,)
    cpu_ms = t.cpu_ms[li, ei, k].sum(1)  # (layers,)
    sync = np.where((k < G).any(1), p.sync_ms, 0.0)  # (layers,)
    layer_ms = p.fixed_ms + sync + np.maximum(gpu_ms, cpu_ms)  # (layers,)
    w = p.counts / np.maximum(p.counts.sum(1, keepdims=True), 1e-300)  # (layers, experts) share of routed work
    layer_share = (w * t.share[li, ei, k]).sum(1)  # (layers,)
    gpu_bytes = float(t.bytes[li, k].sum())
    latency = float(layer_ms.sum() + p.global_ms)
    return {"gpu_expert_bytes": gpu_bytes, "latency_ms": latency, "tokens_per_s": 1e3 / latency,
            "gpu_share_routed": float(layer_share.mean()), "layer_share": layer_share, "layer_ms": layer_ms,
            "gpu_ms": gpu_ms, "cpu_ms": cpu_ms, "sync_ms": sync,
            "feasible": bool(gpu_bytes <= p.budget_bytes * (1 + 1e-12) and (k >= 0).all() and (k <= G).all())}


def solve_experts(p: ExpertProblem, objective: Objective | str = Objective.LATENCY, time_limit: float = 30.0,
                  mip_gap: float = 1e-3, threads: int | None = None, tables: ExpertTables | None = None) -> IlpResult:
    """The ILP; IlpResult.k is (layers, experts) groups on the GPU (whole mode: 1 = on the GPU)."""
    objective = choose(objective, Objective, "objective", SolverError, "objective")
    pulp = _pulp()
    t0 = time.perf_counter()
    t = tables or expert_tables(p)
    L, E = p.shape
    G = p.n_groups
    # Scaled rows (HiGHS's tolerances are absolute): memory in units of the largest expert's bytes, time in units of
    # the slowest layer's all-CPU expert time plus its sync.
    mb = 1.0 / float(max(p.expert_bytes.max(), 1.0))  # 1 / bytes
    unit_ms = float((t.cpu_ms[:, :, 0].sum(1) + p.sync_ms).max()) or 1.0  # ms
    w = p.counts / np.maximum(p.counts.sum(1, keepdims=True), 1e-300) / L  # (layers, experts) objective weights
    sense = pulp.LpMinimize if objective == Objective.LATENCY else pulp.LpMaximize
    prob = pulp.LpProblem("experts", sense)

    def var(name, low=None, up=None, cat="Continuous"):
        return new_var(pulp, prob, name, low, up, cat)

    def expr(terms):
        return pulp.LpAffineExpression(terms)

    # bytes and GPU time are linear in (k, full): value(k) = slope * k - short * full, exact at every integer k,
    # since only the last group may be short
    step = float(t.neurons[1])  # fraction of an expert per full group
    short = G * step - 1.0 if G * step > 1.0 + 1e-12 else 0.0  # fraction missing from the last group
    memory, obj, rows, ks = [], [], [], []
    for l in range(L):
        all_gpu = var(f"all_{l}", 0, 1, pulp.LpBinary)  # every expert of the layer wholly on the GPU: no sync
        gpu_terms, cpu_terms, cpu_const = [], [], 0.0
        for e in range(E):
            if G == 1:
                k = var(f"g_{l}_{e}", 0, 1, pulp.LpBinary)
            else:
                k = var(f"k_{l}_{e}", 0, G, pulp.LpInteger)
            full = None
            if short:  # only a short last group needs the binary full = [k = G]: the others are linear in k alone
                full = var(f"f_{l}_{e}", 0, 1, pulp.LpBinary)
                rows.append(expr([(k, 1), (full, -G)]) >= 0)  # full -> k = G
                rows.append(expr([(k, 1), (full, -1)]) <= G - 1)  # k = G -> full
            ks.append(k)
            xb = float(p.expert_bytes[l]) * mb
            memory += [(k, step * xb)] + ([(full, -short * xb)] if full else [])
            rows.append(expr([(all_gpu, G), (k, -1)]) <= 0)  # all -> every expert's k = G
            if objective == Objective.LATENCY:
                gfull = float(t.gpu_ms[l, e, -1]) / unit_ms
                gpu_terms += [(k, step * gfull)] + ([(full, -short * gfull)] if full else [])
                cpu = t.cpu_ms[l, e] / unit_ms  # (G+1,) convex in k
                if G == 1:  # cpu[0] * (1 - g)
                    cpu_terms.append((k, float(cpu[1] - cpu[0])))
                    cpu_const += float(cpu[0])
                else:
                    c = var(f"c_{l}_{e}", 0)  # epigraph of the expert's CPU time
                    cpu_terms.append((c, 1.0))
                    slope = np.diff(cpu)  # (G,) increasing
                    for g in range(G):
                        rows.append(expr([(c, 1), (k, -float(slope[g]))]) >= float(cpu[g] - slope[g] * g))
            else:
                share = t.share[l, e]  # (G+1,) concave in k
                if G == 1:
                    obj.append((k, float(w[l, e] * (share[1] - share[0]))))
                else:
                    v = var(f"v_{l}_{e}", 0)
                    obj.append((v, float(w[l, e])))
                    slope = np.diff(share)
                    for g in range(G):
                        rows.append(expr([(v, 1), (k, -float(slope[g]))]) <= float(share[g] - slope[g] * g))
        if objective == Objective.LATENCY:
            # t_l >= sync*(1 - all) + GPU and t_l >= sync*(1 - all) + CPU: the two devices work in parallel
            tl = var(f"t_{l}", 0)
            obj.append((tl, 1.0))
            s = float(p.sync_ms[l]) / unit_ms
            rows.append(expr([(tl, 1), (all_gpu, s)] + [(v, -c) for v, c in gpu_terms]) >= s)
            rows.append(expr([(tl, 1), (all_gpu, s)] + [(v, -c) for v, c in cpu_terms]) >= s + cpu_const)
    prob += expr(obj)
    prob += expr(memory) <= p.budget_bytes * mb, "memory"
    for i, r in enumerate(rows):
        prob.addConstraint(r, f"c{i}")
    r = run_highs(pulp, prob, ks, "expert placement", objective, unit_ms, time_limit, mip_gap, threads, t0)
    k, model_status, val, bound, gap = r.k.reshape(L, E), r.model_status, r.objective, r.bound, r.gap  # k (L, E)
    build, solve = r.build_seconds, r.solve_seconds
    status = "optimal" if model_status == "Optimal" else f"{model_status.lower()} (feasible)"
    if model_status != "Optimal":
        # stopped early (time limit): never hand back worse than the better of two heuristics (PuLP 3.3's HiGHS
        # interface takes no MIP start, and a partial one set on highspy left HiGHS's info unset)
        k0 = start_placement(p, objective, t)
        e0, e1 = evaluate_experts(p, k0, t), evaluate_experts(p, k, t)
        if (e0["latency_ms"] < e1["latency_ms"] if objective == Objective.LATENCY
                else e0["gpu_share_routed"] > e1["gpu_share_routed"]):
            k = k0
            val = (e0["latency_ms"] - p.fixed_ms.sum() - p.global_ms if objective == Objective.LATENCY
                   else e0["gpu_share_routed"])
            gap = abs(val - bound) / max(abs(val), 1e-12)
            status = f"{model_status.lower()} (the heuristic start: better than the solver's incumbent)"
    return IlpResult(k, status, val, bound, gap, build, solve, prob.numVariables(), prob.numConstraints())


def start_placement(p: ExpertProblem, objective: Objective, t: ExpertTables) -> np.ndarray:
    """The better, by the objective, of llama.cpp's --n-cpu-moe placement and whole experts taken greedily by routing
    probability per byte across layers: (layers, experts) k."""
    L, E = p.shape
    G = p.n_groups
    kn = np.zeros((L, E), np.int64)
    kn[n_cpu_moe_layers(p):] = G
    kg = np.zeros((L, E), np.int64)
    density = (p.counts / p.expert_bytes[:, None]).ravel()  # (layers * experts,) routed tokens per byte
    order = np.lexsort((np.arange(L * E), -density))
    fits = np.cumsum(np.repeat(p.expert_bytes, E)[order]) <= p.budget_bytes * (1 + 1e-12)
    kg.ravel()[order[fits]] = G  # a prefix of the densest experts
    ev = [evaluate_experts(p, k, t) for k in (kn, kg)]
    if objective == Objective.LATENCY:
        return (kn, kg)[int(ev[1]["latency_ms"] < ev[0]["latency_ms"])]
    return (kn, kg)[int(ev[1]["gpu_share_routed"] > ev[0]["gpu_share_routed"])]


def n_cpu_moe_layers(p: ExpertProblem) -> int:
    """llama.cpp's `-ngl 99 --n-cpu-moe N`: the experts of the first N layers stay on the CPU, every other expert on
    the GPU. The smallest N whose remaining experts fit the budget (L: none fit, all experts on the CPU)."""
    L, E = p.shape
    tail = np.concatenate([np.cumsum((p.expert_bytes * E)[::-1])[::-1], [0.0]])  # (L+1,) bytes of layers N..L-1
    return int(np.nonzero(tail <= p.budget_bytes * (1 + 1e-12))[0][0])


def baselines(p: ExpertProblem, k: np.ndarray, t: ExpertTables | None = None) -> dict:
    """Placements made without the solver, under the same cost model: llama.cpp's --n-cpu-moe N, and a uniform one
    (as many whole GPU experts per layer as ours holds experts' worth of bytes, ids 0..m-1: chosen without the
    profile)."""
    t = t or expert_tables(p)
    L, E = p.shape
    G = p.n_groups
    n = n_cpu_moe_layers(p)
    kn = np.zeros((L, E), np.int64)
    kn[n:] = G
    # (layers,) experts' worth of GPU bytes per layer in our placement (whole experts, or partial ones added up)
    m = np.floor(t.neurons[np.asarray(k)].sum(1) + 1e-9).astype(np.int64)
    ku = np.where(np.arange(E)[None, :] < m[:, None], G, 0)  # (layers, experts)
    out = {}
    for name, kk, extra in (("n_cpu_moe", kn, {"n": n}),
                            ("uniform", ku, {"gpu_experts_per_layer": m.tolist(),
                                             "expected_share": float((m / E).mean())})):
        ev = evaluate_experts(p, kk, t)
        out[name] = {**extra, "gpu_share_routed": ev["gpu_share_routed"], "expected_latency_ms": ev["latency_ms"],
                     "gpu_expert_bytes": int(ev["gpu_expert_bytes"]), "fits": ev["feasible"]}
    return out
