# mypy: disable-error-code="call-arg,var-annotated"
# (mypy reads intrinsics as taking their typing context too, and cannot type what they return.)
"""The compiled loops' shared pieces: indirect BLAS calls, pointers and bit casts, the float32 ``exp``, a
worker's gemm scalars and the work split.

**No address is baked in.** The BLAS entry points are *arguments* (int64 addresses) called through the
``call_*`` intrinsics below, which emit an indirect call (``inttoptr`` then ``call``). ctypes function
objects frozen as globals would make the functions uncacheable; addresses in arguments make the compiled
code independent of where the BLAS library was loaded, and of which BLAS it is.

Everything here is an uncached helper, linked into the cached loops (see :mod:`.support`).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import errors
from numba.extending import intrinsic

from bsrkit.backends.cpu.compiled.constants import EXP_FASTMATH, KIND_F64

CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_TRANS = 101, 111, 112
CHAR_N, CHAR_T = 78, 84

I8P = ir.IntType(8).as_pointer()
I32 = ir.IntType(32)
F32 = ir.FloatType()


def check_scalars(args: tuple[Any, ...]) -> None:
    for t in args:
        if not isinstance(t, (types.Integer, types.Float, types.Boolean)):
            raise errors.TypingError(f"BLAS call: expected scalar arguments, got {t}")


# -- indirect calls: every BLAS entry point is an int64 address -----------------------------------------


@intrinsic
def call_fortran_gemm(typingctx, fn, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """``fn(transa, ..., ldc)``: Fortran ``?gemm_`` at address ``fn``; all 13 arguments are addresses."""
    args = (fn, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
    check_scalars(args)

    def codegen(context, builder, signature, llargs):
        i64 = [context.cast(builder, v, t, types.int64) for v, t in zip(llargs, signature.args, strict=True)]
        fnty = ir.FunctionType(ir.VoidType(), [I8P] * 13)
        callee = builder.inttoptr(i64[0], fnty.as_pointer())
        builder.call(callee, [builder.inttoptr(v, I8P) for v in i64[1:]])
        return context.get_dummy_value()

    return types.void(*args), codegen


# cblas_gemm_{bf16bf16,f16f16}f32(layout, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
# ints are 32-bit (LP64), alpha/beta float, A/B/C pointers.
_CBLAS_HALF_ARGS = ("i", "i", "i", "i", "i", "i", "f", "p", "i", "p", "i", "f", "p", "i")


@intrinsic
def call_cblas_gemm_half(typingctx, fn, layout, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """MKL's half-input, float32-output CBLAS gemm at address ``fn``."""
    args = (fn, layout, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
    check_scalars(args)

    def codegen(context, builder, signature, llargs):
        lltypes, values = [], []
        for kind, v, t in zip(_CBLAS_HALF_ARGS, llargs[1:], signature.args[1:], strict=True):
            if kind == "i":
                lltypes.append(I32)
                values.append(context.cast(builder, v, t, types.int32))
            elif kind == "f":
                lltypes.append(F32)
                values.append(context.cast(builder, v, t, types.float32))
            else:
                lltypes.append(I8P)
                values.append(builder.inttoptr(context.cast(builder, v, t, types.int64), I8P))
        fnty = ir.FunctionType(ir.VoidType(), lltypes)
        address = context.cast(builder, llargs[0], signature.args[0], types.int64)
        builder.call(builder.inttoptr(address, fnty.as_pointer()), values)
        return context.get_dummy_value()

    return types.void(*args), codegen


@intrinsic
def call_int_of_pointer(typingctx, fn, p):
    """``int fn(int *p)`` at address ``fn`` (``mkl_set_num_threads_local`` in torch's MKL build)."""
    check_scalars((fn, p))

    def codegen(context, builder, signature, llargs):
        fn64, p64 = (
            context.cast(builder, v, t, types.int64) for v, t in zip(llargs, signature.args, strict=True)
        )
        fnty = ir.FunctionType(I32, [I8P])
        return builder.call(builder.inttoptr(fn64, fnty.as_pointer()), [builder.inttoptr(p64, I8P)])

    return types.int32(fn, p), codegen


@numba.njit(nogil=True, cache=False)
def set_threads_local(set_threads, p_count):
    """Set BLAS's threads for this thread to ``*p_count``; returns the previous count (0: no such call)."""
    if set_threads == 0:
        return 0
    return call_int_of_pointer(set_threads, p_count)


# -- pointers and bit casts -----------------------------------------------------------------------------


@intrinsic
def typed_pointer(typingctx, address, zero):
    """``address`` (int64) as a pointer to elements of ``zero``'s float type."""
    check_scalars((address, zero))
    if not isinstance(zero, types.Float):
        raise errors.TypingError(f"typed_pointer: expected a float, got {zero}")

    def codegen(context, builder, signature, llargs):
        ptr = context.get_value_type(signature.return_type)
        return builder.inttoptr(context.cast(builder, llargs[0], signature.args[0], types.int64), ptr)

    return types.CPointer(zero)(address, zero), codegen


@numba.njit(nogil=True, cache=False)
def keep_alive(array):
    """Nothing: a use of ``array`` where it is called. numba frees an array after its last use *as an
    array*, so one addressed through a raw pointer taken from it (``typed_pointer(a.ctypes.data, ..)``)
    must be used again after the pointer's last use: else the writes through the pointer go to freed
    heap (as a loop's partial sums once did, harmlessly only while nothing was allocated after them)."""
    return None


@intrinsic
def int64_pointer(typingctx, address):
    """``address`` (int64) as a pointer to int64."""
    check_scalars((address,))

    def codegen(context, builder, signature, llargs):
        ptr = context.get_value_type(signature.return_type)
        return builder.inttoptr(context.cast(builder, llargs[0], signature.args[0], types.int64), ptr)

    return types.CPointer(types.int64)(address), codegen


@intrinsic
def int32_pointer(typingctx, address):
    """``address`` (int64) as a pointer to int32."""
    check_scalars((address,))

    def codegen(context, builder, signature, llargs):
        ptr = context.get_value_type(signature.return_type)
        return builder.inttoptr(context.cast(builder, llargs[0], signature.args[0], types.int64), ptr)

    return types.CPointer(types.int32)(address), codegen


@intrinsic
def float32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the int32 ``bits`` (vectorizes, unlike a store and reload)."""
    if not isinstance(bits, types.Integer):
        raise errors.TypingError(f"float32_from_bits: expected an integer, got {bits}")

    def codegen(context, builder, signature, llargs):
        value = context.cast(builder, llargs[0], signature.args[0], types.int32)
        return builder.bitcast(value, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def bits_of32(typingctx, value):
    """The int32 bit pattern of the float32 ``value``."""
    if value != types.float32:
        raise errors.TypingError(f"bits_of32: expected a float32, got {value}")

    def codegen(context, builder, signature, llargs):
        return builder.bitcast(llargs[0], ir.IntType(32))

    return types.int32(value), codegen


@intrinsic
def maxnum(typingctx, a, b):
    """LLVM's ``maxnum`` (the larger of two floats of one type): unlike ``max``, a reduction over it
    vectorizes (under the ``nnan`` flag)."""
    if not isinstance(a, types.Float) or a != b:
        raise errors.TypingError(f"maxnum: expected two floats of one type, got {a}, {b}")

    def codegen(context, builder, signature, llargs):
        ty = context.get_value_type(signature.args[0])
        fn = builder.module.declare_intrinsic("llvm.maxnum", [ty], ir.FunctionType(ty, [ty, ty]))
        return builder.call(fn, llargs)

    return a(a, b), codegen


# -- float32 exp -----------------------------------------------------------------------------------------
#
# exp(t) = 2**(t log2 e) = 2**n * 2**f with n = round(t log2 e) and |f| <= 1/2; n by adding 1.5 * 2**23 (the
# sum's low mantissa bits are n, rounded to nearest), 2**f by a degree-5 polynomial fitted for relative error
# on [-1/2, 1/2] (7.5e-8; Lawson's weighted least squares). Below t = -87, exp(t) < 1.7e-38 (the smallest
# normal float32): flushed to 0, as is exp(-inf). LLVM vectorizes it (the power of two built by bit casts):
# 0.4 ns per element here, where libm's scalar ``expf`` took 4.8 ns.
_LOG2E = np.float32(1.4426950408889634)
_P0, _P1, _P2 = np.float32(1.0000001), np.float32(0.69314694), np.float32(0.2402212)
_P3, _P4, _P5 = np.float32(0.05550713), np.float32(0.00967554), np.float32(0.00132765)
_ROUND = np.float32(12582912.0)  # 1.5 * 2**23
_ROUND_BITS = np.int32(0x4B400000)  # its bit pattern: the sum's bits are _ROUND_BITS + n
_LOWEST = np.float32(-126.0)
_FLUSH = np.float32(-87.0)
ZERO32 = np.float32(0.0)


@numba.njit(nogil=True, cache=False, fastmath=EXP_FASTMATH)
def exp32(t):
    """exp(t) for float32 t <= 0 (or -inf: 0; NaN: NaN). (float64 loops type it too, on a branch never
    taken.)"""
    v = np.float32(t) * _LOG2E
    v = _LOWEST if v < _LOWEST else v  # (keeps n + 127 a valid exponent; NaN passes, and gives NaN)
    rounded = v + _ROUND
    f = v - (rounded - _ROUND)
    p = _P5 * f + _P4
    p = p * f + _P3
    p = p * f + _P2
    p = p * f + _P1
    p = p * f + _P0
    two_n = float32_from_bits((bits_of32(rounded) - _ROUND_BITS + np.int32(127)) << np.int32(23))
    return ZERO32 if t < _FLUSH else p * two_n


# -- a worker's gemm scalars ----------------------------------------------------------------------------


@numba.njit(nogil=True, cache=False)
def gemm_scalars(kind, alpha, swap, a_rowmajor, b_rowmajor, lda, ldb, ldc, Ks):
    """One worker's Fortran gemm scalars (gemm takes every one by pointer), in one buffer.

    Returns ``(ints, p_int, p_real, rsize, p_chr)``: ints (int32) m, n, k, lda, ldb, ldc, 0, threads, 1 at
    ``p_int``; alpha, 0, 1 in the kind's precision (float64, else float32), ``rsize`` bytes each, at
    ``p_real``; transa, transb, 'N', 'N' at ``p_chr``. ``swap``: a row-major C, computed as the column-major
    C^T = B^T A^T (m and n, lda and ldb, the flags exchanged). The caller sets m and n per call.

    Every pointer points into ``ints``' buffer, and numba frees an array after its *last use*, not at the
    end of its scope: the caller must use ``ints`` after its last gemm call (restoring the BLAS thread
    count does)."""
    state = np.zeros(9, np.int64)  # bytes 0-35 ints, 40-63 reals, 64-67 chars
    ints = state.view(np.int32)
    chars = state[8:9].view(np.uint8)
    ints[7] = 1
    ints[8] = 1
    chars[2] = CHAR_N
    chars[3] = CHAR_N
    if swap:
        chars[0] = CHAR_N if b_rowmajor else CHAR_T
        chars[1] = CHAR_N if a_rowmajor else CHAR_T
        ints[3] = ldb
        ints[4] = lda
    else:
        chars[0] = CHAR_T if a_rowmajor else CHAR_N
        chars[1] = CHAR_T if b_rowmajor else CHAR_N
        ints[3] = lda
        ints[4] = ldb
    ints[2] = Ks
    ints[5] = ldc
    if kind == KIND_F64:
        reals = state[5:8].view(np.float64)
        reals[0] = alpha
        reals[1] = 0.0
        reals[2] = 1.0
        rsize = 8
    else:  # (float32 gemm; the half kinds use it for empty rows only)
        real32 = state[5:7].view(np.float32)
        real32[0] = alpha
        real32[1] = 0.0
        real32[2] = 1.0
        rsize = 4
    p_int = state.ctypes.data
    return ints, p_int, p_int + 40, rsize, p_int + 64


# -- the in-loop proof of the index data -----------------------------------------------------------------


@numba.njit(nogil=True, cache=False, inline="always")
def index_mismatches(plan, row, g0, g1, live_addr, at, wide):
    """1 if any of ``plan[row, g0:g1]`` (a C-contiguous int64 plan array) differs from the live index
    entries ``at + g0 .. at + g1`` at ``live_addr`` (int64, or int32 unless ``wide``), else 0. The live
    values are compared, never used: a concurrent write can change the verdict, never an access. (Raw
    pointers and an OR of XORs: no negative-index branch and no count, so LLVM vectorizes the loop.)"""
    p = int64_pointer(plan.ctypes.data + row * plan.shape[1] * 8)
    acc = 0
    if wide:
        live = int64_pointer(live_addr)
        for g in range(g0, g1):
            acc |= p[g] ^ live[at + g]
    else:
        live32 = int32_pointer(live_addr)
        for g in range(g0, g1):
            acc |= p[g] ^ live32[at + g]
    return 1 if acc != 0 else 0


@numba.njit(nogil=True, cache=False)
def run_mismatches(crow, col, bsr_of, rows, b, i, b_end, i_end, crow_live, col_live, wide):
    """How many index ranges read by a run of one-row tasks, from task ``(b, i)`` to ``(b_end, i_end)``
    (batch, block row), differ from the live memory: per batch of the run, the row pointers ``crow[i + 1 ..
    stop]`` (and ``crow[0]`` from row 0) and the columns ``col[crow[i] : crow[stop]]`` of the plan, each
    compared in one pass, so that the comparison vectorizes over the whole run instead of one block row's
    few entries at a time (a decode product's rows hold tens of blocks)."""
    ncol = col.shape[1]
    n = 0
    while b < b_end or (b == b_end and i < i_end):
        stop = rows if b < b_end else i_end
        bb = bsr_of[b]
        n += index_mismatches(crow, bb, 0 if i == 0 else i + 1, stop + 1, crow_live, bb * (rows + 1), wide)
        n += index_mismatches(col, bb, crow[bb, i], crow[bb, stop], col_live, bb * ncol, wide)
        b += 1
        i = 0
    return n


# -- the work split ---------------------------------------------------------------------------------------


@numba.njit(nogil=True, cache=False)
def task_bound(t, nthreads, bstart, cum, bsr_of, rows, ntasks):
    """(batch, task) where worker ``t``'s run starts: the first task whose preceding cost reaches
    ``t / nthreads`` of the total. Worker t's run ends where worker t + 1's starts.

    Tasks are (batch, panel, row), ``ntasks`` per batch: ``bstart[b]`` is the cost before batch ``b``
    (``nbatch + 1`` entries), ``cum[bsr_of[b]]`` its rows' cost prefix sums (``rows + 1``), the same in
    every panel. (The one search of the loops: the gemm, vector and scatter loops. The fused attention's
    cuts are made by its caller, in numpy: they prefer batch boundaries, see
    :func:`bsrkit.backends.cpu.attention_kernels.work_bounds`.)"""
    nbatch = bsr_of.shape[0]
    if t == 0:
        return 0, 0
    if t >= nthreads:
        return nbatch, 0
    target = bstart[nbatch] * t / nthreads
    lo, hi = 0, nbatch - 1  # the last batch starting at or before target
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if bstart[mid] <= target:
            lo = mid
        else:
            hi = mid - 1
    b = lo
    c = cum[bsr_of[b]]
    per_panel = c[rows]
    lo, hi = 0, ntasks  # the first task i of batch b with cost before it >= target
    while lo < hi:
        mid = (lo + hi) // 2
        if bstart[b] + (mid // rows) * per_panel + c[mid % rows] >= target:
            hi = mid
        else:
            lo = mid + 1
    if lo == ntasks:
        return b + 1, 0
    return b, lo
