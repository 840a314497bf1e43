"""The weight formats the project reads and stores, and the one table of their sizes and kernels.

Every byte count in the project comes from here: pi-solve's memory model (solver/cost.py), the runtime's layouts and
the memory checks before a load. A format is a block of `block` weights stored in `block_bytes` bytes; a row of d
weights (d a multiple of `block`) takes d / block * block_bytes bytes. Float formats are blocks of one weight.

The GGUF formats are every tensor type gguf-py de-quantizes, with llama.cpp's block layouts byte for byte
(ggml-common.h), so rows of a GGUF file can be copied, or read in place, with no conversion; their block sizes are
gguf-py's own table (gguf.GGML_QUANT_SIZES), not typed again here. `int8` is the runtime's own: int8 weights with a
float32 scale per 64.

Per format, whether the runtime's kernels read it as stored (`cpu_kernel`: the Numba cold-row kernels and CPU GEMV;
`gpu_kernel`: the Triton GEMV), and `nearest`, the format a kernel reads that it becomes at load where the kernel of
the device it goes to does not read it (weights/quants.py de-quantizes every format; runtime/engine.py and
models/common.py convert a tensor at a time).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
from hotneurons.common.kinds import Kind, choose


class WeightFormat(Kind):
    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    INT8 = "int8"  # the runtime's cold rows: int8, a float32 scale per 64 weights (kept apart from the rows)
    Q8_0 = "q8_0"  # llama.cpp: 32 weights = fp16 scale + 32 int8
    Q4_0 = "q4_0"  # 32 weights = fp16 scale + 16 bytes of 4-bit values (w = scale * (q - 8))
    Q4_1 = "q4_1"  # 32 weights = fp16 scale, fp16 min + 16 bytes of 4-bit values (w = scale * q + min)
    Q4_K = "q4_k"  # 256 weights in 8 sub-blocks of 32, 6-bit scales and mins (Q4_K_M files mix it with Q6_K)
    Q5_K = "q5_k"
    Q6_K = "q6_k"
    F64 = "f64"
    Q5_0 = "q5_0"  # 32 weights = fp16 scale, 32 fifth bits, 16 bytes of nibbles (w = scale * (q - 16))
    Q5_1 = "q5_1"  # Q5_0's with an fp16 min (w = scale * q + min)
    Q2_K = "q2_k"  # 256 weights in 16 sub-blocks of 16, 2-bit values, 4-bit scales and mins
    Q3_K = "q3_k"  # 256 weights in 16 sub-blocks of 16, 3-bit values, 6-bit scales
    Q8_K = "q8_k"  # 256 weights = float32 scale, 256 int8, 16 int16 sums (llama.cpp's activations' format)
    IQ2_XXS = "iq2_xxs"  # the IQ formats: 8 weights per index into a lattice (grid) of values, signs apart
    IQ2_XS = "iq2_xs"
    IQ3_XXS = "iq3_xxs"
    IQ1_S = "iq1_s"
    IQ4_NL = "iq4_nl"  # 32 weights = fp16 scale + 16 bytes of 4-bit indices into 16 non-uniform levels
    IQ3_S = "iq3_s"
    IQ2_S = "iq2_s"
    IQ4_XS = "iq4_xs"  # IQ4_NL's levels, 256 weights with a 6-bit scale per 32
    IQ1_M = "iq1_m"
    TQ1_0 = "tq1_0"  # ternary (-1, 0, 1) times an fp16 scale, 5 weights a byte
    TQ2_0 = "tq2_0"  # ternary, 4 weights a byte
    MXFP4 = "mxfp4"  # 32 4-bit floats (e2m1) and a power-of-two scale (e8m0)
    NVFP4 = "nvfp4"  # 64 4-bit floats (e2m1) in 4 groups of 16, an fp8 (ue4m3) scale each


@dataclass(frozen=True)
class FormatSpec:
    block: int  # weights per block
    block_bytes: int  # bytes per block
    ggml_type: int | None  # gguf.GGMLQuantizationType value (None: not a GGUF type)
    # what the runtime's kernels read directly; other formats are converted on load (to --cold-dtype / --gpu-dtype)
    cpu_kernel: bool
    gpu_kernel: bool
    nearest: WeightFormat | None = None  # what it becomes where a kernel does not read it (None: itself)

    @property
    def bytes_per_weight(self) -> float:
        return self.block_bytes / self.block

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block


F = WeightFormat
# `nearest`: the format a type without a kernel becomes, chosen by its precision so that the conversion adds no more
# than a rounding step of the source's own grid (its bits per weight alone would not say: IQ4_XS is 4.25 bits of
# non-uniform levels, Q4_K 4.5 bits of even ones):
# - q4_1 for Q4_K: each of its sub-blocks of 32 is 16 evenly spaced levels (d * sc * q - dmin * m), q4_1's block
#   exactly, so its min/max rounding finds the same levels up to the fp16 rounding of scale and min (on weights
#   quantized the Q4_K way, it adds ~1% of Q4_K's own error, where q4_0's symmetric grid adds as much again);
# - q4_0 for the types of at most ~3.5 bits (Q2_K, Q3_K, IQ1-IQ3, TQ): q4_0's step (max |w| / 8 over 32 weights) is
#   at most their own, so re-rounding adds at most half a step of theirs, for the fewest bytes a kernel reads;
# - q8_0 for the rest: 5 bits and more (Q5_0, Q5_1, Q5_K, Q6_K, Q8_K), whose steps a 4-bit grid would widen
#   two- to four-fold, and the non-uniform 4-bit levels (IQ4_NL, IQ4_XS, MXFP4, NVFP4), which an evenly spaced
#   4-bit grid misses by up to a step of theirs; q8_0's 255 levels keep each within ~1/16 of its step;
# - f32 for F64 (no kernel reads float64; the tensors that come as F64 are small).
_NEAREST = {
    F.F64: F.F32, F.Q4_K: F.Q4_1, F.Q5_K: F.Q8_0, F.Q6_K: F.Q8_0, F.Q5_0: F.Q8_0, F.Q5_1: F.Q8_0, F.Q8_K: F.Q8_0,
    F.Q2_K: F.Q4_0, F.Q3_K: F.Q4_0, F.IQ1_S: F.Q4_0, F.IQ1_M: F.Q4_0, F.IQ2_XXS: F.Q4_0,
    F.IQ2_XS: F.Q4_0, F.IQ2_S: F.Q4_0, F.IQ3_XXS: F.Q4_0, F.IQ3_S: F.Q4_0, F.TQ1_0: F.Q4_0, F.TQ2_0: F.Q4_0,
    F.IQ4_NL: F.Q8_0, F.IQ4_XS: F.Q8_0, F.MXFP4: F.Q8_0, F.NVFP4: F.Q8_0,
}
# (cpu_kernel, gpu_kernel) of the formats some kernel reads as stored; every other GGUF type: (False, False)
_KERNELS = {F.F32: (False, True), F.F16: (False, True), F.BF16: (True, True), F.Q8_0: (True, True),
            F.Q4_0: (True, True), F.Q4_1: (True, True),
            F.Q4_K: (True, True), F.Q5_K: (True, True), F.Q6_K: (True, True)}


def _gguf_spec(fmt: WeightFormat) -> FormatSpec | None:
    """The table's row of a GGUF type, its block from gguf-py's table; None where the installed gguf-py lacks it."""
    t = getattr(gguf.GGMLQuantizationType, fmt.name, None)
    if t is None or t not in gguf.GGML_QUANT_SIZES:
        return None
    block, block_bytes = gguf.GGML_QUANT_SIZES[t]
    cpu, gpu = _KERNELS.get(fmt, (False, False))
    return FormatSpec(block, block_bytes, int(t), cpu_kernel=cpu, gpu_kernel=gpu, nearest=_NEAREST.get(fmt))


FORMATS: dict[WeightFormat, FormatSpec] = {
    f: s for f in F for s in [FormatSpec(64, 64 + 4, None, cpu_kernel=True, gpu_kernel=False)
                              if f is F.INT8 else _gguf_spec(f)] if s is not None}
# the hot rows' formats that the GPU kernels read: --gpu-dtype's choices (the cold rows': kernels/names.COLD_DTYPES, the
# formats marked cpu_kernel)
GPU_DTYPES = tuple(str(f) for f, s in FORMATS.items() if s.gpu_kernel)  # f32 f16 bf16 q8_0 q4_0 q4_1 q4_k q5_k q6_k
# The one place other spellings are read: a format's name is its value above (f16, not fp16 or float16), and these
# are what earlier versions, torch and HF wrote (pi-solve --dtype fp16, meta.json files, torch dtype names), accepted
# wherever weight_format parses a name
ALIASES = {"fp32": WeightFormat.F32, "fp16": WeightFormat.F16, "float32": WeightFormat.F32,
           "float16": WeightFormat.F16, "bfloat16": WeightFormat.BF16, "fp64": WeightFormat.F64,
           "float64": WeightFormat.F64}
# the float formats torch computes with on either device (a matrix in one needs no kernel of ours)
TORCH_FLOATS = (WeightFormat.F32, WeightFormat.F16, WeightFormat.BF16)


def weight_format(name: str | WeightFormat, error: type[Exception] = ValueError, param: str | None = None
                  ) -> WeightFormat:
    """A format by name (aliases: fp32, fp16, ...), else a one-line `error` listing the names."""
    if isinstance(name, WeightFormat):
        return name
    if isinstance(name, str) and name.lower() in ALIASES:
        return ALIASES[name.lower()]
    return choose(str(name).lower(), WeightFormat, "weight format", error, param)


def spec(fmt: str | WeightFormat) -> FormatSpec:
    fmt = weight_format(fmt)
    if fmt not in FORMATS:
        raise ValueError(f"weight format {fmt} is unknown to the installed gguf-py: upgrade it (pip install -U gguf)")
    return FORMATS[fmt]


def bytes_per_weight(fmt: str | WeightFormat) -> float:
    return spec(fmt).bytes_per_weight


def row_bytes(fmt: str | WeightFormat, d: int) -> int:
    """Bytes of one row of d weights; d must be a whole number of blocks."""
    s = spec(fmt)
    if d % s.block:
        raise ValueError(f"a row of {d} weights is not a whole number of {fmt} blocks of {s.block}: store it in a "
                         f"format with smaller blocks (q8_0, q4_0, q4_1 take multiples of 32; bf16 any)")
    return d // s.block * s.block_bytes


def nearest(fmt: str | WeightFormat) -> WeightFormat:
    """The format a kernel reads that `fmt` is converted to where it is not read as stored (itself for the formats
    some kernel reads)."""
    fmt = weight_format(fmt)
    return spec(fmt).nearest or fmt


def kernel_format(fmt: str | WeightFormat, device: str) -> WeightFormat:
    """What a matrix stored in `fmt` is kept as on `device` ("cpu", "cuda", or "cuda:1" ...): `fmt` itself where that
    device's kernels read it (the float formats torch computes with, on either), else `nearest(fmt)`."""
    fmt = weight_format(fmt)
    s = spec(fmt)
    reads = s.gpu_kernel if str(device).startswith("cuda") else s.cpu_kernel
    return fmt if reads or fmt in TORCH_FLOATS else nearest(fmt)


def from_ggml_type(ggml_type: int) -> WeightFormat:
    """The format of a GGUF tensor type, or a one-line error for a type no de-quantizer here reads."""
    for fmt, s in FORMATS.items():
        if s.ggml_type == int(ggml_type):
            return fmt
    try:
        name = gguf.GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        name = f"number {int(ggml_type)} (unknown to the installed gguf-py: pip install -U gguf)"
    readable = ", ".join(f.value for f, s in FORMATS.items() if s.ggml_type is not None)
    raise ValueError(f"GGUF tensor type {name} is not read (no de-quantizer for it, gguf-py's included): convert the "
                     f"file to one of {readable} (llama.cpp's llama-quantize)")
