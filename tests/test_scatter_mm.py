"""scatter_mm, bsr_scatter_mm and their indices data, against torch's layout and the reference."""

import numpy as np
import pytest
import torch
import torch.sparse._triton_ops as torch_ops

import bsrkit
from bsrkit import reference, scatter
from bsrkit.backends import BACKENDS
from helpers import assert_close, backends, random_bsr, run_python

FORMATS = ["bsr_strided_mm_compressed", "bsr_strided_mm", "scatter_mm"]


def _equal_data(ours, theirs):
    assert ours[0] == theirs[0]
    n = len(theirs) - (1 if isinstance(theirs[-1], dict) else 0)
    for a, b in zip(ours[1:n], theirs[1:n], strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)
    if isinstance(theirs[-1], dict):  # the whole meta, so ours can drive torch's Triton kernels
        assert ours[-1] == theirs[-1]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("N,nbatch", [(64, ()), (128, (2,))])
def test_indices_data_identical_to_torch(fmt, N, nbatch):
    bsr = random_bsr((64, 96), (16, 16), 0.5, empty_rows=(1,), empty_cols=(2,))
    other = torch.randn(*nbatch, 96, N)
    ours = bsrkit.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt)
    theirs = torch_ops.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt)
    _equal_data(ours, theirs)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch", [(), (2,), (2, 2)])
def test_bsr_scatter_mm_with_indices_data(fmt, batch):
    bsr = random_bsr((48, 40), (8, 4), 0.5, empty_rows=(0, 3))
    other = torch.randn(*batch, 40, 32)
    data = bsrkit.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt, SPLIT_N=4)
    got = bsrkit.bsr_scatter_mm(bsr, other, indices_data=data)
    assert_close(got, reference.bsr_scatter_mm(bsr, other), k=40)


@pytest.mark.parametrize("fmt", FORMATS[:2])
def test_scatter_mm_accumulates_like_the_reference(fmt):
    bsr = random_bsr((32, 32), (8, 8), 0.6, empty_rows=(2,))
    other = torch.randn(2, 32, 16)
    data = bsrkit.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt, SPLIT_N=2)
    acc = torch.randn(2, 32, 16)
    expected = reference.scatter_mm(bsr.values(), other, data, acc)
    got = bsrkit.scatter_mm(bsr.values(), other, data, accumulators=acc.clone())
    assert_close(got, expected, k=32)


def test_scatter_mm_format_on_batches_of_blocks():
    blocks = torch.randn(5, 4, 3)
    others = torch.randn(6, 3, 2)
    c_offsets = torch.tensor([0, 2, 2, 5], dtype=torch.int32)  # an empty output in the middle
    pq = torch.tensor([[0, 1], [4, 5], [1, 0], [2, 2], [3, 3]], dtype=torch.int32)
    data = ("scatter_mm", c_offsets, pq)
    acc = torch.randn(3, 4, 2)
    expected = reference.scatter_mm(blocks, others, data, acc)
    assert_close(bsrkit.scatter_mm(blocks, others, data, accumulators=acc.clone()), expected, k=3)
    assert_close(bsrkit.scatter_mm(blocks, others, data), reference.scatter_mm(blocks, others, data, 0 * acc))


def test_bsr_scatter_mm_default_path_and_out():
    bsr = random_bsr((24, 30), (3, 5), 0.5, empty_rows=(1,))
    other = torch.randn(3, 30, 7)
    out = torch.empty(3, 24, 7)
    assert bsrkit.bsr_scatter_mm(bsr, other, out=out) is out
    assert_close(out, reference.bsr_scatter_mm(bsr, other), k=30)


