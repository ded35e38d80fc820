r"""Compiled CPU kernels of the block-row softmax and its gradient (no BLAS: pure loops).

One task per (batch, block row), spread over numba's threads; inside a task, each of the block's ``Ms``
rows is gathered into a contiguous scratch row (``x + bias``), reduced (max), exponentiated, summed and
written back scaled, so every inner loop runs over contiguous memory and vectorizes.

float32 uses a polynomial ``exp`` (``2**n * p(f)``, relative error < 1e-6, measured) that LLVM vectorizes:
libm's scalar ``expf`` was 8x slower here (4.8 ns vs 0.6 ns per element, one core), and the softmax is
mostly exponentials. float64 uses ``np.exp``. Half types arrive as float32 (the backend converts).

Semantics (``Backend.softmax``): a row's entries are every column of every stored block of its block row;
a row whose entries are all ``-inf`` gives 0 (``zero_empty_rows``) or NaN (as ``torch.softmax``); NaN
propagates to its row. numba is imported on the first call of :func:`softmax_kernel`, not on import.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from bsrkit.loading import import_module

__all__ = ["softmax_backward_kernel", "softmax_kernel"]

# Every fast-math flag except 'nnan' and 'ninf': -inf (excluded entries) and NaN must keep their meaning.
_FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}

# exp(t) = 2**(t log2 e) = 2**n * 2**f with n = round(t log2 e), |f| <= 1/2; 2**f by a degree-6 polynomial
# (Taylor coefficients of 2**f). Below t = -87, exp(t) < 1.7e-38 (the smallest normal float32): flushed to 0.
_LOG2E = np.float32(1.4426950408889634)
_C6, _C5, _C4 = np.float32(1.5353362e-4), np.float32(1.3398874e-3), np.float32(9.6181291e-3)
_C3, _C2, _C1 = np.float32(5.5504109e-2), np.float32(2.4022651e-1), np.float32(6.9314718e-1)
_ONE = np.float32(1.0)
_FLUSH = np.float32(-87.0)

# Set by _numba() before compiling: the loops name the module numba and the compiled normalize_row.
numba: Any = None
normalize_row: Any = None


def _normalize_row(row, scale_bits, zero_empty_rows, fast_exp):
    """row := softmax(row) in place (row holds x + bias); a row of -inf only becomes 0 or NaN.
    ``scale_bits`` is int32 scratch of row's length (the float32 exp's powers of two)."""
    n = row.shape[0]
    m = row.dtype.type(-np.inf)
    for k in range(n):
        m = max(m, row[k])
    if m == -np.inf:  # every entry excluded, or NaN (which max passes over)
        empty = True
        for k in range(n):
            if row[k] != row[k]:
                empty = False
        row[:] = row.dtype.type(0.0 if zero_empty_rows and empty else np.nan)
        return
    if fast_exp:
        scales = scale_bits.view(np.float32)
        for k in range(n):
            t = row[k] - m  # <= 0, or NaN
            tc = _FLUSH if t < _FLUSH else t  # NaN passes through (the comparison is False)
            v = tc * _LOG2E
            e = np.floor(v + np.float32(0.5))
            f = v - e
            p = _C6 * f + _C5
            p = p * f + _C4
            p = p * f + _C3
            p = p * f + _C2
            p = p * f + _C1
            p = p * f + _ONE
            row[k] = p
            # 2**e as float bits; 0.0 below the flush threshold (exp(-inf) = 0 exactly).
            scale_bits[k] = 0 if t < _FLUSH else (np.int32(e) + np.int32(127)) << np.int32(23)
        for k in range(n):
            row[k] = row[k] * scales[k]
    else:
        for k in range(n):
            row[k] = np.exp(row[k] - m)
    s = row.dtype.type(0.0)
    for k in range(n):
        s += row[k]
    inv = row.dtype.type(1.0) / s
    for k in range(n):
        row[k] = row[k] * inv


def _softmax_rows(crow, x, bias, bias_of, has_bias, out, zero_empty_rows, fast_exp):
    """out[b, g, i, :] = softmax of row i of block row r(g) of (x + bias[bias_of[b]]), as documented."""
    B, _, Ms, Ns = x.shape
    MB = crow.shape[1] - 1
    for task in numba.prange(B * MB):
        b = task // MB
        r = task % MB
        g0 = crow[b, r]
        g1 = crow[b, r + 1]
        if g0 == g1:
            continue
        n = (g1 - g0) * Ns
        row = np.empty(n, x.dtype)
        scale_bits = np.empty(n, np.int32)
        bb = bias_of[b]
        for i in range(Ms):
            # Gather the row (x + bias) contiguously, and its maximum.
            for g in range(g0, g1):
                base = (g - g0) * Ns
                if has_bias:
                    for j in range(Ns):
                        c = bias[bb, g, i, j]  # (an excluded entry stays excluded, NaN or not)
                        row[base + j] = c if c == -np.inf else x[b, g, i, j] + c
                else:
                    for j in range(Ns):
                        row[base + j] = x[b, g, i, j]
            normalize_row(row, scale_bits, zero_empty_rows, fast_exp)
            for g in range(g0, g1):
                base = (g - g0) * Ns
                for j in range(Ns):
                    out[b, g, i, j] = row[base + j]


def _softmax_backward_rows(crow, y, grad, out):
    """out = y * (grad - sum_row(grad * y)) per row of each block row."""
    B, _, Ms, Ns = y.shape
    MB = crow.shape[1] - 1
    for task in numba.prange(B * MB):
        b = task // MB
        r = task % MB
        g0 = crow[b, r]
        g1 = crow[b, r + 1]
        for i in range(Ms):
            acc = y.dtype.type(0.0)
            for g in range(g0, g1):
                for j in range(Ns):
                    acc += y[b, g, i, j] * grad[b, g, i, j]
            for g in range(g0, g1):
                for j in range(Ns):
                    out[b, g, i, j] = y[b, g, i, j] * (grad[b, g, i, j] - acc)


@functools.cache
def _numba() -> Any:
    global numba, normalize_row
    numba_module = import_module("numba")  # deferred (~0.3 s), off the main thread (see bsrkit.loading)

    numba = numba_module
    normalize_row = numba.njit(nogil=True, cache=True, fastmath=_FASTMATH)(_normalize_row)
    return numba


@functools.cache
def softmax_kernel() -> Any:
    """The compiled forward loop (compiled once per process per dtype; numba's cache keeps it on disk)."""
    numba = _numba()
    return numba.njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH)(_softmax_rows)


@functools.cache
def softmax_backward_kernel() -> Any:
    numba = _numba()
    return numba.njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH)(_softmax_backward_rows)
