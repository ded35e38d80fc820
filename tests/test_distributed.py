"""BSRLinear under torch.distributed (gloo, CPU): DDP, FSDP2, distributed checkpoint, and the block-row
tensor-parallel layer of bsrkit.distributed.

The 2-rank scenarios run once per module, in two worker processes (tests/distributed_workers.py) under a
hard time limit; each test checks its scenario's figures (max abs differences against single-process
training or the unsharded layer, computed by the workers in float32).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import bsrkit
from bsrkit.distributed import BlockRowParallelBSRLinear, parallelize, split_block_rows
from bsrkit.nn import BSRLinear
from distributed_workers import make_model
from helpers import run_python, start_python

WORKERS = Path(__file__).with_name("distributed_workers.py")
# A hard limit for the whole 2-rank run (about 10 s on 2 shared cores, mostly start-up): a hung
# collective fails the tests instead of hanging CI.
WORKER_TIMEOUT_S = 180
# float32, a few optimizer steps of a small model: summation order differs between the runs.
TOL = 1e-5


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(out: Path, scenarios: list[str], world: int = 2, timeout: float = WORKER_TIMEOUT_S) -> None:
    """Run the scenarios on ``world`` local gloo ranks; kill every rank and fail if any fails or the time
    limit passes."""
    env = {  # (start_python puts this tree's src first on PYTHONPATH)
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
        # The portable backend: the wrappers are under test here, not the kernels, and it spares each
        # worker the numba compile (~10 s). BSRKIT_BACKEND=cpu runs the workers on the compiled kernels.
        "BSRKIT_BACKEND": os.environ.get("BSRKIT_BACKEND", "torch"),
    }
    procs = []
    for rank in range(world):
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 (closed below)
        procs.append(
            (
                start_python(
                    [WORKERS, out, *scenarios],
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    cwd=out,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
                log,
            )
        )
    failed = []
    try:
        for rank, (proc, _) in enumerate(procs):
            try:
                if proc.wait(timeout=timeout) != 0:
                    failed.append(f"rank {rank} exited with {proc.returncode}")
            except subprocess.TimeoutExpired:
                failed.append(f"rank {rank} timed out after {timeout} s")
                break
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if failed:
        tails = "\n".join(
            f"--- rank {r} log (tail) ---\n" + (out / f"rank{r}.log").read_text()[-3000:]
            for r in range(world)
        )
        pytest.fail(f"distributed workers failed: {failed}\n{tails}")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("dist")
    scenarios = ["ddp", "ddp_pattern", "ddp_rigl", "fsdp2", "tp"]
    run_ranks(out, scenarios)
    return out, {name: json.loads((out / f"{name}.json").read_text()) for name in scenarios}


def test_ddp_matches_single_process_training(two_ranks):
    result = two_ranks[1]["ddp"]
    print("\nDDP vs single process:", json.dumps(result))
    assert result["losses_max_abs"] < TOL and result["weights_max_abs"] < TOL, result
    assert result["patterns_equal"]
    # DDP's buffer broadcast must not invalidate the plans: no more misses than one process had.
    assert result["plan_misses_per_rank"] == [result["single_process_plan_misses"]] * 2, result
    losses = result["losses"]
    assert losses[-1] < losses[0]  # it trains


def test_ddp_pattern_changed_on_rank_0_after_wrapping_reaches_every_rank(two_ranks):
    """DDP's default buffer sync writes rank 1's index buffers without moving a version counter; the
    plans cached there for the old pattern must be refused (they compare the index data)."""
    result = two_ranks[1]["ddp_pattern"]
    print("\nDDP, pattern changed on rank 0:", json.dumps(result))
    assert result["new_pattern_per_rank"] == [True, True], result
    assert max(result["max_abs_per_rank"]) < TOL, result


def test_rigl_under_ddp_grows_the_blocks_one_process_grows_on_the_global_batch(two_ranks):
    """Each rank recorded the dense gradient of its own batch: the ranks grew different blocks, and the
    replicas' weights diverged (0.1-0.3 on weights of 0.2). The gradient is averaged over the ranks."""
    result = two_ranks[1]["ddp_rigl"]
    print("\nRigL under DDP:", json.dumps(result))
    assert result["masks_equal_single_process_per_rank"] == [1, 1], result
    assert result["weights_max_abs"] < TOL, result
    assert result["masks_equal_with_a_layer_unused_on_rank_1"], result


