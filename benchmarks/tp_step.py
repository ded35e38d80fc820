"""One training step (forward + backward) of BlockRowParallelBSRLinear on the ranks of a gloo group, against
the unsharded BSRLinear in one process, with the communication volume and time of each step.

    torchrun --nproc-per-node 2 benchmarks/tp_step.py [--features 4096] [--batch 256] [--blocksize 64]
        [--density 0.1] [--skew 0.9] [--repeats 10]

Rank 0 first times the unsharded layer alone (1 thread, then one thread per rank) while the other ranks
wait; then every rank times the TP step with 1 thread (a step's time is the slowest rank's). ``--skew f``
puts the fraction f of the blocks in the first half of the block rows. On one machine whose cores the
ranks share, this measures correctness and overhead, not speedup.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from bsrkit import custom_ops
from bsrkit.distributed import BlockRowParallelBSRLinear
from bsrkit.nn import BSRLinear
from bsrkit.validation import kept_blocks

warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta state")


def skewed_layer(n: int, blocksize: int, density: float, skew: float, seed: int) -> BSRLinear:
    """An n x n BSRLinear with kept_blocks(density, blocks) blocks, the fraction ``skew`` in the top half
    rows."""
    g = torch.Generator().manual_seed(seed)
    nb = n // blocksize
    total = kept_blocks(density, nb * nb)
    top = round(skew * total)
    half = nb // 2 * nb  # blocks in the top half of the block rows
    keep = torch.cat(
        [torch.randperm(half, generator=g)[:top], half + torch.randperm(half, generator=g)[: total - top]]
    )
    norms = torch.full((nb * nb,), 1e-3)
    norms[keep] = 1.0
    lin = torch.nn.Linear(n, n)
    with torch.no_grad():
        w = torch.randn(nb, nb, blocksize, blocksize, generator=g) * norms.view(nb, nb, 1, 1) / n**0.5
        lin.weight.copy_(w.transpose(1, 2).reshape(n, n))
    return BSRLinear.from_dense(lin, blocksize, density=total / (nb * nb))


def median_ms(fn: Callable[[], None], repeats: int, group_max: bool = False) -> float:
    fn()  # warm-up: kernels compiled, plans built
    times = []
    for _ in range(repeats):
        if group_max:
            dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        if group_max:  # a step takes as long as its slowest rank
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--features", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--blocksize", type=int, default=64)
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--skew", type=float, default=None)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    # numba's pool is sized at its import (bsrkit imports it on its first product); each timing below
    # then picks its thread count with numba.set_num_threads.
    os.environ.setdefault("NUMBA_NUM_THREADS", str(world_env))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    import numba

    def threads(n: int) -> None:
        torch.set_num_threads(n)
        # (numba's pool may be smaller, a NUMBA_NUM_THREADS set before this ran: at most that)
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))

    n, batch, bs = args.features, args.batch, args.blocksize
    torch.manual_seed(0)
    if args.skew is None:
        full = BSRLinear(n, n, bs, density=args.density)
    else:
        full = skewed_layer(n, bs, args.density, args.skew, seed=0)
    x = torch.randn(batch, n, requires_grad=True)  # input grad too: the TP layer's all-reduce runs
    upstream = torch.randn(batch, n)

    def step(layer: torch.nn.Module) -> Callable[[], None]:
        def run() -> None:
            layer.zero_grad(set_to_none=True)
            x.grad = None
            (layer(x) * upstream).sum().backward()

        return run

    single: dict[int, float] = {}
    if rank == 0:
        for t in sorted({1, world}):
            threads(t)
            single[t] = median_ms(step(full), args.repeats)
    dist.barrier()

    threads(1)
    tp = BlockRowParallelBSRLinear(full)
    t_tp = median_ms(step(tp), args.repeats, group_max=True)

    # The rank's product alone (forward + both backward products, no collectives).
    values = tp.values.detach().requires_grad_()
    x_local = x.detach().requires_grad_()
    g_local = torch.randn(tp.local_out_features, batch)

    def local_product() -> None:
        values.grad = x_local.grad = None
        y_t = custom_ops.bsr_mm(
            tp.crow_indices, tp.col_indices, values, x_local.mT, tp.local_out_features, n, False
        )
        (y_t * g_local).sum().backward()

    t_local = median_ms(local_product, args.repeats, group_max=True)

    # The two collectives of a step, alone, at the step's sizes.
    rows = [(b - a) * bs for a, b in zip(tp.row_splits, tp.row_splits[1:], strict=False)]
    send = torch.randn(max(rows), batch)
    gathered = torch.empty(world * max(rows), batch)
    grad_x = torch.randn(batch, n)
    t_gather = median_ms(lambda: dist.all_gather_single(gathered, send), args.repeats, group_max=True)
    t_reduce = median_ms(lambda: dist.all_reduce(grad_x), args.repeats, group_max=True)

    nnz = [0] * world
    dist.all_gather_object(nnz, tp.values.shape[0])
    if rank == 0:
        mib = 1 / 2**20
        gather_bytes = world * max(rows) * batch * 4
        reduce_bytes = batch * n * 4
        sent = max(rows) * batch * 4 + 2 * (world - 1) / world * reduce_bytes  # ring all-reduce estimate
        print(
            f"torch {torch.__version__}, gloo, CPU, float32, {n}x{n} layer, blocks {bs}x{bs}, "
            f"density {args.density}, skew {args.skew}, batch {batch}, {world} ranks; "
            f"medians of {args.repeats} (shared machine)"
        )
        print(
            f"blocks per rank {nnz} of {full.values.shape[0]}; block rows per rank {[r // bs for r in rows]}"
        )
        lines = [(f"one process, {t} thread(s)", ms, "") for t, ms in single.items()]
        lines += [
            (f"TP, {world} ranks x 1 thread", t_tp, f"{t_tp / single[1]:.2f}x one process, 1 thread"),
            ("  a rank's product alone (slowest)", t_local, ""),
            ("  all-gather of the output", t_gather, f"{gather_bytes * mib:.1f} MiB, {max(rows)} rows/rank"),
            ("  all-reduce of the input gradient", t_reduce, f"{reduce_bytes * mib:.1f} MiB"),
        ]
        for name, ms, note in lines:
            print(f"  {name:<36} {ms:8.1f} ms/step  {note}")
        print(
            f"communication per step: {(gather_bytes + reduce_bytes) * mib:.1f} MiB of collective payload; "
            f"each rank sends about {sent * mib:.1f} MiB"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
