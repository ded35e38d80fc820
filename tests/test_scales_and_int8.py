"""bsr_dense_addmm's row and column scales (left_alpha, right_alpha) and the int8 -> int32 products,
against the reference on every backend; gradients of the scales in float64."""

import math

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


def _saturated_int8():
    w = torch.full((16, 16), 127, dtype=torch.int8)
    return w, w.to_sparse_bsr((8, 8)), torch.full((16, 4), 127, dtype=torch.int8)


def test_an_int8_product_refuses_a_scale_that_requires_grad():
    """Its exact int32 result cannot carry a gradient (it came back as int8, wrapped)."""
    _, bsr, x = _saturated_int8()
    inp = torch.zeros(16, 4, dtype=torch.int32)
    for kwargs, name in (
        ({"left_alpha": torch.ones(16, requires_grad=True)}, "left_alpha"),
        ({"right_alpha": torch.ones(4, requires_grad=True)}, "right_alpha"),
    ):
        with pytest.raises(ValueError, match=f"expected {name} not to require grad in an int8 product"):
            bsrkit.bsr_dense_addmm(inp, bsr, x, **kwargs)
    with torch.no_grad():
        y = bsrkit.bsr_dense_addmm(inp, bsr, x, left_alpha=torch.ones(16, requires_grad=True))
    assert y.dtype == torch.int32 and y[0, 0].item() == 16 * 127 * 127
    with pytest.raises(TypeError, match=r"expected left_alpha.dtype in \{int8"):
        bsrkit.bsr_dense_addmm(inp, bsr, x, left_alpha=torch.ones(16, dtype=torch.complex64))


def test_an_int8_result_beyond_int32_wraps_around_as_torchs_int32():
    """A float64 cast straight to int32 saturated to -2**31; torch's int32 arithmetic wraps (and the
    reference does as the library)."""
    w, bsr, x = _saturated_int8()
    zeros, big = torch.zeros(16, 4, dtype=torch.int32), torch.full((16, 4), 2**31 - 1, dtype=torch.int32)
    for inp, beta, alpha in ((zeros, 1, 10000), (big, 2, 1)):
        want = torch.addmm(inp, w.int(), x.int(), beta=beta, alpha=alpha)
        assert torch.equal(bsrkit.bsr_dense_addmm(inp, bsr, x, beta=beta, alpha=alpha), want)
        assert torch.equal(reference.bsr_dense_addmm(inp, bsr, x, beta=beta, alpha=alpha), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scales_bring_back_a_half_product_beyond_its_range(dtype):
    """The scaled path formed the product in the half dtype: 1.0e5 became inf before the 1e-3 scale."""
    w = torch.full((16, 16), 80.0, dtype=dtype)
    bsr, x = w.to_sparse_bsr((8, 8)), torch.full((16, 4), 80.0, dtype=dtype)
    inp = torch.zeros(16, 4, dtype=dtype)
    for kwargs in (
        {"left_alpha": torch.full((16,), 1e-3, dtype=dtype)},
        {"right_alpha": torch.full((4,), 1e-3, dtype=dtype)},
    ):
        got = bsrkit.bsr_dense_addmm(inp, bsr, x, **kwargs)
        want = reference.bsr_dense_addmm(inp, bsr, x, **kwargs)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want)


