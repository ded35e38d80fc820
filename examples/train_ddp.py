"""Train a block-sparse MLP (bsrkit.nn.BSRLinear layers) data-parallel on CPU, and print its loss curve.

    torchrun --nproc-per-node 2 examples/train_ddp.py                 # DistributedDataParallel
    torchrun --nproc-per-node 2 examples/train_ddp.py --wrapper fsdp2  # FSDP2 fully_shard
    python examples/train_ddp.py                                       # one process

The task is a synthetic regression: a fixed random dense "teacher" MLP labels random inputs, and the
block-sparse "student" learns it. Every rank draws its own part of each global batch; the printed loss is
the mean over the ranks, i.e. the loss on the global batch. BSRLinear needs nothing special under either
wrapper: DDP all-reduces the gradients of its ``values`` and ``bias``, FSDP2 shards them, and the index
buffers (the pattern) are replicated and never change, so each rank keeps its cached plans.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from bsrkit.nn import BSRLinear


def student(features: int, hidden: int, blocksize: int, density: float) -> nn.Sequential:
    return nn.Sequential(
        BSRLinear(features, hidden, blocksize, density=density),
        nn.GELU(),
        BSRLinear(hidden, hidden, blocksize, density=density),
        nn.GELU(),
        BSRLinear(hidden, features, blocksize, density=density),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wrapper", choices=("ddp", "fsdp2"), default="ddp")
    ap.add_argument("--steps", type=int, default=100, help="at least 2 (the first is not timed)")
    ap.add_argument("--global-batch", type=int, default=128)
    ap.add_argument("--features", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--blocksize", type=int, default=16)
    ap.add_argument("--density", type=float, default=0.25)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--print-every", type=int, default=10)
    args = ap.parse_args()
    if args.steps < 2:
        ap.error(f"--steps must be at least 2 (the first step is not timed), got {args.steps}")

    threads = os.environ.get("OMP_NUM_THREADS", "1")  # torchrun sets 1 per rank
    torch.set_num_threads(int(threads))
    # bsrkit's CPU kernel runs in numba's thread pool, which NUMBA_NUM_THREADS sizes (default: every
    # core), not OMP_NUM_THREADS: 2 ranks x 2 threads on 2 cores ran 7-10x slower per step here. It must
    # be set before numba is imported, which bsrkit does on the first product.
    os.environ.setdefault("NUMBA_NUM_THREADS", threads)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
    else:  # plain `python`: a process group of one, on an in-process store (no port to take)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} must be divisible by the {world} ranks")

    torch.manual_seed(0)  # the same initial model (and pattern) on every rank
    model = student(args.features, args.hidden, args.blocksize, args.density)
    teacher = nn.Sequential(nn.Linear(args.features, 64), nn.Tanh(), nn.Linear(64, args.features))
    if args.wrapper == "ddp":
        # The patterns (index buffers) are fixed: DDP copies rank 0's to every rank here, once; copying
        # them again before every forward is wasted work.
        model = nn.parallel.DistributedDataParallel(model, forward_sync_buffers=False)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, BSRLinear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    if rank == 0:
        blocks = sum(m.values.shape[0] for m in model.modules() if isinstance(m, BSRLinear))
        print(
            f"{args.wrapper} on {world} rank(s) (gloo, CPU), global batch {args.global_batch}, "
            f"{blocks} stored blocks of {args.blocksize}x{args.blocksize} (density {args.density})"
        )
        print(f"{'step':>5} {'loss':>10}")
    local_batch = args.global_batch // world
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own samples
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randn(local_batch, args.features, generator=data)
        with torch.no_grad():
            y = teacher(x)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if step == 1:
            first = time.perf_counter() - start  # includes compiling the kernels and building the plans
            start = time.perf_counter()
        if step == 1 or step % args.print_every == 0:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if rank == 0:
                print(f"{step:>5} {mean.item() / world:>10.5f}", flush=True)
    if rank == 0:
        per_step = (time.perf_counter() - start) / max(1, args.steps - 1)
        print(f"first step {first:.1f} s (kernel compile, plans); then {per_step * 1e3:.1f} ms/step")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Everything is printed and the process group destroyed: leave without running C++ static destructors,
    # where gloo's threads have been seen to abort a finished process ("terminate called without an active
    # exception", exit -6; once in four runs of the test suite here).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
