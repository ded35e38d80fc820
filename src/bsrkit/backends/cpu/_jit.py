# mypy: disable-error-code="call-arg,var-annotated"
# (mypy reads intrinsics as taking their typing context too, and cannot type what they return.)
"""The CPU backend's compiled loops (numba), cached on disk so that only a machine's first process compiles.

Imported by :mod:`bsrkit.backends.cpu.kernels` at the first CPU product, never by ``import bsrkit``.

**No address is baked in.** The BLAS entry points are *arguments* (int64 addresses) called through the
``_call_*`` intrinsics below, which emit an indirect call (``inttoptr`` then ``call``). ctypes function
objects frozen as globals would make the functions uncacheable; addresses in arguments make the compiled
code independent of where the BLAS library was loaded, and of which BLAS it is.

**The on-disk cache** is numba's ``cache=True``:

- Where: ``$NUMBA_CACHE_DIR`` if set and writable, else ``__pycache__`` beside this file if writable, else
  numba's per-user cache directory; where none is writable (a read-only install and home), the functions
  compile in memory on each process, as before (:func:`_njit`).
- Never stale: numba keys the index on a content hash of *this file* (and its own version, the CPU and the
  bytecode). Everything the compiled code depends on (the intrinsics, ``task_bound``, the ``KIND_*``
  constants) lives in this one file for that reason.
- Concurrent writers: each index and data file is written to a temporary name and renamed into place.
  Every function here is only ever compiled for one signature (the caller normalises argument types), so
  two processes compiling at once write the same entry with the same content.

**Threading layer.** numba's default (GNU OpenMP on Linux wheels): it starts a parallel region in
microseconds, where ``workqueue`` took ~0.1-0.2 ms per call (figures in docs/performance.md). GNU OpenMP
cannot run in a process forked after the first product ("fork() called from a process already using GNU
OpenMP"), so in a forked child the kernels run their serial twins (``*_serial``: the same loop compiled
without a parallel region; :mod:`.kernels` picks them), which never touch the threading layer. The
twins also run every product too small to pay for starting the worker threads. Callers serialise kernel
calls with a lock (not every layer is thread-safe).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import inspect
import threading
import types as types_module
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import errors
from numba.core.caching import FunctionCache
from numba.core.runtime import rtsys
from numba.extending import intrinsic, models, register_model

from bsrkit.loading import import_module, off_main_thread

# The same values as kernels.KIND_* (a test checks); repeated here so the cache's source hash covers them.
KIND_F32, KIND_F64, KIND_BF16, KIND_F16 = 0, 1, 2, 3
_CBLAS_ROW_MAJOR, _CBLAS_NO_TRANS, _CBLAS_TRANS = 101, 111, 112
_CHAR_N, _CHAR_T = 78, 84
# bsr_mm_small's ``dot``: broadcast loops (X is (K, Wp)), dot products along k (X is (Wp, K)), or the
# two-column dot loop reading a row-major (K, 2) X directly.
DOT_NONE, DOT_COLUMNS, DOT_PAIRS = 0, 1, 2


class _QuickLoadCache(FunctionCache):
    """numba's function cache, loading without ``target_context.refresh()``.

    The refresh imports every lowering registry numba has (0.5-1.3 s here, SciPy included where it is
    installed), which only *compiling* needs; running loaded code needs the runtime (NRT) alone. A miss
    compiles as usual (the compiler refreshes the context itself). An unreadable or corrupt entry is a
    miss, never an error. The index is stamped with a hash of the source file's *content* (what numba
    >= 0.6x does too; older versions used its size and modification time, which an upgrade may keep).
    """

    def __init__(self, py_func: Any) -> None:
        super().__init__(py_func)
        with open(inspect.getfile(py_func), "rb") as source:
            self._cache_file._source_stamp = ("sha256", hashlib.sha256(source.read()).hexdigest())

    def load_overload(self, sig: Any, target_context: Any) -> Any:
        rtsys.initialize(target_context)
        try:
            return self._load_overload(sig, target_context)
        except Exception:
            return None


def _njit(**options: Any) -> Any:
    """``numba.njit(cache=True)`` with :class:`_QuickLoadCache`; ``cache=False`` (compile in memory, each
    process) where no cache directory is writable."""

    def decorate(fn: Any) -> Any:
        try:
            dispatcher = numba.njit(cache=True, **options)(fn)
        except RuntimeError:  # numba: "cannot cache function ...: no locator available"
            return numba.njit(cache=False, **options)(fn)
        dispatcher._cache = _QuickLoadCache(dispatcher.py_func)
        return dispatcher

    return decorate


# -- indirect calls: every BLAS entry point is an int64 address -----------------------------------------

_I8P = ir.IntType(8).as_pointer()
_I32 = ir.IntType(32)
_F32 = ir.FloatType()


def _check_scalars(args: tuple[Any, ...]) -> None:
    for t in args:
        if not isinstance(t, (types.Integer, types.Float, types.Boolean)):
            raise errors.TypingError(f"BLAS call: expected scalar arguments, got {t}")


@intrinsic
def _call_fortran_gemm(typingctx, fn, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """``fn(transa, ..., ldc)``: Fortran ``?gemm_`` at address ``fn``; all 13 arguments are addresses."""
    args = (fn, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
    _check_scalars(args)

    def codegen(context, builder, signature, llargs):
        i64 = [context.cast(builder, v, t, types.int64) for v, t in zip(llargs, signature.args, strict=True)]
        fnty = ir.FunctionType(ir.VoidType(), [_I8P] * 13)
        callee = builder.inttoptr(i64[0], fnty.as_pointer())
        builder.call(callee, [builder.inttoptr(v, _I8P) for v in i64[1:]])
        return context.get_dummy_value()

    return types.void(*args), codegen


# cblas_gemm_{bf16bf16,f16f16}f32(layout, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
# ints are 32-bit (LP64), alpha/beta float, A/B/C pointers.
_CBLAS_HALF_ARGS = ("i", "i", "i", "i", "i", "i", "f", "p", "i", "p", "i", "f", "p", "i")


@intrinsic
def _call_cblas_gemm_half(
    typingctx, fn, layout, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc
):
    """MKL's half-input, float32-output CBLAS gemm at address ``fn``."""
    args = (fn, layout, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
    _check_scalars(args)

    def codegen(context, builder, signature, llargs):
        lltypes, values = [], []
        for kind, v, t in zip(_CBLAS_HALF_ARGS, llargs[1:], signature.args[1:], strict=True):
            if kind == "i":
                lltypes.append(_I32)
                values.append(context.cast(builder, v, t, types.int32))
            elif kind == "f":
                lltypes.append(_F32)
                values.append(context.cast(builder, v, t, types.float32))
            else:
                lltypes.append(_I8P)
                values.append(builder.inttoptr(context.cast(builder, v, t, types.int64), _I8P))
        fnty = ir.FunctionType(ir.VoidType(), lltypes)
        address = context.cast(builder, llargs[0], signature.args[0], types.int64)
        builder.call(builder.inttoptr(address, fnty.as_pointer()), values)
        return context.get_dummy_value()

    return types.void(*args), codegen


@intrinsic
def _call_int_of_pointer(typingctx, fn, p):
    """``int fn(int *p)`` at address ``fn`` (``mkl_set_num_threads_local`` in torch's MKL build)."""
    _check_scalars((fn, p))

    def codegen(context, builder, signature, llargs):
        fn64, p64 = (
            context.cast(builder, v, t, types.int64) for v, t in zip(llargs, signature.args, strict=True)
        )
        fnty = ir.FunctionType(_I32, [_I8P])
        return builder.call(builder.inttoptr(fn64, fnty.as_pointer()), [builder.inttoptr(p64, _I8P)])

    return types.int32(fn, p), codegen


# Helpers are not cached themselves: their code is linked into each cached kernel, and an uncached helper
# can never be loaded with a stale or mislabelled signature.
@numba.njit(nogil=True, cache=False)
def _set_threads_local(set_threads, p_count):
    """Set BLAS's threads for this thread to ``*p_count``; returns the previous count (0: no such call)."""
    if set_threads == 0:
        return 0
    return _call_int_of_pointer(set_threads, p_count)


# -- a worker's gemm scalars ----------------------------------------------------------------------------


@numba.njit(nogil=True, cache=False)
def _gemm_scalars(kind, alpha, swap, a_rowmajor, b_rowmajor, lda, ldb, ldc, Ks):
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
    chars[2] = _CHAR_N
    chars[3] = _CHAR_N
    if swap:
        chars[0] = _CHAR_N if b_rowmajor else _CHAR_T
        chars[1] = _CHAR_N if a_rowmajor else _CHAR_T
        ints[3] = ldb
        ints[4] = lda
    else:
        chars[0] = _CHAR_T if a_rowmajor else _CHAR_N
        chars[1] = _CHAR_T if b_rowmajor else _CHAR_N
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


# -- bsr @ dense ------------------------------------------------------------------------------------------


@numba.njit(nogil=True, cache=False)
def task_bound(t, nthreads, bstart, cum, bsr_of, rows, ntasks):
    """(batch, task) where worker ``t``'s run starts: the first task whose preceding cost reaches
    ``t / nthreads`` of the total. Worker t's run ends where worker t + 1's starts."""
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


@_njit(parallel=True, nogil=True)
def bsr_mm(
    kind, crow, col, cum, bsr_of, nthreads,
    a_addr, a_boff, a_gs, a_rowmajor, lda,
    b_addr, b_boff, b_rowmajor, b_rs, b_cs, ldb,
    c_addr, c_boff, c_rs, c_cs, c_rowmajor, ldc,
    Ms, Ks, N, panel, alpha, overwrite, isz_ab, isz_c,
    sgemm, dgemm, gemm_bf16, gemm_f16, set_threads,
):  # fmt: skip
    """See :mod:`bsrkit.backends.cpu.kernels`. The last five arguments are BLAS addresses (0: absent)."""
    nbatch = bsr_of.shape[0]
    rows = crow.shape[1] - 1
    npanels = (N + panel - 1) // panel
    ntasks = npanels * rows  # per batch
    if ntasks == 0:
        return
    bstart = np.empty(nbatch + 1, np.float64)  # cost before each batch's first task
    bstart[0] = 0.0
    for b in range(nbatch):
        bstart[b + 1] = bstart[b] + npanels * cum[bsr_of[b], rows]
    gemm = dgemm if kind == KIND_F64 else sgemm
    gemm_half = gemm_bf16 if kind == KIND_BF16 else gemm_f16
    for t in numba.prange(nthreads):
        swap = c_rowmajor  # row-major C: compute C^T = B^T A^T in column-major terms
        ints, p_int, p_real, rsize, p_chr = _gemm_scalars(kind, alpha, swap, a_rowmajor, b_rowmajor, lda, ldb,
                                                          ldc, Ks)  # fmt: skip
        old_threads = _set_threads_local(set_threads, p_int + 28)
        ta = _CBLAS_NO_TRANS if a_rowmajor else _CBLAS_TRANS
        tb = _CBLAS_NO_TRANS if b_rowmajor else _CBLAS_TRANS
        b, i = task_bound(t, nthreads, bstart, cum, bsr_of, rows, ntasks)
        b_end, i_end = task_bound(t + 1, nthreads, bstart, cum, bsr_of, rows, ntasks)
        while b < b_end or (b == b_end and i < i_end):
            bb = bsr_of[b]
            j0 = (i // rows) * panel
            r = i % rows
            ns = min(panel, N - j0)
            if swap:
                ints[0] = ns
                ints[1] = Ms
            else:
                ints[0] = Ms
                ints[1] = ns
            g0 = crow[bb, r]
            g1 = crow[bb, r + 1]
            c_ptr = c_addr + (c_boff[b] + r * Ms * c_rs + j0 * c_cs) * isz_c
            if g0 == g1 and overwrite:  # an empty block row: gemm with k = 0, beta = 0 writes 0
                _call_fortran_gemm(gemm if kind <= KIND_F64 else sgemm, p_chr + 2, p_chr + 3, p_int,
                                   p_int + 4, p_int + 24, p_real, c_ptr, p_int + 20, c_ptr, p_int + 32,
                                   p_real + rsize, c_ptr, p_int + 20)  # fmt: skip
            for g in range(g0, g1):
                a_ptr = a_addr + (a_boff[bb] + g * a_gs) * isz_ab
                b_ptr = b_addr + (b_boff[b] + col[bb, g] * Ks * b_rs + j0 * b_cs) * isz_ab
                first = overwrite and g == g0
                if kind <= KIND_F64:  # float32 or float64: Fortran gemm
                    p_beta = p_real + (rsize if first else 2 * rsize)
                    x_ptr = b_ptr if swap else a_ptr
                    y_ptr = a_ptr if swap else b_ptr
                    _call_fortran_gemm(gemm, p_chr, p_chr + 1, p_int, p_int + 4, p_int + 8, p_real,
                                       x_ptr, p_int + 12, y_ptr, p_int + 16, p_beta,
                                       c_ptr, p_int + 20)  # fmt: skip
                else:
                    beta = 0.0 if first else 1.0
                    _call_cblas_gemm_half(gemm_half, _CBLAS_ROW_MAJOR, ta, tb, Ms, ns, Ks, alpha,
                                          a_ptr, lda, b_ptr, ldb, beta, c_ptr, ldc)  # fmt: skip
            i += 1
            if i == ntasks:
                b += 1
                i = 0
        if set_threads != 0:
            ints[7] = old_threads
            _set_threads_local(set_threads, p_int + 28)


# -- bsr @ dense for few columns (N <= 16): vector loops, no BLAS call ---------------------------------
#
# numba has no SIMD type, so :class:`_Vec` is one: an LLVM vector of 32 bytes (8 float32 or 4 float64; on
# narrower or wider hardware LLVM splits or packs it), held in registers like any scalar local. The loops
# below use only the intrinsics that follow (load, load of two interleaved columns, splat, multiply-add,
# lane, horizontal sum), so the order of every sum is the one written: no fast-math flags (NaN and inf
# behave as in IEEE arithmetic).


class _Vec(types.Type):
    def __init__(self, dtype: Any) -> None:
        self.dtype = dtype
        self.lanes = 32 // (dtype.bitwidth // 8)
        super().__init__(name=f"vec{self.lanes}x{dtype}")


@register_model(_Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm: Any, fe_type: Any) -> None:
        scalar = dmm.lookup(fe_type.dtype).get_value_type()
        super().__init__(dmm, fe_type, ir.VectorType(scalar, fe_type.lanes))


def _float_pointer(t: Any) -> Any:
    if not (isinstance(t, types.CPointer) and isinstance(t.dtype, types.Float)):
        raise errors.TypingError(f"vector op: expected a float pointer, got {t}")
    return t.dtype


@intrinsic
def _typed_pointer(typingctx, address, zero):
    """``address`` (int64) as a pointer to elements of ``zero``'s float type."""
    _check_scalars((address, zero))
    if not isinstance(zero, types.Float):
        raise errors.TypingError(f"_typed_pointer: expected a float, got {zero}")

    def codegen(context, builder, signature, llargs):
        ptr = context.get_value_type(signature.return_type)
        return builder.inttoptr(context.cast(builder, llargs[0], signature.args[0], types.int64), ptr)

    return types.CPointer(zero)(address, zero), codegen


@intrinsic
def _vload(typingctx, p, offset):
    """The vector of elements ``p[offset], p[offset + 1], ...`` (no alignment assumed)."""
    vec = _Vec(_float_pointer(p))

    def codegen(context, builder, signature, llargs):
        where = builder.gep(llargs[0], [context.cast(builder, llargs[1], signature.args[1], types.intp)])
        vty = context.get_value_type(signature.return_type)
        loaded = builder.load(builder.bitcast(where, vty.as_pointer()), align=vec.dtype.bitwidth // 8)
        return loaded

    return vec(p, offset), codegen


@intrinsic
def _vload_pairs(typingctx, p, offset):
    """Two vectors from the ``2 * lanes`` elements at ``p[offset]``: the even-indexed and the odd-indexed ones
    (the two columns of a row-major ``(k, 2)`` matrix: one load, then two shuffles)."""
    vec = _Vec(_float_pointer(p))

    def codegen(context, builder, signature, llargs):
        where = builder.gep(llargs[0], [context.cast(builder, llargs[1], signature.args[1], types.intp)])
        wide = ir.VectorType(context.get_value_type(vec.dtype), 2 * vec.lanes)
        loaded = builder.load(builder.bitcast(where, wide.as_pointer()), align=vec.dtype.bitwidth // 8)
        lane_indices = ir.VectorType(_I32, vec.lanes)
        halves = [
            builder.shuffle_vector(
                loaded,
                ir.Constant(wide, ir.Undefined),
                ir.Constant(lane_indices, list(range(phase, 2 * vec.lanes, 2))),
            )
            for phase in (0, 1)
        ]
        return context.make_tuple(builder, signature.return_type, halves)

    return types.UniTuple(vec, 2)(p, offset), codegen


@intrinsic
def _vsplat(typingctx, x):
    """The vector with ``x`` in every lane."""
    if not isinstance(x, types.Float):
        raise errors.TypingError(f"_vsplat: expected a float, got {x}")
    vec = _Vec(x)

    def codegen(context, builder, signature, llargs):
        vty = context.get_value_type(signature.return_type)
        one = builder.insert_element(ir.Constant(vty, ir.Undefined), llargs[0], _I32(0))
        return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, vec.lanes), [0] * vec.lanes))

    return vec(x), codegen


@intrinsic
def _vzero(typingctx, zero):
    """The vector of zeros of ``zero``'s float type."""
    if not isinstance(zero, types.Float):
        raise errors.TypingError(f"_vzero: expected a float, got {zero}")
    vec = _Vec(zero)

    def codegen(context, builder, signature, llargs):
        vty = context.get_value_type(signature.return_type)
        return ir.Constant(vty, [ir.Constant(vty.element, 0.0)] * vec.lanes)

    return vec(zero), codegen


@intrinsic
def _vfma(typingctx, a, b, c):
    """``a * b + c`` lane by lane (``llvm.fmuladd``: one fused instruction where the CPU has one)."""
    if not (isinstance(a, _Vec) and a == b == c):
        raise errors.TypingError(f"_vfma: expected three vectors of one type, got {a}, {b}, {c}")

    def codegen(context, builder, signature, llargs):
        vty = context.get_value_type(signature.return_type)
        suffix = f"v{vty.count}f{a.dtype.bitwidth}"
        fn = builder.module.declare_intrinsic(f"llvm.fmuladd.{suffix}", fnty=ir.FunctionType(vty, [vty] * 3))
        return builder.call(fn, llargs)

    return a(a, b, c), codegen


@intrinsic
def _vlane(typingctx, v, j):
    """Lane ``j`` of ``v``."""
    if not isinstance(v, _Vec):
        raise errors.TypingError(f"_vlane: expected a vector, got {v}")

    def codegen(context, builder, signature, llargs):
        return builder.extract_element(
            llargs[0], context.cast(builder, llargs[1], signature.args[1], types.int32)
        )

    return v.dtype(v, j), codegen


@intrinsic
def _vsum(typingctx, v):
    """The sum of ``v``'s lanes, in lane order."""
    if not isinstance(v, _Vec):
        raise errors.TypingError(f"_vsum: expected a vector, got {v}")

    def codegen(context, builder, signature, llargs):
        s = builder.extract_element(llargs[0], _I32(0))
        for j in range(1, v.lanes):
            s = builder.fadd(s, builder.extract_element(llargs[0], _I32(j)))
        return s

    return v.dtype(v), codegen


@intrinsic
def _vstore(typingctx, p, offset, v):
    """``p[offset], p[offset + 1], ... = v`` (no alignment assumed)."""
    if not (isinstance(v, _Vec) and _float_pointer(p) == v.dtype):
        raise errors.TypingError(f"_vstore: expected a vector of {p}'s type, got {v}")

    def codegen(context, builder, signature, llargs):
        where = builder.gep(llargs[0], [context.cast(builder, llargs[1], signature.args[1], types.intp)])
        builder.store(
            llargs[2], builder.bitcast(where, llargs[2].type.as_pointer()), align=v.dtype.bitwidth // 8
        )
        return context.get_dummy_value()

    return types.void(p, offset, v), codegen


# Each helper computes one block row of one batch. A: the block values (element a0 + g * a_gs + i * a_rs
# + k * a_cs of block g); X: the dense columns, copied (zero-padded) into the layout the helper reads; C:
# the output tile (element c0 + i * c_rs + j * c_cs), written (overwrite) or added to, times alpha.


@numba.njit(nogil=True, cache=False)
def _store(C, cp, alpha, overwrite, s):
    if overwrite:
        C[cp] = alpha * s
    else:
        C[cp] += alpha * s


@numba.njit(nogil=True, cache=False)
def _zero_row(C, c0, c_rs, c_cs, Ms, N, zero):
    for i in range(Ms):
        for j in range(N):
            C[c0 + i * c_rs + j * c_cs] = zero


@numba.njit(nogil=True, cache=False)
def _x_columns(X, xb, k, x_ld, pairs, Wp):
    """X's vectors at step ``k`` of a block starting at ``xb``: columns 0 and 1 (column 0 twice when
    ``Wp == 1``), from ``(Wp, K)`` rows ``x_ld`` apart, or from row-major ``(K, 2)`` pairs."""
    if pairs:
        return _vload_pairs(X, xb + 2 * k)
    x0v = _vload(X, xb + k)
    return x0v, (_vload(X, xb + x_ld + k) if Wp == 2 else x0v)


@numba.njit(nogil=True, cache=False)
def _dot_rows_in_registers(A, a0, a_gs, a_rs, X, x0, x_ld, pairs, cols, g0, g1, C, c0, c_rs, c_cs, Ms, Ks, N,
                           Wp, L, alpha, overwrite, zero):  # fmt: skip
    """:func:`_dot_row` for Wp = 1 or 2, rows outermost: four rows' partial sums (4 or 8 vectors) stay in
    registers across all the row's blocks and are stored once. (Blocks outermost, as for Wp = 4, spills
    and reloads every partial sum once per block: a third of the loads at bs 16.) The row's part of X
    (blocks x Ks x Wp) is re-read per group of four rows, from L1. ``pairs``: X is the row-major ``(K, 2)``
    dense operand itself (``x_ld`` unused), each step's two columns taken from one load by shuffles."""
    vz = _vzero(zero)
    i = 0
    while i + 4 <= Ms:
        p00 = p10 = p20 = p30 = p01 = p11 = p21 = p31 = vz
        for g in range(g0, g1):
            r = a0 + g * a_gs + i * a_rs
            xb = x0 + cols[g] * Ks * (2 if pairs else 1)
            for k in range(0, Ks, L):
                x0v, x1v = _x_columns(X, xb, k, x_ld, pairs, Wp)
                a0v = _vload(A, r + k)
                a1v = _vload(A, r + a_rs + k)
                a2v = _vload(A, r + 2 * a_rs + k)
                a3v = _vload(A, r + 3 * a_rs + k)
                p00 = _vfma(a0v, x0v, p00)
                p10 = _vfma(a1v, x0v, p10)
                p20 = _vfma(a2v, x0v, p20)
                p30 = _vfma(a3v, x0v, p30)
                if Wp == 2:
                    p01 = _vfma(a0v, x1v, p01)
                    p11 = _vfma(a1v, x1v, p11)
                    p21 = _vfma(a2v, x1v, p21)
                    p31 = _vfma(a3v, x1v, p31)
        c = c0 + i * c_rs
        _store(C, c, alpha, overwrite, _vsum(p00))
        _store(C, c + c_rs, alpha, overwrite, _vsum(p10))
        _store(C, c + 2 * c_rs, alpha, overwrite, _vsum(p20))
        _store(C, c + 3 * c_rs, alpha, overwrite, _vsum(p30))
        if N == 2:
            _store(C, c + c_cs, alpha, overwrite, _vsum(p01))
            _store(C, c + c_rs + c_cs, alpha, overwrite, _vsum(p11))
            _store(C, c + 2 * c_rs + c_cs, alpha, overwrite, _vsum(p21))
            _store(C, c + 3 * c_rs + c_cs, alpha, overwrite, _vsum(p31))
        i += 4
    while i < Ms:  # the last Ms % 4 rows, one at a time
        p00 = p01 = vz
        for g in range(g0, g1):
            r = a0 + g * a_gs + i * a_rs
            xb = x0 + cols[g] * Ks * (2 if pairs else 1)
            for k in range(0, Ks, L):
                x0v, x1v = _x_columns(X, xb, k, x_ld, pairs, Wp)
                a0v = _vload(A, r + k)
                p00 = _vfma(a0v, x0v, p00)
                if Wp == 2:
                    p01 = _vfma(a0v, x1v, p01)
        c = c0 + i * c_rs
        _store(C, c, alpha, overwrite, _vsum(p00))
        if N == 2:
            _store(C, c + c_cs, alpha, overwrite, _vsum(p01))
        i += 1


@numba.njit(nogil=True, cache=False)
def _dot_row(A, a0, a_gs, a_rs, X, x0, x_ld, pairs, cols, g0, g1, C, c0, c_rs, c_cs, Ms, Ks, N, Wp, L, alpha,
             overwrite, V, zero):  # fmt: skip
    """Wp = 1, 2 or 4 columns of X (column j at ``x0 + j * x_ld``, contiguous along k): dot products along k
    of the blocks' rows (``a_cs == 1``, Ks a multiple of the L lanes) with X's columns, kept as vector
    partial sums in ``V`` (Ms * Wp vectors) over the row's blocks, summed across lanes at the end."""
    if Wp <= 2:
        _dot_rows_in_registers(A, a0, a_gs, a_rs, X, x0, x_ld, pairs, cols, g0, g1, C, c0, c_rs, c_cs, Ms, Ks,
                               N, Wp, L, alpha, overwrite, zero)  # fmt: skip
        return
    vz = _vzero(zero)
    for e in range(0, Ms * Wp * L, L):
        _vstore(V, e, vz)
    for g in range(g0, g1):
        ab = a0 + g * a_gs
        xb = x0 + cols[g] * Ks
        if Wp == 1:
            i = 0
            while i + 4 <= Ms:  # four rows at once: four independent sums
                r = ab + i * a_rs
                p0 = _vload(V, i * L)
                p1 = _vload(V, (i + 1) * L)
                p2 = _vload(V, (i + 2) * L)
                p3 = _vload(V, (i + 3) * L)
                for k in range(0, Ks, L):
                    x = _vload(X, xb + k)
                    p0 = _vfma(_vload(A, r + k), x, p0)
                    p1 = _vfma(_vload(A, r + a_rs + k), x, p1)
                    p2 = _vfma(_vload(A, r + 2 * a_rs + k), x, p2)
                    p3 = _vfma(_vload(A, r + 3 * a_rs + k), x, p3)
                _vstore(V, i * L, p0)
                _vstore(V, (i + 1) * L, p1)
                _vstore(V, (i + 2) * L, p2)
                _vstore(V, (i + 3) * L, p3)
                i += 4
            while i < Ms:
                r = ab + i * a_rs
                p0 = _vload(V, i * L)
                for k in range(0, Ks, L):
                    p0 = _vfma(_vload(A, r + k), _vload(X, xb + k), p0)
                _vstore(V, i * L, p0)
                i += 1
        elif Wp == 2:
            i = 0
            while i + 2 <= Ms:  # two rows by two columns: four independent sums, each load used twice
                r = ab + i * a_rs
                v = i * 2 * L
                p00 = _vload(V, v)
                p01 = _vload(V, v + L)
                p10 = _vload(V, v + 2 * L)
                p11 = _vload(V, v + 3 * L)
                for k in range(0, Ks, L):
                    xv0 = _vload(X, xb + k)
                    xv1 = _vload(X, xb + x_ld + k)
                    av0 = _vload(A, r + k)
                    av1 = _vload(A, r + a_rs + k)
                    p00 = _vfma(av0, xv0, p00)
                    p01 = _vfma(av0, xv1, p01)
                    p10 = _vfma(av1, xv0, p10)
                    p11 = _vfma(av1, xv1, p11)
                _vstore(V, v, p00)
                _vstore(V, v + L, p01)
                _vstore(V, v + 2 * L, p10)
                _vstore(V, v + 3 * L, p11)
                i += 2
            if i < Ms:
                r = ab + i * a_rs
                v = i * 2 * L
                p00 = _vload(V, v)
                p01 = _vload(V, v + L)
                for k in range(0, Ks, L):
                    av0 = _vload(A, r + k)
                    p00 = _vfma(av0, _vload(X, xb + k), p00)
                    p01 = _vfma(av0, _vload(X, xb + x_ld + k), p01)
                _vstore(V, v, p00)
                _vstore(V, v + L, p01)
        else:
            for i in range(Ms):
                r = ab + i * a_rs
                v = i * 4 * L
                p0 = _vload(V, v)
                p1 = _vload(V, v + L)
                p2 = _vload(V, v + 2 * L)
                p3 = _vload(V, v + 3 * L)
                for k in range(0, Ks, L):
                    a = _vload(A, r + k)
                    p0 = _vfma(a, _vload(X, xb + k), p0)
                    p1 = _vfma(a, _vload(X, xb + x_ld + k), p1)
                    p2 = _vfma(a, _vload(X, xb + 2 * x_ld + k), p2)
                    p3 = _vfma(a, _vload(X, xb + 3 * x_ld + k), p3)
                _vstore(V, v, p0)
                _vstore(V, v + L, p1)
                _vstore(V, v + 2 * L, p2)
                _vstore(V, v + 3 * L, p3)
    for i in range(Ms):
        for j in range(N):
            _store(C, c0 + i * c_rs + j * c_cs, alpha, overwrite, _vsum(_vload(V, (i * Wp + j) * L)))


@intrinsic
def _vwidth(typingctx, v):
    """The number of lanes of ``v`` (a constant)."""
    if not isinstance(v, _Vec):
        raise errors.TypingError(f"_vwidth: expected a vector, got {v}")

    def codegen(context, builder, signature, llargs):
        return context.get_constant(types.intp, v.lanes)

    return types.intp(v), codegen


@intrinsic
def _vmul(typingctx, a, b):
    """``a * b`` lane by lane."""
    if not (isinstance(a, _Vec) and a == b):
        raise errors.TypingError(f"_vmul: expected two vectors of one type, got {a}, {b}")

    def codegen(context, builder, signature, llargs):
        return builder.fmul(*llargs)

    return a(a, b), codegen


@numba.njit(nogil=True, cache=False)
def _store_lanes(C, cp, c_cs, n, alpha, overwrite, v):
    """The first ``n`` lanes of ``alpha * v`` into (or added to) ``C[cp + j * c_cs]``."""
    if n == _vwidth(v) and c_cs == 1:  # a whole vector into a contiguous row: one store
        a = _vsplat(alpha)
        _vstore(C, cp, _vmul(a, v) if overwrite else _vfma(a, v, _vload(C, cp)))
        return
    for j in range(n):
        _store(C, cp + j * c_cs, alpha, overwrite, _vlane(v, j))


@numba.njit(nogil=True, cache=False)
def _axpy_row(A, a0, a_gs, a_rs, a_cs, X, x0, x_ld, cols, g0, g1, C, c0, c_rs, c_cs, Ms, Ks, N, Wp, L,
              alpha, overwrite, V, zero):  # fmt: skip
    """X is (K, Wp) (row k at ``x0 + k * x_ld``, contiguous along its Wp columns, Wp a multiple of L):
    ``acc[i, :] += A[i, k] * X[k, :]`` with one element of A broadcast to all lanes. Block by block (A
    is read in order, the block's rows of X stay in cache), four output rows times 2L (else L) columns
    at a time in registers; the row's sums in ``V`` (Ms * Wp elements) between blocks."""
    vz = _vzero(zero)
    for e in range(0, Ms * Wp, L):
        _vstore(V, e, vz)
    for g in range(g0, g1):
        ab = a0 + g * a_gs
        xb = x0 + cols[g] * Ks * x_ld
        j0 = 0
        while j0 < Wp:
            two = j0 + 2 * L <= Wp
            i = 0
            while i + 4 <= Ms:
                v = i * Wp + j0
                r = ab + i * a_rs
                if two:
                    c00 = _vload(V, v)
                    c01 = _vload(V, v + L)
                    c10 = _vload(V, v + Wp)
                    c11 = _vload(V, v + Wp + L)
                    c20 = _vload(V, v + 2 * Wp)
                    c21 = _vload(V, v + 2 * Wp + L)
                    c30 = _vload(V, v + 3 * Wp)
                    c31 = _vload(V, v + 3 * Wp + L)
                    for k in range(Ks):
                        xk = xb + k * x_ld + j0
                        x0v = _vload(X, xk)
                        x1v = _vload(X, xk + L)
                        ak = r + k * a_cs
                        a = _vsplat(A[ak])
                        c00 = _vfma(a, x0v, c00)
                        c01 = _vfma(a, x1v, c01)
                        a = _vsplat(A[ak + a_rs])
                        c10 = _vfma(a, x0v, c10)
                        c11 = _vfma(a, x1v, c11)
                        a = _vsplat(A[ak + 2 * a_rs])
                        c20 = _vfma(a, x0v, c20)
                        c21 = _vfma(a, x1v, c21)
                        a = _vsplat(A[ak + 3 * a_rs])
                        c30 = _vfma(a, x0v, c30)
                        c31 = _vfma(a, x1v, c31)
                    _vstore(V, v, c00)
                    _vstore(V, v + L, c01)
                    _vstore(V, v + Wp, c10)
                    _vstore(V, v + Wp + L, c11)
                    _vstore(V, v + 2 * Wp, c20)
                    _vstore(V, v + 2 * Wp + L, c21)
                    _vstore(V, v + 3 * Wp, c30)
                    _vstore(V, v + 3 * Wp + L, c31)
                else:
                    c00 = _vload(V, v)
                    c10 = _vload(V, v + Wp)
                    c20 = _vload(V, v + 2 * Wp)
                    c30 = _vload(V, v + 3 * Wp)
                    for k in range(Ks):
                        x0v = _vload(X, xb + k * x_ld + j0)
                        ak = r + k * a_cs
                        c00 = _vfma(_vsplat(A[ak]), x0v, c00)
                        c10 = _vfma(_vsplat(A[ak + a_rs]), x0v, c10)
                        c20 = _vfma(_vsplat(A[ak + 2 * a_rs]), x0v, c20)
                        c30 = _vfma(_vsplat(A[ak + 3 * a_rs]), x0v, c30)
                    _vstore(V, v, c00)
                    _vstore(V, v + Wp, c10)
                    _vstore(V, v + 2 * Wp, c20)
                    _vstore(V, v + 3 * Wp, c30)
                i += 4
            while i < Ms:  # the last Ms % 4 rows, one at a time
                v = i * Wp + j0
                r = ab + i * a_rs
                c00 = _vload(V, v)
                for k in range(Ks):
                    c00 = _vfma(_vsplat(A[r + k * a_cs]), _vload(X, xb + k * x_ld + j0), c00)
                _vstore(V, v, c00)
                if two:
                    c01 = _vload(V, v + L)
                    for k in range(Ks):
                        c01 = _vfma(_vsplat(A[r + k * a_cs]), _vload(X, xb + k * x_ld + j0 + L), c01)
                    _vstore(V, v + L, c01)
                i += 1
            j0 += 2 * L if two else L
    for i in range(Ms):
        for j0 in range(0, N, L):
            n = min(L, N - j0)  # (padded columns are computed, never stored)
            _store_lanes(C, c0 + i * c_rs + j0 * c_cs, c_cs, n, alpha, overwrite, _vload(V, i * Wp + j0))


@numba.njit(nogil=True, cache=False)
def _small_run(zero, L, alpha, t, nthreads, bstart, crow, col, cum, bsr_of, rows,
               a_addr, a_boff, a_gs, a_rs, a_cs, x_addr, x_boff, x_ld, dot,
               c_addr, c_boff, c_rs, c_cs, Ms, Ks, N, Wp, overwrite):  # fmt: skip
    """Worker ``t``'s run of (batch, block row) tasks, in the float type of ``zero`` (L lanes)."""
    A = _typed_pointer(a_addr, zero)
    X = _typed_pointer(x_addr, zero)
    C = _typed_pointer(c_addr, zero)
    scratch = np.full(max(Ms * max(4 * L, Wp), 1), zero)  # the row's partial sums
    V = _typed_pointer(scratch.ctypes.data, zero)
    b, i = task_bound(t, nthreads, bstart, cum, bsr_of, rows, rows)
    b_end, i_end = task_bound(t + 1, nthreads, bstart, cum, bsr_of, rows, rows)
    while b < b_end or (b == b_end and i < i_end):
        bb = bsr_of[b]
        g0 = crow[bb, i]
        g1 = crow[bb, i + 1]
        c0 = c_boff[b] + i * Ms * c_rs
        if g0 == g1:
            if overwrite:
                _zero_row(C, c0, c_rs, c_cs, Ms, N, zero)
        elif dot:
            _dot_row(A, a_boff[bb], a_gs, a_rs, X, x_boff[b], x_ld, dot == DOT_PAIRS, col[bb], g0, g1, C, c0,
                     c_rs, c_cs, Ms, Ks, N, Wp, L, alpha, overwrite, V, zero)  # fmt: skip
        else:
            _axpy_row(A, a_boff[bb], a_gs, a_rs, a_cs, X, x_boff[b], x_ld, col[bb], g0, g1, C, c0, c_rs,
                      c_cs, Ms, Ks, N, Wp, L, alpha, overwrite, V, zero)  # fmt: skip
        i += 1
        if i == rows:
            b += 1
            i = 0


@_njit(parallel=True, nogil=True)
def bsr_mm_small(
    kind, crow, col, cum, bsr_of, nthreads,
    a_addr, a_boff, a_gs, a_rs, a_cs,
    x_addr, x_boff, x_ld, dot,
    c_addr, c_boff, c_rs, c_cs,
    Ms, Ks, N, Wp, alpha, overwrite,
):  # fmt: skip
    """See :func:`bsrkit.backends.cpu.kernels.bsr_mm_small_kernel`: float32 (kind 0) or float64 (1)."""
    nbatch = bsr_of.shape[0]
    rows = crow.shape[1] - 1
    if rows == 0:
        return
    bstart = np.empty(nbatch + 1, np.float64)  # cost before each batch's first task
    bstart[0] = 0.0
    for b in range(nbatch):
        bstart[b + 1] = bstart[b] + cum[bsr_of[b], rows]
    for t in numba.prange(nthreads):
        if kind == KIND_F64:
            _small_run(np.float64(0), 4, alpha, t, nthreads, bstart, crow, col, cum, bsr_of, rows,
                       a_addr, a_boff, a_gs, a_rs, a_cs, x_addr, x_boff, x_ld, dot,
                       c_addr, c_boff, c_rs, c_cs, Ms, Ks, N, Wp, overwrite)  # fmt: skip
        else:
            _small_run(np.float32(0), 8, np.float32(alpha), t, nthreads, bstart, crow, col, cum, bsr_of,
                       rows, a_addr, a_boff, a_gs, a_rs, a_cs, x_addr, x_boff, x_ld, dot,
                       c_addr, c_boff, c_rs, c_cs, Ms, Ks, N, Wp, overwrite)  # fmt: skip


# -- sampled: C[b, g] = alpha * A[b, rows[g]] @ B[b, :, cols[g]] ----------------------------------------


@_njit(parallel=True, nogil=True)
def sampled(
    kind, rows, cols, nthreads,
    a_addr, a_boff, a_rs, a_rowmajor, lda,
    b_addr, b_boff, b_cs, b_rowmajor, ldb,
    c_addr, Ms, Ns, K, alpha, isz_ab, isz_c,
    sgemm, dgemm, gemm_bf16, gemm_f16, set_threads, k_chunk,
):  # fmt: skip
    """See :func:`bsrkit.backends.cpu.kernels.sampled_kernel`. Then five BLAS addresses, and the inner
    dimension of one Fortran gemm call (``k_chunk`` < K: the block accumulates over chunks of K)."""
    nbatch = rows.shape[0]
    nnz = rows.shape[1]
    gemm = dgemm if kind == KIND_F64 else sgemm
    gemm_half = gemm_bf16 if kind == KIND_BF16 else gemm_f16
    for b in range(nbatch):
        for t in numba.prange(nthreads):
            # Row-major C: compute C^T = B^T A^T in column-major terms.
            ints, p_int, p_real, rsize, p_chr = _gemm_scalars(kind, alpha, True, a_rowmajor, b_rowmajor, lda,
                                                              ldb, Ns, K)  # fmt: skip
            ints[0] = Ns
            ints[1] = Ms
            old_threads = _set_threads_local(set_threads, p_int + 28)
            a_ks = 1 if a_rowmajor else lda  # element step along K in A (rows x K) and in B (K x cols)
            b_ks = ldb if b_rowmajor else 1
            ta = _CBLAS_NO_TRANS if a_rowmajor else _CBLAS_TRANS
            tb = _CBLAS_NO_TRANS if b_rowmajor else _CBLAS_TRANS
            g_lo = (nnz * t) // nthreads
            g_hi = (nnz * (t + 1)) // nthreads
            for g in range(g_lo, g_hi):
                a_ptr = a_addr + (a_boff[b] + rows[b, g] * Ms * a_rs) * isz_ab
                b_ptr = b_addr + (b_boff[b] + cols[b, g] * Ns * b_cs) * isz_ab
                c_ptr = c_addr + ((b * nnz + g) * Ms * Ns) * isz_c
                if kind <= KIND_F64:
                    for k0 in range(0, max(K, 1), k_chunk):  # K == 0: one call (k = 0) writes 0
                        ints[2] = min(k_chunk, K - k0)
                        _call_fortran_gemm(gemm, p_chr, p_chr + 1, p_int, p_int + 4, p_int + 8, p_real,
                                           b_ptr + k0 * b_ks * isz_ab, p_int + 12,
                                           a_ptr + k0 * a_ks * isz_ab, p_int + 16,
                                           p_real + (rsize if k0 == 0 else 2 * rsize),
                                           c_ptr, p_int + 20)  # fmt: skip
                else:
                    _call_cblas_gemm_half(gemm_half, _CBLAS_ROW_MAJOR, ta, tb, Ms, Ns, K, alpha,
                                          a_ptr, lda, b_ptr, ldb, 0.0, c_ptr, Ns)  # fmt: skip
            if set_threads != 0:
                ints[7] = old_threads
                _set_threads_local(set_threads, p_int + 28)


# -- scatter_mm: acc[b, tile] += sum over its pairs of blocks[p] @ others[b, q] --------------------------


@numba.njit(nogil=True, cache=False)
def scatter_task_start(t, nthreads, cum, ntasks, nbatch):
    """The first task (``batch * ntasks + i``) of worker ``t``'s run: the first whose preceding cost
    reaches ``t / nthreads`` of the total (batch ``b``'s tasks cost ``cum`` each, after ``b`` batches)."""
    if t <= 0:
        return 0
    if t >= nthreads:
        return ntasks * nbatch
    target = cum[ntasks] * nbatch * t / nthreads
    lo, hi = 0, ntasks * nbatch
    while lo < hi:
        mid = (lo + hi) // 2
        b = mid // ntasks
        if b * cum[ntasks] + cum[mid - b * ntasks] >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


@_njit(parallel=True, nogil=True)
def scatter_mm(
    kind, tiles, pairs, tasks, cum, nbatch, nthreads,
    a_addr, a_gs, a_rowmajor, lda,
    b_addr, b_boff, b_moff, b_rs, b_cs, b_rowmajor, ldb,
    c_addr, c_boff, c_moff, c_rs, c_cs, c_rowmajor, ldc,
    Ms, Ks, alpha, overwrite, isz_ab, isz_c,
    sgemm, dgemm, gemm_bf16, gemm_f16, set_threads,
):  # fmt: skip
    """See :func:`bsrkit.backends.cpu.kernels.scatter_mm_kernel`. The last five arguments are BLAS
    addresses (0: absent)."""
    ntasks = tasks.shape[0]
    if ntasks == 0 or nbatch == 0:
        return
    gemm = dgemm if kind == KIND_F64 else sgemm
    gemm_half = gemm_bf16 if kind == KIND_BF16 else gemm_f16
    for t in numba.prange(nthreads):
        swap = c_rowmajor  # row-major C: compute C^T = B^T A^T in column-major terms
        ints, p_int, p_real, rsize, p_chr = _gemm_scalars(kind, alpha, swap, a_rowmajor, b_rowmajor, lda, ldb,
                                                          ldc, Ks)  # fmt: skip
        old_threads = _set_threads_local(set_threads, p_int + 28)
        ta = _CBLAS_NO_TRANS if a_rowmajor else _CBLAS_TRANS
        tb = _CBLAS_NO_TRANS if b_rowmajor else _CBLAS_TRANS
        k_end = scatter_task_start(t + 1, nthreads, cum, ntasks, nbatch)
        for k in range(scatter_task_start(t, nthreads, cum, ntasks, nbatch), k_end):
            b = k // ntasks
            i = k - b * ntasks
            tile = tasks[i, 0]
            j0 = tasks[i, 1]
            w = tasks[i, 2]
            if swap:
                ints[0] = w
                ints[1] = Ms
            else:
                ints[0] = Ms
                ints[1] = w
            c_ptr = (
                c_addr
                + (c_boff[b] + c_moff[tiles[tile, 0]] + tiles[tile, 1] * c_rs + (tiles[tile, 2] + j0) * c_cs)
                * isz_c
            )
            g0 = tiles[tile, 3]
            g1 = tiles[tile, 4]
            if g0 == g1 and overwrite:  # a tile without products: gemm with k = 0, beta = 0 writes 0
                ints[2] = 0
                _call_fortran_gemm(gemm if kind <= KIND_F64 else sgemm, p_chr + 2, p_chr + 3, p_int,
                                   p_int + 4, p_int + 8, p_real, c_ptr, p_int + 20, c_ptr, p_int + 32,
                                   p_real + rsize, c_ptr, p_int + 20)  # fmt: skip
                ints[2] = Ks
            for g in range(g0, g1):
                a_ptr = a_addr + pairs[g, 0] * a_gs * isz_ab
                b_ptr = (
                    b_addr
                    + (b_boff[b] + b_moff[pairs[g, 1]] + pairs[g, 2] * b_rs + (pairs[g, 3] + j0) * b_cs)
                    * isz_ab
                )
                first = overwrite and g == g0
                if kind <= KIND_F64:  # float32 or float64: Fortran gemm
                    x_ptr = b_ptr if swap else a_ptr
                    y_ptr = a_ptr if swap else b_ptr
                    _call_fortran_gemm(gemm, p_chr, p_chr + 1, p_int, p_int + 4, p_int + 8, p_real,
                                       x_ptr, p_int + 12, y_ptr, p_int + 16,
                                       p_real + (rsize if first else 2 * rsize),
                                       c_ptr, p_int + 20)  # fmt: skip
                else:
                    _call_cblas_gemm_half(gemm_half, _CBLAS_ROW_MAJOR, ta, tb, Ms, w, Ks, alpha,
                                          a_ptr, lda, b_ptr, ldb, 0.0 if first else 1.0,
                                          c_ptr, ldc)  # fmt: skip
        if set_threads != 0:
            ints[7] = old_threads
            _set_threads_local(set_threads, p_int + 28)


def _serial(parallel: Any, name: str) -> Any:
    """The same loop compiled without a parallel region, run when ``nthreads == 1``: launching numba's
    thread pool costs ~0.1-0.2 ms per call, more than a tiny product takes (``prange`` is ``range`` here).
    A copy of the function under its own name, so that its on-disk cache entries are its own."""
    fn = parallel.py_func
    copy = types_module.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__qualname__ = name
    return _njit(nogil=True)(copy)


# -- C entries of the bsr @ dense serial twins: one packed argument block --------------------------------
#
# A tiny product takes tens of microseconds, and numba's dispatcher, which types and unboxes each of a
# loop's 25-36 arguments on every call, took ~2 µs of it. So the serial twins of ``bsr_mm`` and
# ``bsr_mm_small`` are C functions (numba ``cfunc``, cached on disk like the loops) of four int64s: the
# address of a packed argument block and the three data addresses that change from call to call (blocks,
# dense, out). A caller packs the block once (:meth:`_PackedEntry.pack`) and keeps it; a call through a
# ctypes function pointer costs ~0.4 µs. The entries unpack and call the loop itself (its serial copy), so
# that the arithmetic is the loop's: a change of a loop's arguments must be mirrored in its entry.
#
# The block: ``_SLOTS`` int64 slots per argument, argument i at ``_SLOTS * i``: an int or bool there, a
# float's bits, or an array's address and extents (1-D: n0; 2-D: n0, n1). Arrays are C-contiguous int64
# (``cum``: float64), kept alive by the caller as long as the block.

_SLOTS = 3


@intrinsic
def _int64_pointer(typingctx, address):
    """``address`` (int64) as a pointer to int64."""
    _check_scalars((address,))

    def codegen(context, builder, signature, llargs):
        ptr = context.get_value_type(signature.return_type)
        return builder.inttoptr(context.cast(builder, llargs[0], signature.args[0], types.int64), ptr)

    return types.CPointer(types.int64)(address), codegen


@numba.njit(nogil=True, cache=False)
def _slot_ints1(p, i):
    return numba.carray(_int64_pointer(p[_SLOTS * i]), (p[_SLOTS * i + 1],))


@numba.njit(nogil=True, cache=False)
def _slot_ints2(p, i):
    return numba.carray(_int64_pointer(p[_SLOTS * i]), (p[_SLOTS * i + 1], p[_SLOTS * i + 2]))


@numba.njit(nogil=True, cache=False)
def _slot_floats2(p, i):
    return numba.carray(_typed_pointer(p[_SLOTS * i], np.float64(0)), (p[_SLOTS * i + 1], p[_SLOTS * i + 2]))


@numba.njit(nogil=True, cache=False)
def _slot_float(p, i):
    return p[_SLOTS * i : _SLOTS * i + 1].view(np.float64)[0]


def _serial_body(parallel: Any, name: str) -> Any:
    """The loop compiled without a parallel region, uncached: linked into the entry that calls it."""
    fn = parallel.py_func
    copy = types_module.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__qualname__ = name
    return numba.njit(nogil=True, cache=False)(copy)


_bsr_mm_body = _serial_body(bsr_mm, "_bsr_mm_body")
_bsr_mm_small_body = _serial_body(bsr_mm_small, "_bsr_mm_small_body")


def _bsr_mm_entry(block, a_addr, b_addr, c_addr):  # (compiled by _PackedEntry)
    p = numba.carray(_int64_pointer(block), (36 * _SLOTS,))
    _bsr_mm_body(
        p[0], _slot_ints2(p, 1), _slot_ints2(p, 2), _slot_floats2(p, 3), _slot_ints1(p, 4), p[5 * _SLOTS],
        a_addr, _slot_ints1(p, 7), p[8 * _SLOTS], p[9 * _SLOTS] != 0, p[10 * _SLOTS],
        b_addr, _slot_ints1(p, 12), p[13 * _SLOTS] != 0, p[14 * _SLOTS], p[15 * _SLOTS], p[16 * _SLOTS],
        c_addr, _slot_ints1(p, 18), p[19 * _SLOTS], p[20 * _SLOTS], p[21 * _SLOTS] != 0, p[22 * _SLOTS],
        p[23 * _SLOTS], p[24 * _SLOTS], p[25 * _SLOTS], p[26 * _SLOTS], _slot_float(p, 27),
        p[28 * _SLOTS] != 0, p[29 * _SLOTS], p[30 * _SLOTS],
        p[31 * _SLOTS], p[32 * _SLOTS], p[33 * _SLOTS], p[34 * _SLOTS], p[35 * _SLOTS],
    )  # fmt: skip


def _bsr_mm_small_entry(block, a_addr, x_addr, c_addr):  # (compiled by _PackedEntry)
    p = numba.carray(_int64_pointer(block), (25 * _SLOTS,))
    _bsr_mm_small_body(
        p[0], _slot_ints2(p, 1), _slot_ints2(p, 2), _slot_floats2(p, 3), _slot_ints1(p, 4), p[5 * _SLOTS],
        a_addr, _slot_ints1(p, 7), p[8 * _SLOTS], p[9 * _SLOTS], p[10 * _SLOTS],
        x_addr, _slot_ints1(p, 12), p[13 * _SLOTS], p[14 * _SLOTS],  # (dot: a DOT_* mode, not a bool)
        c_addr, _slot_ints1(p, 16), p[17 * _SLOTS], p[18 * _SLOTS],
        p[19 * _SLOTS], p[20 * _SLOTS], p[21 * _SLOTS], p[22 * _SLOTS], _slot_float(p, 23),
        p[24 * _SLOTS] != 0,
    )  # fmt: skip


class _EntryStats:
    """numba's dispatcher statistics, as :func:`kernels.compile_cache_info` reads them."""

    def __init__(self, cache_path: str | None, hits: int, misses: int) -> None:
        self.cache_path = cache_path
        self.cache_hits = {(): hits}
        self.cache_misses = {(): misses}


class _PackedEntry:
    """A serial twin behind its C entry: ``c_call(block, a, b, c)`` (a ctypes function pointer, compiled
    or loaded from the on-disk cache at first use); :meth:`pack` makes a block; calling the object with a
    loop's full argument list packs and runs it (what a call without a kept block does)."""

    def __init__(self, entry: Any, name: str, kinds: str, data_at: tuple[int, int, int]) -> None:
        self._entry = entry
        self.__name__ = name
        self._kinds = kinds  # per argument: i int, b bool, f float; 1, 2 int64 arrays, F float64 2-D
        self.data_at = data_at
        self._cfunc: Any = None
        self._c_call: Any = None
        self._lock = threading.Lock()

    @property
    def c_call(self) -> Any:
        if self._c_call is None:
            with self._lock:
                if self._c_call is None:  # (a compile takes numba's lock: see bsrkit.loading)
                    self._c_call = off_main_thread(self._compile)
        return self._c_call

    def _compile(self) -> Any:
        CFunc = import_module("numba.core.ccallback").CFunc

        cfunc: Any = CFunc(self._entry, ((types.int64,) * 4, types.void), {}, {})
        with contextlib.suppress(RuntimeError):  # (no writable cache location, see _njit: in memory)
            cfunc._cache = _QuickLoadCache(self._entry)
        cfunc.compile()
        self._cfunc = cfunc
        # CFUNCTYPE: the call releases the GIL while the loop runs, as the nogil loops do.
        prototype = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)
        return prototype(cfunc.address)

    def pack(self, args: Any) -> np.ndarray:
        """The block of a full argument list (its data addresses are not read: they travel per call)."""
        if len(args) != len(self._kinds):
            raise TypeError(f"{self.__name__}(): expected {len(self._kinds)} arguments, got {len(args)}")
        block = np.zeros(len(args) * _SLOTS, np.int64)
        for i, (kind, value) in enumerate(zip(self._kinds, args, strict=True)):
            at = i * _SLOTS
            if kind == "f":
                block[at : at + 1].view(np.float64)[0] = value
            elif kind in "12F":
                dtype, ndim = (np.float64, 2) if kind == "F" else (np.int64, int(kind))
                if (
                    not isinstance(value, np.ndarray)
                    or value.dtype != dtype
                    or value.ndim != ndim
                    or not value.flags.c_contiguous
                ):
                    raise TypeError(f"{self.__name__}(): expected argument {i} a C-contiguous {dtype} array")
                block[at] = value.ctypes.data
                block[at + 1 : at + 1 + value.ndim] = value.shape
            else:
                block[at] = int(value)
        return block

    def __call__(self, *args: Any) -> None:
        block = self.pack(args)
        a, b, c = self.data_at
        self.c_call(block.ctypes.data, args[a], args[b], args[c])

    @property
    def signatures(self) -> list[Any]:
        return [] if self._cfunc is None else [self._cfunc._sig]

    @property
    def stats(self) -> _EntryStats:
        cfunc = self._cfunc
        if cfunc is None:
            return _EntryStats(None, 0, 0)
        path = getattr(cfunc._cache, "cache_path", None)
        return _EntryStats(path, cfunc.cache_hits, 1 - cfunc.cache_hits)


_BSR_MM_KINDS = "i22F1i" + "i1ibi" + "i1bii" + "i" + "i1iibi" + "iiiifbii" + "iiiii"
bsr_mm_serial = _PackedEntry(_bsr_mm_entry, "bsr_mm_serial", _BSR_MM_KINDS, (6, 11, 17))
_BSR_MM_SMALL_KINDS = "i22F1i" + "i1iii" + "i1ii" + "i1ii" + "iiiifb"
bsr_mm_small_serial = _PackedEntry(
    _bsr_mm_small_entry, "bsr_mm_small_serial", _BSR_MM_SMALL_KINDS, (6, 11, 15)
)
sampled_serial = _serial(sampled, "sampled_serial")
scatter_mm_serial = _serial(scatter_mm, "scatter_mm_serial")

DISPATCHERS = {
    "bsr_mm": bsr_mm,
    "sampled": sampled,
    "bsr_mm_serial": bsr_mm_serial,
    "bsr_mm_small": bsr_mm_small,
    "bsr_mm_small_serial": bsr_mm_small_serial,
    "sampled_serial": sampled_serial,
    "scatter_mm": scatter_mm,
    "scatter_mm_serial": scatter_mm_serial,
}
