"""Per-program GPU resources of bsrkit's Triton kernels at their default tiles, compiled for sm_90
(H100/H200) on this machine, no GPU needed (Triton's wheel ships ptxas and cuobjdump).

    TRITON_INTERPRET=0 .venv/bin/python benchmarks/gpu_resources.py [--arch 90]

A row with stack > 0 spills registers: a slower kernel, and a reason to lower that dtype's default tiles.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"  # compile, don't interpret (before triton is imported)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to silence its notice

import torch

from bsrkit.backends.triton.resources import KERNELS, default_resources


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--blocksizes", type=int, nargs="+", default=[16, 32, 64, 128])
    args = ap.parse_args()
    print(f"sm_{args.arch}, default tiles (bsrkit.tuning.triton_meta), n = 4096")
    print(f"{'kernel':16} {'dtype':9} {'bs':>4} | {'BM':>4} {'BK':>4} {'BN':>4} warps | regs stack shared")
    spills = 0
    for name in KERNELS:
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            for bs in args.blocksizes:
                r = default_resources(name, dtype, bs, arch=args.arch)
                spills += r.stack_bytes > 0
                bm, bk, bn = r.tiles
                print(
                    f"{name:16} {str(dtype)[6:]:9} {bs:4} | {bm:4} {bk:4} {bn:4} {r.num_warps:5} | "
                    f"{r.registers:4} {r.stack_bytes:5} {r.shared_bytes:6}",
                    flush=True,
                )
    print(f"{spills} configuration(s) with a stack frame (spills)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
