"""llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K: 256 weights) <-> the tensors kernels/qgemv_k.py reads, in torch.

`to_gpu` splits a chunk of a file's blocks into the fields below, `to_file` puts them back byte for byte; both run on
the chunk's device (qlinear.pack copies the file's bytes to the GPU a chunk at a time and splits them there). Every
field but `qs` is stored row-innermost ((n, ...) viewed from a contiguous (..., n): consecutive rows side by side,
as GpuQ's block-major scales), so that a GEMV thread's rows load as one wide access. A unit is 32 weights (a Q4_K /
Q5_K sub-block, two Q6_K sub-blocks of 16); a block is 8 units.

  qs     (n, k/2) uint8, row-major: each unit's 16 bytes of low nibbles as 4 int32 words, word i nibble t (bits 4t..)
         = q & 15 of weight 4 t + i of the unit (Q4_0's kernel order, kernels/qgemv.py)
  scales (n, k/256) fp16: d        mins (Q4_K, Q5_K) (n, k/256) fp16: dmin
  sub    Q4_K, Q5_K: (n, k/256, 3) int32, a block's 12 bytes of 6-bit scales and mins repacked as 8 fields of 12 bits,
         field j = sc_j | m_j << 6 at bit 12 j of the 96-bit little-endian number (a GEMV thread's one field from two
         adjacent words by one funnel shift); Q6_K: (n, k/32) int16, a unit's two int8 scales (the file's, in order)
  qh     Q5_K: (n, k/32, 1) int32, a unit's 32 fifth bits; Q6_K: (n, k/32, 2) int32, a unit's 64 top-two bits; each
         placed where the GEMV merges them into its B words (below) with one LOP3 a word half
so a Q4_K row holds k/2 + k/256 (2 + 2 + 12) bytes, a Q5_K row k/8 more, a Q6_K row k/2 + k/4 + k/256 (2 + 16): the
file's 144, 176 and 210 bytes a block.

B words (Q5_K, Q6_K): word i of a unit (L, its nibbles) becomes two words of byte-wide fields, B0 = sel(L, G0) and
B1 = sel(L >> 4, G1), sel(a, b) = (a & 0x0F0F0F0F) | (b & 0xF0F0F0F0), G0 / G1 the unit's high-bit word shifted by a
constant: byte c of Bh is weight 8 c + 4 h + i of the unit, its low nibble the weight's, its bit 4 (Q5_K) or bits 4-5
(Q6_K) the weight's high bits; bits above are other weights' (the GEMV masks them off). The high bits of weight
8 c + 4 h + i sit at, within byte c of:
  Q5_K  the unit's word: bit 4 + k for k = 2 i + h < 4, bit k - 4 for k >= 4 (Bh: that word >> k | << 8 - k)
  Q6_K  word i // 2: bits 4 + 2 h (i even: Bh takes the word >> 2 h) | 2 h (i odd: << 4 - 2 h)
"""

from __future__ import annotations

import torch
from hotneurons.weights.formats import WeightFormat, spec

K_FORMATS = (WeightFormat.Q4_K, WeightFormat.Q5_K, WeightFormat.Q6_K)
K_KIND = {f: i for i, f in enumerate(K_FORMATS)}  # the kernels' format codes (qgemv_k's FMT)
QK = spec(WeightFormat.Q4_K).block  # weights a block (256, every K-quant's)
UNIT = 32  # weights a unit
HEAD = {WeightFormat.Q4_K: 16, WeightFormat.Q5_K: 48}  # bytes before the nibbles: d, dmin, 12 scale bytes (, qh)
HIGH_WORDS = {WeightFormat.Q4_K: 0, WeightFormat.Q5_K: 1, WeightFormat.Q6_K: 2}  # qh words a unit


