"""Rounding error of long float32 sums: bsrkit's product against torch.mm, both against float64.

A dense weight of positive entries (every term adds, so the error grows with the length of each running
sum) stored as a BSR, times ``K x N`` of positive entries, for the narrow ``N`` that the CPU vector loops
serve. Prints the max absolute error of each against the float64 product and their ratio.

    .venv/bin/python benchmarks/summation_error.py [--rows 64] [--k 16384] [--blocksize 32]
        [--ns 1 2 4 8 16 32]
"""

from __future__ import annotations

import argparse
import warnings

import torch

import bsrkit

warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta state")
warnings.filterwarnings("ignore", category=bsrkit.tuning.TuningWarning)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--k", type=int, default=16384)
    ap.add_argument("--blocksize", type=int, default=32)
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    args = ap.parse_args()
    torch.manual_seed(0)
    w = torch.rand(args.rows, args.k)
    bsr = w.to_sparse_bsr((args.blocksize, args.blocksize))
    head = f"{args.rows} x {args.k} float32, positive terms, blocksize {args.blocksize}"
    print(f"{head}: max |error| against float64")
    print(f"{'N':>4} | {'bsrkit':>9} | {'torch.mm':>9} | ratio")
    for n in args.ns:
        x = torch.rand(args.k, n)
        exact = w.double() @ x.double()
        ours = (bsrkit.bsr_dense_mm(bsr, x).double() - exact).abs().max().item()
        theirs = ((w @ x).double() - exact).abs().max().item()
        print(f"{n:>4} | {ours:9.3g} | {theirs:9.3g} | {ours / theirs:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
