"""What a ``BSRLinear`` costs inside a compiled model: a stack of K layers under ``torch.compile`` (one
graph, so that the graph's own call and guards are shared by the K layers, as in a model), against the
same stack eager and the chain of ``bsrkit.bsr_dense_mm`` products on the same weights, with the dense
``nn.Linear`` stack, eager and compiled, as the reference for what compiling costs a layer anyway.

    .venv/bin/python benchmarks/compiled_stack.py [--n 1024] [--blocksize 32] [--density 0.1]
        [--tokens 1] [--layers 8] [--rounds 9]

float32, no grad, ``--threads``; µs per layer (a stack's time over K), medians over rounds, the methods
alternating round by round, each round a loop of >= 300 stack calls.
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
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--blocksize", type=int, default=32)
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    n, K = args.n, args.layers
    sparse = torch.nn.Sequential(*[BSRLinear(n, n, args.blocksize, bias=False, density=args.density)
                                   for _ in range(K)])  # fmt: skip
    dense = torch.nn.Sequential(*[torch.nn.Linear(n, n, bias=False) for _ in range(K)])
    bsrs = [
        torch.sparse_bsr_tensor(layer.crow_indices, layer.col_indices, layer.values.detach(), size=(n, n))
        for layer in sparse
    ]
    x = torch.randn(args.tokens, n)

    def mm_chain() -> torch.Tensor:  # (W y^T, as the layer computes it)
        y = x
        for b in bsrs:
            y = bsrkit.bsr_dense_mm(b, y.mT).mT
        return y

    compiled_sparse = torch.compile(sparse, fullgraph=True)
    compiled_dense = torch.compile(dense, fullgraph=True)
    methods = {
        "bsr_dense_mm chain": mm_chain,
        "BSRLinear stack": lambda: sparse(x),
        "compiled stack": lambda: compiled_sparse(x),
        "nn.Linear stack": lambda: dense(x),
        "compiled dense": lambda: compiled_dense(x),
    }
    for method in methods.values():
        for _ in range(20):  # (compiles, prepares, warms)
            method()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.rounds):
        for name, method in methods.items():
            times[name].append(1e6 * seconds_per_call(method, 300) / K)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"{K} layers {n} x {n}, blocksize {args.blocksize}, density {args.density}, N = {args.tokens}, "
        f"{torch.get_num_threads()} threads: µs a layer, median of {args.rounds} rounds"
    )
    for name, t in med.items():
        print(f"{name:>20}: {t:7.1f}")
    print(
        f"compiled stack - BSRLinear stack {med['compiled stack'] - med['BSRLinear stack']:+.1f}, "
        f"BSRLinear stack - bsr_dense_mm chain {med['BSRLinear stack'] - med['bsr_dense_mm chain']:+.1f}; "
        f"compiled dense - nn.Linear stack {med['compiled dense'] - med['nn.Linear stack']:+.1f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