def test_indices_data_cached_and_never_stale():
    bsrkit.cache_clear()
    d = torch.zeros(32, 32)
    d[:16, :16] = 1
    bsr = d.to_sparse_bsr((16, 16))
    other = torch.randn(32, 32)
    a = bsrkit.bsr_scatter_mm_indices_data(bsr, other)
    b = bsrkit.bsr_scatter_mm_indices_data(bsr, other)
    # Computed once (the counts below); each caller gets its own copy, which it may write.
    assert all(torch.equal(x, y) and x is not y for x, y in zip(a[1:-1], b[1:-1], strict=True))
    bsr.col_indices()[0] = 1
    c = bsrkit.bsr_scatter_mm_indices_data(bsr, other)
    assert_close(bsrkit.bsr_scatter_mm(bsr, other, c), reference.bsr_scatter_mm(bsr, other))
    info = bsrkit.cache_info()
    # Each indices-data call: the pattern's verdict and the indices data; the product: the same two (hits:
    # its check that the indices data are the pattern's), their verdict and the CPU backend's gemm list
    # (one entry each, on the indices data's tensors).
    assert (info.hits, info.misses) == (4, 6)


def test_errors():
    bsr = random_bsr((32, 32), (8, 8), 0.5)
    other = torch.randn(32, 16)
    with pytest.raises(ValueError, match="expected indices_format in"):
        bsrkit.bsr_scatter_mm_indices_data(bsr, other, indices_format="csr")
    with pytest.raises(ValueError, match="2-D bsr"):
        bsrkit.bsr_scatter_mm_indices_data(random_bsr((2, 32, 32), (8, 8), 0.5), other)
    with pytest.raises(ValueError, match="divisor of N"):
        bsrkit.bsr_scatter_mm_indices_data(bsr, other, SPLIT_N=3)
    with pytest.raises(ValueError, match="divisible by the block height"):
        bsrkit.bsr_scatter_mm_indices_data(bsr, torch.randn(32, 12), indices_format="scatter_mm")
    with pytest.raises(ValueError, match=r"expected indices_data\[0\]"):
        bsrkit.scatter_mm(bsr.values(), other, ("nope",))
    with pytest.raises(ValueError, match="expected blocks to have at least 3 dimensions"):
        bsrkit.scatter_mm(torch.randn(4, 4), other, ("scatter_mm",))
    with pytest.raises(ValueError, match=r"expected blocks to be 3-D \(P, Ms, Ks\)"):
        bsrkit.scatter_mm(torch.randn(1, 4, 4, 4), other, ("scatter_mm",))
    with pytest.raises(TypeError, match="expected bsr to have layout"):
        bsrkit.bsr_scatter_mm(torch.randn(32, 32), other)


def test_import_is_lean():
    """import bsrkit must not import triton or numba, nor initialise CUDA."""
    code = (
        "import sys, torch, bsrkit; "
        "assert 'triton' not in sys.modules, 'triton'; "
        "assert 'numba' not in sys.modules, 'numba'; "
        "assert not torch.cuda.is_initialized(), 'cuda'"
    )
    run_python(code, timeout=120)


# -- the compiled CPU kernel (and the torch backend beside it) -------------------------------------------


CPU_AND_TORCH = pytest.mark.parametrize("backend", backends("cpu", "torch"), indirect=True)


@CPU_AND_TORCH
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape,blocksize,N,batch,split_n",
    [
        ((64, 48), (16, 8), 32, (), 4),  # rectangular blocks, SPLIT_N panels of 8 columns
        ((48, 64), (8, 8), 16, (3,), 2),  # batched other
        ((32, 32), (8, 8), 64, (2, 1), 1),
    ],
)
def test_bsr_scatter_mm_every_format(backend, fmt, dtype, shape, blocksize, N, batch, split_n):
    if backend == "cpu" and BACKENDS["cpu"].not_supported_reasons("scatter_mm", torch.device("cpu"), dtype):
        pytest.skip(f"this BLAS has no {dtype} gemm")
    bsr = random_bsr(shape, blocksize, 0.4, dtype, empty_rows=(1,), empty_cols=(0,), integers=True)
    other = torch.randint(-3, 4, (*batch, shape[1], N)).to(dtype)  # small integers: exact products
    data = bsrkit.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt, SPLIT_N=split_n)
    out = torch.full((*batch, shape[0], N), float("nan"), dtype=dtype)  # every element must be written
    assert bsrkit.bsr_scatter_mm(bsr, other, data, out=out) is out
    torch.testing.assert_close(out, reference.bsr_scatter_mm(bsr, other), rtol=0, atol=0)


