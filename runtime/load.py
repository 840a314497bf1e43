"""Reading a run directory into a runtime: `check_run` (the run's files, each checked before the model loads) and
`load_runtime` (the model the run was made for, its placement, predictors and profile thresholds, laid out by
generate.build_runtime).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hotneurons.artifacts.placement import Placement
from hotneurons.artifacts.profile import check_profile, read_profile
from hotneurons.common import artifacts
from hotneurons.common.artifacts import ArtifactError
from hotneurons.models.family import check_model, load_model, load_model_from_meta
from hotneurons.runtime.config import PRESETS, RuntimeConfig
from hotneurons.runtime.gated import default_sparsity, gate_taus, uses_gate
from hotneurons.runtime.generate import Runtime, build_runtime, device_and_dtype
from hotneurons.runtime.moe_load import check_moe_run, is_moe_run
from hotneurons.runtime.placement import plan_figures, solved_summary


def _first_meta(run_dir: Path) -> dict | None:
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


def reads_in_place(meta: dict | None, model: str | None, cfg: RuntimeConfig) -> bool:
    """Whether the model loads in place into our decoder (runtime/engine.py): a local folder of safetensors or a GGUF
    file, in hybrid or dense mode. Layer-split (the baseline), --hf-decode and hub ids go through transformers."""
    if model is None and is_moe_run(meta):  # experts run in our decoder only (moe_load refuses layer-split)
        return True
    if cfg.mode == "layer-split" or not cfg.static_decode:
        return False
    if model is None:
        kind = (meta or {}).get("model", {}).get("source", {}).get("kind")
        return kind in ("gguf", "folder")
    from hotneurons.common.model_source import resolve_source

    return resolve_source(model, None).kind in ("gguf", "folder")


def load_runtime(run_dir: str | Path | None, cfg: RuntimeConfig = PRESETS["hybrid"], *, model: str | None = None,
                 gguf_file: str | None = None, use_predictor: bool = True, trust_remote_code: bool = False,
                 recall: float | None = None) -> Runtime:
    """Load the model the run was made for (or `model`), its placement and predictors, and build the runtime.

    `use_predictor=False` turns hybrid into dense (no predictors needed). A mixture of experts reads its expert
    placement and no predictors (runtime/moe_load.py)."""
    if cfg.sparsity is not None and not 0 <= cfg.sparsity < 1:
        raise ArtifactError(f"--sparsity {cfg.sparsity}: give the FFN sparsity as a share in [0, 1), e.g. 0.5")
    run = Path(run_dir) if run_dir is not None else None
    cfg = default_sparsity(run, cfg)
    if cfg.mode == "hybrid" and not cfg.oracle and (not use_predictor or cfg.sparsity == 0):
        cfg = RuntimeConfig(**{**cfg.__dict__, "mode": "dense"})
    device, dtype = device_and_dtype(cfg)
    dname = str(dtype).removeprefix("torch.")
    meta = _first_meta(run) if run is not None else None
    if meta is None and model is None:
        raise ArtifactError(f"no profile, placement or predictors in {run_dir}: run pi-profile first, or pass --model")
    if run is not None:
        check_run(run, cfg, recall, moe=is_moe_run(meta))
    if model is not None:
        check_model(model, gguf_file, trust_remote_code=trust_remote_code, experts=True)  # MoE: engine.py reads them
    if reads_in_place(meta, model, cfg):
        from hotneurons.runtime.engine import load_source_runtime

        return load_source_runtime(run, meta, cfg, model=model, gguf_file=gguf_file, use_predictor=use_predictor,
                                   recall=recall)
    lm = (load_model_from_meta(meta["model"], model, gguf_file, device="cpu", dtype=dname,
                               trust_remote_code=trust_remote_code) if meta is not None
          else load_model(model, gguf_file, device="cpu", dtype=dname, trust_remote_code=trust_remote_code))
    placement = predictors = taus = None
    solved = None  # pi-solve's summary, where the placement came from pi-solve
    if run is not None and (run / "placement" / "placement.parquet").exists() and cfg.mode != "layer-split":
        placement = Placement.from_run(run, lm.info)
        solved = solved_summary(run)
        if cfg.ctx is None and solved is not None:  # the KV cache the solver reserved room for
            cfg = replace(cfg, ctx=solved.flags.ctx)
    gate = uses_gate(cfg)
    if run is not None and cfg.mode == "hybrid" and not cfg.oracle and not gate:
        from hotneurons.artifacts.predictor_file import load_predictors

        if not (run / "predictors" / "predictors.safetensors").exists():
            raise ArtifactError(f"no predictors in {run / 'predictors'}: run `pi-train-predictors --run {run}`, or "
                                f"pass --no-predictor (dense) or --oracle (true masks)")
        predictors = load_predictors(run, lm.info, device="cpu", dtype=dtype)
        if recall is not None:
            predictors.set_recall(recall)
    if run is not None and (run / "profile" / "meta.json").exists():
        _, pmeta = read_profile(run)
        artifacts.check_same_model(pmeta, {"model": lm.info}, f"profile {run / 'profile'}", "the model")
        taus = pmeta.layer_taus
    gtaus = gate_taus(run, cfg, lm.activation, len(lm.layers)) if gate else None
    rt = build_runtime(lm, cfg, placement, predictors, taus, gtaus)
    plan_figures(rt, solved)
    return rt