def _bits_at() -> tuple[torch.Tensor, torch.Tensor]:
    """(32,) bit positions of each weight's high bits in its unit's qh word (Q5_K) and (Q6_K, with word i // 2)."""
    w = torch.arange(UNIT)
    i, h, c = w % 4, (w // 4) % 2, w // 8  # weight 8 c + 4 h + i
    k = 2 * i + h
    q5 = 8 * c + torch.where(k < 4, 4 + k, k - 4)
    q6 = 8 * c + 2 * h + torch.where(i % 2 == 0, 4, 0)
    return q5, q6


Q5_BIT, Q6_BIT = _bits_at()  # (32,) each
Q6_WORD = torch.arange(UNIT) % 4 // 2  # (32,) the qh word of each weight of a Q6_K unit


def _nibble_words(v: torch.Tensor) -> torch.Tensor:
    """(..., 32) values (their low nibbles) -> (..., 16) uint8 in the kernel order: byte 4 i + c holds weights 8 c + i
    (low nibble) and 8 c + 4 + i (high)."""
    v = (v & 15).to(torch.uint8).reshape(*v.shape[:-1], 4, 2, 4)  # (.., c, h, i)
    return (v[..., 0, :] | (v[..., 1, :] << 4)).transpose(-1, -2).reshape(*v.shape[:-3], 16)  # (.., i, c)


def _nibble_values(b: torch.Tensor) -> torch.Tensor:
    """_nibble_words' inverse: (..., 16) uint8 -> (..., 32) uint8 nibbles in weight order."""
    t = b.reshape(*b.shape[:-1], 4, 4).transpose(-1, -2)  # (.., c, i)
    return torch.stack([t & 15, t >> 4], dim=-2).reshape(*b.shape[:-1], UNIT)  # (.., c, h, i)


def _words(bits: torch.Tensor) -> torch.Tensor:
    """(...) int64 values of 0..2^32 - 1 -> int32 of the same bits."""
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)


