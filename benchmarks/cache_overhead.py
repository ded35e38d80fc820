"""Cost of TensorKey creation and of a cache hit, next to functools.lru_cache and torch's plan cache.

Medians of 7 runs per row; the machine may be shared, so compare rows of one run, not runs.

.venv/bin/python benchmarks/cache_overhead.py
"""

from __future__ import annotations

import functools
import statistics
import timeit
import warnings

import torch
import torch.sparse._triton_ops as torch_triton_ops

import bsrkit
from bsrkit import TensorKey, weak_lru_cache
from bsrkit.operand import Operand

warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta state")


def us(fn, number: int = 20000, repeat: int = 7) -> float:
    """Median over `repeat` runs of the mean time per call, in microseconds."""
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    t = torch.randn(256, 256)
    bsr = (torch.randn(1024, 1024) * (torch.rand(1024, 1024) < 0.1)).to_sparse_bsr((32, 32))
    x = torch.randn(1024, 1024)
    print(f"TensorKey(strided):      {us(lambda: TensorKey(t)):6.2f} us")
    print(f"TensorKey(bsr):          {us(lambda: TensorKey(bsr)):6.2f} us")

    @functools.lru_cache(maxsize=128)
    def plain(a):
        return a

    @weak_lru_cache(maxsize=128)
    def weak(a):
        return a + 1

    plain(1)
    weak(t)
    print(f"functools.lru_cache hit (int arg):       {us(lambda: plain(1)):6.2f} us")
    print(f"functools.lru_cache hit (TensorKey arg): {us(lambda: plain(TensorKey(t))):6.2f} us")
    print(f"weak_lru_cache hit (strided tensor):     {us(lambda: weak(t)):6.2f} us")
    # A view re-created on each call finds the entry of its memory (a miss per call before issue 13).
    print(f"weak_lru_cache, view re-created per call: {us(lambda: weak(t[0])):6.2f} us")
    # What a product does to get its plan: the operand (a kept one for a repeated BSR object), then the
    # plan from the operand's validated pattern.
    Operand.of(bsr).plan("cpu_mm", 0)
    kept = us(lambda: Operand.of(bsr).plan("cpu_mm", 0))
    print(f"bsrkit operand and plan, same BSR:       {kept:6.2f} us")
    # A training loop that rebuilds its BSR weight every step from the same index tensors.
    crow, col, values = bsr.crow_indices(), bsr.col_indices(), bsr.values()

    def rebuilt_lookup():
        b = torch.sparse_bsr_tensor(crow, col, values, size=bsr.shape, check_invariants=False)
        return Operand.of(b).plan("cpu_mm", 0)

    rebuilt = us(rebuilt_lookup, number=2000)
    print(f"operand and plan, BSR rebuilt per call:  {rebuilt:6.2f} us (includes the constructor)")
    bsrkit.bsr_scatter_mm_indices_data(bsr, x)
    print(
        "bsrkit.bsr_scatter_mm_indices_data hit:  "
        f"{us(lambda: bsrkit.bsr_scatter_mm_indices_data(bsr, x), number=2000):6.2f} us"
    )
    torch_triton_ops.bsr_scatter_mm_indices_data(bsr, x)
    print(
        "torch bsr_scatter_mm_indices_data hit:   "
        f"{us(lambda: torch_triton_ops.bsr_scatter_mm_indices_data(bsr, x), number=2000):6.2f} us"
    )


if __name__ == "__main__":
    main()