def test_int8_coefficients_wrap_as_torchs_int32_arithmetic():
    """Integer beta and alpha are applied in int32 arithmetic (through float64 they rounded: 2**30 + 1
    times 2**31 - 1); beyond int32, and a float32 product's finite alpha beyond float32, are refused as
    torch.addmm refuses them (1e39 became inf and skipped the 0 * inf rule)."""
    A = torch.zeros(32, 32, dtype=torch.int8)
    A[:16, :16] = torch.eye(16, dtype=torch.int8)
    bsr = A.to_sparse_bsr(16)
    dense = torch.full((32, 4), 3, dtype=torch.int8)
    inp = torch.full((32, 4), 2**31 - 1, dtype=torch.int32)
    beta, alpha = 2**30 + 1, 2**30 + 3
    want = torch.addmm(inp, A.int(), dense.int(), beta=beta, alpha=alpha)
    torch.testing.assert_close(bsrkit.bsr_dense_addmm(inp, bsr, dense, beta=beta, alpha=alpha), want)
    with pytest.raises(ValueError, match="expected \\|alpha\\| < 2.14748e\\+09"):
        bsrkit.bsr_dense_addmm(inp, bsr, dense, alpha=2**40)
    with pytest.raises(ValueError, match="expected \\|alpha\\| < 3.40282e\\+38 for a torch.float32"):
        bsrkit.bsr_dense_addmm(inp.float(), A.float().to_sparse_bsr(16), dense.float(), alpha=1e39)
    assert torch.isfinite(
        bsrkit.bsr_dense_addmm(inp.double(), A.double().to_sparse_bsr(16), dense.double(), alpha=1e39)
    ).all()


def test_int8_integer_scales_wrap_as_torchs_int32_arithmetic():
    """Integer left/right scales multiply in int32 arithmetic, each product wrapped (through float64 the
    exact 2.8e17 lost its low bits before the wrap: 264515584 for 264515600)."""
    a = torch.zeros(32, 16, dtype=torch.int8)
    a[0, :] = 127
    a[17, 3] = -5
    bsr, x = a.to_sparse_bsr((16, 16)), torch.full((16, 4), 127, dtype=torch.int8)
    left = torch.full((32,), 2**30 + 1, dtype=torch.int32)
    left[17] = -(2**31) + 7
    right = torch.tensor([2**10 + 1, 1, -3, 2**20], dtype=torch.int64)
    inp = torch.full((32, 4), 2**31 - 1, dtype=torch.int32)

    def int32(v):
        return (v + 2**31) % 2**32 - 2**31

    exact = [[sum(int(a[i, k]) * int(x[k, j]) for k in range(16)) for j in range(4)] for i in range(32)]
    for beta, alpha in ((0, 1), (3, 2**31 - 1)):
        got = bsrkit._int_bsr_dense_addmm(
            inp, bsr, x, beta=beta, alpha=alpha, left_alpha=left, right_alpha=right
        )
        want = [
            [
                int32(int32(exact[i][j] * int(left[i]) * int(right[j]) * alpha) + int32((2**31 - 1) * beta))
                for j in range(4)
            ]
            for i in range(32)
        ]
        assert got.dtype == torch.int32 and got.tolist() == want
    # A floating scale: float64, rounded once to the nearest (3 * 0.5 -> 2, -3 * 0.5 -> -2).
    half = torch.full((32,), 0.5, dtype=torch.float64)
    c = torch.zeros(16, 16, dtype=torch.int8)
    c[0, 0], c[1, 0] = 3, -3
    got = bsrkit._int_bsr_dense_addmm(
        torch.zeros(16, 1, dtype=torch.int32), c.to_sparse_bsr(16), torch.ones(16, 1, dtype=torch.int8),
        left_alpha=half[:16],
    )  # fmt: skip
    assert got[:2, 0].tolist() == [2, -2]


def test_alpha_zero_reads_no_scale():
    """alpha == 0 forms no product: an infinite scale does not reach the result (0 * inf was NaN), as
    torch.addmm and torch's kernel; with nnz == 0 and alpha == 1 the formula's NaN stays."""
    inp = torch.ones(16, 4)
    left = torch.ones(16)
    left[3] = math.inf
    bsr, x = torch.randn(16, 16).to_sparse_bsr((8, 8)), torch.randn(16, 4)
    for b in (bsr, torch.zeros(16, 16).to_sparse_bsr((8, 8))):
        assert torch.equal(bsrkit.bsr_dense_addmm(inp, b, x, beta=1.0, alpha=0.0, left_alpha=left), inp)
    empty = torch.zeros(16, 16).to_sparse_bsr((8, 8))
    got = bsrkit.bsr_dense_addmm(inp, empty, x, left_alpha=left)
    assert got[3].isnan().all() and torch.equal(got[torch.arange(16) != 3], inp[torch.arange(16) != 3])
