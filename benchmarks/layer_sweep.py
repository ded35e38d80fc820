"""A decode step's block-sparse layers, each streamed from memory: one call of every layer of a LLaMA-style
model in turn (as a decode step makes them, so that no layer's weight is still in the caches when its turn
comes), timed at four levels: the kept prepared call alone (by data addresses), with the output's
allocation, ``custom_ops.linear_product``, and the module call.

    .venv/bin/python benchmarks/layer_sweep.py [--hidden 1024] [--intermediate 2816] [--layers 8]
        [--density 0.1] [--blocksize 32] [--tokens 1] [--rounds 3]

Per model layer: q, k, v, o (hidden x hidden) and gate, up (intermediate x hidden), down (hidden x
intermediate), no bias, no grad, float32, 2 threads. Each figure is the median of 21 sweeps; the levels
alternate round by round. GB/s counts the stored blocks only.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import bsrkit
from bsrkit import custom_ops, shortcuts
from bsrkit.nn import BSRLinear

warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta state")
warnings.filterwarnings("ignore", category=bsrkit.tuning.TuningWarning)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--blocksize", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    h, m = args.hidden, args.intermediate
    shapes = [(h, h)] * 4 + [(h, m)] * 2 + [(m, h)]
    layers = [
        BSRLinear(i, o, args.blocksize, bias=False, density=args.density)
        for _ in range(args.layers)
        for i, o in shapes
    ]
    inputs = {i: torch.randn(args.tokens, i) for i in (h, m)}
    stored = sum(layer.values.numel() * layer.values.element_size() for layer in layers)
    for layer in layers:
        for _ in range(4):  # (checks, prepares, finds the prepared call, reruns it)
            layer(inputs[layer.in_features])
    prepared = []
    for layer in layers:
        size = (layer.out_features, layer.in_features)
        _, calls = shortcuts.kept_weight(layer.crow_indices, layer.col_indices, layer.values, size)
        (call,) = calls.values()
        if call.remembered is None or call.remembered[1].at is None:
            print("no prepared call to rerun by addresses (not the CPU loops?)")
            return 1
        prepared.append((call.remembered[1].at, layer.values.data_ptr(), inputs[layer.in_features], layer))
    outputs = [torch.empty(args.tokens, layer.out_features) for layer in layers]

    def by_addresses() -> None:
        for (at, values, x, _), y in zip(prepared, outputs, strict=True):
            at(values, x.data_ptr(), y.data_ptr(), True)

    def with_output() -> None:
        for at, values, x, layer in prepared:
            y = x.new_empty((x.shape[0], layer.out_features))
            at(values, x.data_ptr(), y.data_ptr(), True)

    def linear_product() -> None:
        for _, _, x, layer in prepared:
            custom_ops.linear_product(
                layer.crow_indices, layer.col_indices, layer.values, x, None, layer.out_features,
                layer.in_features, False,
            )  # fmt: skip

    def module_call() -> None:
        for _, _, x, layer in prepared:
            layer(x)

    levels = {
        "prepared call": by_addresses,
        "+ output": with_output,
        "linear_product": linear_product,
        "module call": module_call,
    }
    times: dict[str, list[float]] = {name: [] for name in levels}
    for _ in range(args.rounds):
        for name, sweep in levels.items():
            sweep()
            sweeps = []
            for _ in range(21):
                t0 = time.perf_counter()
                sweep()
                sweeps.append(time.perf_counter() - t0)
            times[name].append(statistics.median(sweeps))
    print(
        f"{len(layers)} layers (hidden {h}, intermediate {m}), blocksize {args.blocksize}, density "
        f"{args.density}, N = {args.tokens}: {stored / 1e6:.1f} MB of blocks; medians of {args.rounds} rounds"
    )
    for name, t in times.items():
        s = statistics.median(t)
        print(
            f"{name:>15}: {s * 1e3:7.3f} ms a sweep, {s / len(layers) * 1e6:6.1f} µs a layer, "
            f"{stored / s / 1e9:5.1f} GB/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
