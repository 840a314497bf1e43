"""De-quantization of llama.cpp's non-linear formats in vectorised torch: IQ4_NL, IQ4_XS (16 non-uniform levels),
IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (8 or 4 weights per index into a grid of values, signs apart),
TQ1_0, TQ2_0 (ternary), MXFP4 and NVFP4 (4-bit floats): (n blocks, block bytes) uint8 -> (n, block) float32, on the
data's device.

The block layouts are ggml-common.h's; the grids, sign patterns and scale decodings are gguf-py's own tables
(gguf/quants.py), taken from it rather than typed again, and every product is taken in float32 in its order, so the
results equal gguf.quants.dequantize's exactly (tests/test_gguf_types.py). weights/quants.py dispatches here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch


@functools.lru_cache(maxsize=None)
def _grid(kind: str, device: torch.device) -> torch.Tensor:
    """gguf-py's grid of an IQ format: (entries, 8 or 4) float32 values (IQ2: 8, 25, 43; IQ3: odd steps; IQ1: -1..1)."""
    from gguf import quants

    cls = getattr(quants, kind)
    cls.init_grid()
    return torch.from_numpy(np.ascontiguousarray(cls.grid.reshape(cls.grid_shape))).to(device)


@functools.lru_cache(maxsize=None)
def _ksigns(device: torch.device) -> torch.Tensor:
    """(128, 8) float32 +-1: the signs of 8 weights by 7-bit index (the 8th makes the count of minuses even)."""
    from gguf import quants

    k = np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8)  # (128,)
    bits = (k[:, None] >> np.arange(8, dtype=np.uint8)) & 1  # (128, 8)
    return torch.from_numpy(np.where(bits == 0, 1, -1).astype(np.float32)).to(device)


@functools.lru_cache(maxsize=None)
def _byte_table(kind: str, device: torch.device) -> torch.Tensor:
    """(256,) float32: the scale each byte value stands for, by gguf-py's own decoding (MXFP4: e8m0 halved; NVFP4:
    unsigned e4m3 halved); (16,) the levels 4-bit indices name (e2m1 values doubled; IQ4_NL's non-uniform ones)."""
    from gguf import quants

    byte = np.arange(256, dtype=np.uint8)
    table = {"e8m0": lambda: quants.MXFP4.e8m0_to_fp32_half(byte), "ue4m3": lambda: quants.NVFP4.ue4m3_to_fp32(byte),
             "e2m1": lambda: np.array(quants.MXFP4.kvalues), "iq4": lambda: np.array(quants.IQ4_NL.kvalues)}[kind]()
    return torch.from_numpy(np.ascontiguousarray(table, dtype=np.float32)).to(device)


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of each block: (n, bytes) uint8 -> (n, 1) float32 (a copy: aligned)."""
    return b[:, at:at + 2].clone().view(torch.float16).float()


def _u16(b: torch.Tensor) -> torch.Tensor:
    """(..., 2k) uint8 -> (..., k) int64: little-endian uint16 values."""
    b = b.reshape(*b.shape[:-1], -1, 2).long()
    return b[..., 0] | (b[..., 1] << 8)


def _u32(b: torch.Tensor) -> torch.Tensor:
    """(..., 4k) uint8 -> (..., k) int64: little-endian uint32 values."""
    b = b.reshape(*b.shape[:-1], -1, 4).long()
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _bits(b: torch.Tensor) -> torch.Tensor:
    """(..., k) uint8 -> (..., k, 8): bit j of each byte, lowest first."""
    return torch.stack([(b >> j) & 1 for j in range(8)], dim=-1)


def _signs(bits: torch.Tensor) -> torch.Tensor:
    return 1.0 - 2.0 * bits.float()  # a set bit: minus


def _shifted(v: torch.Tensor, shifts: tuple[int, ...], mask: int, dim: int = -1) -> torch.Tensor:
    """(..., k) -> (..., k, len(shifts)) (dim=-1), or (..., len(shifts), k) (dim=-2): (v >> s) & mask for each
    shift."""
    return torch.stack([(v >> s) & mask for s in shifts], dim=dim)


def _nibble_scales(s: torch.Tensor) -> torch.Tensor:
    """(n, k) bytes -> (n, 2k) 4-bit scales: byte j's low nibble, then its high one."""
    return torch.stack([s & 0x0F, s >> 4], dim=2).reshape(s.shape[0], -1)


def _deq_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    # fp16 d, 16 bytes of 4-bit indices (weight j low nibble of byte j, weight 16 + j its high nibble); w = d * level
    n, dev = b.shape[0], b.device
    q = _shifted(b[:, 2:18], (0, 4), 0x0F, dim=-2).reshape(n, 32)
    return _f16(b, 0) * _byte_table("iq4", dev)[q.long()]


