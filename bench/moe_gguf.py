"""bench_moe's model: a mixture of experts of a real model's shape (solver/synthetic.MOE_SHAPES) with RANDOM weights,
written straight into a Q4_0 GGUF in llama.cpp's layout (arch qwen3moe, or llama with experts for Mixtral), one
layer at a time on the device, its ROUTER CALIBRATED to a target per-expert routing skew (speed and memory, never
quality).

Layout (what llama.cpp's loaders create_tensor and weights/names.py read): token_embd, output_norm, output; per layer
attn_norm, attn_q/k/v (Q/K rows permuted for arch llama only), attn_output, attn_q_norm/attn_k_norm (qwen3moe),
ffn_norm, ffn_gate_inp (the router, F32 as llama.cpp's converter and quantizer keep it), ffn_{gate,up}_exps (E, n, d)
and ffn_down_exps (E, d, n), stacked. Norms F32, every other matrix Q4_0. Metadata: the llama keys with
rope.dimension_count = key_length = head_dim (Qwen3's 128 is not d / heads = 64), expert_count, expert_used_count,
expert_feed_forward_length and expert_weights_norm (qwen3moe), our activation key, and the byte-level placeholder
vocabulary bench_gguf's files carry (memory_models.tokenizer: llama.cpp and our reader accept it).

The router's calibration. bench_model's constant channel: channel 0 of the residual stream holds CONST for every
token (embedding column 0; row 0 of every attn_output and ffn_down_exps zero, so nothing writes it), and each
layer's ffn_norm weight[0] scales it to ~1 at the FFN input, so router column 0 acts as a per-expert bias b_e:
logit_e = b_e x_0 + sum_{k>0} W_ek x_k. Columns 1.. are random, std 1/sqrt(d) (a content logit of std ~1: tokens
route differently). The biases are fitted on the layer's own FFN inputs (the calibration tokens carried through the
layers before it, as stored): b_e <- b_e + a_r (log f_e - log c_e) over CAL_STEPS rounds, a_r shrinking from 0.5 to
0.02 (a fixed step overshoots and oscillates), the round closest to the target kept; c_e the measured share of
routed picks of expert e under top-k, f_e the target's (the fixed point of DeepSeek-V3's bias-only load balancing,
here steered to a skew instead of to uniform). The router is F32, so the file routes as calibrated. The hottest
experts' ids are a random permutation per layer.

The targets (`ROUTING`): per-expert pick shares f (sum k) of Zipf form f_r ~ (1 + r)^-s (capped at one pick a
token), s fitted to one published figure per model:
- Qwen3-30B-A3B: the hottest 51% of a layer's experts (65 of 128) receive 90% of its routed picks (median layer,
  llama-imatrix expert counts over ~1k tokens of prose, code and math; its hottest expert 4.3%):
  https://mcp-tool-shop-org.github.io/gpu-container/handbook/derisk/ ("The real result - Qwen3 routes
  near-uniform"). A third party's small sample: no paper gives per-expert frequencies of this model that we found.
- Mixtral-8x7B: NO EXACT FIGURE found. The Mixtral paper (arXiv 2401.04088, section 5, "Routing analysis", Fig. 7)
  shows each domain's expert assignment at layers 0, 15 and 31 near uniform (12.5% each), and llama.cpp issue #4667
  ("in aggregate the share of experts is quite even") agrees. ASSUMPTION, labelled as such: the hottest 2 of 8
  experts receive 35% of the picks (uniform: 25%).
The `uniform` routing variant fits f_e = k / E (the same calibration, no skew).

The sparse-expert variant (dReLU: relu(gate) * relu(up), our activation key `drelu`): TurboSparse-Mixtral-47B leaves
85% of each expert's neurons inactive on average (Song et al., "Turbo Sparse", arXiv 2406.05955, section 6.2: 15% of
neurons active, 3% of the MoE layer's parameters per token). Gate column 0 is then each neuron's bias, set as
bench_model.calibrate sets it (a Gaussian fit of the gate's pre-activation on the tokens routed to the expert) so that
gate_j > 0 with probability q_j = min(1, p_j / 0.8), p a power law of mean 0.15 (the top 20% of neurons 80% of the
firings), and up's column 0 so that up_j > 0 with probability 0.8 (UP_POSITIVE): relu(gate) * relu(up) is non-zero
with probability ~p_j (gate and up independent; the calibration's `fired` is the measured share).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from hotneurons.weights.names import layer_name

from bench import bench_model as bm
from bench.moe_routing import REPORT_FRAC, ROUTING, _route, _router, target_shares, top_share
from bench.shapes import CONST, EMBED_STD

Q4_BLOCK, Q4_BYTES = 32, 18  # Q4_0: 32 weights in 18 bytes
STD = 0.02  # attention and expert weights

UP_POSITIVE = 0.8  # dReLU: the share of tokens whose up projection is positive (up's bias), gate's set to match
DRELU_ACTIVE = 0.15  # TurboSparse-Mixtral-47B: 85% of an expert's neurons inactive (arXiv 2406.05955, sec. 6.2)


@dataclass(frozen=True)
class MoEShape:
    name: str
    arch: str  # llama.cpp's: "qwen3moe" or "llama" (Mixtral)
    n_layers: int
    d: int
    n_ff: int  # one expert's neurons
    n_experts: int
    k: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    ffn_dense: int  # feed_forward_length (Qwen3's config intermediate_size; Mixtral's = n_ff)
    eps: float
    routing_key: str  # ROUTING's entry

    @property
    def expert_params(self) -> int:
        return 3 * self.d * self.n_ff


SHAPES = {
    "qwen3-30b-a3b": MoEShape("qwen3-30b-a3b", "qwen3moe", 48, 2048, 768, 128, 8, 32, 4, 128, 151936, 6144, 1e-6,
                              "qwen3-30b-a3b"),
    "mixtral-8x7b": MoEShape("mixtral-8x7b", "llama", 32, 4096, 14336, 8, 2, 32, 8, 128, 32000, 14336, 1e-5,
                             "mixtral-8x7b"),
    # CPU tests of the harness
    "tiny": MoEShape("tiny", "qwen3moe", 2, 128, 64, 8, 2, 4, 2, 32, 320, 256, 1e-6, "qwen3-30b-a3b"),
    "tiny-mixtral": MoEShape("tiny-mixtral", "llama", 2, 128, 64, 8, 2, 4, 2, 32, 320, 64, 1e-5, "mixtral-8x7b"),
}


def hf_config(shape: MoEShape, activation: str):
    """The transformers config our reader builds from the file (for our decoder in the calibration)."""
    from transformers import AutoConfig

    common = dict(vocab_size=shape.vocab, hidden_size=shape.d, num_hidden_layers=shape.n_layers,
                  num_attention_heads=shape.n_heads, num_key_value_heads=shape.n_kv_heads, head_dim=shape.head_dim,
                  max_position_embeddings=4096, rms_norm_eps=shape.eps, rope_theta=1e6, tie_word_embeddings=False,
                  num_experts_per_tok=shape.k, hidden_act="relu" if activation == "drelu" else "silu")
    if shape.arch == "llama":
        return AutoConfig.for_model("mixtral", **common, intermediate_size=shape.n_ff,
                                    num_local_experts=shape.n_experts, sliding_window=None)
    return AutoConfig.for_model("qwen3_moe", **common, intermediate_size=shape.ffn_dense,
                                moe_intermediate_size=shape.n_ff, num_experts=shape.n_experts, norm_topk_prob=True,
                                decoder_sparse_step=1, mlp_only_layers=[])


def tensor_plan(s: MoEShape) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy-order shape, quantized) of every tensor, in the file's order."""
    d, q, kv, E, n = s.d, s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.n_experts, s.n_ff
    out = [("token_embd.weight", (s.vocab, d), True), ("output_norm.weight", (d,), False),
           ("output.weight", (s.vocab, d), True)]
    for i in range(s.n_layers):
        p = layer_name(i)
        out += [(p + "attn_norm.weight", (d,), False), (p + "attn_q.weight", (q, d), True),
                (p + "attn_k.weight", (kv, d), True), (p + "attn_v.weight", (kv, d), True),
                (p + "attn_output.weight", (d, q), True)]
        if s.arch == "qwen3moe":
            out += [(p + "attn_q_norm.weight", (s.head_dim,), False), (p + "attn_k_norm.weight", (s.head_dim,), False)]
        out += [(p + "ffn_norm.weight", (d,), False), (p + "ffn_gate_inp.weight", (E, d), False),
                (p + "ffn_gate_exps.weight", (E, n, d), True), (p + "ffn_up_exps.weight", (E, n, d), True),
                (p + "ffn_down_exps.weight", (E, d, n), True)]
    return out


