# mypy: disable-error-code="call-arg,var-annotated"
# (mypy cannot type what the intrinsics return.)
r"""The fused CPU attention loops (numba calling MKL gemm), cached on disk (see :mod:`.support`).

Imported by :mod:`bsrkit.backends.cpu.attention_kernels` at the first fused attention call, never by
``import bsrkit``. The gemm and thread-count entry points arrive as int64 addresses and are called through
:mod:`.intrinsics`.

Both loops walk (batch, block row) tasks, each worker one contiguous run of them (``bounds``, chosen by
the caller to balance stored blocks). A block row's stored blocks are taken in *chunks*: runs of
adjacent block columns at most ``width`` columns wide, so that the chunk's ``Ms x width`` scores stay in
the worker's L2 cache and each gemm is one call over the whole chunk. ``bias_idx[mask batch, block]``
says per stored block: ``-1`` every entry allowed, no bias (no work); ``-2`` nothing allowed (the block
is skipped: no gemm, no exp); ``i >= 0`` add ``bias[i]`` (partial blocks: the edges of a window, the
diagonal of a causal mask, float masks).

Forward (flash-attention style online softmax over a row's chunks), for rows ``i`` of block row ``r``:

.. math::
    S = s\,Q_r K_c^T + C, \quad m_i' = \max(m_i, \max_j S_{ij}), \quad
    P_{ij} = e^{S_{ij} - m_i'}, \quad \ell_i' = e^{m_i - m_i'} \ell_i + \textstyle\sum_j P_{ij}, \quad
    O_r' = \mathrm{diag}(e^{m - m'}) O_r + P V_c,

then :math:`O_r /= \ell` and the row's log-sum-exp :math:`\mathrm{lse}_i = m_i + \log \ell_i` is saved
(``-inf`` for a row with nothing allowed; its output is 0). A NaN score (from ``q``, ``k`` or the
bias, at an allowed entry) makes its row's output and lse NaN, as the math does; an excluded entry stays
excluded whatever its score. The backward recomputes
:math:`P = e^{S - \mathrm{lse}}` per chunk (flash-attention 2), with :math:`D_i = \sum_j dO_{ij} O_{ij}`:

.. math::
    dV_c \mathrel{+}= P^T dO_r, \quad dS = P \odot (dO_r V_c^T - D), \quad
    dQ_r \mathrel{+}= s\, dS K_c, \quad dK_c \mathrel{+}= s\, dS^T Q_r.

``dQ`` rows belong to one task. ``dK``/``dV`` of a head are accumulated in place by the worker whose
run holds all of that head's tasks; a head split between workers is accumulated in per-worker side
buffers (``side_head[t] = (head, head)`` or -1) and summed after the parallel loop.

float32 ``exp`` is :func:`.intrinsics.exp32` (a polynomial that LLVM vectorizes); float64 uses ``np.exp``.
Row maxima use LLVM's ``maxnum``, which vectorizes where ``max`` does not (0.07 against 0.35 ns per element).
"""

from __future__ import annotations

import numba
import numpy as np

from bsrkit.backends.cpu.compiled.constants import FASTMATH, KIND_F32, KIND_F64
from bsrkit.backends.cpu.compiled.intrinsics import (
    CHAR_N,
    CHAR_T,
    ZERO32,
    call_fortran_gemm,
    exp32,
    gemm_scalars,
    maxnum,
    set_threads_local,
)
from bsrkit.backends.cpu.compiled.support import njit

__all__ = ["attention_backward", "attention_forward"]

_SKIP, _FULL = -2, -1  # bias_idx codes


@numba.njit(nogil=True, cache=False, fastmath=FASTMATH | {"nnan"})
def _row_max(row):
    """max(row), row nonempty (-inf only if every entry is -inf; NaN entries are passed over, they reach
    the output through the exponentials). Loops index from 0 so that LLVM knows the index >= 0."""
    mx = row[0]
    for j in range(row.shape[0]):
        mx = maxnum(mx, row[j])
    return mx


@numba.njit(nogil=True, cache=False)
def _gemm(fn, scratch, ta, tb, m, n, k, p_alpha, a, lda, b, ldb, p_beta, c, ldc):
    """Column-major ``C = alpha op(A) op(B) + beta C`` by the Fortran gemm at ``fn``; ``scratch`` is an
    int32 array of 8 (Fortran takes every argument by address)."""
    scratch[0] = m
    scratch[1] = n
    scratch[2] = k
    scratch[3] = lda
    scratch[4] = ldb
    scratch[5] = ldc
    scratch[6] = ta  # little-endian: the first byte is the character
    scratch[7] = tb
    p = scratch.ctypes.data
    call_fortran_gemm(fn, p + 24, p + 28, p, p + 4, p + 8, p_alpha, a, p + 12, b, p + 16, p_beta, c, p + 20)