@CPU_AND_TORCH
@pytest.mark.parametrize("fmt", FORMATS)
def test_bsr_scatter_mm_torch_indices_data_and_nnz_zero(backend, fmt):
    g = torch.Generator().manual_seed(3)
    bsr = random_bsr((64, 64), (16, 16), 0.5, empty_rows=(0, 3), generator=g)
    assert bsr._nnz() > 0  # (torch's own indices data fail on an empty pattern: a draw left to the global
    # generator was empty after some test orders)
    other = torch.randn(2, 64, 64, generator=g)
    data = torch_ops.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt)  # torch's own
    assert_close(bsrkit.bsr_scatter_mm(bsr, other, data), reference.bsr_scatter_mm(bsr, other), k=64)
    empty = torch.zeros(64, 64).to_sparse_bsr((16, 16))
    data = bsrkit.bsr_scatter_mm_indices_data(empty, other, indices_format=fmt)
    out = torch.full((2, 64, 64), 7.0)
    assert torch.equal(bsrkit.bsr_scatter_mm(empty, other, data, out=out), torch.zeros(2, 64, 64))


@CPU_AND_TORCH
@pytest.mark.parametrize("fmt", FORMATS[:2])
def test_scatter_mm_strided_non_contiguous_operands(backend, fmt):
    bsr = random_bsr((32, 48), (8, 16), 0.5, empty_rows=(2,))
    data = bsrkit.bsr_scatter_mm_indices_data(bsr, torch.empty(48, 32), indices_format=fmt, SPLIT_N=4)
    others = torch.randn(2, 32, 48).mT  # (2, 48, 32), column-major matrices
    acc = torch.randn(32, 2, 64)[..., ::2].transpose(0, 1)  # (2, 32, 32), no unit stride
    expected = reference.scatter_mm(bsr.values(), others, data, acc)
    got = bsrkit.scatter_mm(bsr.values(), others, data, accumulators=acc)
    assert got is acc
    assert_close(acc, expected, k=48)


@CPU_AND_TORCH
def test_scatter_mm_hand_made_indices_non_contiguous(backend):
    blocks = torch.randn(8, 5, 4, dtype=torch.float64)[::2]  # (4, 5, 4), every other block
    others = torch.randn(7, 3, 4, dtype=torch.float64).mT  # (7, 4, 3)
    c_offsets = torch.tensor([0, 3, 3, 4, 8])  # an empty output, int64
    pq = torch.tensor([[0, 6], [3, 0], [0, 6], [2, 2], [1, 1], [1, 5], [3, 3], [2, 0]], dtype=torch.int32)
    data = ("scatter_mm", c_offsets, pq)
    acc = torch.randn(4, 3, 5, dtype=torch.float64).mT  # (4, 5, 3), column-major
    expected = reference.scatter_mm(blocks, others, data, acc)
    assert_close(bsrkit.scatter_mm(blocks, others, data, accumulators=acc), expected, k=4)


@CPU_AND_TORCH
@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_at_a_storage_offset(backend, fmt):
    """One matrix of a batched BSR: its values start inside the batch's storage (the compiled loop
    read them from the storage's start: the product of the first matrix)."""
    bsr3 = random_bsr((3, 16, 24), (4, 8), 0.5, dtype=torch.float64)
    bsr = bsr3[1]
    assert bsr.values().storage_offset() > 0
    other = torch.randn(24, 8, dtype=torch.float64)
    data = bsrkit.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt)
    assert_close(bsrkit.bsr_scatter_mm(bsr, other, indices_data=data), reference.bsr_dense_mm(bsr, other))
    if fmt != "scatter_mm":
        return
    blocks = torch.randn(4 * 2 * 3 + 6, dtype=torch.float64)[6:].view(4, 2, 3)  # hand-made, offset 6
    others = torch.randn(5, 3, 4, dtype=torch.float64)
    hand_made = (
        "scatter_mm",
        torch.tensor([0, 2, 2, 5]),
        torch.tensor([[0, 1], [3, 4], [1, 0], [1, 0], [2, 2]]),
    )
    acc = torch.zeros(3, 2, 4, dtype=torch.float64)
    expected = reference.scatter_mm(blocks, others, hand_made, acc)
    assert_close(bsrkit.scatter_mm(blocks, others, hand_made), expected, k=3)