def test_fsdp2_matches_single_process_and_shards_values(two_ranks):
    result = two_ranks[1]["fsdp2"]
    print("\nFSDP2 vs single process:", json.dumps(result))
    assert result["losses_max_abs"] < TOL and result["weights_max_abs"] < TOL, result
    assert result["patterns_equal"]
    for layer in result["sharding"]:
        assert layer["values_is_dtensor"] and layer["values_sharded_on_dim0"], layer
        nnz = layer["values_global_shape"][0]
        assert layer["values_local_rows"] == [(nnz + 1) // 2, nnz // 2]  # odd nnz: uneven shards
        assert layer["buffers_plain"] and layer["buffers_replicated"], layer


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")
def test_checkpoint_saved_on_2_ranks_loads_on_1_and_replans(two_ranks):
    import torch.distributed.checkpoint as dcp

    out = two_ranks[0]
    expected = torch.load(out / "checkpoint_expected.pt")
    model = make_model(seed=1)  # same shapes, another pattern than the saved model's
    layers = [m for m in model if isinstance(m, BSRLinear)]
    assert not torch.equal(layers[0].to_dense(), expected["dense"][0])
    bsrkit.cache_clear()
    with torch.no_grad():
        model(expected["x"])  # plans of the old patterns are cached now
    misses = bsrkit.cache_info().misses
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(out / "checkpoint"), no_dist=True)  # world size 1
    model.load_state_dict(state)
    with torch.no_grad():
        y = model(expected["x"])
    diff = float((y - expected["y"]).abs().max())
    print(f"\ncheckpoint 2 -> 1 ranks: output max abs diff {diff:.3g}")
    assert diff < TOL
    for layer, dense in zip(layers, expected["dense"], strict=True):
        assert torch.equal(layer.to_dense(), dense)
    assert bsrkit.cache_info().misses == 2 * misses  # every plan rebuilt for the loaded patterns


@pytest.mark.parametrize("pattern", ["uniform", "skewed", "one_rank_empty"])
def test_tensor_parallel_matches_unsharded_layer(two_ranks, pattern):
    result = two_ranks[1]["tp"][pattern]
    per_rank = [(r["nnz"], r["block_rows"]) for r in result["ranks"]]
    print(
        f"\nTP {pattern}: nnz {result['nnz']} (first half of the block rows: {result['nnz_first_half_rows']})"
    )
    for rank, r in enumerate(result["ranks"]):
        print(f"  rank {rank}: nnz {r['nnz']}, block rows {r['block_rows']}, max abs diffs {r['diffs']}")
    if pattern == "skewed":
        assert result["nnz_first_half_rows"] >= 0.9 * result["nnz"]
    if pattern == "one_rank_empty":
        assert per_rank[1][0] == 0
    # Each rank holds its rows only, the ranks cover the layer, balanced by blocks.
    assert sum(nnz for nnz, _ in per_rank) == result["nnz"]
    assert [rows for _, rows in per_rank] == [
        [0, per_rank[0][1][1]],
        [per_rank[0][1][1], result["block_rows"]],
    ]
    assert max(nnz for nnz, _ in per_rank) == _brute_force_best(result["row_counts"], 2)
    for r in result["ranks"]:
        assert r["pattern_is_local"] and r["values_equal_slice"] and r["gathered_equals_full"]
        assert r["modes_follow"] == [True, True]
        for name, diff in r["diffs"].items():
            assert diff <= TOL * max(1.0, r["scale"][name]), (name, diff, r["scale"][name])


def test_tensor_parallel_refuses_ranks_with_different_layers(two_ranks):
    assert two_ranks[1]["tp"]["refused"] == {
        "seed": True,
        "same_column_sum": True,
        "bias": True,
        "dtype": True,
        "index_dtype": True,
        "values": True,  # (the same pattern with other values was accepted: a mix of the ranks' layers)
        "bias_values": True,
    }
    assert two_ranks[1]["tp"]["other_rank_state"] == "refused"


def test_tensor_parallel_deep_copies_differentiates_twice_and_refuses_a_rewritten_pattern(two_ranks):
    assert two_ranks[1]["tp"]["deepcopy_same"]
    assert two_ranks[1]["tp"]["pattern_write_refused"]
    assert two_ranks[1]["tp"]["double_backward_warnings"] == []


# ---- single-process tests -------------------------------------------------------------------------


def _crow(row_counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(row_counts)])


