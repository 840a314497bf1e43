"""The pi_bench model: LLaMA-2-70B layer shapes, a ReLU-gated FFN, random fp16 weights made on the device, and
per-neuron firing probabilities calibrated to a power law.

Why no FFN biases: LlamaConfig(mlp_bias=True) gives gate_proj a bias, but the runtime's gated path ignores FFN
biases (ops.neuron_values and the gated Numba kernel take no gate bias, and the up bias is not applied on gated
models), so a model calibrated through the gate bias would run differently in pi-generate than in HF. The bias is
therefore realised through a weight the runtime supports: a CONSTANT CHANNEL. Channel 0 of the residual stream holds
a constant C for every token (embedding column 0 = C; row 0 of every o_proj and down_proj = 0, so nothing writes to
it), each layer's post-attention RMSNorm weight[0] scales it so that the FFN input x[0] is 1 on average, and gate
column 0 then acts as the gate bias: gate_j . x = gate[j, 0] * x[0] + sum_{k>0} gate[j, k] x[k].

Why unit-variance token embeddings (EMBED_STD): with every weight at std 0.02, a LLaMA-2-70B-shaped layer's attention
output at position t is ~0.02^2 * d / sqrt(t) per channel (near-uniform attention averages t random value vectors),
~3.3 at t = 1 and ~0.2 at t = 256, against 0.02 for the token embedding. The residual stream was then attention noise
that shrinks with position, and the firing statistics moved with it: calibrated over positions 0-255, a
LLaMA-2-7B-shaped model fired 25% of its neurons at positions 0-16, 15% at 16-48 (where pi_bench decodes) and 7% at
256-512 (where most profile tokens sit), so decode missed the calibrated 10% and the hot set the profile found. With
embeddings of std 1 the token sets the residual stream, as in a trained model: 10% at every position, within 1%
(`active_by_position`, tests/test_bench_model.py).

Calibration, layer by layer on random tokens: with the earlier layers already calibrated, take layer l's FFN inputs,
fit each neuron's gate pre-activation without channel 0 as a Gaussian (mean mu_j, sd s_j) and set
gate[j, 0] = -(mu_j + s_j * ndtri(1 - p_j)), so P(gate_j . x > 0) = p_j, where p is `power_law` (mean 0.10, the top
20% of neurons cover 80% of firings; bench/runtime_gpu_check.py), a different permutation per layer.

An EXACT PREDICTOR of a trained predictor's size, so that the CPU reads what it would behind a real predictor (whose
marked neurons mostly fire, so each reads its gate, up and down rows; masks drawn independently of x would mostly
fail the ReLU gate and skip two of the three rows). With `gate_rank` r, gate columns 1.. are A @ B (A (n, r),
B (r, d), fixed by the seed) and gate . x = A (B x) + gate[:, 0] x[0] is computed exactly by
Linear(d -> 2r+2) -> ReLU -> Linear(2r+2 -> n): fc1 = [B; -B; e0; -e0], fc2 = [A, -A, g0, -g0] (relu(v) - relu(-v)
= v), threshold 0. With r = 511 that is the d/8 = 1024 hidden units of a trained predictor at d = 8192. It errs
only where fp16 rounding flips a sign.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bench.shapes import CONST, EMBED_STD, SHAPES

P_CLIP = (1e-5, 1 - 1e-5)  # firing probabilities kept off 0 and 1 (ndtri is infinite there)


def power_law(n: int, seed: int, mean: float = 0.10, top: float = 0.2, share: float = 0.8) -> np.ndarray:
    """Per-neuron firing probabilities p (mean `mean`), with the top `top` of neurons covering ~`share` of firings,
    in a random order fixed by `seed`."""
    rank = np.arange(1, n + 1, dtype=np.float64)
    lo, hi = 0.01, 5.0
    for _ in range(60):
        a = (lo + hi) / 2
        p = rank ** -a
        for _ in range(50):  # scale to the mean under the clip at 1
            p = np.minimum(1.0, p * mean / p.mean())
        s = p[: int(top * n)].sum() / p.sum()
        lo, hi = (lo, a) if s > share else (a, hi)
    return np.random.default_rng(seed).permutation(p)


def share_of_top(p: np.ndarray, top: float = 0.2) -> float:
    """Share of firings covered by the `top` share of neurons (hottest first)."""
    s = np.sort(np.asarray(p, np.float64))[::-1]
    return float(s[: int(round(top * len(s)))].sum() / s.sum())


@dataclass
class BenchModel:
    lm: object  # hotneurons.models.family.LoadedModel (weights where they were built)
    shape: str
    layers: int
    targets: list[np.ndarray]  # per layer (n,) target firing probabilities
    calibration: dict


class SyntheticTokenizer:
    """Token ids written as decimal words ("17 2093 5 ..."): the synthetic corpus for pi-profile."""

    bos_token_id = None
    eos_token_id = None
    chat_template = None

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [int(w) % self.vocab for w in text.split()]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)


def synthetic_corpus(path, tokens: int, vocab: int, seed: int) -> None:
    """A .txt file of `tokens` uniformly random token ids (one document)."""
    ids = np.random.default_rng(seed).integers(0, vocab, tokens)
    path.write_text(" ".join(map(str, ids.tolist())))


def gate_factors(shape: str, layer: int, seed: int, rank: int, device: str, std: float = 0.02):
    """(A (n, rank), B (rank, d)) float32 with B[:, 0] = 0: layer `layer`'s gate columns 1.. are A @ B (std ~ `std`)."""
    d, n, *_ = SHAPES[shape]
    g = torch.Generator(device).manual_seed(seed * 1000 + 500 + layer)
    a = torch.randn((n, rank), generator=g, device=device) / rank ** 0.5
    b = torch.randn((rank, d), generator=g, device=device) * std
    b[:, 0] = 0.0
    return a, b


