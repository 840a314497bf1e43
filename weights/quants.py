"""Rows of llama.cpp blocks <-> float32, in vectorised torch on the data's device (CPU or CUDA, no numpy round trip).

Every GGUF tensor type gguf-py de-quantizes is de-quantized here (the lattice and small-float ones in
weights/quants_iq.py); quantization writes the formats the kernels read (f32, f16, bf16, q8_0, q4_0, q4_1), and
weights/qtensor.convert turns rows of one format into another with them, a chunk at a time (a type no kernel reads
into its nearest, weights/formats.py).

The block layouts are ggml-common.h's, byte for byte (gguf-py's gguf/quants.py writes the same in numpy, and the tests
hold these functions to it bit for bit). Every product and sum is taken in float32 in gguf-py's order, as separate torch
ops (no fused multiply-add), so the results are the reference's exactly, not merely close.

Big inputs go in chunks of rows (`_CHUNK_FLOATS` float32 values of output at a time), so the temporaries stay bounded
however large the tensor; the result itself is allocated once. Q4_0, Q8_0, Q4_1 (and the K-quants' de-quantization) on
the CPU take Numba kernels of the same arithmetic instead (weights/quants_cpu.py: one pass over a chunk, equal bytes
and floats).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from hotneurons.weights import quants_iq
from hotneurons.weights.formats import FORMATS, WeightFormat, row_bytes, weight_format

_CHUNK_FLOATS = 1 << 24  # float32 values per chunk: 64 MB of output; the temporaries are a few times that
# Q4_0 / Q8_0 / Q4_1 (and the K-quants' de-quantization) on the CPU go through weights/quants_cpu.py's Numba kernels:
# the same bytes and floats in one pass over the data instead of torch's ten or more (a CPU load of a 4-bit GGUF
# spends most of its time here). False: torch's kernels everywhere (the tests hold the two to each other)
CPU_KERNELS = True
CPU_FORMATS = (WeightFormat.Q4_0, WeightFormat.Q8_0, WeightFormat.Q4_1)  # quantized and de-quantized there
CPU_READS = CPU_FORMATS + (WeightFormat.Q4_K, WeightFormat.Q5_K, WeightFormat.Q6_K)  # de-quantized there


def fp16_bits_to_f32(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 little-endian fp16 bit patterns -> (...) float32 (exact: every fp16 is a float32)."""
    return _reinterpret(b, torch.float16)[..., 0].float()


def _reinterpret(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., k * itemsize) uint8 -> (..., k) dtype, the same bytes. A copy when the bytes are strided or misaligned
    for `dtype` (a slice of a block, a view at an odd offset), a view otherwise."""
    b = b.contiguous()
    if b.data_ptr() % dtype.itemsize:
        b = b.clone()
    return b.view(dtype)


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of each block: (n, block bytes) uint8 -> (n, 1) float32."""
    return fp16_bits_to_f32(b[:, at:at + 2]).unsqueeze(1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, k, m) bytes -> (n, k, 2, m): each group's low nibbles, then its high nibbles (ggml's order)."""
    return torch.stack([qs & 0x0F, qs >> 4], dim=2)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins (ggml's get_scale_min_k4) -> (n, 8) each, as float32.
    Bytes 0-3: scales 0-3 (low 6 bits), 4-7: mins 0-3; 8-11: low nibble scale 4+j, high nibble min 4+j, whose top
    two bits are the top bits of bytes j and 4+j."""
    s = s.reshape(-1, 3, 4)  # (n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]  # (n, 4) each
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)  # (n, 8)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)  # (n, 8)
    return sc.float(), mn.float()


# ---- de-quantization: (n blocks, block bytes) uint8 -> (n, block) float32 ----

def _deq_f32(b: torch.Tensor) -> torch.Tensor:
    return _reinterpret(b, torch.float32)  # (n, 1)


def _deq_f16(b: torch.Tensor) -> torch.Tensor:
    return _reinterpret(b, torch.float16).float()  # (n, 1)


def _deq_bf16(b: torch.Tensor) -> torch.Tensor:
    return _reinterpret(b, torch.bfloat16).float()  # (n, 1)


def _deq_q8_0(b: torch.Tensor) -> torch.Tensor:
    # 2 bytes fp16 d, 32 int8 q: w = q * d
    return b[:, 2:].view(torch.int8).float() * _f16(b, 0)  # (n, 32)


