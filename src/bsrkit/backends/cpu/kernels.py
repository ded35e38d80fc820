"""Fast CPU kernel for ``out[b] (+)= alpha * bsr[b] @ dense[b]``: a compiled loop that calls MKL gemm.

Work split: the output is cut into *tasks*, one per (batch, panel of ``panel`` columns, block row), in
that order. A task's cost is its row's block count plus a small overhead (the plan's prefix sums,
:func:`bsrkit.plans.cpu_mm_plan`); each of the ``nthreads`` workers takes one contiguous run of tasks of
about equal cost, found by binary search inside the kernel. Tasks write disjoint output tiles, so no
reduction is needed; and since a run is panel-major, each worker mostly reads its own columns of
``dense`` (threads splitting N, as a dense gemm does), while small products still split evenly over rows.
Inside a task each block is one gemm with beta=1 (beta=0 for the row's first block when overwriting)
straight into the strided output tile: no temporaries, no Python per block, BLAS single-threaded per
worker (``mkl_set_num_threads_local``).

Each operand is passed as (address, per-batch element offsets, row stride, col stride). The caller
guarantees that one of the two strides of every matrix is 1 (see :func:`blas_layout`); the gemm
transpose flags and leading dimensions follow from which one.

Float16/bfloat16 use MKL's ``gemm_{bf16bf16,f16f16}f32``: half inputs, a float32 output buffer, float32
accumulation. This module never validates or caches (see ``bsrkit.ops``).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

from bsrkit.backends.cpu.blas import mkl_functions

__all__ = ["KIND_BF16", "KIND_F16", "KIND_F32", "KIND_F64", "blas_layout", "bsr_mm_kernel"]

KIND_F32, KIND_F64, KIND_BF16, KIND_F16 = 0, 1, 2, 3
_CBLAS_ROW_MAJOR, _CBLAS_NO_TRANS, _CBLAS_TRANS = 101, 111, 112
_CHAR_N, _CHAR_T = 78, 84


def blas_layout(row_stride: int, col_stride: int, rows: int, cols: int) -> tuple[bool, int] | None:
    """(row_major, leading_dimension) under which BLAS can read a strided matrix, or None.

    BLAS needs unit stride along one dimension and a leading dimension at least the other extent;
    dimensions of size <= 1 may have any stride.
    """
    if col_stride == 1 or cols <= 1:
        ld = row_stride if rows > 1 else max(cols, 1)
        if ld >= max(cols, 1):
            return True, ld
    if row_stride == 1 or rows <= 1:
        ld = col_stride if cols > 1 else max(rows, 1)
        if ld >= max(rows, 1):
            return False, ld
    return None


@functools.cache
def _mkl_ctypes() -> tuple[Any, ...] | None:
    """ctypes prototypes of the MKL entry points, callable from numba: (sgemm, dgemm, gemm_bf16,
    gemm_f16, set_num_threads_local); None when they are missing."""
    fns = mkl_functions()
    if fns is None:
        return None
    i64 = ctypes.c_int64
    ci, cf = ctypes.c_int, ctypes.c_float
    # Fortran gemm: 13 pointers. Pointers are passed as 64-bit integers (same ABI on x86-64/aarch64).
    fortran = ctypes.CFUNCTYPE(None, *[i64] * 13)
    half = ctypes.CFUNCTYPE(None, ci, ci, ci, ci, ci, ci, cf, i64, ci, i64, ci, cf, i64, ci)
    return (
        fortran(fns.sgemm),
        fortran(fns.dgemm),
        half(fns.gemm_bf16),
        half(fns.gemm_f16),
        ctypes.CFUNCTYPE(ci, i64)(fns.set_num_threads_local),
    )


@functools.cache
def bsr_mm_kernel() -> Any:
    """Compile (once per process) and return the kernel; None when MKL entry points are missing."""
    fns = _mkl_ctypes()
    if fns is None:
        return None
    import numba  # deferred: importing numba costs ~0.3 s and is needed only here

    sgemm, dgemm, gemm_bf16, gemm_f16, set_threads_local = fns  # locals: numba freezes them in

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

    @numba.njit(parallel=True, nogil=True, cache=False)
    def kernel(
        kind, crow, col, cum, bsr_of, nthreads,
        a_addr, a_boff, a_gs, a_rowmajor, lda,
        b_addr, b_boff, b_rowmajor, b_rs, b_cs, ldb,
        c_addr, c_boff, c_rs, c_cs, c_rowmajor, ldc,
        Ms, Ks, N, panel, alpha, overwrite, isz_ab, isz_c,
    ):  # fmt: skip
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
            old_threads = set_threads_local(p_int + 28)
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
                    zero_args = (p_chr + 2, p_chr + 3, p_int, p_int + 4, p_int + 24,
                                 p_real, c_ptr, p_int + 20, c_ptr, p_int + 32,
                                 p_real + rsize, c_ptr, p_int + 20)  # fmt: skip
                    if kind == KIND_F64:
                        dgemm(*zero_args)
                    else:
                        sgemm(*zero_args)
                for g in range(g0, g1):
                    a_ptr = a_addr + (a_boff[bb] + g * a_gs) * isz_ab
                    b_ptr = b_addr + (b_boff[b] + col[bb, g] * Ks * b_rs + j0 * b_cs) * isz_ab
                    first = overwrite and g == g0
                    if kind <= KIND_F64:  # float32 or float64: Fortran gemm
                        p_beta = p_real + (rsize if first else 2 * rsize)
                        x_ptr = b_ptr if swap else a_ptr
                        y_ptr = a_ptr if swap else b_ptr
                        if kind == KIND_F32:
                            sgemm(p_chr, p_chr + 1, p_int, p_int + 4, p_int + 8, p_real,
                                  x_ptr, p_int + 12, y_ptr, p_int + 16, p_beta,
                                  c_ptr, p_int + 20)  # fmt: skip
                        else:
                            dgemm(p_chr, p_chr + 1, p_int, p_int + 4, p_int + 8, p_real,
                                  x_ptr, p_int + 12, y_ptr, p_int + 16, p_beta,
                                  c_ptr, p_int + 20)  # fmt: skip
                    else:
                        beta = 0.0 if first else 1.0
                        if kind == KIND_BF16:
                            gemm_bf16(_CBLAS_ROW_MAJOR, ta, tb, Ms, ns, Ks, alpha,
                                      a_ptr, lda, b_ptr, ldb, beta, c_ptr, ldc)  # fmt: skip
                        else:
                            gemm_f16(_CBLAS_ROW_MAJOR, ta, tb, Ms, ns, Ks, alpha,
                                     a_ptr, lda, b_ptr, ldb, beta, c_ptr, ldc)  # fmt: skip
                i += 1
                if i == ntasks:
                    b += 1
                    i = 0
            ints[7] = old_threads
            set_threads_local(p_int + 28)

    return kernel


@functools.cache
def sampled_kernel() -> Any:
    """Compile and return the SDDMM kernel: ``C[b, g] = alpha * A[b, rows[g]] @ B[b, :, cols[g]]``.

    One gemm per stored block with the full inner dimension K (no gathered copies); blocks are split
    evenly over the worker threads (every block costs the same). ``C`` is ``(B, nnz, Ms, Ns)``
    contiguous (float32 for half inputs). None when MKL entry points are missing.
    """
    fns = _mkl_ctypes()
    if fns is None:
        return None
    import numba  # deferred: importing numba costs ~0.3 s and is needed only here

    sgemm, dgemm, gemm_bf16, gemm_f16, set_threads_local = fns  # locals: numba freezes them in

    @numba.njit(parallel=True, nogil=True, cache=False)
    def kernel(
        kind, rows, cols, nthreads,
        a_addr, a_boff, a_rs, a_rowmajor, lda,
        b_addr, b_boff, b_cs, b_rowmajor, ldb,
        c_addr, Ms, Ns, K, alpha, isz_ab, isz_c,
    ):  # fmt: skip
        nbatch = rows.shape[0]
        nnz = rows.shape[1]
        for b in range(nbatch):
            for t in numba.prange(nthreads):
                ints = np.zeros(9, np.int32)  # m n k lda ldb ldc 0 threads 1
                reals = np.empty(2, np.float64)
                real32 = np.empty(2, np.float32)
                chars = np.empty(2, np.uint8)
                p_int = ints.ctypes.data
                ints[7] = 1
                old_threads = set_threads_local(p_int + 28)
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
                real32[0] = alpha
                real32[1] = 0.0
                p_real = reals.ctypes.data if kind == KIND_F64 else real32.ctypes.data
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
                    if kind == KIND_F32:
                        sgemm(p_chr, p_chr + 1, p_int, p_int + 4, p_int + 8, p_real, b_ptr, p_int + 12,
                              a_ptr, p_int + 16, p_real + rsize, c_ptr, p_int + 20)  # fmt: skip
                    elif kind == KIND_F64:
                        dgemm(p_chr, p_chr + 1, p_int, p_int + 4, p_int + 8, p_real, b_ptr, p_int + 12,
                              a_ptr, p_int + 16, p_real + rsize, c_ptr, p_int + 20)  # fmt: skip
                    elif kind == KIND_BF16:
                        gemm_bf16(_CBLAS_ROW_MAJOR, ta, tb, Ms, Ns, K, alpha, a_ptr, lda, b_ptr, ldb,
                                  0.0, c_ptr, Ns)  # fmt: skip
                    else:
                        gemm_f16(_CBLAS_ROW_MAJOR, ta, tb, Ms, Ns, K, alpha, a_ptr, lda, b_ptr, ldb,
                                 0.0, c_ptr, Ns)  # fmt: skip
                ints[7] = old_threads
                set_threads_local(p_int + 28)

    return kernel
