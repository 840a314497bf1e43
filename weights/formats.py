"""The weight formats the project reads and stores, and the one table of their sizes.

Every byte count in the project comes from here: pi-solve's memory model (solver/cost.py), the runtime's layouts and
the memory checks before a load. A format is a block of `block` weights stored in `block_bytes` bytes; a row of d
weights (d a multiple of `block`) takes d / block * block_bytes bytes. Float formats are blocks of one weight.

The GGUF formats keep llama.cpp's block layouts byte for byte (ggml-common.h), so rows of a GGUF file can be copied,
or read in place, with no conversion. `int8` is the runtime's own: int8 weights with a float32 scale per 64.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class FormatSpec:
    block: int  # weights per block
    block_bytes: int  # bytes per block
    ggml_type: int | None  # gguf.GGMLQuantizationType value (None: not a GGUF type)
    # what the runtime's kernels read directly; other formats are converted on load (to --cold-dtype / --gpu-dtype)
    cpu_kernel: bool
    gpu_kernel: bool

    @property
    def bytes_per_weight(self) -> float:
        return self.block_bytes / self.block


FORMATS: dict[WeightFormat, FormatSpec] = {
    WeightFormat.F32: FormatSpec(1, 4, 0, cpu_kernel=False, gpu_kernel=True),
    WeightFormat.F16: FormatSpec(1, 2, 1, cpu_kernel=False, gpu_kernel=True),
    WeightFormat.BF16: FormatSpec(1, 2, 30, cpu_kernel=True, gpu_kernel=True),
    WeightFormat.INT8: FormatSpec(64, 64 + 4, None, cpu_kernel=True, gpu_kernel=False),
    WeightFormat.Q8_0: FormatSpec(32, 34, 8, cpu_kernel=True, gpu_kernel=True),
    WeightFormat.Q4_0: FormatSpec(32, 18, 2, cpu_kernel=True, gpu_kernel=True),
    WeightFormat.Q4_1: FormatSpec(32, 20, 3, cpu_kernel=True, gpu_kernel=True),
    WeightFormat.Q4_K: FormatSpec(256, 144, 12, cpu_kernel=False, gpu_kernel=False),
    WeightFormat.Q5_K: FormatSpec(256, 176, 13, cpu_kernel=False, gpu_kernel=False),
    WeightFormat.Q6_K: FormatSpec(256, 210, 14, cpu_kernel=False, gpu_kernel=False),
}
# the hot rows' formats that the GPU kernels read: --gpu-dtype's choices (the cold rows': kernels/names.COLD_DTYPES, the
# formats marked cpu_kernel)
GPU_DTYPES = tuple(str(f) for f, s in FORMATS.items() if s.gpu_kernel)  # f32 f16 bf16 q8_0 q4_0 q4_1
# the names earlier versions took (pi-solve --dtype fp16, meta.json files written by them)
ALIASES = {"fp32": WeightFormat.F32, "fp16": WeightFormat.F16, "float32": WeightFormat.F32,
           "float16": WeightFormat.F16, "bfloat16": WeightFormat.BF16}


def weight_format(name: str | WeightFormat, error: type[Exception] = ValueError, param: str | None = None
                  ) -> WeightFormat:
    """A format by name (aliases: fp32, fp16, ...), else a one-line `error` listing the names."""
    if isinstance(name, str) and name.lower() in ALIASES:
        return ALIASES[name.lower()]
    return choose(str(name).lower(), WeightFormat, "weight format", error, param)


def spec(fmt: str | WeightFormat) -> FormatSpec:
    return FORMATS[weight_format(fmt)]


def bytes_per_weight(fmt: str | WeightFormat) -> float:
    return spec(fmt).bytes_per_weight


def row_bytes(fmt: str | WeightFormat, d: int) -> int:
    """Bytes of one row of d weights; d must be a whole number of blocks."""
    s = spec(fmt)
    if d % s.block:
        raise ValueError(f"a row of {d} weights is not a whole number of {fmt} blocks of {s.block}: store it in a "
                         f"format with smaller blocks (q8_0, q4_0, q4_1 take multiples of 32; bf16 any)")
    return d // s.block * s.block_bytes


def from_ggml_type(ggml_type: int) -> WeightFormat:
    """The format of a GGUF tensor type, or a one-line error for types not read yet."""
    for fmt, s in FORMATS.items():
        if s.ggml_type == int(ggml_type):
            return fmt
    import gguf

    name = gguf.GGMLQuantizationType(int(ggml_type)).name
    readable = ", ".join(f.value for f, s in FORMATS.items() if s.ggml_type is not None)
    raise ValueError(f"GGUF tensor type {name} is not supported: convert the file to one of {readable} "
                     f"(llama.cpp's llama-quantize)")
