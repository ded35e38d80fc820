"""Gradual block pruning with fine-tuning against one-shot pruning, on data every machine has: the bytes of
the Python standard library's own source files (training files and held-out files are disjoint).

A small causal byte-level transformer (plain PyTorch, pre-norm, learned positions) is trained dense, then
pruned to each block density two ways, from the same dense weights:

* one-shot: ``bsrkit.sparsify_`` (block norm), no further training;
* gradual: ``bsrkit.prune.GradualPruner`` (cubic schedule) while fine-tuning, then ``finalize()``.

It reports validation perplexity per byte against the dense model fine-tuned for the same steps, the
time of a fine-tuning step after finalize() (block-sparse layers) against a dense step, and the mean step
time of the gradual run itself while it prunes (``prune ms``: the cubic schedule's steps) and after
(``tune ms``): a layer trains on block-sparse products once its density is below ``--sparse-below``
(default: the break-even density of its device and blocksize), masked dense before.

    python examples/prune_finetune.py                 # the small version (a few minutes on 2 cores)
    python examples/prune_finetune.py --dense-steps 3000 --finetune-steps 2000 --dim 256   # larger
    # step times of training while pruning: block-sparse (below break-even) against masked dense
    python examples/prune_finetune.py --dense-steps 50 --densities 0.25 0.1 --compare-masked-dense
    python examples/prune_finetune.py --rigl 0.3      # and RigL regrowth after the schedule
"""

from __future__ import annotations

import argparse
import copy
import math
import pathlib
import sysconfig
import time

import torch
from torch import nn

import bsrkit
from bsrkit.prune import GradualPruner, RigL


