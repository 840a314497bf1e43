"""A model loaded from its file into our own decoder (hotneurons.models) with hybrid FFNs, with no transformers
model object: the weights are read in place from the GGUF or safetensors file (hotneurons.weights), tensor by tensor.
The decoder's attention, norms, embeddings and head go to the compute device in their stored format (or `gpu_dtype`),
each layer's hot FFN rows to the device and its cold rows into the CPU layout, and each tensor's pages of the file
are released once copied, so that resident memory stays near the bytes the layout keeps.

`SourceModel` stands where the transformers path keeps its LoadedModel (Runtime.lm); `forward` is one token (or a
prompt) through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hotneurons.common.artifacts import ArtifactError
from hotneurons.common.model_source import ModelSource
from hotneurons.weights.formats import TORCH_FLOATS, WeightFormat, kernel_format, nearest, spec, weight_format


@dataclass
class SourceModel:
    """What a Runtime keeps of a model loaded into our decoder."""

    decoder: Any  # a hotneurons.models model: attention, norms, embeddings, head and the static KV cache
    tokenizer: Any
    activation: str
    source: ModelSource
    info: dict[str, Any]  # the "model" section of every stage's meta.json
    config: Any  # the transformers config (text config)
    eos: set[int] = field(default_factory=set)

    @property
    def layers(self) -> range:
        return range(self.info["n_layers"])


def auto_format(stored: WeightFormat, where: str, compute: torch.dtype, device: str = "cuda") -> str:
    """`auto` for --cold-dtype (where="cpu") or --gpu-dtype (where="gpu", on `device`): the stored format where the
    kernels there read it, else the nearest one they read (weights/formats.py's table: Q4_K -> q4_1, Q5_0, Q6_K,
    IQ4_XS ... -> q8_0, Q2_K, Q3_K, IQ1-IQ3 ... -> q4_0). Float files: bf16 cold rows; hot rows in the compute dtype on
    a GPU, as stored when the device is the CPU (a float32 copy of a bf16 file would double its memory there)."""
    if spec(stored).block == 1:
        if where == "cpu":
            return "bf16"
        return str(kernel_format(stored, "cpu")) if device == "cpu" else str(compute).removeprefix("torch.")
    return str(kernel_format(stored, "cpu" if where == "cpu" else device))


def conversions(source: Any, device: str, cold: str, hot: str, gpu: Any = None) -> str | None:
    """One line: the file's block matrices that are not kept in their stored format, what they become at load (FFN
    rows: the hot and cold rows' formats, one each for the whole FFN; other matrices: models/common._pack's
    kernel_format, where the device's kernels do not read theirs), per stored format with its bytes in the file and
    resident after (FFN rows split by `gpu`: per layer the neurons on the device, bool; None: all there). None where
    nothing is converted. An untied embedding stays as stored (a token's row is de-quantized as it is read)."""
    from hotneurons.common.units import format_bytes
    from hotneurons.models.ffn_weights import kept_format
    from hotneurons.runtime.memory import is_ffn_weight

    dev = torch.device(device).type
    rows: dict[WeightFormat, list] = {}  # stored format -> [tensors, stored bytes, resident bytes, {targets}]
    untied = "output.weight" in source.infos
    for name, t in source.infos.items():
        if (len(t.shape) < 2 or t.fmt in TORCH_FLOATS or name.endswith((".fc1.weight", ".fc2.weight"))
                or (untied and name == "token_embd.weight")):
            continue
        numel = int(np.prod(t.shape))
        if is_ffn_weight(name):
            share = 1.0 if gpu is None else float(np.mean(gpu[int(name.split(".")[1])]))
            kept = [(kept_format(source.infos, name, f, side == "cold", share == 1), w)
                    for side, f, w in (("hot", hot, share), ("cold", cold, 1 - share))]  # a K-quant's rows or down's
            parts = [(str(f), w) for f, w in kept if w > 0 and f != t.fmt]
        else:
            parts = [(str(kernel_format(t.fmt, dev)), 1.0)] if kernel_format(t.fmt, dev) != t.fmt else []
        if not parts:
            continue
        row = rows.setdefault(t.fmt, [0, 0, 0.0, set()])
        row[0] += 1
        row[1] += t.nbytes
        row[2] += sum(w * numel * spec(f).bytes_per_weight for f, w in parts)
        row[3].update(str(f) for f, _ in parts)
    if not rows:
        return None
    said = [f"{str(f).upper()} -> {'/'.join(sorted(r[3]))} ({r[0]} tensor{'s' * (r[0] > 1)}, {format_bytes(r[1])} "
            f"stored -> {format_bytes(r[2])} resident)" for f, r in rows.items()]
    return (f"tensors converted at load (no kernel reads their stored format, or the FFN rows' layout keeps one): "
            f"{'; '.join(said)} (docs/memory.md: the formats)")


def formats_for(source: Any, cold_dtype: str, gpu_dtype: str, compute: torch.dtype,
                device: str) -> tuple[str, str]:
    """(cold rows' format, hot rows' format) from the flags and the file's FFN format."""
    stored = source.infos["blk.0.ffn_up.weight"].fmt
    cold = auto_format(stored, "cpu", compute) if cold_dtype == "auto" else str(weight_format(cold_dtype))
    gpu = auto_format(stored, "gpu", compute, device) if gpu_dtype == "auto" else str(weight_format(gpu_dtype))
    return cold, gpu


def file_predictors(source: Any, dtype: torch.dtype) -> Any:
    """PowerInfer's predictors from its own file (fc1, fc2 per layer; a neuron computed iff its logit >= the file's
    sparse threshold, 0 by default), in the powerinfer form: they read the residual before the pre-FFN norm."""
    from hotneurons.artifacts.predictor_file import Predictor, Predictors
    from hotneurons.artifacts.predictors import PredictorForm
    from hotneurons.models.ffn_weights import to_float

    threshold = source.sparse_threshold or 0.0
    layers = {}
    for i in range(int(source.config.num_hidden_layers)):
        fc1, fc2 = (to_float(w) for w in source.predictor(i))  # (r, d), (n, r)
        layers[i] = Predictor.from_weights(fc1, fc2, threshold, dtype=dtype)
    return Predictors(layers, None, None, PredictorForm.POWERINFER)


def file_placement(source: Any, n_layers: int) -> Any:
    """PowerInfer's split beside its file (`.generated.gpuidx`), or none: every neuron on the CPU side."""
    from hotneurons.artifacts.placement import Placement

    masks = source.gpu_index()
    if masks is None:
        return Placement.uniform(n_layers, source.infos["blk.0.ffn_up.weight"].shape[0], False)
    return Placement(tuple(np.asarray(m, dtype=bool) for m in masks))


def requantized(source: Any, cold: str, hot: str) -> None:
    """Warn, once, where 4- to 6-bit rows of the file (Q4_1, Q4_K, Q5_0, IQ4_XS ...) are re-quantized to q4_0, a
    coarser or other grid than theirs: a real cost in quality (`auto` converts them to their nearest format)."""
    import warnings

    stored = source.infos["blk.0.ffn_up.weight"].fmt
    s = spec(stored)
    if (s.block > 1 and 4 <= s.bits_per_weight <= 6 and nearest(stored) != WeightFormat.Q4_0
            and WeightFormat.Q4_0 in (cold, hot)):
        keep = ("--cold-dtype auto --gpu-dtype auto reads them as stored" if kernel_format(stored, "cpu") == stored else
                f"--cold-dtype auto --gpu-dtype auto converts them to {nearest(stored)} instead")
        warnings.warn(f"the file's {stored} FFN rows are re-quantized to q4_0, which costs quality (SmolLM2-135M from "
                      f"Q4_1: +15% perplexity, docs/memory.md); {keep}", stacklevel=3)


@torch.inference_mode()
def forward(rt: Any, ids: list[int], pos0: int, every: bool = False) -> torch.Tensor:
    """Logits (vocab,) float32 of the last of `ids` (at positions pos0...), through the decoder and the hybrid FFNs;
    several ids (a prompt) run each FFN dense over them, one id is a decode step. every: (T, vocab), all positions'."""
    m = rt.lm.decoder
    h = m.embed(torch.tensor(ids, device=rt.device), pos0)  # (T, d)
    for i, f in enumerate(rt.ffns):
        h2, x = m.attention(i, h, pos0)  # (T, d) the residual after attention, the FFN's input
        f.residual = h2 if f.prenorm else None  # the powerinfer-form predictor reads the residual before the norm
        h = m.after_ffn(i, h2, f(x))
    return m.logits(h) if every else m.logits(h[-1:])[0]


def load_source_runtime(run: Path | None, meta: dict | None, cfg: Any, *, model: str | None = None,
                        gguf_file: str | None = None, use_predictor: bool = True, recall: float | None = None,
                        placement: Any = None) -> Any:
    """The Runtime of the model a run was made for (or `model`), read in place into our decoder and hybrid FFNs.
    `placement` (artifacts.placement.Placement) replaces the run's (tests, benchmarks); for a mixture of experts, a
    (layers, experts) bool mask of the experts on the device, else the run's experts.parquet (runtime/moe_load.py)."""
    from hotneurons.artifacts.placement import Placement
    from hotneurons.artifacts.predictors import PredictorForm
    from hotneurons.artifacts.profile import read_profile
    from hotneurons.common import artifacts
    from hotneurons.kernels.cold import set_threads
    from hotneurons.kernels.ops import default_ops
    from hotneurons.models import build_model
    from hotneurons.models.family import RELU_FAMILY, adapter_for
    from hotneurons.models.ffn_weights import FFNWeights
    from hotneurons.models.open import model_info, open_model
    from hotneurons.runtime.balance import pcie_share
    from hotneurons.runtime.gated import gate_taus, uses_gate
    from hotneurons.runtime.generate import CAPACITY, Runtime, device_and_dtype
    from hotneurons.runtime.hybrid_ffn import HybridFFN
    from hotneurons.runtime.memory import check_fits, check_vram, plan_bytes, tensor_bytes
    from hotneurons.runtime.placement import plan_figures, solved_summary
    from hotneurons.runtime.source_steps import SourceSteps
    from tqdm.auto import tqdm

    if cfg.ctx is not None and cfg.ctx < 1:
        raise ValueError(f"--ctx {cfg.ctx}: the static KV cache needs at least 1 token (leave it out for the "
                         f"placement's)")
    if meta is not None and model is None:
        src = meta["model"]["source"]
        model, gguf_file = src["path"], gguf_file or src.get("gguf_file")
    activation = meta["model"]["activation"] if meta is not None and meta["model"]["activation"] == "drelu" else None
    source, sid, mcfg, act = open_model(model, gguf_file, activation)
    if mcfg.moe:
        from hotneurons.runtime.moe_load import load_moe_runtime

        return load_moe_runtime(run, cfg, source, sid, mcfg, act, placement)
    adapter = adapter_for(source.config)
    info = model_info(source, sid, act, adapter.name, adapter.gated)
    device, dtype = device_and_dtype(cfg)
    L, n = info["n_layers"], info["n_neurons"]
    predictors = taus = None
    solved = None  # pi-solve's summary, where the placement came from pi-solve
    if placement is None and run is not None and (run / "placement" / "placement.parquet").exists():
        placement = Placement.from_run(run, info)
        solved = solved_summary(run)
    mode = cfg.mode
    oracle = mode == "hybrid" and cfg.oracle
    if mode == "hybrid" and not oracle and (not use_predictor or cfg.sparsity == 0):
        mode = "dense"
    gate = mode == "hybrid" and uses_gate(cfg)
    mask = "dense" if mode == "dense" else ("oracle" if oracle else ("gate" if gate else "predictor"))
    gtaus = gate_taus(run, cfg, act, L) if gate else None

    pwri = run is None and getattr(source, "powerinfer", False)  # PowerInfer's own file: predictors and split in it
    if pwri and mask == "predictor":
        predictors = file_predictors(source, dtype)
        placement = placement or file_placement(source, L)
    elif mask == "predictor":
        from hotneurons.artifacts.predictor_file import load_predictors

        if run is None:  # a model file alone (not PowerInfer's, which carries its own): no predictors to read
            raise ArtifactError("hybrid mode needs predictors: pass --run RUN (pi-profile, pi-solve, "
                                "pi-train-predictors), or use --mode dense (--no-predictor) or --oracle with a "
                                "placement")

        predictors = load_predictors(run, info, device="cpu", dtype=dtype)
        if recall is not None:
            predictors.set_recall(recall)
    if run is not None and (run / "profile" / "meta.json").exists():
        _, pmeta = read_profile(run)
        artifacts.check_same_model(pmeta, {"model": info}, f"profile {run / 'profile'}", "the model")
        taus = pmeta.layer_taus
    if mode == "hybrid" and placement is None:
        raise ArtifactError("hybrid mode needs a placement: run `pi-solve --run RUN` first, or use --mode dense")
    if mask == "oracle" and taus is None and act not in RELU_FAMILY:
        raise ArtifactError(f"--oracle on a {act} model needs the profile's thresholds (RUN/profile/)")
    placement = placement or Placement.uniform(L, n, True)
    if len(placement.gpu) != L or any(len(g) != n for g in placement.gpu):
        raise ArtifactError(f"the placement is for {len(placement.gpu)} layers of {len(placement.gpu[0])} neurons, the "
                            f"model has {L} of {n}: run pi-solve for this model")
    cold_fmt, hot_fmt = formats_for(source, cfg.cold_dtype, cfg.gpu_dtype, dtype, device)
    cfg = replace(cfg, cold_dtype=cold_fmt, gpu_dtype=hot_fmt)  # as resolved
    requantized(source, cold_fmt, hot_fmt)
    notice = conversions(source, device, cold_fmt, hot_fmt, placement.gpu)
    if notice is not None:
        import warnings

        warnings.warn(notice, stacklevel=2)
    ctx = cfg.ctx or min(solved.flags.ctx if solved is not None else CAPACITY, mcfg.max_positions)
    need = plan_bytes(source, placement, cold_fmt, hot_fmt, dtype, ctx, info,
                      neuron_major=gate and torch.device(device).type == "cuda")
    check_fits(need, device, cfg.vram, ctx)
    prenorm = mask == "predictor" and predictors.form == PredictorForm.POWERINFER
    threads = set_threads(cfg.threads)
    decoder = build_model(mcfg, lambda name: source.get(name) if name in source.infos else None,
                          torch.device(device), dtype, ctx,
                          release=lambda name: source.release(name) if name in source.infos else 0)
    ffns = []
    for i in tqdm(range(L), desc="loading layers", unit="layer", leave=False, disable=L < 8):
        w = FFNWeights.from_source(source, i)
        # taken out of `predictors`: the FFN keeps its own (reordered) copy, so the file's is freed layer by layer
        pred = predictors.layers.pop(i).to("cpu", dtype) if mask == "predictor" else None
        ffns.append(HybridFFN(i, act, w, placement.gpu[i], mask, pred, None if taus is None else taus[i], cold_fmt,
                              cfg.cuda_graphs, prenorm, hot_fmt, device, dtype,
                              gtaus[i] if gate else None).to(device))
        for name in w.names(i):
            if name in source.infos:
                source.release(name)
    tok = source.tokenizer()
    eos = getattr(tok, "eos_token_id", None)
    lm = SourceModel(decoder, tok, act, sid, info, source.config, set() if eos is None else {int(eos)})
    # what the device really holds (the plan estimated it); an untied embedding stays in CPU RAM (models/common.py)
    host_embedding = 0 if mcfg.tied_embeddings else tensor_bytes(decoder.tok_embd)
    bytes_cpu = sum(f.cold_bytes() for f in ffns) + host_embedding
    bytes_gpu = tensor_bytes(decoder, *ffns, device=device) - (host_embedding if device == "cpu" else 0)
    check_vram(bytes_gpu, device, cfg.vram, ctx)
    ops = default_ops(torch.device(device)) if cfg.ops == "auto" else cfg.ops
    # decode steps as CUDA graphs over the decoder's own cache (eager on a CPU, the same pieces)
    fast = (SourceSteps(decoder, ffns, torch.device(device), dtype, cfg.cuda_graphs, ops, cfg.prelaunch)
            if cfg.static_decode else None)
    rt = Runtime(lm, cfg, torch.device(device), dtype, ffns, [], bytes_gpu, bytes_cpu, L, threads, fast)
    rt.pcie_share = pcie_share(rt, mask)
    plan_figures(rt, solved)
    return rt