@numba.njit(nogil=True, cache=False)
def _chunk_end(col, bias_idx, b, bm, g, g1, Ns, width):
    """The end of the chunk starting at stored block ``g``: of the run of adjacent, unskipped block
    columns from ``g``, the first of the fewest equal parts at most ``width`` columns wide."""
    e = g + 1
    while e < g1 and col[b, e] == col[b, g] + (e - g) and bias_idx[bm, e] != -2:
        e += 1
    per_chunk = max(width // Ns, 1)
    nchunks = (e - g + per_chunk - 1) // per_chunk
    return g + (e - g + nchunks - 1) // nchunks


@numba.njit(nogil=True, cache=False, fastmath=FASTMATH)
def _add_bias(buf, w, bias_idx, bias, bm, g, e, Ms, Ns):
    """Add the partial blocks' bias to the chunk's scores (``Ms x w``, row-major)."""
    for gg in range(g, e):
        bi = bias_idx[bm, gg]
        if bi >= 0:
            base = (gg - g) * Ns
            for i in range(Ms):
                row = buf[i * w + base : i * w + base + Ns]
                for j in range(Ns):
                    c = bias[bi, i, j]
                    row[j] = c if c == -np.inf else row[j] + c  # (excluded stays excluded, NaN or not)


@numba.njit(nogil=True, cache=False, fastmath=FASTMATH)
def _add_bias_transposed(buf, w, bias_idx, bias, bm, g, e, Ms, Ns):
    """Add the partial blocks' bias to the chunk's transposed scores (``w x Ms``, row-major)."""
    for gg in range(g, e):
        bi = bias_idx[bm, gg]
        if bi >= 0:
            base = (gg - g) * Ns
            for j in range(Ns):
                row = buf[(base + j) * Ms : (base + j + 1) * Ms]
                for i in range(Ms):
                    c = bias[bi, i, j]
                    row[i] = c if c == -np.inf else row[i] + c


@njit(parallel=True, nogil=True, fastmath=FASTMATH)
def attention_forward(
    crow, col, bias_idx, bias, bias_of,
    q, k, v, out, lse,
    scale, Ms, Ns, width, bounds, nthreads, f64,
    sgemm, dgemm, set_threads,
):  # fmt: skip
    """``out = softmax(scale q k^T + bias) v`` over the pattern, and ``lse`` (see the module's
    docstring). q (B, L, E), k (B, S, E), v (B, S, Ev), out (B, L, Ev), lse (B, L): C-contiguous."""
    E = q.shape[2]
    Ev = v.shape[2]
    S = k.shape[1]
    L = q.shape[1]
    MB = crow.shape[1] - 1
    isz = q.itemsize
    gemm = dgemm if f64 else sgemm
    for t in numba.prange(nthreads):
        scratch = np.zeros(8, np.int32)
        # scale, 0, 1 and the BLAS thread count by pointer, in one buffer kept alive by the restore below
        state, p_state, p_scale, rsize, _ = gemm_scalars(KIND_F64 if f64 else KIND_F32, scale, False, True,
                                                         True, 0, 0, 0, 0)  # fmt: skip
        old_threads = set_threads_local(set_threads, p_state + 28)
        p_zero = p_scale + rsize
        p_one = p_scale + 2 * rsize
        buf = np.empty(Ms * width, q.dtype)
        m = np.empty(Ms, q.dtype)
        ell = np.empty(Ms, q.dtype)
        for task in range(bounds[t], bounds[t + 1]):
            b = task // MB
            r = task % MB
            bm = bias_of[b]
            g1 = crow[b, r + 1]
            o = out[b, r * Ms : (r + 1) * Ms]
            o_ptr = out.ctypes.data + (b * L + r * Ms) * Ev * isz
            q_ptr = q.ctypes.data + (b * L + r * Ms) * E * isz
            m[:] = -np.inf
            ell[:] = 0.0
            first = True
            g = crow[b, r]
            while g < g1:
                if bias_idx[bm, g] == _SKIP:
                    g += 1
                    continue
                e = _chunk_end(col, bias_idx, b, bm, g, g1, Ns, width)
                w = (e - g) * Ns
                c0 = col[b, g] * Ns
                # S (Ms x w, row-major) = scale Q_r K_chunk^T: column-major S^T = K_chunk Q_r^T.
                k_ptr = k.ctypes.data + (b * S + c0) * E * isz
                _gemm(gemm, scratch, CHAR_T, CHAR_N, w, Ms, E, p_scale, k_ptr, E, q_ptr, E,
                      p_zero, buf.ctypes.data, w)  # fmt: skip
                _add_bias(buf, w, bias_idx, bias, bm, g, e, Ms, Ns)
                for i in range(Ms):
                    row = buf[i * w : (i + 1) * w]
                    m_new = max(m[i], _row_max(row))
                    if m_new == -np.inf:  # nothing allowed in the row so far, or NaN (maxnum passes it)
                        for j in range(w):
                            if row[j] != row[j]:
                                ell[i] = np.nan  # (the row's output and lse become NaN at the end)
                        row[:] = 0.0
                        continue
                    s = q.dtype.type(0.0)
                    if f64:
                        for j in range(w):
                            p = np.exp(row[j] - m_new)
                            row[j] = p
                            s += p
                    else:
                        for j in range(w):
                            p = exp32(row[j] - m_new)
                            row[j] = p
                            s += p
                    alpha = np.exp(m[i] - m_new)  # 0 while the row had nothing
                    ell[i] = ell[i] * alpha + s
                    m[i] = m_new
                    if not first and alpha != 1.0:
                        for j in range(Ev):
                            o[i, j] *= alpha
                # O_r (+)= P V_chunk: column-major O^T = V_chunk^T P^T.
                _gemm(gemm, scratch, CHAR_N, CHAR_N, Ev, Ms, w, p_one,
                      v.ctypes.data + (b * S + c0) * Ev * isz, Ev, buf.ctypes.data, w,
                      p_zero if first else p_one, o_ptr, Ev)  # fmt: skip
                first = False
                g = e
            for i in range(Ms):
                if first or ell[i] == 0.0:
                    # Nothing allowed: 0, or the 0 * inf = NaN the row's P V formed from an excluded key's
                    # Inf value (as the composed path, the reference and torch's SDPA); o is unwritten when
                    # the row visited no block.
                    if first:
                        o[i, :] = 0.0
                    lse[b, r * Ms + i] = -np.inf
                else:
                    inv = 1.0 / ell[i]
                    for j in range(Ev):
                        o[i, j] *= inv
                    lse[b, r * Ms + i] = m[i] + np.log(ell[i])
        state[7] = old_threads
        if set_threads != 0:
            set_threads_local(set_threads, p_state + 28)


@njit(parallel=True, nogil=True, fastmath=FASTMATH)
def attention_backward(
    crow, col, bias_idx, bias, bias_of,
    q, k, v, out, dout, lse, dq, dk, dv, side_k, side_v, side_head,
    scale, Ms, Ns, width, bounds, nthreads, f64,
    sgemm, dgemm, set_threads,
):  # fmt: skip
    """dq, dk, dv of :func:`attention_forward` (see the module's docstring); every array C-contiguous,
    side_k (nthreads, 2, S, E), side_v (nthreads, 2, S, Ev), side_head (nthreads, 2) int64."""
    E = q.shape[2]
    Ev = v.shape[2]
    S = k.shape[1]
    L = q.shape[1]
    MB = crow.shape[1] - 1
    isz = q.itemsize
    gemm = dgemm if f64 else sgemm
    for t in numba.prange(nthreads):
        scratch = np.zeros(8, np.int32)
        # scale, 0, 1 and the BLAS thread count by pointer, in one buffer kept alive by the restore below
        state, p_state, p_scale, rsize, _ = gemm_scalars(KIND_F64 if f64 else KIND_F32, scale, False, True,
                                                         True, 0, 0, 0, 0)  # fmt: skip
        old_threads = set_threads_local(set_threads, p_state + 28)
        p_zero = p_scale + rsize
        p_one = p_scale + 2 * rsize
        pbuf = np.empty(Ms * width, q.dtype)
        dbuf = np.empty(Ms * width, q.dtype)
        delta = np.empty(Ms, q.dtype)
        shift = np.empty(Ms, q.dtype)
        for slot in range(2):
            if side_head[t, slot] >= 0:
                side_k[t, slot] = 0.0
                side_v[t, slot] = 0.0
        for task in range(bounds[t], bounds[t + 1]):
            b = task // MB
            r = task % MB
            bm = bias_of[b]
            if b == side_head[t, 0]:
                k_acc = side_k.ctypes.data + (t * 2) * S * E * isz
                v_acc = side_v.ctypes.data + (t * 2) * S * Ev * isz
            elif b == side_head[t, 1]:
                k_acc = side_k.ctypes.data + (t * 2 + 1) * S * E * isz
                v_acc = side_v.ctypes.data + (t * 2 + 1) * S * Ev * isz
            else:  # this worker holds every task of head b
                k_acc = dk.ctypes.data + b * S * E * isz
                v_acc = dv.ctypes.data + b * S * Ev * isz
                if r == 0:
                    dk[b] = 0.0
                    dv[b] = 0.0
            q_ptr = q.ctypes.data + (b * L + r * Ms) * E * isz
            do_ptr = dout.ctypes.data + (b * L + r * Ms) * Ev * isz
            dq_ptr = dq.ctypes.data + (b * L + r * Ms) * E * isz
            for i in range(Ms):
                acc = q.dtype.type(0.0)
                for j in range(Ev):
                    acc += dout[b, r * Ms + i, j] * out[b, r * Ms + i, j]
                delta[i] = acc
                x = lse[b, r * Ms + i]
                shift[i] = np.inf if x == -np.inf else x  # (a row with nothing allowed: P = exp(-inf) = 0)
            first = True
            g1 = crow[b, r + 1]
            g = crow[b, r]
            while g < g1:
                if bias_idx[bm, g] == _SKIP:
                    g += 1
                    continue
                e = _chunk_end(col, bias_idx, b, bm, g, g1, Ns, width)
                w = (e - g) * Ns
                c0 = col[b, g] * Ns
                k_ptr = k.ctypes.data + (b * S + c0) * E * isz
                v_ptr = v.ctypes.data + (b * S + c0) * Ev * isz
                # The backward keeps the chunk transposed (w x Ms, row-major: column-major Ms x w), where
                # three of its four products are NN gemms (dV, dK; dQ is NT) and nothing needs rows.
                # S^T = scale K_chunk Q_r^T, then P^T = exp(S^T - lse) in place.
                _gemm(gemm, scratch, CHAR_T, CHAR_N, Ms, w, E, p_scale, q_ptr, E, k_ptr, E,
                      p_zero, pbuf.ctypes.data, Ms)  # fmt: skip
                _add_bias_transposed(pbuf, w, bias_idx, bias, bm, g, e, Ms, Ns)
                for jj in range(w):
                    row = pbuf[jj * Ms : (jj + 1) * Ms]
                    if f64:
                        for i in range(Ms):
                            row[i] = np.exp(row[i] - shift[i])
                    else:
                        for i in range(Ms):
                            row[i] = exp32(min(row[i] - shift[i], ZERO32))  # (rounding: a hair above 0)
                # dV_chunk += P^T dO_r: column-major dV^T = dO_r^T P.
                _gemm(gemm, scratch, CHAR_N, CHAR_N, Ev, w, Ms, p_one, do_ptr, Ev, pbuf.ctypes.data, Ms,
                      p_one, v_acc + c0 * Ev * isz, Ev)  # fmt: skip
                # dP^T = V_chunk dO_r^T (as S^T), then dS^T = P^T (dP^T - D) in place.
                _gemm(gemm, scratch, CHAR_T, CHAR_N, Ms, w, Ev, p_one, do_ptr, Ev, v_ptr, Ev,
                      p_zero, dbuf.ctypes.data, Ms)  # fmt: skip
                for jj in range(w):
                    p_row = pbuf[jj * Ms : (jj + 1) * Ms]
                    ds_row = dbuf[jj * Ms : (jj + 1) * Ms]  # (slices: loops from 0 vectorize)
                    for i in range(Ms):
                        ds_row[i] = p_row[i] * (ds_row[i] - delta[i])
                # dQ_r (+)= scale dS K_chunk: column-major dQ^T = K_chunk^T dS^T (NT);
                # dK_chunk += scale dS^T Q_r: column-major dK^T = Q_r^T dS (NN).
                _gemm(gemm, scratch, CHAR_N, CHAR_T, E, Ms, w, p_scale, k_ptr, E, dbuf.ctypes.data, Ms,
                      p_zero if first else p_one, dq_ptr, E)  # fmt: skip
                _gemm(gemm, scratch, CHAR_N, CHAR_N, E, w, Ms, p_scale, q_ptr, E, dbuf.ctypes.data, Ms,
                      p_one, k_acc + c0 * E * isz, E)  # fmt: skip
                first = False
                g = e
            if first:
                dq[b, r * Ms : (r + 1) * Ms] = 0.0
        state[7] = old_threads
        if set_threads != 0:
            set_threads_local(set_threads, p_state + 28)
    # Heads split between workers: the sum of their side buffers.
    for t in range(nthreads):
        for slot in range(2):
            h = side_head[t, slot]
            if h >= 0:
                dk[h] = 0.0
                dv[h] = 0.0
    for t in range(nthreads):
        for slot in range(2):
            h = side_head[t, slot]
            if h >= 0:
                dk[h] += side_k[t, slot]
                dv[h] += side_v[t, slot]
