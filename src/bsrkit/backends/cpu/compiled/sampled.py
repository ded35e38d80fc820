# mypy: disable-error-code="call-arg,var-annotated"
# (mypy cannot type what the intrinsics return.)
"""sampled (SDDMM): ``C[b, g] = alpha * A[b, rows[g]] @ B[b, :, cols[g]]``, one gemm per stored block.

See :func:`bsrkit.backends.cpu.kernels.sampled_kernel`.
"""

from __future__ import annotations

from typing import NamedTuple

import numba

from bsrkit.backends.cpu.compiled.constants import KIND_BF16, KIND_F64
from bsrkit.backends.cpu.compiled.intrinsics import (
    CBLAS_NO_TRANS,
    CBLAS_ROW_MAJOR,
    CBLAS_TRANS,
    call_cblas_gemm_half,
    call_fortran_gemm,
    gemm_scalars,
    set_threads_local,
)
from bsrkit.backends.cpu.compiled.support import Address, Bool, Float, Int, Ints1, Ints2, check_fields, njit

__all__ = ["SampledArgs", "sampled"]


@njit(parallel=True, nogil=True)
def sampled(
    kind, rows, cols, nthreads,
    a_addr, a_boff, a_rs, a_rowmajor, lda,
    b_addr, b_boff, b_cs, b_rowmajor, ldb,
    c_addr, Ms, Ns, K, alpha, isz_ab, isz_c,
    sgemm, dgemm, gemm_bf16, gemm_f16, set_threads, k_chunk,
):  # fmt: skip
    """See :class:`SampledArgs` and :func:`bsrkit.backends.cpu.kernels.sampled_kernel`."""
    nbatch = rows.shape[0]
    nnz = rows.shape[1]
    gemm = dgemm if kind == KIND_F64 else sgemm
    gemm_half = gemm_bf16 if kind == KIND_BF16 else gemm_f16
    for b in range(nbatch):
        for t in numba.prange(nthreads):
            # Row-major C: compute C^T = B^T A^T in column-major terms.
            ints, p_int, p_real, rsize, p_chr = gemm_scalars(kind, alpha, True, a_rowmajor, b_rowmajor, lda,
                                                             ldb, Ns, K)  # fmt: skip
            ints[0] = Ns
            ints[1] = Ms
            old_threads = set_threads_local(set_threads, p_int + 28)
            a_ks = 1 if a_rowmajor else lda  # element step along K in A (rows x K) and in B (K x cols)
            b_ks = ldb if b_rowmajor else 1
            ta = CBLAS_NO_TRANS if a_rowmajor else CBLAS_TRANS
            tb = CBLAS_NO_TRANS if b_rowmajor else CBLAS_TRANS
            g_lo = (nnz * t) // nthreads
            g_hi = (nnz * (t + 1)) // nthreads
            for g in range(g_lo, g_hi):
                a_ptr = a_addr + (a_boff[b] + rows[b, g] * Ms * a_rs) * isz_ab
                b_ptr = b_addr + (b_boff[b] + cols[b, g] * Ns * b_cs) * isz_ab
                c_ptr = c_addr + ((b * nnz + g) * Ms * Ns) * isz_c
                if kind <= KIND_F64:
                    for k0 in range(0, max(K, 1), k_chunk):  # K == 0: one call (k = 0) writes 0
                        ints[2] = min(k_chunk, K - k0)
                        call_fortran_gemm(gemm, p_chr, p_chr + 1, p_int, p_int + 4, p_int + 8, p_real,
                                          b_ptr + k0 * b_ks * isz_ab, p_int + 12,
                                          a_ptr + k0 * a_ks * isz_ab, p_int + 16,
                                          p_real + (rsize if k0 == 0 else 2 * rsize),
                                          c_ptr, p_int + 20)  # fmt: skip
                else:
                    call_cblas_gemm_half(gemm_half, CBLAS_ROW_MAJOR, ta, tb, Ms, Ns, K, alpha,
                                         a_ptr, lda, b_ptr, ldb, 0.0, c_ptr, Ns)  # fmt: skip
            if set_threads != 0:
                ints[7] = old_threads
                set_threads_local(set_threads, p_int + 28)


class SampledArgs(NamedTuple):
    """:func:`sampled`'s arguments, in order (the one place that order is written)."""

    kind: Int  # a KIND_*
    rows: Ints2  # (batches, nnz) block row and block column of each stored block
    cols: Ints2
    nthreads: Int
    a_addr: Address  # mat1: element a_boff[b] + i * a_rs + k * (1 if a_rowmajor else lda)
    a_boff: Ints1
    a_rs: Int
    a_rowmajor: Bool
    lda: Int
    b_addr: Address  # mat2: element b_boff[b] + k * (ldb if b_rowmajor else 1) + j * b_cs
    b_boff: Ints1
    b_cs: Int
    b_rowmajor: Bool
    ldb: Int
    c_addr: Address  # out: (batches, nnz, Ms, Ns) contiguous
    Ms: Int
    Ns: Int
    K: Int
    alpha: Float
    isz_ab: Int  # element sizes in bytes: mat1 and mat2, out
    isz_c: Int
    sgemm: Int = 0  # BLAS addresses (0: absent), from the provider
    dgemm: Int = 0
    gemm_bf16: Int = 0
    gemm_f16: Int = 0
    set_threads: Int = 0
    k_chunk: Int = 0  # the inner dimension of one Fortran gemm call (< K: blocks accumulate over chunks of K)


check_fields(SampledArgs, sampled)
