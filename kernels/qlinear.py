"""Linear layers over weights kept at 4 or 8 bits, on the GPU and the CPU: one dispatcher and its torch reference.

A weight is one of
  torch.Tensor  (n, k) float: torch (F.linear / mm), cast to x's dtype where it differs
  QTensor       (n, k) in its file's blocks (weights/qtensor.py), on any device: float formats are viewed as floats;
                Q4_0 / Q4_1 / Q8_0 (and the formats weights/quants.py reads) are de-quantized in chunks of rows and
                multiplied (correct and memory-bounded, not fast: the CPU's path, and a GPU's before `pack`)
  GpuQ          (n, k) Q4_0 / Q4_1 / Q8_0 split once by `pack` into contiguous quants (reordered within each block) and
                block-major fp16 scales (and Q4_1's fp16 mins), the file's bytes (kernels/qgemv.py says how and why);
                Q4_K / Q5_K / Q6_K split likewise into kernels/qlayout_k.py's fields (kernels/qgemv_k.py reads them)

and `linear(x, w, bias)` runs, for x (..., k) -> (..., n) in x's dtype:
  CUDA, GpuQ, <= qgemv.GEMV_MAX_ROWS tokens (decode): qgemv's Triton GEMV (qgemv_k's for K-quants), reading the
      weight's bytes once, sums in float32, rounded once (+ bias before the rounding) to x's dtype
  CUDA, GpuQ, more tokens (prefill): chunks of rows de-quantized by a Triton kernel to x's dtype (each weight
      rounded once there; exact for float32 x), times x by cuBLAS; the chunk is the only temporary (CHUNK_ELEMS
      weights). Not a fused kernel: prefill is bound by the matmul's arithmetic, the chunk's extra traffic (2 + 2
      bytes a weight in fp16) is small next to it for hundreds of tokens
  CPU: chunks of rows de-quantized to float32 by torch, times x in float32, the output cast to x's dtype

`out=` writes into a given (..., n) tensor and `add_linear(h, x, w, bias)` adds into one (h += x @ w.T + bias, as
ops.add_linear), so that the static decoder's CUDA graphs keep fixed buffers; the GEMV path neither syncs nor
allocates (beyond `linear`'s own output without out=), so it can be captured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hotneurons.kernels import qlayout_k
from hotneurons.kernels.qlayout_k import K_FORMATS
from hotneurons.weights.formats import WeightFormat, row_bytes, spec, weight_format
from hotneurons.weights.qtensor import FLOAT_DTYPES, QTensor

QBLOCK = spec(WeightFormat.Q4_0).block  # weights per Q4_0 / Q4_1 / Q8_0 block (32; weights/formats.py's, as all sizes)
# bytes of quants per block: a nibble a weight (Q4_0, Q4_1), a byte (Q8_0); the rest of the block is its head (_head)
BLOCKS = {WeightFormat.Q4_0: QBLOCK // 2, WeightFormat.Q4_1: QBLOCK // 2, WeightFormat.Q8_0: QBLOCK}
QDTYPE = {WeightFormat.Q4_0: torch.uint8, WeightFormat.Q4_1: torch.uint8, WeightFormat.Q8_0: torch.int8}
CHUNK_ELEMS = 1 << 24  # weights de-quantized at a time (64 MB as float32): bounds the temporaries of big matrices
PACK_CHUNK_BYTES = 1 << 24  # file bytes copied to the device at a time by pack


def _block_major(s: torch.Tensor) -> torch.Tensor:
    """(rows, nb) scales with stride (1, rows') (a copy where they are not)."""
    return s if s.stride(0) == 1 else s.t().contiguous().t()


def _head(fmt: WeightFormat) -> int:
    """Bytes before a block's quants: its fp16 scale (and Q4_1's fp16 min)."""
    return spec(fmt).block_bytes - BLOCKS[fmt]


@dataclass(frozen=True)
class GpuQ:
    """An (n, k) Q4_0, Q4_1 or Q8_0 weight in the GEMV's layout (kernels/qgemv.py): qs (n, k/2) uint8 (Q4_0, Q4_1)
    or (n, k) int8 (Q8_0), row-major, each block's quants in the kernel order; scales (n, k/32) fp16, block-major
    (stride (1, n): given otherwise, they are copied so); mins (Q4_1 only) as scales. Or a Q4_K, Q5_K or Q6_K one in
    kernels/qlayout_k.py's layout: qs, scales (d), mins (dmin, Q4_K and Q5_K), sub and qh (Q5_K, Q6_K), each but qs
    row-innermost (copied so where given otherwise). Any device; rows of one (`rows`) are views."""

    qs: torch.Tensor  # (n, k/2) uint8 | (n, k) int8, kernel order within blocks
    scales: torch.Tensor  # (n, k/32) float16, stride (1, n) (K-quants: (n, k/256), d)
    fmt: WeightFormat
    shape: tuple[int, int]  # (n, k), as torch's Linear.weight
    mins: torch.Tensor | None = None  # (n, k/32) float16, stride (1, n): Q4_1's m (w = scale * q + m); else None
    sub: torch.Tensor | None = None  # K-quants: sub-block scales (qlayout_k); else None
    qh: torch.Tensor | None = None  # Q5_K, Q6_K: high bits (qlayout_k); else None

    def __post_init__(self):
        fmt = weight_format(self.fmt)
        object.__setattr__(self, "fmt", fmt)
        if fmt in K_FORMATS:
            return self._check_k()
        if fmt not in BLOCKS:
            raise ValueError(f"GpuQ holds q4_0, q4_1, q8_0, q4_k, q5_k or q6_k weights, not {fmt.value}")
        n, k = self.shape
        nb = k // QBLOCK
        m = self.mins
        mins_ok = m is None if fmt != WeightFormat.Q4_1 else (
            m is not None and m.dtype == torch.float16 and tuple(m.shape) == (n, nb) and m.device == self.qs.device)
        if (k % QBLOCK or self.qs.dtype != QDTYPE[fmt] or tuple(self.qs.shape) != (n, nb * BLOCKS[fmt])
                or self.scales.dtype != torch.float16 or tuple(self.scales.shape) != (n, nb)
                or self.qs.stride(1) != 1 or self.qs.device != self.scales.device or not mins_ok
                or self.sub is not None or self.qh is not None):
            mins = "" if self.mins is None else f" and mins {tuple(self.mins.shape)} {self.mins.dtype}"
            want = f" and mins ({n}, {nb}) float16" if fmt == WeightFormat.Q4_1 else " and no mins"
            raise ValueError(f"GpuQ {fmt.value} {self.shape}: got qs {tuple(self.qs.shape)} {self.qs.dtype} and "
                             f"scales {tuple(self.scales.shape)} {self.scales.dtype}{mins}, expected "
                             f"({n}, {nb * BLOCKS[fmt]}) {QDTYPE[fmt]} and ({n}, {nb}) float16{want} on one device")
        object.__setattr__(self, "scales", _block_major(self.scales))
        if self.mins is not None:
            object.__setattr__(self, "mins", _block_major(self.mins))

    def _check_k(self) -> None:
        """A K-quant's fields (qlayout_k.checked: their shapes and dtypes, made row-innermost)."""
        fields = qlayout_k.checked({f: getattr(self, f) for f in qlayout_k.FIELDS}, self.fmt, self.shape)
        for f, t in fields.items():
            object.__setattr__(self, f, t)

    @property
    def q4(self) -> bool:
        """4-bit quants (Q4_0, Q4_1: nibbles), else 8-bit (Q8_0)."""
        return self.fmt != WeightFormat.Q8_0

    @property
    def kquant(self) -> bool:
        """A Q4_K, Q5_K or Q6_K weight (kernels/qgemv_k.py), else Q4_0, Q4_1 or Q8_0 (kernels/qgemv.py)."""
        return self.fmt in K_FORMATS

    @property
    def device(self) -> torch.device:
        return self.qs.device

    @property
    def nbytes(self) -> int:
        """Bytes held on the device: the file's row_bytes * rows (rows of a view: its share)."""
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins, self.sub, self.qh)
                   if t is not None)

    def to(self, device: torch.device | str) -> "GpuQ":
        def move(t):
            return None if t is None else t.to(device)

        return GpuQ(self.qs.to(device), self.scales.to(device), self.fmt, self.shape, move(self.mins),
                    move(self.sub), move(self.qh))

    def rows(self, idx: slice | torch.Tensor) -> "GpuQ":
        """Some rows: a view for a slice, a copy for an index tensor."""
        def take(t):
            return None if t is None else t[idx]

        qs = self.qs[idx]
        return GpuQ(qs, self.scales[idx], self.fmt, (qs.shape[0], self.shape[1]), take(self.mins), take(self.sub),
                    take(self.qh))

    def file_blocks(self) -> torch.Tensor:
        """(n, nb, block bytes) uint8: the file's interleaved blocks again (on the device)."""
        n, k = self.shape
        if self.kquant:
            return qlayout_k.to_file(self.qs, self.scales, self.mins, self.sub, self.qh, self.fmt)
        nb, bb, head = k // QBLOCK, BLOCKS[self.fmt], _head(self.fmt)
        data = torch.empty((n, nb, head + bb), dtype=torch.uint8, device=self.device)  # (n, blocks, block bytes)
        data[:, :, :2] = self.scales.contiguous().view(torch.uint8).view(n, nb, 2)
        if self.mins is not None:
            data[:, :, 2:4] = self.mins.contiguous().view(torch.uint8).view(n, nb, 2)
        data[:, :, head:] = from_kernel_order(self.qs.view(torch.uint8).view(n, nb, bb), self.q4)
        return data

    def to_qtensor(self) -> QTensor:
        n, k = self.shape
        return QTensor(self.file_blocks().view(n, row_bytes(self.fmt, k)), self.fmt, self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(n, k) in dtype, on the device, by torch (the reference; a whole-matrix temporary)."""
        if self.kquant:  # the file's blocks again, de-quantized as gguf-py does (weights/quants.py)
            from hotneurons.weights.quants import dequantize

            return dequantize(self.to_qtensor().data, self.fmt, self.shape[1]).to(dtype)
        n, nb = self.scales.shape
        qs = from_kernel_order(self.qs.view(torch.uint8).view(n, nb, BLOCKS[self.fmt]), self.q4)
        return _file_dequant(qs, self.scales, self.q4, self.mins).to(dtype)


Weight = torch.Tensor | QTensor | GpuQ


def to_kernel_order(qs: torch.Tensor, q4: bool) -> torch.Tensor:
    """(rows, nb, 16 | 32) uint8 blocks' quants, file order -> kernel order (kernels/qgemv.py); a new tensor. q4: the
    nibbles of Q4_0 and Q4_1 (one layout), else Q8_0's bytes."""
    rows, nb, bb = qs.shape
    if q4:  # file: byte j = weights j (low), 16 + j (high); kernel: byte 4 i + t = weights 8 t + i (low), 8 t + 4 + i
        v = torch.cat([qs & 15, qs >> 4], dim=2).view(rows, nb, 4, 2, 4)  # (.., t, h, i): weight 8 t + 4 h + i
        return (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).transpose(2, 3).reshape(rows, nb, 16)  # (.., i, t)
    # Q8_0: kernel byte 16 a + 4 c + t = weight 16 a + 4 t + c
    return qs.view(rows, nb, 2, 4, 4).transpose(3, 4).reshape(rows, nb, 32)


def from_kernel_order(qs: torch.Tensor, q4: bool) -> torch.Tensor:
    """to_kernel_order's inverse."""
    rows, nb, bb = qs.shape
    if q4:
        k = qs.view(rows, nb, 4, 4).transpose(2, 3)  # (.., t, i): weights 8 t + i (low), 8 t + 4 + i (high)
        v = torch.stack([k & 15, k >> 4], dim=3).reshape(rows, nb, 32)  # weight order
        return v[:, :, :16] | (v[:, :, 16:] << 4)
    return qs.view(rows, nb, 2, 4, 4).transpose(3, 4).reshape(rows, nb, 32)


def _file_dequant(qs: torch.Tensor, scales: torch.Tensor, q4: bool, mins: torch.Tensor | None = None) -> torch.Tensor:
    """(rows, k) float32 from file-order quants (rows, nb, 16 | 32) (uint8, or int8 for Q8_0), fp16 scales (rows, nb)
    and Q4_1's fp16 mins (rows, nb); gguf's arithmetic: scale * (q - 8) (Q4_0), scale * q (Q8_0), both exact in
    float32, scale * q + min (Q4_1: the product exact, the sum rounded once, as gguf-py's)."""
    rows, nb = scales.shape
    if q4:
        w = torch.cat([qs & 15, qs >> 4], dim=2).to(torch.float32)  # (rows, nb, 32) q
        if mins is None:
            w.sub_(8.0)
    else:
        w = qs.view(torch.int8).to(torch.float32)
    w.mul_(scales.to(torch.float32).reshape(rows, nb, 1))
    if mins is not None:
        w.add_(mins.to(torch.float32).reshape(rows, nb, 1))
    return w.reshape(rows, nb * QBLOCK)


def _qtensor_rows(w: QTensor, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of a QTensor as float32 (float formats: as stored), on its device."""
    if w.fmt in FLOAT_DTYPES:
        return w.data[r0:r1].view(FLOAT_DTYPES[w.fmt])
    if w.fmt in BLOCKS:
        head = _head(w.fmt)
        blocks = w.data[r0:r1].view(r1 - r0, -1, head + BLOCKS[w.fmt])  # (rows, nb, block bytes)
        scales, mins = _block_fields(blocks, w.fmt)  # (rows, nb) each (mins None)
        return _file_dequant(blocks[:, :, head:], scales, w.fmt != WeightFormat.Q8_0, mins)
    return w.rows(slice(r0, r1)).dequantize(torch.float32)  # weights/quants.py's formats


def _block_fields(blocks: torch.Tensor, fmt: WeightFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rows, nb, block bytes) uint8 file blocks -> their fp16 scales (rows, nb) and Q4_1's fp16 mins (else None)."""
    def f16(at: int) -> torch.Tensor:
        return blocks[:, :, at:at + 2].contiguous().view(torch.float16).squeeze(2)  # (rows, nb)

    return f16(0), f16(2) if fmt == WeightFormat.Q4_1 else None


def pack(w: QTensor | GpuQ | torch.Tensor, device: torch.device | str,
         chunk_bytes: int = PACK_CHUNK_BYTES) -> GpuQ | torch.Tensor:
    """The form `linear` reads fastest on `device`: a Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K QTensor as a GpuQ (its
    file's bytes, split; copied chunk_bytes of file at a time, with no float temporaries), a float one as a float
    tensor (its bytes viewed); a GpuQ or tensor moved. Other formats (no GPU kernel): a one-line error."""
    if isinstance(w, (GpuQ, torch.Tensor)):
        return w.to(device)
    if w.fmt in FLOAT_DTYPES:
        return w.data.to(device).view(FLOAT_DTYPES[w.fmt])
    if w.fmt in K_FORMATS:
        return GpuQ(fmt=w.fmt, shape=w.shape, **qlayout_k.pack(w.data, w.fmt, w.shape, device, chunk_bytes))
    if w.fmt not in BLOCKS:
        raise ValueError(f"pack: {w.fmt.value} weights have no GPU kernel: store them as q4_0, q4_1, q8_0, q4_k, q5_k, "
                         f"q6_k or a float format (llama.cpp's llama-quantize), or de-quantize them on load")
    n, k = w.shape
    nb, bb, head = k // QBLOCK, BLOCKS[w.fmt], _head(w.fmt)
    qs = torch.empty((n, nb * bb), dtype=QDTYPE[w.fmt], device=device)
    scales = torch.empty((nb, n), dtype=torch.float16, device=device).t()  # (n, nb), block-major
    mins = torch.empty((nb, n), dtype=torch.float16, device=device).t() if w.fmt == WeightFormat.Q4_1 else None
    step = max(1, chunk_bytes // row_bytes(w.fmt, k))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        blocks = w.data[r0:r1].to(device).view(r1 - r0, nb, head + bb)  # (rows, nb, block bytes): the file's
        quants = to_kernel_order(blocks[:, :, head:], w.fmt != WeightFormat.Q8_0)  # (rows, nb, bb): a chunk's copy
        qs[r0:r1].view(torch.uint8).view(r1 - r0, nb, bb).copy_(quants)
        s, m = _block_fields(blocks, w.fmt)  # (rows, nb) each
        scales[r0:r1].copy_(s)
        if mins is not None:
            mins[r0:r1].copy_(m)
    return GpuQ(qs, scales, w.fmt, (n, k), mins)


def shape_of(w: Weight) -> tuple[int, int]:
    return tuple(w.shape) if isinstance(w, torch.Tensor) else w.shape


def _on_kernels(x: torch.Tensor) -> bool:
    """Whether x's device runs qgemv's kernels (the tests patch it to run them in Triton's interpreter)."""
    return x.is_cuda


def _chunked(x2: torch.Tensor, w: QTensor | GpuQ, bias: torch.Tensor | None, out2: torch.Tensor,
             add: bool) -> None:
    """out2 (m, n) = (or +=) x2 (m, k) @ w.T + bias, chunks of CHUNK_ELEMS weights de-quantized at a time: by
    kernels/dequant_gpu.py to x's dtype for a GpuQ on kernels, else by torch to float32 (the sums in float32)."""
    n, k = w.shape
    step = max(1, min(n, CHUNK_ELEMS // k))
    kernels = isinstance(w, GpuQ) and _on_kernels(w.qs)
    dtype = x2.dtype if kernels else torch.float32
    xc = x2.to(dtype)
    buf = torch.empty((step, k), dtype=dtype, device=w.device) if kernels else None  # (rows, k) the one chunk
    if kernels:
        from hotneurons.kernels import dequant_gpu  # Triton: imported where a chunked product runs
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        if kernels and w.kquant:
            wc = dequant_gpu.dequant_k(w.rows(slice(r0, r1)), buf[:r1 - r0])
        elif kernels:
            wc = dequant_gpu.dequant_q(w.qs[r0:r1], w.scales[r0:r1], w.q4, buf[:r1 - r0],
                                      mins=None if w.mins is None else w.mins[r0:r1])
        elif isinstance(w, GpuQ):
            wc = w.rows(slice(r0, r1)).dequantize()
        else:
            wc = _qtensor_rows(w, r0, r1).to(dtype)
        y = F.linear(xc, wc.to(xc.device), None if bias is None else bias[r0:r1].to(xc.device, dtype))
        if add:
            out2[:, r0:r1] += y
        else:
            out2[:, r0:r1] = y


def _apply(x: torch.Tensor, w: Weight, bias: torch.Tensor | None, out: torch.Tensor, add: bool) -> torch.Tensor:
    n, k = shape_of(w)
    if x.shape[-1] != k or out.shape[-1] != n or out.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"linear: x {tuple(x.shape)} and out {tuple(out.shape)} do not fit a weight of "
                         f"{(n, k)}: expected (..., {k}) and (..., {n})")
    m = math.prod(x.shape[:-1])
    x2 = x.reshape(m, k)  # (m, k)
    out2 = out.view(m, n)  # (m, n): a view, so that writes land in out (a one-line error where it cannot be one)
    if isinstance(w, QTensor) and w.fmt in FLOAT_DTYPES:
        w = w.data.view(FLOAT_DTYPES[w.fmt])
    if isinstance(w, torch.Tensor):
        wt = w if w.dtype == x.dtype else w.to(x.dtype)
        if add:
            if bias is None:
                out2.addmm_(x2, wt.t())
            else:
                out2.add_(F.linear(x2, wt, bias.to(x.dtype)))
        elif bias is None:
            torch.mm(x2, wt.t(), out=out2)
        else:
            torch.addmm(bias.to(x.dtype), x2, wt.t(), out=out2)
    elif isinstance(w, GpuQ) and _on_kernels(x) and x2.shape[0] <= _gemv_rows():
        from hotneurons.kernels import qgemv, qgemv_k

        xc = x2 if x2.stride(1) == 1 else x2.contiguous()
        if w.kquant:
            qgemv_k.gemv(xc, w, bias, out2, add=add)
        else:
            qgemv.gemv(xc, w.qs, w.scales, w.q4, bias, out2, add=add, mins=w.mins)
    elif isinstance(w, QTensor) and (w.fmt in BLOCKS or w.fmt in K_FORMATS) and not x.is_cuda and not w.data.is_cuda \
            and m <= CPU_GEMV_ROWS:
        _cpu_gemv(x2, w, bias, out2, add)  # decode on the CPU: the Numba GEMV reads the blocks in place
    else:
        _chunked(x2, w, bias, out2, add)
    return out


CPU_GEMV_ROWS = 4  # tokens up to which the CPU reads a block weight once per token (GEMVs) rather than widening it


def _cpu_gemv(x2: torch.Tensor, w: QTensor, bias: torch.Tensor | None, out2: torch.Tensor, add: bool) -> None:
    """out2 (m, n) = (or +=) x2 (m, k) @ w.T + bias on the CPU, one Numba GEMV per token over the stored blocks
    (kernels/cold_q.py: gemv_q): no float copy of the weight, in float32."""
    from hotneurons.kernels.cold_q import gemv_q

    rows = w.data.numpy()  # (n, row bytes) uint8, the file's blocks (a view)
    y = torch.empty((x2.shape[0], w.shape[0]), dtype=torch.float32)  # (m, n)
    for t in range(x2.shape[0]):
        gemv_q(x2[t].float().contiguous().numpy(), rows, y[t].numpy(), w.fmt.value)
    if bias is not None:
        y += bias.float()
    if add:
        out2 += y.to(out2.dtype)
    else:
        out2.copy_(y)


def _gemv_rows() -> int:
    from hotneurons.kernels.qgemv import GEMV_MAX_ROWS

    return GEMV_MAX_ROWS


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., k) @ w.T (+ bias) -> (..., n) in x's dtype, into `out` (..., n) where given (returned)."""
    if out is None:
        out = x.new_empty((*x.shape[:-1], shape_of(w)[0]))
    return _apply(x, w, bias, out, add=False)


def add_linear(h: torch.Tensor, x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> None:
    """h (..., n) += x (..., k) @ w.T + bias, in h's memory (as ops.add_linear: without a bias rounded once, with
    one the linear rounded first). h is x's dtype."""
    _apply(x, w, bias, h, add=True)


def linear_rows(x: torch.Tensor, w: Weight, rows: torch.Tensor, out_rows: int, per_slot: bool = False) -> torch.Tensor:
    """Slices of w picked by index (a mixture's routed experts in their stack): the r = len(rows) slices of out_rows
    rows [rows[i] * out_rows, ...) of w, stacked, times x (m, k) -> (m, r * out_rows); per_slot: slice i times x's
    row i (x (r, k)) -> (1, r * out_rows). The GEMV reads the slices in place (a GpuQ on the kernels); otherwise they
    are gathered first (the reference)."""
    r = len(rows)
    if isinstance(w, GpuQ) and _on_kernels(x) and (per_slot or x.shape[0] <= _gemv_rows()):
        from hotneurons.kernels import qgemv, qgemv_k

        out = x.new_empty((1 if per_slot else x.shape[0], r * out_rows))
        if w.kquant:
            return qgemv_k.gemv(x.contiguous(), w, None, out, rows=rows, out_rows=out_rows, x_slot=per_slot)
        return qgemv.gemv(x.contiguous(), w.qs, w.scales, w.q4, None, out, mins=w.mins, rows=rows,
                          out_rows=out_rows, x_slot=per_slot)
    idx = (rows[:, None] * out_rows + torch.arange(out_rows, device=rows.device)).reshape(-1)  # (r * out_rows,)
    g = w.rows(idx) if isinstance(w, (GpuQ, QTensor)) else w.index_select(0, idx)
    if not per_slot:
        return linear(x, g)
    y = linear(x, g).reshape(r, r, out_rows)  # (x row, slice, out)
    return torch.diagonal(y, dim1=0, dim2=1).T.reshape(1, r * out_rows)  # each slice with its own row
