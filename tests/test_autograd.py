"""sampled_addmm, the transposed product, and gradients of the products."""

import pytest
import torch

import bsrkit
from bsrkit import reference
from helpers import DTYPES, assert_close, random_bsr


@pytest.fixture(params=["cpu", "torch", pytest.param("triton", marks=pytest.mark.triton)])
def backend(request, monkeypatch):
    if request.param == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("BSRKIT_BACKEND", request.param)
    return request.param


def skip_interpreter_bfloat16(backend, dtype):
    # Triton's interpreter computes tl.dot wrongly in bfloat16 (see test_triton.py); a GPU does not.
    if backend == "triton" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter has no correct bfloat16 tl.dot")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [(), (2,)])
def test_transposed_product(backend, dtype, batch):
    skip_interpreter_bfloat16(backend, dtype)
    bsr = random_bsr((*batch, 24, 36), (6, 4), 0.5, dtype, empty_rows=(1,), empty_cols=(0,))
    dense = torch.randn(*batch, 24, 7).to(dtype)
    got = bsrkit.bsr_transposed_dense_mm(bsr, dense)
    assert got.shape == (*batch, 36, 7)
    assert_close(got, reference.bsr_transposed_dense_mm(bsr, dense), k=24)


def test_transposed_product_exact_and_errors(backend):
    bsr = random_bsr((12, 20), (3, 5), 0.5, torch.float64, integers=True)
    dense = torch.randint(-3, 4, (12, 6)).double()
    assert torch.equal(
        bsrkit.bsr_transposed_dense_mm(bsr, dense), reference.bsr_transposed_dense_mm(bsr, dense)
    )
    with pytest.raises(ValueError, match=r"expected dense.shape\[-2\] == 12 \(bsr.shape\[-2\]\), got 20"):
        bsrkit.bsr_transposed_dense_mm(bsr, torch.randn(20, 6, dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta,alpha", [(1.0, 1.0), (0.5, -2.0), (0.0, 3.0)])
def test_sampled_addmm(backend, dtype, beta, alpha):
    skip_interpreter_bfloat16(backend, dtype)
    inp = random_bsr((24, 20), (6, 4), 0.5, dtype, empty_rows=(2,))
    mat1 = torch.randn(24, 9).to(dtype)
    mat2 = torch.randn(9, 20).to(dtype)
    got = bsrkit.sampled_addmm(inp, mat1, mat2, beta=beta, alpha=alpha)
    assert got.layout is torch.sparse_bsr
    assert torch.equal(got.crow_indices(), inp.crow_indices())
    assert_close(
        reference.bsr_to_dense(got), reference.sampled_addmm(inp, mat1, mat2, beta=beta, alpha=alpha), k=9
    )


def test_sampled_addmm_batched_broadcast_and_out(backend):
    inp = random_bsr((2, 16, 12), (4, 3), 0.5, torch.float64)
    mat1 = torch.randn(16, 5, dtype=torch.float64)  # broadcast over the batch
    mat2 = torch.randn(2, 5, 12, dtype=torch.float64)
    got = bsrkit.sampled_addmm(inp, mat1, mat2, beta=0.5)
    assert_close(
        reference.bsr_to_dense(got), reference.sampled_addmm(inp, mat1.expand(2, 16, 5), mat2, beta=0.5)
    )
    out = torch.sparse_bsr_tensor(
        inp.crow_indices(), inp.col_indices(), torch.zeros_like(inp.values()), size=inp.shape
    )
    assert bsrkit.sampled_addmm(inp, mat1, mat2, beta=0.5, out=out) is out
    assert_close(out.values(), got.values())


def test_sampled_addmm_nan_input_ignored_with_beta_zero_and_errors():
    inp = random_bsr((8, 8), (4, 4), 1.0)
    nan_inp = torch.sparse_bsr_tensor(
        inp.crow_indices(), inp.col_indices(), torch.full_like(inp.values(), float("nan")), size=inp.shape
    )
    got = bsrkit.sampled_addmm(nan_inp, torch.randn(8, 3), torch.randn(3, 8), beta=0)
    assert not got.values().isnan().any()
    with pytest.raises(ValueError, match=r"expected mat2.shape\[-2\] == 3 \(mat1.shape\[-1\]\), got 4"):
        bsrkit.sampled_addmm(inp, torch.randn(8, 3), torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"expected mat1.shape\[-2\] == 8"):
        bsrkit.sampled_addmm(inp, torch.randn(7, 3), torch.randn(3, 8))
    with pytest.raises(TypeError, match="expected input to have layout torch.sparse_bsr"):
        bsrkit.sampled_addmm(torch.randn(8, 8), torch.randn(8, 3), torch.randn(3, 8))


def _bsr_from(pattern, values):
    return torch.sparse_bsr_tensor(pattern.crow_indices(), pattern.col_indices(), values, size=pattern.shape)


@pytest.mark.parametrize(
    "shape,blocksize,dense_batch",
    [((12, 10), (3, 5), ()), ((16, 8), (4, 2), (2,)), ((2, 8, 12), (2, 3), ()), ((2, 8, 12), (4, 4), (2,))],
)
def test_gradcheck_bsr_dense_mm(backend, shape, blocksize, dense_batch):
    if backend == "triton" and len(shape) == 3:
        pytest.skip("interpreter time: the Triton backend's gradients are checked on the 2-D cases")
    pattern = random_bsr(shape, blocksize, 0.5, torch.float64, empty_rows=(1,))
    values = pattern.values().clone().requires_grad_()
    dense = torch.randn(*dense_batch, shape[-1], 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda v, d: bsrkit.bsr_dense_mm(_bsr_from(pattern, v), d), (values, dense)
    )


def test_gradcheck_bsr_dense_addmm(backend):
    pattern = random_bsr((12, 10), (3, 5), 0.5, torch.float64, empty_rows=(0,))
    values = pattern.values().clone().requires_grad_()
    dense = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
    inp = torch.randn(4, dtype=torch.float64, requires_grad=True)  # broadcast over rows

    def f(i, v, d):
        return bsrkit.bsr_dense_addmm(i, _bsr_from(pattern, v), d, beta=0.5, alpha=-1.5)

    assert torch.autograd.gradcheck(f, (inp, values, dense))


def test_gradient_has_the_pattern_and_out_is_refused():
    pattern = random_bsr((8, 8), (4, 4), 0.5)
    values = pattern.values().clone().requires_grad_()
    dense = torch.randn(8, 2)
    bsrkit.bsr_dense_mm(_bsr_from(pattern, values), dense).sum().backward()
    assert values.grad.shape == values.shape
    with pytest.raises(ValueError, match="out= is not differentiable"):
        bsrkit.bsr_dense_mm(_bsr_from(pattern, values), dense, out=torch.empty(8, 2))
    with torch.no_grad():  # no grad needed: out= is fine
        bsrkit.bsr_dense_mm(_bsr_from(pattern, values), dense, out=torch.empty(8, 2))


def test_sampled_addmm_non_contiguous_operands(backend):
    inp = random_bsr((16, 12), (4, 3), 0.6, torch.float64, empty_rows=(1,))
    mat1 = torch.randn(5, 16, dtype=torch.float64).mT  # column-major
    mat2 = torch.randn(12, 5, dtype=torch.float64).mT
    got = bsrkit.sampled_addmm(inp, mat1, mat2, beta=0.0)
    assert_close(reference.bsr_to_dense(got), reference.sampled_addmm(inp, mat1, mat2, beta=0.0))


def test_sampled_addmm_zero_batch():
    b = torch.sparse_bsr_tensor(
        torch.zeros(0, 3, dtype=torch.long),
        torch.zeros(0, 2, dtype=torch.long),
        torch.zeros(0, 2, 2, 2, dtype=torch.float64),
        size=(0, 4, 6),
    )
    got = bsrkit.sampled_addmm(
        b, torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    )
    assert got.shape == (0, 4, 6) and got.values().shape == (0, 2, 2, 2)
