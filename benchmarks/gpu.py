"""The one prepared GPU check (issue 4): correctness against the reference, then timings.

For n = 4096, blocksizes 16/32/64/128, block densities 0.05-0.5, float16/bfloat16/float32: bsrkit's
Triton `bsr_dense_mm` vs torch native `bsr @ dense` (torch's own Triton kernels for these dtypes) vs dense
`torch.mm`, medians of CUDA-event timings, as ratios in one run. Prints one line per point, flushed, so a
run cut short still reports what finished.

    python benchmarks/gpu.py                      # on a CUDA machine (~5 min on an H100-class GPU)
    TRITON_INTERPRET=1 python benchmarks/gpu.py --dry-run   # on CPU: tiny sizes, checks the script itself
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch

import bsrkit
from bsrkit import reference
from bsrkit.benchmarking import random_bsr_weight

warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta state")
TOL = {torch.float16: 2e-2, torch.bfloat16: 5e-2, torch.float32: 1e-3}


def timed(fn, repeats: int, device: torch.device) -> float:
    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def check(label: str, got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> bool:
    """Prints the max error of ``got`` relative to ``ref``'s largest entry; True when within TOL."""
    err = ((got.float() - ref.float()).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
    ok = err < TOL[dtype]
    print(f"check {str(dtype)[6:]:>8} {label}: rel err {err:.1e} {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU (Triton interpreter)")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    if args.dry_run:
        device, n, blocksizes, densities = torch.device("cpu"), 64, (16, 32), (0.25,)
        dtypes, repeats = (torch.float32,), 1
        import os

        os.environ["BSRKIT_BACKEND"] = "triton"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: nothing to do (use --dry-run to check the script on CPU)")
            return 2
        device, n = torch.device("cuda"), 4096
        blocksizes, densities = (16, 32, 64, 128), (0.05, 0.1, 0.25, 0.5)
        dtypes, repeats = (torch.float16, torch.bfloat16, torch.float32), args.repeats
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    failures = 0
    # 1. Correctness on small odd shapes (not powers of two, ragged N, empty rows, non-contiguous dense).
    for dtype in dtypes:
        for bs in ((3, 5), (16, 16), (24, 8)):
            g = torch.Generator().manual_seed(bs[0])
            mask = (torch.rand(240 // bs[0], 240 // bs[1], generator=g) < 0.4).repeat_interleave(bs[0], 0)
            mask = mask.repeat_interleave(bs[1], 1)
            mask[: bs[0]] = False  # an empty block row
            a = (torch.randn(240, 240, generator=g) * mask).to(dtype)
            bsr = a.to_sparse_bsr(bs).to(device)
            dense = torch.randn(70, 240, generator=g).to(dtype).to(device).mT  # (240, 70), column-major
            got = bsrkit.bsr_dense_mm(bsr, dense).float().cpu()
            ref = reference.bsr_dense_mm(bsr.cpu().float(), dense.cpu().float())
            failures += not check(f"blocks {bs}", got, ref, dtype)
            # SDDMM (the values gradient) at the same pattern, column-major mat2.
            m1 = torch.randn(240, 50, generator=g).to(dtype).to(device)
            m2 = torch.randn(240, 50, generator=g).to(dtype).to(device).mT
            got_s = reference.bsr_to_dense(bsrkit.sampled_addmm(bsr, m1, m2, beta=0.0).cpu()).float()
            ref_s = reference.sampled_addmm(bsr.cpu().float(), m1.cpu().float(), m2.cpu().float(), beta=0.0)
            failures += not check(f"sampled {bs}", got_s, ref_s, dtype)
    # Large and non-contiguous: element offsets past 2**31 (int32 index arithmetic would wrap), a
    # transposed and sliced dense, a column-major out; one block per block row keeps it cheap.
    big_n = 128 if args.dry_run else 47104  # 47104**2 > 2**31
    nb = big_n // 64
    col = (torch.arange(nb) * 7) % nb
    crow = torch.arange(nb + 1)
    vals = torch.randn(nb, 64, 64)
    bsr = torch.sparse_bsr_tensor(crow, col, vals, size=(big_n, big_n), check_invariants=False).to(device)
    dense = torch.randn(big_n + 8, big_n, device=device).mT[:, 8:]  # (big_n, big_n), strides (1, big_n)
    out = torch.empty(big_n, big_n, device=device).mT
    bsrkit.bsr_dense_mm(bsr, dense, out=out)
    for i in sorted({0, nb // 2, nb - 1}):  # first, middle and last block rows
        c = int(col[i])
        ref = vals[i].to(device) @ dense[c * 64 : (c + 1) * 64]
        got = out[i * 64 : (i + 1) * 64]
        failures += not check(f"large non-contiguous n={big_n} block row {i}", got, ref, torch.float32)
    del dense, out
    # 2. Timings.
    print(f"{'dtype':>8} {'bs':>4} {'dens':>5} | {'bsrkit ms':>9} {'native ms':>9} {'dense ms':>8} | "
          f"{'x native':>8} {'x dense':>7}", flush=True)  # fmt: skip
    for dtype in dtypes:
        x = torch.randn(n, n, device=device, dtype=dtype)
        for bs in blocksizes:
            for d in densities:
                bsr_cpu, w_cpu = random_bsr_weight(n, bs, d, seed=bs)
                bsr = bsr_cpu.to(dtype).to(device)
                w = w_cpu.to(dtype).to(device)
                out = torch.empty(n, n, device=device, dtype=dtype)
                t_ours = timed(lambda: bsrkit.bsr_dense_mm(bsr, x, out=out), repeats, device)  # noqa: B023
                try:
                    t_nat = timed(lambda: bsr @ x, repeats, device)  # noqa: B023
                except RuntimeError as exc:
                    t_nat = float("nan")
                    print(f"    native failed: {str(exc).splitlines()[0][:90]}", flush=True)
                t_den = timed(lambda: w @ x, repeats, device)  # noqa: B023
                print(
                    f"{str(dtype)[6:]:>8} {bs:>4} {d:>5} | {t_ours * 1e3:>9.3f} {t_nat * 1e3:>9.3f} "
                    f"{t_den * 1e3:>8.3f} | {t_nat / t_ours:>8.2f} {t_den / t_ours:>7.2f}",
                    flush=True,
                )
    print(f"correctness failures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
