"""GPU backend in Triton (optional).

Nothing here imports triton: :func:`available` only looks for the package, and the kernels
(:mod:`bsrkit.backends.triton.kernels`) are imported on the first product dispatched to this backend.
On CPU tensors the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` set before the first
import), which is how the test suite checks them without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os

__all__ = ["available", "interpreting"]


@functools.cache
def available() -> bool:
    """True when the ``triton`` package is installed (it is not imported)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