def stdlib_bytes(limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) byte tensors: the stdlib's .py files in sorted order, every 10th file held out."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    train, val = bytearray(), bytearray()
    for i, path in enumerate(files):
        part, cap = (val, limit // 5) if i % 10 == 9 else (train, limit)
        if len(part) < cap:
            part.extend(path.read_bytes())
    return _as_tensor(train[:limit]), _as_tensor(val[: limit // 5])


def _as_tensor(data: bytearray) -> torch.Tensor:
    return torch.frombuffer(data, dtype=torch.uint8).long() if data else torch.zeros(0, dtype=torch.long)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class ByteLM(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(256, dim), nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def batches(data: torch.Tensor, batch: int, context: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - context - 1, (batch,), generator=g)
        idx = starts[:, None] + torch.arange(context + 1)
        chunk = data[idx]
        yield chunk[:, :-1], chunk[:, 1:]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


@torch.no_grad()
def perplexity(model: nn.Module, val: torch.Tensor, context: int) -> float:
    """exp(mean cross-entropy per byte) over the validation bytes, in non-overlapping windows."""
    model.eval()
    n = (val.numel() - 1) // context * context
    x, y = val[:n].reshape(-1, context), val[1 : n + 1].reshape(-1, context)
    total = sum(
        loss_of(model, x[i : i + 32], y[i : i + 32]).item() * x[i : i + 32].numel()
        for i in range(0, len(x), 32)
    )
    model.train()
    return math.exp(total / x.numel())


def train(model: nn.Module, steps: int, data, lr: float, pruner_of=None) -> list[float]:
    """Train ``steps`` steps (pruning if ``pruner_of``, then finalize()); returns each step's seconds."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    pruner = pruner_of(model, opt) if pruner_of else None
    times = []
    for _ in range(steps):
        x, y = next(data)
        t0 = time.perf_counter()
        loss = loss_of(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if pruner is not None:
            pruner.step()
        times.append(time.perf_counter() - t0)
    if pruner is not None:
        pruner.finalize()
    return times


def _pruner_of(args: argparse.Namespace, density: float, sparse_below: float | str | None):
    """The GradualPruner factory of one fine-tuning run: the cubic schedule over the first 60% of the steps
    (about 40 pattern changes), then fine-tuning at the target density (with RigL regrowth up to 90% of
    the steps if ``--rigl``)."""
    steps = args.finetune_steps
    every = max(1, steps // 40)
    regrow = RigL(args.rigl, every=every, until=int(steps * 0.9)) if args.rigl else None

    def make(model: nn.Module, opt: torch.optim.Optimizer) -> GradualPruner:
        return GradualPruner(model, opt, blocksize=args.blocksize, target_density=density, start_step=0,
                             end_step=_end_step(args), every=every, sparse_below=sparse_below,
                             regrow=regrow)  # fmt: skip

    return make


def _end_step(args: argparse.Namespace) -> int:
    return int(args.finetune_steps * 0.6)


def _phase_ms(args: argparse.Namespace, times: list[float]) -> str:
    """Mean step ms while pruning (after the first 2 steps) and after end_step."""
    end = _end_step(args)
    pruning, after = times[2:end], times[end:]
    mean = lambda t: 1e3 * sum(t) / len(t) if t else float("nan")  # noqa: E731
    return f"{mean(pruning):>8.1f} {mean(after):>7.1f}"


def _sparse_below(text: str) -> float | str | None:
    return None if text == "none" else text if text == "break_even" else float(text)


def step_seconds(model: nn.Module, data, repeats: int = 10) -> float:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    times = []
    for _ in range(repeats + 2):
        x, y = next(data)
        t0 = time.perf_counter()
        loss = loss_of(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return sorted(times[2:])[repeats // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--blocksize", type=int, default=32)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.5, 0.25, 0.1])
    ap.add_argument("--dense-steps", type=int, default=300)
    ap.add_argument("--finetune-steps", type=int, default=200)
    ap.add_argument("--data-bytes", type=int, default=4_000_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--sparse-below",
        type=_sparse_below,
        default="break_even",
        help="density below which a layer trains block-sparse: a number, break_even or none",
    )
    ap.add_argument(
        "--compare-masked-dense",
        action="store_true",
        help="also run each gradual pruning masked dense throughout (--sparse-below none)",
    )
    ap.add_argument("--rigl", type=float, default=0.0, help="RigL regrowth fraction (0: none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    train_data, val_data = stdlib_bytes(args.data_bytes)
    print(
        f"data: {train_data.numel():,} training bytes, {val_data.numel():,} held-out bytes (stdlib .py files)"
    )
    dense = ByteLM(args.dim, args.layers, args.heads, args.context)
    t0 = time.perf_counter()
    train(dense, args.dense_steps, batches(train_data, args.batch, args.context, 0), 3e-3)
    base = perplexity(dense, val_data, args.context)
    took = time.perf_counter() - t0
    print(f"dense: {args.dense_steps} steps in {took:.0f} s, validation perplexity {base:.3f}")
    # The baseline the pruned models are held to: the dense model trained for the same fine-tuning steps.
    tuned = copy.deepcopy(dense)
    train(tuned, args.finetune_steps, batches(train_data, args.batch, args.context, 1), 1e-3)
    base = perplexity(tuned, val_data, args.context)
    print(f"dense, fine-tuned {args.finetune_steps} more steps (the baseline): perplexity {base:.3f}")
    t_dense = step_seconds(copy.deepcopy(dense), batches(train_data, args.batch, args.context, 9))
    print(f"dense fine-tuning step: {t_dense * 1e3:.1f} ms (median of 10)")
    print(f"{'density':>11} | {'one-shot ppl':>12} {'x dense':>7} | {'gradual ppl':>11} {'x dense':>7} | "
          f"{'prune ms':>8} {'tune ms':>7} | {'step ms':>7} {'x dense step':>12}")  # fmt: skip
    runs = [("", args.sparse_below)] + ([(" masked", None)] if args.compare_masked_dense else [])
    for d in args.densities:
        oneshot = copy.deepcopy(dense)
        bsrkit.sparsify_(oneshot, blocksize=args.blocksize, density=d, force=True)
        ppl_one = perplexity(oneshot, val_data, args.context)
        # (a few block-sparse training steps first: the kernels' first calls are not in prune ms)
        step_seconds(oneshot, batches(train_data, args.batch, args.context, 9), repeats=1)
        one = f"{ppl_one:>12.3f} {ppl_one / base:>7.3f}"
        for label, sparse_below in runs:
            gradual = copy.deepcopy(dense)
            data = batches(train_data, args.batch, args.context, 1)
            times = train(gradual, args.finetune_steps, data, 1e-3, _pruner_of(args, d, sparse_below))
            ppl_grad = perplexity(gradual, val_data, args.context)
            t_sparse = step_seconds(gradual, batches(train_data, args.batch, args.context, 9))
            grad = f"{ppl_grad:>11.3f} {ppl_grad / base:>7.3f}"
            name = f"{d}{label}"  # (a masked-dense run: "0.25 masked")
            print(f"{name:>11} | {one} | {grad} | {_phase_ms(args, times)} | {t_sparse * 1e3:>7.1f} "
                  f"{t_dense / t_sparse:>12.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
