"""`profile_model`: count FFN neuron activations over a corpus and store predictor training samples.

Output `RUN/profile/` (see docs/artifacts.md): `neurons.parquet` (layer, neuron, count), `meta.json`
(artifacts/profile.ProfileMeta), and `samples/layer_XXX.{x,mask}.npy` (+ `.rms.npy` where the model has a pre-FFN
RMSNorm). Work goes to `RUN/.profile.partial/`
(common/artifacts.staged) with periodic checkpoints; the finished folder is swapped into place in one rename,
so an existing profile survives any failure, and an interrupted run can be resumed from its checkpoint.
Under `torchrun` each rank profiles every world_size-th batch and the counts are all-reduced at the end.

A local safetensors folder or GGUF file runs layer by layer from the file (models/streamed.py: one layer's weights
on the device at a time, for models bigger than it), a hub id whole through transformers; both feed the same hooks
(profiler/hooks.py) and write the same artifacts. Under torchrun either way shards by batches. A mixture of experts runs
layer by layer only and is counted per expert (profiler/experts.py): experts.parquet, an expert column, no samples.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from hotneurons.artifacts.profile import ProfileMeta, ProfileSamples
from hotneurons.common import artifacts
from hotneurons.common.artifacts import (
    StageInterrupted,
    deferred_interrupt,
)
from hotneurons.common.corpus import CorpusError, check_corpus, iter_texts, token_batches
from hotneurons.common.ffn import activation_rule, share_covering
from hotneurons.common.gating import SPARSITIES
from hotneurons.common.kinds import Rule
from hotneurons.common.model_source import ModelError, resolve_source
from hotneurons.models.family import ExpertsRefused, LoadedModel, check_model, load_model, pick_device, pick_dtype
from hotneurons.models.ffn_hooks import device_of
from hotneurons.models.stream_memory import check_memory, profile_need
from hotneurons.models.streamed import StreamedModel, open_streamed, streams
from hotneurons.models.streamed_experts import ExpertsModel, experts_need, open_experts
from hotneurons.profiler import checkpoint, experts, gated
from hotneurons.profiler.hooks import ActivationCounter, MagnitudeCollector, SampleReservoir, sample_norms
from safetensors.torch import load_file
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
    # SwiGLU / GeGLU models (profiler/gated.py): what neurons.parquet counts (h: |h| > tau_h; gate: |act(g)| > tau_g;
    # gate-h: both), and the sparsities every criterion's thresholds and pass counts are tabulated at (+ the target)
    criterion: str = "h"
    sparsities: tuple[float, ...] = SPARSITIES

    def resume_key(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v  # as state.json gives it back
                for k, v in asdict(self).items() if k not in ("trust_remote_code",)}


@torch.inference_mode()
def forward(lm: LoadedModel | StreamedModel, ids: torch.Tensor) -> None:
    """The decoder stack only: counting needs no logits, so the LM head is skipped."""
    if isinstance(lm, StreamedModel):
        lm.forward(ids)
    else:
        lm.model.base_model(input_ids=ids.to(lm.model.device), use_cache=False)


def calibrate_taus(lm: LoadedModel | StreamedModel, cfg: ProfileConfig) -> tuple[list[float], dict | None]:
    """(tau_l so that cfg.target_sparsity of (token, neuron) pairs in layer l fall at or below it, and on SwiGLU /
    GeGLU models the thresholds of every gated criterion at every tabulated sparsity: profiler/gated.calibrate)."""
    batches = token_batches(lm.tokenizer, iter_texts(cfg.dataset, cfg.text_column), cfg.seq_len,
                            cfg.batch_size, cfg.calibration_tokens)
    if isinstance(lm, ExpertsModel):
        col = experts.ExpertMagnitudes(lm, seed=cfg.seed)
    else:
        col = MagnitudeCollector(lm, seed=cfg.seed, gated=gated.is_gated(lm))
    with col:
        for ids in batches:
            forward(lm, ids)
    if not col.values[0]:
        raise CorpusError(f"dataset '{cfg.dataset}' is empty: no text to profile", params="dataset")
    if not getattr(col, "gated", False):
        return col.taus(cfg.target_sparsity), None
    table = gated.calibrate(col, gated.tabulated(cfg.target_sparsity, cfg.sparsities))
    return gated.rule_taus(table, gated.criterion(cfg.criterion), cfg.target_sparsity)[1], table


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
                  progress: bool = True, lm: LoadedModel | StreamedModel | None = None,
                  layer_by_layer: bool | None = None, _stop_after: int | None = None) -> ProfileMeta | None:
    """Profile `cfg.model` over `cfg.dataset`; write RUN/profile/ and return its meta.json (None on the ranks
    other than 0 of a distributed run).

    Everything that can be refused without the model (its path or hub id, the corpus, the run directory's state) is
    refused before it loads. An interrupt (KeyboardInterrupt) at any moment comes out as StageInterrupted: `kept` is
    the partial folder when a checkpoint in it can be resumed, else None and nothing stands in the way of a fresh
    run; an interrupt while the finished profile is written waits for the write (`done`).
    `lm` reuses an already loaded model (notebooks, tests). `layer_by_layer`: run the model from its file one layer
    at a time (True), whole through transformers (False), or (None) the first where it is a local safetensors folder
    or GGUF file. `_stop_after` interrupts after that many batches, leaving a checkpoint, as a crash would (tests of
    `resume`).
    """
    rank, world = _dist()
    if world > 1 and device in ("auto", "cuda") and torch.cuda.is_available():
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
        torch.cuda.set_device(device)
    device = pick_device(device)
    name = lm.info["name"] if lm is not None else resolve_source(cfg.model, cfg.gguf_file, cfg.revision).name
    check_corpus(cfg.dataset, cfg.text_column)  # stops at the first text; fails before the model loads
    run = Path(out) if out is not None else artifacts.default_run_dir(name)
    final = run / "profile"
    partial = final.with_name(".profile.partial")
    checkpoint.check_partial(partial, resume, force)
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress and rank == 0 else (lambda msg: None)
    finished = False
    try:
        if lm is None:
            streamed = streams(cfg.model, cfg.gguf_file, layer_by_layer)
            try:  # mixtures of experts: on the streamed path only
                check_model(cfg.model, cfg.gguf_file, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code,
                            activation=cfg.activation, experts=streamed)
                lm = _load(cfg, name, device, layer_by_layer, world, say)
            except ExpertsRefused:
                raise experts.whole_model_refusal(name, cfg.model, cfg.gguf_file) from None
        gated.check_criterion(cfg.criterion, lm)
        checkpoint.check_existing(final, lm.info, force)
        _barrier(world)  # every rank has checked before rank 0 creates the partial folder
        with contextlib.ExitStack() as writing:  # holds a deferred interrupt from the final write until the swap
            with artifacts.staged(final, fresh=not resume, owner=rank == 0,
                                  keep_on_failure=checkpoint.resumable) as partial:
                _barrier(world)
                meta = _profile(cfg, lm, partial, rank, world, resume, checkpoint_every, progress, _stop_after,
                                writing, say)
            finished = True
    except KeyboardInterrupt as e:
        if isinstance(e, StageInterrupted):
            raise
        if finished:
            raise StageInterrupted(f"stopped after writing {final}", done=final) from None
        kept = partial if rank == 0 and checkpoint.resumable(partial) else None
        raise StageInterrupted(str(e) or "stopped", kept=kept) from None
    _barrier(world)  # rank 0 has swapped the folder into place
    return meta


def _load(cfg: ProfileConfig, name: str, device: str, layer_by_layer: bool | None, world: int,
          say) -> LoadedModel | StreamedModel:
    """The model, layer by layer from its file (after checking that a layer, the batch and the samples fit), or whole
    through transformers: as asked, or where the file's architecture has no model definition of ours."""
    if streams(cfg.model, cfg.gguf_file, layer_by_layer):
        try:
            kw = dict(activation=cfg.activation, device=device, dtype=pick_dtype(cfg.dtype, device), ctx=cfg.seq_len)
            sm = open_experts(cfg.model, cfg.gguf_file, **kw) or open_streamed(cfg.model, cfg.gguf_file, **kw)
        except ValueError as e:  # an architecture feature our definitions lack: transformers runs it
            if isinstance(e, ModelError) or layer_by_layer:
                raise
            say(f"{e}; profiling the whole model through transformers")
        else:
            calibrate = activation_rule(sm.activation) == Rule.ABS_TAU
            need = experts_need if isinstance(sm, ExpertsModel) else profile_need
            check_memory(need(sm, cfg.batch_size, cfg.seq_len, -(-cfg.samples_per_layer // world),
                              cfg.calibration_tokens, calibrate), device, "pi-profile")
            say(f"loading {name} layer by layer, as it runs")
            return sm
    say(f"loading {name}")
    return load_model(cfg.model, cfg.gguf_file, revision=cfg.revision, device=device, dtype=cfg.dtype,
                      trust_remote_code=cfg.trust_remote_code, activation=cfg.activation)


def _profile(cfg: ProfileConfig, lm: LoadedModel | StreamedModel, partial: Path, rank: int, world: int, resume: bool,
             checkpoint_every: int, progress: bool, _stop_after: int | None, writing: contextlib.ExitStack,
             say=lambda msg: None) -> ProfileMeta | None:
    # state.json: what every rank shares (settings, taus); state.rank{r}.json: how far rank r got
    key = {**cfg.resume_key(), "fingerprint": lm.info["fingerprint"], "world_size": world}
    ckpt, rank_state = partial / f"ckpt.rank{rank}.safetensors", partial / f"state.rank{rank}.json"
    shared: dict[str, Any] = {"key": key, "taus": None, "gated": None}
    state: dict[str, Any] = {"batches": 0, "tokens": 0, "seconds": 0.0}
    if resume:
        shared = artifacts.read_json(partial / "state.json")
        checkpoint.check_resume_key(shared["key"], key, partial)
        if rank_state.exists():
            state = artifacts.read_json(rank_state)

    rule = activation_rule(lm.activation)
    if rule == Rule.ABS_TAU and shared["taus"] is None:
        say(f"calibrating the activation thresholds on {cfg.calibration_tokens:,} tokens")
        shared["taus"], shared["gated"] = calibrate_taus(lm, cfg)
    taus = shared["taus"] if rule == Rule.ABS_TAU else None
    table, crit = shared.get("gated"), gated.criterion(cfg.criterion)
    if rank == 0:
        artifacts.write_json(partial / "state.json", shared)

    info, moe = lm.info, isinstance(lm, ExpertsModel)  # a mixture of experts keeps no samples: its router predicts
    capacity = 0 if moe else cfg.samples_per_layer // world + (rank < cfg.samples_per_layer % world)  # rank's share
    reservoir = None
    if capacity > 0:
        reservoir = SampleReservoir(partial / ("samples" if world == 1 else f"samples.rank{rank}"), capacity,
                                    info["n_layers"], info["d_model"], info["n_neurons"], cfg.seed, rank,
                                    resume=state["batches"] > 0, rms=sample_norms(lm) is not None)
    counting = None if table is None else gated.GatedCounting.build(lm, crit, cfg.target_sparsity, table,
                                                                     device_of(lm))
    counter = experts.ExpertCounter(lm, taus) if moe else ActivationCounter(lm, taus, reservoir, counting)
    if state["batches"] > 0:
        for k, t in load_file(str(ckpt)).items():
            counter.tensors()[k].copy_(t)

    batches = token_batches(lm.tokenizer, iter_texts(cfg.dataset, cfg.text_column), cfg.seq_len, cfg.batch_size,
                            cfg.tokens)
    start, seconds0, done_here = time.perf_counter(), state["seconds"], 0
    stream_tokens = 0  # tokens of all ranks: every rank tokenises the whole stream and takes its batches
    with counter, tqdm(total=cfg.tokens, unit="tok", unit_scale=True, desc="profiling",
                       disable=not progress or rank != 0, dynamic_ncols=True) as bar:  # closed before any message
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
                checkpoint.checkpoint(ckpt, rank_state, counter, reservoir, state)
            if stop:
                bar.close()
                raise KeyboardInterrupt(f"stopped after {done_here} batches (checkpoint kept in {partial})")
    bar.close()
    seconds = seconds0 + time.perf_counter() - start

    dev = counter.counts.device
    tokens = torch.tensor([state["tokens"]], dtype=torch.int64, device=dev)
    filled = [torch.tensor([min(state["tokens"], capacity)], dtype=torch.int64, device=dev)]
    if world > 1:
        import torch.distributed as dist

        for t in (*counter.tensors().values(), tokens):
            dist.all_reduce(t)
        mine_filled, filled = filled[0], [torch.zeros_like(filled[0]) for _ in range(world)]
        dist.all_gather(filled, mine_filled)
    writing.enter_context(deferred_interrupt())  # from here to the swap, Ctrl-C waits: the profile is complete
    say(f"writing {partial.with_name('profile')}")
    if reservoir is not None:
        reservoir.flush()
    _barrier(world)
    if rank != 0:
        return None
    return _finalize(partial, lm, cfg, {k: t.cpu().numpy() for k, t in counter.tensors().items()}, int(tokens), taus,
                     seconds, world, [int(f) for f in filled], capacity, stream_tokens < cfg.tokens, table)


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _finalize(partial: Path, lm: LoadedModel | StreamedModel, cfg: ProfileConfig, tables: dict[str, np.ndarray],
              tokens: int, taus: list[float] | None, seconds: float, world: int, filled: list[int], capacity: int,
              short: bool, table: dict | None = None) -> ProfileMeta:
    """Write the tables and meta.json into the partial folder and drop the checkpoints (staged() swaps it in). The
    summary of a mixture of experts is over its routed (token, expert) pairs, k per token, and all experts' neurons.
    `table`: a gated model's thresholds of every criterion (passes.safetensors and the `gated` section)."""
    moe, n_neurons = isinstance(lm, ExpertsModel), lm.info["n_neurons"]
    keep = cfg.samples_per_layer > 0 and not moe
    rms = keep and sample_norms(lm) is not None
    if moe:
        counts, pairs = experts.write_tables(partial, lm.cfg, tables), tokens * lm.cfg.n_experts_used  # (L, E * n)
    else:
        counts, pairs = tables["counts"], tokens  # (L, n)
        df = pd.DataFrame({"layer": np.repeat(np.arange(len(counts), dtype=np.int32), n_neurons),
                           "neuron": np.tile(np.arange(n_neurons, dtype=np.int32), len(counts)),
                           "count": counts.reshape(-1).astype(np.int64)})
        artifacts.write_parquet(partial / "neurons.parquet", df)
    if keep:
        _merge_samples(partial, counts.shape[0], filled, capacity, world, rms)
    sparsity = 1.0 - counts.sum(1) / max(1, pairs * n_neurons)
    rule, gate_taus, section = activation_rule(lm.activation), None, None
    if table is not None:  # passes.safetensors written, and the gated section
        rule, gate_taus, section = gated.finalize(partial, tables, tokens, table, cfg)
    meta = ProfileMeta(
        inputs={"dataset": cfg.dataset},
        model=lm.info,
        config={**{k: v for k, v in asdict(cfg).items() if k not in ("model", "gguf_file", "revision")},
                "layer_by_layer": isinstance(lm, StreamedModel)},  # how it ran (both give the same profile)
        dataset=cfg.dataset,
        tokens=tokens,
        tokens_requested=cfg.tokens,
        corpus_exhausted=short,
        rule=rule,
        taus=taus,
        target_sparsity=cfg.target_sparsity if taus is not None else None,
        sparsity_per_layer=sparsity.round(6).tolist(),
        mean_sparsity=float(sparsity.mean()),
        share_covering_80pct_per_layer=share_covering(counts, 0.8).round(6).tolist(),
        samples=None if moe else ProfileSamples(
            count=sum(filled) if keep else 0,
            x="samples/layer_{i:03d}.x.npy: float16 (count, d_model): input of the FFN's first linear "
              "layers (after the pre-FFN norm)",
            mask="samples/layer_{i:03d}.mask.npy: uint8 (count, ceil(n_neurons/8)): np.packbits of the "
                 "active mask along neurons",
            rms=RMS_DOC if rms else None),
        seconds=round(seconds, 3),
        tokens_per_second=round(tokens / seconds, 1) if seconds > 0 else None,
        world_size=world,
        device=str(device_of(lm)),
        experts=experts.experts_meta(lm.cfg) if moe else None,
        gate_taus=gate_taus,
        gated=section,
    )
    meta.save(partial / "meta.json")
    for name in os.listdir(partial):
        if name.startswith(("ckpt.", "state")):
            os.unlink(partial / name)
    return meta


RMS_DOC = ("samples/layer_{i:03d}.rms.npy: float32 (count,): the pre-FFN RMSNorm's divisor sqrt(mean(x_pre^2) + eps) "
           "of the residual x_pre entering it (x = gamma * x_pre / rms)")


def _merge_samples(partial: Path, n_layers: int, filled: list[int], capacity: int, world: int, rms: bool) -> None:
    """Single full reservoir: already in place. Otherwise copy each rank's filled rows into one file per layer."""
    out = partial / "samples"
    if world == 1 and filled[0] == capacity:
        return
    srcs = [out] if world == 1 else [partial / f"samples.rank{r}" for r in range(world)]
    staging = partial / "samples.merged"
    staging.mkdir(exist_ok=True)
    for i in range(n_layers):
        for kind in ("x", "mask", "rms") if rms else ("x", "mask"):
            parts = [np.load(src / f"layer_{i:03d}.{kind}.npy", mmap_mode="r")[:f] for src, f in zip(srcs, filled)]
            dst = np.lib.format.open_memmap(staging / f"layer_{i:03d}.{kind}.npy", mode="w+", dtype=parts[0].dtype,
                                            shape=(sum(filled), *parts[0].shape[1:]))
            np.concatenate(parts, out=dst) if sum(filled) else None
            dst.flush()
            del dst, parts
    for src in srcs:
        shutil.rmtree(src)
    os.replace(staging, out)
