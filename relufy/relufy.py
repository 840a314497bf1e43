"""`relufy`: a gated-FFN (SwiGLU/GeGLU) model made ReLU-sparse by distillation from the original.

The student starts from the original weights with the FFN activation replaced (ReLU, dReLU or FATReLU,
common/sparse_act.py) and is trained to match the original model (the teacher, on the same device):

    loss = kl * KL(teacher || student) + lm * CE(next token) + l1(step) * penalty

where l1(step) rises in stages over the first `l1_ramp` of training, as ProSparse does, so the model first
recovers from the swap and then is pushed sparser. The penalty (`penalty`) is either
  h         mean |h|, h being what enters each down projection (ProSparse's L1). Gated FFNs have a scale symmetry
            (gate and up shrink, down grows) that lowers mean |h| without a single new zero;
  gate-cos  mean ReLU(cos(x, w_i)) over tokens and neurons, x the FFN input and w_i neuron i's gate row: the share
            of the gate pre-activation above 0 measured without scale, so only turning neurons off lowers it.

Data: token rows of a corpus (any the profiler takes) plus rows the teacher samples itself from short corpus
prompts (`teacher_text` of the pool): the offline Wikipedia sample is under a million tokens, and the teacher's
own text carries its distribution. The pool is built once and kept with the checkpoints, so `resume` replays the
same batches in the same order.

Output (atomic: written to OUT.partial, renamed at the end): an HF folder (config.json with the new
`hidden_act`, model.safetensors, tokenizer), meta.json, and summary.json with the training curve, per-layer
sparsity on held-out text and perplexity before and after.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from hotneurons.common.corpus import CorpusError, iter_texts, token_rows
from hotneurons.common.model_source import text_config
from hotneurons.common.sparse_act import mark_config, patch_ffn
from hotneurons.models.family import LoadedModel, decoder_layers
from hotneurons.relufy.config import (  # noqa: F401  (re-exported: the stage's settings live in config.py)
    ACTIVATIONS,
    PENALTIES,
    PRESETS,
    SOURCE_ACTIVATIONS,
    RelufyConfig,
    RelufyError,
    preset,
)
from tqdm.auto import tqdm

# ---------------------------------------------------------------------------------------------------------------
# The student, the pool, the schedule


def check_gated(lm: LoadedModel) -> None:
    if not lm.adapter.gated or lm.activation not in SOURCE_ACTIVATIONS or lm.adapter.name not in ("llama",):
        raise RelufyError(f"{lm.source.name} ({lm.info['model_type']}, {lm.activation}) has no LLaMA-style gated "
                          f"FFN to relufy: pi-relufy takes LLaMA/Mistral/Qwen models with SwiGLU-type FFNs")


def plain_model(lm: LoadedModel, dtype: torch.dtype, device: str, activation: str | None = None,
                threshold: float = 0.0) -> torch.nn.Module:
    """A fresh transformers model with `lm`'s weights in `dtype` on `device` (GGUF-loaded models stay flagged as
    quantized and refuse dtype changes; this one is an ordinary model), the FFN activation replaced if asked."""
    from transformers import AutoModelForCausalLM

    config = lm.model.config.__class__.from_dict(lm.model.config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    cfg = text_config(config)
    if activation is not None:
        cfg.hidden_act = "relu"  # built as ReGLU; patch_ffn then sets the exact kind
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(lm.model.state_dict(), strict=True)
    model.to(device)
    if activation is not None:
        patch_ffn([lm.adapter.ffn_module(layer) for layer in decoder_layers(model, model.config)], activation,
                  threshold)
        mark_config(text_config(model.config), activation, threshold)
    return model.eval()


def corpus_rows(tokenizer, cfg: RelufyConfig, dataset: str, max_tokens: int) -> torch.Tensor:
    """(rows, seq_len) int64 token rows of full length from the corpus."""
    rows = [r for r in token_rows(tokenizer, iter_texts(dataset, cfg.text_column), cfg.seq_len, max_tokens)
            if len(r) == cfg.seq_len]
    if not rows:
        raise CorpusError(f"dataset '{dataset}' has no text for one row of {cfg.seq_len} tokens")
    return torch.tensor(rows, dtype=torch.int64)


class _StepBar:
    """transformers' streamer protocol (put the prompt, then each step's tokens; end): moves `bar` every decoding
    step, since one batch's generate() runs for minutes on a CPU. `done()` tops it up to the batch's exact count."""

    def __init__(self, bar):
        self.bar, self.seen, self.prompt = bar, 0, True

    def put(self, value: torch.Tensor) -> None:
        if self.prompt:  # the first call hands the prompts
            self.prompt = False
            return
        self.seen += value.numel()
        self.bar.update(value.numel())

    def end(self) -> None:
        pass

    def done(self, tokens: int) -> None:
        self.bar.update(max(0, tokens - self.seen))
        self.seen, self.prompt = 0, True


@torch.no_grad()
def teacher_rows(teacher: torch.nn.Module, prompts: torch.Tensor, cfg: RelufyConfig, pad_id: int,
                 progress: bool) -> torch.Tensor:
    """(len(prompts), seq_len) rows the teacher samples (top-p) from each prompt; batched, static KV cache on CUDA."""
    from transformers import GenerationConfig

    device = next(teacher.parameters()).device
    gen = GenerationConfig(do_sample=True, top_p=cfg.top_p, top_k=0, temperature=1.0,
                           max_new_tokens=cfg.seq_len - prompts.shape[1], min_new_tokens=cfg.seq_len - prompts.shape[1],
                           pad_token_id=pad_id, eos_token_id=None,
                           cache_implementation="static" if device.type == "cuda" else None)
    torch.manual_seed(cfg.seed)
    out = []
    bar = tqdm(total=len(prompts) * cfg.seq_len, desc="teacher text", unit="tok", unit_scale=True,
               disable=not progress, dynamic_ncols=True)
    step_bar = _StepBar(bar)
    for i in range(0, len(prompts), cfg.gen_batch):
        ids = prompts[i:i + cfg.gen_batch].to(device)
        rows = teacher.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen,
                                streamer=step_bar if progress else None)
        out.append(rows[:, :cfg.seq_len].cpu())
        step_bar.done(rows[:, :cfg.seq_len].numel())
    bar.close()
    return torch.cat(out)


def build_pool(teacher: torch.nn.Module, tokenizer, cfg: RelufyConfig, progress: bool) -> torch.Tensor:
    """Corpus rows plus teacher rows (`teacher_text` of the pool; `chat_share` of those chat exchanges), in a fixed
    order. No larger than the training reads (cfg.steps batches): a small budget makes no teacher text it would never
    see (generating it is the slow part on a CPU)."""
    corpus = corpus_rows(tokenizer, cfg, cfg.dataset, cfg.corpus_tokens)
    needed = cfg.steps * cfg.batch_size  # rows the training reads
    corpus = corpus[:max(1, math.ceil(needed * (1 - cfg.teacher_text)))]
    if cfg.teacher_text <= 0:
        return corpus
    n_teacher = math.ceil(len(corpus) * cfg.teacher_text / (1 - cfg.teacher_text))
    n_chat = round(n_teacher * cfg.chat_share) if getattr(tokenizer, "chat_template", None) else 0
    g = torch.Generator().manual_seed(cfg.seed)
    starts = corpus[torch.randint(len(corpus), (n_teacher,), generator=g)]
    offs = torch.randint(cfg.seq_len - 2 * cfg.prompt_tokens + 1, (n_teacher,), generator=g)
    windows = torch.stack([r[o:o + 2 * cfg.prompt_tokens] for r, o in zip(starts, offs)])  # (n_teacher, 2 prompt)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = [corpus, teacher_rows(teacher, windows[n_chat:, :cfg.prompt_tokens], cfg, int(pad or 0), progress)]
    if n_chat:
        rows.append(chat_rows(teacher, tokenizer, windows[:n_chat], n_chat, cfg, int(pad or 0), progress))
    return torch.cat(rows)


CHAT_ASKS = ("Continue this text: {}", "What is this about? {}", "Explain in simple words: {}", "{}")


@torch.no_grad()
def chat_rows(teacher: torch.nn.Module, tokenizer, windows: torch.Tensor, n_rows: int, cfg: RelufyConfig,
              pad_id: int, progress: bool) -> torch.Tensor:
    """(<= n_rows, seq_len) rows of chat exchanges packed end to end: the user's turn asks about a corpus snippet
    (`windows`, token ids), the teacher samples its answer up to its end-of-turn token."""
    from transformers import GenerationConfig

    device = next(teacher.parameters()).device
    texts = [CHAT_ASKS[i % len(CHAT_ASKS)].format(tokenizer.decode(w, skip_special_tokens=True).strip())
             for i, w in enumerate(windows)]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=True) for t in texts]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    eos = tokenizer.eos_token_id
    gen = GenerationConfig(do_sample=True, top_p=cfg.top_p, top_k=0, temperature=1.0, max_new_tokens=cfg.chat_tokens,
                           pad_token_id=pad_id, eos_token_id=eos)
    torch.manual_seed(cfg.seed + 1)
    stream: list[int] = []
    bar = tqdm(total=n_rows * cfg.seq_len, desc="teacher chats", unit="tok", unit_scale=True, disable=not progress,
               dynamic_ncols=True)
    i = 0
    while len(stream) < n_rows * cfg.seq_len:
        batch = [prompts[(i + k) % len(prompts)] for k in range(cfg.gen_batch)]
        i += cfg.gen_batch
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(b)) + b for b in batch], device=device)  # left-padded
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch], device=device)
        # the bar moves a token a row each step (progress only); after the batch it is set to the tokens kept
        out = teacher.generate(input_ids=ids, attention_mask=mask, generation_config=gen,
                               streamer=_StepBar(bar) if progress else None)[:, width:].tolist()
        for b, answer in zip(batch, out):
            end = answer.index(eos) + 1 if eos in answer else len(answer)
            stream += b + answer[:end]
        bar.n = min(len(stream), n_rows * cfg.seq_len)
        bar.refresh()
    bar.close()
    rows = len(stream) // cfg.seq_len
    return torch.tensor(stream[:rows * cfg.seq_len], dtype=torch.int64).view(rows, cfg.seq_len)[:n_rows]


def batch_rows(step: int, n_rows: int, cfg: RelufyConfig) -> torch.Tensor:
    """Row indices of batch `step`: the pool shuffled anew each epoch (seeded), so any step can be replayed."""
    b = cfg.batch_size
    idx = []
    pos = step * b
    while len(idx) < b:
        epoch, off = divmod(pos, n_rows)
        perm = torch.randperm(n_rows, generator=torch.Generator().manual_seed(cfg.seed * 100_003 + epoch))
        take = perm[off:off + b - len(idx)]
        idx.extend(take.tolist())
        pos += len(take)
    return torch.tensor(idx)


def lr_at(step: int, cfg: RelufyConfig) -> float:
    warm = max(1, int(cfg.warmup * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def l1_at(step: int, cfg: RelufyConfig) -> float:
    """0 at the start (the model first recovers from the swap), `l1` from step `l1_ramp * steps` on; in between
    `l1_stages` equal stairs (0, l1/4, l1/2, 3 l1/4 for 4), or a line for 0 stages; 0 again from `l1_until * steps`."""
    if cfg.l1 <= 0 or step >= cfg.l1_until * cfg.steps:
        return 0.0
    ramp = int(cfg.l1_ramp * cfg.steps)
    if ramp <= 0:
        return cfg.l1
    frac = min(1.0, step / ramp)
    if cfg.l1_stages > 0:
        frac = math.floor(frac * cfg.l1_stages) / cfg.l1_stages
    return cfg.l1 * frac


class FFNValues:
    """Forward pre-hooks on each down projection: the values h entering it, for the penalty and sparsity; with
    penalty "gate-cos", forward hooks on each gate projection keep ReLU(cos(x, w_i)) as well.

    Zero counts stay on the device until `sparsity()` (one sync a step, not one a layer)."""

    def __init__(self, model: torch.nn.Module, adapter, keep: bool, penalty: str = "h"):
        ffns = [adapter.layer_ffn(layer) for layer in decoder_layers(model, model.config)]
        self.mods = [f["down"] for f in ffns]
        self.keep, self.penalty = keep, penalty
        self.terms: list[torch.Tensor] = []  # per layer this step: the penalty's term
        self.zeros: list[list[torch.Tensor]] = [[] for _ in self.mods]  # per layer, exact zeros of each call
        self.seen = [0] * len(self.mods)  # per layer, values seen
        self.handles = [m.register_forward_pre_hook(self._hook(i)) for i, m in enumerate(self.mods)]
        if keep and penalty == "gate-cos":
            self.handles += [f["gate"].register_forward_hook(self._gate_hook) for f in ffns]

    def _hook(self, i: int):
        def hook(module, args):
            h = args[0]  # (batch, seq, neurons)
            if self.keep and self.penalty == "h":
                self.terms.append(h.float().abs().mean())
            self.zeros[i].append((h == 0).sum())
            self.seen[i] += h.numel()
        return hook

    def _gate_hook(self, module, args, z):
        x = args[0].float()  # (batch, seq, d)
        w_norm = module.weight.float().norm(dim=1)  # (neurons,)
        cos = z.float() / (x.norm(dim=-1, keepdim=True) * w_norm + 1e-6)  # (batch, seq, neurons)
        self.terms.append(torch.relu(cos).mean())

    def l1(self) -> torch.Tensor:
        return torch.stack(self.terms).mean()

    def sparsity(self) -> list[float]:
        """Per layer, the share of values seen since `reset` that were exactly 0."""
        zeros = torch.stack([torch.stack(z).sum() for z in self.zeros]).double().cpu()  # (layers,)
        return [float(z) / max(1, s) for z, s in zip(zeros, self.seen)]

    def reset(self) -> None:
        self.terms.clear()
        self.zeros = [[] for _ in self.mods]
        self.seen = [0] * len(self.mods)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student), in float32."""
    v = student_logits.shape[-1]
    s = F.log_softmax(student_logits.float().reshape(-1, v), -1)
    t = F.log_softmax(teacher_logits.float().reshape(-1, v), -1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


# ---------------------------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def evaluate(model: torch.nn.Module, adapter, rows: torch.Tensor, batch_size: int, amp: bool,
             desc: str | None = None) -> dict[str, Any]:
    """Perplexity and per-layer exact-zero share of h on held-out rows (`desc`: a progress bar's label)."""
    device = next(model.parameters()).device
    vals = FFNValues(model, adapter, keep=False)
    nll, count = 0.0, 0
    try:
        for i in tqdm(range(0, len(rows), batch_size), desc=desc, unit="batch", disable=desc is None,
                      dynamic_ncols=True, leave=False):
            ids = rows[i:i + batch_size].to(device)
            with torch.autocast(device.type, torch.bfloat16, enabled=amp):
                logits = model(input_ids=ids, use_cache=False).logits  # (b, s, vocab)
            nll += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(),
                                         ids[:, 1:].reshape(-1), reduction="sum"))
            count += ids[:, 1:].numel()
        per_layer = vals.sparsity()
    finally:
        vals.close()
    return {"perplexity": math.exp(nll / count), "tokens": count, "ffn_sparsity": sum(per_layer) / len(per_layer),
            "ffn_sparsity_per_layer": per_layer}
