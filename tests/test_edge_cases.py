"""Sizes and scalars at the edges: leading dimensions beyond 32 bits, nnz == 0 in training, non-finite
alpha — each against what torch itself computes."""

import math

import pytest
import torch

import bsrkit
from bsrkit import reference
from bsrkit.nn import BSRLinear
from helpers import assert_close, backends, random_bsr

pytestmark = pytest.mark.parametrize("backend", backends("cpu", "torch"), indirect=True)


def _huge_row_stride(rows, cols, fill):
    """A (rows, cols) view whose row stride is 2**31: the storage is 8 GiB of virtual memory, of which
    only the touched pages (the rows) become resident."""
    buf = torch.empty(2**31 * (rows - 1) + cols)
    view = buf.as_strided((rows, cols), (2**31, 1))
    view.copy_(fill)
    return view


def test_row_strides_beyond_32_bits(backend):
    bsr = random_bsr((2, 2), (1, 2), 1.0)
    x = torch.randn(2, 8)
    expected = reference.bsr_dense_mm(bsr, x)
    dense = _huge_row_stride(2, 8, x)
    assert_close(bsrkit.bsr_dense_mm(bsr, dense), expected, k=2)
    del dense
    out = _huge_row_stride(2, 8, torch.full((2, 8), float("nan")))
    bsrkit.bsr_dense_mm(bsr, x, out=out)
    assert_close(out, expected, k=2)
    out.fill_(1.0)
    bsrkit.bsr_dense_addmm(out, bsr, x, beta=1.0, out=out)
    assert_close(out, expected + 1, k=3)


@pytest.mark.parametrize("compiled", [False, True])
def test_bsrlinear_with_no_blocks_trains(backend, compiled):
    layer = BSRLinear(16, 8, 4, density=0.0)
    assert layer.values.shape[0] == 0
    x = torch.randn(3, 16, requires_grad=True)
    fn = torch.compile(layer, fullgraph=True) if compiled else layer
    y = fn(x)
    torch.testing.assert_close(y, layer.bias.expand(3, 8))
    y.sum().backward()
    assert layer.values.grad is not None and layer.values.grad.shape == (0, 4, 4)
    torch.testing.assert_close(x.grad, torch.zeros(3, 16))
    torch.testing.assert_close(layer.bias.grad, torch.full((8,), 3.0))


def _addmm_as_written(inp, a, x, beta, alpha):
    """beta * inp + alpha * (a @ x), scaling the product (torch.addmm on CPU gives NaN everywhere for an
    infinite alpha: MKL scales an operand, and inf * 0 poisons every row)."""
    product = alpha * (a @ x)
    return product if beta == 0 else beta * inp + product


