"""`evaluate`: perplexity on held-out text with the FFN masked the way each stage would run it.

Modes (a neuron's value h = the input of the down projection; a masked neuron contributes h * 0):
- dense: nothing masked;
- oracle: the profile's rule on the true h (h != 0 for ReLU-family models, |h| > tau_l otherwise);
- predictor: neuron computed iff the layer's predictor fires (logit >= threshold) on its input: the FFN input, or for
  the powerinfer form the residual entering the pre-FFN norm (a pre-hook on that norm sees it);
- placement: what the runtime computes: GPU neurons always, CPU neurons where the predictor fires.
A computed neuron keeps its true value; only skipped ones are zeroed, exactly as a sparse kernel would do.

`row_formats` runs every mode again with the FFN rows rounded to each storage format the runtime keeps them in (bf16,
q8_0, q4_0, q4_1: predictors/row_formats.py), so each format's cost in perplexity sits beside the unrounded figures.

A local safetensors folder or GGUF file runs layer by layer from the file (models/streamed.py: one layer's weights
on the device at a time), a hub id whole through transformers; the masks are the same hooks either way. A mixture of
experts runs dense only, layer by layer (models/streamed_experts.ExpertsModel: the router and its experts as
pi-profile runs them): its router picks each token's experts exactly, so no neuron masks apply; the other modes are
refused.

Results go to `RUN/eval/eval.json` (artifacts/predictors.EvalReport; docs/predictors.md lists the fields).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hotneurons.artifacts.placement import Placement, PlacementMeta, read_placement
from hotneurons.artifacts.predictor_file import Predictors, check_predictors, load_predictors
from hotneurons.artifacts.predictors import EvalMode, EvalReport, ModeResult, PredictorForm
from hotneurons.artifacts.profile import check_profile
from hotneurons.common import artifacts
from hotneurons.common.artifacts import ArtifactError
from hotneurons.common.corpus import CorpusError, check_corpus, iter_texts, token_batches
from hotneurons.common.ffn import active_mask
from hotneurons.common.gate_masks import neuron_pass
from hotneurons.common.gating import Criterion, LayerTaus
from hotneurons.common.kinds import Rule, choose
from hotneurons.common.model_source import ModelError
from hotneurons.common.prenorm import ffn_norms
from hotneurons.models.family import LoadedModel, load_model_from_meta, pick_device, pick_dtype
from hotneurons.models.ffn_hooks import StageHooks, device_of, dtype_of
from hotneurons.models.stream_memory import check_memory, eval_need
from hotneurons.models.streamed import StreamedModel, meta_source, open_streamed, streams
from hotneurons.predictors import gated_eval
from hotneurons.predictors.answers import load_prompts
from hotneurons.predictors.row_formats import check_rows, parse_row_formats, stored_as
from tqdm.auto import tqdm

MODES = EvalMode.values()


class FFNMasks(StageHooks):
    """Hooks that mask each layer's FFN neurons per `mode` and count what was computed and what was missed."""

    def __init__(self, lm: LoadedModel | StreamedModel, mode: EvalMode | str, taus: list[float] | None,
                 predictors: Predictors | None = None, gpu: Placement | dict[int, torch.Tensor] | None = None,
                 rule: tuple[Criterion, list[LayerTaus]] | None = None):
        mode = choose(mode, EvalMode, "eval mode", param="modes")
        super().__init__(lm)
        self.mode, self.taus, self.predictors, self.gpu = mode, taus, predictors, gpu
        # a profile counted with --criterion gate / gate-h: the true mask reads act(gate x) (common/gate_masks.py)
        self.rule = rule
        self._a: dict[int, torch.Tensor] = {}
        # per layer: (token, neuron) pairs seen, computed, truly active, active and computed; |h| sums
        self.stats = np.zeros((len(lm.layers), 6), dtype=np.float64)
        if self.wants_x() and predictors.form == PredictorForm.POWERINFER:  # its input is the norm's input
            self.pre_norms = ffn_norms(lm) if isinstance(lm, LoadedModel) else lm.ffn_norms(required=True)
        self._pre: dict[int, torch.Tensor] = {}

    def wants_x(self) -> bool:
        return self.mode in (EvalMode.PREDICTOR, EvalMode.PLACEMENT)  # x (..., d_model): what the predictor sees

    def wants_gate(self) -> bool:
        return self.rule is not None

    def on_gate(self, i: int, a: torch.Tensor) -> None:
        self._a[i] = a

    def on_pre_norm(self, i: int, x_pre: torch.Tensor) -> None:
        if self.pre_norms is not None:
            self._pre[i] = x_pre  # (..., d_model) the pre-norm residual

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._pre.clear()

    def on_ffn(self, i: int, h: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor | None:
        if self.rule is None:
            true = active_mask(h, None if self.taus is None else self.taus[i])  # (..., n) bool
        else:
            true = neuron_pass(self.rule[0], self._a.pop(i), h, self.rule[1][i])
        if self.mode == EvalMode.DENSE:
            mask = None
        elif self.mode == EvalMode.ORACLE:
            mask = true
        else:
            pred = self.predictors.layers[i]
            inp = x if self.pre_norms is None else self._pre.pop(i)  # (..., d_model)
            mask = pred.mask(inp.to(pred.fc1.weight.dtype))  # (..., n) bool
            if self.mode == EvalMode.PLACEMENT:
                mask = mask | torch.as_tensor(self.gpu[i], device=mask.device)  # (n,) broadcast: hot ones computed
        mag = h.detach().abs().double()
        hit = true if mask is None else (true & mask)
        self.stats[i] += [true.numel(), true.numel() if mask is None else int(mask.sum()), int(true.sum()),
                          int(hit.sum()), float(mag[true].sum()), float(mag[hit].sum())]
        return None if mask is None else h * mask.to(h.dtype)

    def on_route(self, i: int, weights: torch.Tensor, idx: torch.Tensor) -> None:
        """A mixture of experts' routing (models/streamed_experts.ExpertFFN): exact, nothing to mask (dense only)."""

    def on_expert(self, i: int, e: int, h: torch.Tensor) -> torch.Tensor | None:
        """One expert's values h (tokens routed to it, n_ff_exp), counted as a dense FFN's are: the true sparsity
        is then that of the (token, routed expert, neuron) values the layer computes."""
        return self.on_ffn(i, h, None)

    def summary(self) -> dict[str, Any]:
        s = self.stats
        pairs, comp, true, hit, mag_t, mag_h = (s[:, k] for k in range(6))
        div = lambda a, b: np.where(b > 0, a / np.where(b > 0, b, 1), 1.0)  # noqa: E731
        per_layer = {"computed_share": div(comp, pairs), "recall": div(hit, true),
                     "magnitude_recall": div(mag_h, mag_t), "true_active_share": div(true, pairs)}
        return {
            "ffn_sparsity": float(1 - comp.sum() / pairs.sum()),
            "recall": float(hit.sum() / true.sum()) if true.sum() else 1.0,
            "magnitude_recall": float(mag_h.sum() / mag_t.sum()) if mag_t.sum() else 1.0,
            "true_sparsity": float(1 - true.sum() / pairs.sum()),
            "per_layer": {k: np.round(v, 6).tolist() for k, v in per_layer.items()},
        }


@torch.inference_mode()
def perplexity(lm: LoadedModel | StreamedModel, batches: list[torch.Tensor], progress: bool = False,
               desc: str = "eval") -> tuple[float, int]:
    """(summed next-token NLL in float64, number of predicted tokens) over `batches` of (b, s) token ids."""
    nll, count = 0.0, 0
    for ids in tqdm(batches, desc=desc, unit="batch", disable=not progress, dynamic_ncols=True, leave=False):
        if isinstance(lm, StreamedModel):
            part, n = lm.nll(ids)
            nll, count = nll + part, count + n
            continue
        ids = ids.to(lm.model.device)
        logits = lm.model(input_ids=ids, use_cache=False).logits  # (b, s, vocab)
        v = logits.shape[-1]
        nll += float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, v).double(),
                                                       ids[:, 1:].reshape(-1), reduction="sum"))
        count += ids[:, 1:].numel()
    return nll, count