def _deq_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    # fp16 d, a uint16 of the 8 scales' top 2 bits, 4 bytes of their low nibbles, 128 bytes: per sub-block of 32, 16
    # bytes of indices (low nibbles, then high); w = d * (scale - 32) * level
    n, dev = b.shape[0], b.device
    high = _shifted(_u16(b[:, 2:4]), tuple(range(0, 16, 2)), 3).reshape(n, 8)  # (n, 8)
    scale = (_nibble_scales(b[:, 4:8]).long() | (high << 4)) - 32  # (n, 8) in -32..31
    dl = (_f16(b, 0) * scale.float()).reshape(n, 8, 1)  # (n, 8, 1)
    q = _shifted(b[:, 8:136].reshape(n, 8, 16), (0, 4), 0x0F, dim=-2).reshape(n, 8, 32)
    return (dl * _byte_table("iq4", dev)[q.long()]).reshape(n, 256)


def _deq_iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    # fp16 d, then per sub-block of 32 8 bytes: 4 grid indices (8 weights each), a uint32 of 4 7-bit sign indices
    # and a 4-bit scale on top; w = d * (0.5 + s) / 4 * grid * sign
    n, dev = b.shape[0], b.device
    q = b[:, 2:].reshape(n, 8, 8)  # (n, 8 sub-blocks, 8 bytes)
    aux = _u32(q[:, :, 4:])[..., 0]  # (n, 8)
    db = (_f16(b, 0) * (0.5 + (aux >> 28).float()) * 0.25).reshape(n, 8, 1, 1)
    signs = _ksigns(dev)[_shifted(aux, (0, 7, 14, 21), 0x7F)]  # (n, 8, 4, 8)
    grid = _grid("IQ2_XXS", dev)[q[:, :, :4].long()]  # (n, 8, 4, 8)
    return (db * grid * signs).reshape(n, 256)


def _deq_iq2_xs(b: torch.Tensor) -> torch.Tensor:
    # fp16 d, 32 uint16 (9-bit grid index, 7-bit sign index: 8 weights each), 8 bytes of 4-bit scales (one per 16)
    n, dev = b.shape[0], b.device
    qs = _u16(b[:, 2:66])  # (n, 32)
    db = (_f16(b, 0) * (0.5 + _nibble_scales(b[:, 66:74]).float()) * 0.25).reshape(n, 16, 1, 1)
    signs = _ksigns(dev)[qs >> 9].reshape(n, 16, 2, 8)
    grid = _grid("IQ2_XS", dev)[qs & 511].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, 256)


def _deq_iq2_s(b: torch.Tensor) -> torch.Tensor:
    # fp16 d, 32 bytes of grid indices' low 8 bits, 32 bytes of sign bits, 8 bytes of their top 2 bits, 8 bytes of
    # 4-bit scales (one per 16)
    n, dev = b.shape[0], b.device
    db = (_f16(b, 0) * (0.5 + _nibble_scales(b[:, 74:82]).float()) * 0.25).reshape(n, 16, 1, 1)
    signs = _signs(_bits(b[:, 34:66])).reshape(n, 16, 2, 8)
    high = _shifted(b[:, 66:74], (0, 2, 4, 6), 3).reshape(n, 32).long()  # (n, 32)
    grid = _grid("IQ2_S", dev)[b[:, 2:34].long() | (high << 8)].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, 256)


def _deq_iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    # fp16 d, 64 bytes of grid indices (4 weights each), per sub-block of 32 a uint32 as IQ2_XXS's; w = d * (0.5 + s)
    # / 2 * grid * sign
    n, dev = b.shape[0], b.device
    aux = _u32(b[:, 66:98])  # (n, 8)
    db = (_f16(b, 0) * (0.5 + (aux >> 28).float()) * 0.5).reshape(n, 8, 1, 1)
    signs = _ksigns(dev)[_shifted(aux, (0, 7, 14, 21), 0x7F)]  # (n, 8, 4, 8)
    grid = _grid("IQ3_XXS", dev)[b[:, 2:66].long()].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, 256)


def _deq_iq3_s(b: torch.Tensor) -> torch.Tensor:
    # fp16 d, 64 bytes of grid indices' low 8 bits, 8 bytes of their 9th bits, 32 bytes of sign bits, 4 bytes of
    # 4-bit scales (one per 32); w = d * (1 + 2 s) * grid * sign
    n, dev = b.shape[0], b.device
    db = (_f16(b, 0) * (1 + 2 * _nibble_scales(b[:, 106:110])).float()).reshape(n, 8, 1, 1)
    signs = _signs(_bits(b[:, 74:106])).reshape(n, 8, 4, 8)
    high = _bits(b[:, 66:74]).reshape(n, 64).long()  # (n, 64)
    grid = _grid("IQ3_S", dev)[b[:, 2:66].long() | (high << 8)].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, 256)


def _deq_iq1_s(b: torch.Tensor) -> torch.Tensor:
    # fp16 d, 32 bytes of grid indices' low 8 bits, per sub-block of 32 a uint16: 4 x 3 high index bits, a 3-bit
    # scale, the sign of the shift; w = d * (2 s + 1) * (grid + shift), shift +-1/8
    n, dev = b.shape[0], b.device
    qh = _u16(b[:, 34:50])  # (n, 8)
    dl = (_f16(b, 0) * (2 * ((qh >> 12) & 7) + 1).float()).reshape(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, 0.125, -0.125).float().reshape(n, 8, 1, 1)
    idx = b[:, 2:34].long() | (_shifted(qh, (0, 3, 6, 9), 7).reshape(n, 32) << 8)  # (n, 32)
    grid = _grid("IQ1_S", dev)[idx].reshape(n, 8, 4, 8)
    return (dl * (grid + delta)).reshape(n, 256)


