"""pi-eval --criterion/--sparsity: perplexity (and answer agreement) of a gated model with its FFN masked by a
training-free sparsity criterion (common/gating.py) at the profile's thresholds for a sparsity.

Masking is exact, as a sparse kernel computes: a skipped neuron contributes h * 0 (h, gate, gate-h: |h| > tau_h,
|act(g)| > tau_g, both); the input criteria (input: |x_i| > tau_x, wina: |x_i| * ||W_gate[:, i]|| > tau_x) zero the
skipped channels of the FFN input before gate and up read it (down is dense). Per result: perplexity, against dense,
the measured share skipped (neurons, or input channels), and the FFN row bytes a token reads under it
(gating.bytes_read_share of the measured pass shares).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from hotneurons.artifacts.predictors import AnswerAgreement, GatedResult
from hotneurons.common.gate_masks import channel_pass, criterion_taus, neuron_pass
from hotneurons.common.gating import Criterion, LayerTaus, bytes_read_share, criterion, key
from hotneurons.common.kinds import FixableError
from hotneurons.models.ffn_hooks import StageHooks


class GatedMasks(StageHooks):
    """Hooks masking each layer's FFN by `crit` at per-layer thresholds `taus` (LayerTaus for the per-neuron criteria,
    tau_x for the input ones; `norms`: per layer (d,) gate column norms, wina only), counting what passed."""

    def __init__(self, lm, crit: Criterion | str, taus: list, norms: list[torch.Tensor] | None = None):
        super().__init__(lm)
        self.crit, self.taus, self.norms = criterion(crit), taus, norms
        self.stats = np.zeros((len(lm.layers), 3), dtype=np.float64)  # per layer: units seen, passing, gate-passing
        self._a: dict[int, torch.Tensor] = {}

    def wants_gate(self) -> bool:
        return self.crit in (Criterion.GATE, Criterion.GATE_H)

    def wants_input(self) -> bool:
        return not self.crit.per_neuron

    def on_gate(self, i: int, a: torch.Tensor) -> None:
        self._a[i] = a

    def on_ffn_input(self, i: int, x: torch.Tensor) -> torch.Tensor | None:
        m = channel_pass(self.crit, x, self.taus[i], None if self.norms is None else self.norms[i])  # (..., d)
        self.stats[i] += [m.numel(), int(m.sum()), 0]
        return x * m.to(x.dtype)

    def on_ffn(self, i: int, h: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor | None:
        if not self.crit.per_neuron:
            return None
        a, t = self._a.pop(i, None), self.taus[i]
        m = neuron_pass(self.crit, a, h, t)  # (..., n)
        g = int(neuron_pass(Criterion.GATE, a, h, LayerTaus(gate=t.gate)).sum()) if self.crit == Criterion.GATE_H \
            else 0
        self.stats[i] += [m.numel(), int(m.sum()), g]
        return h * m.to(h.dtype)

    def summary(self) -> dict:
        seen, passed, gate = self.stats.sum(0)
        p = passed / seen if seen else 1.0
        g = gate / seen if self.crit == Criterion.GATE_H and seen else None
        per = {"pass_share": np.round(self.stats[:, 1] / np.maximum(1, self.stats[:, 0]), 6).tolist()}
        if g is not None:
            per["gate_pass_share"] = np.round(self.stats[:, 2] / np.maximum(1, self.stats[:, 0]), 6).tolist()
        return {"skips": "neurons" if self.crit.per_neuron else "channels", "ffn_sparsity": float(1 - p),
                "pass_share": float(p), "gate_pass_share": None if g is None else float(g),
                "bytes_read_share": bytes_read_share(self.crit, p, g), "per_layer": per}


def parse_criteria(values) -> list[Criterion]:
    """Criterion names (a list, or comma lists), each checked: one-line error naming the value and the choices."""
    items = [v.strip() for val in ([values] if isinstance(values, str) else values) for v in str(val).split(",")]
    return [criterion(v) for v in items if v]


def check_gated(gated: dict | None, crits: list[Criterion], sparsities: list[float], where: str) -> None:
    """Every (criterion, sparsity) tabulated in the profile's `gated` section, else one line naming what is."""
    for c in crits:
        for s in sparsities:
            criterion_taus(gated, c, s, where)


