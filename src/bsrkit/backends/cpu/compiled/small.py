# mypy: disable-error-code="call-arg,var-annotated"
# (mypy cannot type what the intrinsics return.)
"""bsr @ dense for few columns (N <= 16): vector loops over each block row, no BLAS call.

See :func:`bsrkit.backends.cpu.kernels.bsr_mm_small_kernel` for the arguments' meaning; the vector type
is :mod:`.vector`'s. Same tasks and work split as :mod:`.gemm` (one panel).
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from bsrkit.backends.cpu.compiled.constants import DOT_PAIRS, KIND_F64
from bsrkit.backends.cpu.compiled.intrinsics import keep_alive, run_mismatches, task_bound, typed_pointer
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
from bsrkit.backends.cpu.compiled.vector import (
    prefetch,
    vadd,
    vfma,
    vlane,
    vload,
    vload_pairs,
    vmul,
    vsplat,
    vstore,
    vsum,
    vwidth,
    vzero,
)

__all__ = ["BsrMMSmallArgs", "bsr_mm_small"]

# How far ahead of its reads the dot loop prefetches the blocks: one 32 x 32 float32 block. Measured on a
# decode step's 56 layers streamed from memory (benchmarks/layer_sweep.py, docs/performance.md).
PREFETCH_BYTES = 4096

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
def _dot_pairs_in_registers(A, a0, a_gs, a_rs, X, x0, cols, g0, g1, C, c0, c_rs, c_cs, Ms, Ks, L, alpha,
                            overwrite, zero):  # fmt: skip
    """:func:`_dot_row` for X the row-major ``(K, 2)`` dense operand itself (``DOT_PAIRS``), rows
    outermost: each step's two columns taken from one load by shuffles, and four rows' partial sums (8
    vectors) kept in registers across all the row's blocks, stored once. The row's part of X (blocks x Ks
    x 2) is re-read per group of four rows, from L1. (Every other dot loop runs blocks outermost: see
    :func:`_dot_row`.)"""
    vz = vzero(zero)
    i = 0
    while i + 4 <= Ms:
        p00 = p10 = p20 = p30 = p01 = p11 = p21 = p31 = vz
        for g in range(g0, g1):
            r = a0 + g * a_gs + i * a_rs
            xb = x0 + cols[g] * Ks * 2
            for k in range(0, Ks, L):
                x0v, x1v = vload_pairs(X, xb + 2 * k)
                a0v = vload(A, r + k)
                a1v = vload(A, r + a_rs + k)
                a2v = vload(A, r + 2 * a_rs + k)
                a3v = vload(A, r + 3 * a_rs + k)
                p00 = vfma(a0v, x0v, p00)
                p10 = vfma(a1v, x0v, p10)
                p20 = vfma(a2v, x0v, p20)
                p30 = vfma(a3v, x0v, p30)
                p01 = vfma(a0v, x1v, p01)
                p11 = vfma(a1v, x1v, p11)
                p21 = vfma(a2v, x1v, p21)
                p31 = vfma(a3v, x1v, p31)
        c = c0 + i * c_rs
        _store(C, c, alpha, overwrite, vsum(p00))
        _store(C, c + c_rs, alpha, overwrite, vsum(p10))
        _store(C, c + 2 * c_rs, alpha, overwrite, vsum(p20))
        _store(C, c + 3 * c_rs, alpha, overwrite, vsum(p30))
        _store(C, c + c_cs, alpha, overwrite, vsum(p01))
        _store(C, c + c_rs + c_cs, alpha, overwrite, vsum(p11))
        _store(C, c + 2 * c_rs + c_cs, alpha, overwrite, vsum(p21))
        _store(C, c + 3 * c_rs + c_cs, alpha, overwrite, vsum(p31))
        i += 4
    while i < Ms:  # the last Ms % 4 rows, one at a time
        p00 = p01 = vz
        for g in range(g0, g1):
            r = a0 + g * a_gs + i * a_rs
            xb = x0 + cols[g] * Ks * 2
            for k in range(0, Ks, L):
                x0v, x1v = vload_pairs(X, xb + 2 * k)
                a0v = vload(A, r + k)
                p00 = vfma(a0v, x0v, p00)
                p01 = vfma(a0v, x1v, p01)
        c = c0 + i * c_rs
        _store(C, c, alpha, overwrite, vsum(p00))
        _store(C, c + c_cs, alpha, overwrite, vsum(p01))
        i += 1


@numba.njit(nogil=True, cache=False)
def _dot_row(A, a0, a_gs, a_rs, X, x0, x_ld, pairs, cols, g0, g1, C, c0, c_rs, c_cs, Ms, Ks, N, Wp, L, alpha,
             overwrite, V, zero):  # fmt: skip
    """Wp = 1, 2 or 4 columns of X (column j at ``x0 + j * x_ld``, contiguous along k): dot products along k
    of the blocks' rows (``a_cs == 1``, Ks a multiple of the L lanes) with X's columns, kept as vector
    partial sums in ``V`` (Ms * Wp vectors) over the row's blocks, summed across lanes at the end. One
    column's (decode's) sums start from zero at each block and are then added to ``V`` (the error grows
    with Ks / L plus the block count, not with K / L; free there: the loop waits on memory); two and
    four columns carry them through ``V`` (the extra add per block measured 6% at N = 4).

    Blocks outermost: the values are read in memory order (one sequential stream), the partial sums
    loaded from and stored to ``V`` (in L1) once per block. Rows outermost (four rows across all the row's
    blocks, partial sums in registers: :func:`_dot_pairs_in_registers`) jumps a block between loads, a
    stream per block that the hardware prefetchers pick up late: measured on a model's layers streamed
    from memory (56 products of 1024 x 1024 and 1024 x 2816, bs 32, density 0.1, N = 1), 27 GB/s blocks
    outermost against 14 rows outermost, and no slower with the weight in cache (docs/performance.md).
    Only ``pairs`` (X read in place from a row-major ``(K, 2)``) runs rows outermost."""
    if pairs:  # (N = Wp = 2)
        _dot_pairs_in_registers(A, a0, a_gs, a_rs, X, x0, cols, g0, g1, C, c0, c_rs, c_cs, Ms, Ks, L, alpha,
                                overwrite, zero)  # fmt: skip
        return
    vz = vzero(zero)
    # One column (decode): each four-row step first asks for the cache lines PREFETCH_BYTES further along
    # the blocks (2 * L elements a line), so that the stream does not wait at every page, where the
    # hardware prefetchers stop. (Two and four columns do 2-4x the arithmetic a load: no gain measured.)
    PD = PREFETCH_BYTES // (32 // L)  # (elements: L lanes are 32 bytes)
    for e in range(0, Ms * Wp * L, L):
        vstore(V, e, vz)
    for g in range(g0, g1):
        ab = a0 + g * a_gs
        xb = x0 + cols[g] * Ks
        if Wp == 1:
            i = 0
            while i + 4 <= Ms:  # four rows at once: four independent sums
                r = ab + i * a_rs
                for e in range(0, 4 * a_rs, 2 * L):
                    prefetch(A, r + PD + e)
                p0 = vz
                p1 = vz
                p2 = vz
                p3 = vz
                for k in range(0, Ks, L):
                    x = vload(X, xb + k)
                    p0 = vfma(vload(A, r + k), x, p0)
                    p1 = vfma(vload(A, r + a_rs + k), x, p1)
                    p2 = vfma(vload(A, r + 2 * a_rs + k), x, p2)
                    p3 = vfma(vload(A, r + 3 * a_rs + k), x, p3)
                vstore(V, i * L, vadd(vload(V, i * L), p0))
                vstore(V, (i + 1) * L, vadd(vload(V, (i + 1) * L), p1))
                vstore(V, (i + 2) * L, vadd(vload(V, (i + 2) * L), p2))
                vstore(V, (i + 3) * L, vadd(vload(V, (i + 3) * L), p3))
                i += 4
            while i < Ms:
                r = ab + i * a_rs
                p0 = vz
                for k in range(0, Ks, L):
                    p0 = vfma(vload(A, r + k), vload(X, xb + k), p0)
                vstore(V, i * L, vadd(vload(V, i * L), p0))
                i += 1
        elif Wp == 2:
            i = 0
            while i + 2 <= Ms:  # two rows by two columns: four independent sums, each load used twice
                r = ab + i * a_rs
                v = i * 2 * L
                p00 = vload(V, v)
                p01 = vload(V, v + L)
                p10 = vload(V, v + 2 * L)
                p11 = vload(V, v + 3 * L)
                for k in range(0, Ks, L):
                    xv0 = vload(X, xb + k)
                    xv1 = vload(X, xb + x_ld + k)
                    av0 = vload(A, r + k)
                    av1 = vload(A, r + a_rs + k)
                    p00 = vfma(av0, xv0, p00)
                    p01 = vfma(av0, xv1, p01)
                    p10 = vfma(av1, xv0, p10)
                    p11 = vfma(av1, xv1, p11)
                vstore(V, v, p00)
                vstore(V, v + L, p01)
                vstore(V, v + 2 * L, p10)
                vstore(V, v + 3 * L, p11)
                i += 2
            if i < Ms:
                r = ab + i * a_rs
                v = i * 2 * L
                p00 = vload(V, v)
                p01 = vload(V, v + L)
                for k in range(0, Ks, L):
                    av0 = vload(A, r + k)
                    p00 = vfma(av0, vload(X, xb + k), p00)
                    p01 = vfma(av0, vload(X, xb + x_ld + k), p01)
                vstore(V, v, p00)
                vstore(V, v + L, p01)
        else:
            for i in range(Ms):
                r = ab + i * a_rs
                v = i * 4 * L
                p0 = vload(V, v)
                p1 = vload(V, v + L)
                p2 = vload(V, v + 2 * L)
                p3 = vload(V, v + 3 * L)
                for k in range(0, Ks, L):
                    a = vload(A, r + k)
                    p0 = vfma(a, vload(X, xb + k), p0)
                    p1 = vfma(a, vload(X, xb + x_ld + k), p1)
                    p2 = vfma(a, vload(X, xb + 2 * x_ld + k), p2)
                    p3 = vfma(a, vload(X, xb + 3 * x_ld + k), p3)
                vstore(V, v, p0)
                vstore(V, v + L, p1)
                vstore(V, v + 2 * L, p2)
                vstore(V, v + 3 * L, p3)
    for i in range(Ms):
        for j in range(N):
            _store(C, c0 + i * c_rs + j * c_cs, alpha, overwrite, vsum(vload(V, (i * Wp + j) * L)))


@numba.njit(nogil=True, cache=False)
def _store_lanes(C, cp, c_cs, n, alpha, overwrite, v):
    """The first ``n`` lanes of ``alpha * v`` into (or added to) ``C[cp + j * c_cs]``."""
    if n == vwidth(v) and c_cs == 1:  # a whole vector into a contiguous row: one store
        a = vsplat(alpha)
        vstore(C, cp, vmul(a, v) if overwrite else vfma(a, v, vload(C, cp)))
        return
    for j in range(n):
        _store(C, cp + j * c_cs, alpha, overwrite, vlane(v, j))


@numba.njit(nogil=True, cache=False)
def _axpy_row(A, a0, a_gs, a_rs, a_cs, X, x0, x_ld, cols, g0, g1, C, c0, c_rs, c_cs, Ms, Ks, N, Wp, L,
              alpha, overwrite, V, zero):  # fmt: skip
    """X is (K, Wp) (row k at ``x0 + k * x_ld``, contiguous along its Wp columns, Wp a multiple of L):
    ``acc[i, :] += A[i, k] * X[k, :]`` with one element of A broadcast to all lanes. Block by block (A
    is read in order, the block's rows of X stay in cache), four output rows times 2L (else L) columns
    at a time in registers, each block's from zero, then added to the row's sums in ``V`` (Ms * Wp
    elements; so that an element's rounding error grows with Ks plus the block count, not with K, as
    in a serial sum: 20x less than that at K = 16384, bs 32, on the level of torch.mm's), stored row by row,
    or column by column where C's columns are contiguous (``c_rs == 1``: a layer's row-major output seen
    transposed; lane by lane into rows M apart costs more)."""
    vz = vzero(zero)
    for e in range(0, Ms * Wp, L):
        vstore(V, e, vz)
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
                    c00 = vz
                    c01 = vz
                    c10 = vz
                    c11 = vz
                    c20 = vz
                    c21 = vz
                    c30 = vz
                    c31 = vz
                    for k in range(Ks):
                        xk = xb + k * x_ld + j0
                        x0v = vload(X, xk)
                        x1v = vload(X, xk + L)
                        ak = r + k * a_cs
                        a = vsplat(A[ak])
                        c00 = vfma(a, x0v, c00)
                        c01 = vfma(a, x1v, c01)
                        a = vsplat(A[ak + a_rs])
                        c10 = vfma(a, x0v, c10)
                        c11 = vfma(a, x1v, c11)
                        a = vsplat(A[ak + 2 * a_rs])
                        c20 = vfma(a, x0v, c20)
                        c21 = vfma(a, x1v, c21)
                        a = vsplat(A[ak + 3 * a_rs])
                        c30 = vfma(a, x0v, c30)
                        c31 = vfma(a, x1v, c31)
                    vstore(V, v, vadd(vload(V, v), c00))
                    vstore(V, v + L, vadd(vload(V, v + L), c01))
                    vstore(V, v + Wp, vadd(vload(V, v + Wp), c10))
                    vstore(V, v + Wp + L, vadd(vload(V, v + Wp + L), c11))
                    vstore(V, v + 2 * Wp, vadd(vload(V, v + 2 * Wp), c20))
                    vstore(V, v + 2 * Wp + L, vadd(vload(V, v + 2 * Wp + L), c21))
                    vstore(V, v + 3 * Wp, vadd(vload(V, v + 3 * Wp), c30))
                    vstore(V, v + 3 * Wp + L, vadd(vload(V, v + 3 * Wp + L), c31))
                else:
                    c00 = vz
                    c10 = vz
                    c20 = vz
                    c30 = vz
                    for k in range(Ks):
                        x0v = vload(X, xb + k * x_ld + j0)
                        ak = r + k * a_cs
                        c00 = vfma(vsplat(A[ak]), x0v, c00)
                        c10 = vfma(vsplat(A[ak + a_rs]), x0v, c10)
                        c20 = vfma(vsplat(A[ak + 2 * a_rs]), x0v, c20)
                        c30 = vfma(vsplat(A[ak + 3 * a_rs]), x0v, c30)
                    vstore(V, v, vadd(vload(V, v), c00))
                    vstore(V, v + Wp, vadd(vload(V, v + Wp), c10))
                    vstore(V, v + 2 * Wp, vadd(vload(V, v + 2 * Wp), c20))
                    vstore(V, v + 3 * Wp, vadd(vload(V, v + 3 * Wp), c30))
                i += 4
            while i < Ms:  # the last Ms % 4 rows, one at a time
                v = i * Wp + j0
                r = ab + i * a_rs
                c00 = vz
                for k in range(Ks):
                    c00 = vfma(vsplat(A[r + k * a_cs]), vload(X, xb + k * x_ld + j0), c00)
                vstore(V, v, vadd(vload(V, v), c00))
                if two:
                    c01 = vz
                    for k in range(Ks):
                        c01 = vfma(vsplat(A[r + k * a_cs]), vload(X, xb + k * x_ld + j0 + L), c01)
                    vstore(V, v + L, vadd(vload(V, v + L), c01))
                i += 1
            j0 += 2 * L if two else L
    if c_rs == 1 and c_cs != 1:  # (a column-major tile: each column's Ms sums are contiguous in C)
        for j in range(N):
            for i in range(Ms):
                _store(C, c0 + i + j * c_cs, alpha, overwrite, V[i * Wp + j])
        return
    for i in range(Ms):
        for j0 in range(0, N, L):
            n = min(L, N - j0)  # (padded columns are computed, never stored)
            _store_lanes(C, c0 + i * c_rs + j0 * c_cs, c_cs, n, alpha, overwrite, vload(V, i * Wp + j0))


@numba.njit(nogil=True, cache=False)
def _small_run(zero, L, alpha, t, nthreads, bstart, crow, col, cum, bsr_of, rows,
               a_addr, a_boff, a_gs, a_rs, a_cs, x_addr, x_boff, x_ld, dot,
               c_addr, c_boff, c_rs, c_cs, Ms, Ks, N, Wp, overwrite,
               check, crow_live, col_live, live_wide):  # fmt: skip
    """Worker ``t``'s run of (batch, block row) tasks, in the float type of ``zero`` (L lanes). ``check``:
    also compare the plan's index entries the run reads with the live ones, first (see
    :class:`BsrMMSmallArgs`); returns how many index ranges differ (0 without ``check``)."""
    A = typed_pointer(a_addr, zero)
    X = typed_pointer(x_addr, zero)
    C = typed_pointer(c_addr, zero)
    scratch = np.full(max(Ms * max(4 * L, Wp), 1), zero)  # the row's partial sums (kept alive below)
    V = typed_pointer(scratch.ctypes.data, zero)
    b, i = task_bound(t, nthreads, bstart, cum, bsr_of, rows, rows)
    b_end, i_end = task_bound(t + 1, nthreads, bstart, cum, bsr_of, rows, rows)
    differ = 0
    if check:  # the run's entries: crow[i + 1 ..] (and crow[0] from row 0), col[crow[i] ..], per batch
        differ = run_mismatches(crow, col, bsr_of, rows, b, i, b_end, i_end, crow_live, col_live, live_wide)
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
    keep_alive(scratch)  # (V's array, to here)
    return differ


@njit(parallel=True, nogil=True)
def bsr_mm_small(
    kind, crow, col, cum, bsr_of, nthreads,
    a_addr, a_boff, a_gs, a_rs, a_cs,
    x_addr, x_boff, x_ld, dot,
    c_addr, c_boff, c_rs, c_cs,
    Ms, Ks, N, Wp, alpha, overwrite,
    proof, crow_live, col_live, live_wide,
):  # fmt: skip
    """See :func:`bsrkit.backends.cpu.kernels.bsr_mm_small_kernel`: float32 (kind 0) or float64 (1)."""
    proof[1] = 0
    nbatch = bsr_of.shape[0]
    rows = crow.shape[1] - 1
    if rows == 0:
        return
    check = proof[0] != 0
    bstart = np.empty(nbatch + 1, np.float64)  # cost before each batch's first task
    bstart[0] = 0.0
    for b in range(nbatch):
        bstart[b + 1] = bstart[b] + cum[bsr_of[b], rows]
    differ = 0
    for t in numba.prange(nthreads):
        if kind == KIND_F64:
            n = _small_run(np.float64(0), 4, alpha, t, nthreads, bstart, crow, col, cum, bsr_of, rows,
                           a_addr, a_boff, a_gs, a_rs, a_cs, x_addr, x_boff, x_ld, dot,
                           c_addr, c_boff, c_rs, c_cs, Ms, Ks, N, Wp, overwrite,
                           check, crow_live, col_live, live_wide)  # fmt: skip
        else:
            n = _small_run(np.float32(0), 8, np.float32(alpha), t, nthreads, bstart, crow, col, cum, bsr_of,
                           rows, a_addr, a_boff, a_gs, a_rs, a_cs, x_addr, x_boff, x_ld, dot,
                           c_addr, c_boff, c_rs, c_cs, Ms, Ks, N, Wp, overwrite,
                           check, crow_live, col_live, live_wide)  # fmt: skip
        differ += n  # (a reduction over the workers)
    proof[1] = differ


class BsrMMSmallArgs(NamedTuple):
    """:func:`bsr_mm_small`'s arguments, in order (the one place that order is written)."""

    kind: Int  # KIND_F32 or KIND_F64
    crow: Ints2  # the plan's (batches, rows + 1) row pointers
    col: Ints2
    cum: Floats2  # the rows' cost prefix sums
    bsr_of: Ints1  # the bsr batch of each output batch
    nthreads: Int
    a_addr: Address  # blocks: element a_boff[b] + g * a_gs + i * a_rs + k * a_cs
    a_boff: Ints1
    a_gs: Int
    a_rs: Int
    a_cs: Int
    x_addr: Address  # X: the dense columns in the layout ``dot`` reads
    x_boff: Ints1
    x_ld: Int
    dot: Int  # a DOT_* mode
    c_addr: Address  # out: element c_boff[b] + i * c_rs + j * c_cs
    c_boff: Ints1
    c_rs: Int
    c_cs: Int
    Ms: Int
    Ks: Int
    N: Int
    Wp: Int
    alpha: Float
    overwrite: Bool
    # The in-loop proof (a prepared call's, see bsrkit.backends.cpu.running): with proof[0] != 0, every
    # worker first compares the plan entries its run of tasks reads (per batch: crow[i + 1 ..], crow[0]
    # from row 0, col[crow[i]:crow[stop]]; together every entry of every batch) in one pass per range
    # (intrinsics.run_mismatches) with the live index memory at crow_live and col_live
    # (C-contiguous, int64 or, unless live_wide, int32; addressed from the plan's own indices only). The
    # loop writes the count of index ranges that differ to proof[1] (0 without the comparison).
    proof: Ints1
    crow_live: Int
    col_live: Int
    live_wide: Bool


check_fields(BsrMMSmallArgs, bsr_mm_small)