@CPU_AND_TORCH
def test_scatter_mm_overlapping_hand_made_tiles(backend):
    """Tiles that overlap (off the grid, or twice at one place) still sum exactly."""
    blocks = torch.randint(-3, 4, (3, 4, 4)).double()
    others = torch.randint(-3, 4, (2, 8, 8)).double()
    N = 8
    r_offsets = torch.tensor([0, 0, 2 * N + 2], dtype=torch.int32)  # twice at (0, 0); one at (2, 2)
    c_indices = torch.tensor([0, 2, 3, 5], dtype=torch.int32)
    p_offsets = torch.tensor([0, 1, 2, 0, 2], dtype=torch.int32)
    q_offsets = torch.tensor([0, 4 * N + 4, 4, 1, 3 * N], dtype=torch.int32)
    data = ("bsr_strided_mm", c_indices, r_offsets, p_offsets, q_offsets, {"SPLIT_N": 2})
    acc = torch.randint(-3, 4, (2, 8, 8)).double()
    expected = reference.scatter_mm(blocks, others, data, acc)
    torch.testing.assert_close(
        bsrkit.scatter_mm(blocks, others, data, accumulators=acc), expected, rtol=0, atol=0
    )


@CPU_AND_TORCH
def test_scatter_mm_accumulators_sharing_memory(backend):
    """Accumulators that overlap an input still get the products of the inputs as they were."""
    blocks = torch.randn(2, 4, 4)
    buf = torch.randn(3, 4, 4)
    data = ("scatter_mm", torch.tensor([0, 1, 2]), torch.tensor([[0, 1], [1, 2]]))
    acc = buf[:2]  # others[1:] and acc[1:] share memory
    expected = reference.scatter_mm(blocks, buf, data, acc.clone())
    assert_close(bsrkit.scatter_mm(blocks, buf, data, accumulators=acc), expected, k=4)


@CPU_AND_TORCH
@pytest.mark.parametrize("fmt", ["scatter_mm", "bsr_strided_mm"])
def test_accumulators_whose_elements_share_memory_get_every_sum(backend, fmt):
    """An expanded accumulator (its matrices one memory) gets the sum of every matrix's products, as
    torch's scatter_mm adds them row by row (bsrkit failed in torch's add_; torch's strided formats fail)."""
    blocks = torch.randint(-3, 4, (3, 4, 4)).double()
    if fmt == "scatter_mm":
        others = torch.randint(-3, 4, (4, 4, 4)).double()
        data = (
            "scatter_mm",
            torch.tensor([0, 2, 3, 5]),
            torch.tensor([[0, 1], [1, 2], [2, 0], [0, 3], [1, 1]]),
        )
        shape = (3, 4, 4)
    else:
        others = torch.randint(-3, 4, (8, 8)).double()
        blocks = torch.randint(-3, 4, (4, 4, 4)).double()
        data = bsrkit.bsr_scatter_mm_indices_data(
            torch.sparse_bsr_tensor(torch.tensor([0, 2, 4]), torch.tensor([0, 1, 0, 1]), blocks), others,
            indices_format="bsr_strided_mm", SPLIT_N=2,
        )  # fmt: skip
        shape = (8, 8)
    base = torch.randint(-3, 4, shape[-1:]).double()
    acc = base.expand(shape)  # every element of a row of matrices is one of four numbers
    separate = reference.scatter_mm(blocks, others, data, torch.zeros(shape, dtype=torch.float64))
    start = base.new_zeros(base.shape) if fmt == "bsr_strided_mm" else base  # (that format overwrites)
    expected = start + separate.reshape(-1, shape[-1]).sum(0)
    bsrkit.scatter_mm(blocks, others, data, accumulators=acc)
    torch.testing.assert_close(base, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_backend_runs_the_compiled_kernel(monkeypatch, fmt, dtype):
    import bsrkit.backends.torch_ops as torch_primitives

    def refuse(*args, **kwargs):
        raise AssertionError("scatter_mm_into called")

    monkeypatch.setattr(torch_primitives, "scatter_mm_into", refuse)
    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    bsr = random_bsr((64, 32), (16, 8), 0.5, dtype, empty_rows=(1,))
    other = torch.randn(32, 32, dtype=dtype)
    data = bsrkit.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt)
    assert_close(bsrkit.bsr_scatter_mm(bsr, other, data), reference.bsr_scatter_mm(bsr, other), k=32)
    if fmt != "scatter_mm":
        acc = torch.randn(64, 32, dtype=dtype)
        expected = reference.scatter_mm(bsr.values(), other, data, acc)
        assert_close(bsrkit.scatter_mm(bsr.values(), other, data, accumulators=acc), expected, k=32)


