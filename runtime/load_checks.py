"""The checks and defaults that the runtime's builders share (runtime/load.py: load_runtime and its builders
build_runtime, load_source_runtime, load_moe_runtime), one place each so that the paths agree: the run's files before
the model loads (`check_run`), where and in which dtype the hot part runs, the mode and mask a config asks for, what
hybrid mode needs, the run's predictors, profile thresholds and placement, the KV cache's length, and the pieces that
finish a runtime over our decoder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hotneurons.artifacts.profile import check_profile
from hotneurons.common import artifacts
from hotneurons.common.artifacts import ArtifactError
from hotneurons.models.family import RELU_FAMILY, pick_device, pick_dtype
from hotneurons.runtime.config import RuntimeConfig
from hotneurons.runtime.gated import uses_gate
from hotneurons.runtime.moe_load import check_moe_run
from hotneurons.runtime.static_decoder import CAPACITY


def first_meta(run_dir: Path) -> dict | None:
    """The meta.json of the run's first stage that names the model (placement, predictors, profile); None if none."""
    for stage in ("placement", "predictors", "profile"):
        p = run_dir / stage / "meta.json"
        if p.exists():
            try:
                meta = artifacts.read_json(p)
            except (ValueError, OSError) as e:
                raise ArtifactError(f"{p} is not valid JSON ({e}): re-run the stage that wrote it") from None
            if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
                raise ArtifactError(f"{p} names no model: re-run the stage that wrote it")
            return meta
    return None


def check_run(run: Path, cfg: RuntimeConfig, recall: float | None = None, moe: bool = False) -> None:
    """The run directory's files that `load_runtime` will read, checked before the model loads: each refused in one
    line naming it (missing, empty, cut short, of another format). A mixture of experts' run (`moe`) needs no
    predictors: its router picks the experts (runtime/moe_load.check_moe_run)."""
    from hotneurons.artifacts.placement import PlacementMeta
    from hotneurons.artifacts.predictor_file import check_predictors

    if (run / "profile" / "meta.json").exists():
        check_profile(run)
    if moe:
        return check_moe_run(run)
    if (run / "placement" / "placement.parquet").exists() and cfg.mode != "layer-split":
        PlacementMeta.load(run / "placement" / "meta.json")
        artifacts.check_table(run / "placement" / "placement.parquet", ("layer", "neuron", "gpu"),
                              f"pi-solve --run {run}")
    if cfg.mode == "hybrid" and not cfg.oracle and not uses_gate(cfg):
        if not (run / "predictors" / "predictors.safetensors").exists():
            raise ArtifactError(f"no predictors in {run / 'predictors'}: run `pi-train-predictors --run {run}`, or "
                                f"pass --sparsity S (a gated model's own gates), --no-predictor (dense) or --oracle "
                                f"(true masks)")
        check_predictors(run, recall)


def device_and_dtype(cfg: RuntimeConfig) -> tuple[str, torch.dtype]:
    """The one place that decides where the hot part runs and in which dtype (and how attention runs there)."""
    device = pick_device(cfg.device)
    if device.startswith("cuda"):
        # cuDNN's attention builds a new execution plan for every new KV length, and decoding makes a new length
        # each step, costing several times the whole step in CPU time. Flash and memory-efficient attention have
        # no per-shape plans.
        torch.backends.cuda.enable_cudnn_sdp(False)
    return device, pick_dtype(cfg.dtype, device)


def check_ctx(cfg: RuntimeConfig) -> None:
    if cfg.ctx is not None and cfg.ctx < 1:
        raise ValueError(f"--ctx {cfg.ctx}: the static KV cache needs at least 1 token (leave it out for the "
                         f"placement's)")


def check_sparsity(cfg: RuntimeConfig) -> None:
    if cfg.sparsity is not None and not 0 <= cfg.sparsity < 1:
        raise ArtifactError(f"--sparsity {cfg.sparsity}: give the FFN sparsity as a share in [0, 1), e.g. 0.5")


def resolved_mode(cfg: RuntimeConfig, use_predictor: bool) -> str:
    """cfg.mode, but hybrid without predictors (`use_predictor=False`) or at sparsity 0 runs dense (not the oracle,
    whose masks need no predictors)."""
    if cfg.mode == "hybrid" and not cfg.oracle and (not use_predictor or cfg.sparsity == 0):
        return "dense"
    return cfg.mode


