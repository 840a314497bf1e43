"""`relufy`: the distillation loop, its checkpoints and its output folder (relufy/relufy.py has the parts)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from hotneurons.common import artifacts
from hotneurons.models.family import LoadedModel, load_model, pick_device
from hotneurons.relufy.config import RelufyInterrupted
from hotneurons.relufy.relufy import (
    FFNValues,
    RelufyConfig,
    RelufyError,
    batch_rows,
    build_pool,
    check_gated,
    corpus_rows,
    evaluate,
    kl_loss,
    l1_at,
    lr_at,
    plain_model,
)
from safetensors.torch import load_file, save_file, save_model
from safetensors.torch import load_model as load_weights
from tqdm.auto import tqdm

CURVE_POINTS = 60  # rows of the training curve kept in summary.json


def check_out(out: Path, resume: bool, force: bool) -> None:
    """Refuse, before any slow work, an output that exists or an interrupted run the flags do not address."""
    partial = partial_dir(out)
    if out.exists() and not force:
        raise RelufyError(f"'{out}' exists: pass force to replace it, or pick another output folder")
    if resume and not (partial / "checkpoint" / "state.json").exists():
        raise RelufyError(f"no interrupted relufy in '{partial}' to resume: run without resume")
    if not resume and not force and (partial / "checkpoint" / "state.json").exists():
        raise RelufyError(f"an interrupted relufy is in '{partial}': resume it, or force to start over")


def partial_dir(out: Path) -> Path:
    """Where artifacts.staged builds `out`; it holds the checkpoint of an interrupted run."""
    return out.with_name(f".{out.name}.partial")


def _has_checkpoint(partial: Path) -> bool:
    return (partial / "checkpoint" / "state.json").exists()


def relufy(model: str | None, out: str | Path, cfg: RelufyConfig, *, gguf_file: str | None = None,
           device: str = "auto", resume: bool = False, force: bool = False, progress: bool = True,
           on_step: Callable[[int, dict[str, Any]], None] | None = None, lm: LoadedModel | None = None,
           pool: torch.Tensor | None = None) -> dict[str, Any]:
    """Distil a ReLU-family student from `model`; writes the HF folder `out` and returns its summary.

    `on_step(step, stats)` is called after each optimiser step (notebooks plot from it; tests interrupt
    from it). On KeyboardInterrupt after the pool is built, the pool and the last checkpoint (step 0's at
    least) stay in OUT.partial for `resume`; before that, nothing is kept. `lm` and `pool`
    (from `build_pool`, same config) skip loading the model and building the pool again, as sweeps do.
    """
    out = Path(out)
    check_out(out, resume, force)
    device = pick_device(device)
    cuda = device.startswith("cuda")
    t_start = time.perf_counter()
    if lm is None:
        lm = load_model(model, gguf_file, device="cpu", dtype="float32")
    check_gated(lm)
    with artifacts.staged(out, fresh=not resume, keep_on_failure=_has_checkpoint) as partial:
        state = _read_state(partial, cfg) if resume else None

        teacher = plain_model(lm, torch.bfloat16 if cuda else torch.float32, device)
        for p in teacher.parameters():
            p.requires_grad_(False)
        micro = cfg.batch_size if cuda else micro_rows(cfg.seq_len, teacher.config.vocab_size)
        label = "eval: {}" if progress else None  # the evaluations' bar labels
        pool_path = partial / "pool.safetensors"
        eval_rows = corpus_rows(lm.tokenizer, cfg, cfg.eval_dataset, cfg.eval_tokens)
        if state is None:
            pool = build_pool(teacher, lm.tokenizer, cfg, progress) if pool is None else pool
            save_file({"pool": pool.contiguous()}, str(pool_path))
            before = evaluate(teacher, lm.adapter, eval_rows, micro, cuda, label and label.format("the teacher"))
        else:
            pool = load_file(str(pool_path))["pool"]
            before = state["eval_before"]

        student = plain_model(lm, torch.float32, device, cfg.activation, cfg.fat_threshold)
        opt = torch.optim.AdamW(student.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        step0, curve, swapped = 0, [], None
        if state is None:
            swapped = evaluate(student, lm.adapter, eval_rows, micro, cuda, label and label.format("the student"))
            # a checkpoint of step 0: the teacher text (the pool, often half the run on a CPU) survives an interrupt
            _write_checkpoint(partial, student, opt, cfg, 0, [], before, swapped)
        else:
            load_weights(student, str(partial / "checkpoint" / "student.safetensors"))
            _load_optimizer(opt, partial / "checkpoint" / "optimizer.safetensors")
            step0, curve, swapped = state["step"], state["curve"], state["eval_swapped"]

        vals = FFNValues(student, lm.adapter, keep=True, penalty=cfg.penalty)
        every = max(1, cfg.steps // CURVE_POINTS)
        bar = tqdm(total=cfg.steps, initial=step0, desc="relufy", unit="step", disable=not progress, dynamic_ncols=True)
        t_train, tokens_done = time.perf_counter(), 0
        student.train()
        step = step0
        try:
            for step in range(step0, cfg.steps):
                ids = pool[batch_rows(step, len(pool), cfg)].to(device)  # (batch, seq)
                lr, l1w = lr_at(step, cfg), l1_at(step, cfg)
                for group in opt.param_groups:
                    group["lr"] = lr
                vals.reset()
                opt.zero_grad(set_to_none=True)
                sums = {"loss": 0.0, "kl": 0.0, "l1": 0.0}
                for part in ids.split(micro):  # each part's losses are means: weighted by its share, the batch's
                    share = len(part) / len(ids)
                    losses = _losses(teacher, student, vals, part, cfg, l1w, cuda)
                    (share * losses["loss"]).backward()
                    vals.terms.clear()  # the terms hold the graph: freed before the next part
                    for k in sums:
                        sums[k] += share * losses[k].item()
                torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
                opt.step()
                tokens_done += ids.numel()
                sparsity = sum(vals.sparsity()) / len(vals.mods)
                stats = {"step": step + 1, "tokens": (step + 1) * ids.numel(), **sums, "l1_weight": l1w, "lr": lr,
                         "sparsity": sparsity}
                if (step + 1) % every == 0 or step + 1 == cfg.steps:
                    curve.append(stats)
                tok_s = tokens_done / max(1e-9, time.perf_counter() - t_train)
                bar.set_postfix(kl=f"{stats['kl']:.3f}", zeros=f"{sparsity:.1%}", tok_s=f"{tok_s:,.0f}", refresh=False)
                bar.update(1)
                if on_step is not None:
                    on_step(step + 1, stats)
                if (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                    _write_checkpoint(partial, student, opt, cfg, step + 1, curve, before, swapped)
        except KeyboardInterrupt:
            bar.close()
            done = _last_checkpoint_step(partial)
            raise RelufyInterrupted(f"interrupted at step {step + 1}: the teacher text and the checkpoint of step "
                                    f"{done} are kept in '{partial}'; continue with resume") from None
        bar.close()
        vals.close()
        train_s = time.perf_counter() - t_train
        student.eval()
        after = evaluate(student, lm.adapter, eval_rows, micro, cuda, label and label.format("the relufied student"))
        summary = {
            "model": lm.info["name"], "activation": cfg.activation, "config": asdict(cfg),
            "pool_rows": len(pool), "pool_tokens": pool.numel(), "steps": cfg.steps,
            "tokens": cfg.steps * cfg.batch_size * cfg.seq_len, "train_seconds": round(train_s, 1),
            "tokens_per_s": round(tokens_done / max(1e-9, train_s), 1) if tokens_done else None,
            "seconds": round(time.perf_counter() - t_start, 1), "device": device,
            "eval": {"dataset": cfg.eval_dataset, "tokens": after["tokens"], "original": before,
                     "swapped_untrained": swapped, "relufied": after,
                     "perplexity_ratio": after["perplexity"] / before["perplexity"]},
            "curve": curve,
        }
        _write_output(partial, student, lm, cfg, summary)
    return summary


# rows of a batch whose logits are alive at once on the CPU: a row's teacher and student logits, their float32
# log-softmaxes and the student's gradient are ~6 (seq, vocab) float32 tensors; a whole batch of 32 x 256 tokens of
# a 49,152-token vocabulary at once held ~12 GB
LOGITS_BYTES = 1024**3


def micro_rows(seq_len: int, vocab: int) -> int:
    """Rows of a batch computed at once on the CPU (gradients accumulated over the parts)."""
    return max(1, LOGITS_BYTES // (6 * 4 * seq_len * vocab))


def _losses(teacher, student, vals, ids: torch.Tensor, cfg: RelufyConfig, l1w: float,
            cuda: bool) -> dict[str, torch.Tensor]:
    """The step's losses on `ids` (rows, seq), each a mean over its tokens: KL, L1 and their weighted sum."""
    with torch.autocast("cuda", torch.bfloat16, enabled=cuda):
        with torch.no_grad():
            t_logits = teacher(input_ids=ids, use_cache=False).logits  # (rows, seq, vocab)
        s_logits = student(input_ids=ids, use_cache=False).logits  # (rows, seq, vocab)
    kl = kl_loss(s_logits, t_logits)
    loss = cfg.kl * kl
    if cfg.lm > 0:
        v = s_logits.shape[-1]
        loss = loss + cfg.lm * torch.nn.functional.cross_entropy(
            s_logits[:, :-1].float().reshape(-1, v), ids[:, 1:].reshape(-1))
    l1 = vals.l1()
    if l1w > 0:
        loss = loss + l1w * l1
    return {"loss": loss, "kl": kl, "l1": l1}


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints and output