def _gather_bits(v: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """(..., 32) uint8 small values -> (...) int32: the sum of v << at (their bits disjoint: no carries, so int32's
    wrap-around gives the bits; 8 bytes of temporaries a value, not int64's 16 and more)."""
    return (v.to(torch.int32) << at.to(v.device, torch.int32)).sum(dim=-1, dtype=torch.int32)


def _k_scale_fields(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, nb, 12) uint8 scale bytes -> sc, m (rows, nb, 8) int64 (ggml's get_scale_min_k4)."""
    s = s.to(torch.int64)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_scale_bytes(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """_k_scale_fields' inverse: (rows, nb, 8) int64 each -> (rows, nb, 12) uint8."""
    lo = torch.cat([(sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6),
                    (mn[..., :4] & 0x3F) | ((mn[..., 4:] >> 4) << 6),
                    (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)], dim=-1)
    return lo.to(torch.uint8)


def _pack_fields(f: torch.Tensor) -> torch.Tensor:
    """(rows, nb, 8) int64 12-bit fields -> (rows, nb, 3) int32: field j at bit 12 j of 96 bits."""
    words = [torch.zeros_like(f[..., 0]) for _ in range(3)]
    for j in range(8):
        w, sh = divmod(12 * j, 32)
        words[w] |= (f[..., j] << sh) & 0xFFFFFFFF
        if sh > 20:  # straddles into the next word
            words[w + 1] |= f[..., j] >> (32 - sh)
    return _words(torch.stack(words, dim=-1))


def _unpack_fields(words: torch.Tensor) -> torch.Tensor:
    """_pack_fields' inverse: (rows, nb, 3) int32 -> (rows, nb, 8) int64."""
    u = words.to(torch.int64) & 0xFFFFFFFF
    out = []
    for j in range(8):
        w, sh = divmod(12 * j, 32)
        v = u[..., w] >> sh
        if sh > 20:
            v = v | (u[..., w + 1] << (32 - sh))
        out.append(v & 0xFFF)
    return torch.stack(out, dim=-1)


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """(rows, nb, block bytes) uint8 -> the fp16 at byte `at` of each block, (rows, nb)."""
    return b[..., at:at + 2].contiguous().view(torch.float16).squeeze(-1)


def to_gpu(blocks: torch.Tensor, fmt: WeightFormat) -> dict[str, torch.Tensor]:
    """(rows, nb, block bytes) uint8 file blocks -> the GPU fields (module docstring) of those rows, each contiguous
    row-major ((rows, ...)): qs (rows, nb * 128) uint8, scales, mins (rows, nb) fp16, sub, qh (None where the format
    has none)."""
    rows, nb, _ = blocks.shape
    if fmt == WeightFormat.Q6_K:
        ql, qh = blocks[..., :128], blocks[..., 128:192]  # (rows, nb, 128), (rows, nb, 64) uint8
        low = torch.stack([ql.reshape(rows, nb, 2, 64) & 15, ql.reshape(rows, nb, 2, 64) >> 4], dim=2)  # (.., s, h, b)
        low = low.permute(0, 1, 3, 2, 4).reshape(rows, nb * 8, UNIT)  # (rows, units, 32): weight 128 h + 64 s + b
        high = torch.stack([(qh.reshape(rows, nb, 2, 32) >> (2 * t)) & 3 for t in range(4)], dim=3)  # (.., h, t, l)
        high = high.reshape(rows, nb * 8, UNIT)  # weight 128 h + 32 t + l
        words = torch.stack([_gather_bits(torch.where(Q6_WORD.to(high.device) == e, high, 0), Q6_BIT)
                             for e in (0, 1)], dim=-1)  # (rows, units, 2)
        sub = blocks[..., 192:208].contiguous().view(torch.int16).reshape(rows, nb * 8)  # (rows, units)
        return {"qs": _nibble_words(low).reshape(rows, nb * 128), "scales": _f16(blocks, 208), "mins": None,
                "sub": sub, "qh": words}
    head = HEAD[fmt]
    qs = blocks[..., head:].reshape(rows, nb, 4, 32)  # (rows, nb, pair, 32): sub-blocks 2 p (low), 2 p + 1 (high)
    v = torch.stack([qs & 15, qs >> 4], dim=3).reshape(rows, nb * 8, UNIT)  # (rows, units, 32) nibbles
    sc, mn = _k_scale_fields(blocks[..., 4:16])
    out = {"qs": _nibble_words(v).reshape(rows, nb * 128), "scales": _f16(blocks, 0), "mins": _f16(blocks, 2),
           "sub": _pack_fields(sc | (mn << 6)), "qh": None}
    if fmt == WeightFormat.Q5_K:
        qh = blocks[..., 16:48]  # (rows, nb, 32) uint8: bit j of byte l = sub-block j's weight l
        high = torch.stack([(qh >> j) & 1 for j in range(8)], dim=2).reshape(rows, nb * 8, UNIT)  # (rows, units, 32)
        out["qh"] = _gather_bits(high, Q5_BIT).unsqueeze(-1)  # (rows, units, 1)
    return out


def to_file(qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, sub: torch.Tensor,
            qh: torch.Tensor | None, fmt: WeightFormat) -> torch.Tensor:
    """to_gpu's inverse: the GPU fields of some rows (any strides) -> (rows, nb, block bytes) uint8 file blocks."""
    rows, nb = scales.shape
    low = _nibble_values(qs.reshape(rows, nb * 8, 16)).to(torch.int64)  # (rows, units, 32)
    # reshape(-1) lays the fp16 values out row-major (a copy where the rows are a block-major slice); .contiguous()
    # would keep a one-block slice's (1, n) stride, which a view as bytes refuses
    f16 = [t.reshape(-1).view(torch.uint8).reshape(rows, nb, 2) for t in (scales, mins) if t is not None]
    if fmt == WeightFormat.Q6_K:
        words = qh.to(torch.int64) & 0xFFFFFFFF  # (rows, units, 2)
        high = (words.gather(2, Q6_WORD.to(qh.device).expand(rows, nb * 8, UNIT)) >> Q6_BIT.to(qh.device)) & 3
        high = high.reshape(rows, nb, 2, 4, 32)  # (.., h, t, l): weight 128 h + 32 t + l
        qhb = sum(high[:, :, :, t] << (2 * t) for t in range(4)).reshape(rows, nb, 64)
        low = low.reshape(rows, nb, 2, 2, 2, 32)  # (.., h, s, b // 32, l): weight 128 h + 64 s + b
        ql = (low[:, :, :, 0] | (low[:, :, :, 1] << 4)).reshape(rows, nb, 128)  # byte 64 h + b
        sc = sub.contiguous().view(torch.uint8).reshape(rows, nb, 16)
        return torch.cat([ql.to(torch.uint8), qhb.to(torch.uint8), sc, f16[0]], dim=-1)  # (rows, nb, 210)
    v = low.reshape(rows, nb, 4, 2, 32)  # (.., pair, low | high, 32)
    quants = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).reshape(rows, nb, 128).to(torch.uint8)
    f = _unpack_fields(sub.reshape(rows, nb, 3))
    parts = [*f16, _k_scale_bytes(f & 0x3F, f >> 6)]
    if fmt == WeightFormat.Q5_K:
        hb = (qh.reshape(rows, nb * 8, 1).to(torch.int64) & 0xFFFFFFFF) >> Q5_BIT.to(qh.device) & 1  # (.., units, 32)
        hb = hb.reshape(rows, nb, 8, 32)
        parts.append(sum(hb[:, :, j] << j for j in range(8)).to(torch.uint8))  # (rows, nb, 32)
    return torch.cat([*parts, quants], dim=-1)


FIELDS = ("qs", "scales", "mins", "sub", "qh")


def pack(data: torch.Tensor, fmt: WeightFormat, shape: tuple[int, int], device: torch.device | str,
         chunk_bytes: int) -> dict[str, torch.Tensor | None]:
    """A file's rows (n, row bytes) uint8, any device -> the fields on `device`, allocated once (row-innermost but qs):
    a quarter of chunk_bytes of the file at a time to the device, split there (to_gpu), so the temporaries stay a
    chunk's (to_gpu's take 7 (Q4_K) to 20 (Q5_K) times its bytes)."""
    (n, k), bb = shape, spec(fmt).block_bytes
    fields = {f: None if v is None else (torch.empty(v[0], dtype=v[1], device=device) if f == "qs" else
                                         empty_rows_inner(v[0], v[1], device)) for f, v in shapes(fmt, n, k).items()}
    step = max(1, chunk_bytes // 4 // max(1, k // QK * bb))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        part = to_gpu(data[r0:r1].to(device).view(r1 - r0, k // QK, bb), fmt)  # the chunk's fields
        for f, t in fields.items():
            if t is not None:
                t[r0:r1].copy_(part[f])
    return fields


def checked(fields: dict[str, torch.Tensor | None], fmt: WeightFormat,
            shape: tuple[int, int]) -> dict[str, torch.Tensor | None]:
    """The fields if they have shapes' shapes and dtypes on one device, qs row-major, the rest made row-innermost
    (rows_inner); else a one-line error."""
    n, k = shape
    want = shapes(fmt, n, k) if k % QK == 0 else {}
    dev = fields["qs"].device
    ok = bool(want) and fields["qs"].stride(1) == 1 and all(
        (t is None) == (want[f] is None) and (t is None or (tuple(t.shape), t.dtype, t.device) == (*want[f], dev))
        for f, t in fields.items())
    if not ok:
        have = ", ".join(f"{f} {None if t is None else (tuple(t.shape), t.dtype)}" for f, t in fields.items())
        need = ", ".join(f"{f} {v}" for f, v in want.items()) or f"k a multiple of {QK}"
        raise ValueError(f"GpuQ {fmt.value} {shape}: got {have}; expected {need} on one device")
    return {f: t if f == "qs" else rows_inner(t) for f, t in fields.items()}


def rows_inner(t: torch.Tensor | None) -> torch.Tensor | None:
    """t (n, ...) with consecutive rows side by side (stride 1 along rows; a copy where they are not)."""
    if t is None or t.stride(0) == 1 or t.shape[0] <= 1:
        return t
    order = (*range(1, t.dim()), 0)
    return t.permute(order).contiguous().permute(t.dim() - 1, *range(t.dim() - 1))


def empty_rows_inner(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An empty (n, ...) tensor stored row-innermost."""
    return torch.empty((*shape[1:], shape[0]), dtype=dtype, device=device).permute(len(shape) - 1,
                                                                                   *range(len(shape) - 1))


def shapes(fmt: WeightFormat, n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype] | None]:
    """Each field's (shape, dtype) for an (n, k) weight (None: the format has none)."""
    nb, nu = k // QK, k // UNIT
    six = fmt == WeightFormat.Q6_K
    return {"qs": ((n, k // 2), torch.uint8), "scales": ((n, nb), torch.float16),
            "mins": None if six else ((n, nb), torch.float16),
            "sub": ((n, nu), torch.int16) if six else ((n, nb, 3), torch.int32),
            "qh": ((n, nu, HIGH_WORDS[fmt]), torch.int32) if HIGH_WORDS[fmt] else None}