def evaluate(run_dir: str | Path, *, modes: list[str] | None = None, dataset: str = "wikipedia-sample:eval",
             text_column: str = "text", tokens: int = 32768, seq_len: int = 512, batch_size: int = 2,
             recall: float | None = None, model: str | None = None, gguf_file: str | None = None,
             device: str = "auto", dtype: str = "auto", progress: bool = True,
             lm: LoadedModel | StreamedModel | None = None, recall_sweep: list[float] | None = None,
             write: bool = True, layer_by_layer: bool | None = None,
             row_formats: list[str] | None = None, criteria: list[str] | str | None = None,
             sparsities: list[float] | None = None, answers: str | Path | None = None,
             new_tokens: int = 32) -> EvalReport:
    """Perplexity per mode on `dataset`; writes RUN/eval/eval.json (when `write`) and returns it.

    `recall_sweep`: also run the predictor mode at each of these tabulated recalls (the trade-off curve).
    `row_formats`: also run every mode with the FFN rows stored in each of these row formats (bf16, q8_0, q4_0, q4_1;
    names or comma lists), reported under `row_formats` (the recall sweep stays unrounded).
    `layer_by_layer`: run the model from its file one layer at a time (True), whole through transformers (False),
    or (None) the first where it is a local safetensors folder or GGUF file.
    `criteria` x `sparsities` (gated models; either alone: the profile's criterion or target sparsity): also each with
    the FFN masked by that criterion at the profile's thresholds (predictors/gated_eval.py), reported under `gated`
    against dense (which then always runs); `answers`: a JSON file of chat prompts whose greedy answers (`new_tokens`)
    are compared with dense ones for each (the whole model through transformers only).
    """
    run_dir = Path(run_dir)
    # everything that can be refused without the model, before it loads
    pmeta = check_profile(run_dir)
    if pmeta.experts is not None:  # its router picks the experts exactly: dense is the one mode to evaluate
        check_experts_modes(run_dir, modes, recall_sweep, row_formats, criteria, sparsities, answers, layer_by_layer)
        modes = [EvalMode.DENSE]
    have_pred = (run_dir / "predictors" / "meta.json").exists()
    have_place = (run_dir / "placement" / "placement.parquet").exists()
    gated_only = modes is None and (criteria is not None or sparsities is not None)  # dense and the criteria only
    if modes is None:
        modes = [EvalMode.DENSE, EvalMode.ORACLE] + ([EvalMode.PREDICTOR] if have_pred else []) + \
                ([EvalMode.PLACEMENT] if have_pred and have_place else [])
    crits = gated_eval.parse_criteria(criteria) if criteria is not None else None
    if crits is not None or sparsities is not None:
        g = pmeta.gated or {}
        crits = crits or [g.get("criterion", "h")]
        sparsities = list(sparsities) if sparsities is not None else [g.get("sparsity", pmeta.target_sparsity)]
        gated_eval.check_gated(pmeta.gated, crits, sparsities, str(run_dir / "profile"))
        modes = [EvalMode.DENSE] if gated_only else [EvalMode.DENSE, *(m for m in modes if m != EvalMode.DENSE)]
    prompts = load_prompts(answers) if answers is not None else None
    if prompts is not None and crits is None:
        raise ArtifactError("answer agreement compares each gated criterion's answers with dense ones: name the "
                            "criteria", params=("criterion", "answers"))
    modes = [choose(m, EvalMode, "eval mode", param="modes") for m in modes]
    fmts = parse_row_formats(row_formats)
    if any(m in (EvalMode.PREDICTOR, EvalMode.PLACEMENT) for m in modes) or recall_sweep:
        for r in [recall, *(recall_sweep or [])]:
            check_predictors(run_dir, r)
    if EvalMode.PLACEMENT in modes:
        if not have_place:
            raise ArtifactError(f"no placement in {run_dir / 'placement'}: run pi-solve on {run_dir} first, "
                                f"or leave out the placement mode", params="modes")
        PlacementMeta.load(run_dir / "placement" / "meta.json")
        artifacts.check_table(run_dir / "placement" / "placement.parquet", ("layer", "neuron", "gpu"),
                              f"pi-solve --run {run_dir}")
    check_corpus(dataset, text_column)
    if prompts is not None:
        gated_eval.refuse_answers_streamed(isinstance(lm, StreamedModel) if lm is not None else streams(
            *meta_source(pmeta.model, model, gguf_file)[:2], layer_by_layer))
    if lm is None:
        lm = _load(run_dir, pmeta.model, model, gguf_file, pick_device(device), dtype, batch_size, seq_len,
                   layer_by_layer, rounding=bool(fmts))
    artifacts.check_same_model(pmeta, {"model": lm.info}, f"profile {run_dir / 'profile'}", "the model")
    check_rows(fmts, lm.info["d_model"])
    preds = gpu = None
    if any(m in (EvalMode.PREDICTOR, EvalMode.PLACEMENT) for m in modes) or recall_sweep:
        preds = load_predictors(run_dir, lm.info, device=str(device_of(lm)), dtype=dtype_of(lm))
        if recall is not None:
            preds.set_recall(recall)
    if EvalMode.PLACEMENT in modes:
        gpu = read_placement(run_dir, lm.info, len(lm.layers))
    taus = pmeta.layer_taus
    rule = None  # a profile of --criterion gate / gate-h: its oracle is that criterion
    if pmeta.rule in (Rule.GATE_TAU, Rule.GATE_H_TAU) and pmeta.experts is None:
        rule = (Criterion.GATE if pmeta.rule == Rule.GATE_TAU else Criterion.GATE_H, pmeta.neuron_taus)
    batches = list(token_batches(lm.tokenizer, iter_texts(dataset, text_column), seq_len, batch_size, tokens))
    if not batches:
        raise CorpusError(f"dataset '{dataset}' is empty: no text to evaluate on", params="dataset")

    def run_mode(m: EvalMode, desc: str, **extra) -> ModeResult:
        t0 = time.perf_counter()
        with FFNMasks(lm, m, taus, preds, gpu, rule) as masks:
            nll, count = perplexity(lm, batches, progress, desc=desc)
        res = ModeResult(perplexity=math.exp(nll / count), nll_per_token=nll / count, tokens=count,
                         **masks.summary(), seconds=round(time.perf_counter() - t0, 2), **extra)
        if m == EvalMode.PLACEMENT:
            g = np.stack([gpu[i] for i in range(len(lm.layers))]).astype(np.float64)  # (layers, n)
            res.gpu_neuron_share = float(g.mean())
            comp = np.array(res.per_layer["computed_share"])
            res.cpu_computed_share_of_cold = float(np.mean(
                (comp - g.mean(1)) / np.maximum(1e-12, 1 - g.mean(1))))
        return res

    results = {m.value: run_mode(m, m.value) for m in modes}
    by_format: dict[str, dict[str, ModeResult]] = {}
    for fmt in fmts:
        with stored_as(lm, fmt):
            by_format[fmt.value] = {m.value: run_mode(m, f"{fmt} {m}") for m in modes}
        for m, res in by_format[fmt.value].items():  # the format's cost, mode by mode
            res.ppl_vs_unrounded = res.perplexity / results[m].perplexity - 1
    sweep = []
    for r in recall_sweep or []:
        preds.set_recall(r)
        sweep.append(run_mode(EvalMode.PREDICTOR, f"predictor@{r:g}", threshold_recall=r))
    if recall_sweep and recall is not None:
        preds.set_recall(recall)
    if EvalMode.DENSE in results:
        for res in [*results.values(), *sweep]:
            res.ppl_vs_dense = res.perplexity / results[EvalMode.DENSE].perplexity - 1
        for rows in by_format.values():  # against the same format's dense: what the masks cost with those rows
            for res in rows.values():
                res.ppl_vs_dense = res.perplexity / rows[EvalMode.DENSE].perplexity - 1
    gated = answered = None
    if crits is not None:
        gated, answered = gated_eval.run_gated(lm, batches, pmeta.gated, crits, sparsities,
                                               results[EvalMode.DENSE].perplexity, perplexity, progress, prompts,
                                               new_tokens)
        if answered is not None:
            answered["file"] = str(answers)
    report = EvalReport(
        inputs={"profile": {"meta_sha256": artifacts.sha256_file(run_dir / "profile" / "meta.json")}},
        model=pmeta.model["name"], fingerprint=lm.info["fingerprint"], dataset=dataset, tokens=tokens,
        seq_len=seq_len, rule=pmeta.rule,
        threshold_recall=recall if recall is not None else (preds.summary.target_recall if preds else None),
        device=str(device_of(lm)), dtype=str(dtype_of(lm)), modes=results,
        recall_sweep=sweep, row_formats=by_format or None, gated=gated, answers=answered)
    if write:
        report.save(run_dir / "eval" / "eval.json")
    return report