def _deq_q4_0(b: torch.Tensor) -> torch.Tensor:
    # 2 bytes fp16 d, 16 bytes: weight j in the low nibble of byte j, weight 16 + j in its high nibble; w = d * (q - 8)
    q = _nibbles(b[:, 2:].unsqueeze(1)).reshape(-1, 32)  # (n, 32) uint8
    return _f16(b, 0) * (q.to(torch.int8) - 8).float()  # (n, 32)


def _deq_q4_1(b: torch.Tensor) -> torch.Tensor:
    # fp16 d, fp16 m, 16 bytes as Q4_0's; w = d * q + m
    q = _nibbles(b[:, 4:].unsqueeze(1)).reshape(-1, 32).float()  # (n, 32)
    return _f16(b, 0) * q + _f16(b, 2)


def _deq_q4_k(b: torch.Tensor) -> torch.Tensor:
    # fp16 d, fp16 dmin, 12 bytes of scales/mins, 128 bytes: 4 groups of 32 bytes, each two sub-blocks of 32 (low
    # nibbles, then high); sub-block i: w = d * sc_i * q - dmin * m_i
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])  # (n, 8) each
    d = (_f16(b, 0) * sc).reshape(n, 8, 1)  # (n, 8, 1)
    dm = (_f16(b, 2) * mn).reshape(n, 8, 1)  # (n, 8, 1)
    q = _nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).float()  # (n, 8, 32)
    return (d * q - dm).reshape(n, 256)


def _deq_q5_k(b: torch.Tensor) -> torch.Tensor:
    # Q4_K's header, then 32 bytes qh (bit i of byte j: the fifth bit of sub-block i's weight j), then Q4_K's 128 bytes
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])  # (n, 8) each
    d = (_f16(b, 0) * sc).reshape(n, 8, 1)  # (n, 8, 1)
    dm = (_f16(b, 2) * mn).reshape(n, 8, 1)  # (n, 8, 1)
    qh = b[:, 16:48]  # (n, 32)
    high = torch.stack([(qh >> i) & 1 for i in range(8)], dim=1)  # (n, 8, 32)
    low = _nibbles(b[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)  # (n, 8, 32)
    q = (low | (high << 4)).float()  # (n, 8, 32)
    return (d * q - dm).reshape(n, 256)


def _deq_q6_k(b: torch.Tensor) -> torch.Tensor:
    # 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales (one per 16 weights), fp16 d at byte 208.
    # Per half of 128 weights: ql's 64 bytes give weights 0-63 (low nibbles) and 64-127 (high); qh's 32 bytes give
    # the top bits of weights 32k + j in bits 2k, 2k+1 of byte j. w = d * scale * (q - 32)
    n = b.shape[0]
    low = _nibbles(b[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)  # (n, 8, 32)
    qh = b[:, 128:192].reshape(n, 2, 32)  # (n, 2, 32)
    high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2).reshape(n, 8, 32)  # (n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()  # (n, 16, 16)
    d = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).reshape(n, 16, 1)  # (n, 16, 1)
    return (d * q).reshape(n, 256)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) bytes of a little-endian uint32 -> (n, 32): its bit j, weight j's fifth bit, shifted to bit 4."""
    return torch.stack([(qh >> k) & 1 for k in range(8)], dim=2).reshape(-1, 32) << 4


def _deq_q5_0(b: torch.Tensor) -> torch.Tensor:
    # fp16 d, 4 bytes qh (bit j: weight j's fifth bit), 16 bytes as Q4_0's; w = d * (q - 16)
    q = _nibbles(b[:, 6:].unsqueeze(1)).reshape(-1, 32) | _fifth_bits(b[:, 2:6])  # (n, 32) uint8 0..31
    return _f16(b, 0) * (q.to(torch.int8) - 16).float()


def _deq_q5_1(b: torch.Tensor) -> torch.Tensor:
    # fp16 d, fp16 m, 4 bytes qh, 16 bytes as Q4_1's; w = d * q + m
    q = (_nibbles(b[:, 8:].unsqueeze(1)).reshape(-1, 32) | _fifth_bits(b[:, 4:8])).float()  # (n, 32)
    return _f16(b, 0) * q + _f16(b, 2)


