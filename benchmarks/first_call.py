"""The first product on new index memory (a plan-cache miss: the snapshot and its copy, validation, the
CPU plan) against the second (a hit), on CPU.

    .venv/bin/python benchmarks/first_call.py [--points 64,16,0.25,8 ...] [--repeats 30]

Each point is ``n,blocksize,density,N`` (an n x n float32 BSR weight times n x N, 2 threads): every repeat
builds a BSR on fresh copies of the same indices and times its first and second product; medians in µs.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import bsrkit
from bsrkit.benchmarking import random_bsr_weight

warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta state")
warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
warnings.filterwarnings("ignore", category=bsrkit.tuning.TuningWarning)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", nargs="+", default=["64,16,0.25,8", "1024,32,0.1,8", "4096,32,0.1,1"])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'n,bs,density,N':>16} | {'first call':>10} {'second':>8}  (µs, medians)")
    for point in args.points:
        n, bs, density, N = point.split(",")
        w, _ = random_bsr_weight(int(n), int(bs), float(density))
        x = torch.randn(int(n), int(N))
        bsrkit.bsr_dense_mm(w, x)  # (imports, compiled loops, tuning state)
        first, second = [], []
        for _ in range(args.repeats):
            crow, col = w.crow_indices().clone(), w.col_indices().clone()
            b = torch.sparse_bsr_tensor(crow, col, w.values(), size=w.shape)
            t0 = time.perf_counter()
            bsrkit.bsr_dense_mm(b, x)
            t1 = time.perf_counter()
            bsrkit.bsr_dense_mm(b, x)
            t2 = time.perf_counter()
            first.append((t1 - t0) * 1e6)
            second.append((t2 - t1) * 1e6)
        print(f"{point:>16} | {statistics.median(first):>10.1f} {statistics.median(second):>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
