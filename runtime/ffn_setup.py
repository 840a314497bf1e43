"""What a `HybridFFN` (runtime/hybrid_ffn.py) is built from: `FFNLayout`, the choices a runtime makes once for every
layer (the mask, the hot and cold rows' formats, where the hot rows go), the checks of one layer's arguments against
it, its weights and neuron split, and the hot rows' setup on the compute device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from hotneurons.common.kinds import MaskSource, PredictorDtype, choose
from hotneurons.kernels.cold import ACT_CODE, GATED
from hotneurons.kernels.qlinear import GpuQ
from hotneurons.models.ffn_weights import FFNWeights, down_t_rows, float_dtype, hot_blocks, take_rows, to_float
from hotneurons.weights.formats import spec, weight_format
from torch import nn


@dataclass(frozen=True)
class FFNLayout:
    """How a runtime lays out each layer's FFN: the same for every layer (runtime/load.py's builders make one)."""

    mask: str  # common/kinds.MaskSource: predictor, oracle, dense or gate
    cold_dtype: str = "bf16"  # the cold rows in CPU RAM (kernels/names.COLD_DTYPES)
    # the hot rows in a block format such as q4_0, read by qlinear's GEMV; None: float, in `dtype` or the weights' own
    gpu_dtype: str | None = None
    device: torch.device | str | None = None  # the hot rows' (None: where the weights are; the caller moves the FFN)
    dtype: torch.dtype | None = None  # the compute dtype of the hot rows (None: the weights')
    graphs: bool = True  # CUDA: replay a token's GPU work as two CUDA graphs (HybridFFN's _Graphs)
    prenorm: bool = False  # the predictor reads the residual before the pre-FFN norm (the powerinfer form)
    # the predictors: auto (as trained, buffers) or q8_0 (predictor_blocks, made on `device`, which must be set: blocks
    # are not buffers, so a later Module.to would leave them behind)
    predictor_dtype: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "mask", choose(self.mask, MaskSource, "mask source"))
        dtype = choose(self.predictor_dtype, PredictorDtype, "predictor dtype").value
        object.__setattr__(self, "predictor_dtype", dtype)
        if self.predictor_dtype != "auto" and self.device is None:
            raise ValueError("predictor blocks are made where the hot rows go: set FFNLayout.device")
        if self.mask == "gate" and self.cold_dtype == "int8":
            raise ValueError("the gate-first cold kernel reads bf16 rows or q8_0 / q4_0 / q4_1 blocks, not int8: pass "
                             "another --cold-dtype")


def check_layer(layer: int, activation: str, layout: FFNLayout, predictor: nn.Module | None,
                gate_taus: tuple[float, float] | None) -> None:
    """One layer's arguments against what the layout's mask and the cold kernels need, each refused in one line."""
    if activation not in ACT_CODE:  # FATReLU: its threshold is in none of the cold kernels (docs/runtime.md)
        raise ValueError(f"activation {activation!r}: pi-generate's kernels compute {', '.join(ACT_CODE)}; "
                         f"FATReLU's threshold is in none of them: relufy with --activation relu or drelu to "
                         f"decode (pi-profile and pi-eval run FATReLU models)")
    if layout.mask == "predictor" and predictor is None:
        raise ValueError(f"layer {layer}: mask 'predictor' needs a predictor")
    if layout.mask == "gate" and (gate_taus is None or activation not in GATED):
        raise ValueError(f"layer {layer}: mask 'gate' needs a gated activation and its thresholds, got "
                         f"{activation} and {gate_taus}")


def layer_weights(layer: int, ffn: FFNWeights | dict[str, nn.Linear]) -> FFNWeights:
    """A layer's FFN weights as stored (FFNWeights), or an HF layer's Linear modules read as such."""
    try:
        return ffn if isinstance(ffn, FFNWeights) else FFNWeights.from_linears(ffn)
    except ValueError as e:
        raise ValueError(f"layer {layer}: {e}") from None


def hot_and_cold(gpu: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's placement (n,) bool, True on the device -> (hot ids, cold ids), each ascending."""
    gpu_t = torch.as_tensor(np.asarray(gpu, dtype=bool))
    return torch.nonzero(gpu_t).flatten(), torch.nonzero(~gpu_t).flatten()


