"""Per-call cost of small products: bsrkit.bsr_dense_mm vs torch native BSR vs dense torch.mm, on CPU.

Below n ~ 256 a product is a few microseconds of arithmetic, and what a call costs is the Python around
it: validation, the plan-cache lookups, parameter resolution, the kernel's argument marshaling. Prints,
per (n, blocksize, density, N), the best-of-``--rounds`` mean time per call of ``--calls`` calls (the
three methods interleaved round by round, so that they share the machine's load), and ratios.

    .venv/bin/python benchmarks/tiny_calls.py [--sizes 64 128 256 512] [--rounds 7] [--calls 2000]
"""

from __future__ import annotations

import argparse
import warnings

import torch

import bsrkit
from bsrkit.benchmarking import random_bsr_weight, seconds_per_call

US = 1e6  # (µs per second)

warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta state")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--blocksizes", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--density", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000, help="calls per round at n = 64 (fewer above)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} threads, float32, n x n (density {args.density}) "
        f"@ n x n; us per call, best of {args.rounds} rounds"
    )
    header = (
        f"{'n':>5} {'bs':>3} {'nnz':>4} | {'bsrkit':>8} {'out=':>8} {'native':>8} {'dense':>8} | "
        f"{'x native':>8} {'x native (out=)':>15} {'x dense':>7}"
    )
    print(header)
    print("-" * len(header))
    for n in args.sizes:
        calls = max(20, args.calls * 64 * 64 // (n * n))
        x = torch.randn(n, n)
        for bs in args.blocksizes:
            if bs > n:
                continue
            bsr, w = random_bsr_weight(n, bs, args.density, seed=n + bs)
            out = torch.empty(n, n)
            methods = {
                "bsrkit": lambda: bsrkit.bsr_dense_mm(bsr, x),  # noqa: B023
                "out=": lambda: bsrkit.bsr_dense_mm(bsr, x, out=out),  # noqa: B023
                "native": lambda: bsr @ x,  # noqa: B023
                "dense": lambda: w @ x,  # noqa: B023
            }
            for fn in methods.values():  # warm: plans, compiled kernels, MKL's buffers
                for _ in range(20):
                    fn()
            best = dict.fromkeys(methods, float("inf"))
            for _ in range(args.rounds):
                for name, fn in methods.items():
                    best[name] = min(best[name], US * seconds_per_call(fn, calls))
            ours, ours_out, nat, den = best["bsrkit"], best["out="], best["native"], best["dense"]
            print(
                f"{n:>5} {bs:>3} {bsr._nnz():>4} | {ours:>8.1f} {ours_out:>8.1f} {nat:>8.1f} {den:>8.1f} | "
                f"{nat / ours:>8.2f} {nat / ours_out:>15.2f} {den / ours:>7.2f}",
                flush=True,
            )
    print("x native: native's time / bsrkit's (above 1: bsrkit is faster)")


if __name__ == "__main__":
    main()
