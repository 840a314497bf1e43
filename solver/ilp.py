"""The placement ILP, built with PuLP and solved by HiGHS (see docs/solver.md for the formulation).

Per layer one integer k_l (groups on the GPU, a prefix of the hottest groups) and two binaries:
full_l (the whole layer is on the GPU, so no sync and the last, possibly short, group is in) and on_l
(the layer uses the GPU at all, for the communication minimum K_l). Because groups are sorted by count,
the activations served by a prefix are concave in k and the CPU time convex, so each is an exact
piecewise-linear function of the integer k_l, written as one row per breakpoint. This is equivalent to
one binary per group with prefix constraints, but the MIP branches on 3 variables per layer, not 450.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from hotneurons.artifacts.placement import Objective
from hotneurons.common.cli import stdout_to_stderr
from hotneurons.common.kinds import choose

from .cost import LayerTables, PlacementProblem, SolverError, layer_tables

OBJECTIVES = Objective.values()


@dataclass(frozen=True)
class IlpResult:
    k: np.ndarray  # (layers,) groups on the GPU
    status: str  # "optimal", "time limit (feasible)", ...
    objective: float  # the solver's objective: ms/token of FFN+sync (latency) or GPU activation share
    bound: float  # the best proven bound on it
    gap: float  # relative gap the solver proved, |objective - bound| / |objective|
    build_seconds: float
    solve_seconds: float
    n_variables: int
    n_constraints: int


def _pulp():
    try:
        import pulp
    except ImportError:
        raise SolverError("PuLP is not installed: pip install 'pulp>=2.8' 'highspy>=1.7'") from None
    solver = pulp.HiGHS(msg=False)
    if not solver.available():
        raise SolverError("the HiGHS solver is not available to PuLP: pip install 'highspy>=1.7'")
    return pulp


def new_var(pulp, prob, name: str, low=None, up=None, cat: str = "Continuous"):
    """A variable of `prob`: through the problem on PuLP >= 3.3 (add_variable), else PuLP's constructor."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, low, up, cat=cat)


@dataclass(frozen=True)
class Solved:
    """What run_highs gives back: the integer values of `ks`, and the solver's figures in the objective's units."""

    k: np.ndarray  # (len(ks),) int64
    model_status: str  # HiGHS's words: "Optimal", "Time limit reached", ...
    objective: float
    bound: float
    gap: float
    build_seconds: float
    solve_seconds: float


def run_highs(pulp, prob, ks: list, what: str, objective: Objective, unit_ms: float, time_limit: float,
              mip_gap: float, threads: int | None, t0: float) -> Solved:
    """Solve `prob` (built since t0) with HiGHS; refuse in one line where it found no `what` in the time limit. The
    objective comes back from units of unit_ms (latency), or negated back (PuLP hands HiGHS -objective to
    maximise)."""
    solver = pulp.HiGHS(msg=False, timeLimit=time_limit, gapRel=mip_gap, threads=threads)
    build = time.perf_counter() - t0
    t1 = time.perf_counter()
    with stdout_to_stderr():  # HiGHS prints its banner to fd 1 even with msg=False: never into a caller's stdout
        prob.solve(solver)
    solve = time.perf_counter() - t1
    h = prob.solverModel
    info = h.getInfo()
    model_status = h.modelStatusToString(h.getModelStatus())
    if any(v.varValue is None for v in ks):
        raise SolverError(f"HiGHS found no {what} ({model_status}) within {time_limit:g} s: raise the time limit",
                          params="time_limit")
    k = np.array([int(round(v.varValue)) for v in ks], dtype=np.int64)
    scale = unit_ms if objective == Objective.LATENCY else -1.0
    obj = float(pulp.value(prob.objective)) * abs(scale)
    bound = float(info.mip_dual_bound) * scale
    return Solved(k, model_status, obj, bound, abs(obj - bound) / max(abs(obj), 1e-12), build, solve)


