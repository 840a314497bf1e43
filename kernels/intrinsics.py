"""Numba intrinsics written in LLVM IR, each an instruction or two inlined where it is called (kernels/cold.py,
kernels/dram.py): a stored weight widened to float32 (`_widen`: a bf16 pattern's bitcast), atomics on a shared counter
(`_fetch_add`) and on the int32 flags that the GPU's graphs share with the host (`_load_acquire`, `_store_release`),
and count-trailing-zeros (`_ctz`).

Numba's cache is named by a hash of every kernel source (kernels/__init__.numba_cache_dir): an edit here reaches
the kernels that call this module at their next start.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@intrinsic
def _widen(typingctx, v):
    """One stored weight -> float32, written so that it fuses into the dot and axpy loops and they vectorise (no
    scratch row). A bf16 pattern (uint16) is the top half of a float32: zero-extend, shift, reinterpret (a bitcast,
    which Numba cannot write). An int8 converts; its group's scale is applied once per group."""
    if v == types.uint16:
        def codegen(context, builder, signature, args):
            wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
            return builder.bitcast(wide, ir.FloatType())
    elif v == types.int8:
        def codegen(context, builder, signature, args):
            return builder.sitofp(args[0], ir.FloatType())
    else:
        return None
    return types.float32(v), codegen


@intrinsic
def _fetch_add(typingctx, counter, inc):
    """counter[0] += inc atomically (an LLVM atomicrmw); returns the value before."""
    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", ary.data, args[1], "monotonic")

    return types.int64(counter, types.int64), codegen


@intrinsic
def _load_acquire(typingctx, flags, i):
    """flags[i] read with acquire order (int32 flags that another agent writes): later reads stay after it."""
    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        return builder.load_atomic(ptr, "acquire", 4)

    return types.int32(flags, types.int64), codegen


@intrinsic
def _store_release(typingctx, flags, i, v):
    """flags[i] = v with release order: every earlier write is visible to whoever then reads flags[i] = v."""
    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        builder.store_atomic(args[2], builder.gep(ary.data, [args[1]]), "release", 4)
        return context.get_dummy_value()

    return types.none(flags, types.int64, types.int32), codegen


@intrinsic
def _ctz(typingctx, v):
    """The index of the lowest set bit of a nonzero uint64 (LLVM's cttz: one tzcnt/bsf instruction)."""
    if v != types.uint64:
        return None

    def codegen(context, builder, signature, args):
        return builder.zext(builder.cttz(args[0], ir.Constant(ir.IntType(1), 1)), ir.IntType(64))

    return types.int64(v), codegen