def exact_predictor(lm, shape: str, layer: int, seed: int, rank: int):
    """The predictor whose logits are layer `layer`'s gate pre-activations (module docstring), fp16, threshold 0."""
    from hotneurons.artifacts.predictor_file import Predictor

    d, n, *_ = SHAPES[shape]
    w = lm.layers[layer].mlp.gate_proj.weight
    a, b = gate_factors(shape, layer, seed, rank, w.device)
    e0 = torch.zeros((1, d), device=w.device)
    e0[0, 0] = 1.0
    g0 = w[:, :1].float()  # (n, 1) the calibrated bias column
    p = Predictor(d, 2 * rank + 2, n, threshold=0.0).to(w.device)
    with torch.no_grad():
        p.fc1.weight.copy_(torch.cat([b, -b, e0, -e0]))  # (2r+2, d)
        p.fc2.weight.copy_(torch.cat([a, -a, g0, -g0], dim=1))  # (n, 2r+2)
    return p.half()


def build_model(shape: str, layers: int, device: str, seed: int = 0, std: float = 0.02, gate_rank: int | None = None,
                embed_std: float = EMBED_STD):
    """Random fp16 LLaMA (ReLU-gated FFN) built on `device`, with the constant channel wired in (uncalibrated);
    gate_rank: gate columns 1.. of rank `gate_rank` (gate_factors), for exact_predictor."""
    from hotneurons.common.model_source import ModelSource
    from hotneurons.models.family import wrap_model
    from transformers import LlamaConfig, LlamaForCausalLM

    d, n, heads, kv, vocab = SHAPES[shape]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=n, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, hidden_act="relu", mlp_bias=False,
                      max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.eval()
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, embed_std if name == "model.embed_tokens.weight" else std, generator=gen)
            else:
                p.fill_(1.0)  # RMSNorm weights
        model.model.embed_tokens.weight[:, 0] = CONST
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
            if gate_rank:
                a, b = gate_factors(shape, i, seed, gate_rank, device, std)
                layer.mlp.gate_proj.weight.copy_(a @ b)  # (n, d); column 0 is 0 (b[:, 0] = 0)
                del a, b
            layer.mlp.gate_proj.weight[:, 0] = 0.0
    src = ModelSource(f"{shape}-shaped random ReLU-gated LLaMA ({layers} layers, seed {seed})", "memory")
    return wrap_model(model, SyntheticTokenizer(vocab), src)


class _Stop(Exception):
    pass


@torch.no_grad()
def _ffn_input(lm, layer: int, ids: torch.Tensor) -> torch.Tensor:
    """(tokens, d) float32: layer `layer`'s FFN input for `ids` (the forward stops there)."""
    got = {}

    def hook(_mod, args):
        got["x"] = args[0].reshape(-1, args[0].shape[-1]).float()
        raise _Stop

    h = lm.layers[layer].mlp.register_forward_pre_hook(hook)
    try:
        lm.model.model(input_ids=ids, use_cache=False)
    except _Stop:
        pass
    finally:
        h.remove()
    return got["x"]


