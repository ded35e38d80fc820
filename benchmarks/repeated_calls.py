"""Repeated small calls of each cached path, in one process: what a call costs once everything it checks,
plans and prepares is kept. A raw product at n = 64 (with and without ``out=``), a ``BSRLinear`` at 1024²
and N = 1, ``sampled_addmm``, ``bsr_softmax``, and block-sparse attention with a causal mask. For
before/after comparisons of the hot paths, in alternating processes on source trees:

    PYTHONPATH=<tree>/src .venv/bin/python benchmarks/repeated_calls.py

Fixed operands (a seeded draw of 6 of 16 blocks at n = 64), 2 threads, no grad; each figure is the median
of 15 rounds, in µs a call.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable

import torch

import bsrkit
from bsrkit.nn import BSRLinear

warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta state")
warnings.filterwarnings("ignore", category=bsrkit.tuning.TuningWarning)


def per_call_us(call: Callable[[], object], calls: int, rounds: int = 15) -> float:
    for _ in range(200):  # (checks, plans, prepares, then reruns)
        call()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main() -> int:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(16, dtype=torch.bool)
    mask[torch.randperm(16, generator=g)[:6]] = True
    full = mask.reshape(4, 4).repeat_interleave(16, 0).repeat_interleave(16, 1)
    bsr = (torch.randn(64, 64, generator=g) * full).to_sparse_bsr(16)
    x, out = torch.randn(64, 64, generator=g), torch.empty(64, 64)
    layer = BSRLinear(1024, 1024, 32, bias=False, density=0.1, generator=g)
    row = torch.randn(1, 1024, generator=g)
    q = torch.randn(1, 4, 256, 64, generator=g)
    causal = bsrkit.causal_mask(256, 64)
    cases: dict[str, tuple[Callable[[], object], int]] = {
        "bsr_dense_mm": (lambda: bsrkit.bsr_dense_mm(bsr, x), 2000),
        "out=": (lambda: bsrkit.bsr_dense_mm(bsr, x, out=out), 2000),
        "BSRLinear": (lambda: layer(row), 2000),
        "sampled_addmm": (lambda: bsrkit.sampled_addmm(bsr, x, x), 1000),
        "bsr_softmax": (lambda: bsrkit.bsr_softmax(bsr), 1000),
        "attention": (lambda: bsrkit.scaled_dot_product_attention(q, q, q, causal), 200),
    }
    with torch.no_grad():
        figures = {name: per_call_us(call, calls) for name, (call, calls) in cases.items()}
    print(" ".join(f"{name} {us:.2f}" for name, us in figures.items()), "(µs a call)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
