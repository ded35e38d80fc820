"""Direct access to the BLAS that torch itself uses on CPU (MKL, linked into ``libtorch_cpu``).

The CPU backend calls ``gemm`` once per (block, output panel) from compiled code, so it needs raw C
function addresses, not a Python API. Using torch's own MKL means bsrkit's block products run the same
micro-kernels as dense ``torch.mm`` and add no BLAS dependency. On builds without these exports
(e.g. non-MKL aarch64 wheels), :func:`mkl_functions` returns None and the ops use the pure-torch
backend instead.

Calling conventions (MKL LP64: 32-bit integers):

* ``sgemm_``/``dgemm_`` — Fortran: every argument by pointer, column-major.
* ``cblas_gemm_bf16bf16f32``/``cblas_gemm_f16f16f32`` — CBLAS: by value; half inputs, float32 output.
* ``mkl_set_num_threads_local`` — takes a *pointer* to the thread count in this build; returns the
  previous value. Used so that each worker thread runs gemm single-threaded (no oversubscription).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import NamedTuple

import torch

__all__ = ["MKLFunctions", "mkl_functions"]


class MKLFunctions(NamedTuple):
    sgemm: int
    dgemm: int
    gemm_bf16: int
    gemm_f16: int
    set_num_threads_local: int


_SYMBOLS = {
    "sgemm": "sgemm_",
    "dgemm": "dgemm_",
    "gemm_bf16": "cblas_gemm_bf16bf16f32",
    "gemm_f16": "cblas_gemm_f16f16f32",
    "set_num_threads_local": "mkl_set_num_threads_local",
}


@functools.cache
def mkl_functions() -> MKLFunctions | None:
    """Addresses of the MKL entry points exported by torch's CPU library, or None if absent."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    addresses: dict[str, int] = {}
    for field, symbol in _SYMBOLS.items():
        try:
            fn = getattr(lib, symbol)
        except AttributeError:
            return None
        address = ctypes.cast(fn, ctypes.c_void_p).value
        if not address:
            return None
        addresses[field] = address
    return MKLFunctions(**addresses)