def check_experts_modes(run_dir: Path, modes: list | None, recall_sweep, row_formats, criteria, sparsities, answers,
                   layer_by_layer: bool | None) -> None:
    """A mixture of experts' profile: anything but the dense mode, layer by layer, refused in one line."""
    asked = [str(m) for m in modes or () if str(m) != EvalMode.DENSE]
    asked += [f"--{k}" for k, v in (("recall-sweep", recall_sweep), ("row-format", row_formats),
                                    ("criterion", criteria), ("sparsity", sparsities), ("answers", answers)) if v]
    if asked:
        raise ArtifactError(f"{run_dir / 'profile'} profiles a mixture of experts: pi-eval runs it dense only (its "
                            f"router picks each token's experts exactly, so there are no neuron masks or predictors "
                            f"to evaluate), not {', '.join(asked)}: run `pi-eval --run {run_dir} --mode dense`, and "
                            f"`pi-solve --run {run_dir}`, then `pi-generate --run {run_dir}` for the runtime",
                            params="modes")
    if layer_by_layer is False:
        raise ArtifactError("pi-eval runs a mixture of experts layer by layer from its local safetensors folder or "
                            "GGUF file: drop --whole-model", params="layer_by_layer")


def _load(run_dir: Path, info: dict, model: str | None, gguf_file: str | None, device: str, dtype: str,
          batch_size: int, seq_len: int, layer_by_layer: bool | None,
          rounding: bool = False) -> LoadedModel | StreamedModel:
    """The profile's model (or `model`), layer by layer from its file after checking that a layer and the batch fit,
    or whole through transformers: as asked, or where the file's architecture has no model definition of ours.
    A mixture of experts (models/streamed_experts.ExpertsModel) runs layer by layer only."""
    path, gguf, activation = meta_source(info, model, gguf_file)
    if info.get("family") == "moe":
        from hotneurons.models.stream_memory import Need
        from hotneurons.models.streamed_experts import experts_need, open_experts

        sm = open_experts(path, gguf, activation=activation, device=device, dtype=pick_dtype(dtype, device),
                          ctx=seq_len)
        if sm is None:
            raise ModelError(f"'{path}' is not a local mixture of experts (the profile's model is): name its local "
                             f"safetensors folder or GGUF file with --model", params="model")
        need = eval_need(sm, batch_size, seq_len, 0)  # + the experts' outputs and the shared expert's projections
        extra = experts_need(sm, batch_size, seq_len, 0, 0, False).device["experts' outputs"]
        check_memory(Need(device={**need.device, "experts' outputs": extra}, host=need.host), device, "pi-eval")
        return sm
    if streams(path, gguf, layer_by_layer):
        try:
            sm = open_streamed(path, gguf, activation=activation, device=device, dtype=pick_dtype(dtype, device),
                               ctx=seq_len)
        except ValueError as e:  # an architecture feature our definitions lack: transformers runs it
            if layer_by_layer or isinstance(e, ModelError):
                raise
        else:
            pfile = run_dir / "predictors" / "predictors.safetensors"
            pbytes = pfile.stat().st_size * sm.dtype.itemsize // 4 if pfile.exists() else 0  # stored float32
            check_memory(eval_need(sm, batch_size, seq_len, pbytes, rounding), device, "pi-eval")
            return sm
    return load_model_from_meta(info, model, gguf_file, device=device, dtype=dtype)


