"""`profile_model`: count FFN neuron activations over a corpus and store predictor training samples.

Output `RUN/profile/` (see docs/artifacts.md): `neurons.parquet` (layer, neuron, count), `meta.json`, and
`samples/layer_XXX.{x,mask}.npy`. Work goes to `RUN/.profile.partial/` with periodic checkpoints; the
finished folder is swapped into place in one rename, so an existing profile survives any failure.
Under `torchrun` each rank profiles every world_size-th batch and the counts are all-reduced at the end.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from hotneurons.common import artifacts
from hotneurons.common.artifacts import ArtifactError
from hotneurons.common.corpus import CorpusError, iter_texts
from hotneurons.common.models import LoadedModel, load_model, pick_device
from hotneurons.profiler.hooks import ActivationCounter, MagnitudeCollector, SampleReservoir, activation_rule
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm


@dataclass(frozen=True)
class ProfileConfig:
    """Everything that determines a profile's contents (a resumed run must match it exactly)."""

    model: str | None = None  # hub id, folder or .gguf path; None = embedded SmolLM2-135M-Instruct
    gguf_file: str | None = None
    revision: str | None = None
    dataset: str = "wikipedia-sample"
    text_column: str = "text"
    tokens: int = 100_000  # budget
    seq_len: int = 512
    batch_size: int = 8
    target_sparsity: float = 0.5  # non-ReLU models only: share of neurons inactive per token
    calibration_tokens: int = 8192  # first tokens used to set tau_l (non-ReLU models)
    samples_per_layer: int = 16384  # reservoir size (0 = store no samples)
    seed: int = 0
    dtype: str = "auto"
    activation: str | None = None  # override, e.g. "drelu" for Bamboo/TurboSparse remote-code models
    trust_remote_code: bool = False

    def resume_key(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("trust_remote_code",)}


def token_rows(tokenizer, texts: Iterator[str], seq_len: int, max_tokens: int) -> Iterator[list[int]]:
    """Pack documents (joined by EOS) into rows of seq_len tokens, each starting with BOS when the model has one.

    Stops at max_tokens tokens in total; only the last row may be shorter (budget or corpus reached).
    """
    head = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    buf: list[int] = []
    total = 0
    for text in texts:
        if not text:
            continue
        buf.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + eos)
        while len(buf) >= seq_len - len(head):
            n = min(seq_len, max_tokens - total) - len(head)  # body tokens of this row
            if n <= 0:
                return
            row = head + buf[:n]
            del buf[:n]
            total += len(row)
            yield row
            if total >= max_tokens:
                return
    n = min(len(buf), max_tokens - total - len(head))
    if n > 0:
        yield head + buf[:n]


def token_batches(tokenizer, texts: Iterator[str], seq_len: int, batch_size: int,
                  max_tokens: int) -> Iterator[torch.Tensor]:
    """(batch, seq_len) int64 batches of token_rows; a final shorter row comes alone as a (1, len) batch."""
    rows: list[list[int]] = []
    for row in token_rows(tokenizer, texts, seq_len, max_tokens):
        if len(row) < seq_len:
            if rows:
                yield _stack(rows)
                rows = []
            yield _stack([row])
            continue
        rows.append(row)
        if len(rows) == batch_size:
            yield _stack(rows)
            rows = []
    if rows:
        yield _stack(rows)


