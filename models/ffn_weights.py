"""One layer's FFN weights as the file stores them (float tensors or QTensors in their block format), and the row
selections the hybrid layout makes of them: a neuron's gate and up rows, and its down column as a row (`down_t`).

Rows of gate and up are rows of the stored matrices, so they keep the file's format byte for byte. The down
projection is stored (d, n) with blocks along n, so a neuron's column is spread over d rows: it is read a block column
at a time (`down_t_rows`), de-quantized, transposed and stored again in the format asked for, a chunk of neurons at a
time so that no float copy of the whole matrix is ever made. A dense layout (every neuron hot) needs no such
conversion: its down projection is taken as stored (`every_column`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hotneurons.kernels.qlayout_k import K_FORMATS
from hotneurons.weights.formats import WeightFormat, nearest, spec, weight_format
from hotneurons.weights.names import layer_name
from hotneurons.weights.qtensor import FLOAT_DTYPES, QTensor
from torch import nn

Weight = torch.Tensor | QTensor
CHUNK_BYTES = 64 << 20  # float32 temporaries of a conversion (bytes): one chunk of rows at a time


@dataclass(frozen=True)
class FFNWeights:
    """gate, up (n, d) and down (d, n) in torch's Linear orientation; down_t (n, d) instead of down where the file
    stores the down projection transposed (PowerInfer's ffn_down_t)."""

    up: Weight  # (n, d)
    down: Weight | None  # (d, n)
    gate: Weight | None = None  # (n, d) gated FFNs
    b_up: torch.Tensor | None = None  # (n,)
    b_down: torch.Tensor | None = None  # (d,)
    down_t: Weight | None = None  # (n, d)

    @classmethod
    def from_linears(cls, ffn: dict[str, nn.Linear]) -> "FFNWeights":
        """An HF layer's FFN modules (models/family.FamilyAdapter.layer_ffn)."""
        g = ffn.get("gate")
        if g is not None and (g.bias is not None or ffn["up"].bias is not None):
            raise ValueError("this gated FFN has gate/up biases (e.g. mlp_bias=True), which the runtime does not "
                             "compute yet: run it with HF transformers instead")
        return cls(up=ffn["up"].weight.detach(), down=ffn["down"].weight.detach(),
                   gate=None if g is None else g.weight.detach(),
                   b_up=None if ffn["up"].bias is None else ffn["up"].bias.detach(),
                   b_down=None if ffn["down"].bias is None else ffn["down"].bias.detach())

    @classmethod
    def from_source(cls, source: Any, i: int) -> "FFNWeights":
        """Layer i's FFN from a weight source (hotneurons.weights.source), by canonical name, in place."""
        def get(name: str):
            return source.get(name) if name in source.infos else None

        p = layer_name(i)
        down_t = get(p + "ffn_down_t.weight")
        return cls(up=get(p + "ffn_up.weight"), down=None if down_t is not None else get(p + "ffn_down.weight"),
                   gate=get(p + "ffn_gate.weight"), b_up=get(p + "ffn_up.bias"), b_down=get(p + "ffn_down.bias"),
                   down_t=down_t)

    @property
    def shape(self) -> tuple[int, int]:
        """(n neurons, d model)."""
        return tuple(self.up.shape)

    def names(self, i: int) -> list[str]:
        p = layer_name(i)
        return [p + n for n in ("ffn_up.weight", "ffn_down.weight", "ffn_gate.weight", "ffn_up.bias",
                                "ffn_down.bias", "ffn_down_t.weight")]


def float_dtype(fmt: WeightFormat) -> torch.dtype:
    return FLOAT_DTYPES[fmt]


def float_format(dtype: torch.dtype) -> WeightFormat:
    """The float format of a torch dtype (float32 for any other)."""
    return {v: k for k, v in FLOAT_DTYPES.items()}.get(dtype, WeightFormat.F32)


def fmt_of(w: Weight) -> WeightFormat:
    return w.fmt if isinstance(w, QTensor) else float_format(w.dtype)


def _chunk_rows(cols: int) -> int:
    return max(1, CHUNK_BYTES // (4 * max(cols, 1)))


def to_float(w: Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight as a float tensor (a de-quantized copy for QTensors)."""
    return w.dequantize(dtype) if isinstance(w, QTensor) else w.to(dtype)


def take_rows(w: Weight, idx: torch.Tensor) -> Weight:
    """Rows idx of w (a copy), in w's own format."""
    idx = idx.to(w.device if not isinstance(w, QTensor) else w.data.device)
    return w.rows(idx) if isinstance(w, QTensor) else w.index_select(0, idx)


def store(w: Weight, fmt: str | WeightFormat, device: torch.device | str = "cpu") -> Weight:
    """w in `fmt` on `device`: kept as it is when it is in that format already (a GGUF's rows byte for byte),
    else converted a chunk of rows at a time, on `device` (each chunk's stored bytes cross, then are widened or
    quantized there). Float formats give float tensors, block formats QTensors."""
    from hotneurons.weights.quants import quantize

    fmt = weight_format(fmt)
    if fmt_of(w) == fmt:
        return w.to(device)
    rows, cols = w.shape
    if spec(fmt).block == 1:  # a float format
        dtype = FLOAT_DTYPES[fmt]
        out = torch.empty((rows, cols), dtype=dtype, device=device)  # (rows, cols)
        step = _chunk_rows(cols)
        for s in range(0, rows, step):
            part = w.rows(slice(s, s + step)) if isinstance(w, QTensor) else w[s:s + step]
            out[s:s + step] = to_float(part.to(device))
        return out
    from hotneurons.weights.formats import row_bytes

    data = torch.empty((rows, row_bytes(fmt, cols)), dtype=torch.uint8, device=device)  # (rows, row bytes)
    step = _chunk_rows(cols)
    for s in range(0, rows, step):
        part = w.rows(slice(s, s + step)) if isinstance(w, QTensor) else w[s:s + step]
        data[s:s + step] = quantize(to_float(part.to(device)), fmt)
    return QTensor(data, fmt, (rows, cols))


def _columns(w: Weight, lo: int, hi: int, work: torch.device | str | None = None) -> torch.Tensor:
    """Columns [lo, hi) of a (rows, cols) weight as float32 (rows, hi - lo) on `work` (default: where w is); for
    QTensors lo and hi on block edges are read without touching other blocks, else the covering blocks are
    de-quantized and cut."""
    if not isinstance(w, QTensor):
        return w[:, lo:hi].to(work or w.device).float()
    from hotneurons.weights.quants import dequantize

    s = spec(w.fmt)
    b0, b1 = lo // s.block, -(-hi // s.block)
    raw = w.data[:, b0 * s.block_bytes:b1 * s.block_bytes]  # (rows, blocks' bytes): a strided view
    cols = dequantize(raw.contiguous().to(work or raw.device), w.fmt, (b1 - b0) * s.block)  # (rows, covered cols)
    return cols[:, lo - b0 * s.block:hi - b0 * s.block]


def down_t_rows(w: FFNWeights, idx: torch.Tensor, fmt: str | WeightFormat,
                device: torch.device | str = "cpu", work: torch.device | str | None = None) -> Weight:
    """(len(idx), d): the down projection's columns idx as rows (neuron j's row = down[:, j]), in `fmt` on `device`.
    idx ascending. Read a window of block columns at a time: de-quantized, cut to its neurons, transposed, stored.
    `work`: where the conversion runs (a GPU does it in a fraction of the CPU's time; the stored bytes come back)."""
    if w.down_t is not None:  # stored transposed already: rows
        return store(take_rows(w.down_t, idx), fmt, device)
    n, d = w.shape
    k = len(idx)
    fmt = weight_format(fmt)
    idx = idx.cpu()
    if k and _on_cpu_kernels(w, fmt, device, work):  # one pass in Numba, the same bytes (weights/quants_cpu.py)
        from hotneurons.weights.quants_cpu import columns_as_rows

        out = columns_as_rows(w.down.data.contiguous().numpy(), w.down.fmt.value, idx.numpy(), fmt.value)
        if out is not None:
            return torch.from_numpy(out) if fmt == WeightFormat.F32 else QTensor(torch.from_numpy(out), fmt, (k, d))
    parts: list[Weight] = []
    step = max(256, _chunk_rows(d) // 256 * 256)  # columns per window: whole blocks of every format
    for lo in range(0, n, step):  # windows of columns, so the float temporary is (d, step) whatever idx holds
        hi = min(n, lo + step)
        ids = idx[(idx >= lo) & (idx < hi)]  # (c,) ascending
        if len(ids) == 0:
            continue
        cols = _columns(w.down, lo, hi, work)  # (d, hi - lo) float32
        rows = cols[:, (ids - lo).to(cols.device)].T.contiguous()  # (c, d) on work
        parts.append(store(rows, fmt, rows.device).to(device))  # quantized where the floats are; the bytes move
    if not parts:
        return store(torch.zeros((0, d)), fmt, device)
    if isinstance(parts[0], QTensor):
        return QTensor(torch.cat([p.data for p in parts]), fmt, (k, d))
    return torch.cat(parts)


def as_stored(w: FFNWeights, fmt: str | WeightFormat, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> FFNWeights:
    """The FFN the runtime computes with when every neuron's rows are stored in `fmt` (cold_rows_of's layout), as
    `dtype` tensors on `device`: gate and up rows (blocks along d_model; kept byte for byte where the file stores
    that format) and the down projection's columns as rows (down_t, blocks along d_model too), each stored with
    `store` / `down_t_rows` and widened back. Biases as they are (the runtime keeps them in float). pi-eval
    --row-format evaluates with these (predictors/row_formats.py); the stored bytes are dropped as each matrix is
    widened, so one matrix's bytes and its float32 copy are the only temporaries."""
    fmt = weight_format(fmt)
    every = torch.arange(w.shape[0])
    return FFNWeights(up=to_float(store(w.up, fmt, device), dtype), down=None,
                      gate=None if w.gate is None else to_float(store(w.gate, fmt, device), dtype), b_up=w.b_up,
                      b_down=w.b_down, down_t=to_float(down_t_rows(w, every, fmt, device, work=device), dtype))


def hot_blocks(w: FFNWeights, hot: torch.Tensor, fmt: WeightFormat, device: torch.device | str,
               gated: bool, neuron_major: bool = False) -> dict[str, Any]:
    """The hot rows in a block format on `device`, as qlinear reads them: gate and up (n_hot, d) rows (kept as stored
    when the file has that format), and the down projection's hot columns (d, n_hot padded to whole blocks with zero
    columns: the padded neurons' values are zeros too); `neuron_major`: instead of those columns, `down_t`, the hot
    neurons' down weights as (n_hot, d) rows (kernels/gated.py reads only the passing ones). A K-quant `fmt`:
    _hot_blocks_k."""
    if fmt in K_FORMATS:
        return _hot_blocks_k(w, hot, fmt, device, gated, neuron_major)
    block = spec(fmt).block
    cols = -(-len(hot) // block) * block
    if neuron_major:
        return {"up": _device_form(store(take_rows(w.up, hot), fmt), device),
                "gate": _device_form(store(take_rows(w.gate, hot), fmt), device) if gated else None,
                "down": None, "down_t": _device_form(down_t_rows(w, hot, fmt, device, work=device), device),
                "down_cols": cols}
    if every_column(w, hot, fmt):  # dense: the file's own matrices, no row copies and no re-quantization
        return {"up": _device_form(store(w.up, fmt), device),
                "gate": _device_form(store(w.gate, fmt), device) if gated else None,
                "down": _device_form(w.down, device), "down_cols": cols}
    return {"up": _device_form(store(take_rows(w.up, hot), fmt), device),
            "gate": _device_form(store(take_rows(w.gate, hot), fmt), device) if gated else None,
            "down": _device_form(_down_columns(w, hot, fmt, cols, device), device), "down_cols": cols}


def _down_columns(w: FFNWeights, hot: torch.Tensor, fmt: WeightFormat, cols: int,
                  device: torch.device | str) -> Weight:
    """The down projection's hot columns (d, cols) in `fmt`, zero columns past len(hot)."""
    if fmt != WeightFormat.F32 and _on_cpu_kernels(w, fmt, device, device):  # one pass in Numba, the same bytes
        from hotneurons.weights.quants_cpu import columns_reblocked

        out = columns_reblocked(w.down.data.contiguous().numpy(), w.down.fmt.value, hot.cpu().numpy(), cols, fmt.value)
        if out is not None:
            return QTensor(torch.from_numpy(out), fmt, (w.shape[1], cols))
    down = to_float(down_t_rows(w, hot, WeightFormat.F32, device, work=device)).T  # (d, n_hot) float32
    return store(torch.nn.functional.pad(down, (0, cols - len(hot))).contiguous(), fmt, device)  # (d, cols)


def k_hot_formats(fmt: WeightFormat, rows: WeightFormat, down: WeightFormat, dense: bool,
                  neuron_major: bool = False) -> tuple[WeightFormat, WeightFormat]:
    """The formats a K-quant `fmt`'s hot rows are kept in (_hot_blocks_k; runtime/memory.py plans with them): (gate
    and up rows, down projection) from their stored formats. The K-quants the GPU reads as stored but
    weights/quants.py does not write: rows as stored where the GPU reads their format, else in fmt's nearest; the down
    projection as stored when every neuron is hot (`dense`: a Q4_K_M file's Q6_K down stays Q6_K), else its hot
    columns, re-blocked and so re-quantized, in its stored format's nearest where that is a K-quant or unread (Q4_K ->
    q4_1, Q5_K and Q6_K -> q8_0: weights/formats.py). neuron_major: both in fmt's nearest (kernels/gated.py reads
    q4_0, q4_1 and q8_0)."""
    if neuron_major:
        return nearest(fmt), nearest(fmt)

    def reads(f: WeightFormat) -> bool:
        return f in K_FORMATS or spec(f).gpu_kernel

    keep = rows if reads(rows) else nearest(fmt)
    if dense and reads(down):
        return keep, down
    return keep, nearest(down) if down in K_FORMATS or not reads(down) else down


def _hot_blocks_k(w: FFNWeights, hot: torch.Tensor, fmt: WeightFormat, device: torch.device | str, gated: bool,
                  neuron_major: bool) -> dict[str, Any]:
    """hot_blocks for a K-quant `fmt`, in k_hot_formats' formats."""
    n = w.shape[0]
    stored = fmt_of(w.down) if w.down is not None else fmt
    dense = len(hot) == n and w.down is not None and n % spec(stored).block == 0
    if neuron_major:
        return hot_blocks(w, hot, k_hot_formats(fmt, fmt, stored, dense, True)[0], device, gated, neuron_major=True)

    def rows(m: Weight) -> Any:
        m = take_rows(m, hot)
        return _device_form(store(m, k_hot_formats(fmt, fmt_of(m), stored, dense)[0]), device)

    dfmt = k_hot_formats(fmt, fmt, stored, dense)[1]
    if dense and dfmt == stored:
        down, cols = _device_form(w.down, device), n
    else:
        cols = -(-len(hot) // spec(dfmt).block) * spec(dfmt).block
        down = _device_form(_down_columns(w, hot, dfmt, cols, device), device)
    return {"up": rows(w.up), "gate": rows(w.gate) if gated else None, "down": down, "down_cols": cols}


def _on_cpu_kernels(w: FFNWeights, fmt: WeightFormat, device: torch.device | str,
                    work: torch.device | str | None) -> bool:
    """Whether the down projection's columns can be taken by weights/quants_cpu.py's Numba kernels: stored (d, n) in
    blocks it reads (Q4_0, Q8_0, Q4_1, the K-quants) in CPU memory, d whole blocks of 32, converted on the CPU into
    f32, q4_0, q8_0 or q4_1 (a GPU's `work` keeps torch's kernels there: they are fast on it)."""
    from hotneurons.weights import quants, quants_cpu

    return (quants.CPU_KERNELS and isinstance(w.down, QTensor) and w.down.fmt.value in quants_cpu.READS
            and w.down.device.type == "cpu" and fmt.value in ("f32", *quants_cpu.WRITES) and w.shape[1] % 32 == 0
            and torch.device(device).type == "cpu" and (work is None or torch.device(work).type == "cpu"))


def _device_form(w: QTensor, device: torch.device | str) -> Any:
    """Block rows as `device` reads them fastest, by the decoder's rule (models/common._pack): on CUDA qlinear's
    packed layout (its Triton GEMV); on the CPU the stored blocks themselves, which qlinear's Numba GEMV reads in place
    and its prefill de-quantizes with no reordering (packing them cost a CPU load seconds, and every prefill the
    unpacking)."""
    from hotneurons.kernels.qlinear import pack

    if torch.device(device).type == "cuda":
        return pack(w, device)
    return w.to(device)


def every_column(w: FFNWeights, hot: torch.Tensor, fmt: WeightFormat) -> bool:
    """Whether the hot rows are every neuron (hot ascending, as HybridFFN makes it) of a down projection stored
    (d, n) in `fmt` with n whole blocks: hot_blocks then takes the stored matrix as it is. Re-quantizing what
    de-quantizing a Q4_0 or Q8_0 block gives returns that block byte for byte where the file was written with
    llama.cpp's reference rounding (each block's largest weight maps back to the same scale; an all-zero block's
    scale may come back +0 for -0, the same zeros: tests/test_ffn_weights_fast.py), so for such files this is only
    the time saved (seconds of a CPU load); for a file quantized otherwise (an importance matrix's search) the file's
    own bytes are kept, as gate and up are."""
    n = w.shape[0]
    return isinstance(w.down, QTensor) and w.down.fmt == fmt and len(hot) == n and n % spec(fmt).block == 0


def cold_formats(fmt: WeightFormat, up: WeightFormat, gate: WeightFormat | None,
                 down: WeightFormat) -> tuple[WeightFormat, WeightFormat]:
    """The formats of cold rows asked in block format `fmt` (--cold-dtype), from the stored formats of up, gate (None:
    ungated) and the down projection: (gate and up rows, down_t rows). Q8_0, Q4_0, Q4_1: both in fmt. A K-quant (the
    CPU kernels read it as stored; weights/quants.py writes none): gate and up as stored where both are stored in fmt
    (else all three in fmt's nearest), and down_t in the down's own format where it is q8_0, q4_0 or q4_1, else its
    nearest (Q4_K -> q4_1, Q5_K and Q6_K -> q8_0, weights/formats.py; floats -> q8_0), whatever d_model is.

    down_t is never a K-quant: it re-blocks the down projection's columns along d_model, so its blocks of 256 would
    hold other weights than the file's blocks and no byte of the file would be kept in any format; a K-quant's rounding
    is llama.cpp's search for sub-block scales and mins (make_qkx2_quants), which nothing here reproduces; and a
    32-weight format needs d_model a multiple of 32, not 256. q8_0 for the 5- and 6-bit K-quants keeps a weight within
    ~1/16 of their own step (a Q4_K_M file's Q6_K down), q4_1 for Q4_K about its bytes a weight."""
    if fmt not in K_FORMATS:
        return fmt, fmt
    if up != fmt or gate not in (None, fmt):
        return nearest(fmt), nearest(fmt)
    dt = nearest(down) if spec(down).block > 1 else WeightFormat.Q8_0
    return fmt, dt if dt in (WeightFormat.Q8_0, WeightFormat.Q4_0, WeightFormat.Q4_1) else WeightFormat.Q8_0


def kept_format(infos: dict[str, Any], name: str, fmt: str | WeightFormat, cold: bool, dense: bool) -> WeightFormat:
    """The format a dense FFN's tensor `name` (blk.{i}.ffn_gate / up / down / down_t.weight; infos: the file's tensor
    table) is kept in by its cold rows (`cold`) or its hot rows, asked in `fmt` (--cold-dtype / --gpu-dtype): fmt, or
    for a K-quant fmt what cold_formats / k_hot_formats make of its layer (dense: every neuron hot)."""
    fmt = weight_format(fmt)
    p, _, own = name.rpartition(".ffn_")
    if fmt not in K_FORMATS or own not in ("gate.weight", "up.weight", "down.weight", "down_t.weight"):
        return fmt

    def stored(k: str) -> WeightFormat | None:
        t = infos.get(f"{p}.ffn_{k}.weight")
        return None if t is None else t.fmt

    down, mine = stored("down") or stored("down_t"), infos[name].fmt
    if cold:
        rows, dt = cold_formats(fmt, stored("up"), stored("gate"), down)
    else:
        rows, dt = k_hot_formats(fmt, mine, down, dense)
    return dt if own.startswith("down") else rows
