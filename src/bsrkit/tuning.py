"""Kernel parameters: defaults, and validation of a user's ``meta=`` override.

Tuning stays out of kernels: every op takes ``meta=`` (a dict) and otherwise asks this module. The
persisted per-device tuning table and the tuner come with the CLI (``bsrkit tune``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["cpu_mm_meta", "scatter_mm_meta"]

# Output panel width (columns) per gemm call. Measured (docs/performance.md): 128-512 are within noise
# of each other at n = 2048-4096; 256 keeps a (K x 256) float32 dense panel of a 32-wide block column
# in L2 and gives each gemm enough columns to amortise its call.
_DEFAULT_PANEL = 256
_CPU_KEYS = frozenset({"panel", "nthreads"})


def cpu_mm_meta(op: str, N: int, meta: dict[str, Any] | None) -> dict[str, int]:
    """Parameters of the CPU kernel: ``panel`` (columns per gemm) and ``nthreads`` (worker threads)."""
    result = {"panel": _DEFAULT_PANEL, "nthreads": max(1, torch.get_num_threads())}
    if meta:
        unknown = set(meta) - _CPU_KEYS
        if unknown:
            raise ValueError(
                f"{op}(): expected meta keys among {sorted(_CPU_KEYS)} for the CPU backend, "
                f"got unknown {sorted(unknown)}"
            )
        for name, value in meta.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{op}(): expected meta[{name!r}] to be an int >= 1, got {value!r}")
        result.update(meta)
    result["panel"] = min(result["panel"], max(N, 1))
    return result


# SPLIT_N by N, as in torch.sparse._triton_ops.scatter_mm_meta, so indices data are interchangeable.
_SPLIT_N_BY_N = {16: 1, 32: 2, 64: 4, 128: 8, 256: 16, 512: 8, 1024: 16, 4096: 32, 8192: 64}


def scatter_mm_meta(M: int, K: int, N: int, Ms: int, Ks: int, **meta_input: Any) -> dict[str, Any]:
    """Meta of the ``bsr_strided_mm*`` indices formats: ``SPLIT_N`` (N is cut in SPLIT_N panels)."""
    split_n = meta_input.pop("SPLIT_N", None)
    if split_n is None:
        split_n = _SPLIT_N_BY_N.get(N, 16)
        if Ms >= 512 and N >= 2048:
            split_n = 1
        split_n = math.gcd(N, split_n) if N > 0 else 1  # must divide N
    elif not isinstance(split_n, int) or split_n < 1 or (N > 0 and N % split_n):
        raise ValueError(
            f"bsr_scatter_mm_indices_data(): expected SPLIT_N to be a positive divisor of N == {N}, "
            f"got {split_n!r}"
        )
    return {"SPLIT_N": split_n, **meta_input}