@torch.no_grad()
def calibrate(lm, shape: str, tokens: int = 2048, seq: int = 256, seed: int = 0, mean: float = 0.10) -> BenchModel:
    """Set each layer's constant-channel norm weight and gate column 0 so neuron j fires with probability p_j."""
    d, n, *_, vocab = SHAPES[shape]
    dev = next(lm.model.parameters()).device
    g = torch.Generator(dev).manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (max(1, tokens // seq), seq), device=dev, generator=g)
    targets, rows = [], []
    for i, layer in enumerate(lm.layers):
        p = np.clip(power_law(n, seed=seed * 1000 + i, mean=mean), *P_CLIP)
        targets.append(p)
        x = _ffn_input(lm, i, ids)  # (tokens, d)
        x0 = float(x[:, 0].mean())
        norm = layer.post_attention_layernorm.weight
        norm[0] = norm[0] / x0  # x[0] -> ~1
        x[:, 0] /= x0
        w = layer.mlp.gate_proj.weight
        pre = x[:, 1:] @ w[:, 1:].float().T  # (tokens, n) gate pre-activation without channel 0
        mu, sd = pre.mean(0), pre.std(0)
        z = torch.special.ndtri(torch.from_numpy(1 - p).to(dev, torch.float32))
        w[:, 0] = (-(mu + sd * z)).to(w.dtype)
        rows.append({"layer": i, "x0_raw_mean": x0, "x0_cv": float(x[:, 0].std() / x[:, 0].mean()),
                     "gate_sd_mean": float(sd.mean()), "bias_min": float(w[:, 0].min()),
                     "bias_max": float(w[:, 0].max())})
        del x, pre
    info = {"method": "constant residual channel 0 + gate column 0 (see bench/bench_model.py)",
            "tokens": int(ids.numel()), "seq": seq, "layers": rows,
            "target_mean_active": float(np.mean([p.mean() for p in targets])),
            "target_top20_share": float(np.mean([share_of_top(p) for p in targets])),
            "active_by_position": active_by_position(lm, shape)}
    return BenchModel(lm, shape, len(lm.layers), targets, info)


@torch.no_grad()
def with_gate_outputs(lm, ids: torch.Tensor, each) -> None:
    """Run the model on ids (batch, tokens) with each(layer index, gate pre-activations (batch, tokens, n)) called
    at every layer's gate_proj; the outputs are left unchanged."""
    def hook(i):
        def call(_mod, _args, out) -> None:  # a hook that returns something replaces the output: this one does not
            each(i, out)
        return call

    hooks = [layer.mlp.gate_proj.register_forward_hook(hook(i)) for i, layer in enumerate(lm.layers)]
    try:
        lm.model.model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def realised(lm, shape: str, tokens: int = 2048, seq: int = 256, seed: int = 7) -> list[np.ndarray]:
    """Per layer (n,) firing frequencies of relu(gate . x) > 0 on fresh random tokens (a quick check)."""
    d, n, *_, vocab = SHAPES[shape]
    dev = next(lm.model.parameters()).device
    g = torch.Generator(dev).manual_seed(seed)
    ids = torch.randint(0, vocab, (max(1, tokens // seq), seq), device=dev, generator=g)
    counts = [torch.zeros(n, device=dev) for _ in lm.layers]
    with_gate_outputs(lm, ids, lambda i, out: counts[i].add_((out.reshape(-1, n) > 0).sum(0)))
    return [(c / ids.numel()).cpu().numpy() for c in counts]


@torch.no_grad()
def active_by_position(lm, shape: str, edges: tuple[int, ...] = (0, 16, 64, 256), seqs: int = 4,
                       seed: int = 7) -> list[dict]:
    """Share of FFN neurons that fire (relu(gate . x) > 0, all layers) at positions edges[i]..edges[i+1] of `seqs`
    fresh random sequences of edges[-1] tokens: a model whose statistics hold at every position reads ~the same."""
    *_, vocab = SHAPES[shape]
    dev = next(lm.model.parameters()).device
    ids = torch.randint(0, vocab, (seqs, edges[-1]), device=dev, generator=torch.Generator(dev).manual_seed(seed))
    fired = torch.zeros(edges[-1], device=dev)  # (positions,) firings summed over sequences, layers, neurons
    with_gate_outputs(lm, ids, lambda _i, out: fired.add_((out > 0).float().sum((0, 2))))
    per = fired.cpu().numpy() / (seqs * len(lm.layers) * SHAPES[shape][1])  # (positions,)
    return [{"positions": f"{a}-{b}", "mean_active": float(per[a:b].mean())} for a, b in zip(edges, edges[1:])]


def model_bytes(shape: str, layers: int, size: float = 2) -> dict:
    """Bytes of the model at `size` bytes per weight (2: fp16): per layer (attention, FFN, norms), embeddings + head +
    final norm, total."""
    d, n, heads, kv, vocab = SHAPES[shape]
    hd = d // heads
    attn = d * d * 2 + 2 * d * kv * hd
    ffn = 3 * d * n
    norms = 2 * d
    outside = 2 * vocab * d + d
    per_layer = (attn + ffn + norms) * size
    return {"attention_per_layer": attn * size, "ffn_per_layer": ffn * size, "layer": per_layer,
            "outside_layers": outside * size, "total": layers * per_layer + outside * size}


def gpu_layers_for(budget: int, shape: str, layers: int, size: float = 2) -> int:
    """Whole layers that fit in `budget` after the LM head and final norm (llama.cpp -ngl, layer-split), at `size`
    bytes per weight (2: fp16; 34/32: llama.cpp's Q8_0). The input embedding stays in CPU RAM, in llama.cpp as in
    our runtime."""
    d, _, _, _, vocab = SHAPES[shape]
    b = model_bytes(shape, layers, size)
    return max(0, min(layers, int((budget - b["outside_layers"] + vocab * d * size) // b["layer"])))