def _deq_q8_k(b: torch.Tensor) -> torch.Tensor:
    # float32 d, 256 int8 q, 16 int16 sums; w = q * d
    return b[:, 4:260].view(torch.int8).float() * _reinterpret(b[:, :4], torch.float32)  # (n, 256)


def _deq_f64(b: torch.Tensor) -> torch.Tensor:
    return _reinterpret(b, torch.float64).float()  # (n, 1), rounded to nearest


def _deq_q2_k(b: torch.Tensor) -> torch.Tensor:
    # 16 bytes of scales (low nibble scale, high nibble min, one each per 16 weights), 64 bytes of 2-bit values (per
    # half of 128 weights, weight 32 s + j in bits 2 s, 2 s + 1 of byte j), fp16 d and dmin at 80 and 82;
    # w = d * scale * q - dmin * min
    n = b.shape[0]
    sc = b[:, :16]  # (n, 16)
    dl = (_f16(b, 80) * (sc & 0x0F).float()).reshape(n, 16, 1)  # (n, 16, 1)
    ml = (_f16(b, 82) * (sc >> 4).float()).reshape(n, 16, 1)  # (n, 16, 1)
    qs = b[:, 16:80].reshape(n, 2, 32)  # (n, 2, 32)
    q = torch.stack([(qs >> s) & 3 for s in (0, 2, 4, 6)], dim=2).reshape(n, 16, 16).float()  # (n, 16, 16)
    return (dl * q - ml).reshape(n, 256)


def _deq_q3_k(b: torch.Tensor) -> torch.Tensor:
    # 32 bytes hmask (bit k of byte j: weight 32 k + j's third bit, set meaning no offset), 64 bytes of low 2 bits
    # (as Q2_K's), 12 bytes of 6-bit scales (one per 16: low nibbles in bytes 0-7, top 2 bits in bytes 8-11), fp16 d
    # at 108; w = d * (scale - 32) * (q - 4 * !hbit)
    n = b.shape[0]
    s = b[:, 96:108]  # (n, 12)
    low = torch.cat([s[:, :8] & 0x0F, s[:, :8] >> 4], dim=1)  # (n, 16)
    high = torch.cat([(s[:, 8:] >> k) & 3 for k in (0, 2, 4, 6)], dim=1)  # (n, 16)
    dl = (_f16(b, 108) * ((low | (high << 4)).to(torch.int8) - 32).float()).reshape(n, 16, 1)  # (n, 16, 1)
    ql = b[:, 32:96].reshape(n, 2, 32)  # (n, 2, 32)
    ql = torch.stack([(ql >> k) & 3 for k in (0, 2, 4, 6)], dim=2).reshape(n, 16, 16)  # (n, 16, 16)
    hm = b[:, :32]  # (n, 32)
    qh = torch.stack([(hm >> k) & 1 for k in range(8)], dim=1).reshape(n, 16, 16) ^ 1  # (n, 16, 16)
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()  # (n, 16, 16) in -4..3
    return (dl * q).reshape(n, 256)


_DEQUANT: dict[WeightFormat, Callable[[torch.Tensor], torch.Tensor]] = {
    WeightFormat.F32: _deq_f32, WeightFormat.F16: _deq_f16, WeightFormat.BF16: _deq_bf16,
    WeightFormat.Q8_0: _deq_q8_0, WeightFormat.Q4_0: _deq_q4_0, WeightFormat.Q4_1: _deq_q4_1,
    WeightFormat.Q4_K: _deq_q4_k, WeightFormat.Q5_K: _deq_q5_k, WeightFormat.Q6_K: _deq_q6_k,
    WeightFormat.F64: _deq_f64, WeightFormat.Q5_0: _deq_q5_0, WeightFormat.Q5_1: _deq_q5_1,
    WeightFormat.Q8_K: _deq_q8_k, WeightFormat.Q2_K: _deq_q2_k, WeightFormat.Q3_K: _deq_q3_k,
    **{WeightFormat(k): f for k, f in quants_iq.DEQUANT.items() if WeightFormat(k) in FORMATS},
}


# ---- quantization: (n blocks, block) float32 -> (n, block bytes) uint8, llama.cpp's reference rounding ----

