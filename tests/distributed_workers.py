"""Worker processes for tests/test_distributed.py (gloo, CPU), one per rank:

    python tests/distributed_workers.py OUT_DIR SCENARIO [SCENARIO ...]

with MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE in the environment. The scenarios run in order in one
process group (one start-up for all of them); rank 0 writes ``OUT_DIR/<scenario>.json`` with the figures
the tests check. Every rank also trains the single-process reference itself: the models are small.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bsrkit.nn import BSRLinear

T0 = time.perf_counter()
STEPS = 6
GLOBAL_BATCH = 32


def make_model(seed: int) -> nn.Sequential:
    """Two BSRLinear layers pruned from seeded dense weights: the pattern depends on ``seed``, the
    number of blocks does not (15 of 32 and 9 of 32: odd, so FSDP2 shards them unevenly)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        first = BSRLinear.from_dense(nn.Linear(64, 128), 16, density=15 / 32)
        second = BSRLinear.from_dense(nn.Linear(128, 32), (8, 16), density=9 / 32)
    return nn.Sequential(first, nn.ReLU(), second)


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH, 64, generator=g)
    y = torch.tanh(x @ torch.randn(64, 32, generator=g) / 8)
    return x, y


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = STEPS) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def rank_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def mean_over_ranks(losses: list[torch.Tensor], world: int) -> torch.Tensor:
    # Equal local batches: the mean of the local mean losses is the global-batch mean loss.
    stacked = torch.stack(losses)
    torch.distributed.all_reduce(stacked)
    return stacked / world


def compare_weights(model: nn.Module, ref: nn.Module, full: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    ours = {k: full(v) for k, v in model.state_dict().items()}
    theirs = ref.state_dict()
    assert ours.keys() == theirs.keys(), (ours.keys(), theirs.keys())
    return {
        "weights_max_abs": max(max_abs(ours[k], theirs[k]) for k in ours if "indices" not in k),
        "patterns_equal": all(torch.equal(ours[k], theirs[k]) for k in ours if "indices" in k),
    }


def scenario_ddp(rank: int, world: int, out: Path) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    import bsrkit

    x, y = make_data()
    ref = make_model(0)
    bsrkit.cache_clear()
    ref_losses = torch.stack(train(ref, x, y))
    result: dict[str, Any] = {"single_process_plan_misses": bsrkit.cache_info().misses}
    # DDP's default broadcast_buffers=True copies the index buffers from rank 0 before every forward
    # (without bumping their version counters); the plans must be built once, not once per step.
    ddp = DistributedDataParallel(make_model(0))
    bsrkit.cache_clear()
    losses = mean_over_ranks(train(ddp, rank_slice(x, rank, world), rank_slice(y, rank, world)), world)
    result.update(
        losses_max_abs=max_abs(losses, ref_losses),
        **compare_weights(ddp.module, ref, lambda t: t),
        plan_misses_per_rank=_gather_ints(bsrkit.cache_info().misses, world),
    )
    result["losses"] = ref_losses.tolist()
    return result


def scenario_ddp_rigl(rank: int, world: int, out: Path) -> dict:
    """RigL under DDP grows by the gradient of the global batch, as one process on that batch does: each
    rank recorded its own batch's dense gradient and grew other blocks, the replicas then diverging."""
    from torch.nn.parallel import DistributedDataParallel

    from bsrkit.prune import GradualPruner, RigL

    g = torch.Generator().manual_seed(1)
    x, y = (
        torch.randn(9, 16, 32, generator=g, dtype=torch.float64),
        torch.randn(9, 16, 8, generator=g, dtype=torch.float64),
    )

    def run(distributed: bool) -> tuple[list[torch.Tensor], nn.Module]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        model = model.double()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        pruner = GradualPruner(
            model, opt, blocksize=8, target_density=0.25, start_step=0, end_step=1, every=1, sparse_below=1.0,
            regrow=RigL(fraction=0.3, every=2, decay="constant"),
        )  # fmt: skip
        masks, net = [], model
        for i in range(9):
            if i == 1 and distributed:  # (wrapped after the first step made the layers block-sparse)
                net = DistributedDataParallel(model)
            xs, ys = (rank_slice(x[i], rank, world), rank_slice(y[i], rank, world)) if i else (x[i], y[i])
            opt.zero_grad()
            nn.functional.mse_loss(net(xs if distributed else x[i]), ys if distributed else y[i]).backward()
            opt.step()
            pruner.step()
            masks += [m.clone() for m in pruner.masks().values()]
        return masks, model

    ref_masks, ref = run(False)
    masks, model = run(True)
    return {
        "masks_equal_single_process_per_rank": _gather_ints(
            int(all(torch.equal(a, b) for a, b in zip(masks, ref_masks, strict=True))), world
        ),
        "weights_max_abs": max(max_abs(model[i].to_dense(), ref[i].to_dense()) for i in (0, 2, 4)),
        "masks_equal_with_a_layer_unused_on_rank_1": _masks_with_a_layer_unused_on_rank_1(rank, world),
    }


def _masks_with_a_layer_unused_on_rank_1(rank: int, world: int) -> bool:
    """A layer rank 1 skips in the step before an update records nothing there: that rank still joins
    the average (as zeros, as DDP counts an unused parameter), where it skipped the collective and the
    ranks hung or aborted."""
    from torch.nn.parallel import DistributedDataParallel

    from bsrkit.prune import GradualPruner, RigL

    class Skipping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.head = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8)

        def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
            h = torch.relu(self.a(x))
            return self.head(torch.relu(self.b(h)) if use_b else h)

    torch.manual_seed(0)
    model = Skipping().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    pruner = GradualPruner(
        model, opt, blocksize=8, target_density=0.25, start_step=0, end_step=1, every=1, sparse_below=1.0,
        filter_fn=lambda m, name: name in ("a", "b"), regrow=RigL(fraction=0.5, every=2, decay="constant"),
    )  # fmt: skip
    shared, own = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2 + rank)
    net: nn.Module = model
    for i in range(4):
        if i == 1:  # (wrapped after the first step, on the same batch everywhere, made the layers sparse)
            net = DistributedDataParallel(model, find_unused_parameters=True)
        opt.zero_grad()
        x = torch.randn(8, 32, generator=own if i else shared, dtype=torch.float64)
        net(x, use_b=not (rank == 1 and i == 1)).sum().backward()
        opt.step()
        pruner.step()
    everyone: list[Any] = [None] * world
    torch.distributed.all_gather_object(everyone, [m.clone() for m in pruner.masks().values()])
    return all(torch.equal(p, q) for p, q in zip(everyone[0], everyone[1], strict=True))


