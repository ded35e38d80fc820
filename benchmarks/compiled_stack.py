"""What a ``BSRLinear`` costs inside a compiled model: stacks of K layers under ``torch.compile`` (one
graph each, as in a model), against the same stacks eager and the chain of ``bsrkit.bsr_dense_mm``
products on the same weights (eager, and inside a compiled function), with the dense ``nn.Linear``
stacks, eager and compiled, as the reference for what compiling costs a layer anyway.

    .venv/bin/python benchmarks/compiled_stack.py [--n 1024] [--blocksize 32] [--density 0.1]
        [--tokens 1] [--layers 4 16] [--rounds 9]

Each method runs at two depths K1 < K2 (``--layers``): its cost *a layer* is the slope ``(t(K2) -
t(K1)) / (K2 - K1)``, which leaves out what a call costs once whatever its depth (a compiled graph's
entry, guards evaluation and wrappers: shown as "per call"). float32, no grad, ``--threads``; medians
over rounds, the methods and depths alternating round by round, each round a loop of >= 100 calls.
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from collections.abc import Callable

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
    ap.add_argument("--layers", type=int, nargs=2, default=(4, 16), metavar=("K1", "K2"))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    k1, k2 = args.layers
    if not 0 < k1 < k2:
        ap.error(f"--layers: expected two depths 0 < K1 < K2, got {k1} {k2}")
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    n = args.n
    sparse = [BSRLinear(n, n, args.blocksize, bias=False, density=args.density) for _ in range(k2)]
    dense = [torch.nn.Linear(n, n, bias=False) for _ in range(k2)]
    bsrs = [
        torch.sparse_bsr_tensor(layer.crow_indices, layer.col_indices, layer.values.detach(), size=(n, n))
        for layer in sparse
    ]
    x = torch.randn(args.tokens, n)

    def mm_chain(k: int, compiled: bool = False) -> Callable[[], torch.Tensor]:
        def chain() -> torch.Tensor:  # (W y^T, as the layer computes it)
            y = x
            for b in bsrs[:k]:
                y = bsrkit.bsr_dense_mm(b, y.mT).mT
            return y

        # (compiled: bsr_dense_mm takes BSR tensors, which dynamo does not trace: a graph break a product)
        return torch.compile(chain) if compiled else chain

    def stack(layers: list[torch.nn.Module], k: int, compiled: bool) -> Callable[[], torch.Tensor]:
        model = torch.nn.Sequential(*layers[:k])
        run = torch.compile(model, fullgraph=True) if compiled else model
        return lambda: run(x)

    depths = (k1, k2)
    methods: dict[str, Callable[[int], Callable[[], torch.Tensor]]] = {
        "bsr_dense_mm chain": mm_chain,
        "compiled chain": lambda k: mm_chain(k, True),
        "BSRLinear stack": lambda k: stack(sparse, k, False),
        "compiled stack": lambda k: stack(sparse, k, True),
        "nn.Linear stack": lambda k: stack(dense, k, False),
        "compiled dense": lambda k: stack(dense, k, True),
    }
    calls = {(name, k): make(k) for name, make in methods.items() for k in depths}
    for call in calls.values():
        for _ in range(20):  # (compiles, prepares, warms)
            call()
    times: dict[tuple[str, int], list[float]] = {key: [] for key in calls}
    for _ in range(args.rounds):
        for key, call in calls.items():
            times[key].append(1e6 * seconds_per_call(call, max(100, 4800 // key[1])))
    med = {key: statistics.median(t) for key, t in times.items()}
    per_layer = {name: (med[name, k2] - med[name, k1]) / (k2 - k1) for name in methods}
    print(
        f"layers {n} x {n}, blocksize {args.blocksize}, density {args.density}, N = {args.tokens}, "
        f"{torch.get_num_threads()} threads, stacks of {k1} and {k2}: µs, medians of {args.rounds} rounds"
    )
    print(f"{'':>20}  {'a layer':>8}  {'per call':>8}")
    for name in methods:
        print(f"{name:>20}  {per_layer[name]:8.1f}  {med[name, k1] - k1 * per_layer[name]:8.1f}")
    pairs = (
        ("compiled stack", "bsr_dense_mm chain"),
        ("compiled stack", "compiled chain"),
        ("compiled stack", "BSRLinear stack"),
        ("BSRLinear stack", "bsr_dense_mm chain"),
        ("compiled dense", "nn.Linear stack"),
    )
    print("a layer: " + ", ".join(f"{a} - {b} {per_layer[a] - per_layer[b]:+.1f}" for a, b in pairs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
