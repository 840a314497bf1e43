"""Expert predictors for a mixture of sparse experts (a gated ReLU-family activation: reglu, drelu), fitted from the
model's own gates on the experts' real inputs: what `pi-train-predictors` writes for such a run
(runtime/expert_predictors.py reads the file; docs/predictors.md, "Expert predictors").

The model streams --tokens of the profile's corpus layer by layer (models/streamed_experts.ExpertsModel), keeping up
to `samples` routed inputs x of every (layer, expert). Expert e's gate G (n, d), de-quantized, then gets the rank-r
predictor that best reproduces its pre-activations on those inputs: with Y = X G^T (m, n) and U_r the top r left
singular vectors of Y^T, B = U_r (n, r) and A = U_r^T G (r, d), so that B (A x) is G x projected on the r directions
that carry most of it for this expert's inputs (least squares over the samples). A neuron j is marked where
(B A x)_j > t_j, t_j = -k sigma_j, sigma_j the score's error against g_j on the fitting samples and k the smallest
that reaches `recall` of the firing neurons (g > 0) on held-out samples (a fifth of them). No training loop: a
minute or two for a Mixtral-sized model on a GPU; the recall and the share of neurons marked are in the summary,
which says whether the predictors pay (the share marked against the gate's firing share).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from hotneurons.models.ffn_hooks import StageHooks

SPARSE_GATED = ("reglu", "drelu")  # activations whose neuron is exactly zero where relu(gate) is
K_GRID = tuple(np.round(np.arange(0.0, 8.01, 0.25), 2))  # thresholds tried, in units of the score's error
HELD_OUT = 0.2


class ExpertInputs(StageHooks):
    """Entered on a streamed mixture of experts: the first `samples` routed inputs of every (layer, expert), float16 on
    the host (the stages' consumer protocol: models/ffn_hooks.StageHooks, streamed_experts.ExpertFFN)."""

    def __init__(self, lm, samples: int):
        super().__init__(lm)
        self.samples = samples
        L, E = lm.cfg.n_layers, lm.cfg.n_experts
        self.x: list[list[list[torch.Tensor]]] = [[[] for _ in range(E)] for _ in range(L)]
        self.kept = np.zeros((L, E), np.int64)

    def on_expert_input(self, i: int, e: int, x: torch.Tensor) -> None:
        room = self.samples - int(self.kept[i, e])
        if room > 0:
            self.x[i][e].append(x[:room].to("cpu", torch.float16))
            self.kept[i, e] += min(room, x.shape[0])

    def inputs(self, i: int, e: int) -> torch.Tensor | None:
        return torch.cat(self.x[i][e]) if self.x[i][e] else None

    def on_route(self, i, weights, idx) -> None:
        pass

    def on_expert(self, i, e, h) -> None:
        return None


def fit_expert(gate: torch.Tensor, x: torch.Tensor, rank: int, recall: float, seed: int = 0) -> dict:
    """One expert's predictor from its gate (n, d) and routed inputs x (m, d), float32 on one device: A (r, d),
    B (n, r), t (n,) as float32 numpy, and its held-out recall, share marked and the gate's firing share."""
    m = x.shape[0]
    order = torch.randperm(m, generator=torch.Generator().manual_seed(seed)).to(x.device)
    held = max(1, int(m * HELD_OUT))
    xh, xf = x[order[:held]], x[order[held:]]
    yf, yh = xf @ gate.T, xh @ gate.T  # (m, n) the gate's pre-activations
    r = min(rank, xf.shape[0] - 1, gate.shape[0])
    U, _, _ = torch.svd_lowrank(yf.T, q=min(r + 8, min(yf.shape)), niter=4)  # (n, q): Y^T's top singular vectors
    B = U[:, :r].contiguous()  # (n, r)
    A = B.T @ gate  # (r, d)
    sigma = ((xf @ A.T) @ B.T - yf).std(0).clamp(min=1e-12)  # (n,) the score's error on the fitting samples
    score, fires = (xh @ A.T) @ B.T, yh > 0
    firing = max(1, int(fires.sum()))
    k = K_GRID[-1]
    for k in K_GRID:
        if float(((score > -k * sigma) & fires).sum()) / firing >= recall:
            break
    t = -k * sigma
    marked = score > t
    return {"a": A.float().cpu().numpy(), "b": B.float().cpu().numpy(), "t": t.float().cpu().numpy(), "k": float(k),
            "recall": float((marked & fires).sum()) / firing, "marked": float(marked.float().mean()),
            "fires": float(fires.float().mean()), "samples": m}


def fit_expert_predictors(run_dir: str | Path, rank: int = 32, recall: float = 0.99, tokens: int = 8192,
                          samples: int = 1024, device: str = "auto", progress: bool = True) -> dict:
    """Fit every expert's predictor of the run's model (its profile's corpus, model and activation) into
    RUN/predictors/expert_predictors.safetensors; returns the summary (also RUN/predictors/expert_predictors.json).
    Experts with fewer than 4 r routed samples get none (their gate rows are read whole)."""
    from hotneurons.artifacts.expert_predictors import path_in, save
    from hotneurons.artifacts.profile import check_profile
    from hotneurons.common import artifacts
    from hotneurons.common.corpus import iter_texts, token_batches
    from hotneurons.common.kinds import FixableError
    from hotneurons.models.streamed import meta_source
    from hotneurons.models.streamed_experts import open_experts
    from tqdm import tqdm

    run_dir = Path(run_dir)
    meta = check_profile(run_dir)
    pc = meta.config or {}
    dev = "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    path, gguf, activation = meta_source(meta.model)
    lm = open_experts(path, gguf, activation=activation, device=dev, ctx=int(pc.get("seq_len", 512)))
    if lm is None:
        raise FixableError(f"{run_dir / 'profile'} is not a mixture of experts' profile: expert predictors are for "
                           f"sparse experts (train a dense model's predictors with pi-train-predictors)", params="run")
    if lm.activation not in SPARSE_GATED:
        raise FixableError(f"the run's experts use {lm.activation}: expert predictors are for sparse gated experts "
                           f"({', '.join(SPARSE_GATED)}), whose unmarked neurons are exact zeros; a {lm.activation} "
                           f"mixture of experts needs no predictors (its router picks the experts): run `pi-solve "
                           f"--run {run_dir}`, then `pi-generate --run {run_dir}`", params="run")
    if rank < 1 or not 0 < recall <= 1:
        raise FixableError(f"--expert-rank {rank} and --target-recall {recall}: the rank must be >= 1 and the recall "
                           f"in (0, 1]", params=("expert_rank", "target_recall"))
    t0 = time.perf_counter()
    cfg = lm.cfg
    batches = token_batches(lm.tokenizer, iter_texts(pc.get("dataset", "wikipedia-sample"), pc.get("text_column",
                            "text")), int(pc.get("seq_len", 512)), int(pc.get("batch_size", 8)), tokens)
    with torch.inference_mode(), ExpertInputs(lm, samples) as inputs, tqdm(
            total=tokens, unit="tok", unit_scale=True, desc="expert inputs", disable=not progress) as bar:
        for ids in batches:
            lm.forward(ids)
            bar.update(ids.numel())
    layers, rows = {}, []
    for i in tqdm(range(cfg.n_layers), desc="fitting", disable=not progress):
        w = lm.ffn(i)  # (E, n, d) gates, de-quantized on the device
        parts: dict[str, list] = {"ids": [], "a": [], "b": [], "t": []}
        for e in range(cfg.n_experts):
            x = inputs.inputs(i, e)
            if x is None or x.shape[0] < 4 * rank:
                continue
            f = fit_expert(w.gate[e].float(), x.to(w.gate.device, torch.float32), rank, recall, seed=i * 1000 + e)
            for k in ("a", "b", "t"):
                parts[k].append(f[k])
            parts["ids"].append(e)
            rows.append({"layer": i, "expert": e, **{k: f[k] for k in ("recall", "marked", "fires", "k", "samples")}})
        lm.release_ffn(i)
        if parts["ids"]:
            layers[i] = {k: np.asarray(v) if k == "ids" else np.stack(v) for k, v in parts.items()}
    if not layers:
        raise FixableError(f"no expert had {4 * rank} routed inputs in {tokens:,} tokens: pass more --expert-tokens "
                           f"(or a smaller --expert-rank)", params=("expert_tokens", "expert_rank"))
    path = save(path_in(run_dir), layers)
    summary = {"file": str(path), "rank": rank, "target_recall": recall, "tokens": tokens, "samples": samples,
               "device": dev, "seconds": round(time.perf_counter() - t0, 1), "predictors": len(rows),
               "experts": cfg.n_layers * cfg.n_experts, "mean_recall": float(np.mean([r["recall"] for r in rows])),
               "min_recall": float(np.min([r["recall"] for r in rows])),
               "mean_marked": float(np.mean([r["marked"] for r in rows])),
               "mean_gate_fires": float(np.mean([r["fires"] for r in rows])), "experts_fitted": rows}
    artifacts.write_json(path.with_suffix(".json"), summary)
    return summary
