"""The predictors' and the evaluation's artifact files as typed dataclasses (common/schema.py says how they work).

`RUN/predictors/meta.json` (PredictorsMeta), `RUN/predictors/summary.json` (PredictorsSummary),
`RUN/eval/eval.json` (EvalReport). docs/artifacts.md and docs/predictors.md list the keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from hotneurons.common.artifacts import JsonFile, Section, StageMeta
from hotneurons.common.gating import Criterion
from hotneurons.common.kinds import Kind, Rule
from hotneurons.common.schema import optional


class EvalMode(Kind):
    """How the evaluation masks each layer's FFN neurons (predictors/evaluate.py)."""

    DENSE = "dense"  # nothing masked
    ORACLE = "oracle"  # the profile's rule on the true values
    PREDICTOR = "predictor"  # computed iff the layer's predictor fires
    PLACEMENT = "placement"  # GPU neurons always, the others where the predictor fires (what the runtime computes)


class PredictorForm(Kind):
    """What a predictor reads and how its thresholds are shared (predictors/meta.json `config.form`;
    predictors/form.py)."""

    NORMED = "normed"  # the FFN input (after the pre-FFN norm); one threshold per layer
    POWERINFER = "powerinfer"  # the residual before the pre-FFN RMSNorm; one threshold for all layers

    @classmethod
    def of(cls, config: dict | None) -> PredictorForm:
        """The form a PredictorConfig dict records; a file from before forms existed reads as normed."""
        return cls((config or {}).get("form") or cls.NORMED)


@dataclass(kw_only=True)
class PredictorsMeta(StageMeta):
    """predictors/meta.json: `inputs.profile.meta_sha256` ties the predictors to the profile they were trained on."""

    STAGE: ClassVar[str] = "predictors"
    WRITER: ClassVar[str] = "pi-train-predictors"

    stage: str = "predictors"
    model: dict[str, Any]
    config: dict[str, Any] | None = None  # predictors.train.PredictorConfig fields


@dataclass(kw_only=True)
class PredictorLayer(Section):
    """One layer's predictor. The runtime needs `layer` and `thresholds_by_recall`; the rest reports the fit
    (recall, precision and sparsities on the test split)."""

    layer: int
    hidden: int | None = None
    params: int | None = None
    params_share_of_ffn: float | None = None
    share80: float | None = None
    profile_sparsity: float | None = None
    skewed: bool | None = None
    threshold: float | None = None
    recall: float | None = None
    precision: float | None = None
    predicted_sparsity: float | None = None
    true_sparsity: float | None = None
    val: dict[str, float] | None = None
    thresholds_by_recall: dict[str, float]  # "0.9" -> the logit threshold tabulated on val for that recall
    # powerinfer form: fc2 was multiplied by fold_scale so that `threshold` is the one of all layers; the threshold
    # it replaced (null for a layer that never fired), and whether it was first lowered (predictors/form.py)
    fold_scale: float | None = optional()
    threshold_before_fold: float | None = optional()
    threshold_moved: bool | None = optional()
    epochs: int | None = None
    tried: list[dict[str, Any]] | None = None  # every size fitted: hidden, params, phase, val, test, epochs, seconds


@dataclass(kw_only=True)
class PredictorTotals(Section):
    layers: int
    predictor_params: int
    ffn_params: int
    predictor_fraction_of_ffn: float
    budget_params: int
    mean_recall: float
    min_recall: float
    mean_precision: float
    mean_predicted_sparsity: float
    mean_true_sparsity: float
    fits: int
    train_seconds: float
    device: str
    recomputed_mask_agreement_min: float | None = optional()  # with the magnitude weighting only
    global_threshold: float | None = optional()  # powerinfer form: every layer's threshold
    moved_layers: int | None = optional()  # powerinfer form: layers whose threshold was lowered to fold it