def _stack(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


@torch.inference_mode()
def forward(lm: LoadedModel, ids: torch.Tensor) -> None:
    """The decoder stack only: counting needs no logits, so the LM head is skipped."""
    lm.model.base_model(input_ids=ids.to(lm.model.device), use_cache=False)


def calibrate_taus(lm: LoadedModel, cfg: ProfileConfig) -> list[float]:
    """tau_l so that cfg.target_sparsity of (token, neuron) pairs in layer l fall at or below it."""
    batches = token_batches(lm.tokenizer, iter_texts(cfg.dataset, cfg.text_column), cfg.seq_len,
                            cfg.batch_size, cfg.calibration_tokens)
    with MagnitudeCollector(lm, seed=cfg.seed) as col:
        for ids in batches:
            forward(lm, ids)
    if not col.values[0]:
        raise CorpusError(f"dataset '{cfg.dataset}' is empty: no text to profile")
    return col.taus(cfg.target_sparsity)


def _dist() -> tuple[int, int]:
    """(rank, world_size); initialises torch.distributed when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), world


def profile_model(cfg: ProfileConfig, out: str | os.PathLike | None = None, *, resume: bool = False,
                  force: bool = False, device: str = "auto", checkpoint_every: int = 50,
                  progress: bool = True, lm: LoadedModel | None = None,
                  _stop_after: int | None = None) -> dict[str, Any]:
    """Profile `cfg.model` over `cfg.dataset`; write RUN/profile/ and return its meta.json dict.

    `lm` reuses an already loaded model (notebooks, tests). `_stop_after` interrupts after that many batches,
    leaving a checkpoint, as a crash would (tests of --resume).
    """
    rank, world = _dist()
    if world > 1 and device in ("auto", "cuda") and torch.cuda.is_available():
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
        torch.cuda.set_device(device)
    device = pick_device(device)
    if lm is None:
        lm = load_model(cfg.model, cfg.gguf_file, revision=cfg.revision, device=device, dtype=cfg.dtype,
                        trust_remote_code=cfg.trust_remote_code, activation=cfg.activation)
    if not any(iter_texts(cfg.dataset, cfg.text_column)):  # stops at the first text; fails before touching the disk
        raise CorpusError(f"dataset '{cfg.dataset}' is empty: no text to profile")
    run = Path(out) if out is not None else artifacts.default_run_dir(lm.info["name"])
    final, partial = run / "profile", run / ".profile.partial"
    _check_existing(final, partial, lm.info, resume, force)
    _barrier(world)  # every rank has checked before rank 0 creates the partial folder
    try:
        return _profile(cfg, lm, final, partial, rank, world, resume, checkpoint_every, progress, _stop_after)
    except Exception:
        if rank == 0 and not any(partial.glob("state.rank*.json")):
            shutil.rmtree(partial, ignore_errors=True)  # nothing worth resuming: leave no debris behind
        raise


def _profile(cfg: ProfileConfig, lm: LoadedModel, final: Path, partial: Path, rank: int, world: int, resume: bool,
             checkpoint_every: int, progress: bool, _stop_after: int | None) -> dict[str, Any]:
    # state.json: what every rank shares (settings, taus); state.rank{r}.json: how far rank r got
    key = {**cfg.resume_key(), "fingerprint": lm.info["fingerprint"], "world_size": world}
    ckpt, rank_state = partial / f"ckpt.rank{rank}.safetensors", partial / f"state.rank{rank}.json"
    shared: dict[str, Any] = {"key": key, "taus": None}
    state: dict[str, Any] = {"batches": 0, "tokens": 0, "seconds": 0.0}
    if resume:
        shared = artifacts.read_json(partial / "state.json")
        _check_resume_key(shared["key"], key, partial)
        if rank_state.exists():
            state = artifacts.read_json(rank_state)
    elif rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier(world)

    rule = activation_rule(lm.activation)
    if rule == "abs>tau" and shared["taus"] is None:
        shared["taus"] = calibrate_taus(lm, cfg)
    taus = shared["taus"] if rule == "abs>tau" else None
    if rank == 0:
        artifacts.write_json(partial / "state.json", shared)

    info = lm.info
    capacity = cfg.samples_per_layer // world + (rank < cfg.samples_per_layer % world)  # this rank's share
    reservoir = None
    if capacity > 0:
        reservoir = SampleReservoir(partial / ("samples" if world == 1 else f"samples.rank{rank}"), capacity,
                                    info["n_layers"], info["d_model"], info["n_neurons"], cfg.seed, rank,
                                    resume=state["batches"] > 0)
    counter = ActivationCounter(lm, taus, reservoir)
    if state["batches"] > 0:
        counter.counts.copy_(load_file(str(ckpt))["counts"])

    batches = token_batches(lm.tokenizer, iter_texts(cfg.dataset, cfg.text_column), cfg.seq_len, cfg.batch_size,
                            cfg.tokens)
    bar = tqdm(total=cfg.tokens, unit="tok", unit_scale=True, desc="profiling", disable=not progress or rank != 0,
               dynamic_ncols=True)
    start, seconds0, done_here = time.perf_counter(), state["seconds"], 0
    stream_tokens = 0  # tokens of all ranks: every rank tokenises the whole stream and takes its batches
    with counter:
        for b, ids in enumerate(batches):
            stream_tokens += ids.numel()
            bar.update(ids.numel())
            mine = b // world  # this rank's batch index
            if b % world != rank or mine < state["batches"]:
                continue
            if reservoir is not None:
                reservoir.plan(mine, state["tokens"], ids.numel(), counter.counts.device)
            forward(lm, ids)
            if reservoir is not None:
                reservoir.commit()
            state["tokens"] += ids.numel()
            state["batches"] = mine + 1
            done_here += 1
            stop = _stop_after is not None and done_here >= _stop_after
            if state["batches"] % checkpoint_every == 0 or stop:
                state["seconds"] = seconds0 + time.perf_counter() - start
                _checkpoint(ckpt, rank_state, counter, reservoir, state)
            if stop:
                bar.close()
                raise KeyboardInterrupt(f"stopped after {done_here} batches (checkpoint kept in {partial})")
    bar.close()
    seconds = seconds0 + time.perf_counter() - start

    counts = counter.counts
    tokens = torch.tensor([state["tokens"]], dtype=torch.int64, device=counts.device)
    filled = [torch.tensor([min(state["tokens"], capacity)], dtype=torch.int64, device=counts.device)]
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(counts)
        dist.all_reduce(tokens)
        mine_filled, filled = filled[0], [torch.zeros_like(filled[0]) for _ in range(world)]
        dist.all_gather(filled, mine_filled)
    if reservoir is not None:
        reservoir.flush()
    _barrier(world)
    meta: dict[str, Any] = {}
    if rank == 0:
        meta = _finalize(partial, final, lm, cfg, counts.cpu().numpy(), int(tokens), taus, seconds, world,
                         [int(f) for f in filled], capacity, stream_tokens < cfg.tokens)
    _barrier(world)
    return meta


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _check_existing(final: Path, partial: Path, info: dict, resume: bool, force: bool) -> None:
    if (final / "meta.json").exists() and not force:
        old = artifacts.read_json(final / "meta.json")
        if old.get("model", {}).get("fingerprint") != info["fingerprint"]:
            raise ArtifactError(f"{final} holds a profile of '{old.get('model', {}).get('name')}', not of "
                                f"'{info['name']}': pass --force to replace it, or choose another --out")
    if partial.exists() and not resume and not force:
        raise ArtifactError(f"an interrupted profile is in {partial}: pass --resume to continue it or --force to "
                            f"start over")
    if resume and not (partial / "state.json").exists():
        raise ArtifactError(f"--resume: no interrupted profile in {partial}; run without --resume")


def _check_resume_key(saved: dict, now: dict, partial: Path) -> None:
    diff = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if diff:
        k = diff[0]
        raise ArtifactError(f"--resume: the run in {partial} used {k}={saved.get(k)!r}, now {now.get(k)!r}: "
                            f"use the same settings, or --force to start over")


def _checkpoint(ckpt: Path, rank_state: Path, counter: ActivationCounter, reservoir: SampleReservoir | None,
                state: dict) -> None:
    """Samples first, then counts, then state: a state file names only what is already on disk."""
    if reservoir is not None:
        reservoir.flush()
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    save_file({"counts": counter.counts.cpu().contiguous()}, str(tmp))
    os.replace(tmp, ckpt)
    artifacts.write_json(rank_state, state)


def share_covering(counts: np.ndarray, share: float = 0.8) -> np.ndarray:
    """Per layer, the fraction of neurons (hottest first) that covers `share` of the layer's activations."""
    c = -np.sort(-counts, axis=1).astype(np.float64)  # (layers, neurons), hottest first
    total = c.sum(1, keepdims=True)
    cum = np.cumsum(c, axis=1) / np.where(total > 0, total, 1)
    k = (cum < share - 1e-12).sum(1) + 1  # neurons needed
    return np.where(total[:, 0] > 0, k / counts.shape[1], np.nan)


def _finalize(partial: Path, final: Path, lm: LoadedModel, cfg: ProfileConfig, counts: np.ndarray, tokens: int,
              taus: list[float] | None, seconds: float, world: int, filled: list[int], capacity: int,
              short: bool) -> dict[str, Any]:
    n_layers, n_neurons = counts.shape
    samples = sum(filled) if cfg.samples_per_layer > 0 else 0
    if cfg.samples_per_layer > 0:
        _merge_samples(partial, n_layers, filled, capacity, world)
    layer = np.repeat(np.arange(n_layers, dtype=np.int32), n_neurons)
    neuron = np.tile(np.arange(n_neurons, dtype=np.int32), n_layers)
    df = pd.DataFrame({"layer": layer, "neuron": neuron, "count": counts.reshape(-1).astype(np.int64)})
    artifacts.write_parquet(partial / "neurons.parquet", df)
    sparsity = 1.0 - counts.sum(1) / max(1, tokens * n_neurons)
    meta = artifacts.base_meta("profile", inputs={"dataset": cfg.dataset})
    meta.update({
        "model": lm.info,
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("model", "gguf_file", "revision")},
        "dataset": cfg.dataset,
        "tokens": tokens,
        "tokens_requested": cfg.tokens,
        "corpus_exhausted": short,
        "rule": activation_rule(lm.activation),
        "taus": taus,
        "target_sparsity": cfg.target_sparsity if taus is not None else None,
        "sparsity_per_layer": sparsity.round(6).tolist(),
        "mean_sparsity": float(sparsity.mean()),
        "share_covering_80pct_per_layer": share_covering(counts, 0.8).round(6).tolist(),
        "samples": {
            "count": samples,
            "x": "samples/layer_{i:03d}.x.npy: float16 (count, d_model): input of the FFN's first linear "
                 "layers (after the pre-FFN norm)",
            "mask": "samples/layer_{i:03d}.mask.npy: uint8 (count, ceil(n_neurons/8)): np.packbits of the "
                    "active mask along neurons",
        },
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens / seconds, 1) if seconds > 0 else None,
        "world_size": world,
        "device": str(lm.model.device),
    })
    artifacts.write_json(partial / "meta.json", meta)
    for name in os.listdir(partial):
        if name.startswith(("ckpt.", "state")):
            os.unlink(partial / name)
    artifacts.replace_dir(partial, final)
    return meta


def _merge_samples(partial: Path, n_layers: int, filled: list[int], capacity: int, world: int) -> None:
    """Single full reservoir: already in place. Otherwise copy each rank's filled rows into one file per layer."""
    out = partial / "samples"
    if world == 1 and filled[0] == capacity:
        return
    srcs = [out] if world == 1 else [partial / f"samples.rank{r}" for r in range(world)]
    staging = partial / "samples.merged"
    staging.mkdir(exist_ok=True)
    for i in range(n_layers):
        for kind in ("x", "mask"):
            parts = [np.load(src / f"layer_{i:03d}.{kind}.npy", mmap_mode="r")[:f] for src, f in zip(srcs, filled)]
            dst = np.lib.format.open_memmap(staging / f"layer_{i:03d}.{kind}.npy", mode="w+", dtype=parts[0].dtype,
                                            shape=(sum(filled), parts[0].shape[1]))
            np.concatenate(parts, out=dst) if sum(filled) else None
            dst.flush()
            del dst, parts
    for src in srcs:
        shutil.rmtree(src)
    os.replace(staging, out)
