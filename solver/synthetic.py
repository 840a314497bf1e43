"""Synthetic power-law profiles with real architecture shapes, for the benchmark, the notebook and tests.

The counts are not measured: each layer's activation probabilities follow a power law over the neuron's
rank calibrated to published ReLU-model figures (about 90% of FFN neurons inactive per token, about 20%
of the neurons serving about 80% of the activations), with per-layer variation.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pandas as pd
from hotneurons.artifacts.profile import ProfileMeta
from hotneurons.common.artifacts import staged, write_parquet
from hotneurons.common.kinds import Activation
from hotneurons.common.model_info import ModelInfo, ParamCounts


def llama_model_meta(name: str, n_layers: int, d_model: int, n_neurons: int, n_heads: int, n_kv_heads: int,
                     vocab_size: int, activation: str = "reglu", tied: bool = False) -> dict:
    """A profile's `model` dict for a LLaMA-architecture model (gated FFN, RMSNorm, no biases)."""
    hd = d_model // n_heads
    attn = 2 * d_model * d_model + 2 * d_model * n_kv_heads * hd + 2 * d_model  # q,o + k,v + 2 norms
    return ModelInfo(
        name=name, fingerprint=hashlib.sha256(name.encode()).hexdigest(), family="llama", model_type="llama",
        activation=activation, gated=True, n_layers=n_layers, d_model=d_model, n_neurons=n_neurons,
        num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, head_dim=hd, vocab_size=vocab_size,
        weight_dtype="float16",
        params=ParamCounts(embedding=vocab_size * d_model, lm_head=0 if tied else vocab_size * d_model, other=d_model,
                           attention_per_layer=(attn,) * n_layers,
                           ffn_per_layer=(3 * d_model * n_neurons,) * n_layers)).to_meta()


SHAPES = {
    "llama-70b": dict(n_layers=80, d_model=8192, n_neurons=28672, n_heads=64, n_kv_heads=8, vocab_size=32000),
    "llama-13b": dict(n_layers=40, d_model=5120, n_neurons=13824, n_heads=40, n_kv_heads=40, vocab_size=32000),
    "llama-7b": dict(n_layers=32, d_model=4096, n_neurons=11008, n_heads=32, n_kv_heads=32, vocab_size=32000),
}


def powerlaw_probs(n: int, alpha: float, mean: float, pmax: float = 0.95) -> np.ndarray:
    """(n,) activation probabilities by rank, p_r = pmax * (1 + r/r0)^-alpha, with r0 solved so that the
    mean is `mean` (the share of neurons active per token). alpha = 4 and mean = 0.1 put about 80% of
    the activations on the hottest 20% of the neurons."""
    r = np.arange(n, dtype=np.float64)  # (n,) rank
    lo, hi = 1e-6, 1e9
    for _ in range(200):  # bisection on log r0: the mean grows with r0
        r0 = float(np.sqrt(lo * hi))
        if (pmax * (1 + r / r0) ** -alpha).mean() < mean:
            lo = r0
        else:
            hi = r0
    return pmax * (1 + r / np.sqrt(lo * hi)) ** -alpha


def synthetic_counts(n_layers: int, n_neurons: int, tokens: int, seed: int = 0, mean: float = 0.10,
                     alpha: float = 4.0, spread: float = 0.25) -> list[np.ndarray]:
    """Per layer (n_neurons,) int64 counts in neuron-index order (ranks shuffled over neuron ids)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_layers):
        a = alpha * float(np.exp(rng.normal(0, spread)))  # layers differ in skew
        m = mean * float(np.exp(rng.normal(0, spread)))  # and in sparsity
        p = powerlaw_probs(n_neurons, a, min(m, 0.9))
        c = rng.binomial(tokens, p).astype(np.int64)  # (n_neurons,)
        out.append(c[rng.permutation(n_neurons)])
    return out


def write_profile(run_dir: str | Path, model: dict, counts: list[np.ndarray], tokens: int,
                  rule: str = "nonzero") -> Path:
    """Write RUN/profile/{neurons.parquet, meta.json} following pi-profile's contract."""
    run_dir = Path(run_dir)
    L = len(counts)
    df = pd.DataFrame({
        "layer": np.repeat(np.arange(L, dtype=np.int32), [len(c) for c in counts]),
        "neuron": np.concatenate([np.arange(len(c), dtype=np.int32) for c in counts]),
        "count": np.concatenate(counts).astype(np.int64),
    })
    meta = ProfileMeta(inputs={"synthetic": "power-law counts"}, tokens=int(tokens), rule=rule, model=model)
    with staged(run_dir / "profile") as partial:
        write_parquet(partial / "neurons.parquet", df)
        meta.save(partial / "meta.json")
    return run_dir