def solve_ilp(p: PlacementProblem, objective: Objective | str = Objective.LATENCY, time_limit: float = 30.0,
              mip_gap: float = 1e-3,
              threads: int | None = None, tables: LayerTables | None = None) -> IlpResult:
    objective = choose(objective, Objective, "objective", SolverError, "objective")
    pulp = _pulp()
    t0 = time.perf_counter()
    t = tables or layer_tables(p)
    G_l = p.n_groups  # (layers,)
    short = G_l * p.group_size - t.neurons[np.arange(p.n_layers), G_l]  # (layers,) neurons missing from the last group
    # Rows are scaled so that their coefficients are near 1 whatever the model's size, because HiGHS's
    # tolerances are absolute (1e-7): memory in units of the largest group's bytes, time in units of
    # the slowest layer's all-CPU FFN time.
    mb = 1.0 / float(p.group_size * p.bytes_per_neuron.max())  # 1 / bytes
    unit_ms = float((t.cpu_ms[:, 0] + p.sync_ms).max()) or 1.0  # ms
    total_counts = max(float(t.counts[:, -1].sum()), 1e-300)

    sense = pulp.LpMinimize if objective == Objective.LATENCY else pulp.LpMaximize
    prob = pulp.LpProblem("placement", sense)

    def var(name, low=None, up=None, cat="Continuous"):
        return new_var(pulp, prob, name, low, up, cat)

    memory_terms, obj_terms = [], []
    ks, rows = [], []
    for l in range(p.n_layers):
        G = int(G_l[l])
        k = var(f"k_{l}", 0, G, pulp.LpInteger)
        full = var(f"full_{l}", 0, 1, pulp.LpBinary)
        ks.append(k)
        bpg = p.group_size * p.bytes_per_neuron[l] * mb  # MB per full group
        memory_terms += [(k, bpg), (full, -short[l] * p.bytes_per_neuron[l] * mb)]
        rows.append(pulp.LpAffineExpression([(k, 1), (full, -G)]) >= 0)  # full -> k = G
        rows.append(pulp.LpAffineExpression([(k, 1), (full, -1)]) <= G - 1)  # k = G -> full
        K = int(p.min_groups[l])
        if K > 1:
            on = var(f"on_{l}", 0, 1, pulp.LpBinary)
            rows.append(pulp.LpAffineExpression([(k, 1), (on, -K)]) >= 0)  # on -> k >= K_l
            rows.append(pulp.LpAffineExpression([(k, 1), (on, -G)]) <= 0)  # k > 0 -> on
        if objective == Objective.LATENCY:
            # t_l >= sync*(1-full) + GPU(k), with GPU(k) = ms/neuron * (group_size*k - short*full), and
            # t_l >= sync*(1-full) + CPU(k); CPU(k) is convex piecewise linear in k (breakpoints at each group),
            # one row per segment.
            tl = var(f"t_{l}", 0)
            obj_terms.append((tl, 1.0))
            s = float(p.sync_ms[l]) / unit_ms
            gpn = float(p.gpu_ms_per_neuron[l]) / unit_ms
            rows.append(pulp.LpAffineExpression([(tl, 1), (k, -p.group_size * gpn), (full, s + short[l] * gpn)]) >= s)
            cpu = t.cpu_ms[l, : G + 1] / unit_ms  # (G+1,)
            slope = np.diff(cpu)  # (G,) ms per group, increasing (less negative) with g
            for g in range(G):
                # t - slope_g*k + s*full >= cpu_g - slope_g*g + s
                rows.append(pulp.LpAffineExpression([(tl, 1), (k, -float(slope[g])), (full, s)])
                            >= float(cpu[g] - slope[g] * g + s))
        else:
            # v_l <= V(k), V concave piecewise linear: the share of the model's activations the GPU serves.
            vl = var(f"v_{l}", 0)
            obj_terms.append((vl, 1.0))
            V = t.counts[l, : G + 1] / total_counts  # (G+1,)
            slope = np.diff(V)  # (G,) decreasing
            for g in range(G):
                rows.append(pulp.LpAffineExpression([(vl, 1), (k, -float(slope[g]))]) <= float(V[g] - slope[g] * g))
    prob += pulp.LpAffineExpression(obj_terms)
    prob += pulp.LpAffineExpression(memory_terms) <= p.budget_bytes * mb, "memory"
    for i, r in enumerate(rows):
        prob.addConstraint(r, f"c{i}")

    r = run_highs(pulp, prob, ks, "placement", objective, unit_ms, time_limit, mip_gap, threads, t0)
    status = "optimal" if r.model_status == "Optimal" else f"{r.model_status.lower()} (feasible)"
    return IlpResult(r.k, status, r.objective, r.bound, r.gap, r.build_seconds, r.solve_seconds,
                     prob.numVariables(), prob.numConstraints())
