"""Drop-in compatibility with torch.sparse._triton_ops where the two APIs meet: argument names, keyword
arguments, error classes, indices-data meta, and sampled_addmm's out= and boolean masks."""

import pytest
import torch
import torch.sparse._triton_ops as torch_ops

import bsrkit
from bsrkit import reference
from bsrkit.validation import ArgumentTypeError
from helpers import assert_close, random_bsr


def _eye_blocks():
    return torch.eye(2).repeat_interleave(2, 0).repeat_interleave(2, 1)


def test_sampled_addmm_out_with_another_pattern_takes_inputs_pattern():
    # The repro: out's pattern (anti-diagonal) differs from input's (diagonal), same nnz.
    inp = _eye_blocks().to_sparse_bsr(2)
    out = _eye_blocks().flip(0).to_sparse_bsr(2)
    mat1, mat2 = torch.randn(4, 3), torch.randn(3, 4)
    got = bsrkit.sampled_addmm(inp, mat1, mat2, beta=0.0, out=out)
    assert got is out
    assert torch.equal(out.crow_indices(), inp.crow_indices())
    assert torch.equal(out.col_indices(), inp.col_indices())
    assert_close(out.to_dense(), reference.sampled_addmm(inp, mat1, mat2, beta=0.0), k=3)


def test_sampled_addmm_out_must_match_nnz_and_blocksize():
    inp = random_bsr((8, 8), (2, 2), 0.5)
    mat1, mat2 = torch.randn(8, 3), torch.randn(3, 8)
    fewer = random_bsr((8, 8), (2, 2), 0.0)
    with pytest.raises(ValueError, match="nnz =="):
        bsrkit.sampled_addmm(inp, mat1, mat2, out=fewer)


def test_boolean_mask_input_with_beta_zero():
    mask = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool).repeat_interleave(4, 0).repeat_interleave(4, 1)
    inp = mask.to_sparse_bsr(4)
    mat1, mat2 = torch.randn(8, 5, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    got = bsrkit.sampled_addmm(inp, mat1, mat2, beta=0.0, alpha=2.0)
    assert got.dtype == torch.float64
    assert_close(got.to_dense(), reference.sampled_addmm(inp, mat1, mat2, beta=0.0, alpha=2.0), k=5)
    with pytest.raises(ValueError, match="beta == 0 with a boolean input"):
        bsrkit.sampled_addmm(inp, mat1, mat2)


@pytest.mark.parametrize(
    "call",
    [
        lambda x: bsrkit.bsr_dense_mm(x.to_dense(), x.to_dense()),  # wrong layout
        lambda x: bsrkit.bsr_dense_mm(x, x.to_dense().double()),  # dtype mismatch
        lambda x: bsrkit.sampled_addmm(x, x.to_dense(), x.to_dense().double()),
        lambda x: bsrkit.bsr_dense_mm(x, x.to_dense(), out=torch.empty(4, 4, dtype=torch.float64)),
    ],
)
def test_type_errors_are_value_errors_as_in_torch(call):
    x = _eye_blocks().to_sparse_bsr(2)
    with pytest.raises(ValueError) as info:  # what code written against torch catches
        call(x)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ArgumentTypeError)


def test_torch_keywords_are_accepted():
    bsr = random_bsr((32, 32), (16, 16), 0.5)
    dense = torch.randn(32, 16)
    ref = reference.bsr_dense_mm(bsr, dense)
    kw = {"skip_checks": True, "max_grid": (None, 4, None)}
    assert_close(bsrkit.bsr_dense_mm(bsr, dense, **kw), ref, k=32)
    assert_close(bsrkit.bsr_dense_addmm(torch.zeros(32, 16), bsr, dense, **kw), ref, k=32)
    s = bsrkit.sampled_addmm(bsr, torch.randn(32, 4), torch.randn(4, 32), **kw)
    assert s.shape == bsr.shape
    with pytest.raises(ValueError, match="max_grid"):
        bsrkit.bsr_dense_mm(bsr, dense, max_grid=(1, 2))


@pytest.mark.parametrize("fmt", ["bsr_strided_mm_compressed", "bsr_strided_mm"])
@pytest.mark.parametrize(
    "n,bs,dtype",
    [(256, 16, torch.float32), (256, 32, torch.float16), (512, 64, torch.bfloat16), (64, 16, torch.float32)],
)
def test_indices_data_meta_equals_torchs(fmt, n, bs, dtype):
    """Every key torch's Triton scatter_mm reads (TILE_M, TILE_N, GROUP_SIZE, num_warps, num_stages,
    allow_tf32) and SPLIT_N, including the shapes torch tunes specially (256^3 with 16x16 blocks)."""
    bsr = random_bsr((n, n), (bs, bs), 0.5, dtype=dtype)  # (torch's own code fails on nnz == 0)
    other = torch.randn(n, n, dtype=dtype)
    ours = bsrkit.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt)[-1]
    theirs = torch_ops.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt)[-1]
    assert ours == theirs
    given = {"SPLIT_N": 2, "TILE_M": 16, "allow_tf32": True}
    assert (
        bsrkit.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt, **given)[-1]
        == torch_ops.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt, **given)[-1]
    )
