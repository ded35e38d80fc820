r"""The block-row softmax and its gradient (no BLAS: pure loops).

One task per (batch, block row), spread over numba's threads; inside a task, each of the block's ``Ms``
rows is gathered into a contiguous scratch row (``x + bias``), reduced (max), exponentiated, summed and
written back scaled, so every inner loop runs over contiguous memory and vectorizes.

float32 uses :func:`.intrinsics.exp32`, a polynomial ``exp`` that LLVM vectorizes: libm's scalar ``expf``
was 8x slower here, and the softmax is mostly exponentials. float64 uses ``np.exp``. Half types arrive as
float32 (the backend converts). Semantics: see :mod:`bsrkit.backends.cpu.softmax_kernels`.
"""

from __future__ import annotations

import numba
import numpy as np

from bsrkit.backends.cpu.compiled.constants import FASTMATH
from bsrkit.backends.cpu.compiled.intrinsics import exp32
from bsrkit.backends.cpu.compiled.support import njit

__all__ = ["softmax_backward_rows", "softmax_rows"]


@numba.njit(nogil=True, cache=False, fastmath=FASTMATH)
def _normalize_row(row, zero_empty_rows, fast_exp):
    """row := softmax(row) in place (row holds x + bias); a row of -inf only becomes 0 or NaN."""
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
        for k in range(n):
            row[k] = exp32(row[k] - m)  # (t <= 0, or NaN: NaN)
    else:
        for k in range(n):
            row[k] = np.exp(row[k] - m)
    s = row.dtype.type(0.0)
    for k in range(n):
        s += row[k]
    inv = row.dtype.type(1.0) / s
    for k in range(n):
        row[k] = row[k] * inv


@njit(parallel=True, nogil=True, fastmath=FASTMATH)
def softmax_rows(crow, x, bias, bias_of, has_bias, out, zero_empty_rows, fast_exp):
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
        bb = bias_of[b]
        for i in range(Ms):
            # Gather the row (x + bias) contiguously.
            for g in range(g0, g1):
                base = (g - g0) * Ns
                if has_bias:
                    for j in range(Ns):
                        c = bias[bb, g, i, j]  # (an excluded entry stays excluded, NaN or not)
                        row[base + j] = c if c == -np.inf else x[b, g, i, j] + c
                else:
                    for j in range(Ns):
                        row[base + j] = x[b, g, i, j]
            _normalize_row(row, zero_empty_rows, fast_exp)
            for g in range(g0, g1):
                base = (g - g0) * Ns
                for j in range(Ns):
                    out[b, g, i, j] = row[base + j]


@njit(parallel=True, nogil=True, fastmath=FASTMATH)
def softmax_backward_rows(crow, y, grad, out):
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