def _brute_force_best(row_counts: list[int], parts: int) -> int:
    rows = len(row_counts)
    best = sum(row_counts)
    for cuts in itertools.combinations_with_replacement(range(rows + 1), parts - 1):
        bounds = [0, *cuts, rows]
        best = min(best, max(sum(row_counts[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_split_block_rows_minimises_the_largest_part(parts):
    g = torch.Generator().manual_seed(parts)
    for trial in range(30):
        rows = int(torch.randint(1, 9, (), generator=g))
        counts = torch.randint(0, 6, (rows,), generator=g).tolist()
        if trial % 3 == 0:
            counts[0] *= 10  # skewed
        bounds = split_block_rows(_crow(counts), parts)
        assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == rows
        assert all(a <= b for a, b in itertools.pairwise(bounds)), bounds
        largest = max(sum(counts[a:b]) for a, b in itertools.pairwise(bounds))
        if sum(counts):
            assert largest == _brute_force_best(counts, parts), (counts, bounds)


def test_split_block_rows_balances_blocks_not_rows():
    counts = [9] * 4 + [1] * 4  # the first half of the rows holds 90% of the blocks
    assert split_block_rows(_crow(counts), 2) == [0, 2, 8]  # 18 + 22 blocks, not 36 + 4
    assert split_block_rows(_crow([0] * 5), 2) == [0, 2, 5]  # no blocks: even by rows
    assert split_block_rows(_crow([3, 3]), 4) == [0, 1, 2, 2, 2]  # more ranks than rows: empty ranks
    with pytest.raises(ValueError, match=r"split_block_rows\(\): expected parts to be an int >= 1, got 0"):
        split_block_rows(_crow([1]), 0)
    assert split_block_rows(_crow([3, 3]), np.int64(2)) == [0, 1, 2]
    with pytest.raises(ValueError, match="expected crow_indices to start at 0, got 5"):
        split_block_rows(torch.tensor([5, 6, 7]), 2)
    with pytest.raises(ValueError, match="expected 1-D integer crow_indices"):
        split_block_rows(torch.zeros(2, 3, dtype=torch.int64), 2)


@pytest.fixture
def world_of_one():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_on_one_rank_is_the_layer(world_of_one):
    torch.manual_seed(0)
    model = torch.nn.Sequential(BSRLinear(32, 48, (8, 4), density=0.4), torch.nn.ReLU(), BSRLinear(48, 16, 8))
    reference = [m for m in model if isinstance(m, BSRLinear)]
    import copy

    tp_model = parallelize(copy.deepcopy(model))
    assert all(isinstance(tp_model[i], BlockRowParallelBSRLinear) for i in (0, 2))
    assert "rank=0/1" in repr(tp_model[0])
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(tp_model(x), model(x), rtol=0, atol=0)
    model(x).square().sum().backward()
    tp_model(x).square().sum().backward()
    for ref, tp in zip(reference, (tp_model[0], tp_model[2]), strict=True):
        torch.testing.assert_close(tp.values.grad, ref.values.grad, rtol=0, atol=0)
        torch.testing.assert_close(tp.bias.grad, ref.bias.grad, rtol=0, atol=0)
    gathered = tp_model[0].to_bsr_linear()
    assert gathered.state_dict().keys() == reference[0].state_dict().keys()
    for key, value in reference[0].state_dict().items():
        assert torch.equal(gathered.state_dict()[key], value), key
    assert gathered.values.requires_grad and gathered.bias.requires_grad
    tp_model[2].values.requires_grad_(False)  # (a frozen layer gathers frozen)
    assert not tp_model[2].to_bsr_linear().values.requires_grad
    with pytest.raises(ValueError, match=r"forward\(\): expected input of shape \(\*, 32\), got \(2, 31\)"):
        tp_model(torch.randn(2, 31))
    with pytest.raises(ValueError, match=r"forward\(\): expected input of shape \(\*, 32\), got \(\)"):
        tp_model(torch.tensor(1.0))
    with pytest.raises(TypeError, match="expected a BSRLinear, got Linear"):
        BlockRowParallelBSRLinear(torch.nn.Linear(4, 4))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected a ProcessGroup, a 1-D DeviceMesh or None, got str"):
        BlockRowParallelBSRLinear(reference[0], "world")


def test_parallelize_keeps_shared_and_tied_layers_one_and_int32_indices(world_of_one):
    """A layer at two places is one parallel layer at both; layers tied by sparsify_ (one values
    Parameter) share their part; to_bsr_linear keeps int32 indices int32 (cumsum promoted crow)."""
    torch.manual_seed(0)
    shared = BSRLinear(16, 16, 4, density=0.5)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
    parallelize(model)
    assert isinstance(model[0], BlockRowParallelBSRLinear) and model[0] is model[2]
    tied = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    tied[1].weight = tied[0].weight
    bsrkit.sparsify_(tied, blocksize=4, density=0.5, force=True)
    assert tied[0].values is tied[1].values
    parallelize(tied)
    assert tied[0] is not tied[1] and tied[0].values is tied[1].values
    assert tied[0].col_indices is tied[1].col_indices
    layer = BSRLinear(16, 8, 4, density=0.5)
    layer.crow_indices, layer.col_indices = layer.crow_indices.int(), layer.col_indices.int()
    gathered = BlockRowParallelBSRLinear(layer).to_bsr_linear()
    assert gathered.crow_indices.dtype == gathered.col_indices.dtype == torch.int32
    x = torch.randn(3, 16)
    torch.testing.assert_close(gathered(x), layer(x), rtol=0, atol=0)


def test_tensor_parallel_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="expected an initialised default process group"):
        BlockRowParallelBSRLinear(BSRLinear(8, 8, 4))


def test_distributed_is_loaded_lazily():
    code = (
        "import sys, bsrkit; "
        "assert 'bsrkit.distributed' not in sys.modules; "
        "assert 'torch.distributed.fsdp' not in sys.modules; "
        "assert bsrkit.distributed.BlockRowParallelBSRLinear"
    )
    run_python(code, timeout=120)


def test_tensor_parallel_names_bad_inputs(world_of_one):
    tp = BlockRowParallelBSRLinear(BSRLinear(16, 16, 4, density=0.5))
    for bad, error, match in (
        (None, TypeError, "expected input to be a strided \\(dense\\) torch.Tensor, got NoneType"),
        (torch.randn(2, 16).to_sparse(), TypeError, "got torch.sparse_coo"),
        (
            torch.randn(2, 16, dtype=torch.float64),
            ValueError,
            "BlockRowParallelBSRLinear.forward\\(\\): expected input.dtype",
        ),
    ):
        with pytest.raises(error, match=match):
            tp(bad)
    with pytest.raises(TypeError, match="parallelize\\(\\): expected an nn.Module, got NoneType"):
        parallelize(None)


def test_tensor_parallel_converts_and_loads_with_swapping_conversions(world_of_one):
    # (torch.utils.swap_tensors refuses a tensor with weak references: the kept weight's held one after a
    # forward, so .double() and load_state_dict failed)
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        torch.manual_seed(0)
        layer = BSRLinear(32, 16, 8, density=0.5)
        tp = BlockRowParallelBSRLinear(BSRLinear(32, 16, 8, density=0.5))
        x = torch.randn(2, 32)
        with torch.no_grad():
            tp(x)
        tp.load_state_dict(BlockRowParallelBSRLinear(layer).state_dict())
        torch.testing.assert_close(tp(x), layer(x))
        tp.double()
        torch.testing.assert_close(tp(x.double()), layer.double()(x.double()))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.mark.parametrize(
    "edit, defect",
    [
        (
            lambda sd: sd["col_indices"].fill_(99),
            r"expected col_indices in \[0, 4\) \(block columns\), got 99",
        ),
        (lambda sd: sd["crow_indices"].add_(1), "crow_indices"),
        (lambda sd: sd.update(crow_indices=sd["crow_indices"][:-1]), "crow_indices"),
    ],
)
def test_tensor_parallel_load_refuses_a_malformed_pattern_by_name(world_of_one, edit, defect):
    """As BSRLinear's load: it loaded, and only the next forward refused it, naming the forward."""
    torch.manual_seed(0)
    tp = BlockRowParallelBSRLinear(BSRLinear(32, 16, 8, density=0.5))
    state = {k: v.clone() for k, v in tp.state_dict().items()}
    before = {k: v.clone() for k, v in state.items()}
    edit(state)
    with pytest.raises(
        ValueError, match=r"BlockRowParallelBSRLinear.load_state_dict\(\): malformed pattern.*" + defect
    ):
        tp.load_state_dict(state)
    for name, t in tp.state_dict().items():  # (nothing loaded)
        assert torch.equal(t, before[name]), name
    x = torch.randn(2, 32)
    torch.testing.assert_close(tp(x), tp.to_bsr_linear()(x))


def test_tensor_parallel_load_of_another_nnz_is_refused_before_anything_loads(world_of_one):
    """torch's load wrote crow_indices, then failed on the values: the next forward found them apart."""
    make = lambda seed, d: BSRLinear(64, 48, 16, density=d, generator=torch.Generator().manual_seed(seed))  # noqa: E731
    tp = BlockRowParallelBSRLinear(make(0, 0.4))
    before = {k: v.clone() for k, v in tp.state_dict().items()}
    with pytest.raises(
        RuntimeError, match=r"holds \[9\] blocks, this rank's part 5: the parallel layer keeps"
    ):
        tp.load_state_dict(BlockRowParallelBSRLinear(make(9, 0.75)).state_dict())
    assert all(torch.equal(t, before[k]) for k, t in tp.state_dict().items())
    x = torch.randn(2, 64)
    torch.testing.assert_close(tp(x), tp.to_bsr_linear()(x))


def test_tensor_parallel_layer_refuses_a_bias_of_another_dtype_as_bsrlinear(world_of_one):
    tp = BlockRowParallelBSRLinear(BSRLinear(32, 16, 8, density=0.5, dtype=torch.float64))
    tp.bias = torch.nn.Parameter(tp.bias.detach().float())
    with pytest.raises(bsrkit.validation.MixedDtypeError, match="bias"):
        tp(torch.randn(2, 32, dtype=torch.float64))
