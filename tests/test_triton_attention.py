"""The fused Triton attention forward (backends/triton/attention_kernels.py), in Triton's interpreter,
against the float64 masked-dense reference; its backward is the composed path's."""

import math

import pytest
import torch

import bsrkit
from bsrkit import reference
from helpers import random_bsr

pytest.importorskip("triton")
pytestmark = pytest.mark.triton


@pytest.fixture
def fused_calls(monkeypatch):
    """Forces the Triton backend and counts the fused forward's launches."""
    from bsrkit.backends.triton import attention_kernels

    monkeypatch.setenv("BSRKIT_BACKEND", "triton")
    calls = []
    original = attention_kernels.forward

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(attention_kernels, "forward", counting)
    return calls


def _masks():
    g = torch.Generator().manual_seed(1)
    partial = random_bsr((24, 30), (4, 6), 0.5, torch.bool, empty_rows=(2,))
    values = torch.rand(partial.values().shape, generator=g) < 0.7
    values[0] = False  # one stored block with nothing allowed
    partial = torch.sparse_bsr_tensor(
        partial.crow_indices(), partial.col_indices(), values, size=partial.shape
    )
    return {
        "sliding": bsrkit.sliding_window_mask(24, 5, (4, 6), S=30),
        "partial_bool": partial,
        "float": random_bsr((24, 30), (6, 5), 0.5, torch.float32, empty_rows=(0,)),
        "per_head": random_bsr((2, 24, 30), (6, 6), 0.5, torch.float32, empty_rows=(1,)),
        "odd_blocks": bsrkit.causal_mask(24, (3, 5), S=30),
    }


@pytest.mark.parametrize("kind", list(_masks()))
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_forward_matches_reference(fused_calls, kind, is_causal, dtype):
    mask = _masks()[kind]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 2, 24, 8, generator=g)
    k = torch.randn(3, 2, 30, 8, generator=g)
    v = torch.randn(3, 2, 30, 5, generator=g)
    if mask.dtype != torch.bool:
        mask = mask.to(dtype)
    out = bsrkit.scaled_dot_product_attention(
        q.to(dtype), k.to(dtype), v.to(dtype), mask, is_causal=is_causal
    )
    assert fused_calls and out.dtype == dtype
    ref_mask = mask if mask.dtype == torch.bool else mask.double()
    expected = reference.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), ref_mask, is_causal=is_causal
    )
    reference.assert_close(out, expected, dtype, 30)


def test_fused_forward_then_composed_backward(fused_calls):
    mask = _masks()["partial_bool"]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, n, 8, generator=g).requires_grad_() for n in (24, 30, 30))
    out = bsrkit.scaled_dot_product_attention(q, k, v, mask, is_causal=True)
    assert fused_calls
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = reference.scaled_dot_product_attention(q64, k64, v64, mask, is_causal=True)
    want = torch.autograd.grad(expected, (q64, k64, v64), grad.double())
    reference.assert_close(out, expected, torch.float32, 30)
    for a, b in zip(got, want, strict=True):
        reference.assert_close(a, b, torch.float32, 30)


def test_rows_with_nothing_allowed_give_zero(fused_calls):
    mask = random_bsr((16, 16), (4, 4), 0.5, torch.bool, empty_rows=(1,))
    q, k, v = (torch.randn(2, 16, 4) for _ in range(3))
    out = bsrkit.scaled_dot_product_attention(q, k, v, mask)
    assert fused_calls
    assert (out[:, 4:8] == 0).all() and out.isfinite().all()


def test_nan_reaches_exactly_the_rows_the_math_gives(fused_calls):
    mask = bsrkit.sliding_window_mask(32, 4, 8)
    q, k, v = (torch.randn(1, 32, 16) for _ in range(3))
    q[0, 3, 0] = math.nan
    k[0, 20, 1] = math.nan
    out = bsrkit.scaled_dot_product_attention(q, k, v, mask)
    assert fused_calls
    expected = reference.scaled_dot_product_attention(q.double(), k.double(), v.double(), mask)
    assert torch.equal(out.isnan().any(-1), expected.isnan().any(-1))
    assert out[0, 3].isnan().all() and out[0, 0].isfinite().all()


def test_float64_and_large_heads_take_the_composed_path(fused_calls):
    mask = bsrkit.sliding_window_mask(16, 3, 8)
    q, k, v = (torch.randn(1, 16, 4, dtype=torch.float64) for _ in range(3))
    out = bsrkit.scaled_dot_product_attention(q, k, v, mask)
    assert not fused_calls
    torch.testing.assert_close(out, reference.scaled_dot_product_attention(q, k, v, mask))