def format_table(report: EvalReport | dict) -> str:
    """The report as a table: a row per mode, per recall-sweep point, then per row format and mode (`q8_0 dense`);
    a format's `vs dense` is against its own dense row, `vs unrounded` against the same mode with the rows as read."""
    first = report["modes"][next(iter(report["modes"]))]
    formats = report.get("row_formats") or {}
    w = 15 if formats else 10  # "q4_1 placement"
    lines = [f"{report['model']} on {report['dataset']} ({first['tokens']:,} predicted tokens, seq_len "
             f"{report['seq_len']})",
             f"{'mode':{w}} {'ppl':>9} {'vs dense':>9} {'FFN sparsity':>13} {'recall':>7} {'|h| recall':>10} "
             f"{'seconds':>8}" + (f" {'vs unrounded':>12}" if formats else "")]

    def pct(r: dict, key: str) -> str:
        return f"{100 * r[key]:+.2f}%" if key in r else "-"

    def row(name: str, r: dict) -> str:
        return (f"{name:{w}} {r['perplexity']:9.3f} {pct(r, 'ppl_vs_dense'):>9} {r['ffn_sparsity']:13.3f} "
                f"{r['recall']:7.3f} {r['magnitude_recall']:10.3f} {r['seconds']:8.1f}"
                + (f" {pct(r, 'ppl_vs_unrounded'):>12}" if formats else ""))

    lines += [row(m, r) for m, r in report["modes"].items()]
    lines += [row(f"pred@{r['threshold_recall']:g}", r) for r in report.get("recall_sweep", [])]
    lines += [row(f"{fmt} {m}", r) for fmt, rows in formats.items() for m, r in rows.items()]
    if report.get("gated"):
        lines += gated_eval.format_gated(report["gated"])
    return "\n".join(lines)
