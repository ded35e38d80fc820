"""CPU backend: compiled (numba) loops calling the BLAS gemm that torch links."""

from bsrkit.backends.cpu.kernels import blas_layout, bsr_mm_kernel, sampled_kernel

__all__ = ["blas_layout", "bsr_mm_kernel", "sampled_kernel"]
