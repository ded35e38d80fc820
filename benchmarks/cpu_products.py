"""bsrkit.bsr_dense_mm vs torch native BSR (`bsr @ dense`, MKL sparse) vs dense torch.mm, on CPU.

Prints, per (n, blocksize, density): median times (warm plan cache), ratios, and effective GFLOP/s
(2 * nnz_blocks * bm * bk * N / time). Also the plan-cache hit overhead and the plan-miss cost.

    .venv/bin/python benchmarks/cpu_products.py [--sizes 1024 2048 4096] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit
import warnings

import torch

import bsrkit
from bsrkit.backends.cpu import planning
from bsrkit.benchmarking import median_seconds, random_bsr_weight
from bsrkit.operand import Operand

warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta state")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--blocksizes", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--densities", type=float, nargs="+", default=[0.05, 0.1, 0.25, 0.5])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=0, help="0: by size (9 / 5 / 3)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, float32, square n x n @ n x n")
    header = (
        f"{'n':>5} {'bs':>3} {'dens':>5} | {'bsrkit ms':>9} {'native ms':>9} {'dense ms':>9} | "
        f"{'x native':>8} {'x dense':>7} | {'GF/s':>5} {'nativeGF':>8} {'denseGF':>7} {'rate/dense':>10}"
    )
    print(header)
    print("-" * len(header))
    for n in args.sizes:
        repeats = args.repeats or {1024: 9, 2048: 5}.get(n, 3)
        x = torch.randn(n, n)
        for bs in args.blocksizes:
            for d in args.densities:
                bsr, w = random_bsr_weight(n, bs, d, seed=n + bs)
                out = torch.empty(n, n)
                t_ours = median_seconds(lambda: bsrkit.bsr_dense_mm(bsr, x, out=out), repeats)  # noqa: B023
                t_nat = median_seconds(lambda: bsr @ x, repeats)  # noqa: B023
                t_den = median_seconds(lambda: w @ x, repeats)  # noqa: B023
                flop = 2 * bsr._nnz() * bs * bs * n
                gf, gf_nat, gf_den = flop / t_ours / 1e9, flop / t_nat / 1e9, 2 * n**3 / t_den / 1e9
                print(
                    f"{n:>5} {bs:>3} {d:>5} | {t_ours * 1e3:>9.2f} {t_nat * 1e3:>9.2f} {t_den * 1e3:>9.2f} | "
                    f"{t_nat / t_ours:>8.2f} {t_den / t_ours:>7.2f} | {gf:>5.0f} {gf_nat:>8.0f} "
                    f"{gf_den:>7.0f} {gf / gf_den:>10.2f}",
                    flush=True,
                )
    # Plan cache: hit overhead and the cost of a miss for n=4096, blocksize 32, density 0.1. A product
    # validates the pattern (a cached verdict) and fetches the CPU plan: two lookups on one key.
    bsr, _ = random_bsr_weight(4096, 32, 0.1, seed=7)
    Operand.of(bsr)
    planning.cpu_mm_plan(bsr)
    hit = min(timeit.repeat(lambda: planning.cpu_mm_plan(bsr), number=2000, repeat=5)) / 2000
    # What a product adds: it fetches the members anyway and builds the key from them.
    in_product = (
        min(timeit.repeat(lambda: planning.cpu_mm_plan(Operand.of(bsr).source), number=2000, repeat=5)) / 2000
    )
    checks, misses = [], []
    for _ in range(5):
        bsrkit.cache_clear()
        t0 = time.perf_counter()
        a = Operand.of(bsr)  # the validation (crow, col read once)
        t1 = time.perf_counter()
        planning.cpu_mm_plan(a.source)
        checks.append(t1 - t0)
        misses.append(time.perf_counter() - t0)
    x = torch.randn(4096, 4096)
    t_prod = median_seconds(lambda: bsrkit.bsr_dense_mm(bsr, x), 3)
    miss = statistics.median(misses)
    print(
        f"plan cache hit: {hit * 1e6:.2f} us standalone, {in_product * 1e6:.2f} us inside a product "
        "(key, verdict and plan); plan miss (4096, bs 32, density 0.1): "
        f"{miss * 1e3:.2f} ms, of which validation {statistics.median(checks) * 1e3:.2f} ms; "
        f"= {miss / t_prod:.1%} of one product ({t_prod * 1e3:.1f} ms)"
    )


if __name__ == "__main__":
    main()
