"""The bench MoE models' routers (bench/moe_gguf.py): per-expert pick shares fitted to one published figure per model
(ROUTING; moe_gguf's docstring cites them), and the router whose top-k picks on a layer's inputs follow them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from bench.moe_gguf import MoEShape

CAL_STEPS = 200
# the targets' one number per model (moe_gguf's docstring): (share of experts, share of routed picks they receive)
ROUTING = {"qwen3-30b-a3b": (65 / 128, 0.90), "mixtral-8x7b": (2 / 8, 0.35)}
REPORT_FRAC = 0.25  # the calibration reports the share of the picks the hottest quarter of the experts receive


def zipf_shares(E: int, k: int, s: float) -> np.ndarray:
    """(E,) pick shares by rank, sum k, f_r ~ (1 + r)^-s capped at 1 (an expert is picked once a token at most)."""
    f = (1.0 + np.arange(E)) ** -s
    for _ in range(100):
        f = np.minimum(1.0, f * k / f.sum())
    return f


def top_share(f: np.ndarray, frac: float) -> float:
    """Share of the picks the hottest `frac` of the experts receive (fractional experts interpolated)."""
    c = np.concatenate([[0.0], np.cumsum(np.sort(f)[::-1])]) / f.sum()
    x = frac * len(f)
    i = int(np.floor(x))
    return float(c[i] + (x - i) * (c[min(i + 1, len(f))] - c[i]))


def target_shares(shape: MoEShape, routing: str) -> np.ndarray:
    """(E,) the target pick shares by rank (sum k): ROUTING's figure for the shape, or uniform."""
    E, k = shape.n_experts, shape.k
    if routing == "uniform":
        return np.full(E, k / E)
    frac, share = ROUTING[shape.routing_key]
    lo, hi = 0.0, 8.0
    for _ in range(60):  # the top share grows with s
        s = (lo + hi) / 2
        lo, hi = (s, hi) if top_share(zipf_shares(E, k, s), frac) < share else (lo, s)
    return zipf_shares(E, k, (lo + hi) / 2)


def _route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """models/moe.route's renormalised top-k (both shapes renormalise): (weights (T, k), ids (T, k))."""
    probs = torch.softmax(logits, -1)
    top, idx = torch.topk(probs, k, -1)
    return top / top.sum(-1, keepdim=True), idx


def _router(x: torch.Tensor, target: np.ndarray, k: int, g: torch.Generator, seed: int,
            layer: int) -> tuple[torch.Tensor, np.ndarray, dict]:
    """The router (E, d) float32 whose top-k picks on x (T, d) follow `target` (by rank; the ranks' expert ids a
    permutation of the layer's), its measured (E,) pick shares and the fit's figures."""
    E, (T, d) = len(target), x.shape
    f = torch.from_numpy(target[np.random.default_rng(seed * 7919 + layer).permutation(E)]).to(x.device)  # by id
    w = torch.randn((E, d), generator=g, device=x.device) / d ** 0.5
    w[:, 0] = 0.0
    content = x @ w.T  # (T, E) the logits without the bias
    b = torch.log(f.float())
    best, best_err = b, float("inf")
    for r in range(CAL_STEPS):
        idx = torch.topk(content + b * x[:, :1], k, -1).indices  # (T, k)
        c = torch.bincount(idx.ravel(), minlength=E).float() / T  # (E,) picks a token
        err = float((c - f).abs().max())
        if err < best_err:
            best, best_err = b, err
        # a step that shrinks from 0.5 to 0.02: a fixed one overshoots where an expert's picks respond steeply to its
        # bias (an expert with no picks gets a step of log(f T), and then takes most tokens), and never settles
        b = b + 0.5 * 0.025 ** (r / CAL_STEPS) * (torch.log(f.float()) - torch.log(c + 0.5 / T))
    w[:, 0] = best
    idx = torch.topk(x @ w.T, k, -1).indices
    c = (torch.bincount(idx.ravel(), minlength=E).double() / T).cpu().numpy()
    frac = REPORT_FRAC
    row = {"top_share": top_share(c, frac), "target_top_share": top_share(target, frac),
           "max_abs_error": float(np.abs(c - f.cpu().numpy()).max()), "picks_per_token": float(c.sum())}
    return w, c, row
