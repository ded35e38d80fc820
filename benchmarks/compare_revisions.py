"""bsrkit.bsr_dense_mm of two source trees (e.g. two git revisions), in alternating fresh processes.

    git worktree add /tmp/old <rev>
    .venv/bin/python benchmarks/compare_revisions.py /tmp/old/src src --rounds 3 \\
        --points 256,32,0.1,256 2048,32,0.1,2048

Each point is ``n,blocksize,density,N`` (an n x n BSR weight times n x N, float32, 2 threads); each process
prints its median per call, and the table gives the median over rounds per source tree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

_POINT = """
import statistics, sys, time, warnings
warnings.filterwarnings("ignore")
import torch, bsrkit
from bsrkit.benchmarking import random_bsr_weight
torch.set_num_threads(2)
for spec in sys.argv[1:]:
    n, bs, d, N = spec.split(",")
    n, bs, N, d = int(n), int(bs), int(N), float(d)
    bsr, _ = random_bsr_weight(n, bs, d, seed=n + bs)
    x, out = torch.randn(n, N), torch.empty(n, N)
    for _ in range(3):
        bsrkit.bsr_dense_mm(bsr, x, out=out)
    times = []
    for _ in range(300 if n <= 256 else 30 if n <= 1024 else 9):
        t = time.perf_counter()
        bsrkit.bsr_dense_mm(bsr, x, out=out)
        times.append(time.perf_counter() - t)
    print(spec, statistics.median(times) * 1e3)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old_src")
    ap.add_argument("new_src")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--points", nargs="+", default=["64,16,0.25,64", "256,32,0.1,256", "2048,32,0.1,2048"])
    args = ap.parse_args()
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for label, src in (("old", args.old_src), ("new", args.new_src)):
            env = {**os.environ, "PYTHONPATH": src}
            out = subprocess.run(
                [sys.executable, "-c", _POINT, *args.points],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            for line in out.splitlines():
                spec, ms = line.split()
                times.setdefault((spec, label), []).append(float(ms))
    print(f"{'point (n,bs,density,N)':>24} {'old ms':>9} {'new ms':>9}  (medians of {args.rounds} processes)")
    for spec in args.points:
        old, new = (statistics.median(times[spec, label]) for label in ("old", "new"))
        print(f"{spec:>24} {old:9.4f} {new:9.4f}")


if __name__ == "__main__":
    main()