def _metadata(w, s: MoEShape, activation: str, routing: str) -> None:
    from hotneurons.export.gguf_model import vocab_from_tokenizer
    from hotneurons.weights.names import ACTIVATION_KEY

    from bench import memory_models as mm

    w.add_name(f"random {s.name} ({routing} routing, {activation})")
    w.add_string(ACTIVATION_KEY, activation)
    w.add_context_length(4096)
    w.add_embedding_length(s.d)
    w.add_block_count(s.n_layers)
    w.add_feed_forward_length(s.ffn_dense)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv_heads)
    w.add_rope_dimension_count(s.head_dim)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(s.eps)
    w.add_expert_count(s.n_experts)
    w.add_expert_used_count(s.k)
    if s.arch == "qwen3moe":
        w.add_expert_feed_forward_length(s.n_ff)
        w.add_expert_weights_norm(True)
    w.add_file_type(2)  # LLAMA_FTYPE_MOSTLY_Q4_0
    vocab_from_tokenizer(mm.tokenizer(s.vocab), s.vocab).add_to(w)


def _q4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q4_0 bytes (rows, row bytes) uint8, the float32 values they stand for) of a (rows, cols) matrix."""
    from hotneurons.weights.quants import dequantize, quantize

    q = quantize(w, "q4_0")
    return q, dequantize(q, "q4_0", w.shape[1])


def gate_fire_probs(n: int, seed: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """(n,) float32: a dReLU expert's P(gate_j > 0) = p_j / UP_POSITIVE (below 1), p a power law of mean DRELU_ACTIVE,
    so that relu(gate) * relu(up) fires with probability p_j (module docstring)."""
    prob = np.clip(bm.power_law(n, seed=seed, mean=DRELU_ACTIVE), *bm.P_CLIP)
    return torch.from_numpy(np.minimum(1 - 1e-5, prob / UP_POSITIVE)).to(device, torch.float32)


def set_bias(wt: torch.Tensor, xe: torch.Tensor, q: torch.Tensor) -> None:
    """wt (n, d)'s column 0 (the bias, times the constant channel) set so that row j's pre-activation on the inputs xe
    (m, d) is > 0 with probability q_j, from a Gaussian fit of its other columns' pre-activations."""
    pre = xe[:, 1:] @ wt[:, 1:].T  # (m, n) without channel 0
    wt[:, 0] = -(pre.mean(0) + pre.std(0).nan_to_num(1.0) * torch.special.ndtri(1 - q))