def masks_for(lm, gated: dict, crit: Criterion, s: float, norms: list[torch.Tensor] | None) -> GatedMasks:
    return GatedMasks(lm, crit, criterion_taus(gated, crit, s), norms if crit == Criterion.WINA else None)


def run_gated(lm, batches: list[torch.Tensor], gated: dict, crits: list[Criterion], sparsities: list[float],
              dense_ppl: float | None, perplexity, progress: bool = False, prompts: list[str] | None = None,
              new_tokens: int = 32) -> tuple[list[GatedResult], dict | None]:
    """Every criterion x sparsity on `batches` (perplexity: evaluate.perplexity); with `prompts`, answer agreement
    against dense greedy answers too (a LoadedModel). -> (results, the answers' report section or None)."""
    from hotneurons.models.ffn_hooks import gate_column_norms

    norms = gate_column_norms(lm) if Criterion.WINA in crits else None
    dense_answers = answers_meta = None
    if prompts is not None:
        from hotneurons.predictors.answers import greedy_answers

        dense_answers = greedy_answers(lm, prompts, new_tokens)
        answers_meta = {"prompts": len(prompts), "new_tokens": new_tokens,
                        "dense": [lm.tokenizer.decode(a, skip_special_tokens=True) for a in dense_answers]}
    out = []
    for c in crits:
        for s in sparsities:
            t0 = time.perf_counter()
            with masks_for(lm, gated, c, s, norms) as masks:
                nll, count = perplexity(lm, batches, progress, desc=f"{c}@{key(s)}")
            summary = masks.summary()
            res = GatedResult(criterion=c, sparsity=float(s), perplexity=math.exp(nll / count),
                              nll_per_token=nll / count, tokens=count, seconds=0.0, **summary)
            if dense_ppl is not None:
                res.ppl_vs_dense = res.perplexity / dense_ppl - 1
            if prompts is not None:
                from hotneurons.predictors.answers import agreement, greedy_answers

                with masks_for(lm, gated, c, s, norms):
                    same, prefix = agreement(dense_answers, greedy_answers(lm, prompts, new_tokens))
                res.answers = AnswerAgreement(prompts=len(prompts), new_tokens=new_tokens, identical_share=same,
                                              prefix_share=prefix)
            res.seconds = round(time.perf_counter() - t0, 2)
            out.append(res)
    return out, answers_meta


def refuse_answers_streamed(streamed: bool) -> None:
    if streamed:
        raise FixableError("answer agreement generates through transformers (the whole model): run it whole, or "
                           "leave out the answers", params=("layer_by_layer", "answers"))


def format_gated(rows: list[dict]) -> list[str]:
    """pi-eval's table rows for the gated results."""
    lines = [f"{'criterion@s':13} {'ppl':>9} {'vs dense':>9} {'sparsity':>9} {'skips':>8} {'bytes':>6} "
             f"{'same ans':>8} {'prefix':>6} {'seconds':>8}"]
    for r in rows:
        a = r.get("answers") or {}
        vs = f"{100 * r['ppl_vs_dense']:+.2f}%" if r.get("ppl_vs_dense") is not None else "-"
        same = f"{a['identical_share']:.2f}" if a else "-"
        pre = f"{a['prefix_share']:.2f}" if a else "-"
        lines.append(f"{r['criterion'] + '@' + key(r['sparsity']):13} {r['perplexity']:9.3f} {vs:>9} "
                     f"{r['ffn_sparsity']:9.3f} {r['skips']:>8} {r['bytes_read_share']:6.3f} {same:>8} {pre:>6} "
                     f"{r['seconds']:8.1f}")
    return lines
