"""bsr_softmax against the dense reference (softmax over stored entries, unstored = -inf), all backends."""

import math

import numpy as np
import pytest
import torch

import bsrkit
from bsrkit import reference
from helpers import DTYPES, random_bsr

# Softmax outputs are in [0, 1]; half types round once at the end (computed in float32).
_TOL = {
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    torch.bfloat16: {"rtol": 1e-2, "atol": 4e-3},
    torch.float16: {"rtol": 1e-3, "atol": 5e-4},
}


def _check(x: torch.Tensor, y: torch.Tensor) -> None:
    assert y.layout == torch.sparse_bsr and y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(y.crow_indices(), x.crow_indices()) and torch.equal(y.col_indices(), x.col_indices())
    got = reference.bsr_to_dense(y).double()
    expected = reference.bsr_softmax(x)
    torch.testing.assert_close(got, expected, **_TOL[x.dtype], equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,bs,empty_rows",
    [
        ((24, 20), (6, 4), (1,)),
        ((2, 3, 16, 32), (8, 8), (0,)),
        ((8, 9), (1, 1), (3,)),
        ((12, 8), (12, 2), ()),
    ],
)
def test_matches_reference(backend, dtype, shape, bs, empty_rows):
    x = random_bsr(shape, bs, 0.6, dtype, empty_rows=empty_rows)
    x = torch.sparse_bsr_tensor(
        x.crow_indices(), x.col_indices(), x.values() * 4, size=x.shape
    )  # wider range
    _check(x, bsrkit.bsr_softmax(x))


def test_wide_range_float32_exp_accuracy():
    # The CPU kernel's float32 exp is a polynomial: check its relative accuracy across the whole range.
    x = random_bsr((16, 64), (4, 16), 1.0, torch.float32)
    vals = torch.linspace(-90, 0, x.values().numel()).reshape(x.values().shape)
    x = torch.sparse_bsr_tensor(x.crow_indices(), x.col_indices(), vals, size=x.shape)
    y = reference.bsr_to_dense(bsrkit.bsr_softmax(x)).double()
    expected = reference.bsr_softmax(x)
    torch.testing.assert_close(y, expected, rtol=2e-6, atol=1e-30)


def test_inf_and_nan_semantics(backend):
    # Row 0: one -inf entry (weight 0); row 1: all -inf (NaN, as torch.softmax); row 2: a NaN (row NaN).
    vals = torch.zeros(2, 4, 2)
    vals[0, 0, 0] = -math.inf
    vals[:, 1] = -math.inf
    vals[1, 2, 1] = math.nan
    x = torch.sparse_bsr_tensor(torch.tensor([0, 2]), torch.tensor([0, 1]), vals, size=(4, 4))
    y = reference.bsr_to_dense(bsrkit.bsr_softmax(x))
    expected = torch.softmax(reference.bsr_to_dense(x), dim=-1)
    torch.testing.assert_close(y, expected, equal_nan=True)
    assert y[0, 0] == 0 and y[1].isnan().all() and y[2].isnan().all()


def test_nnz_zero_and_empty(backend):
    x = random_bsr((2, 8, 8), (4, 4), 0.0)
    y = bsrkit.bsr_softmax(x)
    assert y._nnz() == 0 and y.shape == x.shape
    e = torch.zeros(0, 4).to_sparse_bsr((2, 2))
    assert bsrkit.bsr_softmax(e).shape == (0, 4)


def _softmax_of_values(x):
    crow, col = x.crow_indices(), x.col_indices()
    return lambda values: bsrkit.bsr_softmax(
        torch.sparse_bsr_tensor(crow, col, values, size=x.shape)
    ).values()


