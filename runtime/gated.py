"""Whether a run decodes with mask 'gate' (gated models, no predictor: common/gating.py), its thresholds, and the
mask's compute for runtime/hybrid_ffn.HybridFFN (the CPU's gate-first call, the GPU's sparse hot rows).

A hybrid run of a gated model (SwiGLU, GeGLU) uses the gate mask when `--sparsity S` asks for it: the gate of each
neuron is its own exact predictor, so profile -> solve -> generate needs no training. Without the flag a run with no
predictors whose profile tabulates gated thresholds decodes dense (`default_sparsity`): on the 70B-class shape the
gate mask at the criterion that keeps SmolLM2's perplexity within 1.08x (`h` at 0.5) decoded slower than the dense
mask (docs/gated.md), so skipping neurons is the user's choice, not the default. `--sparsity 0` is the dense mask.
Both dense runtime builders (load.build_runtime, load.load_source_runtime) and check_run ask here, so they agree.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from hotneurons.common import artifacts
from hotneurons.common.artifacts import ArtifactError
from hotneurons.common.gating import profile_taus
from hotneurons.common.kinds import FixableError
from hotneurons.kernels import cold_q
from hotneurons.kernels.cold import ACT_CODE
from hotneurons.kernels.cold_experts import CODE
from hotneurons.kernels.cold_experts_sparse import scratch, sparse_layer
from hotneurons.runtime.config import RuntimeConfig

GATE_FIRST = ("reglu", "drelu", "swiglu", "geglu")  # activations with a gate the kernels test first


def profile_gated(run: Path | None) -> dict | None:
    """The `gated` section of RUN/profile/meta.json (thresholds per criterion and sparsity), or None."""
    p = None if run is None else run / "profile" / "meta.json"
    if p is None or not p.exists():
        return None
    meta = artifacts.read_json(p)
    return meta.get("gated") if isinstance(meta, dict) else None


def uses_gate(cfg: RuntimeConfig) -> bool:
    """Mask 'gate' for this run: hybrid (not oracle) with --sparsity > 0."""
    return cfg.mode == "hybrid" and not cfg.oracle and bool(cfg.sparsity)


def default_sparsity(run: Path | None, cfg: RuntimeConfig) -> RuntimeConfig:
    """cfg with sparsity 0 (dense) where a hybrid run without --sparsity has no predictors and its profile tabulates
    gated thresholds (a gated model's run: the module docstring says why dense); else cfg as it is."""
    if (cfg.mode != "hybrid" or cfg.oracle or cfg.sparsity is not None or run is None
            or (run / "predictors" / "predictors.safetensors").exists() or profile_gated(run) is None):
        return cfg
    from dataclasses import replace

    return replace(cfg, sparsity=0.0)


def gate_taus(run: Path | None, cfg: RuntimeConfig, activation: str, n_layers: int) -> list[tuple[float, float]]:
    """Per layer (tau_g, tau_h) of the run's profile for cfg.criterion (None: the profile's) at cfg.sparsity (None:
    the profile's target); refused in one line where the model has no gate or the profile no such table."""
    if activation not in GATE_FIRST:
        raise ArtifactError(f"--sparsity: a {activation} FFN has no gate to test first (gated sparsity needs SwiGLU, "
                            f"GeGLU, ReGLU or dReLU); leave --sparsity out")
    if run is None:
        raise ArtifactError("--sparsity needs a run's profile for its thresholds: pass --run RUN (pi-profile, "
                            "pi-solve)")
    try:
        _, _, taus = profile_taus(profile_gated(run), cfg.criterion, cfg.sparsity, where=str(run / "profile"))
    except FixableError as e:
        raise ArtifactError(str(e)) from None
    if len(taus) != n_layers:
        raise ArtifactError(f"{run / 'profile'} has gated thresholds for {len(taus)} layers, the model {n_layers}: "
                            f"re-run pi-profile for this model")
    return [(t.gate, t.h) for t in taus]


# ---------------------------------------------------------------------------------------------------------------
# The gate mask's compute, for runtime/hybrid_ffn.HybridFFN (`ffn`): its CPU part and its GPU part of a decode token


def gate_first(ffn, ready: np.ndarray, release: np.ndarray, i: int) -> int:
    """The CPU part: kernels/cold_experts_sparse.sparse_layer over the layer's cold rows as one expert (gate rows all
    read; up rows where |act(g)| > tau_g; down_t rows where |h| > tau_h too), its sum into the host buffers. Returns
    the passing cold neurons' count, or -1 when ready[i] never came."""
    c, io = ffn.cold, ffn.io
    if ffn._gate_args is None:
        def rows(a: np.ndarray) -> np.ndarray:  # bf16 bit patterns: int16 is how the kernel tells them from fp16
            return a.view(np.int16) if c.fmt is None else a
        one = np.zeros(1, np.int64)
        ffn._gate_args = (one, np.ones(1, np.float32), *scratch(1, ffn.n_cold), rows(c.gate), rows(c.up),
                          rows(c.down_t), CODE.get(c.fmt, -1), CODE.get(c.down_fmt, -1))
    one, w1, idx, hs, cnt, g, u, dt, f, fd = ffn._gate_args
    tg, th = ffn.taus
    return sparse_layer(ready, release, i, io.x_np, one, w1, one, one, g, u, dt, idx, hs, cnt, io.part, io.out,
                        ACT_CODE[ffn.activation], f, fd, cold_q.XQ, tg, th)


def hot_sparse(ffn, x: torch.Tensor) -> torch.Tensor:
    """The GPU part, one token on CUDA: (1, d) -> (1, d) by kernels/gated.gated_ffn (static buffers: graphs capture
    it), the passing hot neurons added to hot_passed from its workspace (its first count ids passed the gate; of them
    those whose |h| passes tau_h), with static shapes."""
    from hotneurons.kernels.gated import gated_ffn  # Triton: CUDA runs only

    q = ffn.hot_q or {"gate": ffn.gate_hot, "up": ffn.up_hot, "down_t": ffn.down_t_hot}
    ws, tau = ffn.gws, ffn.tau_dev  # tau (2,) float32: tau_g, tau_h
    y = gated_ffn(ffn.activation, x, q["gate"], q["up"], q["down_t"], tau[0:1], tau[1:2], ws)
    h = ws.a * ws.u[0]  # (n_hot,) rounded as the kernel rounds; past the count: stale values, masked below
    ok = (torch.arange(ffn.n_hot, device=x.device) < ws.count) & (h.float().abs() > tau[1])
    ffn.hot_passed.index_add_(0, ws.ids.long(), ok.int())
    return y if ffn.b_down is None else y + ffn.b_down