def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    # (n, 1) float32 -> (n, 2): round to nearest even, as numpy; flattened first, since a size-1 last dimension may
    # carry any stride (0 after some reductions), which a dtype view refuses
    return x.to(torch.float16).reshape(-1).view(torch.uint8).view(-1, 2)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """roundf: halves away from zero, computed as gguf-py's np_roundf (floor(|x| + 0.5) would round 0.49999997 up)."""
    a = x.abs()
    fl = torch.floor(a)
    return torch.sign(x) * (fl + torch.floor(2 * (a - fl)))


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)  # 0 for an all-zero block


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(n, 32) uint8 values 0..15 -> (n, 16): weight j low, weight 16 + j high."""
    q = q.reshape(-1, 2, 16)
    return q[:, 0] | (q[:, 1] << 4)


def _q_f32(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)  # (n, 1) -> (n, 4)


def _q_f16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).view(torch.uint8)  # (n, 1) -> (n, 2)


def _q_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.float().to(torch.bfloat16).view(torch.uint8)  # via float32, as gguf-py: round to nearest even


def _q_q8_0(x: torch.Tensor) -> torch.Tensor:
    d = x.abs().amax(dim=1, keepdim=True) / 127  # (n, 1)
    q = _round_half_away(x * _inverse(d)).to(torch.int8).view(torch.uint8)  # (n, 32)
    return torch.cat([_fp16_bytes(d), q], dim=1)  # (n, 34)


def _q_q4_0(x: torch.Tensor) -> torch.Tensor:
    # d = (the weight of largest magnitude, with its sign) / -8, so that weight maps to q = 0 exactly
    imax = x.abs().argmax(dim=1, keepdim=True)  # (n, 1): the first of ties, as numpy's argmax
    d = x.gather(1, imax) / -8  # (n, 1)
    q = torch.trunc(x * _inverse(d) + 8.5).clamp(0, 15).to(torch.uint8)  # (n, 32)
    return torch.cat([_fp16_bytes(d), _pack_nibbles(q)], dim=1)  # (n, 18)


def _q_q4_1(x: torch.Tensor) -> torch.Tensor:
    mx = x.amax(dim=1, keepdim=True)  # (n, 1)
    mn = x.amin(dim=1, keepdim=True)  # (n, 1)
    d = (mx - mn) / 15  # (n, 1)
    q = torch.trunc((x - mn) * _inverse(d) + 0.5).clamp(0, 15).to(torch.uint8)  # (n, 32)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(mn), _pack_nibbles(q)], dim=1)  # (n, 20)


_QUANT: dict[WeightFormat, Callable[[torch.Tensor], torch.Tensor]] = {
    WeightFormat.F32: _q_f32, WeightFormat.F16: _q_f16, WeightFormat.BF16: _q_bf16,
    WeightFormat.Q8_0: _q_q8_0, WeightFormat.Q4_0: _q_q4_0, WeightFormat.Q4_1: _q_q4_1,
}


def _format(fmt: str | WeightFormat, table: dict, verb: str) -> WeightFormat:
    fmt = weight_format(fmt)
    if fmt not in table:
        names = ", ".join(f.value for f in table)
        why = " (the runtime's int8 keeps its scales apart from the rows: runtime/cold_rows.py)" \
            if fmt is WeightFormat.INT8 else ""
        raise ValueError(f"cannot {verb} {fmt}{why}: choose one of {names}")
    return fmt


def _chunk_rows(cols: int) -> int:
    return max(1, _CHUNK_FLOATS // max(cols, 1))


def _on_cpu_kernels(t: torch.Tensor, fmt: WeightFormat, formats: tuple = CPU_FORMATS) -> bool:
    return CPU_KERNELS and fmt in formats and t.device.type == "cpu"


def _dequantize_cpu(chunk: torch.Tensor, fmt: WeightFormat, out: torch.Tensor) -> None:
    """A chunk (r, row bytes) of CPU_READS rows -> out (r, cols) float32 (C-contiguous), by quants_cpu."""
    from hotneurons.weights import quants_cpu

    blocks = chunk.contiguous().numpy().reshape(-1, FORMATS[fmt].block_bytes)  # (blocks, block bytes)
    quants_cpu.dequantize_q(blocks, fmt.value, out.numpy().reshape(-1, FORMATS[fmt].block))


def _quantize_cpu(chunk: torch.Tensor, fmt: WeightFormat, out: torch.Tensor) -> bool:
    """A chunk (r, cols) float32 -> out (r, row bytes) uint8 (C-contiguous) by quants_cpu; False where a block needs
    torch's kernel (non-finite weights, or scales too small to invert)."""
    from hotneurons.weights import quants_cpu

    x = chunk.detach().contiguous().numpy().reshape(-1, FORMATS[fmt].block)  # (blocks, 32)
    return quants_cpu.quantize_q(x, fmt.value, out.numpy().reshape(-1, FORMATS[fmt].block_bytes))


