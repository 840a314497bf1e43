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


def llama_model_meta(name: str, n_layers: int, d_model: int, n_neurons: int, n_heads: int, n_kv_heads: int,
                     vocab_size: int, activation: str = "reglu", tied: bool = False) -> dict:
    """A profile's `model` dict for a LLaMA-architecture model (gated FFN, RMSNorm, no biases)."""
    hd = d_model // n_heads
    attn = 2 * d_model * d_model + 2 * d_model * n_kv_heads * hd + 2 * d_model  # q,o + k,v + 2 norms
    return {
        "name": name, "fingerprint": hashlib.sha256(name.encode()).hexdigest(), "family": "llama",
        "model_type": "llama", "activation": activation, "gated": True, "n_layers": n_layers, "d_model": d_model,
        "n_neurons": n_neurons, "ffn_bias": False, "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads,
        "head_dim": hd, "vocab_size": vocab_size, "weight_dtype": "float16",
        "params": {"embedding": vocab_size * d_model, "lm_head": 0 if tied else vocab_size * d_model,
                   "other": d_model, "attention_per_layer": [attn] * n_layers,
                   "ffn_per_layer": [3 * d_model * n_neurons] * n_layers},
    }


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
