"""scatter_mm, bsr_scatter_mm and their indices data, against torch's layout and the reference."""

import subprocess
import sys

import pytest
import torch
import torch.sparse._triton_ops as torch_ops

import bsrkit
from bsrkit import reference
from helpers import assert_close, random_bsr

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
    assert all(x is y for x, y in zip(a[1:-1], b[1:-1], strict=True))
    bsr.col_indices()[0] = 1
    c = bsrkit.bsr_scatter_mm_indices_data(bsr, other)
    assert_close(bsrkit.bsr_scatter_mm(bsr, other, c), reference.bsr_scatter_mm(bsr, other))
    info = bsrkit.cache_info()
    # Each indices-data call: the pattern's verdict and the indices data; the product: their verdict
    # and the CPU backend's gemm list (one entry each, on the indices data's tensors).
    assert (info.hits, info.misses) == (2, 6)


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
    subprocess.run([sys.executable, "-c", code], check=True)
