"""One forward+backward of a 4096x4096 layer, batch 256, float32: BSRLinear vs nn.Linear vs torch native BSR.

    .venv/bin/python benchmarks/training_step.py [--threads 2] [--repeats 5]

"torch native BSR" is the same weight as a torch BSR tensor, y = (W @ x^T)^T + b with torch's own
sparse kernels. Its backward w.r.t. the BSR values does not exist in torch; the table times what torch
can do (forward, and backward to x and bias only) and says so.
"""

from __future__ import annotations

import argparse
import warnings

import torch

from bsrkit.benchmarking import median_seconds
from bsrkit.nn import BSRLinear

warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta state")


def step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    x.grad = None
    model(x).sum().backward()


class NativeBSRLinear(torch.nn.Module):
    def __init__(self, layer: BSRLinear) -> None:
        super().__init__()
        self.weight = layer.to_bsr().detach()  # torch cannot give BSR values a gradient
        self.bias = torch.nn.Parameter(layer.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight @ x.mT).mT + self.bias


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--features", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n, batch = args.features, args.batch
    print(
        f"torch {torch.__version__}, {args.threads} threads, float32, {n}x{n} layer, batch {batch}; medians"
    )
    header = (
        f"{'bs':>3} {'dens':>5} | {'BSRLinear ms':>12} {'fwd ms':>7} | {'nn.Linear ms':>12} | "
        f"{'native fwd ms':>13} {'native fwd+bwd(x) ms':>20} | {'x Linear':>8} {'x native fwd':>12}"
    )
    print(header)
    print("-" * len(header))
    x = torch.randn(batch, n, requires_grad=True)
    dense = torch.nn.Linear(n, n)
    t_dense = median_seconds(lambda: step(dense, x), args.repeats)
    native_unsupported = False
    for bs in (32, 64):
        for density in (0.1, 0.25):
            torch.manual_seed(0)
            layer = BSRLinear(n, n, bs, density=density)
            t_ours = median_seconds(lambda: step(layer, x), args.repeats)  # noqa: B023
            with torch.no_grad():
                t_fwd = median_seconds(lambda: layer(x), args.repeats)  # noqa: B023
            native = NativeBSRLinear(layer)
            with torch.no_grad():
                t_native_fwd = median_seconds(lambda: native(x), args.repeats)  # noqa: B023
            try:
                t_native = median_seconds(lambda: step(native, x), args.repeats)  # noqa: B023
                native_text = f"{t_native * 1e3:>20.1f}"
            except RuntimeError as exc:  # torch lacks the backward
                native_text = f"{'unsupported':>20}"
                native_unsupported = True
                print(f"    (torch native backward failed: {str(exc).splitlines()[0][:80]})")
            print(
                f"{bs:>3} {density:>5} | {t_ours * 1e3:>12.1f} {t_fwd * 1e3:>7.1f} | "
                f"{t_dense * 1e3:>12.1f} | {t_native_fwd * 1e3:>13.1f} {native_text} | "
                f"{t_dense / t_ours:>8.2f} {t_native_fwd / t_fwd:>12.2f}",
                flush=True,
            )
    print("x Linear: nn.Linear fwd+bwd time / BSRLinear fwd+bwd time; x native fwd: forward only.")
    if native_unsupported:
        print("native: torch has no backward w.r.t. BSR values, and (above) none w.r.t. x on CPU either.")
    else:
        print("native: torch has no backward w.r.t. BSR values (its backward w.r.t. x is timed above).")


if __name__ == "__main__":
    main()
