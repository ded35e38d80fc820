r"""Fused CPU forward of block-sparse attention (float32 and float64): per (batch, block row) task,

1. ``S = scale * Q_r K_c^T`` for the row's stored blocks, by MKL gemm into a thread-local ``Ms x n`` row
   buffer (``n`` = stored columns of the block row; runs of adjacent block columns are one gemm);
2. the row softmax in place (``+ bias``; rows with nothing allowed give 0), by the compiled row
   normaliser of :mod:`.softmax_kernels`; the weights are copied out when the backward needs them;
3. ``O_r = P V_c`` by gemm (beta = 1 after the first run) straight into the output rows.

Why fused: the composed path (SDDMM, softmax, BSR product) writes and rereads the ``nnz * Ms * Ns``
scores three times; here they stay in the worker's cache. Measured at L = 4096, H = 8, D = 64, a
+-512 window of 128-blocks, 2 threads: see docs/performance.md. numba and MKL as in :mod:`.kernels`
(each worker runs single-threaded gemm, set through ``mkl_set_num_threads_local``).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

import bsrkit.backends.cpu.softmax_kernels as softmax_kernels
from bsrkit.backends.cpu.blas import mkl_functions

__all__ = ["attention_kernel"]

_CHAR_N, _CHAR_T = 78, 84


@functools.cache
def _mkl_ctypes() -> tuple[Any, ...] | None:
    """ctypes prototypes of MKL's sgemm, dgemm and mkl_set_num_threads_local (numba freezes them into this
    in-process compile), or None without MKL: then attention takes the composed path."""
    fns = mkl_functions()
    if fns is None:
        return None
    i64 = ctypes.c_int64
    fortran = ctypes.CFUNCTYPE(None, *[i64] * 13)  # Fortran gemm: 13 pointers, passed as 64-bit ints
    set_threads = ctypes.CFUNCTYPE(ctypes.c_int, i64)(fns.set_num_threads_local)
    return fortran(fns.sgemm), fortran(fns.dgemm), None, None, set_threads


@functools.cache
def attention_kernel() -> Any:
    """Compile (once per process) and return the fused kernel; None when MKL's gemm is missing."""
    fns = _mkl_ctypes()
    if fns is None:
        return None
    import numba  # deferred: importing numba costs ~0.3 s and is needed only here

    sgemm, dgemm, _, _, set_threads_local = fns  # locals: numba freezes them in
    normalize_row = softmax_kernels.row_normalizer()

    @numba.njit(parallel=True, nogil=True, cache=False)
    def kernel(
        crow, col, q, k, v, bias, bias_of, has_bias, out, weights, write_weights,
        scale, Ms, Ns, f64, nthreads,
    ):  # fmt: skip
        B, L, E = q.shape
        Ev = v.shape[2]
        MB = crow.shape[1] - 1
        isz = 8 if f64 else 4
        ntasks = B * MB
        for t in numba.prange(nthreads):
            ints = np.zeros(9, np.int32)  # m n k lda ldb ldc ldc2 threads 1
            reals = np.empty(3, np.float64)  # alpha, 0, 1
            real32 = np.empty(3, np.float32)
            chars = np.empty(2, np.uint8)
            p_int = ints.ctypes.data
            ints[7] = 1
            old_threads = set_threads_local(p_int + 28)
            reals[0] = scale
            reals[1] = 0.0
            reals[2] = 1.0
            real32[0] = scale
            real32[1] = 0.0
            real32[2] = 1.0
            p_real = reals.ctypes.data if f64 else real32.ctypes.data
            p_one = reals.ctypes.data + 16 if f64 else real32.ctypes.data + 8
            p_chr = chars.ctypes.data
            for task in range((ntasks * t) // nthreads, (ntasks * (t + 1)) // nthreads):
                b = task // MB
                r = task % MB
                g0 = crow[b, r]
                g1 = crow[b, r + 1]
                o_ptr = out.ctypes.data + ((b * L + r * Ms) * Ev) * isz
                if g0 == g1:
                    for i in range(r * Ms, (r + 1) * Ms):
                        out[b, i, :] = 0.0
                    continue
                n = (g1 - g0) * Ns
                buf = np.empty((Ms, n), q.dtype)
                scale_bits = np.empty(n, np.int32)
                q_ptr = q.ctypes.data + ((b * L + r * Ms) * E) * isz
                # 1. S = scale * Q_r K^T, one gemm per run of adjacent block columns. Row-major C (Ms x w)
                #    is column-major C^T = K_run Q_r^T: transa = T (K row-major), transb = N.
                g = g0
                while g < g1:
                    run = 1
                    while g + run < g1 and col[b, g + run] == col[b, g] + run:
                        run += 1
                    chars[0] = _CHAR_T
                    chars[1] = _CHAR_N
                    ints[0] = run * Ns
                    ints[1] = Ms
                    ints[2] = E
                    ints[3] = E
                    ints[4] = E
                    ints[5] = n
                    k_ptr = k.ctypes.data + ((b * k.shape[1] + col[b, g] * Ns) * E) * isz
                    c_ptr = buf.ctypes.data + ((g - g0) * Ns) * isz
                    args = (p_chr, p_chr + 1, p_int, p_int + 4, p_int + 8, p_real, k_ptr, p_int + 12,
                            q_ptr, p_int + 16, p_real + isz, c_ptr, p_int + 20)  # fmt: skip
                    if f64:
                        dgemm(*args)
                    else:
                        sgemm(*args)
                    g += run
                # 2. The softmax of each row, in place.
                bb = bias_of[b]
                for i in range(Ms):
                    row = buf[i]
                    if has_bias:
                        for gg in range(g0, g1):
                            base = (gg - g0) * Ns
                            for j in range(Ns):
                                row[base + j] += bias[bb, gg, i, j]
                    normalize_row(row, scale_bits, True, not f64)
                    if write_weights:
                        for gg in range(g0, g1):
                            base = (gg - g0) * Ns
                            for j in range(Ns):
                                weights[b, gg, i, j] = row[base + j]
                # 3. O_r = P V: column-major O^T (Ev x Ms) = V_run^T P_run^T, both transa/transb = N.
                g = g0
                first = True
                while g < g1:
                    run = 1
                    while g + run < g1 and col[b, g + run] == col[b, g] + run:
                        run += 1
                    chars[0] = _CHAR_N
                    chars[1] = _CHAR_N
                    ints[0] = Ev
                    ints[1] = Ms
                    ints[2] = run * Ns
                    ints[3] = Ev
                    ints[4] = n
                    ints[6] = Ev
                    v_ptr = v.ctypes.data + ((b * v.shape[1] + col[b, g] * Ns) * Ev) * isz
                    p_ptr = buf.ctypes.data + ((g - g0) * Ns) * isz
                    p_beta = p_real + isz if first else p_one
                    args = (p_chr, p_chr + 1, p_int, p_int + 4, p_int + 8, p_one, v_ptr, p_int + 12,
                            p_ptr, p_int + 16, p_beta, o_ptr, p_int + 24)  # fmt: skip
                    if f64:
                        dgemm(*args)
                    else:
                        sgemm(*args)
                    first = False
                    g += run
            ints[7] = old_threads
            set_threads_local(p_int + 28)

    return kernel
