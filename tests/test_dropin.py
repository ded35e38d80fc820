"""Drop-in compatibility with torch.sparse._triton_ops where the two APIs meet: argument names, keyword
arguments, error classes, indices-data meta, and sampled_addmm's out= and boolean masks."""

import numpy as np
import pytest
import torch
import torch.sparse._triton_ops as torch_ops

import bsrkit
from bsrkit import reference
from bsrkit.validation import ArgumentTypeError
from helpers import assert_close, random_bsr


def test_torchs_names_are_bsrkits():
    # (torch's module defines most of them only where Triton is installed: the list is its names)
    names = [
        "bsr_dense_mm", "bsr_dense_addmm", "_int_bsr_dense_addmm", "sampled_addmm", "bsr_softmax",
        "bsr_scatter_mm", "bsr_scatter_mm_indices_data", "scatter_mm", "scatter_mm_meta",
        "_scaled_dot_product_attention", "TensorAsKey",
    ]  # fmt: skip
    assert [name for name in names if not hasattr(bsrkit, name)] == []
    assert set(names) <= set(bsrkit.__all__)
    bsr = random_bsr((8, 8), (4, 4), 0.5)
    q = torch.randn(8, 4)
    mask = torch.ones(8, 8).to_sparse_bsr((4, 4))
    assert_close(
        bsrkit._scaled_dot_product_attention(q, q, q, mask),
        bsrkit.scaled_dot_product_attention(q, q, q, mask),
    )
    assert bsrkit.TensorAsKey(bsr) == bsrkit.TensorAsKey(obj=bsr) == bsrkit.TensorKey(bsr)
    assert bsrkit.TensorAsKey(obj=bsr).obj is bsr
    # (a class, as torch's: its __eq__ asks isinstance; and a cache takes it as the tensor's key)
    assert isinstance(bsrkit.TensorAsKey(bsr), bsrkit.TensorAsKey | bsrkit.TensorKey)

    @bsrkit.weak_lru_cache()
    def nnz(t):
        return (t.obj if isinstance(t, bsrkit.TensorKey) else t)._nnz()

    assert nnz(bsr) == nnz(bsrkit.TensorAsKey(bsr)) and nnz.cache_info().hits == 1

    @bsrkit.weak_lru_cache(verify_contents=True)
    def total(t):
        return (t.obj if isinstance(t, bsrkit.TensorKey) else t).sum().clone()

    x = torch.ones(8)
    assert total(bsrkit.TensorAsKey(x)).item() == 8
    x.numpy()[:] = 2.0  # (a write no counter sees: the TensorAsKey's tensor was not copied, nor proven)
    assert total(bsrkit.TensorAsKey(x)).item() == total(x).item() == 16
    assert bsrkit.scatter_mm_meta(32, 32, 32, 8, 8) == torch_ops.scatter_mm_meta(32, 32, 32, 8, 8)