@pytest.mark.parametrize("alpha", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_non_finite_alpha_gives_the_formula_on_every_backend(backend, alpha, beta):
    bsr = random_bsr((16, 12), (4, 4), 0.4, empty_rows=(1,))
    x = torch.randn(12, 8)
    inp = torch.randn(16, 8)
    for a in (bsr, random_bsr((16, 12), (4, 4), 0.0)):
        expected = _addmm_as_written(inp, a.to_dense(), x, beta, alpha)
        got = bsrkit.bsr_dense_addmm(inp, a, x, beta=beta, alpha=alpha)
        torch.testing.assert_close(got, expected, equal_nan=True)


@pytest.mark.parametrize("beta", [0.0, 1.5])
def test_alpha_zero_forms_no_product_as_torch_addmm(backend, beta):
    """alpha == 0: NaN and Inf in the operands never reach the result (torch.addmm, torch's Triton
    kernels), and the reference says so too: for the products and sampled_addmm."""
    bsr = random_bsr((16, 12), (4, 4), 0.5, empty_rows=(1,))
    values = bsr.values().clone()
    values[0, 0, 0] = math.nan
    bsr = torch.sparse_bsr_tensor(bsr.crow_indices(), bsr.col_indices(), values, size=bsr.shape)
    x, inp = torch.randn(12, 8), torch.randn(16, 8)
    x[3, 2] = math.inf
    expected = torch.addmm(inp, torch.zeros(16, 12), x.nan_to_num(0, 0, 0), beta=beta, alpha=0)
    for got in (
        bsrkit.bsr_dense_addmm(inp, bsr, x, beta=beta, alpha=0),
        reference.bsr_dense_addmm(inp, bsr, x, beta=beta, alpha=0),
    ):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected)
    mat1, mat2 = torch.randn(16, 5), torch.randn(5, 12)
    mat1[0, 0], mat2[1, 1] = math.nan, -math.inf
    finite = torch.sparse_bsr_tensor(
        bsr.crow_indices(), bsr.col_indices(), values.nan_to_num(), size=bsr.shape
    )
    inp = finite if beta else bsr  # beta == 0 ignores the NaN block entry
    for got in (
        bsrkit.sampled_addmm(inp, mat1, mat2, beta=beta, alpha=0).to_dense(),
        reference.sampled_addmm(inp, mat1, mat2, beta=beta, alpha=0),
    ):
        torch.testing.assert_close(got, beta * finite.to_dense())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_sums_are_formed_in_float32_and_rounded_once(backend, dtype):
    """As torch: beta * input beyond the half range (120000) plus a product of -60000 is 60000, not inf;
    a sampled product of 70000 plus an input of -60000 is 10000; a beta beyond the range is no error."""
    if dtype is torch.bfloat16:
        pytest.skip("bfloat16's range reaches 3e38: nothing overflows at these sizes")
    A = torch.zeros(32, 32)
    A[:16, :16] = torch.eye(16)
    bsr = A.to(dtype).to_sparse_bsr(16)
    dense, inp = torch.full((32, 8), -60000.0).to(dtype), torch.full((32, 8), 60000.0).to(dtype)
    got = bsrkit.bsr_dense_addmm(inp, bsr, dense, beta=2.0)
    torch.testing.assert_close(got, torch.addmm(inp, A.to(dtype), dense, beta=2.0))
    base = torch.zeros(32, 32)
    base[:16, :16] = -60000.0
    m1, m2 = torch.full((32, 4), 100.0).to(dtype), torch.full((4, 32), 175.0).to(dtype)
    got = bsrkit.sampled_addmm(base.to(dtype).to_sparse_bsr(16), m1, m2).to_dense()
    assert got[0, 0].item() == 10000.0 and torch.isfinite(got).all()
    small = torch.zeros(32, 32)
    small[:16, :16] = 0.01
    got = bsrkit.sampled_addmm(small.to(dtype).to_sparse_bsr(16), m1 * 0, m2, beta=70400.0).to_dense()
    assert got[0, 0].item() == pytest.approx(704.0, rel=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_attention_is_as_accurate_as_torch(backend, dtype, monkeypatch):
    """The composed path rounded the scores to half before the softmax: 10x torch's error, and NaN for
    scores beyond 65504 where torch stays finite."""
    monkeypatch.setenv("BSRKIT_FUSED_ATTENTION", "0")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 64, 16, generator=g) for _ in range(3))
    mask = bsrkit.causal_mask(64, 16)
    dense_mask = mask.to_dense()
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=dense_mask
    )
    ours = bsrkit.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=dense_mask
    )
    error = (ours.double() - exact).norm() / exact.norm()
    assert error <= 2 * (theirs.double() - exact).norm() / exact.norm()
    big = bsrkit.scaled_dot_product_attention(
        (q * 80).to(dtype), (k * 80).to(dtype), v.to(dtype), mask, scale=1.0
    )
    assert torch.isfinite(big).all()


