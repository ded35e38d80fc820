"""CPU backend: compiled (numba) loops calling the BLAS gemm that torch links.

``kernels`` holds the compiled loops and ``blas`` the BLAS entry points; ``backend`` marshals validated
tensors into the loops' arguments. Importing this package imports neither numba nor the kernels' code
generation: the loops compile on first use.
"""

from bsrkit.backends.cpu.backend import CpuBackend

__all__ = ["CpuBackend"]