def set_hot_rows(ffn: Any, w: FFNWeights, hot: torch.Tensor, fmt: str | None, dev: Any, fdtype: torch.dtype) -> None:
    """The hot neurons' rows (`hot`: (n_hot,) ids) onto `dev` as `ffn`'s buffers: float `up_hot`, `gate_hot`,
    `down_t_hot` (n_hot, d) in `fdtype`, or block-format `hot_q` (qlinear's GpuQ / QTensor) in `fmt`; sets `hot_fmt`,
    `hot_q` and `sparse_hot`. Reads ffn.n_hot, gated, mask."""
    # hot rows in the compute dtype: torch's ops on buffers; in another format (blocks, or bf16 rows of a CPU run kept
    # as stored): qlinear, which reads blocks and casts floats per call
    fmt = None if fmt is None else weight_format(fmt)
    ffn.hot_fmt = None if fmt is None or (spec(fmt).block == 1 and float_dtype(fmt) == fdtype) else fmt
    ffn.hot_q = None  # block-format hot rows: gate, up, down
    if ffn.hot_fmt is None or not ffn.n_hot:  # float hot rows, in the model dtype (or none at all)
        def rows(m):
            return None if m is None else to_float(take_rows(m, hot), fdtype).to(dev)

        ffn.register_buffer("up_hot", rows(w.up))  # (n_hot, d)
        ffn.register_buffer("gate_hot", rows(w.gate) if ffn.gated else None)  # (n_hot, d)
        ffn.register_buffer("down_t_hot", to_float(down_t_rows(w, hot, "f32", dev), fdtype))  # (n_hot, d)
    # mask 'gate' on CUDA: one token's hot rows through kernels/gated.py, which reads only the passing neurons' up and
    # down rows; its down rows are neuron-major, (n_hot, d) in place of the (d, n_hot) columns (as many bytes)
    ffn.sparse_hot = (ffn.mask == "gate" and ffn.n_hot > 0 and torch.device(dev).type == "cuda"
                      and (ffn.hot_fmt is None or spec(ffn.hot_fmt).block > 1))  # blocks, or compute-dtype rows
    if ffn.hot_fmt is not None and ffn.n_hot:
        ffn.up_hot = ffn.gate_hot = ffn.down_t_hot = None
        ffn.hot_q = hot_blocks(w, hot, ffn.hot_fmt, dev, ffn.gated, neuron_major=ffn.sparse_hot)
        if ffn.sparse_hot and isinstance(ffn.hot_q["down_t"], GpuQ):
            from hotneurons.kernels.gated import DownRows  # Triton: CUDA runs only

            ffn.hot_q["down_t"] = DownRows.of(ffn.hot_q["down_t"])  # row-major scales: gathered rows' layout


def predictor_blocks(fc1: torch.Tensor, fc2: torch.Tensor, fmt: str) -> tuple[Any, Any]:
    """A predictor's fc1 (h, d) and fc2 (n, h) in `fmt`'s blocks of 32 as the device's GEMV reads them (qlinear: a
    GpuQ on CUDA, a QTensor elsewhere). h is padded with zero units to a multiple of 32: fc1's zero rows give relu(0)
    = 0, which fc2's zero columns then multiply."""
    from hotneurons.kernels import qlinear
    from hotneurons.weights.qtensor import QTensor
    from hotneurons.weights.quants import quantize

    if fc1.shape[1] % 32:
        raise ValueError(f"--predictor-dtype {fmt}: the model's width {fc1.shape[1]} is not a multiple of 32; keep "
                         f"--predictor-dtype auto")
    pad = (-fc1.shape[0]) % 32
    fc1, fc2 = F.pad(fc1, (0, 0, 0, pad)), F.pad(fc2, (0, pad))  # (h', d), (n, h')

    def blocks(w: torch.Tensor):
        q = QTensor(quantize(w.float(), fmt), fmt, tuple(w.shape))
        return qlinear.pack(q, w.device) if w.device.type == "cuda" else q

    return blocks(fc1), blocks(fc2)