def write_synthetic_profile(run_dir: str | Path, shape: str = "llama-70b", tokens: int = 100_000, seed: int = 0,
                            n_layers: int | None = None, **kw) -> Path:
    s = dict(SHAPES[shape])
    if n_layers is not None:
        s["n_layers"] = n_layers
    model = llama_model_meta(f"synthetic-{shape}", **s)
    counts = synthetic_counts(s["n_layers"], s["n_neurons"], tokens, seed=seed, **kw)
    return write_profile(run_dir, model, counts, tokens)


# ---------------------------------------------------------------------------------------------------------------
# Mixtures of experts: router counts with a Zipf-like skew per layer, neuron counts inside each expert

MOE_SHAPES = {  # published configs (HF config.json of each model)
    "mixtral-8x7b": dict(n_layers=32, d_model=4096, n_ff_exp=14336, n_experts=8, n_experts_used=2, n_ff_shexp=0,
                         n_heads=32, n_kv_heads=8, head_dim=128, vocab_size=32000, norm_topk=True),
    "qwen1.5-moe-a2.7b": dict(n_layers=24, d_model=2048, n_ff_exp=1408, n_experts=60, n_experts_used=4,
                              n_ff_shexp=5632, n_heads=16, n_kv_heads=16, head_dim=128, vocab_size=151936,
                              norm_topk=False),
    "qwen3-30b-a3b": dict(n_layers=48, d_model=2048, n_ff_exp=768, n_experts=128, n_experts_used=8, n_ff_shexp=0,
                          n_heads=32, n_kv_heads=4, head_dim=128, vocab_size=151936, norm_topk=True),
}


def moe_model_meta(name: str, n_layers: int, d_model: int, n_ff_exp: int, n_experts: int, n_experts_used: int,
                   n_ff_shexp: int, n_heads: int, n_kv_heads: int, head_dim: int, vocab_size: int,
                   norm_topk: bool = True, activation: str = "swiglu", tied: bool = False) -> dict:
    """A profile's `model` dict for a mixture of experts with LLaMA's attention (models/moe.py): `n_neurons` is the
    neurons of one expert; `attention_per_layer` every parameter of a layer outside its MoE FFN (router, experts,
    shared expert), which `ffn_per_layer` holds."""
    attn = d_model * n_heads * head_dim * 2 + d_model * n_kv_heads * head_dim * 2 + 2 * d_model  # q,o + k,v + norms
    shexp = 3 * d_model * n_ff_shexp + (d_model if n_ff_shexp else 0)  # rows + its sigmoid gate
    ffn = n_experts * 3 * d_model * n_ff_exp + n_experts * d_model + shexp  # experts + router + shared expert
    return ModelInfo(
        name=name, fingerprint=hashlib.sha256(name.encode()).hexdigest(), family="moe",
        model_type="qwen2_moe" if n_ff_shexp else "mixtral", activation=activation, gated=True, n_layers=n_layers,
        d_model=d_model, n_neurons=n_ff_exp, num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
        head_dim=head_dim, vocab_size=vocab_size, weight_dtype="float16",
        params=ParamCounts(embedding=vocab_size * d_model, lm_head=0 if tied else vocab_size * d_model, other=d_model,
                           attention_per_layer=(attn,) * n_layers, ffn_per_layer=(ffn,) * n_layers)).to_meta()


