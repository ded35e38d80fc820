"""What the content proof costs a repeated bsrkit.bsr_dense_mm: the same process, the same operands, rounds
alternating between ``BSRKIT_CHECK_PLANS`` unset (every hit compares the index data) and ``0`` (nothing is
compared: memory identity and version counters only, as before the proof). On a shared machine the
alternation puts both under the same load; the table gives the medians over rounds of each round's median.

    .venv/bin/python benchmarks/freshness_cost.py [--points 64,16,0.25,64 ...] [--rounds 15]

Each point is ``n,blocksize,density,N`` (an n x n BSR weight times n x N, float32, ``--threads``). The
``proof us`` column times the comparison alone (``Snapshot.unchanged()`` of the weight's indices, best of
7 repeats of 2000): on a loaded machine the difference of two product times is noisier than that.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import timeit
import warnings

import torch

import bsrkit
from bsrkit.benchmarking import random_bsr_weight
from bsrkit.freshness import Snapshot

warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta state")


def round_median(fn: object, calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--points", nargs="+", default=["64,16,0.25,64", "64,16,0.25,2", "256,32,0.1,256", "4096,32,0.1,1"]
    )
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", action="store_true", help="pass out= (the prepared-call path)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, float32; medians over {args.rounds} rounds")
    head = ("point (n,bs,density,N)", "checked us", "unchecked us", "extra us", "extra %", "proof us", "%")
    print(f"{head[0]:>24} {head[1]:>11} {head[2]:>13} {head[3]:>9} {head[4]:>8} {head[5]:>9} {head[6]:>6}")
    for spec in args.points:
        n, bs, d, N = spec.split(",")
        bsr, _ = random_bsr_weight(int(n), int(bs), float(d), seed=int(n) + int(bs))
        x, out = torch.randn(int(n), int(N)), torch.empty(int(n), int(N))

        def call() -> None:
            if args.out:
                bsrkit.bsr_dense_mm(bsr, x, out=out)  # noqa: B023
            else:
                bsrkit.bsr_dense_mm(bsr, x)  # noqa: B023

        for _ in range(5):
            call()
        calls = 300 if int(n) <= 256 else 15
        checked, unchecked = [], []
        for _ in range(args.rounds):
            for mode, times in (("", checked), ("0", unchecked)):
                os.environ["BSRKIT_CHECK_PLANS"] = mode
                times.append(round_median(call, calls))
        os.environ.pop("BSRKIT_CHECK_PLANS")
        c, u = statistics.median(checked) * 1e6, statistics.median(unchecked) * 1e6
        proof = Snapshot((bsr.crow_indices(), bsr.col_indices())).unchanged
        p = min(timeit.repeat(proof, number=2000, repeat=7)) / 2000 * 1e6
        extra = f"{c - u:9.2f} {100 * (c - u) / u:7.1f}%"
        print(f"{spec:>24} {c:11.2f} {u:13.2f} {extra} {p:9.2f} {100 * p / u:5.1f}%", flush=True)


if __name__ == "__main__":
    main()
