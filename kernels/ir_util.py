"""What kernels/cold_q_ir.py's row math and kernels/cold_k.py's (the K-quants', which cold_q_ir's `rows_dot` calls)
share: the format codes and their block sizes, the instruction sets the compile target has, and the small LLVM IR
builders both emit their vector code with.

Numba's cache is named by a hash of every kernel source (kernels/__init__.numba_cache_dir): an edit here reaches
the kernels that call this module at their next start.
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numba
from hotneurons.weights.formats import FORMATS, WeightFormat
from llvmlite import ir
from numba.core import cgutils

Q8_0, Q4_0, Q4_1 = 0, 1, 2  # format codes
Q4_K, Q5_K, Q6_K = 3, 4, 5  # the K-quants' (256 weights a block: kernels/cold_k.py has their row math)
CODE_FORMATS = (WeightFormat.Q8_0, WeightFormat.Q4_0, WeightFormat.Q4_1,
                WeightFormat.Q4_K, WeightFormat.Q5_K, WeightFormat.Q6_K)  # by format code
# weights/formats.py's sizes by format code, as tuples: the jitted code indexes them by a runtime code, and Numba
# takes a global tuple as a constant (a dict or the FORMATS table it cannot read)
BLOCK_BYTES = tuple(FORMATS[f].block_bytes for f in CODE_FORMATS)  # 34 18 20 144 176 210
BLOCK_WEIGHTS = tuple(FORMATS[f].block for f in CODE_FORMATS)  # 32 32 32 256 256 256


def _features() -> set[str]:
    """The features Numba compiles for: NUMBA_CPU_NAME / NUMBA_CPU_FEATURES when set, else the host's."""
    if numba.config.CPU_NAME and numba.config.CPU_NAME != "host":
        spec = numba.config.CPU_FEATURES or ""
    else:
        spec = llvm.get_host_cpu_features().flatten()
    return {f[1:] for f in spec.split(",") if f.startswith("+")}


_FEAT = _features()
HAS_512 = {"avx512f", "avx512bw"} <= _FEAT  # 16-lane float vectors and vpermps (the Q4_0 table)
XQ_OK = HAS_512 and {"avx512vl", "avx512vbmi", "avx512vnni"} <= _FEAT  # the int route's instructions

_F32, _I1, _I8, _I16, _I32, _I64 = ir.FloatType(), ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), \
    ir.IntType(64)
_V16F, _V16I, _V16B, _V64B = (ir.VectorType(_F32, 16), ir.VectorType(_I32, 16), ir.VectorType(_I8, 16),
                              ir.VectorType(_I8, 64))


def _c(t, v):  # a constant; a list for a vector
    return ir.Constant(t, v)


def _ptr(builder, base, offset, t):
    return builder.bitcast(builder.gep(base, [offset]), ir.PointerType(t))


def _ld(builder, base, offset, t, align=1):
    return builder.load(_ptr(builder, base, offset, t), align=align)


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _splat(builder, v, t=_V16F):
    one = builder.insert_element(ir.Constant(t, ir.Undefined), v, _c(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(t, ir.Undefined), _c(ir.VectorType(_I32, t.count), [0] * t.count))


def _shuffle(builder, a, b, mask):
    return builder.shuffle_vector(a, b, _c(ir.VectorType(_I32, len(mask)), mask))


def _prefetch(builder, data, o):
    """Ask for the cache line of byte o of a row, into the L2 (LLVM's prefetch: read, locality 2, data)."""
    i8p = ir.PointerType(_I8)
    fn = _fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [i8p, _I32, _I32, _I32])
    builder.call(fn, [builder.bitcast(builder.gep(data, [o]), i8p)] + [_c(_I32, v) for v in (0, 2, 1)])


def _fma(builder, a, b, c):
    return builder.call(_fn(builder, "llvm.fmuladd.v16f32", _V16F, [_V16F] * 3), [a, b, c])


def _hsum(builder, v):  # 16 lanes -> 1, halving
    n = 16
    while n > 1:
        n //= 2
        v = builder.fadd(_shuffle(builder, v, v, list(range(n))), _shuffle(builder, v, v, list(range(n, 2 * n))))
    return builder.extract_element(v, _c(_I32, 0))


def _scale(builder, lut, data, o):
    """A block's fp16 scale at byte o of a row, as float32 (one load from the table)."""
    return builder.load(builder.gep(lut, [builder.zext(_ld(builder, data, o, _I16), _I64)]))