def test_a_batch_of_size_zero_with_stored_blocks(backend):
    """A BSR batch of size 0 still has nnz per batch (crow[0, -1] does not exist): the row plan took nnz
    0, and the backward and attention failed on its shape; q/k/v with no batch element as SDPA."""
    crow, col = torch.zeros(0, 5, dtype=torch.int64), torch.zeros(0, 16, dtype=torch.int64)
    values = torch.zeros(0, 16, 8, 8, requires_grad=True)
    bsr = torch.sparse_bsr_tensor(crow, col, values, size=(0, 32, 32))
    x = torch.randn(32, 4, requires_grad=True)
    out = bsrkit.bsr_dense_mm(bsr, x)
    assert out.shape == (0, 32, 4)
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros(32, 4)) and values.grad.shape == values.shape
    assert bsrkit.bsr_transposed_dense_mm(bsr, x).shape == (0, 32, 4)
    assert bsrkit.sampled_addmm(bsr.detach(), torch.randn(32, 4), torch.randn(4, 32)).shape == (0, 32, 32)
    mask = torch.ones(32, 32, dtype=torch.bool).to_sparse_bsr((8, 8))
    for shape in ((0, 32, 4), (2, 0, 32, 4)):
        q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
        got = bsrkit.scaled_dot_product_attention(q, k, v, mask)
        assert got.shape == torch.nn.functional.scaled_dot_product_attention(q, k, v).shape
        got.sum().backward()
        assert q.grad.shape == shape


@pytest.mark.parametrize(
    ("op", "released"),
    [
        ("mm", "dense"), ("mm", "values"), ("mm_one_column", "dense"), ("mm_one_column", "values"),
        ("transposed", "dense"), ("scatter", "values"), ("scatter", "dense"), ("mm", "col"),
        ("layer", "values"), ("layer", "input"),
    ],
)  # fmt: skip
def test_an_operand_whose_storage_was_released_is_an_error_not_a_crash(backend, op, released):
    """A storage released after a first product (untyped_storage().resize_(0), as FSDP and offloading do)
    is a RuntimeError, as torch.mm says of it: the loops read address 0 (a segfault), the index snapshot
    read past the storage."""
    torch.manual_seed(0)
    bsr = torch.randn(32, 32).relu().to_sparse_bsr(8)
    x = torch.randn(32, 4)
    layer = BSRLinear(32, 32, 8, density=0.5)
    inp = torch.randn(3, 32)
    run = {
        "mm": lambda: bsrkit.bsr_dense_mm(bsr, x),
        "mm_one_column": lambda: bsrkit.bsr_dense_mm(bsr, x[:, :1]),
        "transposed": lambda: bsrkit.bsr_transposed_dense_mm(bsr, x),
        "scatter": lambda: bsrkit.bsr_scatter_mm(bsr, x, bsrkit.bsr_scatter_mm_indices_data(bsr, x)),
        "layer": lambda: layer(inp),
    }[op]
    with torch.no_grad():
        for _ in range(3):  # (checks, prepares, reruns the prepared call)
            run()
        tensor = {
            "dense": x, "values": layer.values if op == "layer" else bsr.values(), "col": bsr.col_indices(),
            "input": inp,
        }[released]  # fmt: skip
        tensor.untyped_storage().resize_(0)
        with pytest.raises(RuntimeError, match="not allocated|requiring a storage size"):
            run()


def test_softmax_and_a_shrunk_storage_are_errors_not_crashes(backend):
    """bsr_softmax's loops read a released storage through a numpy array (a values view at an offset: a
    segfault), and a values storage shrunk below its view was read past its end on a first product.
    (The torch backend runs torch's own ops, which crash on such an offset view themselves.)"""
    if backend == "torch":
        pytest.skip("torch's own ops segfault on an offset view of a released storage")
    vals = torch.randn(20, 8, 8)[4:]
    bsr = torch.sparse_bsr_tensor(
        torch.tensor([0, 4, 8, 12, 16]), torch.arange(4).repeat(4), vals, size=(32, 32)
    )
    for _ in range(3):
        bsrkit.bsr_softmax(bsr)
    vals.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="not allocated|requiring a storage size"):
        bsrkit.bsr_softmax(bsr)
    shrunk = torch.randn(16, 8, 8)
    bsr = torch.sparse_bsr_tensor(
        torch.tensor([0, 4, 8, 12, 16]), torch.arange(4).repeat(4), shrunk, size=(32, 32)
    )
    shrunk.untyped_storage().resize_(64)
    with pytest.raises(RuntimeError, match="not allocated|requiring a storage size"):
        bsrkit.bsr_dense_mm(bsr, torch.randn(32, 2))