def synthetic_routing(n_layers: int, n_experts: int, k: int, tokens: int, seed: int = 0, skew: float = 0.8,
                      spread: float = 0.3, chunk: int = 8192) -> tuple[np.ndarray, np.ndarray]:
    """((layers, experts) int64 counts, (layers, experts) float64 weight sums): each token picks k distinct experts,
    expert e with Zipf-like preference (1 + rank)^-s, s = skew * exp(N(0, spread)) per layer (layers differ in how
    skewed their routers are), ranks shuffled over expert ids. Sampled exactly (Gumbel top-k), so every token counts
    k experts, as a router's top-k does."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((n_layers, n_experts), np.int64)  # (layers, experts)
    wsum = np.zeros((n_layers, n_experts), np.float64)  # (layers, experts)
    for l in range(n_layers):
        s = skew * float(np.exp(rng.normal(0, spread)))
        logit = -s * np.log1p(np.arange(n_experts))[rng.permutation(n_experts)]  # (experts,)
        for t0 in range(0, tokens, chunk):
            g = logit + rng.gumbel(size=(min(chunk, tokens - t0), n_experts))  # (chunk, experts)
            top = np.argpartition(-g, k - 1, axis=1)[:, :k]  # (chunk, k)
            w = np.exp(np.take_along_axis(g, top, 1))  # (chunk, k) a softmax-like weight per pick
            counts[l] += np.bincount(top.ravel(), minlength=n_experts)
            wsum[l] += np.bincount(top.ravel(), weights=(w / w.sum(1, keepdims=True)).ravel(), minlength=n_experts)
    return counts, wsum


def write_moe_profile(run_dir: str | Path, model: dict, experts: dict, counts: np.ndarray, weight_sum: np.ndarray,
                      tokens: int, neurons: np.ndarray | None = None, shared: np.ndarray | None = None,
                      rule: str = "nonzero") -> Path:
    """RUN/profile/{experts.parquet, neurons.parquet, meta.json} in pi-profile's MoE contract. counts, weight_sum:
    (layers, experts); neurons: (layers, experts, n_ff_exp) counts among the tokens routed to each expert, or None
    (then neurons.parquet holds the shared expert only, or no rows); shared: (layers, n_ff_shexp), expert -1."""
    run_dir = Path(run_dir)
    L, E = counts.shape
    edf = pd.DataFrame({"layer": np.repeat(np.arange(L, dtype=np.int32), E),
                        "expert": np.tile(np.arange(E, dtype=np.int32), L),
                        "count": counts.ravel().astype(np.int64), "weight_sum": weight_sum.ravel().astype(np.float64)})
    parts = []
    for arr, expert_ids in ((neurons, np.arange(E)), (None if shared is None else shared[:, None], [-1])):
        if arr is None:
            continue
        _, n_e, n = arr.shape
        parts.append(pd.DataFrame({
            "layer": np.repeat(np.arange(L, dtype=np.int32), n_e * n),
            "expert": np.tile(np.repeat(np.asarray(expert_ids, np.int32), n), L),
            "neuron": np.tile(np.arange(n, dtype=np.int32), L * n_e), "count": arr.ravel().astype(np.int64)}))
    ndf = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(
        {"layer": np.zeros(0, np.int32), "expert": np.zeros(0, np.int32), "neuron": np.zeros(0, np.int32),
         "count": np.zeros(0, np.int64)})
    meta = ProfileMeta(inputs={"synthetic": "Zipf-like router counts"}, tokens=int(tokens), rule=rule, model=model,
                       extras={"experts": dict(experts)})
    with staged(run_dir / "profile") as partial:
        write_parquet(partial / "experts.parquet", edf)
        write_parquet(partial / "neurons.parquet", ndf)
        meta.save(partial / "meta.json")
    return run_dir


def write_synthetic_moe_profile(run_dir: str | Path, shape: str = "qwen3-30b-a3b", tokens: int = 20_000,
                                seed: int = 0, n_layers: int | None = None, activation: str = "swiglu",
                                neurons: bool | None = None, skew: float = 0.8, **kw) -> Path:
    """A MoE profile of a real model's shapes. Neuron counts (a power law inside each expert, see powerlaw_probs)
    are written for ReLU-family activations unless `neurons` says otherwise."""
    s = dict(MOE_SHAPES[shape])
    if n_layers is not None:
        s["n_layers"] = n_layers
    model = moe_model_meta(f"synthetic-{shape}", activation=activation, **s)
    L, E, k, n = s["n_layers"], s["n_experts"], s["n_experts_used"], s["n_ff_exp"]
    counts, wsum = synthetic_routing(L, E, k, tokens, seed=seed, skew=skew)
    rng = np.random.default_rng(seed + 1)
    if neurons if neurons is not None else Activation(activation).relu_family:
        per = np.stack([np.stack([rng.binomial(int(counts[l, e]), powerlaw_probs(n, 4.0, 0.1))[rng.permutation(n)]
                                  for e in range(E)]) for l in range(L)])  # (layers, experts, n_ff_exp)
    else:
        per = None
    shared = (np.stack([rng.binomial(tokens, powerlaw_probs(s["n_ff_shexp"], 4.0, 0.1)) for _ in range(L)])
              if s["n_ff_shexp"] and per is not None else None)  # (layers, n_ff_shexp)
    experts = {"n_experts": E, "n_experts_used": k, "n_ff_exp": n, "n_ff_shexp": s["n_ff_shexp"],
               "norm_topk": s["norm_topk"]}
    return write_moe_profile(run_dir, model, experts, counts, wsum, tokens, per, shared, **kw)
