# mypy: disable-error-code="call-arg,var-annotated"
# (mypy cannot type what the intrinsics return.)
"""scatter_mm: ``acc[b, tile] += sum over its pairs of blocks[p] @ others[b, q]``, one gemm per pair.

See :func:`bsrkit.backends.cpu.kernels.scatter_mm_kernel`.
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
    set_threads_local,
    task_bound,
)
from bsrkit.backends.cpu.compiled.support import (
    Address,
    Bool,
    Float,
    Floats1,
    Int,
    Ints1,
    Ints2,
    check_fields,
    njit,
)

__all__ = ["ScatterMMArgs", "scatter_mm"]


@njit(parallel=True, nogil=True)
def scatter_mm(
    kind, tiles, pairs, tasks, cum, nbatch, nthreads,
    a_addr, a_gs, a_rowmajor, lda,
    b_addr, b_boff, b_moff, b_rs, b_cs, b_rowmajor, ldb,
    c_addr, c_boff, c_moff, c_rs, c_cs, c_rowmajor, ldc,
    Ms, Ks, alpha, overwrite, isz_ab, isz_c,
    sgemm, dgemm, gemm_bf16, gemm_f16, set_threads,
):  # fmt: skip
    """See :class:`ScatterMMArgs` and :func:`bsrkit.backends.cpu.kernels.scatter_mm_kernel`."""
    ntasks = tasks.shape[0]
    if ntasks == 0 or nbatch == 0:
        return
    # The work split of the bsr @ dense loops, every batch with the same tasks (one "panel" of ntasks rows).
    bstart = np.arange(nbatch + 1) * cum[ntasks]  # cost before each batch's first task
    bsr_of = np.zeros(nbatch, np.int64)
    cum2 = cum.reshape((1, ntasks + 1))
    gemm = dgemm if kind == KIND_F64 else sgemm
    gemm_half = gemm_bf16 if kind == KIND_BF16 else gemm_f16
    for t in numba.prange(nthreads):
        swap = c_rowmajor  # row-major C: compute C^T = B^T A^T in column-major terms
        ints, p_int, p_real, rsize, p_chr = gemm_scalars(kind, alpha, swap, a_rowmajor, b_rowmajor, lda, ldb,
                                                         ldc, Ks)  # fmt: skip
        old_threads = set_threads_local(set_threads, p_int + 28)
        ta = CBLAS_NO_TRANS if a_rowmajor else CBLAS_TRANS
        tb = CBLAS_NO_TRANS if b_rowmajor else CBLAS_TRANS
        b, i = task_bound(t, nthreads, bstart, cum2, bsr_of, ntasks, ntasks)
        b_end, i_end = task_bound(t + 1, nthreads, bstart, cum2, bsr_of, ntasks, ntasks)
        while b < b_end or (b == b_end and i < i_end):
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
                call_fortran_gemm(gemm if kind <= KIND_F64 else sgemm, p_chr + 2, p_chr + 3, p_int,
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
                    call_fortran_gemm(gemm, p_chr, p_chr + 1, p_int, p_int + 4, p_int + 8, p_real,
                                      x_ptr, p_int + 12, y_ptr, p_int + 16,
                                      p_real + (rsize if first else 2 * rsize),
                                      c_ptr, p_int + 20)  # fmt: skip
                else:
                    call_cblas_gemm_half(gemm_half, CBLAS_ROW_MAJOR, ta, tb, Ms, w, Ks, alpha,
                                         a_ptr, lda, b_ptr, ldb, 0.0 if first else 1.0,
                                         c_ptr, ldc)  # fmt: skip
            i += 1
            if i == ntasks:
                b += 1
                i = 0
        if set_threads != 0:
            ints[7] = old_threads
            set_threads_local(set_threads, p_int + 28)


class ScatterMMArgs(NamedTuple):
    """:func:`scatter_mm`'s arguments, in order (the one place that order is written)."""

    kind: Int  # a KIND_*
    tiles: Ints2  # the plan's (T, 5) tiles, (G, 4) pairs, (S, 3) tasks and (S + 1,) task cost prefix sums
    pairs: Ints2
    tasks: Ints2
    cum: Floats1
    nbatch: Int
    nthreads: Int
    a_addr: Address  # blocks: block p at element p * a_gs
    a_gs: Int
    a_rowmajor: Bool
    lda: Int
    b_addr: Address  # others: element b_boff[b] + b_moff[matrix] + row * b_rs + column * b_cs
    b_boff: Ints1
    b_moff: Ints1
    b_rs: Int
    b_cs: Int
    b_rowmajor: Bool
    ldb: Int
    c_addr: Address  # accumulators: element c_boff[b] + c_moff[matrix] + row * c_rs + column * c_cs
    c_boff: Ints1
    c_moff: Ints1
    c_rs: Int
    c_cs: Int
    c_rowmajor: Bool
    ldc: Int
    Ms: Int
    Ks: Int
    alpha: Float
    overwrite: Bool
    isz_ab: Int  # element sizes in bytes: blocks and others, accumulators
    isz_c: Int
    sgemm: Int = 0  # BLAS addresses (0: absent), from the provider
    dgemm: Int = 0
    gemm_bf16: Int = 0
    gemm_f16: Int = 0
    set_threads: Int = 0


check_fields(ScatterMMArgs, scatter_mm)
