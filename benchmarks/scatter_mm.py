"""bsr_scatter_mm with indices data (each format) vs bsrkit.bsr_dense_mm vs torch native, on CPU.

Prints, per (n, blocksize, density, N), the median time of each call (float32, warm plan cache; the
bsrkit calls are timed round-robin, so that a change in machine load hits them alike; torch native
after them) and its ratio to
``bsrkit.bsr_dense_mm`` on the same operands. ``torch indices`` is the compressed format's indices data
made by ``torch.sparse._triton_ops.bsr_scatter_mm_indices_data`` (same layout), run by bsrkit.

    .venv/bin/python benchmarks/scatter_mm.py [--points 2048,32,0.1,256 4096,32,0.1,512] [--threads 2]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.sparse._triton_ops as torch_triton_ops

import bsrkit
from bsrkit.benchmarking import random_bsr_weight

warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta state")

FORMATS = ("bsr_strided_mm_compressed", "bsr_strided_mm", "scatter_mm")


def round_robin_medians(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    for fn in calls.values():  # warm-up: compile, plans
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    items = list(calls.items())
    for i in range(rounds):
        for name, fn in items[i % len(items) :] + items[: i % len(items)]:  # each call first in turn
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bsrkit_calls(bsr: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Every call allocates its result, as torch native's does (and as a user's call does)."""
    calls: dict[str, Callable[[], object]] = {
        "bsrkit.bsr_dense_mm": lambda: bsrkit.bsr_dense_mm(bsr, x),
    }
    for fmt in FORMATS:
        data = bsrkit.bsr_scatter_mm_indices_data(bsr, x, indices_format=fmt)
        calls[f"bsr_scatter_mm, {fmt}"] = functools.partial(bsrkit.bsr_scatter_mm, bsr, x, data)
    tdata = torch_triton_ops.bsr_scatter_mm_indices_data(bsr, x, indices_format=FORMATS[0])
    calls[f"bsr_scatter_mm, {FORMATS[0]} (torch indices)"] = functools.partial(
        bsrkit.bsr_scatter_mm, bsr, x, tdata
    )
    return calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", nargs="+", default=["2048,32,0.1,256", "4096,32,0.1,512"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, float32, (n x n BSR) @ (n x N)")
    header = f"{'n':>5} {'bs':>3} {'dens':>5} {'N':>5} | {'call':<58} {'ms':>8} {'x bsr_dense_mm':>14}"
    print(header)
    print("-" * len(header))
    for point in args.points:
        n_s, bs_s, d_s, N_s = point.split(",")
        n, bs, d, N = int(n_s), int(bs_s), float(d_s), int(N_s)
        bsr, _ = random_bsr_weight(n, bs, d, seed=n + bs)
        x = torch.randn(n, N)
        calls = bsrkit_calls(bsr, x)
        medians = round_robin_medians(calls, args.rounds)
        # Timed apart: torch's OpenMP workers spin after each of its calls, slowing whatever runs next.
        medians |= round_robin_medians(
            {"torch native bsr @ dense": functools.partial(torch.matmul, bsr, x)}, args.rounds
        )
        base = medians["bsrkit.bsr_dense_mm"]
        for name, t in medians.items():
            print(f"{n:>5} {bs:>3} {d:>5} {N:>5} | {name:<58} {t * 1e3:>8.2f} {t / base:>14.2f}", flush=True)


if __name__ == "__main__":
    main()
