"""pi-bench's model (bench_model.py: LLaMA-2-70B shapes, the constant channel, firing calibrated to a power law, gate
columns of rank `gate_rank`) written straight into a Q4_0 GGUF, one layer at a time on the device: the whole model in
fp16 (138 GB at 80 layers) fits no GPU, and this way no more than one layer's weights exist at a time.

Layer by layer: the layer's weights are drawn on the device from a generator of their own (seed, layer), quantized to
Q4_0 (weights/quants.py, byte-equal to gguf-py) and de-quantized again; the calibration sequences' hidden states,
carried from the layer before, go through the layer's attention as stored (our decoder, models/llama.py, lazy); the
FFN input's constant channel is scaled to 1 (the pre-FFN norm's weight 0) and gate column 0 set so that neuron j fires
with probability p_j (bench_model.calibrate's rule); the gate is quantized, the FFN run on the stored weights, and
the layer's tensors appended to the file, whose header (every tensor's name, shape and offset) was written first.

The EXACT predictor of each layer (bench_model.exact_predictor's construction, on the stored gate's column 0) is kept
beside the file as predictors.safetensors (fp16: fc1 (2r+2, d), fc2 (n, 2r+2), per layer), to be installed into a
run once it has a profile (install_predictors).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from hotneurons.weights.names import layer_name

from bench import bench_model as bm
from bench import memory_models as mm

Q4 = "q4_0"


def shape_of(shape: str, layers: int) -> mm.Shape:
    d, n, heads, kv, vocab = bm.SHAPES[shape]
    return mm.Shape(d_model=d, n_neurons=n, n_heads=heads, n_kv_heads=kv, n_layers=layers, vocab=vocab,
                    max_positions=4096)


def _stored(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q4_0 bytes (rows, row bytes) uint8, the float32 weights they stand for) of a (rows, cols) matrix."""
    from hotneurons.weights.quants import dequantize, quantize

    q = quantize(w, Q4)
    return q, dequantize(q, Q4, w.shape[1])


def _randn(g: torch.Generator, shape: tuple[int, ...], std: float, device: str) -> torch.Tensor:
    return torch.randn(shape, generator=g, device=device) * std


def globals_(s: mm.Shape, seed: int, std: float, embed_std: float, device: str) -> dict[str, torch.Tensor]:
    """token_embd (std embed_std, column 0 the constant channel), output_norm, output: float32 HF values."""
    g = torch.Generator(device).manual_seed(seed * 1_000_003 + 999_999)
    emb = _randn(g, (s.vocab, s.d_model), embed_std, device)
    emb[:, 0] = bm.CONST
    return {"token_embd.weight": emb, "output_norm.weight": torch.ones(s.d_model, device=device),
            "output.weight": _randn(g, (s.vocab, s.d_model), std, device)}


def layer_weights(s: mm.Shape, shape: str, i: int, seed: int, std: float, rank: int,
                  device: str) -> dict[str, torch.Tensor]:
    """Layer i's weights by canonical name, float32 HF values, the constant channel wired in: nothing writes channel 0
    (o_proj's and down's row 0 are zero), gate column 0 zero until calibrated."""
    g = torch.Generator(device).manual_seed(seed * 1_000_003 + 1000 * (i + 1))
    d, n, kv = s.d_model, s.n_neurons, s.n_kv_heads * s.head_dim
    p = layer_name(i)
    w = {p + "attn_norm.weight": torch.ones(d, device=device), p + "ffn_norm.weight": torch.ones(d, device=device),
         p + "attn_q.weight": _randn(g, (d, d), std, device), p + "attn_k.weight": _randn(g, (kv, d), std, device),
         p + "attn_v.weight": _randn(g, (kv, d), std, device), p + "attn_output.weight": _randn(g, (d, d), std, device),
         p + "ffn_up.weight": _randn(g, (n, d), std, device), p + "ffn_down.weight": _randn(g, (d, n), std, device)}
    w[p + "attn_output.weight"][0] = 0.0
    w[p + "ffn_down.weight"][0] = 0.0
    a, b = bm.gate_factors(shape, i, seed, rank, device, std)  # (n, r), (r, d) with b[:, 0] = 0
    w[p + "ffn_gate.weight"] = a @ b  # (n, d), column 0 zero
    w[p + "gate_factors"] = (a, b)
    return w


def _file_bytes(t: mm.TensorSpec, stored: dict[str, torch.Tensor]) -> np.ndarray:
    """A tensor as the file holds it: norms float32; matrices Q4_0, q and k with llama.cpp's row order."""
    from hotneurons.export.gguf_model import permute_qk

    a = stored[t.gguf]
    if t.permute_heads:  # Q4_0 blocks run along a row, so permuting rows permutes the stored rows as they are
        a = permute_qk(a, t.permute_heads)
    return a.contiguous().cpu().numpy()


