"""What a stage run layer by layer (models/streamed.py) needs of host and device memory, counted from the file's
tensor table before anything loads, and the check that refuses, in one line naming both figures and the fix, a run
that would not fit (instead of an out-of-memory kill after an hour of profiling).

Device: the largest layer's weights as the device holds them (de-quantized to float),
the resident part (embeddings where tied, final norm, head, rope tables, the one-layer KV cache), the batch's
activations and the samples' rows gathered per layer. Host: the samples' pinned copies and the calibration values
(+ everything when the device is the CPU). The file's pages are not counted: page cache, released tensor by tensor.
HOTNEURONS_HOST_MEMORY replaces the host memory the check sees as available (runtime/memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hotneurons.common.kinds import FixableError
from hotneurons.common.memory import SLACK, MemoryPlanError, available_host
from hotneurons.models.ffn_weights import CHUNK_BYTES
from hotneurons.weights.formats import spec

BATCH_FIX = "use a smaller batch size or sequence length, or free memory"


class StreamMemoryError(FixableError, MemoryPlanError):
    """A layer-by-layer run that would not fit; `params` names the settings that shrink it."""


@dataclass(frozen=True)
class Need:
    """Bytes by part: on the compute device, and in host memory besides."""

    device: dict[str, int]
    host: dict[str, int]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _kept_bytes(info, itemsize: int) -> int:
    """A non-FFN tensor as the decoder keeps it: block formats as stored, floats in the compute dtype."""
    n = int(np.prod(info.shape))
    return int(info.nbytes) if spec(info.fmt).block > 1 else n * itemsize


def layer_bytes(sm) -> int:
    """The largest layer's weights on the device, all de-quantized to float, plus one chunk's float32
    de-quantization temporary."""
    size = _itemsize(sm.dtype)
    per = [0] * sm.cfg.n_layers
    for name, t in sm.source.infos.items():
        if name.startswith("blk."):
            per[int(name.split(".")[1])] += int(np.prod(t.shape)) * size
    return max(per) + CHUNK_BYTES


def resident_bytes(sm) -> int:
    """What stays on the device: embeddings where the head shares them (an untied table stays in the file's pages),
    final norm, head, learned positions, rope tables, the one-layer KV cache."""
    size, cfg = _itemsize(sm.dtype), sm.cfg
    untied = "output.weight" in sm.source.infos
    rest = sum(_kept_bytes(t, size) for name, t in sm.source.infos.items()
               if not name.startswith("blk.") and not (untied and name == "token_embd.weight"))
    rope = (4 if cfg.rope_local else 2) * sm.ctx * cfg.head_dim * size
    kv = 2 * cfg.n_kv_heads * sm.ctx * cfg.head_dim * size
    return rest + rope + kv


def batch_bytes(sm, batch: int, seq_len: int, *, masks: bool = False, logits: bool = False) -> int:
    """One batch's activations at their largest (one layer's): hidden states, the FFN's projections and values,
    one sequence's attention scores; `masks`: pi-eval's mode masks and float64 magnitudes; `logits`: the head's
    output, a chunk of positions at a time."""
    size, cfg = _itemsize(sm.dtype), sm.cfg
    tokens = batch * seq_len
    hidden = 6 * tokens * cfg.d_model * size  # h, the stacked h2 and x and their per-sequence parts, y
    ffn = tokens * cfg.n_ff * (3 * size + 8)  # gate, up, values; the counters' float32 |h|
    scores = cfg.n_heads * seq_len * seq_len * (2 * size + 4)  # scores, masked copy, float32 softmax
    eval_masks = tokens * cfg.n_ff * (11 + size) if masks else 0  # 3 bool masks, |h| in float64, h * mask
    head = min(tokens * cfg.vocab * 20, 256 << 20) if logits else 0
    return hidden + ffn + scores + eval_masks + head


def sample_bytes(sm, rows: int) -> int:
    """One layer's kept rows: x (float16), the packed mask and r (float32)."""
    return rows * (2 * sm.cfg.d_model + (sm.cfg.n_ff + 7) // 8 + 4)


def profile_need(sm, batch: int, seq_len: int, samples_per_layer: int, calibration_tokens: int,
                 calibrate: bool) -> Need:
    """pi-profile's need: a layer, the batch's activations, the samples' rows (gathered on the device, two layers'
    in pinned host memory while the writer thread stores one) and the calibration's collected |h| values."""
    rows = min(batch * seq_len, samples_per_layer)
    gather = rows * (sm.cfg.d_model + sm.cfg.n_ff) * _itemsize(sm.dtype) if rows else 0  # x rows, mask rows
    calib = 0
    if calibrate:
        calls = -(-calibration_tokens // (batch * seq_len)) + 1
        per_call = min(batch * seq_len * sm.cfg.n_ff, 1 << 18) * 4  # MagnitudeCollector.per_batch float32 values
        calib = sm.cfg.n_layers * calls * per_call * 2  # kept, and one layer's concatenated and sorted copy
        if sm.info.get("gated") and sm.activation in ("swiglu", "geglu"):  # + |act(g)|, |x| and WINA's scores
            calib *= 4  # (profiler/gated.py)
    return Need(device={"one layer's weights in float": layer_bytes(sm), "embeddings, head and cache":
                        resident_bytes(sm), "the batch's activations": batch_bytes(sm, batch, seq_len),
                        "samples": sample_bytes(sm, rows) + gather},
                host={"samples": 2 * sample_bytes(sm, rows), "calibration values": calib, "runtime": SLACK})


def eval_need(sm, batch: int, seq_len: int, predictor_bytes: int, rounding: bool = False) -> Need:
    """pi-eval's need: a layer, the batch's activations with the mode masks and the head's logits, the predictors;
    `rounding` (--row-format): one FFN matrix's stored rows (2 bytes a weight at most) and float32 copy besides."""
    rows = sm.cfg.n_ff * sm.cfg.d_model * (2 + 4) + CHUNK_BYTES if rounding else 0
    return Need(device={"one layer's weights in float": layer_bytes(sm), "embeddings, head and cache":
                        resident_bytes(sm), "the batch's activations":
                        batch_bytes(sm, batch, seq_len, masks=True, logits=True), "predictors": predictor_bytes,
                        "row-format rounding": rows},
                host={"runtime": SLACK})


def train_need(sm, count: int, magnitude: bool, chunk: int = 4096) -> Need:
    """pi-train-predictors' need of the model: one layer's FFN in float and a chunk of its values on the device; one
    layer's samples in host memory (x float32, the unpacked mask, and with magnitude weights their values and
    weights)."""
    size, cfg = _itemsize(sm.dtype), sm.cfg
    ffn = 3 * cfg.n_ff * cfg.d_model * size + CHUNK_BYTES
    host = count * (cfg.d_model * 4 + cfg.n_ff) + (2 * count * cfg.n_ff * 4 if magnitude else 0)
    return Need(device={"one layer's FFN in float": ffn, "values": min(chunk, count) * cfg.n_ff * (3 * size + 4)},
                host={"one layer's samples": host, "runtime": SLACK})


def _parts(parts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in parts.items() if v)


def check_memory(need: Need, device: str | torch.device, stage: str, fix: str = BATCH_FIX,
                 params: tuple[str, ...] = ("batch_size", "seq_len")) -> None:
    """Refuse, in one line naming what is needed (by part), what there is and the fix, a run that does not fit the
    host or the device."""
    device = str(device)
    on_cpu = not device.startswith("cuda")
    host = {**need.device, **need.host} if on_cpu else dict(need.host)
    have, total = available_host(), sum(host.values())
    if total > have:
        raise StreamMemoryError(f"{stage} needs {total / 1e9:.2f} GB of host memory ({_parts(host)}) but "
                                f"{have / 1e9:.2f} GB is available: {fix}", params=params)
    if on_cpu:
        return
    free = torch.cuda.mem_get_info(torch.device(device))[0]
    total = sum(need.device.values())
    if total > free:
        raise StreamMemoryError(f"{stage} needs {total / 1e9:.2f} GB on {device} ({_parts(need.device)}) but "
                                f"{free / 1e9:.2f} GB is free: {fix}", params=params)
