"""Predictors in the form PowerInfer runs, and the exact predictor of a ReGLU LLaMA.

PowerInfer's form (llama.cpp:4688-4694, 5045-5048; ggml.c:14256): per layer `idx = fc2 · ReLU(fc1 · x)`, no biases,
`x` the residual stream entering the FFN block (`ffn_inp`, before `ffn_norm`); neuron j is computed iff
`idx_j >= T`, with T one float for the whole model (`powerinfer.sparse_threshold`). Our predictors come in two forms
(`config.form` in RUN/predictors/meta.json and summary.json):

- "powerinfer": trained on that input with one threshold: exported as they are.
- "normed" (the default when `form` is absent): trained on the FFN's own input, the RMS-normed
  `x_post = γ ⊙ x / rms(x)`, with a threshold per layer. `fc1 · diag(γ) · x = rms(x) · fc1 · x_post`, and ReLU and fc2
  commute with the positive factor rms(x): the pre-norm logit is the normed one times rms(x) > 0. Its sign is the
  same, so a layer whose threshold is 0 decides exactly as before with fc1' = fc1 · diag(γ) and T = 0; any other
  threshold would have to scale with rms(x), which one constant cannot do.

The exact predictor of a ReGLU layer: fc1 = [W_gate·diag(γ); -W_gate·diag(γ)] (2n × d), fc2 = [I, -I] (n × 2n),
T = 0, so `fc2 · ReLU(fc1 · x) = W_gate·diag(γ)·x = rms(x) · gate(x_post)`: positive exactly where ReLU(gate) opens.
Its "normed" twin (fc1 = [W_gate; -W_gate]) is what a runtime feeding the post-norm input runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from hotneurons.artifacts.predictors import PredictorForm as Form
from hotneurons.common import artifacts
from hotneurons.common.artifacts import ArtifactError
from hotneurons.common.kinds import choose

from .gguf_model import ExportError

Layer = tuple[torch.Tensor, torch.Tensor]  # (fc1 (r, d), fc2 (n, r)), float32


RETRAIN = "train predictors PowerInfer can run with `pi-train-predictors --form powerinfer`"


def gammas(state: dict[str, torch.Tensor], n_layers: int) -> list[torch.Tensor]:
    """Each layer's post_attention_layernorm weight γ (d,), float32."""
    return [state[f"model.layers.{i}.post_attention_layernorm.weight"].detach().float().cpu() for i in range(n_layers)]


def exact_predictors(state: dict[str, torch.Tensor], n_layers: int, form: str = Form.POWERINFER) -> list[Layer]:
    """The exact predictor of each ReGLU layer (threshold 0) in `form`, from an HF LLaMA state dict."""
    form = choose(form, Form, "predictor form", ExportError, "form")
    out = []
    for i, g in enumerate(gammas(state, n_layers)):
        w = state[f"model.layers.{i}.mlp.gate_proj.weight"].detach().float().cpu()  # (n, d)
        if form == Form.POWERINFER:
            w = w * g  # (n, d) · diag(γ): the norm's weight moves into fc1
        n = w.shape[0]
        eye = torch.eye(n)
        out.append((torch.cat((w, -w)).contiguous(), torch.cat((eye, -eye), 1).contiguous()))  # (2n, d), (n, 2n)
    return out


def powerinfer_threshold(thresholds: Sequence[float], form: str) -> float:
    """The one threshold PowerInfer will apply to predictors of `form` with these per-layer thresholds, or a
    one-line refusal when no exact equivalent exists (needs no weights: checked before a model loads)."""
    form = choose(form, Form, "predictor form", ExportError, "form")
    ts = [float(t) for t in thresholds]
    if form == Form.POWERINFER:
        if len(set(ts)) != 1:
            raise ExportError(f"the powerinfer-form predictors have {len(set(ts))} different thresholds "
                              f"({min(ts):.4g} .. {max(ts):.4g}) but PowerInfer applies one to every layer: {RETRAIN}",
                              params="recall")
        return ts[0]
    bad = [i for i, t in enumerate(ts) if t != 0.0]
    if bad:
        raise ExportError(f"normed predictors (trained on the post-norm FFN input) export exactly only with threshold "
                          f"0, but layer {bad[0]}'s is {ts[bad[0]]:.4g} ({len(bad)} of {len(ts)} layers nonzero): "
                          f"{RETRAIN}", params="recall")
    return 0.0


def to_powerinfer(layers: Sequence[Layer], thresholds: Sequence[float], form: str,
                  gamma: Sequence[torch.Tensor]) -> tuple[list[Layer], float]:
    """Predictors of `form` with per-layer `thresholds` -> PowerInfer's form (float32) and its one threshold: normed
    ones get fc1 · diag(γ) with γ each layer's post_attention_layernorm weight."""
    t = powerinfer_threshold(thresholds, form)
    if form == Form.POWERINFER:
        return [(f1.float(), f2.float()) for f1, f2 in layers], t
    return [(f1.float() * g.float(), f2.float()) for (f1, f2), g in zip(layers, gamma)], t  # (r, d) · diag(γ)


