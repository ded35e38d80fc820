# mypy: disable-error-code="call-arg,var-annotated"
# (mypy cannot type what the intrinsics return.)
"""bsr @ dense by BLAS gemm: one gemm per (stored block, panel of output columns).

See :mod:`bsrkit.backends.cpu.kernels` for the work split and the operands' layout. The BLAS entry points
are the record's last fields (addresses, 0: absent), filled in by the caller's provider.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from bsrkit.backends.cpu.compiled.constants import KIND_BF16, KIND_F64
from bsrkit.backends.cpu.compiled.intrinsics import (
    CBLAS_NO_TRANS,
    CBLAS_ROW_MAJOR,
    CBLAS_TRANS,
    call_cblas_gemm_half,
    call_fortran_gemm,
    gemm_scalars,
    index_mismatches,
    set_threads_local,
    task_bound,
)
from bsrkit.backends.cpu.compiled.support import (
    Address,
    Bool,
    Float,
    Floats2,
    Int,
    Ints1,
    Ints2,
    check_fields,
    njit,
)

__all__ = ["BsrMMArgs", "bsr_mm"]


@njit(parallel=True, nogil=True)
def bsr_mm(
    kind, crow, col, cum, bsr_of, nthreads,
    a_addr, a_boff, a_gs, a_rowmajor, lda,
    b_addr, b_boff, b_rowmajor, b_rs, b_cs, ldb,
    c_addr, c_boff, c_rs, c_cs, c_rowmajor, ldc,
    Ms, Ks, N, panel, alpha, overwrite, isz_ab, isz_c,
    proof, crow_live, col_live, live_wide,
    sgemm, dgemm, gemm_bf16, gemm_f16, set_threads,
):  # fmt: skip
    """See :class:`BsrMMArgs` and :mod:`bsrkit.backends.cpu.kernels`."""
    proof[1] = 0
    nbatch = bsr_of.shape[0]
    rows = crow.shape[1] - 1
    npanels = (N + panel - 1) // panel
    ntasks = npanels * rows  # per batch
    if ntasks == 0:
        return
    check = proof[0] != 0
    ncol = col.shape[1]
    differ = 0
    bstart = np.empty(nbatch + 1, np.float64)  # cost before each batch's first task
    bstart[0] = 0.0
    for b in range(nbatch):
        bstart[b + 1] = bstart[b] + npanels * cum[bsr_of[b], rows]
    gemm = dgemm if kind == KIND_F64 else sgemm
    gemm_half = gemm_bf16 if kind == KIND_BF16 else gemm_f16
    for t in numba.prange(nthreads):
        swap = c_rowmajor  # row-major C: compute C^T = B^T A^T in column-major terms
        ints, p_int, p_real, rsize, p_chr = gemm_scalars(kind, alpha, swap, a_rowmajor, b_rowmajor, lda, ldb,
                                                         ldc, Ks)  # fmt: skip
        old_threads = set_threads_local(set_threads, p_int + 28)
        ta = CBLAS_NO_TRANS if a_rowmajor else CBLAS_TRANS
        tb = CBLAS_NO_TRANS if b_rowmajor else CBLAS_TRANS
        b, i = task_bound(t, nthreads, bstart, cum, bsr_of, rows, ntasks)
        b_end, i_end = task_bound(t + 1, nthreads, bstart, cum, bsr_of, rows, ntasks)
        n = 0  # this worker's index ranges that differ (the in-loop proof)
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
            if check and j0 == 0:  # (in the first panel: as in compiled.small, each entry once per batch)
                n += index_mismatches(
                    crow, bb, 0 if r == 0 else r + 1, r + 2, crow_live, bb * (rows + 1), live_wide
                )
                n += index_mismatches(col, bb, g0, g1, col_live, bb * ncol, live_wide)
            c_ptr = c_addr + (c_boff[b] + r * Ms * c_rs + j0 * c_cs) * isz_c
            if g0 == g1 and overwrite:  # an empty block row: gemm with k = 0, beta = 0 writes 0
                call_fortran_gemm(gemm if kind <= KIND_F64 else sgemm, p_chr + 2, p_chr + 3, p_int,
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
                    call_fortran_gemm(gemm, p_chr, p_chr + 1, p_int, p_int + 4, p_int + 8, p_real,
                                      x_ptr, p_int + 12, y_ptr, p_int + 16, p_beta,
                                      c_ptr, p_int + 20)  # fmt: skip
                else:
                    beta = 0.0 if first else 1.0
                    call_cblas_gemm_half(gemm_half, CBLAS_ROW_MAJOR, ta, tb, Ms, ns, Ks, alpha,
                                         a_ptr, lda, b_ptr, ldb, beta, c_ptr, ldc)  # fmt: skip
            i += 1
            if i == ntasks:
                b += 1
                i = 0
        if set_threads != 0:
            ints[7] = old_threads
            set_threads_local(set_threads, p_int + 28)
        differ += n  # (a reduction over the workers)
    proof[1] = differ


class BsrMMArgs(NamedTuple):
    """:func:`bsr_mm`'s arguments, in order (the one place that order is written)."""

    kind: Int  # a KIND_*
    crow: Ints2  # the plan's (batches, rows + 1) row pointers
    col: Ints2
    cum: Floats2  # the rows' cost prefix sums
    bsr_of: Ints1  # the bsr batch of each output batch
    nthreads: Int
    a_addr: Address  # blocks: block g of batch b at element a_boff[b] + g * a_gs
    a_boff: Ints1
    a_gs: Int
    a_rowmajor: Bool
    lda: Int
    b_addr: Address  # dense: element b_boff[b] + k * b_rs + j * b_cs
    b_boff: Ints1
    b_rowmajor: Bool
    b_rs: Int
    b_cs: Int
    ldb: Int
    c_addr: Address  # out: element c_boff[b] + i * c_rs + j * c_cs
    c_boff: Ints1
    c_rs: Int
    c_cs: Int
    c_rowmajor: Bool
    ldc: Int
    Ms: Int
    Ks: Int
    N: Int
    panel: Int  # output columns per gemm call
    alpha: Float
    overwrite: Bool
    isz_ab: Int  # element sizes in bytes: blocks and dense, out
    isz_c: Int
    proof: Ints1  # the in-loop proof: as compiled.small.BsrMMSmallArgs's (compared in the first panel)
    crow_live: Int
    col_live: Int
    live_wide: Bool
    sgemm: Int = 0  # BLAS addresses (0: absent), from the provider
    dgemm: Int = 0
    gemm_bf16: Int = 0
    gemm_f16: Int = 0
    set_threads: Int = 0


check_fields(BsrMMArgs, bsr_mm)
