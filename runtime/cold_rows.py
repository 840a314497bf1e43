"""Cold rows in CPU RAM: their storage, as the kernels read them (`ColdRows`: bfloat16 bit patterns, int8 with a
float32 scale per group of INT8_GROUP weights, or llama.cpp's Q8_0 / Q4_0 / Q4_1 blocks or K-quants (Q4_K / Q5_K / Q6_K
gate and up rows beside down_t rows of the former) as a GGUF file stores them),
the CPU's sum over a token's active rows (`ffn_rows`, by the Numba kernels of hotneurons.kernels), and the compute
device's reads of them in place (`map_rows`, `ffn_rows_mapped`: the GPU's share of the active cold rows, read over
PCIe)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import torch
from hotneurons.kernels.cold import ACT_CODE, INT8_GROUP, cold_ffn
from hotneurons.kernels.cold_q import FORMAT_CODE, cold_ffn_q
from hotneurons.kernels.dequant import dequant_rows
from hotneurons.kernels.names import BLOCK_DTYPES, COLD_DTYPES, K_DTYPES, ROW_DTYPES
from hotneurons.kernels.ops import neuron_values
from hotneurons.models.ffn_weights import (
    FFNWeights,
    cold_formats,
    down_t_rows,
    fmt_of,
    store,
    take_rows,
    to_float,
)
from hotneurons.weights.formats import WeightFormat, row_bytes, spec, weight_format
from hotneurons.weights.qtensor import QTensor
from hotneurons.weights.quants import dequantize, quantize

# ---------------------------------------------------------------------------------------------------------------
# Cold-row storage: bf16 (default), int8 with a scale per group of INT8_GROUP weights, or llama.cpp's blocks

QUANT_CHUNK = 4096  # rows quantised at a time (bounds the float32 temporary)


def to_bf16_bits(w: torch.Tensor) -> np.ndarray:
    """Any float tensor -> C-contiguous uint16 numpy array of its bfloat16 bit patterns (round to nearest even).

    The array is numpy's own: numpy asks the kernel for 2 MiB pages for large arrays (madvise), torch does not.
    Cold rows are read at random row offsets across many GB, where 4 KiB pages cost a page walk per 4 KiB read."""
    out = np.empty(tuple(w.shape), np.uint16)
    torch.from_numpy(out.view(np.int16)).view(torch.bfloat16).copy_(w.detach())  # converts and moves in one copy
    return out


def from_bf16_bits(bits: np.ndarray) -> torch.Tensor:
    """uint16 bf16 patterns -> float32 torch tensor (a copy)."""
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()


def to_int8_groups(w: torch.Tensor, group: int = INT8_GROUP) -> tuple[np.ndarray, np.ndarray]:
    """(n, d) float -> (n, d) int8 (numpy-owned, as to_bf16_bits) and (n, ceil(d / group)) float32 scales: symmetric
    per group of `group` weights along d (the last group may be shorter), scale = max|w| / 127, q = round(w / scale).
    Computed on w's device, QUANT_CHUNK rows at a time."""
    n, d = w.shape
    ng = -(-d // group)
    q, scale = np.empty((n, d), np.int8), np.empty((n, ng), np.float32)
    for s in range(0, n, QUANT_CHUNK):
        c = torch.nn.functional.pad(w[s:s + QUANT_CHUNK].detach().float(), (0, ng * group - d))  # (rows, ng * group)
        c = c.view(c.shape[0], ng, group)
        sc = c.abs().amax(dim=2).clamp_min(torch.finfo(torch.float32).tiny) / 127  # (rows, ng); zero groups stay 0
        qc = torch.round(c / sc[:, :, None]).clamp_(-127, 127).to(torch.int8).view(c.shape[0], ng * group)[:, :d]
        torch.from_numpy(q[s:s + QUANT_CHUNK]).copy_(qc)
        scale[s:s + QUANT_CHUNK] = sc.cpu().numpy()
    return q, scale


def from_int8_groups(q: np.ndarray, scale: np.ndarray, group: int) -> torch.Tensor:
    """The float32 weights (n, d) that int8 rows and their group scales stand for (a torch tensor, a copy)."""
    n, d = q.shape
    per_weight = torch.from_numpy(scale).repeat_interleave(group, dim=1)[:, :d]  # (n, d)
    return torch.from_numpy(q).float() * per_weight


def to_blocks(w: torch.Tensor, fmt: str) -> np.ndarray:
    """(n, d) float, d a multiple of 32 -> (n, row_bytes) uint8 rows of `fmt` blocks (numpy-owned, as to_bf16_bits),
    quantised with llama.cpp's rounding (weights.quants: the bytes gguf.quants.quantize writes) on w's device,
    QUANT_CHUNK rows at a time."""
    n, d = w.shape
    out = np.empty((n, row_bytes(fmt, d)), np.uint8)
    for s in range(0, n, QUANT_CHUNK):
        torch.from_numpy(out[s:s + QUANT_CHUNK]).copy_(quantize(w[s:s + QUANT_CHUNK].detach(), fmt))
    return out


def _own(t: torch.Tensor, copy: bool) -> np.ndarray:
    """A QTensor's (n, row_bytes) uint8 bytes as a C-contiguous numpy array: a numpy-owned copy, or (copy=False, a
    C-contiguous CPU tensor) its memory in place."""
    if not copy and t.device.type == "cpu" and t.is_contiguous():
        return t.numpy()
    out = np.empty(tuple(t.shape), np.uint8)
    torch.from_numpy(out).copy_(t)
    return out


@dataclass(frozen=True)
class ColdRows:
    """One layer's cold neurons in CPU RAM, one contiguous row per neuron and matrix, as the kernels read them.

    bf16: rows are bfloat16 bit patterns (uint16), one group of d per row, `scale` all ones. int8: rows are int8 with a
    float32 scale per `group` weights (w ~ scale * q, an error of at most scale / 2 per weight): 1.0625 bytes a weight,
    so a token reads about half the bytes from DRAM. q8_0 / q4_0 / q4_1 (`fmt`): rows are (n, row_bytes) uint8 of
    llama.cpp blocks of 32 weights, each with its fp16 scale (and q4_1's fp16 min) inside (1.0625 / 0.5625 / 0.625
    bytes a weight), the bytes of a GGUF file's rows; `scale` is (3, n, 0) and `group` 32. q4_k / q5_k / q6_k (`fmt`):
    gate and up rows of llama.cpp's K-quant blocks of 256 weights (0.5625 / 0.6875 / 0.8203 bytes a weight) as the
    file stores them, and down_t rows in q8_0, q4_0 or q4_1 (`fmt_down`: models/ffn_weights.cold_formats says why).
    Read by cold_q.cold_ffn_q / cold_layer_q."""

    gate: np.ndarray | None  # (n, d) uint16 or int8; None for ungated FFNs
    up: np.ndarray  # (n, d)
    down_t: np.ndarray  # (n, d): down.weight[:, cold].T
    b_up: np.ndarray  # (n,) float32, zeros when the FFN has no up bias
    scale: np.ndarray  # (3, n, groups) float32: gate, up, down_t scales (gate's unused by ungated FFNs)
    group: int  # weights per scale along d
    fmt: str | None = None  # "q8_0" / "q4_0" / "q4_1" / a K-quant for rows of blocks; None: bf16 or int8 (the type)
    fmt_down: str | None = None  # down_t's block format where it is not fmt's (beside K-quant gate and up rows)

    @classmethod
    def from_weights(cls, gate: torch.Tensor | None, up: torch.Tensor, b_up: torch.Tensor | None,
                     down_t: torch.Tensor, dtype: str = "bf16") -> "ColdRows":
        """gate, up, down_t (n, d) on any device, b_up (n,) or None -> rows stored as `dtype` (COLD_DTYPES; q8_0, q4_0
        and q4_1 quantise with llama.cpp's rounding and need d a multiple of 32)."""
        if dtype not in COLD_DTYPES:
            raise ValueError(f"unknown cold-row dtype '{dtype}': choose one of {', '.join(COLD_DTYPES)}")
        if dtype in K_DTYPES:
            raise ValueError(f"cold-row dtype '{dtype}': K-quant rows are kept as a GGUF file stores them, not made "
                             f"from float weights: choose one of {', '.join(ROW_DTYPES + BLOCK_DTYPES)}")
        n, d = up.shape
        bias = np.zeros(n, np.float32) if b_up is None else b_up.detach().float().cpu().numpy()
        if dtype in BLOCK_DTYPES:
            return cls(None if gate is None else to_blocks(gate, dtype), to_blocks(up, dtype),
                       to_blocks(down_t, dtype), bias, np.ones((3, n, 0), np.float32), 32, dtype)
        group = d if dtype == "bf16" else min(INT8_GROUP, max(d, 1))
        ones = np.ones((n, -(-d // group)), np.float32)
        store = (lambda w: (to_bf16_bits(w), ones)) if dtype == "bf16" else to_int8_groups
        (g, sg), (u, su), (dt, sd) = (store(gate) if gate is not None else (None, ones)), store(up), store(down_t)
        return cls(g, u, dt, bias, np.stack([sg, su, sd]), group)

    @classmethod
    def from_blocks(cls, gate: QTensor | None, up: QTensor, b_up: torch.Tensor | None, down_t: QTensor,
                    copy: bool = True) -> "ColdRows":
        """Rows already in blocks (e.g. a GGUF file's gate and up rows), kept byte for byte: no re-quantisation. gate
        (None: ungated), up, down_t (n, d) QTensors of one format (BLOCK_DTYPES), or gate and up of a K-quant beside
        down_t of BLOCK_DTYPES, on any device; b_up (n,) or None. copy=False uses C-contiguous CPU bytes in place
        (e.g. a memory-mapped file's) instead of copying them."""
        fmt, dfmt = weight_format(up.fmt).value, weight_format(down_t.fmt).value
        shape = tuple(up.shape)
        if fmt not in BLOCK_DTYPES + K_DTYPES:
            raise ValueError(f"ColdRows.from_blocks: up is {fmt}, which the cold kernels do not read: choose one of "
                             f"{', '.join(BLOCK_DTYPES + K_DTYPES)}, or convert with ColdRows.from_weights(..., dtype)")
        for name, t, ok in (("gate", gate, (fmt,)), ("down_t", down_t, BLOCK_DTYPES if fmt in K_DTYPES else (fmt,))):
            if t is not None and (weight_format(t.fmt).value not in ok or tuple(t.shape) != shape):
                raise ValueError(f"ColdRows.from_blocks: {name} is {weight_format(t.fmt).value} {tuple(t.shape)}, up "
                                 f"{fmt} {shape}: store gate, up and down_t in one format and shape (down_t of a "
                                 f"K-quant's in one of {', '.join(BLOCK_DTYPES)})")
        n = shape[0]
        bias = np.zeros(n, np.float32) if b_up is None else b_up.detach().float().cpu().numpy()
        return cls(None if gate is None else _own(gate.data, copy), _own(up.data, copy), _own(down_t.data, copy),
                   bias, np.ones((3, n, 0), np.float32), 32, fmt, None if dfmt == fmt else dfmt)

    @property
    def dtype(self) -> str:
        return self.fmt or ("int8" if self.up.dtype == np.int8 else "bf16")

    @property
    def down_fmt(self) -> str | None:
        """down_t's block format (None: bf16 or int8 rows)."""
        return self.fmt_down or self.fmt

    @property
    def code(self) -> int:
        """cold_q.FORMAT_CODE of the gate and up rows (-1: bf16 or int8 rows)."""
        return FORMAT_CODE.get(self.fmt, -1)

    @property
    def d(self) -> int:
        """Weights per row (d_model)."""
        if not self.fmt:
            return self.up.shape[1]
        s = spec(self.fmt)
        return self.up.shape[1] // s.block_bytes * s.block

    @property
    def gate_arg(self) -> np.ndarray:
        """What cold_ffn's `gate` takes: the gate rows, or for ungated FFNs up's (of the type it needs, never read)."""
        return self.up if self.gate is None else self.gate

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.gate, self.up, self.down_t, self.b_up, self.scale) if a is not None)

    def float32(self, rows: slice = slice(None), device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor | None]:
        """The weights rows `rows` stand for, torch tensors on `device` (copies): gate, up, down_t (float32, or
        `dtype` for block rows), b_up (float32). Block rows cross to the device as stored and are widened there."""
        if self.fmt:
            return self.widen(self.stored(rows, device), dtype)

        def wide(a: np.ndarray | None, s: np.ndarray) -> torch.Tensor | None:
            if a is None:
                return None
            a, s = a[rows], s[rows]
            return (from_int8_groups(a, s, self.group) if a.dtype == np.int8 else from_bf16_bits(a)).to(device)

        return {"gate": wide(self.gate, self.scale[0]), "up": wide(self.up, self.scale[1]),
                "down_t": wide(self.down_t, self.scale[2]), "b_up": torch.from_numpy(self.b_up[rows]).to(device)}

    def stored(self, rows: slice, device: torch.device | str, non_blocking: bool = False) -> dict[str, Any]:
        """Block rows `rows` as stored: uint8 tensors on `device` (gate, up, down_t; b_up float32). non_blocking: the
        copies are queued on the current stream (asynchronous where the rows are page-locked: map_cold's)."""
        def raw(a: np.ndarray | None) -> torch.Tensor | None:
            return None if a is None else torch.from_numpy(a[rows]).to(device, non_blocking=non_blocking)

        return {"gate": raw(self.gate), "up": raw(self.up), "down_t": raw(self.down_t),
                "b_up": torch.from_numpy(self.b_up[rows]).to(device, non_blocking=non_blocking)}

    def widen(self, raw: dict[str, Any], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor | None]:
        """stored()'s blocks as `dtype` weights where they are (one pass each: kernels/dequant.dequant_rows)."""
        return {k: v if v is None or k == "b_up" else dequant_rows(v, self.down_fmt if k == "down_t" else self.fmt,
                                                                  self.d, dtype) for k, v in raw.items()}


def chunks(cold: ColdRows, step: int, device: torch.device, dtype: torch.dtype = torch.float32):
    """The rows `step` at a time as ColdRows.float32 gives them (prefill, oracle): never a float copy of them all.
    float32, or `dtype` for block rows, which cross to the device as stored and are widened there. On CUDA the next
    chunk's bytes cross on a side stream while this one is computed (the copies are a third of a 70B's prefill); the
    host waits for chunk k - 2's compute before queuing copy k + 1, so that at most three chunks' bytes are in flight
    (queued far ahead, the allocator cannot reuse their memory: gigabytes more)."""
    n = cold.up.shape[0]
    if device.type != "cuda" or not cold.fmt:
        for s in range(0, n, step):
            yield cold.float32(slice(s, s + step), device, dtype)
        return
    from hotneurons.runtime.cuda import side_stream

    main, side = torch.cuda.current_stream(device), side_stream(device)
    computed: list[torch.cuda.Event] = []  # recorded on the main stream after each chunk's compute

    def fetch(s: int) -> tuple[dict[str, Any], torch.cuda.Event]:
        side.wait_stream(main)  # the memory it may reuse is done with
        with torch.cuda.stream(side):
            raw = cold.stored(slice(s, s + step), device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(side)
        return raw, copied

    nxt = fetch(0)
    for k, s in enumerate(range(0, n, step)):
        raw, copied = nxt
        if s + step < n:
            if k >= 2:
                computed[k - 2].synchronize()
            nxt = fetch(s + step)
        main.wait_event(copied)
        for t in raw.values():
            if t is not None:
                t.record_stream(main)  # made on the side stream, read on the main one
        yield cold.widen(raw, dtype)
        computed.append(torch.cuda.Event())
        computed[-1].record(main)


# ---------------------------------------------------------------------------------------------------------------
# The CPU's reads of them


def ffn_rows(activation: str, x: np.ndarray, idx: np.ndarray, rows: ColdRows, out: np.ndarray,
             part: np.ndarray | None = None) -> np.ndarray:
    """CPU backend: out (d,) float32 = sum over neurons j in idx of h_j(x) * down_t[j], by the Numba kernel of the
    rows' format (kernels/cold.py cold_ffn, kernels/cold_q.py cold_ffn_q).

    part: (threads, d) float32 scratch for the per-thread partial sums (made here if None); its row count is the
    number of threads that share the active list."""
    if part is None:
        part = np.empty((numba.get_num_threads(), x.shape[0]), np.float32)
    if rows.fmt:  # llama.cpp blocks (q8_0, q4_0, q4_1, the K-quants): their own kernel
        cold_ffn_q(x, idx, rows.gate_arg, rows.up, rows.b_up, rows.down_t, part, out, ACT_CODE[activation],
                   fmt=rows.code)
        return out
    cold_ffn(x, idx, rows.gate_arg, rows.up, rows.b_up, rows.down_t, rows.scale, rows.group, part, out,
             ACT_CODE[activation])
    return out


# ---------------------------------------------------------------------------------------------------------------
# Cold rows the compute device reads in place. On CUDA the arrays are page-locked and mapped into the GPU's address
# space (cudaHostRegister), so a GPU kernel reads them over PCIe while the CPU reads other rows from DRAM: the two
# reads add up, the CPU keeping most of its bandwidth (docs/history.md). On the CPU the
# "mapped" tensors are plain views, which tests use.


class _CudaArrayView:
    """A registered host array as the CUDA array interface describes device memory (its pointer is valid on the GPU)."""

    def __init__(self, a: np.ndarray):
        self.a = a  # kept alive by the tensor made from this
        self.__cuda_array_interface__ = {"shape": a.shape, "typestr": a.dtype.str, "data": (a.ctypes.data, False),
                                         "version": 3, "strides": None}


def _widest(a: np.ndarray) -> np.ndarray:
    """(n, d) rows viewed as the widest integer type that divides a row: wider loads keep more bytes in flight."""
    for t in (np.int64, np.int32, np.int16):
        if a.shape[1] * a.itemsize % np.dtype(t).itemsize == 0:
            return a.view(t)
    return a.view(np.int8)


def host_mapped(a: np.ndarray, view: np.ndarray, device: torch.device, register: bool = True) -> torch.Tensor:
    """`view` (a view of the C-contiguous array `a`) as a tensor on `device` over the same memory: on CUDA `a` is
    registered (page-locked, mapped; unregistered when `a` is freed), so GPU kernels read and write it over PCIe.
    register=False: `a` is page-locked already (torch's pinned memory; with unified addressing its host pointer is
    valid on the GPU)."""
    if device.type != "cuda":
        return torch.from_numpy(view)
    if view.size == 0:  # nothing to map (a layer without cold neurons): torch refuses a host pointer it cannot place
        return torch.empty(view.shape, dtype=torch.from_numpy(view).dtype, device=device)
    if not register:
        return torch.as_tensor(_CudaArrayView(view), device=device)
    rt = torch.cuda.cudart()
    err = int(rt.cudaHostRegister(a.ctypes.data, a.nbytes, 0))
    if err:
        raise RuntimeError(f"cudaHostRegister of {a.nbytes:,} B of cold rows failed (CUDA error {err}): run with "
                           f"--pcie-share 0 (the CPU reads every cold row)")
    weakref.finalize(a, rt.cudaHostUnregister, a.ctypes.data)  # runs before numpy frees the memory
    return torch.as_tensor(_CudaArrayView(view), device=device)


def map_rows(rows: ColdRows, device: torch.device) -> dict[str, torch.Tensor | str | int | None]:
    """rows' arrays as tensors on `device` over the same memory (CUDA: registered and mapped; CPU: views)."""
    out: dict[str, torch.Tensor | str | int | None] = {"dtype": rows.dtype, "down_dtype": rows.down_fmt or rows.dtype,
                                                       "group": rows.group, "d": rows.d}
    for name in ("gate", "up", "down_t", "scale"):
        a = getattr(rows, name)
        if a is None:
            out[name] = None
            continue
        out[name] = host_mapped(a, a if name == "scale" else _widest(a), device)
    out["b_up"] = torch.from_numpy(rows.b_up).to(device)  # (n,) float32, small: a device copy
    return out


def _take(mapped: dict, name: str, which: int, ids: torch.Tensor) -> torch.Tensor | None:
    """Rows `ids` of mapped[name] as float32 (K, d), read over PCIe on CUDA; int8 rows times their group scales, block
    rows de-quantised on the device."""
    a = mapped[name]
    if a is None:
        return None
    r = a.index_select(0, ids)  # (K, row bytes / itemsize)
    fmt = mapped["down_dtype" if name == "down_t" else "dtype"]
    if fmt in BLOCK_DTYPES + K_DTYPES:
        return dequantize(r.view(torch.uint8), fmt, mapped["d"])  # (K, d)
    if mapped["dtype"] == "bf16":
        return r.view(torch.int16).view(torch.bfloat16).float()
    s = mapped["scale"][which].index_select(0, ids)  # (K, groups)
    q, group, d = r.view(torch.int8).float(), mapped["group"], mapped["d"]  # (K, d)
    if d % group == 0:  # a broadcast product: no (K, d) tensor of repeated scales to write and read again
        return (q.view(len(ids), -1, group) * s[:, :, None]).view(len(ids), d)
    return q * s.repeat_interleave(group, dim=1)[:, :d]


def ffn_rows_mapped(activation: str, x: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor,
                    mapped: dict) -> torch.Tensor:
    """Device backend of `ffn_rows` over rows read in place: (1, d) x, (K,) row ids and (K,) valid (False: padding,
    contributes nothing) -> (1, d) float32 sum of h_j * down_t[j]. Static shapes, so it can be a CUDA graph's part."""
    h = neuron_values(activation, x.float(), _take(mapped, "gate", 0, ids), _take(mapped, "up", 1, ids),
                      mapped["b_up"].index_select(0, ids))  # (1, K)
    return (h * valid) @ _take(mapped, "down_t", 2, ids)  # (1, K) @ (K, d)


def cold_rows_of(w: FFNWeights, cold: torch.Tensor, dtype: str, gated: bool,
                 work: torch.device | str | None = None):
    """The cold neurons' rows in CPU RAM as runtime/cold_rows.ColdRows stores them in `dtype`: block formats from the
    stored rows (copied as they are when the file has that format; a K-quant's in cold_formats' formats), bf16 / int8
    from float rows. The down rows' conversion runs on `work` (the compute device)."""
    fmt = weight_format(dtype)
    b_up = None if w.b_up is None else w.b_up[cold.to(w.b_up.device)]
    if spec(fmt).block > 1 and fmt != WeightFormat.INT8:
        rows, dt = cold_formats(fmt, fmt_of(w.up), fmt_of(w.gate) if gated else None,
                                fmt_of(w.down if w.down is not None else w.down_t))
        gate = store(take_rows(w.gate, cold), rows) if gated else None
        return ColdRows.from_blocks(gate, store(take_rows(w.up, cold), rows), b_up,
                                    down_t_rows(w, cold, dt, work=work))
    wide = torch.bfloat16 if fmt == WeightFormat.BF16 else torch.float32  # bf16 rows lose nothing from bf16
    gate = to_float(take_rows(w.gate, cold), wide) if gated else None
    return ColdRows.from_weights(gate, to_float(take_rows(w.up, cold), wide), b_up,
                                 to_float(down_t_rows(w, cold, WeightFormat.F32, work=work), wide), str(fmt))
