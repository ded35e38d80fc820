"""The ``bsrkit`` command. ``bsrkit demo``: the README's main job, on built-in random data."""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable, Sequence

import torch

from bsrkit.benchmarking import median_seconds, random_bsr_weight

__all__ = ["main"]


def _time_products(
    bsr: torch.Tensor, dense: torch.Tensor, out: torch.Tensor, repeats: int
) -> tuple[float, float, float]:
    """Median seconds of bsrkit, torch native BSR and dense torch.mm, measured in one run."""
    import bsrkit

    dense_w = bsr.to_dense()
    return (
        median_seconds(lambda: bsrkit.bsr_dense_mm(bsr, dense, out=out), repeats),
        median_seconds(lambda: bsr @ dense, repeats),
        median_seconds(lambda: dense_w @ dense, repeats),
    )


def demo(args: argparse.Namespace) -> int:
    import bsrkit
    from bsrkit import reference

    n, bs, density = args.size, args.blocksize, args.density
    print(f"bsrkit {bsrkit.__version__} demo: {n}x{n} BSR weight (blocksize {bs}, block density "
          f"{density}) @ {n}x{n} dense, float32, {torch.get_num_threads()} threads")  # fmt: skip
    bsr, _ = random_bsr_weight(n, bs, density)
    dense = torch.randn(n, n, generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    out = bsrkit.bsr_dense_mm(bsr, dense)
    first = time.perf_counter() - t0
    print(f"  first call (kernel compile + plan): {first:.2f} s")
    sub = slice(0, min(n, 256))
    check = reference.bsr_dense_mm(bsr, dense[:, sub])
    err = ((out[:, sub] - check).abs().max() / check.abs().max().clamp_min(1e-30)).item()
    print(f"  result check vs masked-dense reference (first {sub.stop} columns): "
          f"max relative error {err:.2e} {'OK' if err < 1e-5 else 'FAIL'}")  # fmt: skip
    t_ours, t_native, t_dense = _time_products(bsr, dense, out, args.repeats)
    gflop = 2 * bsr._nnz() * bs * bs * n / 1e9
    print(f"  median of {args.repeats}: bsrkit {t_ours * 1e3:.1f} ms ({gflop / t_ours:.0f} GFLOP/s), "
          f"torch native BSR {t_native * 1e3:.1f} ms, dense torch.mm {t_dense * 1e3:.1f} ms")  # fmt: skip
    print(f"  speedup: {t_native / t_ours:.2f}x vs torch native BSR, {t_dense / t_ours:.2f}x vs dense")
    info = bsrkit.cache_info()
    print(f"  plan cache: hits={info.hits} misses={info.misses} entries={info.currsize} "
          f"bytes={info.nbytes} dead_evictions={info.dead_evictions}")  # fmt: skip
    del bsr
    info = bsrkit.cache_info()
    print(f"  after `del bsr`: entries={info.currsize} bytes={info.nbytes} "
          f"dead_evictions={info.dead_evictions} (the plan died with its tensor)")  # fmt: skip
    return 0 if err < 1e-5 else 1


def _positive(kind: type) -> Callable[[str], object]:
    def parse(text: str) -> object:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text}")
        return value

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta state")
    parser = argparse.ArgumentParser(prog="bsrkit", description="Block-sparse products for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="multiply a random BSR weight by a dense matrix and compare")
    p.add_argument("--size", type=_positive(int), default=2048, help="matrix size n (default 2048)")
    p.add_argument("--blocksize", type=_positive(int), default=32, help="block size (default 32)")
    p.add_argument("--density", type=_positive(float), default=0.1, help="block density (0.1)")
    p.add_argument("--repeats", type=_positive(int), default=5, help="timed repeats (default 5)")
    p.set_defaults(run=demo)
    args = parser.parse_args(argv)
    if args.command == "demo" and args.size % args.blocksize:
        parser.error(f"--size must be a multiple of --blocksize, got {args.size} and {args.blocksize}")
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
