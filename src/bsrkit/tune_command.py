"""``bsrkit tune``: time the products' candidate parameters (CPU loops or Triton tiles) on each shape and
blocksize, and store the best in the tuning table (:mod:`bsrkit.tuning`); ``--break-even``: each
blocksize's break-even density (:mod:`bsrkit.break_even`). The command's arguments are parsed by
:mod:`bsrkit.cli`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

from bsrkit.benchmarking import median_seconds, random_block_mask, streamed_copies

__all__ = ["tune"]


def _tune_shape(
    bsrs: list[torch.Tensor],
    x: torch.Tensor,
    out: torch.Tensor,
    candidates: list[dict[str, int]],
    repeats: int,
) -> tuple[float, dict[str, int], float]:
    """(best seconds per product, best meta, seconds with the defaults) over the candidate metas; each
    timing runs one product on each of ``bsrs`` (copies of one weight: see ``--streamed``)."""
    import bsrkit

    def timed(meta: dict[str, int]) -> float:
        def run() -> None:
            for bsr in bsrs:
                bsrkit.bsr_dense_mm(bsr, x, out=out, meta=meta)
            if out.device.type == "cuda":
                torch.cuda.synchronize()

        return median_seconds(run, repeats) / len(bsrs)

    results = [(timed(meta), meta) for meta in candidates]
    best_t, best = min(results, key=lambda r: r[0])
    return best_t, best, timed({})  # meta={} means "the defaults", without a table lookup


def _candidates(args: argparse.Namespace, N: int, Ks: int) -> list[dict[str, int]]:
    """The search grid: CPU (panel x threads) or Triton (BLOCK_N x BLOCK_K x num_warps x num_stages).

    Tile caps beyond the padded extent (``N`` columns, ``Ks`` inner) are clamped by the kernels, so
    they are deduplicated here rather than timed twice."""
    if args.backend == "triton":
        from bsrkit.backends.triton.tiles import tile

        widths = sorted({min(w, tile(N)) for w in args.block_n})
        chunks = sorted({min(k, tile(Ks)) for k in args.block_k})
        return [
            {"BLOCK_N": w, "BLOCK_K": k, "num_warps": nw, "num_stages": ns}
            for w in widths
            for k in chunks
            for nw in args.num_warps
            for ns in args.num_stages
        ]
    threads = args.threads or sorted({1, torch.get_num_threads()})
    panels = sorted({min(p, max(N, 1)) for p in args.panels})  # (the loops clamp a panel to N columns)
    return [{"panel": p, "nthreads": t} for p in panels for t in threads]


def tune(args: argparse.Namespace) -> int:
    """``bsrkit tune`` with the parsed ``args`` (see :func:`bsrkit.cli.main`); its exit status."""
    previous = os.environ.get("BSRKIT_BACKEND")
    os.environ["BSRKIT_BACKEND"] = args.backend  # while tuning: the products run the tuned kernels
    try:
        return _tune(args)
    finally:
        if previous is None:
            del os.environ["BSRKIT_BACKEND"]
        else:
            os.environ["BSRKIT_BACKEND"] = previous


def _tune(args: argparse.Namespace) -> int:
    from bsrkit import tuning
    from bsrkit.benchmarking import DTYPES

    dtype = DTYPES[args.dtype]
    if args.backend == "triton":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device_name = tuning.triton_device_name(device)
    else:
        device = torch.device("cpu")
        device_name = tuning.cpu_device_name()
    try:  # before any tuning work, not after it
        table = tuning.check_writable(args.table)
    except OSError as exc:
        print(f"bsrkit tune: cannot write the tuning table: {exc}", file=sys.stderr)
        return 2
    if args.break_even:
        return _tune_break_even(args, device, device_name, dtype, table)
    shapes = args.shapes or [(n, n, n) for n in args.sizes]
    found: dict[str, dict[str, Any]] = {}
    jobs = [(shape, bs) for shape in shapes for bs in args.blocksizes]
    try:
        _tune_shapes(args, jobs, device, device_name, dtype, found)
    finally:  # (Ctrl-C: the shapes that finished are kept)
        if found:
            path = tuning.save_entries(found, table)
            print(f"wrote {len(found)} entries to {path}")
    return 0


def _tune_shapes(
    args: argparse.Namespace,
    jobs: list[Any],
    device: torch.device,
    device_name: str,
    dtype: torch.dtype,
    found: dict[str, dict[str, Any]],
) -> None:
    from tqdm import tqdm

    from bsrkit import tuning

    g = torch.Generator().manual_seed(0)
    for (M, K, N), (Ms, Ks) in tqdm(jobs, desc="bsrkit tune", unit="shape", file=sys.stderr):
        mask = random_block_mask((M // Ms, K // Ks), args.density, g)  # (a draw of none stored noise)
        full = mask.repeat_interleave(Ms, 0).repeat_interleave(Ks, 1)
        bsr = (torch.randn((M, K), generator=g) * full).to(dtype).to_sparse_bsr((Ms, Ks)).to(device)
        x = torch.randn((K, N), generator=g).to(dtype).to(device)
        out = torch.empty((M, N), dtype=dtype, device=device)
        bsrs = streamed_copies(bsr) if args.streamed else [bsr]
        best_t, best, default = _tune_shape(bsrs, x, out, _candidates(args, N, Ks), args.repeats)
        del bsrs
        chosen = " ".join(f"{k}={v}" for k, v in best.items())
        print(
            f"M,K,N={M},{K},{N} blocks {Ms}x{Ks}: best {chosen} "
            f"{best_t * 1e3:.2f} ms (defaults {default * 1e3:.2f} ms, {default / best_t:.2f}x)"
        )
        timed = {**best, "seconds": round(best_t, 6), "density": args.density, "streamed": args.streamed}
        # (the transposed product runs the same loops: it takes these parameters, untimed, so no seconds)
        untimed = {k: v for k, v in timed.items() if k != "seconds"}
        for kind, entry in (("", timed), ("transposed", untimed)):
            name = tuning.TABLE_NAMES["addmm", kind]
            found[tuning.table_key(device_name, name, dtype, (M, K, N), (Ms, Ks))] = entry


def _tune_break_even(
    args: argparse.Namespace, device: torch.device, device_name: str, dtype: torch.dtype, table: Any
) -> int:
    """``bsrkit tune --break-even``: each blocksize's break-even density (see bsrkit.break_even)."""
    from bsrkit import break_even, tuning

    M, K, _ = (args.shapes or [(n, n, n) for n in args.sizes])[0]
    found = {}
    for bs in args.blocksizes:
        entry = break_even.measure(
            bs, features=(M, K), tokens=(1, 512), dtype=dtype, device=device, repeats=args.repeats
        )
        found[break_even.table_key(device_name, dtype, bs)] = {**entry, "features": [M, K]}
        ratios = "; ".join(f"{n} tokens {r}" for n, r in entry["ratios"].items())
        print(
            f"{M}x{K} blocks {bs[0]}x{bs[1]}: break-even density {entry['density']} "
            f"(sparse/dense time at densities {entry['densities']}: {ratios})"
        )
    path = tuning.save_entries(found, table)
    print(f"wrote {len(found)} entries to {path}")
    return 0
