"""pi-profile on a mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): docs/profiler.md, "Mixtures of experts".

Only the layer-by-layer path runs them (models/streamed_experts.ExpertsModel: the router and each expert on the
tokens routed to it, the consumers shown the routing and each expert's values).

ExpertCounter counts: per (layer, expert) the tokens routed and the sum of their routing weights; per (layer, expert,
neuron) the routed tokens on which the neuron was active (active_mask's rule: nonzero, or |h| > tau_l). The taus
are calibrated over the routed experts' values (ExpertMagnitudes), so that target_sparsity of the (token, expert,
neuron) values a layer computes fall at or below them; the shared expert is counted at its layer's tau. No predictor
samples: the router is the exact predictor of which experts run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch
from hotneurons.artifacts.profile import ExpertsMeta
from hotneurons.common import artifacts
from hotneurons.common.model_source import ModelError, resolve_source
from hotneurons.models import ModelConfig
from hotneurons.models.ffn_hooks import StageHooks
from hotneurons.models.streamed_experts import SHARED, ExpertsModel
from hotneurons.profiler.hooks import MagnitudeCollector, count_active


def whole_model_refusal(name: str, model: str | None, gguf_file: str | None) -> ModelError:
    """A mixture of experts asked to run through transformers (a hub id, or --whole-model): refused in one line. The
    transformers path counts one dense FFN per layer through its modules' hooks; experts need the router's choice,
    which only our own decoder hands over."""
    hub = resolve_source(model, gguf_file).kind == "hub"
    fix = (f"download it first (huggingface-cli download {name} --local-dir DIR) and profile DIR" if hub else
           "drop --whole-model")
    return ModelError(f"'{name}' is a mixture of experts: pi-profile counts experts layer by layer from a local "
                      f"safetensors folder or GGUF file: {fix}", params=("model", "layer_by_layer"))


def experts_meta(cfg: ModelConfig) -> ExpertsMeta:
    return ExpertsMeta(n_experts=cfg.n_experts, n_experts_used=cfg.n_experts_used, n_ff_exp=cfg.n_ff_exp,
                       n_ff_shexp=cfg.n_ff_shexp, norm_topk=cfg.norm_topk)


class ExpertCounter(StageHooks):
    """Counts on the model's device: `routed` (L, E) tokens per expert, `weight_sum` (L, E) float64 their routing
    weights, `counts` (L, E, n) active neurons among those tokens, `shared` (L, n_sh) the shared expert's over all."""

    def __init__(self, lm: ExpertsModel, taus: list[float] | None):
        super().__init__(lm)
        c, dev = lm.cfg, lm.device
        self.taus = taus
        self.routed = torch.zeros(c.n_layers, c.n_experts, dtype=torch.int64, device=dev)
        self.weight_sum = torch.zeros(c.n_layers, c.n_experts, dtype=torch.float64, device=dev)
        self.counts = torch.zeros(c.n_layers, c.n_experts, c.n_ff_exp, dtype=torch.int64, device=dev)
        self.shared = torch.zeros(c.n_layers, c.n_ff_shexp, dtype=torch.int64, device=dev) if c.n_ff_shexp else None

    def tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps and torchrun all-reduces."""
        out = {"routed": self.routed, "weight_sum": self.weight_sum, "counts": self.counts}
        return out if self.shared is None else {**out, "shared": self.shared}

    def on_route(self, i: int, weights: torch.Tensor, idx: torch.Tensor) -> None:
        idx = idx.flatten()  # (T * k,)
        self.routed[i] += torch.bincount(idx, minlength=self.routed.shape[1])
        self.weight_sum[i].index_add_(0, idx, weights.flatten().to(torch.float64))

    def on_expert(self, i: int, e: int, h: torch.Tensor) -> None:
        n = count_active(h, None if self.taus is None else self.taus[i])  # (n,)
        if e == SHARED:
            self.shared[i] += n
        else:
            self.counts[i, e] += n


class ExpertMagnitudes(MagnitudeCollector):
    """Calibration: |h| of every routed (token, expert) pair of a layer, pooled and then subsampled as the dense
    collector does (uniformly over the layer's values, whichever expert computed them)."""

    def __init__(self, lm, per_batch: int = 1 << 18, seed: int = 0):
        super().__init__(lm, per_batch, seed)
        self._layer: list[torch.Tensor] = []

    def on_route(self, i: int, weights: torch.Tensor, idx: torch.Tensor) -> None:
        pass

    def on_expert(self, i: int, e: int, h: torch.Tensor) -> None:
        if e != SHARED:
            self._layer.append(h.flatten())

    def end_layer(self, i: int) -> None:
        if self._layer:
            self.on_ffn(i, torch.cat(self._layer), None)
        self._layer = []


def write_tables(partial: Path, cfg: ModelConfig, tables: dict[str, np.ndarray]) -> np.ndarray:
    """experts.parquet and neurons.parquet (with its expert column) from ExpertCounter's tensors (numpy) -> the
    routed experts' counts (L, E * n) for the summary."""
    L, E, n = tables["counts"].shape
    experts = pd.DataFrame({"layer": np.repeat(np.arange(L, dtype=np.int32), E),
                            "expert": np.tile(np.arange(E, dtype=np.int32), L),
                            "count": tables["routed"].reshape(-1).astype(np.int64),
                            "weight_sum": tables["weight_sum"].reshape(-1).astype(np.float64)})
    artifacts.write_parquet(partial / "experts.parquet", experts)
    parts = [_neurons(tables["shared"][:, None, :], SHARED)] if "shared" in tables else []  # (L, 1, n_sh)
    neurons = pd.concat([*parts, _neurons(tables["counts"], 0)]).sort_values(["layer", "expert", "neuron"],
                                                                            kind="stable")
    artifacts.write_parquet(partial / "neurons.parquet", neurons.reset_index(drop=True))
    return tables["counts"].reshape(L, E * n)


def _neurons(counts: np.ndarray, first: int) -> pd.DataFrame:
    """(L, E, n) counts -> rows (layer, expert, neuron, count), experts numbered from `first`."""
    L, E, n = counts.shape
    return pd.DataFrame({"layer": np.repeat(np.arange(L, dtype=np.int32), E * n),
                         "expert": np.tile(np.repeat(np.arange(first, first + E, dtype=np.int32), n), L),
                         "neuron": np.tile(np.arange(n, dtype=np.int32), L * E),
                         "count": counts.reshape(-1).astype(np.int64)})