def test_cpu_plan_joins_split_n_panels():
    """torch's SPLIT_N panels of one block row become one wide gemm tile; empty rows one zero tile."""
    from bsrkit.backends.cpu import planning

    bsr = random_bsr((64, 64), (16, 16), 0.5, empty_rows=(2,))
    other = torch.randn(64, 128)
    for fmt in FORMATS[:2]:
        data = torch_ops.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt, SPLIT_N=8)
        plan = planning.cpu_scatter_plan(data, 128, 16, 16, 256, grid_rows=4)
        assert plan.tiles.shape[0] == 4 and plan.covers and plan.disjoint
        assert plan.tasks[:, 2].tolist() == [128] * 4
        assert plan.pairs.shape[0] == bsr._nnz()  # one gemm per block, as bsr_dense_mm
    data = bsrkit.bsr_scatter_mm_indices_data(bsr, other, indices_format="scatter_mm")
    plan = planning.cpu_scatter_plan(data, 128, 16, 16, 256, tiling=(4, 8, 4, 16, 16))
    assert plan.tiles.shape[0] == 4 and plan.tasks[:, 2].tolist() == [128] * 4
    assert planning.cpu_scatter_plan(data, 128, 16, 16, 256).tiles.shape[0] == 32  # plain stacks: no join


@CPU_AND_TORCH
@pytest.mark.parametrize("blocksize", [(1, 1), (1, 3), (2, 1)])
def test_bsr_scatter_mm_thin_blocks_join_correctly(backend, blocksize):
    """Tiles one row or column wide (strides of size-1 dims are arbitrary) join into valid gemms."""
    bsr = random_bsr((4, 6), blocksize, 0.6, torch.float64, integers=True)
    other = torch.randint(-3, 4, (2, 6, 4 * blocksize[0])).double()
    for fmt in FORMATS:
        data = bsrkit.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt)
        got = bsrkit.bsr_scatter_mm(bsr, other, data)
        torch.testing.assert_close(got, reference.bsr_scatter_mm(bsr, other), rtol=0, atol=0)


def test_cpu_plan_lives_as_long_as_the_indices_data(monkeypatch):
    """The gemm list is cached on the index tensors: a second call hits, and the entry (with the
    indices' verdict) goes when the tensors die."""
    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    bsrkit.cache_clear()
    blocks, others = torch.randn(2, 4, 4), torch.randn(3, 4, 4)
    data = ("scatter_mm", torch.tensor([0, 2, 3]), torch.tensor([[0, 1], [1, 2], [1, 0]]))
    for _ in range(2):
        bsrkit.scatter_mm(blocks, others, data)
    info = bsrkit.cache_info()
    assert (info.hits, info.misses, info.currsize) == (2, 2, 2)  # the verdict and the gemm list
    del data
    assert bsrkit.cache_info().currsize == 0