def dequantize(data: torch.Tensor, fmt: str | WeightFormat, cols: int) -> torch.Tensor:
    """Rows of `fmt` blocks -> float32 weights, on data's device.

    data: (rows, row_bytes(fmt, cols)) uint8, or one row (row_bytes,) uint8; returns (rows, cols) float32, or (cols,)
    for one row. Formats: every one of weights/formats.py but int8 (llama.cpp's block layouts)."""
    fmt = _format(fmt, _DEQUANT, "dequantize")
    rb = row_bytes(fmt, cols)
    if data.dtype != torch.uint8:
        raise ValueError(f"dequantize {fmt}: data is {data.dtype}, expected torch.uint8 bytes: pass the stored bytes "
                         f"(tensor.view(torch.uint8))")
    if data.dim() not in (1, 2) or data.shape[-1] != rb:
        raise ValueError(f"dequantize {fmt}: data is {tuple(data.shape)}, expected (rows, {rb}) uint8 for {cols} "
                         f"columns: pass whole rows of blocks, row_bytes({fmt}, {cols}) = {rb} bytes a row")
    one_row = data.dim() == 1
    data = data.reshape(1, rb) if one_row else data  # (rows, rb)
    rows = data.shape[0]
    spec, kernel = FORMATS[fmt], _DEQUANT[fmt]
    out = torch.empty((rows, cols), dtype=torch.float32, device=data.device)  # (rows, cols)
    step = _chunk_rows(cols)
    fast = _on_cpu_kernels(data, fmt, CPU_READS)
    for r0 in range(0, rows, step):
        chunk = data[r0:r0 + step]  # (r, rb)
        if fast:
            _dequantize_cpu(chunk, fmt, out[r0:r0 + step])
            continue
        blocks = chunk.reshape(-1, spec.block_bytes)  # (r * cols / block, block bytes)
        out[r0:r0 + step] = kernel(blocks).reshape(chunk.shape[0], cols)
    return out[0] if one_row else out


def quantize(w: torch.Tensor, fmt: str | WeightFormat) -> torch.Tensor:
    """Float weights -> rows of `fmt` blocks, on w's device, with llama.cpp's reference rounding (bit-identical to
    gguf.quants.quantize).

    w: (rows, cols) or one row (cols,), any float dtype, taken as float32 first as gguf-py does (so f16 of a float64 w
    is rounded twice, as torch's own .half() does, where numpy's astype rounds once). Returns (rows, row_bytes(fmt,
    cols)) uint8, or (row_bytes,). Formats: f32, f16, bf16, q8_0, q4_0, q4_1 (K-quants: llama.cpp's llama-quantize)."""
    fmt = _format(fmt, _QUANT, "quantize to")
    if not w.is_floating_point() or w.dim() not in (1, 2):
        raise ValueError(f"quantize to {fmt}: w is {tuple(w.shape)} {w.dtype}, expected a float (rows, cols) or "
                         f"(cols,) tensor")
    one_row = w.dim() == 1
    w = w.reshape(1, -1) if one_row else w  # (rows, cols)
    rows, cols = w.shape
    rb = row_bytes(fmt, cols)
    spec, kernel = FORMATS[fmt], _QUANT[fmt]
    out = torch.empty((rows, rb), dtype=torch.uint8, device=w.device)  # (rows, rb) bytes
    step = _chunk_rows(cols)
    fast = _on_cpu_kernels(w, fmt)
    for r0 in range(0, rows, step):
        chunk = w[r0:r0 + step].float()  # (r, cols)
        if fast and _quantize_cpu(chunk, fmt, out[r0:r0 + step]):
            continue
        blocks = chunk.reshape(-1, spec.block)  # (r * cols / block, block)
        out[r0:r0 + step] = kernel(blocks).reshape(chunk.shape[0], rb)
    return out[0] if one_row else out
