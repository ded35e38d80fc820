"""The one comparison rule every fast path is judged by (``bsrkit.reference.mismatch``): it passes a
correctly rounded result and fails a wrong one, also where the expected entries are small."""

import math

import pytest
import torch

from bsrkit import reference

HALF_AND_FLOAT = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", HALF_AND_FLOAT)
@pytest.mark.parametrize("k", [1, 64, 4096])
def test_a_rounded_product_passes(dtype, k):
    g = torch.Generator().manual_seed(k)
    a, b = torch.randn(32, k, generator=g).to(dtype), torch.randn(k, 24, generator=g).to(dtype)
    exact = a.double() @ b.double()
    assert reference.mismatch(exact.to(dtype), exact, dtype, k) is None
    # float32 accumulation, one rounding: how the kernels compute half products
    assert reference.mismatch((a.float() @ b.float()).to(dtype), exact, dtype, k) is None


@pytest.mark.parametrize("dtype", HALF_AND_FLOAT)
def test_a_zero_result_fails_where_the_expected_entries_are_small(dtype):
    """An attention output is a weighted average (entries ~ 1 / sqrt(keys)): zeros pass an elementwise
    atol grown with the sum's length; the normwise bound refuses them."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(64, 256, generator=g, dtype=torch.float64)
    expected = torch.softmax(scores, -1) @ torch.randn(256, 16, generator=g, dtype=torch.float64)
    zeros = torch.zeros_like(expected).to(dtype)
    reason = reference.mismatch(zeros, expected, dtype, 256)
    assert reason is not None
    # a 5% error everywhere fails too (bfloat16's tolerance is 2%, five unit roundoffs)
    assert reference.mismatch((expected * 1.05).to(dtype), expected, dtype, 1) is not None


def test_non_finite_entries_must_sit_where_expected():
    expected = torch.tensor([1.0, math.nan, math.inf, -math.inf], dtype=torch.float64)
    assert reference.mismatch(expected.float(), expected, torch.float32) is None
    for wrong in ([1.0, 0.0, math.inf, -math.inf], [1.0, math.nan, math.inf, math.inf], [math.nan] * 4):
        assert reference.mismatch(torch.tensor(wrong), expected, torch.float32) is not None


def test_shape_and_dtype_are_checked():
    expected = torch.ones(3, 4)
    assert "shape" in reference.mismatch(torch.ones(4, 3), expected)
    assert "dtype" in reference.mismatch(torch.ones(3, 4, dtype=torch.float64), expected)
    # an explicit dtype compares the values only (a half result against its float64 oracle)
    assert reference.mismatch(torch.ones(3, 4).half(), expected.double(), torch.float16) is None
    with pytest.raises(AssertionError, match="entries differ"):
        reference.assert_close(torch.zeros(3, 4), expected)


def test_the_oracles_take_a_batch_of_size_zero():
    bsr = torch.sparse_bsr_tensor(
        torch.zeros(0, 3, dtype=torch.int64), torch.zeros(0, 1, dtype=torch.int64),
        torch.randn(0, 1, 2, 2, dtype=torch.float64), size=(0, 4, 4),
    )  # fmt: skip
    dense = torch.randn(0, 4, 3, dtype=torch.float64)
    assert reference.bsr_dense_mm(bsr, dense).shape == (0, 4, 3)
    assert reference.bsr_to_dense(bsr).shape == (0, 4, 4)


@pytest.mark.parametrize("batched", [False, True])
def test_softmax_and_sddmm_references_weigh_a_block_column_stored_twice_twice(batched):
    """Torch's validation and bsrkit's accept a block row storing a column twice, and the fast paths take
    each stored block as its own (torch's per-block semantics); the references summed the two first
    (softmax saw exp(a + b) for exp(a) + exp(b), SDDMM added the product once)."""
    import bsrkit

    g = torch.Generator().manual_seed(0)
    crow, col = torch.tensor([0, 3, 3, 4]), torch.tensor([0, 0, 1, 1])  # (row 0 stores column 0 twice)
    values = torch.randn(3, 4, 2, 3, generator=g, dtype=torch.float64)[: 3 if batched else 1]
    values = values if batched else values[0]
    shape = (3, 6, 6) if batched else (6, 6)
    bsr = torch.sparse_bsr_tensor(
        crow.expand(3, -1).contiguous() if batched else crow,
        col.expand(3, -1).contiguous() if batched else col,
        values,
        size=shape,
        check_invariants=False,
    )
    got = bsrkit.bsr_softmax(bsr).to_dense()
    reference.assert_close(got, reference.bsr_softmax(bsr).to(got.dtype))
    rows = reference.bsr_softmax(bsr).sum(-1)  # (every stored row sums to 1, row block 1 is empty)
    torch.testing.assert_close(rows[..., :2], torch.ones_like(rows[..., :2]))
    mat1, mat2 = (
        torch.randn(6, 5, generator=g, dtype=torch.float64),
        torch.randn(5, 6, generator=g, dtype=torch.float64),
    )
    got = bsrkit.sampled_addmm(bsr, mat1, mat2, beta=0.5, alpha=2.0).to_dense()
    reference.assert_close(got, reference.sampled_addmm(bsr, mat1, mat2, beta=0.5, alpha=2.0))