# -- offsets beyond int32 (issue 24, item 7) ------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["bsr_strided_mm_compressed", "bsr_strided_mm"])
def test_int32_indices_that_would_overflow_raise_naming_it(fmt):
    K, N = 2**16, 2**15 + 16  # K * N > 2**31: other's offsets exceed int32 (expanded views: no memory)
    b64 = random_bsr((16, K), (16, 16), 0.01, torch.float32)
    b32 = torch.sparse_bsr_tensor(
        b64.crow_indices().int(), b64.col_indices().int(), b64.values(), size=b64.shape
    )
    other = torch.zeros(()).expand(K, N)
    with pytest.raises(ValueError, match=r"overflows bsr's int32 indices.*int64"):
        bsrkit.bsr_scatter_mm_indices_data(b32, other, indices_format=fmt)
    data = bsrkit.bsr_scatter_mm_indices_data(b64, other, indices_format=fmt)  # int64: no overflow
    assert int(data[-2].min()) >= 0 and data[-2].dtype == torch.int64
    small = torch.zeros(()).expand(K, 2**15)  # K * N == 2**31: every offset fits, int32 as torch's
    assert bsrkit.bsr_scatter_mm_indices_data(b32, small, indices_format=fmt)[-2].dtype == torch.int32


def test_negative_int32_offsets_name_the_overflow():
    bsr = random_bsr((16, 32), (4, 4), 0.5, torch.float32)
    other = torch.randn(32, 8)
    data = list(bsrkit.bsr_scatter_mm_indices_data(bsr, other, indices_format="bsr_strided_mm"))
    data[-2] = data[-2].int() - 2**30 * 2  # wrapped around, as torch's would be
    with pytest.raises(ValueError, match="int32 offset that overflowed"):
        bsrkit.scatter_mm(bsr.values(), other, tuple(data))
    with pytest.raises(ValueError, match="indices data for another pattern, width or batch"):  # not bsr's
        bsrkit.bsr_scatter_mm(bsr, other, indices_data=tuple(data))


def test_scatter_mm_format_refuses_more_tiles_than_int32_holds():
    bsr = random_bsr((4, 64), (1, 1), 0.5, torch.float32)
    other = torch.zeros(()).expand(2**20, 64, 2**12)  # 2**38 tiles of other
    with pytest.raises(ValueError, match="int32"):
        bsrkit.bsr_scatter_mm_indices_data(bsr, other, indices_format="scatter_mm")


def test_indices_data_paths_refuse_arguments_that_require_grad():
    # They are not differentiable (nor are torch's): a gradient must not be cut off silently.
    bsr = random_bsr((16, 32), (4, 4), 0.5)
    other = torch.randn(32, 8, requires_grad=True)
    data = bsrkit.bsr_scatter_mm_indices_data(bsr, other)
    with pytest.raises(ValueError, match="other not to require grad"):
        bsrkit.bsr_scatter_mm(bsr, other, indices_data=data)
    with pytest.raises(ValueError, match="blocks not to require grad"):
        bsrkit.scatter_mm(bsr.values().clone().requires_grad_(), other.detach(), data)
    with torch.no_grad():
        bsrkit.bsr_scatter_mm(bsr, other, indices_data=data)
    got = bsrkit.bsr_scatter_mm(bsr, other)  # without indices data: differentiable
    got.sum().backward()
    assert other.grad is not None


@pytest.mark.parametrize("fmt", ["bsr_strided_mm_compressed", "bsr_strided_mm", "scatter_mm"])
def test_indices_data_of_another_width_or_an_earlier_pattern_are_refused(fmt):
    """Offsets made for N = 8 stay in bounds at N = 16 in the strided formats, and an earlier pattern's
    with the same nnz in every format: bounds alone would let both through to a wrong product."""
    bsr = torch.sparse_bsr_tensor(
        torch.tensor([0, 2, 3, 5]), torch.tensor([0, 2, 1, 0, 2]), torch.randn(5, 4, 4), size=(12, 12)
    )
    narrow = bsrkit.bsr_scatter_mm_indices_data(bsr, torch.randn(12, 8), fmt)
    with pytest.raises(ValueError, match=r"other.shape\[-1\] == 16.*got indices data for another"):
        bsrkit.bsr_scatter_mm(bsr, torch.randn(12, 16), narrow)
    other = torch.randn(12, 8)
    assert_close(bsrkit.bsr_scatter_mm(bsr, other, narrow), reference.bsr_scatter_mm(bsr, other))
    bsr.col_indices()[0] = 1  # an in-place pattern change: the data made before describe the old one
    with pytest.raises(ValueError, match="for this bsr as it is now"):
        bsrkit.bsr_scatter_mm(bsr, other, narrow)
    fresh = bsrkit.bsr_scatter_mm_indices_data(bsr, other, fmt)
    assert_close(bsrkit.bsr_scatter_mm(bsr, other, fresh), reference.bsr_scatter_mm(bsr, other))


