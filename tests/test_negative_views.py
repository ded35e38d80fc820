"""Negative views (``torch._neg_view``, the ``.imag`` of a conjugate) share memory that holds ``-t``.
torch's ops read the bit; bsrkit's kernels read memory, so every dense operand is resolved first
(``validation.resolved``). Each op here gives what it gives on the resolved tensor."""

import pytest
import torch

import bsrkit
from bsrkit import reference
from bsrkit.nn import BSRLinear
from helpers import CPU_PATHS, assert_close, product_paths, random_bsr


def neg_view(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t``'s memory that reads as ``-t``'s negation: ``t`` itself, with the bit set."""
    view = torch._neg_view(-t)
    assert view.is_neg()
    return view


def public_neg_view(t: torch.Tensor) -> torch.Tensor:
    """The same for float32/float64, the way users meet one: the imaginary part of a conjugate."""
    view = torch.complex(torch.zeros_like(t), -t).conj().imag
    assert view.is_neg() and torch.equal(view, t)
    return view


@pytest.mark.parametrize("product_path", product_paths(*CPU_PATHS, "torch"), indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("N", [1, 2, 4, 40])
def test_products_read_a_negative_dense_as_torch_does(product_path, dtype, N):
    g = torch.Generator().manual_seed(N)
    bsr = random_bsr((32, 48), (8, 16), 0.5, dtype, generator=g)
    dense = torch.randn((48, N), generator=g).to(dtype)
    expected = reference.bsr_dense_mm(bsr, dense)
    assert_close(product_path.mm(bsr, neg_view(dense)), expected, k=48)
    t_dense = torch.randn((32, N), generator=g).to(dtype)
    assert_close(
        product_path.transposed_mm(bsr, neg_view(t_dense)),
        reference.bsr_dense_mm(bsr.mT.to_sparse_bsr((16, 8)), t_dense),
        k=32,
    )
    input = torch.randn((32, N), generator=g).to(dtype)
    got = product_path.addmm(neg_view(input), bsr, neg_view(dense), beta=0.5, alpha=2.0)
    assert_close(got, reference.bsr_dense_addmm(input, bsr, dense, beta=0.5, alpha=2.0), k=48)
    out = torch.zeros((N, 32), dtype=dtype).mT  # written through a negative view: torch's mm does it right
    product_path.mm(bsr, dense, out=torch._neg_view(out))
    assert_close(-out, expected, k=48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_public_negative_view_and_its_gradient(dtype):
    g = torch.Generator().manual_seed(0)
    bsr = random_bsr((32, 32), (8, 8), 0.5, dtype, generator=g)
    base = torch.randn((32, 3), generator=g, dtype=dtype)
    x = base.clone().requires_grad_(True)
    view = torch.complex(torch.zeros_like(x), -x).conj().imag  # reads as x
    assert view.is_neg()
    y = bsrkit.bsr_dense_mm(bsr, view)
    assert_close(y, reference.bsr_dense_mm(bsr, base), k=32)
    y.sum().backward()
    assert_close(x.grad, bsr.to_dense().sum(0)[:, None].expand(32, 3), k=32)


def test_sampled_addmm_and_scatter_read_negative_operands():
    g = torch.Generator().manual_seed(1)
    bsr = random_bsr((32, 32), (8, 8), 0.5, generator=g)
    a, b = torch.randn((32, 16), generator=g), torch.randn((16, 32), generator=g)
    got = bsrkit.sampled_addmm(bsr, public_neg_view(a), public_neg_view(b))
    assert_close(got.to_dense(), reference.sampled_addmm(bsr, a, b).to_dense(), k=16)
    other = torch.randn((32, 16), generator=g)
    expected = reference.bsr_scatter_mm(bsr, other)
    assert_close(bsrkit.bsr_scatter_mm(bsr, public_neg_view(other)), expected, k=32)
    for fmt in ("bsr_strided_mm_compressed", "bsr_strided_mm", "scatter_mm"):
        data = bsrkit.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt)
        assert_close(bsrkit.bsr_scatter_mm(bsr, public_neg_view(other), data), expected, k=32)


@pytest.mark.parametrize("fused", ["1", "0"])
def test_attention_reads_negative_query_key_value(monkeypatch, fused):
    monkeypatch.setenv("BSRKIT_FUSED_ATTENTION", fused)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn((2, 32, 16), generator=g) for _ in range(3))
    mask = bsrkit.causal_mask(32, 8)
    got = bsrkit.scaled_dot_product_attention(
        public_neg_view(q), public_neg_view(k), public_neg_view(v), mask
    )
    assert_close(got, reference.scaled_dot_product_attention(q, k, v, mask), k=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_bsr_linear_reads_a_negative_input(dtype, rows):
    torch.manual_seed(0)
    layer = BSRLinear.from_dense(torch.nn.Linear(32, 16).to(dtype), 8, 0.5)
    x = torch.randn(rows, 32).to(dtype)
    expected = torch.nn.functional.linear(x.double(), layer.to_dense().double(), layer.bias.double())
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            assert_close(layer(neg_view(x)), expected.to(dtype), k=32)


@pytest.mark.parametrize("product_path", product_paths(*CPU_PATHS, "torch"), indirect=True)
@pytest.mark.parametrize("fmt", ["bsr_strided_mm", "bsr_strided_mm_compressed", "scatter_mm"])
def test_scatter_writes_a_negative_out_and_accumulators_as_torch_does(product_path, fmt):
    # (the kernels wrote the memory of the view, not its values: every entry had the wrong sign)
    g = torch.Generator().manual_seed(7)
    bsr = torch.randn(32, 48, generator=g).to_sparse_bsr((16, 16))
    other = torch.randn(48, 32, generator=g)
    idx = bsrkit.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt)
    out = torch._neg_view(torch.zeros(32, 32))
    bsrkit.bsr_scatter_mm(bsr, other, indices_data=idx, out=out)
    assert_close(out, reference.bsr_dense_mm(bsr, other), k=48)
    if fmt == "scatter_mm":
        return
    start = torch.randn(1, 32, 32, generator=g)
    idx = bsrkit.bsr_scatter_mm_indices_data(bsr, other.unsqueeze(0), indices_format=fmt)
    acc = torch._neg_view(start.neg())  # (holding start's values)
    bsrkit.scatter_mm(bsr.values(), other.unsqueeze(0), idx, accumulators=acc)
    assert_close(acc, reference.scatter_mm(bsr.values(), other.unsqueeze(0), idx, start), k=48)


@pytest.mark.parametrize(
    "base, message",
    [
        (torch.zeros(32, 32, dtype=torch.float64), "expected out.dtype == torch.float32"),
        (torch.zeros(3, 32, 32), r"expected out.shape == \(32, 32\)"),
        (torch.zeros(32, 32, requires_grad=True), "expected out not to require grad"),
    ],
)
def test_a_negative_out_is_checked_as_any_out(base, message):
    # (it went straight to copy_, which cast a float64 out, broadcast into (3, M, N) and raised autograd's
    # error for one requiring grad)
    g = torch.Generator().manual_seed(7)
    bsr = torch.randn(32, 48, generator=g).to_sparse_bsr((16, 16))
    other = torch.randn(48, 32, generator=g)
    idx = bsrkit.bsr_scatter_mm_indices_data(bsr, other)
    with pytest.raises(ValueError, match=message):
        bsrkit.bsr_scatter_mm(bsr, other, indices_data=idx, out=torch._neg_view(base))


def test_a_member_index_given_the_negative_bit_after_a_product_is_refused():
    # (the kept operand and the plan keys left the neg bit of the index tensors out: the old pattern's
    # product came back for a BSR whose columns now read negative)
    crow, col, vals = torch.tensor([0, 2, 3]), torch.tensor([0, 2, 1]), torch.randn(3, 4, 4)
    bsr = torch.sparse_bsr_tensor(crow, col, vals, size=(8, 12))
    d = torch.randn(12, 3)
    for _ in range(3):
        bsrkit.bsr_dense_mm(bsr, d)
    col.data = torch._neg_view(col.detach())
    with pytest.raises(ValueError, match="malformed bsr: expected col_indices in"):
        bsrkit.bsr_dense_mm(bsr, d)