def _torch_parameters(name: str) -> list[tuple[str, str, str | None]]:
    """(name, kind, default's source) of each parameter of torch's ``name``, read from its source (torch
    defines most of them only where Triton runs on a GPU); a class's ``__init__`` without ``self``."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(torch_ops))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name == name)
    if isinstance(node, ast.ClassDef):
        node = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    a = node.args
    positional = [(p.arg, "positional") for p in a.posonlyargs + a.args if p.arg != "self"]
    defaults = [None] * (len(positional) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    params = [(n, k, d) for (n, k), d in zip(positional, defaults, strict=True)]
    if a.vararg:
        params.append((a.vararg.arg, "*", None))
    for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        params.append((p.arg, "keyword", None if d is None else ast.unparse(d)))
    if a.kwarg:
        params.append((a.kwarg.arg, "**", None))
    return params


def test_torchs_signatures_are_bsrkits():
    """Each function's parameters as torch's (names, order, kinds, defaults): positional GROUP_SIZE was
    refused by scatter_mm_meta, TensorAsKey(obj=...) by its keyword."""
    import inspect

    P = inspect.Parameter
    kinds = {
        P.POSITIONAL_ONLY: "positional", P.POSITIONAL_OR_KEYWORD: "positional", P.VAR_POSITIONAL: "*",
        P.KEYWORD_ONLY: "keyword", P.VAR_KEYWORD: "**",
    }  # fmt: skip
    for name in (
        "bsr_dense_mm", "bsr_dense_addmm", "_int_bsr_dense_addmm", "sampled_addmm", "bsr_softmax",
        "bsr_scatter_mm", "bsr_scatter_mm_indices_data", "scatter_mm", "scatter_mm_meta",
        "_scaled_dot_product_attention", "TensorAsKey",
    ):  # fmt: skip
        ours = [
            (p.name, kinds[p.kind], None if p.default is p.empty else repr(p.default))
            for p in inspect.signature(getattr(bsrkit, name)).parameters.values()
        ]
        assert ours == _torch_parameters(name), name
    positional = (256, 256, 64, 16, 16, 2)  # (GROUP_SIZE=2)
    assert bsrkit.scatter_mm_meta(*positional) == torch_ops.scatter_mm_meta(*positional)


def test_scales_of_the_shapes_torch_views_are_taken():
    # torch views left_alpha as (*batch, M, 1) and right_alpha as (*batch, 1, N): (M, 1), (1, N) and a
    # flattened batch (B * M,) are its documented forms; broadcasting ones stay broadcast.
    bsr = random_bsr((2, 8, 12), (4, 4), 0.5, torch.float64)
    x = torch.randn(12, 5, dtype=torch.float64)
    left, right = torch.randn(2, 8, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)
    expected = left[..., None] * reference.bsr_dense_mm(bsr, x) * right[:, None, :]
    for lt, rt in ((left.reshape(-1), right.reshape(-1)), (left[..., None], right[:, None, :])):
        lt, rt = lt.clone().requires_grad_(), rt.clone().requires_grad_()
        got = bsrkit.bsr_dense_addmm(
            torch.zeros(2, 8, 5, dtype=torch.float64), bsr, x, left_alpha=lt, right_alpha=rt
        )
        torch.testing.assert_close(got, expected)
        got.sum().backward()  # (the gradients reach the scales as given)
        assert lt.grad is not None and lt.grad.shape == lt.shape and rt.grad is not None
    single = random_bsr((8, 12), (4, 4), 0.5, torch.float64)
    got = bsrkit.bsr_dense_addmm(
        torch.zeros(8, 5, dtype=torch.float64), single, x, left_alpha=left[0, :, None], right_alpha=right[:1]
    )
    torch.testing.assert_close(got, left[0, :, None] * reference.bsr_dense_mm(single, x) * right[:1])
    with pytest.raises(
        ValueError, match=r"expected left_alpha.shape to broadcast to \(2, 8\) \(or left_alpha to hold 16"
    ):
        bsrkit.bsr_dense_addmm(
            torch.zeros(2, 8, 5, dtype=torch.float64), bsr, x, left_alpha=left.reshape(-1)[:15]
        )


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
    for torch_takes in ((8, 8), [None, None, None], (0, None, None)):  # (torch pads and clamps them)
        assert_close(bsrkit.bsr_dense_mm(bsr, dense, max_grid=torch_takes), ref, k=32)
    for bad in ((1.5, None), "abc", (True,)):
        with pytest.raises(ValueError, match="max_grid"):
            bsrkit.bsr_dense_mm(bsr, dense, max_grid=bad)


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


@pytest.mark.parametrize(
    "coefficient",
    [np.float32(2.0), np.int64(2), torch.tensor(2.0), True],
    ids=["np.float32", "np.int64", "0-d", "bool"],
)
def test_coefficients_in_every_form_torch_addmm_takes(coefficient):
    bsr = random_bsr((8, 12), (2, 3), 0.5, dtype=torch.float64)
    x, inp = torch.randn(12, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    want = torch.addmm(inp, bsr.to_dense(), x, beta=coefficient, alpha=coefficient)
    torch.testing.assert_close(bsrkit.bsr_dense_addmm(inp, bsr, x, beta=coefficient, alpha=coefficient), want)
    mat1, mat2 = torch.randn(8, 5, dtype=torch.float64), torch.randn(5, 12, dtype=torch.float64)
    got = bsrkit.sampled_addmm(bsr, mat1, mat2, beta=coefficient, alpha=coefficient).to_dense()
    mask = bsr.to_dense() != 0
    want = torch.where(mask, float(coefficient) * (bsr.to_dense() + mat1 @ mat2), 0.0)
    torch.testing.assert_close(torch.where(mask, got, 0.0), want)
    with pytest.raises(ValueError, match="expected alpha not to require grad"):
        bsrkit.bsr_dense_addmm(inp, bsr, x, alpha=torch.tensor(2.0, requires_grad=True))


def test_scatter_mm_bsr_strided_mm_overwrites_as_torch_and_takes_a_list():
    """torch's "bsr_strided_mm" zeroes the accumulators first (CPU) or stores the tiles (GPU); the other
    formats add into them, as torch's CPU loops."""
    g = torch.Generator().manual_seed(0)  # (torch's indices data fail on a pattern with no block)
    bsr = random_bsr((32, 32), (16, 16), 0.5, dtype=torch.float64, generator=g)
    assert bsr._nnz() > 0
    other = torch.randn(32, 32, dtype=torch.float64)
    for fmt in ("bsr_strided_mm", "bsr_strided_mm_compressed"):
        data = torch_ops.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt)
        theirs = torch_ops.scatter_mm(
            bsr.values(), other, data, accumulators=torch.ones(32, 32, dtype=torch.float64)
        )
        ours = bsrkit.scatter_mm(
            bsr.values(), other, list(data), accumulators=torch.ones(32, 32, dtype=torch.float64)
        )
        torch.testing.assert_close(ours, theirs)


def test_attention_errors_are_value_errors_too_as_torch():
    q = torch.randn(1, 16, 8)
    mask = bsrkit.sliding_window_mask(16, 4, 4)
    for call in (
        lambda: bsrkit.scaled_dot_product_attention(q, q, q, mask.to_dense()),
        lambda: bsrkit.scaled_dot_product_attention(q.int(), q.int(), q.int(), mask),
        lambda: bsrkit.scaled_dot_product_attention(q, q, q, mask, dropout_p="0"),
        lambda: bsrkit.scaled_dot_product_attention(q, q, q, mask, scale="1"),
    ):
        with pytest.raises(ValueError):
            call()
