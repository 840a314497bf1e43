"""`export_run`: a run directory (profile, predictors, placement) and its model -> PowerInfer's files.

Everything that can be refused without the model's weights is checked first: the output folder, the profile, the
architecture and activation named in the profile's meta.json, the predictors' form, biases and thresholds, and the
placement; then the model loads (float32 by default, so the norm weights folded into a normed predictor are exact)
and `write_powerinfer` writes the files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from hotneurons.common import artifacts
from hotneurons.common.artifacts import ArtifactError, slugify
from hotneurons.weights.names import layer_name

from . import RUN_FORMATS
from .gguf_model import ExportError, hf_state, vocab_from_tokenizer
from .powerinfer import ARCH, MODEL_TYPES, RELUFY, check_width, write_powerinfer
from .predictors import Form, gammas, powerinfer_threshold, read_predictors, to_powerinfer

F16_BYTES = 2


def split_bytes(gpu_mask: list[np.ndarray], neuron_bytes: int) -> int:
    """Bytes the GPU neurons' rows take: gate, up and down_t rows, `neuron_bytes` the three together as written (what
    llama.cpp:2956-2963 copies to the GPU). The least split.vram_capacity that is honest for this placement."""
    return int(sum(int(m.sum()) for m in gpu_mask)) * neuron_bytes


def split_capacity(gpu_mask: list[np.ndarray] | None, vram_capacity: int | None, neuron_bytes: int) -> int:
    """The gpuidx's split.vram_capacity: the one given, else the GPU neurons' own bytes (split_bytes); 0 without a
    placement (no gpuidx is written)."""
    if gpu_mask is None:
        return 0
    return split_bytes(gpu_mask, neuron_bytes) if vram_capacity is None else vram_capacity


def export_run(run_dir: str | Path, out: str | Path, *, fmt: str = "powerinfer", recall: float | None = None,
               vram_capacity: int | None = None, model: str | None = None, dtype: str = "float32",
               force: bool = False, progress: bool = False, threshold: float | None = None) -> dict[str, Any]:
    """Export RUN's model with its predictors, profile and placement for PowerInfer into OUT (see write_powerinfer).

    `recall`: use the predictors' thresholds tabulated for this recall instead of the trained target's;
    `vram_capacity`: the gpuidx's split.vram_capacity in bytes (default: the GPU neurons' own F16 bytes, so that
    PowerInfer loads the split whenever its budget left after the dense tensors holds them); `model`: load this
    model instead of the one the run names (its fingerprint must match). Without RUN/placement no gpuidx is
    written (PowerInfer then solves its own split on a CUDA build); `threshold`: one threshold for every layer in
    place of the run's per-layer ones (PowerInfer applies one; the summary keeps those it replaced). A run of a GGUF
    model is exported from the file as stored (export/powerinfer_gguf.py); `dtype` is then unused. Returns the
    summary (OUT/export.json)."""
    from hotneurons.artifacts.placement import read_placement
    from hotneurons.artifacts.profile import check_profile, read_profile
    from hotneurons.common.kinds import choose
    from hotneurons.models.family import load_model_from_meta

    choose(fmt, RUN_FORMATS, "export format", ExportError, "fmt")
    run, out = Path(run_dir), Path(out)
    if out.exists() and not force:
        raise ExportError(f"{out} exists: pass --force to replace it, or another output folder", params="force")
    if vram_capacity is not None and vram_capacity < 0:
        raise ExportError(f"vram capacity {vram_capacity} is negative: give bytes >= 0", params="vram_capacity")
    pmeta = check_profile(run)
    info = pmeta.model
    if info.get("model_type") not in MODEL_TYPES:
        raise ExportError(f"model type '{info.get('model_type')}' of {info['name']} is not LLaMA-shaped: PowerInfer's "
                          f"sparse path exports LLaMA-architecture models ({', '.join(MODEL_TYPES)})")
    if info.get("activation") not in ARCH:
        raise ExportError(f"activation '{info.get('activation')}' of {info['name']} cannot run on PowerInfer: its "
                          f"sparse FFN computes ReLU(gate)·up or ReLU(gate)·ReLU(up) only: {RELUFY}")
    if pmeta.layer_taus is not None:  # a thresholded profile counts |value| > tau, not ReLU's zeros
        raise ExportError(f"the profile in {run / 'profile'} counts |activation| > tau, not ReLU's nonzeros: re-run "
                          f"pi-profile on the ReLU model")
    L, n, d = info["n_layers"], info["n_neurons"], info["d_model"]
    check_width(n)
    layers, thresholds, form = read_predictors(run, L, recall)
    replaced = None
    if threshold is not None:
        replaced, thresholds = thresholds, [float(threshold)] * L
    powerinfer_threshold(thresholds, form)  # refused here, before the model loads
    prof_sha = artifacts.sha256_file(run / "profile" / "meta.json")
    pred_meta = artifacts.read_json(run / "predictors" / "meta.json")
    if pred_meta.get("inputs", {}).get("profile", {}).get("meta_sha256") not in (prof_sha, "none"):
        raise ArtifactError(f"the predictors in {run / 'predictors'} were trained on another profile than "
                            f"{run / 'profile'}: re-run pi-train-predictors --run {run}")
    artifacts.check_same_model(pred_meta, pmeta, f"predictors {run / 'predictors'}", f"profile {run / 'profile'}")
    df, _ = read_profile(run)
    counts = np.zeros((L, n), dtype=np.int64)
    counts[df["layer"].to_numpy(np.int64), df["neuron"].to_numpy(np.int64)] = df["count"].to_numpy(np.int64)
    gpu_mask = None
    if (run / "placement" / "placement.parquet").exists():
        placement = read_placement(run, info)
        gpu_mask = list(placement.gpu)  # (n,) bool each
    source = {"run": str(run), "model": info["name"], "fingerprint": info["fingerprint"], "predictor_form": form,
              "recall": recall, "profile_tokens": pmeta.tokens, "profile_meta_sha256": prof_sha,
              "folded_norm_into_fc1": form == Form.NORMED, "replaced_thresholds": replaced,
              "command": artifacts.command_line()}
    if info.get("source", {}).get("kind") == "gguf" or str(model or "").endswith(".gguf"):
        return _export_gguf(info, model, pmeta, layers, thresholds, form, counts, gpu_mask, vram_capacity, out,
                            progress, source)
    lm = load_model_from_meta(info, model, device="cpu", dtype=dtype)
    artifacts.check_same_model(pmeta, {"model": lm.info}, f"profile {run / 'profile'}", "the model")
    state = hf_state(lm.model)
    pi_layers, threshold = to_powerinfer(layers, thresholds, form, gammas(state, L))
    vocab = vocab_from_tokenizer(lm.tokenizer, lm.model.config.vocab_size)
    cap = split_capacity(gpu_mask, vram_capacity, 3 * d * F16_BYTES)  # F16 rows of gate, up, down_t
    return write_powerinfer(state, vocab, pi_layers, threshold, counts, gpu_mask, cap, out,
                            config=lm.model.config, activation=lm.activation, name=slugify(info["name"]),
                            force=force, progress=progress, info={"source": source})


def _export_gguf(info: dict, model: str | None, pmeta, layers, thresholds, form, counts, gpu_mask, vram_capacity,
                 out: Path, progress: bool, source: dict) -> dict[str, Any]:
    """export_run for a GGUF model: its header read, its tensors streamed as stored (powerinfer_gguf)."""
    from hotneurons.models.family import adapter_for
    from hotneurons.models.open import model_info, open_model
    from hotneurons.weights.formats import row_bytes

    from .powerinfer import powerinfer_arch
    from .powerinfer_gguf import write_powerinfer_gguf

    src = info.get("source", {})
    file, sid, _, act = open_model(model or src.get("path"), None if model else src.get("gguf_file"))
    ad = adapter_for(file.config)
    artifacts.check_same_model(pmeta, {"model": model_info(file, sid, act, ad.name, ad.gated)},
                               "the profile", "the model")
    powerinfer_arch(file.config, act)
    L, d = info["n_layers"], info["d_model"]
    gamma = [file.get(layer_name(i, "ffn_norm.weight")).float() for i in range(L)]  # (d,) each
    pi_layers, threshold = to_powerinfer(layers, thresholds, form, gamma)
    neuron = sum(row_bytes(file.infos[layer_name(0, f"ffn_{k}.weight")].fmt, d)
                 for k in ("gate", "up", "down"))  # bytes
    cap = split_capacity(gpu_mask, vram_capacity, neuron)
    return write_powerinfer_gguf(file, pi_layers, threshold, counts, gpu_mask, cap, out, activation=act,
                                 name=slugify(info["name"]), progress=progress, info={"source": source})
