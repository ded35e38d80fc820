"""What a repeated product pays to prove that its BSR's members still view the memory it kept.

A kept operand (a repeated product with the same BSR object) reads the members' addresses and layouts
through the accessors on every hit (``bsrkit.shortcuts.kept_operand``); a kept weight's wrapper skips it.
This script alternates, round by round in one process, the real check and the same path told that the
members are proven (the behaviour before the check), and prints the median per-call times and the median
of the per-round ratios with their interquartile range.

    PYTHONPATH=src .venv/bin/python benchmarks/member_check_ab.py 64,16,0.25,64 4096,32,0.1,1

Each point is ``n,blocksize,density,N`` (float32, 2 threads, ``out=``).
"""

from __future__ import annotations

import argparse
import statistics
import timeit
import warnings
from typing import Any

import torch

import bsrkit
from bsrkit import shortcuts
from bsrkit.benchmarking import random_bsr_weight

warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta state")
warnings.filterwarnings("ignore", category=bsrkit.tuning.TuningWarning)

_CHECKED = shortcuts.kept_operand


def _unchecked(bsr: torch.Tensor, compare: bool | None = None, members_proven: bool = False) -> Any:
    return _CHECKED(bsr, compare, True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("points", nargs="+", help="n,blocksize,density,N")
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args()
    torch.set_num_threads(2)
    for spec in args.points:
        n_s, bs_s, d_s, cols_s = spec.split(",")
        n, bs, density, cols = int(n_s), int(bs_s), float(d_s), int(cols_s)
        bsr, _ = random_bsr_weight(n, bs, density, seed=n + bs)
        x, out = torch.randn(n, cols), torch.empty(n, cols)

        def call(bsr: torch.Tensor = bsr, x: torch.Tensor = x, out: torch.Tensor = out) -> None:
            bsrkit.bsr_dense_mm(bsr, x, out=out)

        for _ in range(5):
            call()
        calls = max(20, min(2000, int(2e5 / (n * cols * density / 8 + 1000))))
        ratios: list[float] = []
        times: dict[str, list[float]] = {"unchecked": [], "checked": []}
        for r in range(args.rounds):
            order = ("unchecked", "checked") if r % 2 else ("checked", "unchecked")
            this: dict[str, float] = {}
            for mode in order:
                shortcuts.kept_operand = _CHECKED if mode == "checked" else _unchecked
                this[mode] = min(timeit.repeat(call, number=calls, repeat=3)) / calls * 1e6
                times[mode].append(this[mode])
            ratios.append(this["checked"] / this["unchecked"])
        shortcuts.kept_operand = _CHECKED
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        extra = 100 * (statistics.median(ratios) - 1)
        print(
            f"{spec:>18}: unchecked {statistics.median(times['unchecked']):8.2f} us, checked "
            f"{statistics.median(times['checked']):8.2f} us, extra {extra:+.1f}% "
            f"[{100 * (q1 - 1):+.1f}, {100 * (q3 - 1):+.1f}] ({calls} calls a round)"
        )


if __name__ == "__main__":
    main()
