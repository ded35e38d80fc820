"""Block-sparse scaled_dot_product_attention against masked dense attention (forward and gradients, float64),
and the mask builders against their dense definitions."""

import pytest
import torch

import bsrkit
from bsrkit import plans, reference
from helpers import random_bsr

# Triton's interpreter takes seconds per call: its tests use the few smallest cases.


def _inputs(q_shape, k_shape, v_shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in (q_shape, k_shape, v_shape)]


def _compare(q, k, v, mask, tol=None, **kwargs):
    """Forward and all three gradients against the dense reference."""
    out = bsrkit.scaled_dot_product_attention(q, k, v, mask, **kwargs)
    expected = reference.scaled_dot_product_attention(q, k, v, mask, **kwargs)
    tol = tol or {}
    torch.testing.assert_close(out, expected, **tol)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for name, a, b in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"grad of {name}: {m}")
    return out


def _with_false_entries(mask, seed=0):
    """The mask's pattern with random False entries inside its stored blocks (one block all False)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.rand(mask.values().shape, generator=g) < 0.7
    if values.shape[-3]:
        values[..., 0, :, :] = False
    return torch.sparse_bsr_tensor(mask.crow_indices(), mask.col_indices(), values, size=mask.shape)


def _mask(kind, L, S, H):
    if kind == "sliding":
        return bsrkit.sliding_window_mask(L, 5, (4, 6), S=S)
    if kind == "causal":
        return bsrkit.causal_mask(L, (8, 6), S=S)
    if kind == "local_global":
        return bsrkit.block_local_mask(L, (4, 6), S=S, neighbours=1, global_tokens=3)
    if kind == "random_bool":  # empty block rows, False entries, a block with nothing allowed
        return _with_false_entries(random_bsr((L, S), (4, 3), 0.4, torch.bool, empty_rows=(2,)))
    if kind == "random_float":
        return random_bsr((L, S), (6, 5), 0.5, torch.float64, empty_rows=(0,))
    # a mask per head, broadcast over the batch
    return random_bsr((H, L, S), (6, 6), 0.5, torch.float64, empty_rows=(1,))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(
    "kind", ["sliding", "causal", "local_global", "random_bool", "random_float", "batched_mask"]
)
@pytest.mark.parametrize("backend", ["cpu", "torch"], indirect=True)
def test_matches_dense_reference(backend, kind, is_causal):
    B, H, L, S, E, Ev = 2, 3, 24, 30, 8, 5  # ragged L != S, multi-head, value broadcast over the batch
    mask = _mask(kind, L, S, H)
    q, k, v = _inputs((B, H, L, E), (B, H, S, E), (H, S, Ev))
    _compare(q, k, v, mask, is_causal=is_causal, scale=0.7 if kind == "random_float" else None)


@pytest.mark.triton
@pytest.mark.parametrize("kind,is_causal", [("random_bool", True), ("batched_mask", False)])
def test_triton_matches_dense_reference(monkeypatch, kind, is_causal):
    pytest.importorskip("triton")
    monkeypatch.setenv("BSRKIT_BACKEND", "triton")
    H, L, S = 2, 12, 18
    mask = _mask(kind, L, S, H)
    q, k, v = _inputs((H, L, 4), (H, S, 4), (H, S, 3))
    _compare(q, k, v, mask, is_causal=is_causal)


def test_empty_rows_give_zero_and_finite_gradients(backend):
    mask = _with_false_entries(random_bsr((16, 16), (4, 4), 0.5, torch.bool, empty_rows=(1,)))
    q, k, v = _inputs((2, 16, 4), (2, 16, 4), (2, 16, 3))
    out = _compare(q, k, v, mask)
    assert (out[:, 4:8] == 0).all()  # block row 1 stores nothing
    assert out.isfinite().all()


def test_nnz_zero_and_empty_dimensions(backend):
    mask = random_bsr((8, 12), (4, 4), 0.0, torch.bool)
    q, k, v = _inputs((2, 8, 4), (2, 12, 4), (2, 12, 3))
    out = bsrkit.scaled_dot_product_attention(q, k, v, mask)
    assert out.shape == (2, 8, 3) and (out == 0).all()
    out.sum().backward()
    assert all((t.grad == 0).all() for t in (q, k, v))
    empty = torch.zeros(0, 12, dtype=torch.bool).to_sparse_bsr((4, 4))
    assert bsrkit.scaled_dot_product_attention(q[:, :0], k, v, empty).shape == (2, 0, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lower_precision(dtype):
    mask = bsrkit.sliding_window_mask(32, 6, 8)
    q, k, v = (t.detach().to(dtype) for t in _inputs((2, 32, 16), (2, 32, 16), (2, 32, 16)))
    out = bsrkit.scaled_dot_product_attention(q, k, v, mask, is_causal=True)
    expected = reference.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), mask, is_causal=True
    )
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


def test_dropout():
    mask = bsrkit.sliding_window_mask(8, 2, 4)
    q, k, v = _inputs((1, 8, 2), (1, 8, 2), (1, 8, 2))

    def attn(q, k, v):
        torch.manual_seed(1)  # the same dropout mask in every evaluation
        return bsrkit.scaled_dot_product_attention(q, k, v, mask, dropout_p=0.4)

    torch.autograd.gradcheck(attn, (q, k, v))
    plain = bsrkit.scaled_dot_product_attention(q, k, v, mask)
    assert not torch.allclose(attn(q, k, v), plain)
    assert (bsrkit.scaled_dot_product_attention(q, k, v, mask, dropout_p=1.0) == 0).all()
    # Unbiased: the mean over many dropout draws approaches the plain output.
    with torch.no_grad():
        qs, ks, vs = (t.expand(2000, 8, 2) for t in (q, k, v))
        mean = bsrkit.scaled_dot_product_attention(qs, ks, vs, mask, dropout_p=0.4).mean(0, keepdim=True)
    torch.testing.assert_close(mean, plain, rtol=0, atol=0.1)


def test_backward_reuses_the_mask_plans():
    mask = bsrkit.sliding_window_mask(16, 4, 4)
    q, k, v = _inputs((2, 3, 16, 4), (2, 3, 16, 4), (2, 3, 16, 3))
    bsrkit.scaled_dot_product_attention(q, k, v, mask).sum().backward()
    misses = plans.cache_info().misses
    for _ in range(2):
        bsrkit.scaled_dot_product_attention(q, k, v, mask).sum().backward()
    assert plans.cache_info().misses == misses


def test_no_entry_outlives_the_mask():
    import gc
    import weakref

    def run():
        mask = bsrkit.sliding_window_mask(16, 4, 4)
        q = torch.randn(2, 3, 16, 4, requires_grad=True)
        bsrkit.scaled_dot_product_attention(q, q, q, mask, is_causal=True).sum().backward()
        return weakref.ref(mask)

    before = plans.cache_info().currsize
    ref = run()
    gc.collect()
    assert ref() is None
    assert plans.cache_info().currsize == before


def test_arguments():
    mask = bsrkit.sliding_window_mask(8, 2, 4)
    q = torch.randn(8, 4)
    op = r"scaled_dot_product_attention\(\): "
    with pytest.raises(TypeError, match=op + "expected attn_mask to be a torch.sparse_bsr tensor"):
        bsrkit.scaled_dot_product_attention(q, q, q, None)
    with pytest.raises(TypeError, match=op + "expected attn_mask to be a torch.sparse_bsr tensor"):
        bsrkit.scaled_dot_product_attention(q, q, q, torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=op + r"expected attn_mask.shape\[-2:\] == \(8, 12\)"):
        bsrkit.scaled_dot_product_attention(q, torch.randn(12, 4), torch.randn(12, 4), mask)
    with pytest.raises(ValueError, match=op + r"expected key.shape\[-1\] == 4"):
        bsrkit.scaled_dot_product_attention(q, torch.randn(8, 5), q, mask)
    with pytest.raises(ValueError, match=op + r"expected value.shape\[-2\] == 8"):
        bsrkit.scaled_dot_product_attention(q, q, torch.randn(9, 4), mask)
    with pytest.raises(TypeError, match=op + "expected attn_mask.dtype to be torch.bool or torch.float32"):
        bsrkit.scaled_dot_product_attention(q, q, q, mask.to(torch.float64))
    with pytest.raises(TypeError, match=op + r"expected key.dtype == torch.float32"):
        bsrkit.scaled_dot_product_attention(q, q.double(), q, mask)
    with pytest.raises(ValueError, match=op + "expected dropout_p to be a number in"):
        bsrkit.scaled_dot_product_attention(q, q, q, mask, dropout_p=1.5)
    with pytest.raises(TypeError, match=op + "expected is_causal to be a bool"):
        bsrkit.scaled_dot_product_attention(q, q, q, mask, is_causal=1)
    with pytest.raises(ValueError, match=op + "expected broadcastable batch dimensions"):
        bsrkit.scaled_dot_product_attention(torch.randn(2, 8, 4), torch.randn(3, 8, 4), q, mask)


# -- mask builders -----------------------------------------------------------------------------------


def _check_mask(mask, allowed):
    """mask's entries equal allowed, and exactly the blocks holding an allowed entry are stored."""
    dense = reference.bsr_to_dense(mask)
    assert torch.equal(dense, allowed)
    Ms, Ns = mask.values().shape[-2:]
    L, S = allowed.shape[-2:]
    blocks = allowed.reshape(-1, L // Ms, Ms, S // Ns, Ns).any(2).any(-1).any(0)
    assert torch.equal(reference.block_mask(mask).reshape(-1, L, S)[0, ::Ms, ::Ns], blocks)


def test_builders():
    i = torch.arange(24)[:, None]
    j = torch.arange(30)[None, :]
    _check_mask(bsrkit.sliding_window_mask(24, (5, 2), (4, 6), S=30), (j >= i - 5) & (j <= i + 2))
    _check_mask(bsrkit.causal_mask(24, (8, 3), S=30), (j <= i).expand(24, 30))
    local = ((j // 6 - i // 4).abs() <= 1) | (i < 3) | (j < 3)
    _check_mask(bsrkit.block_local_mask(24, (4, 6), S=30, neighbours=1, global_tokens=3), local)
    dense = torch.rand(2, 24, 30) < 0.05
    dense[:, 4:8] = False
    from_dense = bsrkit.mask_from_dense(dense, (4, 6))
    assert from_dense.shape == (2, 24, 30)
    _check_mask(from_dense, dense)
    with pytest.raises(
        ValueError, match=r"sliding_window_mask\(\): expected the blocksize \(5, 5\) to divide"
    ):
        bsrkit.sliding_window_mask(24, 3, 5)
    with pytest.raises(TypeError, match=r"mask_from_dense\(\): expected a strided bool tensor"):
        bsrkit.mask_from_dense(torch.zeros(4, 4), 2)


def test_mask_from_flex_block_mask():
    fa = pytest.importorskip("torch.nn.attention.flex_attention")

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 5

    block_mask = fa.create_block_mask(mask_mod, 1, 1, 32, 48, device="cpu", BLOCK_SIZE=8, _compile=False)
    mask = bsrkit.mask_from_block_mask(block_mask)
    i, j = torch.arange(32)[:, None], torch.arange(48)[None, :]
    _check_mask(mask, (i - j).abs() <= 5)
