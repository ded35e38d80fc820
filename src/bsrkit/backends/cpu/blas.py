"""The BLAS entry points the compiled CPU kernels call: raw C function addresses, from one *provider*.

The CPU backend calls ``gemm`` once per (block, output panel) from compiled code, so it needs raw C
function addresses, not a Python API. Providers, in order of preference (:func:`blas_provider`):

* ``mkl`` — the MKL that torch itself links into ``libtorch_cpu`` (x86-64 Linux/Windows wheels): bsrkit's
  block products run the same micro-kernels as dense ``torch.mm`` and add no BLAS dependency. All four
  kinds (float32, float64, and bfloat16/float16 through MKL's half gemm), one BLAS thread per worker.
* ``scipy`` — the Fortran ``sgemm``/``dgemm`` that SciPy exports as capsules
  (``scipy.linalg.cython_blas.__pyx_capi__``; OpenBLAS in SciPy's wheels), where torch's library has no
  MKL (aarch64 and macOS wheels). float32 and float64 only; scipy stays an optional dependency.

``$BSRKIT_BLAS`` (``mkl`` or ``scipy``) forces one; with neither available, the ops use the pure-torch
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
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from bsrkit.loading import import_module

__all__ = [
    "BLAS_ENV",
    "PROVIDERS",
    "BLASProvider",
    "MKLFunctions",
    "blas_provider",
    "mkl_functions",
    "scipy_functions",
]

BLAS_ENV = "BSRKIT_BLAS"
PROVIDERS = ("mkl", "scipy")


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


class BLASProvider(NamedTuple):
    """One BLAS's entry points as C addresses; 0 where the provider has none.

    ``sgemm``/``dgemm`` follow the Fortran convention (every argument by pointer). ``set_num_threads_local``
    is 0 where the provider cannot limit the calling thread alone; ``single_thread_mnk`` > 0 then says up
    to which ``m * n * k`` a gemm call stays single-threaded, and the kernels keep every call below it.
    """

    name: str
    sgemm: int
    dgemm: int
    gemm_bf16: int
    gemm_f16: int
    set_num_threads_local: int
    single_thread_mnk: int = 0

    @property
    def has_half(self) -> bool:
        """Whether bfloat16/float16 inputs have a gemm (half inputs, float32 accumulation and output)."""
        return bool(self.gemm_bf16 and self.gemm_f16)


@functools.cache
def scipy_functions() -> BLASProvider | None:
    """SciPy's Fortran ``sgemm``/``dgemm`` (Cython capsules), or None without scipy.

    In SciPy's wheels these run OpenBLAS (pthreads build). OpenBLAS has no per-thread thread count (its
    ``openblas_set_num_threads_local`` sets the process-wide count), so none is set. Instead every gemm
    call is kept at or below OpenBLAS's default threshold for threading (m*n*k <= 64**3), under which it
    runs single-threaded: a larger call would start OpenBLAS's own pool from each kernel worker (measured
    5-7x slower at blocksize 64 on 2 cores). A build with a lower threshold still threads those calls;
    ``OPENBLAS_NUM_THREADS=1`` then avoids it.
    """
    try:
        cython_blas = import_module("scipy.linalg.cython_blas")  # (the first product's: bsrkit.loading)
    except ImportError:
        return None
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype = ctypes.c_char_p
    get_name.argtypes = [ctypes.py_object]
    addresses = []
    for name in ("sgemm", "dgemm"):
        capsule = cython_blas.__pyx_capi__.get(name)
        if capsule is None:
            return None
        address = get_pointer(capsule, get_name(capsule))
        if not address:
            return None
        addresses.append(address)
    return BLASProvider(
        "scipy", addresses[0], addresses[1], 0, 0, 0, single_thread_mnk=_OPENBLAS_SINGLE_THREAD_MNK
    )


# OpenBLAS interface/gemm.c: m*n*k <= SMP_THRESHOLD_MIN (65536) * GEMM_MULTITHREAD_THRESHOLD (4) -> 1 thread.
_OPENBLAS_SINGLE_THREAD_MNK = 65536 * 4


def _mkl_provider() -> BLASProvider | None:
    fns = mkl_functions()
    return None if fns is None else BLASProvider("mkl", *fns)


def blas_provider() -> BLASProvider | None:
    """The provider ``$BSRKIT_BLAS`` names, else the first available of :data:`PROVIDERS`; None if none.

    Raises ``ValueError`` for an unknown name. A forced provider that is unavailable gives None (with a
    warning): the ops then fall back to the pure-torch backend.
    """
    return _provider(os.environ.get(BLAS_ENV, ""))


@functools.cache
def _provider(forced: str) -> BLASProvider | None:
    finders: dict[str, Callable[[], BLASProvider | None]] = {"mkl": _mkl_provider, "scipy": scipy_functions}
    if not forced:
        for name in PROVIDERS:
            found = finders[name]()
            if found is not None:
                return found
        return None
    if forced not in finders:
        raise ValueError(f"blas_provider(): expected ${BLAS_ENV} in {PROVIDERS} or unset, got {forced!r}")
    found = finders[forced]()
    if found is None:
        warnings.warn(
            f"${BLAS_ENV}={forced}: that BLAS is not available here; the CPU kernels are disabled",
            RuntimeWarning,
            stacklevel=2,
        )
    return found