def scenario_ddp_pattern(rank: int, world: int, out: Path) -> dict:
    """A pattern changed on rank 0 after wrapping, with DDP's default buffer sync before every forward:
    the broadcast writes the other ranks' index buffers without moving their version counters, after
    plans for the old pattern were cached there. Every rank must compute with the new pattern."""
    from torch.nn.parallel import DistributedDataParallel

    x, _ = make_data()
    ddp = DistributedDataParallel(make_model(0))
    first = ddp.module[0]
    ddp(x).sum().backward()  # plans of the old pattern (forward and backward) on every rank
    new = make_model(2)[0]  # same shapes and number of blocks, another pattern
    assert not torch.equal(new.col_indices, first.col_indices)
    if rank == 0:
        with torch.no_grad():
            first.crow_indices.copy_(new.crow_indices)
            first.col_indices.copy_(new.col_indices)
    x.requires_grad_(True)
    y = ddp(x)  # (DDP copies rank 0's buffers to every rank first)
    (grad,) = torch.autograd.grad(y.sum(), x)
    second = ddp.module[2]
    xd = x.detach().clone().requires_grad_(True)
    expected = torch.relu(xd @ first.to_dense().T + first.bias) @ second.to_dense().T + second.bias
    (expected_grad,) = torch.autograd.grad(expected.sum(), xd)
    diff = max(max_abs(y, expected), max_abs(grad, expected_grad))
    has_new = bool(
        torch.equal(first.col_indices, new.col_indices) and torch.equal(first.crow_indices, new.crow_indices)
    )
    everyone: list[Any] = [None] * world
    torch.distributed.all_gather_object(everyone, (diff, has_new))
    return {"max_abs_per_rank": [d for d, _ in everyone], "new_pattern_per_rank": [h for _, h in everyone]}


