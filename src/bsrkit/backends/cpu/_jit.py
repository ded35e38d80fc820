# mypy: disable-error-code="call-arg"
# (mypy reads intrinsics as taking their typing context too.)
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

import hashlib
import inspect
import types as types_module
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import errors
from numba.core.caching import FunctionCache
from numba.core.runtime import rtsys
from numba.extending import intrinsic

# The same values as kernels.KIND_* (a test checks); repeated here so the cache's source hash covers them.
KIND_F32, KIND_F64, KIND_BF16, KIND_F16 = 0, 1, 2, 3
_CBLAS_ROW_MAJOR, _CBLAS_NO_TRANS, _CBLAS_TRANS = 101, 111, 112
_CHAR_N, _CHAR_T = 78, 84


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
        # Per-thread scratch: Fortran gemm takes every scalar by pointer.
        ints = np.zeros(9, np.int32)  # m n k lda ldb ldc 0 threads 1
        reals = np.empty(3, np.float64)
        real32 = np.empty(3, np.float32)
        chars = np.empty(4, np.uint8)
        p_int = ints.ctypes.data
        ints[7] = 1
        ints[8] = 1
        chars[2] = _CHAR_N
        chars[3] = _CHAR_N
        old_threads = _set_threads_local(set_threads, p_int + 28)
        swap = c_rowmajor  # row-major C: compute C^T = B^T A^T in column-major terms
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
        reals[0] = alpha
        reals[1] = 0.0
        reals[2] = 1.0
        real32[0] = alpha
        real32[1] = 0.0
        real32[2] = 1.0
        p_real = reals.ctypes.data if kind == KIND_F64 else real32.ctypes.data
        rsize = 8 if kind == KIND_F64 else 4
        p_chr = chars.ctypes.data
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
            ints = np.zeros(9, np.int32)  # m n k lda ldb ldc 0 threads 1
            reals = np.empty(3, np.float64)  # alpha, 0, 1
            real32 = np.empty(3, np.float32)
            chars = np.empty(2, np.uint8)
            p_int = ints.ctypes.data
            ints[7] = 1
            old_threads = _set_threads_local(set_threads, p_int + 28)
            # Row-major C: compute C^T = B^T A^T in column-major terms.
            chars[0] = _CHAR_N if b_rowmajor else _CHAR_T
            chars[1] = _CHAR_N if a_rowmajor else _CHAR_T
            ints[0] = Ns
            ints[1] = Ms
            ints[2] = K
            ints[3] = ldb
            ints[4] = lda
            ints[5] = Ns
            reals[0] = alpha
            reals[1] = 0.0
            reals[2] = 1.0
            real32[0] = alpha
            real32[1] = 0.0
            real32[2] = 1.0
            p_real = reals.ctypes.data if kind == KIND_F64 else real32.ctypes.data
            a_ks = 1 if a_rowmajor else lda  # element step along K in A (rows x K) and in B (K x cols)
            b_ks = ldb if b_rowmajor else 1
            rsize = 8 if kind == KIND_F64 else 4
            p_chr = chars.ctypes.data
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
        ints = np.zeros(9, np.int32)  # m n k lda ldb ldc 0 threads 1
        reals = np.empty(3, np.float64)  # alpha, 1, 0
        real32 = np.empty(3, np.float32)
        chars = np.empty(4, np.uint8)
        p_int = ints.ctypes.data
        ints[7] = 1
        ints[8] = 1
        chars[2] = _CHAR_N
        chars[3] = _CHAR_N
        old_threads = _set_threads_local(set_threads, p_int + 28)
        swap = c_rowmajor  # row-major C: compute C^T = B^T A^T in column-major terms
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
        reals[0] = alpha
        reals[1] = 1.0
        reals[2] = 0.0
        real32[0] = alpha
        real32[1] = 1.0
        real32[2] = 0.0
        p_real = reals.ctypes.data if kind == KIND_F64 else real32.ctypes.data
        rsize = 8 if kind == KIND_F64 else 4
        p_chr = chars.ctypes.data
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
                                   p_real + 2 * rsize, c_ptr, p_int + 20)  # fmt: skip
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
                                       p_real + (2 * rsize if first else rsize),
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


bsr_mm_serial = _serial(bsr_mm, "bsr_mm_serial")
sampled_serial = _serial(sampled, "sampled_serial")
scatter_mm_serial = _serial(scatter_mm, "scatter_mm_serial")

DISPATCHERS = {
    "bsr_mm": bsr_mm,
    "sampled": sampled,
    "bsr_mm_serial": bsr_mm_serial,
    "sampled_serial": sampled_serial,
    "scatter_mm": scatter_mm,
    "scatter_mm_serial": scatter_mm_serial,
}