@dataclass(kw_only=True)
class PredictorsSummary(JsonFile):
    """predictors/summary.json: per layer hidden size, skewness statistic, recall, precision, predicted sparsity,
    threshold and the sizes tried; the totals against the parameter budget."""

    WRITER: ClassVar[str] = "pi-train-predictors"

    config: dict[str, Any] | None = None  # predictors.train.PredictorConfig fields
    skewness_statistic: str | None = None
    metrics_split: str | None = None
    samples_per_layer: int | None = None
    d_model: int | None = None
    n_neurons: int | None = None
    totals: PredictorTotals | None = None
    layers: list[PredictorLayer]

    @property
    def target_recall(self) -> float | None:
        return (self.config or {}).get("target_recall")

    @property
    def form(self) -> PredictorForm:
        return PredictorForm.of(self.config)  # files from before forms: normed


@dataclass(kw_only=True)
class ModeResult(Section):
    """Perplexity and what was computed in one eval mode (or one point of the recall sweep)."""

    threshold_recall: float | None = optional()  # recall sweep points only
    perplexity: float
    nll_per_token: float
    tokens: int
    ffn_sparsity: float  # share of (token, neuron) pairs not computed
    recall: float  # share of truly active pairs computed
    magnitude_recall: float  # share of the active pairs' |h| computed
    true_sparsity: float
    per_layer: dict[str, list[float]]  # computed_share, recall, magnitude_recall, true_active_share
    seconds: float
    gpu_neuron_share: float | None = optional()  # placement mode only
    cpu_computed_share_of_cold: float | None = optional()  # placement mode only
    ppl_vs_dense: float | None = optional()  # perplexity / dense perplexity - 1 (when dense ran)
    # row_formats only: perplexity / the same mode's perplexity with the rows unrounded (`modes`) - 1
    ppl_vs_unrounded: float | None = optional()


@dataclass(kw_only=True)
class AnswerAgreement(Section):
    """Greedy chat answers with the FFN masked against dense ones, on a fixed prompt set (predictors/answers.py)."""

    prompts: int
    new_tokens: int
    identical_share: float  # share of prompts whose greedy answer is the dense one, token for token
    prefix_share: float  # mean over prompts of the share of the dense answer's tokens before the first divergence


@dataclass(kw_only=True)
class GatedResult(Section):
    """The FFN masked by one gated sparsity criterion at the profile's thresholds for one sparsity (pi-eval
    --criterion/--sparsity; common/gating.py)."""

    criterion: Criterion
    sparsity: float  # the target the thresholds were calibrated for
    perplexity: float
    nll_per_token: float
    tokens: int
    ppl_vs_dense: float | None = optional()  # perplexity / dense perplexity - 1
    skips: str  # "neurons" (h, gate, gate-h) or "channels" (input, wina: the FFN input's)
    ffn_sparsity: float  # measured share of (token, neuron) pairs skipped, or of (token, input channel) pairs
    pass_share: float  # 1 - ffn_sparsity
    gate_pass_share: float | None = optional()  # gate-h: share of neurons passing the gate filter (up rows read)
    bytes_read_share: float  # common/gating.bytes_read_share of the measured shares: FFN row bytes read per token
    per_layer: dict[str, list[float]]  # pass_share (and gate_pass_share for gate-h)
    seconds: float
    answers: AnswerAgreement | None = optional()  # with --answers


@dataclass(kw_only=True)
class EvalReport(StageMeta):
    """eval/eval.json: perplexity per mode on held-out text."""

    STAGE: ClassVar[str] = "eval"
    WRITER: ClassVar[str] = "pi-eval"

    stage: str = "eval"
    model: str  # the model's name (its fingerprint is the next key)
    fingerprint: str
    dataset: str
    tokens: int  # the token budget (each mode's `tokens` counts the predicted ones)
    seq_len: int
    rule: Rule
    threshold_recall: float | None = None
    device: str
    dtype: str
    modes: dict[str, ModeResult]
    recall_sweep: list[ModeResult]
    # pi-eval --row-format: format -> mode -> the mode with the FFN rows stored in that format (predictors/row_formats);
    # ppl_vs_dense there is against the same format's dense
    row_formats: dict[str, dict[str, ModeResult]] | None = optional()
    # pi-eval --criterion/--sparsity (gated models): one entry per criterion and sparsity, in the order run
    gated: list[GatedResult] | None = optional()
    # with --answers: the prompt file, the prompt count, the greedy tokens asked and the dense answers' text
    answers: dict[str, Any] | None = optional()