def read_predictors(run_dir: str | Path, n_layers: int, recall: float | None = None
                    ) -> tuple[list[Layer], list[float], str]:
    """RUN/predictors as (per layer (fc1, fc2), per-layer thresholds, form). Thresholds are summary.json's
    `threshold` (the run's target recall), or those tabulated for `recall`. Refuses biases and missing layers."""
    from hotneurons.artifacts.predictor_file import check_predictors
    from hotneurons.artifacts.predictors import PredictorsMeta, PredictorsSummary
    from safetensors.torch import load_file

    pdir = Path(run_dir) / "predictors"
    summary: PredictorsSummary = check_predictors(run_dir)
    meta = PredictorsMeta.load(pdir / "meta.json")
    config = {**(summary.config or {}), **(meta.config or {})}
    form = config.get("form") or Form.NORMED.value
    choose(form, Form, f"predictor form in {pdir / 'meta.json'}", ExportError)
    tensors = load_file(str(pdir / "predictors.safetensors"))
    biases = sorted(k for k in tensors if k.endswith(".bias"))
    if biases:
        raise ExportError(f"{pdir / 'predictors.safetensors'} has biases ({biases[0]}, ...) but PowerInfer's predictor "
                          f"has none: {RETRAIN}")
    rows = {r.layer: r for r in summary.layers}
    missing = [i for i in range(n_layers) if i not in rows]
    if missing:
        raise ExportError(f"{pdir} has no predictor for layer {missing[0]} ({len(missing)} of {n_layers} missing) but "
                          f"PowerInfer needs one in every layer: re-run pi-train-predictors on every layer")
    layers, ts = [], []
    for i in range(n_layers):
        layers.append((tensors[f"layers.{i}.fc1.weight"], tensors[f"layers.{i}.fc2.weight"]))
        if recall is None:
            t = rows[i].threshold
            ts.append(float(tensors[f"layers.{i}.threshold"][0]) if t is None else float(t))
        else:
            table = rows[i].thresholds_by_recall
            if f"{recall:g}" not in table:
                raise ExportError(f"recall {recall:g} has no tabulated threshold in {pdir / 'summary.json'}: choose "
                                  f"one of {', '.join(table)}", params="recall")
            ts.append(float(table[f"{recall:g}"]))
    return layers, ts, form


def write_predictors(run_dir: str | Path, info: dict[str, Any], layers: Sequence[Layer],
                     threshold: float | Sequence[float], form: str = Form.POWERINFER, name: str = "exact") -> Path:
    """RUN/predictors from given weights (fc1 (r, d), fc2 (n, r) per layer, kept in their dtype), with one threshold
    for every layer or one per layer, in the layout pi-train-predictors writes, so that pi-generate, pi-solve and
    pi-export read them as trained ones (the one writer of a predictors folder besides the trainer). Tied to
    RUN/profile when there is one."""
    from hotneurons.artifacts.predictors import PredictorLayer, PredictorsMeta, PredictorsSummary
    from safetensors.torch import save_file

    form = choose(form, Form, "predictor form", ExportError, "form")
    run = Path(run_dir)
    prof = run / "profile" / "meta.json"
    config = {"name": name, "form": form.value, "target_recall": 1.0}
    ts = [float(threshold)] * len(layers) if isinstance(threshold, (int, float)) else [float(t) for t in threshold]
    if len(ts) != len(layers):
        raise ArtifactError(f"{len(ts)} thresholds for {len(layers)} predictor layers: give one, or one per layer")
    tensors, rows = {}, []
    for i, ((f1, f2), t) in enumerate(zip(layers, ts)):
        tensors[f"layers.{i}.fc1.weight"] = f1.detach().cpu().contiguous()  # (r, d)
        tensors[f"layers.{i}.fc2.weight"] = f2.detach().cpu().contiguous()  # (n, r)
        tensors[f"layers.{i}.threshold"] = torch.tensor([t], dtype=torch.float32)
        rows.append(PredictorLayer(layer=i, hidden=f1.shape[0], params=f1.numel() + f2.numel(), threshold=t,
                                   thresholds_by_recall={"1": t}))
    if not layers:
        raise ArtifactError("no predictor layers to write")
    with artifacts.staged(run / "predictors") as tmp:
        save_file(tensors, str(tmp / "predictors.safetensors"))
        PredictorsSummary(config=config, d_model=layers[0][0].shape[1], n_neurons=layers[0][1].shape[0],
                          layers=rows).save(tmp / "summary.json")
        sha = artifacts.sha256_file(prof) if prof.exists() else "none"
        PredictorsMeta(model=info, config=config, inputs={"profile": {"meta_sha256": sha}}).save(tmp / "meta.json")
    return run / "predictors"