def test_torch_made_indices_data_are_accepted():
    from torch.sparse import _triton_ops

    bsr = random_bsr((32, 48), (8, 16), 0.5)
    other = torch.randn(48, 32)
    for fmt in ("bsr_strided_mm_compressed", "bsr_strided_mm", "scatter_mm"):
        data = _triton_ops.bsr_scatter_mm_indices_data(bsr, other, fmt)
        assert_close(bsrkit.bsr_scatter_mm(bsr, other, data), reference.bsr_scatter_mm(bsr, other))
    # (numpy's integers, as torch takes them: its indices data then hold one)
    for made_by, split_n in ((_triton_ops, np.int64(2)), (bsrkit, np.int64(2)), (bsrkit, np.int8(2))):
        data = made_by.bsr_scatter_mm_indices_data(bsr, other, "bsr_strided_mm", SPLIT_N=split_n)
        assert_close(bsrkit.bsr_scatter_mm(bsr, other, data), reference.bsr_scatter_mm(bsr, other))
    with pytest.raises(ValueError, match=r"^scatter_mm_meta\(\): expected SPLIT_N to be a positive int"):
        bsrkit.scatter_mm_meta(32, 48, 32, 8, 16, SPLIT_N=0)  # (named as the function called)


def test_out_sharing_memory_with_other_gets_the_product_of_other_as_it_was_on_every_path():
    bsr = random_bsr((16, 16), (4, 4), 0.5)
    kept = torch.randn(16, 8)
    for data in (None, bsrkit.bsr_scatter_mm_indices_data(bsr, kept)):
        other = kept.clone()
        assert_close(bsrkit.bsr_scatter_mm(bsr, other, data, out=other), reference.bsr_scatter_mm(bsr, kept))


@pytest.mark.parametrize("fmt", ["bsr_strided_mm_compressed", "bsr_strided_mm", "scatter_mm"])
def test_out_on_bsrs_values_gets_the_product_of_the_blocks_as_they_were(fmt):
    """out overlapping the blocks was zeroed before they were read (the product all zeros): through a
    temporary now, with and without indices data."""
    values = torch.randn(4, 4, 4)
    kept = values.clone()
    bsr = torch.sparse_bsr_tensor(torch.tensor([0, 2, 4]), torch.tensor([0, 1, 0, 1]), values, size=(8, 8))
    other = torch.randn(8, 8)
    for data in (None, bsrkit.bsr_scatter_mm_indices_data(bsr, other, fmt)):
        values.copy_(kept)
        expected = reference.bsr_scatter_mm(bsr, other)
        assert_close(bsrkit.bsr_scatter_mm(bsr, other, data, out=values.view(8, 8)), expected)


@pytest.mark.parametrize("fmt", ["bsr_strided_mm_compressed", "bsr_strided_mm", "scatter_mm"])
def test_writing_handed_out_indices_data_changes_no_cached_data(fmt):
    bsr = random_bsr((32, 32), (8, 8), 0.5)
    other = torch.randn(32, 16)
    data = bsrkit.bsr_scatter_mm_indices_data(bsr, other, fmt)
    edited = next(
        t for t in data[1:] if isinstance(t, torch.Tensor) and t.numel() > 1 and t.unique().numel() > 1
    )
    edited.copy_(edited.flip(0))  # (in bounds: the same entries in another order)
    with pytest.raises(ValueError, match="expected indices_data made by"):
        bsrkit.bsr_scatter_mm(bsr, other, data)
    fresh = bsrkit.bsr_scatter_mm_indices_data(bsr, other, fmt)
    assert_close(bsrkit.bsr_scatter_mm(bsr, other, fresh), reference.bsr_scatter_mm(bsr, other))