def scenario_fsdp2(rank: int, world: int, out: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    x, y = make_data()
    ref = make_model(0)
    model = make_model(0)
    layers = [m for m in model if isinstance(m, BSRLinear)]
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    sharding = []
    for layer in layers:
        values = layer.values
        assert isinstance(values, DTensor), type(values)
        # Replicated patterns: plain tensors, identical on every rank.
        patterns = [None] * world
        torch.distributed.all_gather_object(patterns, (layer.crow_indices, layer.col_indices))
        sharding.append(
            {
                "values_is_dtensor": isinstance(values, DTensor),
                "values_placements": [str(p) for p in values.placements],
                "values_sharded_on_dim0": values.placements == (Shard(0),),
                "values_global_shape": list(values.shape),
                "values_local_rows": [int(n) for n in _gather_ints(values.to_local().shape[0], world)],
                "buffers_plain": not isinstance(layer.crow_indices, DTensor)
                and not isinstance(layer.col_indices, DTensor),
                "buffers_replicated": all(
                    torch.equal(c, layer.crow_indices) and torch.equal(k, layer.col_indices)
                    for c, k in patterns  # type: ignore[misc]
                ),
            }
        )
    ref_losses = torch.stack(train(ref, x, y))
    losses = mean_over_ranks(train(model, rank_slice(x, rank, world), rank_slice(y, rank, world)), world)
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    result = {
        "losses_max_abs": max_abs(losses, ref_losses),
        **compare_weights(model, ref, full),
        "sharding": sharding,
    }
    # A sharded checkpoint of the trained model, for the 2 -> 1 load in the test process.
    dcp.save(get_model_state_dict(model), checkpoint_id=str(out / "checkpoint"))
    x_eval = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y_eval = model(x_eval)
    dense = [  # the trained model's weights (full_tensor is collective: every rank calls it)
        torch.sparse_bsr_tensor(
            m.crow_indices, m.col_indices, full(m.values).detach(), (m.out_features, m.in_features)
        ).to_dense()
        for m in layers
    ]
    if rank == 0:
        torch.save({"x": x_eval, "y": y_eval, "dense": dense}, out / "checkpoint_expected.pt")
    return result


def _modes_follow(full: Any, group: Any, training: bool) -> bool:
    """A layer in eval (training) mode is split, and gathered again, in eval (training) mode."""
    from bsrkit.distributed import BlockRowParallelBSRLinear

    part = BlockRowParallelBSRLinear(copy.deepcopy(full).train(training), group)
    return part.training == training and part.to_bsr_linear().training == training


def _gather_ints(n: int, world: int) -> list[int]:
    everyone = [0] * world
    torch.distributed.all_gather_object(everyone, n)
    return everyone


def skewed_layer(seed: int) -> BSRLinear:
    """256 x 128, blocks 16: 16 x 8 block grid, 64 blocks kept; the first 8 block rows hold 58 (90%)."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(128, 256)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(256, 128, generator=g) * 1e-3)
        lin.bias.copy_(torch.randn(256, generator=g))
        blocks = lin.weight.view(16, 16, 8, 16).transpose(1, 2)  # (block row, block col, 16, 16) view
        top = torch.randperm(64, generator=g)[:58]
        bottom = 64 + torch.randperm(64, generator=g)[:6]
        for i in torch.cat([top, bottom]).tolist():
            blocks[i // 8, i % 8] = torch.randn(16, 16, generator=g)  # large: from_dense keeps these
    return BSRLinear.from_dense(lin, 16, density=0.5)


def top_row_layer(seed: int) -> BSRLinear:
    """16 x 32, blocks 8: all 4 stored blocks in block row 0, so the other rank holds no rows at all."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(32, 16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(16, 32, generator=g))
        lin.weight[8:] *= 1e-3
        lin.bias.copy_(torch.randn(16, generator=g))  # not nn.Linear's: the global RNG differs per rank
    return BSRLinear.from_dense(lin, 8, density=0.5)


def uniform_layer(seed: int) -> BSRLinear:
    return BSRLinear(128, 256, (16, 8), density=0.3, generator=torch.Generator().manual_seed(seed))


def _same_layer(a: BSRLinear, b: BSRLinear) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def scenario_tp(rank: int, world: int, out: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from bsrkit.distributed import BlockRowParallelBSRLinear

    results = {}
    mesh = init_device_mesh("cpu", (world,))
    cases = (
        ("uniform", uniform_layer, None),
        ("skewed", skewed_layer, mesh),
        ("one_rank_empty", top_row_layer, None),
    )
    for name, factory, group in cases:
        full = factory(3)
        tp = BlockRowParallelBSRLinear(copy.deepcopy(full), group)
        g = torch.Generator().manual_seed(4)
        x = torch.randn(3, 5, full.in_features, generator=g)
        upstream = torch.randn(3, 5, full.out_features, generator=g)
        x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ref, y_tp = full(x_ref), tp(x_tp)
        (y_ref * upstream).sum().backward()
        (y_tp * upstream).sum().backward()
        start, stop = tp.row_splits[rank], tp.row_splits[rank + 1]
        first, last = int(full.crow_indices[start]), int(full.crow_indices[stop])
        bo = full.blocksize[0]
        assert full.bias is not None and tp.bias is not None and full.values.grad is not None
        pairs = {
            "output": (y_tp, y_ref),
            "grad_x": (x_tp.grad, x_ref.grad),
            "grad_values": (tp.values.grad, full.values.grad[first:last]),
            "grad_bias": (tp.bias.grad, full.bias.grad[start * bo : stop * bo]),
        }
        diffs = {k: max_abs(a, b) for k, (a, b) in pairs.items()}  # type: ignore[arg-type]
        scale = {k: float(b.abs().max()) if b.numel() else 0.0 for k, (_, b) in pairs.items()}
        everyone: list[Any] = [None] * world
        torch.distributed.all_gather_object(
            everyone,
            {
                "nnz": tp.values.shape[0],
                "block_rows": [start, stop],
                "diffs": diffs,
                "scale": scale,
                "pattern_is_local": torch.equal(tp.col_indices, full.col_indices[first:last])
                and tp.crow_indices[0] == 0
                and torch.equal(tp.crow_indices + first, full.crow_indices[start : stop + 1]),
                "values_equal_slice": torch.equal(tp.values, full.values[first:last]),
                "gathered_equals_full": _same_layer(tp.to_bsr_linear(), full),
                "modes_follow": [_modes_follow(full, group, mode) for mode in (False, True)],
            },
        )
        half = full.crow_indices.shape[0] // 2
        results[name] = {
            "nnz": full.values.shape[0],
            "nnz_first_half_rows": int(full.crow_indices[half]),
            "block_rows": full.crow_indices.shape[0] - 1,
            "row_counts": full.crow_indices.diff().tolist(),
            "ranks": everyone,
        }
    # Ranks built with different seeds, with patterns whose weighted column sums agree (a fingerprint the
    # check was), with and without a bias, in two dtypes: every rank refuses (none is left waiting in a
    # collective, or garbled by one).
    refused = {}
    for name, layer in (
        ("seed", lambda: uniform_layer(rank)),
        ("same_column_sum", lambda: _one_block_per_row([2, 0] if rank == 0 else [0, 1])),
        ("bias", lambda: BSRLinear(16, 16, 4, bias=rank == 0, density=0.5, generator=_seeded(0))),
        (
            "dtype",
            lambda: BSRLinear(16, 16, 4, density=0.5, generator=_seeded(0)).to(
                torch.float64 if rank else torch.float32
            ),
        ),
        ("index_dtype", lambda: _index_dtype(BSRLinear(16, 16, 4, density=0.5, generator=_seeded(0)), rank)),
        # (one pattern, other values: every block stored, drawn from each rank's own seed; another bias)
        ("values", lambda: BSRLinear(16, 16, 4, density=1.0, generator=_seeded(rank))),
        ("bias_values", lambda: _other_bias(BSRLinear(16, 16, 4, density=0.5, generator=_seeded(0)), rank)),
    ):
        try:
            BlockRowParallelBSRLinear(layer())
        except ValueError as exc:
            refused[name] = "on every rank" in str(exc)
        else:
            refused[name] = False
    results["refused"] = refused
    # Another rank's state_dict has this rank's shapes here (an even split): it loaded silently, and the
    # layer computed the other rank's rows. Its part is named now; this rank's own loads.
    tp = BlockRowParallelBSRLinear(BSRLinear(16, 16, 4, density=1.0, generator=_seeded(0)))
    states: list[Any] = [None] * world
    torch.distributed.all_gather_object(states, tp.state_dict())
    try:
        tp.load_state_dict(states[1 - rank])
        results["other_rank_state"] = "loaded"
    except ValueError as exc:
        results["other_rank_state"] = "refused" if "holds the part" in str(exc) else str(exc)
    tp.load_state_dict(states[rank])
    # A deep copy (an EMA model) shares the group and computes the same; a second derivative through
    # the input gradient runs no in-place collective on the graph (torch warns about those).
    full = uniform_layer(3)
    tp = BlockRowParallelBSRLinear(copy.deepcopy(full))
    twin = copy.deepcopy(tp)
    x = torch.randn(3, full.in_features, generator=_seeded(5), requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (gx,) = torch.autograd.grad(tp(x).pow(2).sum(), x, create_graph=True)
        gx.pow(2).sum().backward()
    results["deepcopy_same"] = twin.group is tp.group and torch.equal(twin(x), tp(x))
    results["double_backward_warnings"] = [str(w.message)[:80] for w in caught]
    # A pattern written between forward and backward by numpy (moving no counter) is refused, as
    # BSRLinear's (the backward gave another pattern's gradient).
    y = tp(x)
    col = tp.col_indices.clone()
    tp.col_indices.numpy()[:] = (col + 1).numpy() % (full.in_features // full.blocksize[1])
    try:
        y.sum().backward()
    except RuntimeError as exc:
        results["pattern_write_refused"] = "between the forward and the backward" in str(exc)
    else:
        results["pattern_write_refused"] = False
    tp.col_indices.copy_(col)
    return results


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _index_dtype(layer: BSRLinear, rank: int) -> BSRLinear:
    """``layer`` with int32 indices on rank 1 (int64 elsewhere): the same pattern, gathered as another
    dtype by to_bsr_linear (gloo aborted the process)."""
    if rank:
        layer.crow_indices, layer.col_indices = layer.crow_indices.int(), layer.col_indices.int()
    return layer


def _other_bias(layer: BSRLinear, rank: int) -> BSRLinear:
    """``layer`` with another bias on rank 1: the same pattern and blocks."""
    if rank:
        with torch.no_grad():
            layer.bias.add_(1.0)
    return layer


def _one_block_per_row(cols: list[int]) -> BSRLinear:
    """A (4 * rows) x 12 layer of 4 x 4 blocks, one per block row, at the given block columns."""
    dense = nn.Linear(12, 4 * len(cols))
    with torch.no_grad():
        dense.weight.zero_()
        for i, j in enumerate(cols):
            dense.weight[4 * i : 4 * i + 4, 4 * j : 4 * j + 4] = 1.0
    return BSRLinear.from_dense(dense, 4, density=len(cols) / (3 * len(cols)))


SCENARIOS = {
    "ddp": scenario_ddp,
    "ddp_pattern": scenario_ddp_pattern,
    "ddp_rigl": scenario_ddp_rigl,
    "fsdp2": scenario_fsdp2,
    "tp": scenario_tp,
}


def main() -> None:
    print(f"started after {time.perf_counter() - T0:.1f} s", flush=True)
    out, names = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")  # in case BSRKIT_BACKEND=cpu (numba not loaded yet)
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        for name in names:
            start = time.perf_counter()
            result = SCENARIOS[name](rank, world, out)
            print(f"rank {rank}: {name} took {time.perf_counter() - start:.1f} s", flush=True)
            if rank == 0:
                (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    finally:
        torch.distributed.destroy_process_group()
    print(f"rank {rank}: done {names} (pid {os.getpid()})")


if __name__ == "__main__":
    main()
    # Every result is written and the process group destroyed: leave without running C++ static
    # destructors, where gloo's threads have been seen to abort a finished rank at exit ("terminate called
    # without an active exception", exit -6, once in many CI runs).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