def mask_kind(mode: str, oracle: bool, gate: bool) -> str:
    """Where a hybrid FFN's masks come from: 'predictor', 'gate' (a gated model's own gates), 'oracle' (the true
    activations); 'dense' outside hybrid mode."""
    if mode != "hybrid":
        return "dense"
    return "oracle" if oracle else ("gate" if gate else "predictor")


def need_placement(mode: str, placement: Any) -> None:
    if mode == "hybrid" and placement is None:
        raise ArtifactError("hybrid mode needs a placement: run `pi-solve --run RUN` first, or use --mode dense")


def need_oracle_taus(mask: str, taus: Any, activation: str) -> None:
    if mask == "oracle" and taus is None and activation not in RELU_FAMILY:
        raise ArtifactError(f"--oracle on a {activation} model needs the profile's thresholds (RUN/profile/)")


def run_predictors(run: Path, info: dict, dtype: torch.dtype, recall: float | None) -> Any:
    """RUN/predictors/ for this model, on the CPU in `dtype`, at `recall` where given."""
    from hotneurons.artifacts.predictor_file import load_predictors

    predictors = load_predictors(run, info, device="cpu", dtype=dtype)
    if recall is not None:
        predictors.set_recall(recall)
    return predictors


def profile_taus(run: Path | None, info: dict) -> list[float] | None:
    """The profile's per-layer activation thresholds (its model checked to be this one); None without a profile."""
    from hotneurons.artifacts.profile import read_profile

    if run is None or not (run / "profile" / "meta.json").exists():
        return None
    _, pmeta = read_profile(run)
    artifacts.check_same_model(pmeta, {"model": info}, f"profile {run / 'profile'}", "the model")
    return pmeta.layer_taus


def solved_placement(run: Path | None, info: dict) -> tuple[Any, Any]:
    """RUN/placement/'s neuron placement for this model and pi-solve's summary of it; (None, None) without one."""
    from hotneurons.artifacts.placement import Placement
    from hotneurons.runtime.placement import solved_summary

    if run is None or not (run / "placement" / "placement.parquet").exists():
        return None, None
    return Placement.from_run(run, info), solved_summary(run)


def static_ctx(cfg: RuntimeConfig, solved: Any, max_positions: int) -> int:
    """Our decoder's KV cache: --ctx, else the one the solver reserved room for, else CAPACITY; at most the model's."""
    return cfg.ctx or min(solved.flags.ctx if solved is not None else CAPACITY, max_positions)


def gpu_ops(cfg: RuntimeConfig, device: str) -> Any:
    from hotneurons.kernels.ops import default_ops

    return default_ops(torch.device(device)) if cfg.ops == "auto" else cfg.ops


def source_model(decoder: Any, source: Any, act: str, sid: Any, info: dict) -> Any:
    """Our decoder with the file's tokenizer and end-of-sequence id (runtime/engine.SourceModel)."""
    from hotneurons.runtime.engine import SourceModel

    tok = source.tokenizer()
    eos = getattr(tok, "eos_token_id", None)
    return SourceModel(decoder, tok, act, sid, info, source.config, set() if eos is None else {int(eos)})


def host_embedding_bytes(mcfg: Any, decoder: Any) -> int:
    """An untied embedding stays in CPU RAM (models/common.py): its bytes, 0 for a tied one."""
    from hotneurons.runtime.memory import tensor_bytes

    return 0 if mcfg.tied_embeddings else tensor_bytes(decoder.tok_embd)


def source_steps(decoder: Any, ffns: list, cfg: RuntimeConfig, device: str, dtype: torch.dtype) -> Any:
    """Decode steps as CUDA graphs over the decoder's own cache (eager on a CPU, the same pieces); None without
    static decoding."""
    from hotneurons.runtime.source_steps import SourceSteps

    if not cfg.static_decode:
        return None
    return SourceSteps(decoder, ffns, torch.device(device), dtype, cfg.cuda_graphs, gpu_ops(cfg, device),
                       cfg.prelaunch)
