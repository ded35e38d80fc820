"""bsr_dense_addmm's row and column scales (left_alpha, right_alpha) and the int8 -> int32 products,
against the reference on every backend; gradients of the scales in float64."""

import pytest
import torch

import bsrkit
from bsrkit import reference
from helpers import assert_close, random_bsr


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batched", [False, True])
def test_left_and_right_alpha(backend, dtype, batched):
    batch = (2,) if batched else ()
    bsr = random_bsr((*batch, 12, 8), (3, 4), 0.5, dtype, empty_rows=(1,))
    x = torch.randn(*batch, 8, 5, dtype=dtype)
    inp = torch.randn(12, 5, dtype=dtype)
    left = torch.randn(*batch, 12, dtype=dtype)
    right = torch.randn(5, dtype=dtype)  # broadcast over the batch
    for kw in ({"left_alpha": left}, {"right_alpha": right}, {"left_alpha": left, "right_alpha": right}):
        got = bsrkit.bsr_dense_addmm(inp, bsr, x, beta=0.5, alpha=2.0, **kw)
        assert_close(got, reference.bsr_dense_addmm(inp, bsr, x, beta=0.5, alpha=2.0, **kw), k=8)
    with pytest.raises(ValueError, match="left_alpha.shape to broadcast"):
        bsrkit.bsr_dense_addmm(inp, bsr, x, left_alpha=torch.ones(5, dtype=dtype))


def test_scales_are_differentiable(monkeypatch):
    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    torch.manual_seed(0)
    pattern = random_bsr((8, 6), (2, 3), 0.6, torch.float64)
    values = pattern.values().clone().requires_grad_()
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    inp = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    left = torch.randn(8, dtype=torch.float64, requires_grad=True)
    right = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def f(values, x, inp, left, right):
        bsr = torch.sparse_bsr_tensor(pattern.crow_indices(), pattern.col_indices(), values, size=(8, 6))
        return bsrkit.bsr_dense_addmm(inp, bsr, x, beta=0.7, alpha=1.5, left_alpha=left, right_alpha=right)

    torch.autograd.gradcheck(f, (values, x, inp, left, right))


def _int8(shape, generator):
    return torch.randint(-128, 128, shape, generator=generator, dtype=torch.int8)


@pytest.mark.parametrize("K", [16, 2048])  # float32 carries the product exactly up to K = 1024, then float64
def test_int8_products_are_exact(backend, K):
    if backend == "triton" and K > 16:
        pytest.skip("interpreter time")
    g = torch.Generator().manual_seed(K)
    mask = torch.rand(4, K // 8, generator=g) < 0.5
    dense_w = _int8((16, K), g) * mask.repeat_interleave(4, 0).repeat_interleave(8, 1)
    bsr = dense_w.to_sparse_bsr((4, 8))
    x = _int8((K, 6), g)
    expected = (dense_w.long() @ x.long()).to(torch.int32)
    got = bsrkit.bsr_dense_mm(bsr, x)
    assert got.dtype == torch.int32
    assert torch.equal(got, expected)
    inp = torch.randint(-1000, 1000, (16, 6), generator=g, dtype=torch.int32)
    got = bsrkit._int_bsr_dense_addmm(inp, bsr, x, beta=3, alpha=-2)
    assert torch.equal(got, (3 * inp.long() - 2 * expected.long()).to(torch.int32))
    with pytest.raises(ValueError, match="integer beta and alpha"):
        bsrkit._int_bsr_dense_addmm(inp, bsr, x, alpha=0.5)
