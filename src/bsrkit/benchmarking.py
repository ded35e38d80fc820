"""Helpers shared by the demo and the benchmark scripts: timing medians and random BSR weights."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["median_seconds", "random_bsr_weight"]


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, after one warm-up call (compile, caches)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def random_bsr_weight(
    n: int, blocksize: int, density: float, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """An n x n float32 BSR matrix with about ``density`` of its blocks stored, and its dense twin."""
    g = torch.Generator().manual_seed(seed)
    nb = n // blocksize
    mask = torch.rand((nb, nb), generator=g) < density
    full = mask.repeat_interleave(blocksize, 0).repeat_interleave(blocksize, 1)
    dense = torch.randn((n, n), generator=g) * full
    return dense.to_sparse_bsr((blocksize, blocksize)), dense
