"""What ``BSRLinear`` costs over the product it runs: the layer (eager and under ``torch.compile``) against
``bsrkit.bsr_dense_mm`` on the same weight and against dense ``F.linear``, at decode sizes, no grad.

    .venv/bin/python benchmarks/layer_overhead.py [--points 1024,32,0.1,1 ...] [--rounds 9]

Each point is ``n,blocksize,density,N`` (an n x n weight, N tokens, float32, ``--threads``). A round times
each method over a loop of >= 20 ms and takes the time per call; the methods alternate round by round and
the table gives the median over rounds. ``layer`` has a bias (``y += b``: one more op), ``layer nb`` none;
``bsr_dense_mm`` is given ``x.mT`` (``W x^T``, what the layer computes) and allocates its output;
``compiled lin`` is the dense ``nn.Linear`` under ``torch.compile``: what compiling costs per call anyway.
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch

import bsrkit
from bsrkit.benchmarking import seconds_per_call
from bsrkit.nn import BSRLinear

warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta state")
warnings.filterwarnings("ignore", category=bsrkit.tuning.TuningWarning)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--points", nargs="+", default=["1024,32,0.1,1", "4096,32,0.1,1", "1024,16,0.25,1", "1024,32,0.1,8"]
    )
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} threads, float32, no grad; µs per call, median of {args.rounds} rounds")
    cols = ["bsr_dense_mm", "layer", "layer nb", "compiled", "F.linear", "compiled lin"]
    header = " ".join(f"{c:>12}" for c in cols)
    print(f"{'n,bs,density,N':>18} | {header} | layer - mm, nb - mm, compiled - mm")
    for point in args.points:
        n, bs, density, N = point.split(",")
        n, bs, N, d = int(n), int(bs), int(N), float(density)
        torch.manual_seed(0)
        dense = torch.nn.Linear(n, n)
        layer = BSRLinear.from_dense(dense, bs, d).requires_grad_(False)
        plain = BSRLinear.from_dense(torch.nn.Linear(n, n, bias=False), bs, d).requires_grad_(False)
        plain.load_state_dict({**layer.state_dict(), "bias": None}, strict=False)
        weight = layer.to_bsr().detach()
        x = torch.randn(N, n)
        xt = x.mT
        methods = {
            "bsr_dense_mm": lambda: bsrkit.bsr_dense_mm(weight, xt),  # noqa: B023
            "layer": lambda: layer(x),  # noqa: B023
            "layer nb": lambda: plain(x),  # noqa: B023
            "F.linear": lambda: torch.nn.functional.linear(x, dense.weight, dense.bias),  # noqa: B023
        }
        if not args.no_compile:
            compiled = torch.compile(layer, fullgraph=True)
            methods["compiled"] = lambda: compiled(x)  # noqa: B023
            compiled_dense = torch.compile(dense, fullgraph=True)
            methods["compiled lin"] = lambda: compiled_dense(x)  # noqa: B023
        times: dict[str, list[float]] = {name: [] for name in methods}
        with torch.no_grad():
            calls = {}
            for name, fn in methods.items():  # warm-up, and calls per >= 20 ms
                for _ in range(3):
                    fn()
                c = 1
                while seconds_per_call(fn, c) * c < 0.02:
                    c *= 2
                calls[name] = c
            for _ in range(args.rounds):
                for name, fn in methods.items():
                    times[name].append(seconds_per_call(fn, calls[name]))
        med = {name: statistics.median(t) * 1e6 for name, t in times.items()}
        row = " ".join(f"{med[c]:>12.1f}" if c in med else f"{'-':>12}" for c in cols)
        extra = f"{med['layer'] - med['bsr_dense_mm']:+.1f}, {med['layer nb'] - med['bsr_dense_mm']:+.1f}"
        if "compiled" in med:
            extra += f", {med['compiled'] - med['bsr_dense_mm']:+.1f}"
            extra += f" (compiled lin - F.linear {med['compiled lin'] - med['F.linear']:+.1f})"
        print(f"{point:>18} | {row} | {extra}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
