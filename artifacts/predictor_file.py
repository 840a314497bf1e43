"""RUN/predictors/predictors.safetensors read into the predictor network (`Predictor`): `check_predictors` (before a
model loads), `load_predictors`, and `Predictors`. The runtime and the stages that evaluate or export predictors read
them here; predictors/ trains them.

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
from hotneurons.common.prenorm import has_ffn_norm, refusal
from safetensors import safe_open
from torch import nn


class Predictor(nn.Module):
    """Linear(d -> h) -> ReLU -> Linear(h -> n), no biases; `threshold` is the per-layer decision logit."""

    def __init__(self, d_model: int, hidden: int, n_neurons: int, threshold: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, n_neurons, bias=False)
        self.register_buffer("threshold", torch.tensor([threshold], dtype=torch.float32))

    @classmethod
    def from_weights(cls, fc1: torch.Tensor, fc2: torch.Tensor, threshold: float, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> "Predictor":
        """A predictor holding fc1 (h, d) and fc2 (n, h) as `dtype` on `device` (the threshold too), built on the meta
        device first: the constructor's random initialisation costs a CPU seconds a layer at a 70B's shapes."""
        with torch.device("meta"):
            p = cls(fc1.shape[1], fc1.shape[0], fc2.shape[0])
        p.fc1.weight = nn.Parameter(fc1.to(device=device, dtype=dtype))  # (h, d)
        p.fc2.weight = nn.Parameter(fc2.to(device=device, dtype=dtype))  # (n, h)
        p.threshold = torch.tensor([threshold], dtype=dtype, device=device)
        return p.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))  # (..., d) -> (..., n) logits

    def mask(self, x: torch.Tensor) -> torch.Tensor:
        return self(x) >= self.threshold.to(x.dtype)  # (..., n) bool


def check_model_family(info: dict) -> None:
    """The powerinfer form needs a pre-FFN RMSNorm: refused in one line, from the profile's model section, for
    families without one (OPT, Falcon)."""
    if not has_ffn_norm(info.get("family", "")):
        raise refusal(info.get("family", "?"), info.get("model_type"))


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
        check_model_family(meta.model)  # its input needs a pre-FFN RMSNorm
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
