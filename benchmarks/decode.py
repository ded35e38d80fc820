"""Decode-sized products: an n x n BSR weight times n x N with N small (a sparse layer serving a few tokens).

Prints, per (blocksize, N): median ms of bsrkit, torch native BSR (``bsr @ dense``) and dense ``w @ x``;
bsrkit's speed-up over native; its time over its own N = 1 time; and the effective bandwidth
``(weight bytes + dense bytes + out bytes) / time`` against two copy rates measured in the same run with
``torch.Tensor.copy_`` on the same threads: a large buffer (256 MiB, DRAM) and one of the weight's size
(which stays in the last-level cache, as the weight itself does between calls here).

    .venv/bin/python benchmarks/decode.py [--n 4096] [--blocksizes 16 32 64] [--ns 1 2 4 8 16]
        [--density 0.1] [--threads 2] [--dtype float32] [--stat median] [--meta '{"small_n": true}']
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch

import bsrkit
from bsrkit.benchmarking import median_seconds, min_seconds, random_bsr_weight

warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta state")

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def copy_rate(nbytes: int, repeats: int) -> float:
    """Bytes per second moved (read + written) by ``dst.copy_(src)`` of ``nbytes``-byte buffers."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), repeats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--blocksizes", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="widths (include 1)")
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    ap.add_argument("--repeats", type=int, default=51)
    ap.add_argument("--stat", choices=("median", "min"), default="median", help="min: on a busy machine")
    ap.add_argument("--meta", type=json.loads, default=None, help="bsrkit meta, e.g. '{\"small_n\": false}'")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    timer = min_seconds if args.stat == "min" else median_seconds
    dtype = _DTYPES[args.dtype]
    n, d = args.n, args.density
    dram = copy_rate(256 * 2**20, 11)
    print(
        f"torch {torch.__version__}, {args.threads} threads, {args.dtype}, {n} x {n} BSR (density {d}) "
        f"@ {n} x N; meta={args.meta}; {args.stat} of {args.repeats}; "
        f"copy rate: {dram / 1e9:.1f} GB/s (256 MiB buffers)"
    )
    header = (
        f"{'bs':>3} {'N':>3} | {'bsrkit ms':>9} {'native ms':>9} {'dense ms':>8} | {'x native':>8} "
        f"{'/ N=1':>5} | {'GB/s':>5} {'/ DRAM copy':>11} {'/ LLC copy':>10}"
    )
    print(header)
    print("-" * len(header))
    for bs in args.blocksizes:
        bsr, w = random_bsr_weight(n, bs, d, seed=n + bs)
        bsr, w = bsr.to(dtype), w.to(dtype)
        weight_bytes = bsr.values().numel() * bsr.values().element_size()
        llc = copy_rate(max(weight_bytes, 2**20), 21)
        t_one = None
        for N in sorted(args.ns):  # (the smallest first: the "/ N=1" column is relative to it)
            x = torch.randn(n, N, dtype=dtype)
            # (allocating its result, as the peers do)
            ours = lambda b=bsr, x=x: bsrkit.bsr_dense_mm(b, x, meta=args.meta)  # noqa: E731
            t_ours = timer(ours, args.repeats)
            t_nat = timer(lambda: bsr @ x, args.repeats)  # noqa: B023
            t_den = timer(lambda: w @ x, args.repeats)  # noqa: B023
            t_one = t_ours if t_one is None else t_one
            moved = weight_bytes + 2 * n * N * x.element_size()
            rate = moved / t_ours
            print(
                f"{bs:>3} {N:>3} | {t_ours * 1e3:>9.3f} {t_nat * 1e3:>9.3f} {t_den * 1e3:>8.3f} | "
                f"{t_nat / t_ours:>8.2f} {t_ours / t_one:>5.2f} | {rate / 1e9:>5.1f} {rate / dram:>11.2f} "
                f"{rate / llc:>10.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
