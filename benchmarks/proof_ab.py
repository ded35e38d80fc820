"""Where a repeated CPU product proves its pattern unchanged: inside the compiled loop (the default), in
Python before the loop (``Snapshot.unchanged()``, what the loop's proof replaced), or not at all
(``BSRKIT_CHECK_PLANS=0``), in one process, rounds alternating between the three.

    .venv/bin/python benchmarks/proof_ab.py [--points 4096,16,0.1,1 ...] [--rounds 15] [--calls 300] [--out]

Each point is ``n,blocksize,density,N`` (an n x n float32 BSR weight times n x N, 2 threads); µs per call,
medians over rounds. "extra" is the median over rounds of each round's ratio to no proof (the modes of a
round run back to back, in an order reversed every other round, so that drift cancels), with the
interquartile range of those ratios in brackets; "best" is each mode's fastest round against no proof's
(interference only ever slows a round, so on a busy host the best rounds show the work itself).
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings

import torch

import bsrkit
from bsrkit.benchmarking import random_bsr_weight, seconds_per_call
from bsrkit.operand import Operand

US = 1e6  # (µs per second)

warnings.filterwarnings("ignore")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", nargs="+", default=["4096,16,0.1,1", "4096,32,0.1,1", "4096,16,0.1,4",
                                                     "4096,32,0.1,16"])  # fmt: skip
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", action="store_true", help="write into a preallocated out= (as decode.py does)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    header = f"{'n,bs,density,N':>16} | {'no proof':>9} {'Python':>9} {'loop':>9}"
    print(f"{header} | Python extra, loop extra | best: Python, loop")
    for point in args.points:
        n, bs, density, N = point.split(",")
        w, _ = random_bsr_weight(int(n), int(bs), float(density))
        x = torch.randn(int(n), int(N))
        out = torch.empty(int(n), int(N)) if args.out else None
        product = lambda: bsrkit.bsr_dense_mm(w, x, out=out)  # noqa: E731, B023
        for _ in range(20):
            product()
        (kept,) = Operand.of(w).calls.values()  # the kept operand's one prepared call
        rerun = kept[3]
        if not rerun.proves:
            print(f"{point:>16} | (this call's loop cannot prove: skipped)")
            continue
        times: dict[str, list[float]] = {"none": [], "python": [], "loop": []}
        try:
            for r in range(args.rounds):
                for mode in list(times)[:: 1 if r % 2 == 0 else -1]:
                    t = times[mode]
                    rerun.proves = mode == "loop"
                    if mode == "none":
                        os.environ["BSRKIT_CHECK_PLANS"] = "0"
                    t.append(US * seconds_per_call(product, args.calls))
                    os.environ.pop("BSRKIT_CHECK_PLANS", None)
        finally:
            rerun.proves = True
        m = {mode: statistics.median(t) for mode, t in times.items()}
        best = {k: f"{100 * (min(times[k]) / min(times['none']) - 1):+.1f}%" for k in ("python", "loop")}
        extra = {}
        for k in ("python", "loop"):
            ratios = [100 * (a / b - 1) for a, b in zip(times[k], times["none"], strict=True)]
            q1, med, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
            extra[k] = f"{med:+.1f}% [{q1:+.1f}, {q3:+.1f}]"
        print(f"{point:>16} | {m['none']:>9.1f} {m['python']:>9.1f} {m['loop']:>9.1f} | "
              f"{extra['python']}, {extra['loop']} | {best['python']}, {best['loop']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