def _deq_iq1_m(b: torch.Tensor) -> torch.Tensor:
    # 32 bytes of grid indices' low 8 bits, 16 bytes: per 8 weights 3 high index bits and the shift's sign, then 4
    # uint16 of 3-bit scales (one per 16) whose top nibbles together are the fp16 d
    n, dev = b.shape[0], b.device
    sc = _u16(b[:, 48:56])  # (n, 4)
    d_bits = ((sc[:, 0] & 0xF000) >> 12) | ((sc[:, 1] & 0xF000) >> 8) | ((sc[:, 2] & 0xF000) >> 4) | (sc[:, 3] & 0xF000)
    d = torch.stack([d_bits & 0xFF, d_bits >> 8], dim=1).to(torch.uint8).view(torch.float16).float()  # (n, 1)
    dl = (d * (2 * _shifted(sc, (0, 3, 6, 9), 7).reshape(n, 16) + 1).float()).reshape(n, 8, 2, 1, 1)
    qh = _shifted(b[:, 32:48], (0, 4), 0x0F).reshape(n, 32)  # (n, 32): per 8 weights 4 bits
    delta = torch.where((qh & 0x08) == 0, 0.125, -0.125).float().reshape(n, 8, 2, 2, 1)
    grid = _grid("IQ1_M", dev)[b[:, :32].long() | ((qh & 7).long() << 8)].reshape(n, 8, 2, 2, 8)
    return (dl * (grid + delta)).reshape(n, 256)


_POW3 = (1, 3, 9, 27, 81)


def _deq_tq1_0(b: torch.Tensor) -> torch.Tensor:
    # 48 bytes of 5 trits each, 4 bytes of 4 trits each, fp16 d: trit k of byte x is the top of (x * 3^k mod 256) * 3
    n = b.shape[0]
    pow3 = torch.tensor(_POW3, dtype=torch.uint8, device=b.device)
    parts = [(b[:, :32].unsqueeze(1) * pow3.view(1, 5, 1)).reshape(n, 160),  # uint8 products wrap mod 256
             (b[:, 32:48].unsqueeze(1) * pow3.view(1, 5, 1)).reshape(n, 80),
             (b[:, 48:52].unsqueeze(1) * pow3[:4].view(1, 4, 1)).reshape(n, 16)]
    q = ((torch.cat(parts, dim=1).long() * 3) >> 8) - 1  # (n, 256) in -1..1
    return _f16(b, 52) * q.float()


def _deq_tq2_0(b: torch.Tensor) -> torch.Tensor:
    # 64 bytes of 2-bit values (per half of 128: weight 32 s + j in bits 2 s of byte j), fp16 d; w = d * (q - 1)
    n = b.shape[0]
    q = _shifted(b[:, :64].reshape(n, 2, 32), (0, 2, 4, 6), 3, dim=-2).reshape(n, 256)
    return _f16(b, 64) * (q.to(torch.int8) - 1).float()


def _deq_mxfp4(b: torch.Tensor) -> torch.Tensor:
    # an e8m0 scale byte, 16 bytes of e2m1 indices (weight j low nibble of byte j, weight 16 + j its high nibble)
    n, dev = b.shape[0], b.device
    d = _byte_table("e8m0", dev)[b[:, 0].long()].unsqueeze(1)  # (n, 1)
    q = _shifted(b[:, 1:17], (0, 4), 0x0F, dim=-2).reshape(n, 32)
    return d * _byte_table("e2m1", dev)[q.long()]


def _deq_nvfp4(b: torch.Tensor) -> torch.Tensor:
    # 4 ue4m3 scale bytes (one per 16 weights), 32 bytes: per 16 weights 8 bytes, weights 0-7 low nibbles, 8-15 high
    n, dev = b.shape[0], b.device
    d = _byte_table("ue4m3", dev)[b[:, :4].long()].reshape(n, 4, 1)
    q = _shifted(b[:, 4:36].reshape(n, 4, 8), (0, 4), 0x0F, dim=-2).reshape(n, 4, 16)
    return (d * _byte_table("e2m1", dev)[q.long()]).reshape(n, 64)


DEQUANT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "iq4_nl": _deq_iq4_nl, "iq4_xs": _deq_iq4_xs,
    "iq2_xxs": _deq_iq2_xxs, "iq2_xs": _deq_iq2_xs, "iq2_s": _deq_iq2_s, "iq3_xxs": _deq_iq3_xxs,
    "iq3_s": _deq_iq3_s, "iq1_s": _deq_iq1_s, "iq1_m": _deq_iq1_m, "tq1_0": _deq_tq1_0, "tq2_0": _deq_tq2_0,
    "mxfp4": _deq_mxfp4, "nvfp4": _deq_nvfp4,
}
