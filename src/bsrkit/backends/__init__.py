"""The product backends and their registry; the contract they implement is in :mod:`.base`.

Importing this package imports neither numba nor triton: each backend loads its kernels on first use.
"""

from __future__ import annotations

from bsrkit.backends.base import Backend
from bsrkit.backends.cpu import CpuBackend
from bsrkit.backends.torch_ops import TorchBackend
from bsrkit.backends.triton import TritonBackend

__all__ = ["BACKENDS", "Backend"]

# In the dispatcher's order of preference: compiled backends first, the portable fallback last.
BACKENDS: dict[str, Backend] = {"cpu": CpuBackend(), "triton": TritonBackend(), "torch": TorchBackend()}
