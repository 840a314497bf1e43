"""Batched decoding in the cost model (pi-serve --parallel B): B sequences decode together, one step a token for all.

The hot rows and the attention's weights are read once a step for the B tokens; a cold neuron is read once a step
where any of the B tokens needs it. With firing probability p_j (the profile's count / tokens) and B independent
sequences (different requests), that is the union's expected share u_j(B) = 1 - (1 - p_j)^B, which grows with B
slower where the firing skew is strong (a hot set with p near 1 stays near 1; a cold neuron of p << 1 grows as B p).
`measured_union` checks it on the profile's token masks (B rows drawn at random: other contexts). Each sequence also
has its own KV cache slot: pi-solve --parallel counts them in memory_items' kv_cache.

The layer split (llama.cpp -ngl N at the same budget) reads every weight of its layers once a step, whatever B: the
step time of a memory-bound model does not grow with B until compute bounds it, which this model leaves out (in the
layer split's favour). So the hybrid's aggregate rate B / step grows slower than the layer split's as B grows, and
`batch_table` says from which B the layer split's aggregate rate is the higher one (`stops_paying_at`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hotneurons.common.hardware import HardwareSpec
from hotneurons.common.model_info import ModelInfo

from .cost import LayerTables, PlacementProblem

BATCHES = (1, 2, 4, 8)


def union_share(freq: np.ndarray, B: int) -> np.ndarray:
    """(n,) expected share of steps in which each neuron is needed by at least one of B independent tokens."""
    return 1.0 - np.power(1.0 - np.clip(freq, 0.0, 1.0), B)


def layer_split_ms(p: PlacementProblem, shape: ModelInfo, hw: HardwareSpec, dtype_bytes: float,
                   predictor_bytes: float = 0.0) -> tuple[int, float]:
    """(layers on the GPU, ms a step) of the layer split in the same budget: whole layers on the GPU while they fit
    (the bytes the hybrid gives its FFN neurons and its predictors, which a layer split has none of, plus the
    attention and fixed FFN weights it keeps there anyway), the rest read from DRAM (HardwareSpec.stream_bw),
    memory-bound either way."""
    L = p.n_layers
    layer = [(shape.params.attention_per_layer[l] + shape.ffn_fixed_params(l)) * dtype_bytes
             + float(p.group_neurons[l].sum() * p.bytes_per_neuron[l]) for l in range(L)]  # bytes a layer
    fixed = sum((shape.params.attention_per_layer[l] + shape.ffn_fixed_params(l)) * dtype_bytes for l in range(L))
    room = p.budget_bytes + predictor_bytes + fixed  # bytes
    n, used = 0, 0.0
    while n < L and used + layer[n] <= room:
        used += layer[n]
        n += 1
    gpu_bw = hw.gpu_bw if hw.has_gpu else hw.stream_bw
    # its CPU layers stream whole matrices: DRAM's rate, not the cold kernel's on scattered rows (cpu_bw measured)
    ms = sum(layer[:n]) / gpu_bw * 1e3 + sum(layer[n:]) / hw.stream_bw * 1e3 + p.global_ms
    return n, ms + (hw.sync_latency_s * 1e3 if 0 < n < L else 0.0)


def batch_table(p: PlacementProblem, t: LayerTables, k: np.ndarray, counts: list[np.ndarray], shape: ModelInfo,
                hw: HardwareSpec, dtype_bytes: float, batches: tuple[int, ...] = BATCHES,
                predictor_bytes: float = 0.0) -> dict:
    """Per batch size B: the expected step, the aggregate tokens/s of B sequences, the cold rows a step reads per
    token, and the layer split's aggregate rate at the same budget; `stops_paying_at`: the first B (of `batches`,
    then doubling up to 64) where the layer split's aggregate rate is the higher (None: never up to 64).
    counts: per layer the neurons' activation counts sorted descending (the placement's order: the first
    t.neurons[l, k[l]] are on the GPU); predictor_bytes: the hybrid's predictors on the GPU, room the layer split
    fills with layers."""
    rows = np.arange(p.n_layers)
    hot = t.neurons[rows, k].astype(np.int64)  # (layers,)
    split_layers, split_ms = layer_split_ms(p, shape, hw, dtype_bytes, predictor_bytes)

    def at(B: int) -> dict:
        cold_rows, step = 0.0, p.global_ms
        for l, c in enumerate(counts):
            u = union_share(c[hot[l]:] / p.tokens, B)  # (cold,)
            cold_rows += float(u.sum())
            cpu = float(u.sum()) * p.cpu_ms_per_activation[l]
            if p.cpu_ms_per_cold_neuron is not None:
                cpu += len(u) * p.cpu_ms_per_cold_neuron[l]
            sync = p.sync_ms[l] if k[l] < p.n_groups[l] else 0.0
            step += p.fixed_ms[l] + sync + max(float(t.gpu_ms[l, k[l]]), cpu)
        return {"step_ms": step, "tokens_per_s": B * 1e3 / step, "cold_rows_per_token": cold_rows / B,
                "layer_split_tokens_per_s": B * 1e3 / split_ms,
                "vs_layer_split": split_ms / step}

    table = {str(B): at(B) for B in batches}
    stops = next((B for B in batches if table[str(B)]["vs_layer_split"] < 1.0), None)
    B = max(batches)
    while stops is None and B < 64:
        B *= 2
        if at(B)["vs_layer_split"] < 1.0:
            stops = B
    return {"batches": table, "stops_paying_at": stops, "layer_split_gpu_layers": split_layers,
            "model": "independent sequences: a cold neuron is read when any of the B tokens needs it; the layer "
                     "split memory-bound at any B (solver/batching.py)"}


def measured_union(samples: Path, cold: list[np.ndarray], batches: tuple[int, ...] = BATCHES, draws: int = 64,
                   seed: int = 0) -> dict[str, float] | None:
    """Mean cold neurons a step reads per token, measured on the profile's token masks (samples/layer_XXX.mask.npy,
    packed bits): B rows drawn at random, their masks' union over each layer's cold neurons `cold[l]` (indices);
    None where the profile kept no samples."""
    paths = [samples / f"layer_{l:03d}.mask.npy" for l in range(len(cold))]
    if not all(q.exists() for q in paths):
        return None
    rng = np.random.default_rng(seed)
    out = {}
    masks = [np.load(q, mmap_mode="r") for q in paths]
    rows = masks[0].shape[0]
    if rows == 0:
        return None
    for B in batches:
        total = 0.0
        for _ in range(draws):
            pick = np.sort(rng.choice(rows, size=min(B, rows), replace=False))
            for m, c in zip(masks, cold):
                bits = np.unpackbits(np.asarray(m[pick]), axis=1)[:, c]  # (B, cold) bool, big bit order (np.packbits)
                total += float(bits.any(0).sum())
        out[str(B)] = total / draws / B
    return out

