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
                # (allocating its result, as the peers do)
                t_ours = median_seconds(lambda: bsrkit.bsr_dense_mm(bsr, x), repeats)  # noqa: B023
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
    # Plan cache: hit overhead and the cost of a miss for n=4096, blocksize 32, density 0.1. A product takes
    # its operand (a kept one on a repeated call, else the pattern's cached verdict) and the CPU plan from
    # the operand's validated pattern: the path timed here.
    bsr, _ = random_bsr_weight(4096, 32, 0.1, seed=7)
    Operand.of(bsr).plan("cpu_mm", 0)
    hit = min(timeit.repeat(lambda: Operand.of(bsr).plan("cpu_mm", 0), number=2000, repeat=5)) / 2000
    # A product on a new BSR object of the same index tensors (no kept operand: the verdict's lookup).
    crow, col, values = bsr.crow_indices(), bsr.col_indices(), bsr.values()

    def rebuilt() -> object:
        b = torch.sparse_bsr_tensor(crow, col, values, size=bsr.shape, check_invariants=False)
        return Operand.of(b).plan("cpu_mm", 0)

    in_product = min(timeit.repeat(rebuilt, number=2000, repeat=5)) / 2000
    checks, misses = [], []
    for _ in range(5):
        bsrkit.cache_clear()
        t0 = time.perf_counter()
        a = Operand.of(bsr)  # the validation (crow, col read once)
        t1 = time.perf_counter()
        a.plan("cpu_mm", 0)
        checks.append(t1 - t0)
        misses.append(time.perf_counter() - t0)
    x = torch.randn(4096, 4096)
    t_prod = median_seconds(lambda: bsrkit.bsr_dense_mm(bsr, x), 3)
    miss = statistics.median(misses)
    print(
        f"operand and plan: {hit * 1e6:.2f} us for a repeated BSR (its kept operand), {in_product * 1e6:.2f} "
        "us for a BSR rebuilt on the same indices (the constructor, the verdict's lookup); "
        "plan miss (4096, bs 32, density 0.1): "
        f"{miss * 1e3:.2f} ms, of which validation {statistics.median(checks) * 1e3:.2f} ms; "
        f"= {miss / t_prod:.1%} of one product ({t_prod * 1e3:.1f} ms)"
    )


if __name__ == "__main__":
    main()
