r"""Compiled CPU kernels of the block-row softmax and its gradient (no BLAS: pure loops).

The loops are :mod:`.compiled.softmax`'s, compiled once per machine and cached on disk; numba is imported
on the first call of :func:`softmax_kernel`, not on import.

Semantics (``Backend.softmax``): a row's entries are every column of every stored block of its block row;
a row whose entries are all ``-inf`` gives 0 (``zero_empty_rows``) or NaN (as ``torch.softmax``); NaN
propagates to its row. Half types arrive as float32 (the backend converts).
"""

from __future__ import annotations

from typing import Any

from bsrkit.loading import import_module

__all__ = ["softmax_backward_kernel", "softmax_kernel"]


def _loops() -> Any:
    # deferred: imports numba, loads (or compiles) the loops; off the main thread (see bsrkit.loading)
    return import_module("bsrkit.backends.cpu.compiled.softmax")


def softmax_kernel() -> Any:
    """The compiled forward loop (compiled once per dtype and machine: numba's cache keeps it on disk)."""
    return _loops().softmax_rows


def softmax_backward_kernel() -> Any:
    return _loops().softmax_backward_rows