def test_bsr_scatter_mm_names_other_and_a_batch_mismatch():
    bsr = random_bsr((16, 16), (4, 4), 0.5)
    with pytest.raises(ValueError, match=r"expected other.shape\[-2\] == 16"):
        bsrkit.bsr_scatter_mm(bsr, torch.randn(12, 8))
    with pytest.raises(TypeError, match=r"expected other.dtype == torch.float32"):
        bsrkit.bsr_scatter_mm(bsr, torch.randn(16, 8, dtype=torch.float64))
    data = bsrkit.bsr_scatter_mm_indices_data(bsr, torch.randn(16, 8), "scatter_mm")
    with pytest.raises(ValueError, match=r"other's 3 batch\(es\)"):
        bsrkit.bsr_scatter_mm(bsr, torch.randn(3, 16, 8), data)


@pytest.mark.parametrize(
    "call",
    [
        lambda bsr, x, o: bsrkit.bsr_dense_mm(bsr, x, out=o),
        lambda bsr, x, o: bsrkit.bsr_dense_addmm(torch.zeros(16, 8), bsr, x, out=o),
        lambda bsr, x, o: bsrkit.bsr_transposed_dense_mm(bsr, x, out=o),
        lambda bsr, x, o: bsrkit.bsr_scatter_mm(bsr, x, None, o),
        lambda bsr, x, o: bsrkit.bsr_scatter_mm(bsr, x, bsrkit.bsr_scatter_mm_indices_data(bsr, x), o),
    ],
    ids=["mm", "addmm", "transposed", "scatter", "scatter-indices"],
)
def test_an_out_that_requires_grad_is_refused_as_torch_refuses_it(call):
    bsr = random_bsr((16, 16), (4, 4), 0.5)
    x = torch.randn(16, 8)
    out = torch.zeros(16, 8, requires_grad=True)
    with pytest.raises(ValueError, match="expected out not to require grad"):
        call(bsr, x, out)
    assert not out.detach().any()
    with torch.no_grad():  # (as torch: allowed where nothing is recorded)
        result = call(bsr, x, out)
    assert result is out and torch.equal(out.detach(), call(bsr, x, torch.empty(16, 8)))


def test_none_in_the_meta_keywords_means_not_given_as_in_torch():
    bsr = random_bsr((8, 12), (2, 4), 0.6, dtype=torch.float64)
    x = torch.randn(12, 16, dtype=torch.float64)
    theirs = torch_ops.bsr_scatter_mm_indices_data(bsr, x, SPLIT_N=None, TILE_M=None)[-1]
    for given in ({"TILE_M": None}, {"SPLIT_N": None}, {"SPLIT_N": None, "num_warps": None}):
        assert bsrkit.bsr_scatter_mm_indices_data(bsr, x, **given)[-1] == theirs
    assert None not in scatter.scatter_mm_meta(256, 256, 256, 16, 16, SPLIT_N=None).values()


@pytest.mark.parametrize(
    "c_offsets",
    [[0, 2, 2, 5], torch.tensor([], dtype=torch.long), torch.tensor([0.0])],
    ids=["list", "empty", "float"],
)
def test_unusable_c_offsets_are_refused_even_where_the_result_is_empty(c_offsets):
    blocks, others = torch.randn(4, 2, 3), torch.randn(5, 3, 4)
    pq = torch.tensor([[0, 1], [3, 4], [1, 0], [1, 0], [2, 2]])
    with pytest.raises(ValueError, match="c_offsets"):
        bsrkit.scatter_mm(blocks, others, ("scatter_mm", c_offsets, pq))


@pytest.mark.parametrize("fmt", FORMATS[:2])
def test_a_bool_split_n_is_refused_by_both_strided_formats(fmt):
    bsr = random_bsr((8, 12), (2, 4), 0.6)
    x = torch.randn(12, 16)
    data = bsrkit.bsr_scatter_mm_indices_data(bsr, x, indices_format=fmt)
    with pytest.raises(ValueError, match="SPLIT_N"):
        bsrkit.scatter_mm(bsr.values(), x, (*data[:-1], dict(data[-1], SPLIT_N=True)))