def write_model(shape: str, layers: int, path: Path, device: str, seed: int = 0, std: float = 0.02,
                embed_std: float = bm.EMBED_STD, rank: int = 511, calibration_tokens: int = 2048, seq: int = 256,
                mean: float = 0.10, recall: float = 0.97, log=print, activation: str = "reglu",
                rates: np.ndarray | None = None, shift: float = 1.0) -> dict:
    """The calibrated model as a Q4_0 GGUF at `path` (written to a temp name, then renamed), its exact predictors in
    path.with_suffix(".predictors.safetensors") (with per-layer thresholds that keep `recall` of the stored gate's
    firings). Returns the calibration's figures.

    activation "swiglu": a gated model without exact zeros (no predictors written): neuron j's gate pre-activation
    exceeds `shift` with probability p_j, so that at the threshold |silu(g)| > silu(shift) (> 0.279, the most a
    negative g reaches) its pass rate is p_j; `rates`: the sorted pass frequencies to draw the p_j from (a measured
    profile's, resampled to the layer's width), else the power law of `mean`."""
    from safetensors.torch import save_file

    s = shape_of(shape, layers)
    preds: dict[str, torch.Tensor] = {}
    rows: list[dict] = []
    mm.write_q4_file(s, path, _calibrated(s, shape, device, seed, std, embed_std, rank, calibration_tokens, seq,
                                          mean, recall, preds, rows, log, activation, rates, shift),
                     activation=activation)
    pred_path = path.with_suffix(".predictors.safetensors")
    save_file(preds, str(pred_path))
    return {"gguf": str(path), "gguf_bytes": path.stat().st_size, "predictors": str(pred_path),
            "predictor_hidden": 2 * rank + 2,
            "predictor_bytes": sum(t.numel() * t.element_size() for t in preds.values()),
            "calibration": {"tokens": max(1, calibration_tokens // seq) * seq, "seq": seq, "layers": rows,
                            "mean_fired_as_stored": float(np.mean([r["fired_as_stored"] for r in rows]))}}


def resampled(rates: np.ndarray, n: int, seed: int) -> np.ndarray:
    """n per-neuron rates with the distribution of `rates` (its quantiles at n evenly spaced points), in a random
    order fixed by `seed`."""
    q = np.quantile(np.asarray(rates, np.float64), (np.arange(n) + 0.5) / n)
    return np.random.default_rng(seed).permutation(q)


def _calibrated(s: mm.Shape, shape: str, device: str, seed: int, std: float, embed_std: float, rank: int,
                calibration_tokens: int, seq: int, mean: float, recall: float, preds: dict, rows: list,
                log, activation: str = "reglu", rates: np.ndarray | None = None,
                shift: float = 1.0) -> Iterator[np.ndarray]:
    """The file's tensors in its order (mm.tensor_plan), each layer's made and calibrated as it comes (module
    docstring); the exact predictors into `preds`, each layer's figures into `rows`."""
    from hotneurons.common.kinds import Activation
    from hotneurons.models import build_model
    from hotneurons.models.config import ModelConfig
    from hotneurons.predictors.fit import metrics, threshold_for_recall

    plan = mm.tensor_plan(s)
    gated = activation == "swiglu"  # SwiGLU: no exact zeros, no predictors; else ReGLU with exact predictors
    mcfg = ModelConfig.from_hf(mm.config(s, mm.tokenizer(s.vocab), "silu" if gated else "relu"),
                               Activation(activation))
    floats: dict[str, torch.Tensor] = {}  # canonical name -> the float32 weights the file stands for (one layer's)
    stored: dict[str, torch.Tensor] = {}  # canonical name -> what the file holds (one layer's)
    for name, t in globals_(s, seed, std, embed_std, device).items():
        stored[name], floats[name] = (t, t) if t.dim() == 1 else _stored(t)
    m = build_model(mcfg, floats.get, device, torch.float16, ctx=seq, layers=False)
    g = torch.Generator(device).manual_seed(seed + 1)
    ids = torch.randint(0, s.vocab, (max(1, calibration_tokens // seq), seq), device=device, generator=g)
    hs = [m.embed(row, 0) for row in ids]  # per sequence (seq, d) fp16: the hidden states, layer by layer
    for t in plan[:3]:  # token_embd, output_norm, output
        yield _file_bytes(t, stored)
    floats.clear()  # the model holds what it needs of them
    stored.clear()
    for i in range(s.n_layers):
        lw = layer_weights(s, shape, i, seed, std, rank, device)
        a, b = lw.pop(layer_name(i, "gate_factors"))
        p = layer_name(i)
        for name, t in lw.items():
            if t.dim() == 1:
                stored[name] = floats[name] = t
            elif not name.endswith("ffn_gate.weight"):
                stored[name], floats[name] = _stored(t)
        m.load_layer(i)
        h2s, xs = zip(*(m.attention(i, h, 0) for h in hs))  # (seq, d) fp16 each
        m.drop_layer(i)
        x = torch.cat(xs).float()  # (tokens, d) the FFN inputs
        x0 = float(x[:, 0].mean())
        floats[p + "ffn_norm.weight"][0] /= x0  # x[0] -> ~1 (the norm's weight scales channel 0 alone)
        x[:, 0] /= x0
        prob = (resampled(rates, s.n_neurons, seed * 1000 + i) if rates is not None
                else bm.power_law(s.n_neurons, seed=seed * 1000 + i, mean=mean))
        prob = np.clip(prob, *bm.P_CLIP)
        gate = lw[p + "ffn_gate.weight"]
        pre = x[:, 1:] @ gate[:, 1:].T  # (tokens, n) the gate pre-activation without channel 0
        z = torch.special.ndtri(torch.from_numpy(1 - prob).to(device, torch.float32))
        gate[:, 0] = -(pre.mean(0) + pre.std(0) * z) + (shift if gated else 0.0)  # P(g > shift) = p_j
        del pre
        stored[p + "ffn_gate.weight"], floats[p + "ffn_gate.weight"] = _stored(gate)
        gq, up, down = (floats[p + k] for k in ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"))
        fired = 0.0
        for j, (h2, xj) in enumerate(zip(h2s, x.split(seq))):
            gx = xj @ gq.T  # (seq, n) as stored
            fired += float((gx > (shift if gated else 0.0)).float().mean())
            act = torch.nn.functional.silu(gx) if gated else torch.relu(gx)
            hs[j] = (h2.float() + (act * (xj @ up.T)) @ down.T).half()
        if gated:  # no exact zeros: nothing for an exact predictor to predict
            rows.append({"layer": i, "x0_raw_mean": x0, "target_mean": float(prob.mean()),
                         "target_top20_share": bm.share_of_top(prob), "fired_as_stored": fired / len(hs)})
            log(f"layer {i}: x0 {x0:.3f}, gate > {shift:g}: {rows[-1]['fired_as_stored']:.3f} "
                f"(target {prob.mean():.3f})")
            yield from (_file_bytes(t, stored) for t in plan[3 + 9 * i:3 + 9 * (i + 1)])
            for name in [k for k in floats if k.startswith(p)]:
                floats.pop(name)
                stored.pop(name)
            del lw, gate, gq, up, down, x
            continue
        e0 = torch.zeros((1, s.d_model), device=device)
        e0[0, 0] = 1.0
        g0 = gq[:, :1]  # (n, 1) the stored gate's column 0: the calibrated bias
        fc1 = torch.cat([b, -b, e0, -e0])  # (2r+2, d)
        fc2 = torch.cat([a, -a, g0, -g0], dim=1)  # (n, 2r+2)
        # its logits are the fp32 gate's pre-activations; the stored gate differs by Q4_0's rounding, so the
        # threshold is the one that keeps `recall` of the stored gate's firings on the calibration tokens
        logits = torch.relu(x @ fc1.T) @ fc2.T  # (tokens, n)
        active = x @ gq.T > 0  # (tokens, n)
        threshold = min(0.0, threshold_for_recall(logits, active, recall))
        fit = metrics(logits, active, threshold)
        del logits, active
        preds[f"layers.{i}.fc1.weight"] = fc1.half().cpu()
        preds[f"layers.{i}.fc2.weight"] = fc2.half().cpu()
        preds[f"layers.{i}.threshold"] = torch.tensor([threshold])
        rows.append({"layer": i, "x0_raw_mean": x0, "target_mean": float(prob.mean()),
                     "fired_as_stored": fired / len(hs), "predictor_threshold": threshold,
                     "predictor_recall": fit["recall"], "predictor_precision": fit["precision"]})
        for t in plan[3 + 9 * i:3 + 9 * (i + 1)]:  # the layer's nine tensors
            yield _file_bytes(t, stored)
        for name in [k for k in floats if k.startswith(p)]:
            floats.pop(name)
            stored.pop(name)
        del lw, gate, gq, up, down, x
        log(f"layer {i}: x0 {x0:.3f}, fired {rows[-1]['fired_as_stored']:.3f} (target {prob.mean():.3f}), "
            f"predictor recall {fit['recall']:.3f} precision {fit['precision']:.3f}")