def write_model(shape: str, path: Path, device: str, routing: str = "calibrated", sparse: bool = False,
                seed: int = 0, calibration_tokens: int = 2048, seq: int = 256, predictor_rank: int = 0,
                log=print) -> dict:
    """The model as a Q4_0 GGUF at `path` (a temp name, renamed when whole); returns the calibration's figures.
    sparse with predictor_rank r > 0: every expert's gate of rank r (bar its bias column), and exact expert
    predictors of rank r + 1 beside it (`predictors_path(path)`, artifacts/expert_predictors.py's file)."""
    import gguf

    s = SHAPES[shape]
    act = "drelu" if sparse else "swiglu"
    tmp = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(tmp), s.arch)
    _metadata(w, s, act, routing)
    q4 = gguf.GGMLQuantizationType.Q4_0
    for name, shp, quant in tensor_plan(s):
        if quant:
            byte_shape = (*shp[:-1], shp[-1] // Q4_BLOCK * Q4_BYTES)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=q4)
        else:
            w.add_tensor_info(name, shp, np.dtype(np.float32), 4 * int(np.prod(shp)))
    rows: list[dict] = []
    preds: dict[int, dict] | None = {} if sparse and predictor_rank > 0 else None
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for a in _layers(s, act, routing, device, seed, calibration_tokens, seq, rows, log, predictor_rank, preds):
            w.write_tensor_data(a)
        w.close()
        if preds is not None:
            from hotneurons.artifacts.expert_predictors import save

            save(predictors_path(path), preds)
        tmp.replace(path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    target = target_shares(s, routing)
    return {"gguf": str(path), "gguf_bytes": path.stat().st_size, "shape": shape, "arch": s.arch,
            "activation": act, "routing": routing, "target_shares_by_rank": target.tolist(),
            "target_top": {"frac": REPORT_FRAC, "share": top_share(target, REPORT_FRAC),
                           "fitted_to": ROUTING[s.routing_key] if routing != "uniform" else None},
            "calibration": {"tokens": max(1, calibration_tokens // seq) * seq, "seq": seq, "layers": rows,
                            "mean_top_share": float(np.mean([r["top_share"] for r in rows])),
                            "mean_fired": (float(np.mean([r["fired"] for r in rows])) if sparse else None)},
            "expert_predictors": None if preds is None else {
                "file": str(predictors_path(path)), "rank": predictor_rank + 1,
                "recall": float(np.mean([r["predictor_recall"] for r in rows])),
                "marked": float(np.mean([r["predictor_marked"] for r in rows]))}}


def predictors_path(gguf: Path) -> Path:
    """Where write_model puts the expert predictors of the model at `gguf`."""
    return gguf.with_suffix(".expert_predictors.safetensors")


def _gen(seed: int, key: int, device: str) -> torch.Generator:
    """A generator of its own per (seed, key): any layer can be made again without the others."""
    return torch.Generator(device).manual_seed(seed * 1_000_003 + 1000 * (key + 3))


def _layers(s: MoEShape, act: str, routing: str, device: str, seed: int, calibration_tokens: int, seq: int,
            rows: list, log, rank: int = 0, preds: dict | None = None) -> Iterator[np.ndarray]:
    """The file's tensors in tensor_plan's order, each layer made and calibrated as it comes (module docstring);
    `preds` (rank > 0, dReLU) gets each layer's exact expert predictors (_predictor)."""
    from hotneurons.export.gguf_model import permute_qk
    from hotneurons.models import build_model
    from hotneurons.models.config import ModelConfig

    mcfg = ModelConfig.from_hf(hf_config(s, act), act)
    floats: dict[str, torch.Tensor] = {}  # canonical name -> the float32 values the file stands for
    g = _gen(seed, -1, device=device)
    emb = torch.randn((s.vocab, s.d), generator=g, device=device) * EMBED_STD
    emb[:, 0] = CONST
    head = torch.randn((s.vocab, s.d), generator=g, device=device) * STD
    emb_q, floats["token_embd.weight"] = _q4(emb)
    head_q, floats["output.weight"] = _q4(head)
    floats["output_norm.weight"] = torch.ones(s.d, device=device)
    m = build_model(mcfg, floats.get, device, torch.float16, ctx=seq, layers=False)
    ids = torch.randint(0, s.vocab, (max(1, calibration_tokens // seq), seq), device=device,
                        generator=_gen(seed, -2, device=device))
    hs = [m.embed(r, 0) for r in ids]  # per sequence (seq, d) fp16: the hidden states, layer by layer
    yield emb_q.cpu().numpy()
    yield floats["output_norm.weight"].cpu().numpy()
    yield head_q.cpu().numpy()
    floats.clear()
    target = target_shares(s, routing)
    q, kv, E, n, d = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.n_experts, s.n_ff, s.d
    for i in range(s.n_layers):
        p, g = layer_name(i), _gen(seed, i, device=device)
        out: list[np.ndarray] = []  # the layer's tensors in the file's order
        ones = torch.ones(d, device=device)
        floats[p + "attn_norm.weight"] = ones
        floats[p + "ffn_norm.weight"] = ones.clone()
        out.append(ones.cpu().numpy())
        for name, shp in (("attn_q", (q, d)), ("attn_k", (kv, d)), ("attn_v", (kv, d)), ("attn_output", (d, q))):
            wt = torch.randn(shp, generator=g, device=device) * STD
            if name == "attn_output":
                wt[0] = 0.0  # nothing writes the constant channel
            stored, floats[p + name + ".weight"] = _q4(wt)
            heads = {"attn_q": s.n_heads, "attn_k": s.n_kv_heads}.get(name)
            if s.arch == "llama" and heads:  # llama.cpp's rope row order; Q4_0 blocks run along rows
                stored = permute_qk(stored, heads)
            out.append(stored.cpu().numpy())
        if s.arch == "qwen3moe":
            for name in ("attn_q_norm", "attn_k_norm"):
                floats[p + name + ".weight"] = torch.ones(s.head_dim, device=device)
                out.append(np.ones(s.head_dim, np.float32))
        m.load_layer(i)
        h2s, xs = zip(*(m.attention(i, h, 0) for h in hs))  # (seq, d) fp16 each
        m.drop_layer(i)
        x = torch.cat(xs).float()  # (T, d) the FFN inputs
        x0 = float(x[:, 0].mean())
        floats[p + "ffn_norm.weight"][0] /= x0  # x[0] -> ~1: the norm's weight scales channel 0 alone
        x[:, 0] /= x0
        out.append(floats[p + "ffn_norm.weight"].cpu().numpy())
        router, _, row = _router(x, target, s.k, g, seed, i)
        out.append(router.cpu().numpy())
        ys = torch.zeros_like(x)  # (T, d) the experts' weighted sum
        wts, idx = _route(x @ router.T, s.k)  # (T, k) each
        stacks: dict[str, list[np.ndarray]] = {"gate": [], "up": [], "down": []}
        fired, pr = [], {"a": [], "b": [], "t": [], "recall": [], "marked": []}
        for e in range(E):
            gate = torch.randn((n, d), generator=g, device=device) * STD
            if preds is not None:  # a gate of rank `rank` (its bias column set below): what an exact predictor needs
                af = torch.randn((rank, d - 1), generator=g, device=device) * (STD / rank ** 0.5)
                bf = torch.randn((n, rank), generator=g, device=device)
                gate[:, 1:] = bf @ af
            up = torch.randn((n, d), generator=g, device=device) * STD
            down = torch.randn((d, n), generator=g, device=device) * STD
            down[0] = 0.0  # nothing writes the constant channel
            tok, slot = (idx == e).nonzero(as_tuple=True)  # the tokens routed to e
            xe = x[tok] if len(tok) >= 32 else x  # (m, d) the calibration's sample of e's inputs
            if act == "drelu":
                qg = gate_fire_probs(n, seed * 1000 + i * E + e, device)
                for wt, qq in ((gate, qg), (up, torch.full_like(qg, UP_POSITIVE))):
                    set_bias(wt, xe, qq)
            parts = {}
            for k_, wt in (("gate", gate), ("up", up), ("down", down)):
                qb, parts[k_] = _q4(wt)
                stacks[k_].append(qb.cpu().numpy())
            if preds is not None:
                made = _predictor(af, bf, gate[:, 0], parts["gate"], xe)
                for k_, v in zip(("a", "b", "t", "recall", "marked"), made):
                    pr[k_].append(v)
            if len(tok):
                xt = x[tok]
                gx, ux = xt @ parts["gate"].T, xt @ parts["up"].T  # (m, n)
                h = torch.relu(gx) * torch.relu(ux) if act == "drelu" else torch.nn.functional.silu(gx) * ux
                if act == "drelu":
                    fired.append(float((h > 0).float().mean()))
                ys.index_add_(0, tok, (h @ parts["down"].T) * wts[tok, slot, None])
        for k_ in ("gate", "up", "down"):
            out.append(np.stack(stacks[k_]))  # (E, rows, row bytes)
        del stacks
        at = 0
        for j, h2 in enumerate(h2s):
            hs[j] = (h2.float() + ys[at:at + seq]).half()
            at += seq
        row |= {"layer": i, "x0_raw_mean": x0, "fired": float(np.mean(fired)) if fired else None}
        if preds is not None:
            preds[i] = {"ids": np.arange(E), **{k_: np.stack(pr[k_]) for k_ in ("a", "b", "t")}}
            row |= {"predictor_recall": float(np.mean(pr["recall"])), "predictor_marked": float(np.mean(pr["marked"]))}
        rows.append(row)
        for a in out:
            yield a
        for name in [k_ for k_ in floats if k_.startswith(p)]:
            floats.pop(name)
        log(f"layer {i}: the hottest {REPORT_FRAC:.0%} of experts take {row['top_share']:.3f} of picks "
            f"(target {row['target_top_share']:.3f}), max share error {row['max_abs_error']:.4f}"
            + (f", fired {row['fired']:.3f}" if row["fired"] is not None else ""))


PREDICTOR_SIGMAS = 3.0  # an expert predictor's threshold: this many of its score's errors below zero


def _predictor(af: torch.Tensor, bf: torch.Tensor, bias: torch.Tensor, stored: torch.Tensor,
               xe: torch.Tensor) -> tuple:
    """The exact predictor of a gate bf @ af (columns 1..) plus `bias` (column 0, times the constant channel):
    A (r + 1, d) = [0 | af; e_0], B (n, r + 1) = [bf | bias], so B A x is the gate's pre-activation before Q4_0; its
    thresholds (n,) at PREDICTOR_SIGMAS of the score's error against the stored gate below zero, on the expert's
    calibration inputs xe (m, d). Returns (A, B, t) as float32 arrays, the recall of the stored gate's firings
    (g > 0) and the share of neurons marked, on xe."""
    r, d = af.shape[0], af.shape[1] + 1
    A = torch.zeros((r + 1, d), device=af.device)
    A[:r, 1:] = af
    A[r, 0] = 1.0
    B = torch.cat([bf, bias[:, None]], 1)  # (n, r + 1)
    score, gq = (xe @ A.T) @ B.T, xe @ stored.T  # (m, n) each
    t = -PREDICTOR_SIGMAS * float((score - gq).std())
    marked, fires = score > t, gq > 0
    recall = float((marked & fires).sum() / fires.sum().clamp(min=1))
    thr = np.full(B.shape[0], t, np.float32)
    return A.cpu().numpy(), B.cpu().numpy(), thr, recall, float(marked.float().mean())