@pytest.mark.parametrize("shape,bs", [((12, 10), (3, 5)), ((2, 8, 12), (4, 3))])
def test_gradient(backend, shape, bs):
    # dX = Y (dY - rowsum(dY Y)) against autograd through the dense reference (float64).
    x = random_bsr(shape, bs, 0.6, torch.float64, empty_rows=(1,))
    values = x.values().clone().requires_grad_()
    y = _softmax_of_values(x)(values)
    grad = torch.randn_like(y)
    (got,) = torch.autograd.grad(y, values, grad)
    dense_values = reference.bsr_to_dense(x).requires_grad_()
    mask = reference.block_mask(x)
    expected_y = reference.bsr_softmax(
        torch.sparse_bsr_tensor(x.crow_indices(), x.col_indices(), x.values(), size=x.shape)
    )
    # The reference's gradient, taken on the dense matrix and read back at the stored blocks.
    scores = torch.where(mask, dense_values, -torch.inf)
    dense_y = torch.where(mask.any(-1, keepdim=True), torch.softmax(scores, -1), 0.0)
    torch.testing.assert_close(dense_y, expected_y)
    dense_grad = reference.bsr_to_dense(
        torch.sparse_bsr_tensor(x.crow_indices(), x.col_indices(), grad, size=x.shape)
    )
    (expected,) = torch.autograd.grad(dense_y, dense_values, dense_grad)
    got_dense = reference.bsr_to_dense(
        torch.sparse_bsr_tensor(x.crow_indices(), x.col_indices(), got, size=x.shape)
    )
    torch.testing.assert_close(got_dense, torch.where(mask, expected, 0.0))


def test_gradcheck():
    x = random_bsr((2, 8, 12), (4, 3), 0.6, torch.float64, empty_rows=(1,))
    torch.autograd.gradcheck(_softmax_of_values(x), (x.values().clone().requires_grad_(),))


def test_gradient_half_matches_float32():
    x = random_bsr((16, 16), (4, 4), 0.7, torch.float32)
    grad = torch.randn_like(x.values())
    grads = []
    for dtype in (torch.float32, torch.bfloat16):
        values = x.values().to(dtype).requires_grad_()
        y = bsrkit.bsr_softmax(
            torch.sparse_bsr_tensor(x.crow_indices(), x.col_indices(), values, size=x.shape)
        )
        y.values().backward(grad.to(dtype))
        grads.append(values.grad.float())
    torch.testing.assert_close(grads[1], grads[0], rtol=2e-2, atol=2e-2)


def test_arguments():
    x = random_bsr((8, 8), (4, 4), 1.0)
    expected = bsrkit.bsr_softmax(x).values()
    for max_row_nnz in (8, np.int64(8)):  # (numpy's integers too)
        assert torch.equal(bsrkit.bsr_softmax(x, max_row_nnz=max_row_nnz).values(), expected)
    with pytest.raises(TypeError, match=r"bsr_softmax\(\): expected input to have layout torch.sparse_bsr"):
        bsrkit.bsr_softmax(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"expected max_row_nnz >= 1, got 0"):
        bsrkit.bsr_softmax(x, max_row_nnz=0)
    with pytest.raises(TypeError, match=r"expected max_row_nnz to be an int or None"):
        bsrkit.bsr_softmax(x, max_row_nnz=2.0)


def test_a_second_derivative_through_bsr_softmax_warns_that_it_misses_terms():
    """Its backward is first-order only; the error first_order_only would raise is dropped by torch's
    backward of a BSR's values() and constructor, so create_graph warns instead of silently missing."""
    import warnings

    x = torch.randn(8, 8, dtype=torch.float64).to_sparse_bsr((4, 4))
    values = x.values().clone().requires_grad_()
    y = bsrkit.bsr_softmax(torch.sparse_bsr_tensor(x.crow_indices(), x.col_indices(), values, size=x.shape))
    with pytest.warns(UserWarning, match=r"bsr_softmax\(\): differentiated with create_graph"):
        torch.autograd.grad(y.values().pow(2).sum(), values, create_graph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a first-order backward does not warn)
        y = bsrkit.bsr_softmax(
            torch.sparse_bsr_tensor(x.crow_indices(), x.col_indices(), values, size=x.shape)
        )
        torch.autograd.grad(y.values().pow(2).sum(), values)