def _read_state(partial: Path, cfg: RelufyConfig) -> dict[str, Any]:
    state = json.loads((partial / "checkpoint" / "state.json").read_text())
    if state["config"] != json.loads(json.dumps(asdict(cfg))):
        diff = {k: v for k, v in asdict(cfg).items() if state["config"].get(k) != v}
        raise RelufyError(f"the interrupted relufy in '{partial}' used other settings ({', '.join(diff)}): "
                          f"resume with the same settings, or force to start over")
    return state


def _write_checkpoint(partial: Path, student, opt, cfg: RelufyConfig, step: int, curve: list, before: dict,
                      swapped: dict) -> None:
    """Student weights, AdamW moments and the loop's state, swapped in whole (an interrupt leaves the last one)."""
    tmp = partial / "checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_model(student, str(tmp / "student.safetensors"))
    moments = {}
    for i, p in enumerate(student.parameters()):
        s = opt.state.get(p)
        if s:
            moments[f"{i}.exp_avg"] = s["exp_avg"].contiguous()
            moments[f"{i}.exp_avg_sq"] = s["exp_avg_sq"].contiguous()
            moments[f"{i}.step"] = torch.as_tensor(s["step"], dtype=torch.float32).reshape(1)
    save_file(moments, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps({"step": step, "config": asdict(cfg), "curve": curve,
                                                "eval_before": before, "eval_swapped": swapped}))
    shutil.rmtree(partial / "checkpoint", ignore_errors=True)
    tmp.rename(partial / "checkpoint")


def _load_optimizer(opt, path: Path) -> None:
    moments = load_file(str(path))
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        if f"{i}.exp_avg" in moments:
            opt.state[p] = {"step": moments[f"{i}.step"].reshape(()).to(p.device),
                            "exp_avg": moments[f"{i}.exp_avg"].to(p.device),
                            "exp_avg_sq": moments[f"{i}.exp_avg_sq"].to(p.device)}


def _last_checkpoint_step(partial: Path) -> int:
    return json.loads((partial / "checkpoint" / "state.json").read_text())["step"]


def _write_output(partial: Path, student, lm: LoadedModel, cfg: RelufyConfig, summary: dict[str, Any]) -> None:
    """The HF folder, meta.json and summary.json in the staged folder; the checkpoint and pool leave it."""
    shutil.rmtree(partial / "checkpoint", ignore_errors=True)
    (partial / "pool.safetensors").unlink(missing_ok=True)
    student.save_pretrained(partial, safe_serialization=True)
    lm.tokenizer.save_pretrained(partial)
    meta = artifacts.base_meta("relufy", inputs={"model": lm.info})
    meta["config"] = asdict(cfg)
    artifacts.write_json(partial / "meta.json", meta)
    artifacts.write_json(partial / "summary.json", summary)
