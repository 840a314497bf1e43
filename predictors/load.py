"""Reading RUN/predictors/: `check_predictors` (before a model loads), `load_predictors`, and `Predictors`.

Predictors of either form (artifacts/predictors.PredictorForm) load the same way; `Predictors.form` tells the
evaluation and the runtime what each layer's predictor reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from hotneurons.artifacts.predictors import PredictorForm, PredictorsMeta, PredictorsSummary
from hotneurons.common import artifacts
from hotneurons.common.artifacts import ArtifactError
from hotneurons.predictors import form as pform
from hotneurons.predictors.fit import Predictor
from safetensors import safe_open


@dataclass
class Predictors:
    layers: dict[int, Predictor]
    summary: PredictorsSummary
    meta: PredictorsMeta
    form: PredictorForm = PredictorForm.NORMED  # powerinfer: each layer's predictor reads the pre-norm residual

    def set_recall(self, recall: float) -> None:
        """Switch every layer to the threshold tabulated on val for `recall` (one of RECALL_GRID + target)."""
        key = f"{recall:g}"
        for row in self.summary.layers:
            table = row.thresholds_by_recall
            if key not in table:
                raise ValueError(f"recall {recall} has no tabulated threshold: choose one of {', '.join(table)}")
            self.layers[row.layer].threshold.fill_(table[key])


def check_predictors(run_dir: str | Path, recall: float | None = None) -> PredictorsSummary:
    """RUN/predictors/ is complete and readable (meta.json, summary.json, the tensors each layer needs), of a form
    the model's family runs, and `recall`, when given, is one of its tabulated recalls: refused in one line before a
    model loads."""
    pdir = Path(run_dir) / "predictors"
    if not (pdir / "meta.json").exists() or not (pdir / "predictors.safetensors").exists():
        raise ArtifactError(f"no predictors in {pdir}: run pi-train-predictors on {run_dir} first")
    meta = PredictorsMeta.load(pdir / "meta.json")
    if PredictorForm.of(meta.config) == PredictorForm.POWERINFER:
        pform.check_model_family(meta.model)  # its input needs a pre-FFN RMSNorm
    summary = PredictorsSummary.load(pdir / "summary.json")
    names = set(artifacts.check_tensors(pdir / "predictors.safetensors", f"pi-train-predictors --run {run_dir}"))
    for row in summary.layers:
        want = [f"layers.{row.layer}.{t}" for t in ("fc1.weight", "fc2.weight", "threshold")]
        if not names.issuperset(want):
            raise ArtifactError(f"{pdir / 'predictors.safetensors'} lacks the tensors of layer {row.layer}: re-run "
                                f"pi-train-predictors --run {run_dir}")
        if recall is not None and f"{recall:g}" not in row.thresholds_by_recall:
            raise ValueError(f"recall {recall} has no tabulated threshold: choose one of "
                             f"{', '.join(row.thresholds_by_recall)}")
    return summary


def load_predictors(run_dir: str | Path, model_info: dict | None = None, *, check_profile: bool = True,
                    device: str = "cpu", dtype: torch.dtype = torch.float32) -> Predictors:
    """Read RUN/predictors/; refuse predictors of another model (`model_info` = the loaded model's info) or of
    another profile than RUN/profile/ (when it exists and `check_profile`)."""
    pdir = Path(run_dir) / "predictors"
    if not (pdir / "meta.json").exists() or not (pdir / "predictors.safetensors").exists():
        raise ArtifactError(f"no predictors in {pdir}: run pi-train-predictors on {run_dir} first")
    meta = PredictorsMeta.load(pdir / "meta.json")
    if model_info is not None:
        artifacts.check_same_model(meta, {"model": model_info}, f"predictors {pdir}", "the model")
    prof = Path(run_dir) / "profile" / "meta.json"
    if check_profile and prof.exists():
        want = meta.inputs["profile"]["meta_sha256"]
        if artifacts.sha256_file(prof) != want:
            raise ArtifactError(f"predictors {pdir} were trained on another profile than {prof.parent} "
                                f"(profile meta sha256 {want[:12]}): re-run pi-train-predictors, forcing a "
                                f"replacement")
    summary = check_predictors(run_dir)
    tensors = safe_open(str(pdir / "predictors.safetensors"), "pt")  # read a tensor at a time, not all at once
    layers: dict[int, Predictor] = {}
    for row in summary.layers:
        i = row.layer
        w1, w2 = tensors.get_tensor(f"layers.{i}.fc1.weight"), tensors.get_tensor(f"layers.{i}.fc2.weight")
        threshold = float(tensors.get_tensor(f"layers.{i}.threshold")[0])
        layers[i] = Predictor.from_weights(w1, w2, threshold, device, dtype)  # threshold in dtype: compared in x's
    return Predictors(layers, summary, meta, PredictorForm.of(meta.config))
