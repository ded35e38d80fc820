"""Block-sparse scaled_dot_product_attention against masked dense attention (forward and gradients, float64),
and the mask builders against their dense definitions."""

import math

import numpy as np
import pytest
import torch

import bsrkit
from bsrkit import plans, reference
from helpers import backends, random_bsr

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
@pytest.mark.parametrize("backend", backends("cpu", "torch"), indirect=True)
def test_matches_dense_reference(backend, kind, is_causal):
    B, H, L, S, E, Ev = 2, 3, 24, 30, 8, 5  # ragged L != S, multi-head, value broadcast over the batch
    mask = _mask(kind, L, S, H)
    q, k, v = _inputs((B, H, L, E), (B, H, S, E), (H, S, Ev))
    _compare(q, k, v, mask, is_causal=is_causal, scale=0.7 if kind == "random_float" else None)


@pytest.fixture(params=["fused", "composed"])
def cpu_path(request, monkeypatch):
    """The CPU backend with its fused loops on (the default) or off (the composed path)."""
    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    monkeypatch.setenv("BSRKIT_FUSED_ATTENTION", "1" if request.param == "fused" else "0")
    return request.param


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts of the fused forward and backward loops' calls."""
    from bsrkit.backends.cpu import attention_kernels

    calls = {"forward": 0, "backward": 0}
    for name in calls:
        original = getattr(attention_kernels, name)

        def spy(*args, name=name, original=original, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(attention_kernels, name, spy)
    return calls


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("kind", ["sliding", "causal", "random_bool", "random_float", "batched_mask"])
def test_cpu_fused_and_composed_paths(cpu_path, fused_calls, kind, is_causal):
    B, H, L, S, E, Ev = 2, 3, 24, 30, 8, 5
    mask = _mask(kind, L, S, H)
    q, k, v = _inputs((B, H, L, E), (B, H, S, E), (H, S, Ev), seed=1)
    _compare(q, k, v, mask, is_causal=is_causal)
    expected = (1, 1) if cpu_path == "fused" else (0, 0)
    assert (fused_calls["forward"], fused_calls["backward"]) == expected


def test_a_float_mask_of_column_major_blocks(cpu_path, fused_calls):
    """Its values are copied for the loops: the copy must live while they read it (it was freed first:
    errors of 2.5 at L = 256, a segfault at 2048), forward and backward."""
    L, bs = 256, 32
    g = torch.Generator().manual_seed(4)
    bias = torch.randn(L, L, generator=g, dtype=torch.float64)
    blocks = bias.reshape(L // bs, bs, L // bs, bs).transpose(1, 2).reshape(-1, bs, bs)
    nb = L // bs
    crow, col = torch.arange(0, nb * nb + 1, nb), torch.arange(nb).repeat(nb)
    mask = torch.sparse_bsr_tensor(crow, col, blocks.mT.contiguous().mT, size=(L, L))
    assert not mask.values().is_contiguous()
    q, k, v = _inputs((2, L, 8), (2, L, 8), (2, L, 8), seed=2)
    out = _compare(q, k, v, mask)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(out, expected)
    assert fused_calls["forward"] == (1 if cpu_path == "fused" else 0)


def test_fused_float32_matches_float64(fused_calls):
    """The float32 loops (polynomial exp, MKL sgemm) against the float64 reference, with 128-blocks
    split into several chunks per block row and partial blocks on the window's edges."""
    mask = bsrkit.sliding_window_mask(512, 150, 64)
    q, k, v = (t.detach() for t in _inputs((2, 512, 32), (2, 512, 32), (2, 512, 16), seed=2))
    grad = torch.randn(2, 512, 16, dtype=torch.float64)
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    out = bsrkit.scaled_dot_product_attention(q32, k32, v32, mask, is_causal=True)
    got = torch.autograd.grad(out, (q32, k32, v32), grad.float())
    q64, k64, v64 = (t.requires_grad_() for t in (q, k, v))
    expected = reference.scaled_dot_product_attention(q64, k64, v64, mask, is_causal=True)
    want = torch.autograd.grad(expected, (q64, k64, v64), grad)
    assert fused_calls == {"forward": 1, "backward": 1}
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("nthreads", [1, 2, 3, 5])
def test_fused_backward_heads_split_between_workers(nthreads):
    """More workers than heads: a head's dK/dV are summed from the side buffers of the workers that
    share it (and with 1 head per worker, none is shared)."""
    from bsrkit import attention
    from bsrkit.backends.cpu import attention_kernels
    from bsrkit.backends.cpu.backend import _run
    from bsrkit.mask_bias import block_bias
    from bsrkit.operand import Operand

    mask = _with_false_entries(random_bsr((40, 36), (4, 6), 0.6, torch.bool, empty_rows=(3,)), seed=3)
    q, k, v = _inputs((2, 40, 8), (2, 36, 8), (2, 36, 4), seed=4)
    a = Operand.of(attention._pattern(mask, (2,)))
    bias = block_bias(mask, True, torch.float64)
    with torch.no_grad():
        out, lse = attention_kernels.forward(a, q, k, v, bias, 0.3, nthreads, _run)
        grad = torch.randn_like(out)
        got = attention_kernels.backward(a, q, k, v, out, lse, grad, bias, 0.3, nthreads, _run)
    expected = reference.scaled_dot_product_attention(q, k, v, mask, is_causal=True, scale=0.3)
    torch.testing.assert_close(out, expected)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for name, x, y in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(x, y, msg=lambda m, name=name: f"grad of {name}: {m}")


def test_work_bounds_and_side_heads():
    from bsrkit.backends.cpu.attention_kernels import side_heads, work_bounds

    cost = np.cumsum(np.concatenate([np.zeros((4, 1)), np.ones((4, 3))], 1), 1)  # 4 heads x 3 rows
    bounds = work_bounds(cost, 2)
    assert bounds.tolist() == [0, 6, 12]  # cut between heads
    assert (side_heads(bounds, 3) == -1).all()
    bounds = work_bounds(cost[:1], 2)  # 1 head, 2 workers: the head is shared
    assert bounds.tolist() in ([0, 1, 3], [0, 2, 3])
    assert side_heads(bounds, 3).tolist() == [[0, -1], [0, -1]]
    bounds = np.array([0, 2, 7, 12])
    assert side_heads(bounds, 3).tolist() == [[0, -1], [0, 2], [2, -1]]


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

    gc.collect()  # (entries of earlier tests' masks that only a collection frees)
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
    with pytest.raises(ValueError, match=op + r"expected dropout_p in \[0, 1\], got 1.5"):
        bsrkit.scaled_dot_product_attention(q, q, q, mask, dropout_p=1.5)
    with pytest.raises(TypeError, match=op + "expected dropout_p to be a real number, got str"):
        bsrkit.scaled_dot_product_attention(q, q, q, mask, dropout_p="0.1")
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
    with pytest.raises(TypeError, match=r"mask_from_dense\(\): expected mask to be a strided bool tensor"):
        bsrkit.mask_from_dense(torch.zeros(4, 4), 2)


def test_a_float_mask_row_of_minus_inf_only_gives_zero_as_torch(backend):
    """A row whose stored entries are all -inf has nothing allowed: 0, as torch's SDPA gives (the
    reference gave NaN: it counted stored blocks, not finite entries)."""
    values = torch.zeros(3, 16, 16)
    values[0, 3, :] = -torch.inf  # row 3: -inf in one of its two blocks
    values[2, 5, :] = -torch.inf  # row 21: -inf in its only block
    mask = torch.sparse_bsr_tensor(torch.tensor([0, 2, 3]), torch.tensor([0, 1, 0]), values, size=(32, 32))
    q, k, v = (torch.randn(32, d) for d in (16, 16, 8))
    got = bsrkit.scaled_dot_product_attention(q, k, v, mask)
    q, k, v = q.double(), k.double(), v.double()
    expected = reference.scaled_dot_product_attention(q, k, v, mask.double())
    dense = torch.where(reference.block_mask(mask), reference.bsr_to_dense(mask).double(), -torch.inf)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    assert (got[21] == 0).all() and (expected[21] == 0).all() and (theirs[21] == 0).all()
    torch.testing.assert_close(got.double(), expected, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(expected, theirs)


def test_a_row_whose_scores_are_all_minus_inf_gives_zero_as_torch(backend):
    """An infinite query entry makes every allowed score of its row -inf: 0, as torch's safe softmax (the
    reference gave NaN: it counted allowed entries, not finite scores)."""
    q, k, v = torch.randn(16, 4), -torch.rand(16, 4) - 0.5, torch.randn(16, 3)
    q[5] = 0.0
    q[5, 0] = torch.inf  # (every key's first entry is negative: row 5's scores are all -inf)
    k[:, 1:] = 0.0
    mask = torch.ones(16, 16).to_sparse_bsr((8, 8))
    got = bsrkit.scaled_dot_product_attention(q, k, v, mask)
    expected = reference.scaled_dot_product_attention(q.double(), k.double(), v.double(), mask.double())
    theirs = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert (got[5] == 0).all() and (expected[5] == 0).all() and (theirs[5] == 0).all()
    torch.testing.assert_close(expected, theirs)
    torch.testing.assert_close(got.double(), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    "build,error,message",
    [
        (
            lambda: bsrkit.sliding_window_mask(-16, 2, 4),
            ValueError,
            r"sliding_window_mask\(\): expected L >= 0",
        ),
        (lambda: bsrkit.causal_mask(16, 4, -4), ValueError, r"causal_mask\(\): expected S >= 0, got -4"),
        (lambda: bsrkit.causal_mask(16.0, 4), TypeError, r"causal_mask\(\): expected L to be an int"),
        (
            lambda: bsrkit.sliding_window_mask(16, 2.0, 4),
            TypeError,
            "expected window to be an int, got float",
        ),
        (lambda: bsrkit.sliding_window_mask(16, (2, -1), 4), ValueError, "expected window >= 0, got -1"),
        (
            lambda: bsrkit.sliding_window_mask(8, (1, 2, 3), 4),
            TypeError,
            "expected window to be an int or a pair of ints, got \\(1, 2, 3\\)",
        ),
        (
            lambda: bsrkit.block_local_mask(16, 4, neighbours=1.5),
            TypeError,
            "expected neighbours to be an int",
        ),
        (lambda: bsrkit.block_local_mask(16, 4, global_tokens=-1), ValueError, "expected global_tokens >= 0"),
    ],
)
def test_mask_builders_name_a_bad_size(build, error, message):
    with pytest.raises(error, match=message):
        build()


@pytest.mark.parametrize(
    "build",
    [
        lambda **kw: bsrkit.causal_mask(16, 4, **kw),
        lambda **kw: bsrkit.sliding_window_mask(16, 2, 4, **kw),
        lambda **kw: bsrkit.block_local_mask(16, 4, neighbours=1, **kw),
    ],
)
def test_mask_builders_name_a_device_that_holds_no_data(build):
    """A mask's pattern is data: on meta, given or torch's default, torch's nonzero() failed."""
    with pytest.raises(
        ValueError, match=r"_mask\(\): expected device to be a device that holds data, got 'meta'"
    ):
        build(device="meta")
    with torch.device("meta"), pytest.raises(ValueError, match="got None: meta tensors hold no data"):
        build()
    with pytest.raises(ValueError, match="expected device to be a device that holds data, got 'bogus'"):
        build(device="bogus")
    assert build(device="cpu:0").device == torch.device("cpu")
    with pytest.raises(
        ValueError, match=r"mask_from_dense\(\): expected mask to hold data, got a tensor on the meta"
    ):
        bsrkit.mask_from_dense(torch.ones(16, 16, dtype=torch.bool, device="meta"), 4)


@pytest.mark.parametrize("shape", [(0, 4, 4), (0, 4), (2, 0, 4), (4, 0)])
def test_mask_from_dense_of_an_empty_mask_is_empty(shape):
    mask = bsrkit.mask_from_dense(torch.ones(shape, dtype=torch.bool), 2)
    assert mask.shape == shape and mask.values().numel() == 0
    assert bsrkit.causal_mask(0, 4).shape == (0, 0)


def test_mask_from_flex_block_mask():
    fa = pytest.importorskip("torch.nn.attention.flex_attention")

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 5

    block_mask = fa.create_block_mask(mask_mod, 1, 1, 32, 48, device="cpu", BLOCK_SIZE=8, _compile=False)
    mask = bsrkit.mask_from_block_mask(block_mask)
    i, j = torch.arange(32)[:, None], torch.arange(48)[None, :]
    _check_mask(mask, (i - j).abs() <= 5)


def test_mask_from_block_mask_names_a_wrong_argument_and_a_sliced_block_mask():
    """A sliced BlockMask keeps the whole seq_lengths: an invalid BSR came back, refused later under
    attn_mask's name; a non-BlockMask raised a bare AttributeError."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    block_mask = fa.create_block_mask(causal, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=16, _compile=False)
    sliced = block_mask[:, :, 1:3]
    sliced.mask_mod = causal
    with pytest.raises(ValueError, match="expected block_mask to hold the 4 block rows"):
        bsrkit.mask_from_block_mask(sliced)
    for bad in (None, torch.ones(3)):
        with pytest.raises(TypeError, match="expected block_mask to be a torch.nn.attention"):
            bsrkit.mask_from_block_mask(bad)


@pytest.mark.parametrize("batched", [False, True])
def test_a_mask_storing_a_block_column_twice_is_refused(batched):
    """Attention over a row that stores a block twice weighed its keys twice (fused and composed paths
    alike: wrong rows, silently); products sum what is stored, attention cannot."""
    crow, col = torch.tensor([0, 2, 4]), torch.tensor([0, 1, 1, 1])  # block row 1 holds column 1 twice
    if batched:
        crow, col = (
            torch.stack([torch.tensor([0, 2, 4]), crow]),
            torch.stack([torch.tensor([0, 1, 0, 1]), col]),
        )
    values = torch.ones(*crow.shape[:-1], 4, 4, 4, dtype=torch.bool)
    mask = torch.sparse_bsr_tensor(crow, col, values, size=(*crow.shape[:-1], 8, 8), check_invariants=False)
    q = torch.randn(2, 8, 4)
    where = "block row 1 of batch 1" if batched else "block row 1"
    with pytest.raises(ValueError, match=f"{where} stores block column 1 twice"):
        bsrkit.scaled_dot_product_attention(q, q, q, mask)


def _dense_construction(allowed, L, S, blocksize):
    """The builders' former O(L * S) construction (kept as the oracle): evaluate every entry, store
    the blocks holding an allowed one."""
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    return bsrkit.mask_from_dense(allowed(i, j).expand(L, S).contiguous(), blocksize)


def _assert_same_bsr(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.crow_indices(), want.crow_indices())
    assert torch.equal(got.col_indices(), want.col_indices())
    assert torch.equal(got.values(), want.values())


@pytest.mark.parametrize("L,S,bs", [(24, 30, (4, 6)), (32, 32, (8, 8)), (30, 12, (5, 3)), (8, 40, (2, 8))])
def test_builders_equal_the_dense_construction(L, S, bs):
    for window in [0, 1, 5, (7, 0), (0, 3), (2, 9), 100]:
        left, right = (window, window) if isinstance(window, int) else window
        _assert_same_bsr(
            bsrkit.sliding_window_mask(L, window, bs, S=S),
            _dense_construction(lambda i, j, lo=left, hi=right: (j >= i - lo) & (j <= i + hi), L, S, bs),
        )
    _assert_same_bsr(bsrkit.causal_mask(L, bs, S=S), _dense_construction(lambda i, j: j <= i, L, S, bs))
    Ms, Ns = bs
    for neighbours in [0, 1, 3]:
        for g in [0, 1, Ns, Ns + 1, 2 * max(L, S)]:

            def local(i, j, neighbours=neighbours, g=g):
                return ((j // Ns - i // Ms).abs() <= neighbours) | (i < g) | (j < g)

            _assert_same_bsr(
                bsrkit.block_local_mask(L, bs, S=S, neighbours=neighbours, global_tokens=g),
                _dense_construction(local, L, S, bs),
            )


def test_builders_memory_is_o_nnz():
    # L = 2**18: the former construction evaluated L * S = 2**36 entries; this stores 3 blocks a row.
    mask = bsrkit.sliding_window_mask(2**18, 8, 16)
    assert mask._nnz() == 3 * 2**14 - 2
    local = bsrkit.block_local_mask(2**18, 16, neighbours=1, global_tokens=1)
    assert local._nnz() == 3 * 2**14 - 2 + 2 * (2**14 - 2)  # the band, the first row and column


def test_fused_path_sees_changed_mask_values(fused_calls):
    """The per-block bias of the fused loops is cached with the mask; writing to the mask's values
    (a new version) is seen by the next call."""
    mask = bsrkit.sliding_window_mask(16, 4, 4)
    q, k, v = (t.detach() for t in _inputs((2, 16, 4), (2, 16, 4), (2, 16, 3)))
    before = bsrkit.scaled_dot_product_attention(q, k, v, mask)
    mask.values()[0] = False  # block (0, 0): nothing allowed now
    after = bsrkit.scaled_dot_product_attention(q, k, v, mask)
    assert fused_calls["forward"] == 2
    torch.testing.assert_close(after, reference.scaled_dot_product_attention(q, k, v, mask))
    assert not torch.allclose(before, after)


def test_fused_path_takes_strided_inputs_and_gradients(fused_calls):
    """(batch, L, heads, E) layouts transposed to (batch, heads, L, E), and an expanded gradient."""
    mask = bsrkit.sliding_window_mask(24, 5, 4)
    base = _inputs((2, 24, 3, 8), (2, 24, 3, 8), (2, 24, 3, 4), seed=5)
    q, k, v = (t.transpose(1, 2) for t in base)
    out = bsrkit.scaled_dot_product_attention(q, k, v, mask, is_causal=True)
    expected = reference.scaled_dot_product_attention(q, k, v, mask, is_causal=True)
    torch.testing.assert_close(out, expected)
    got = torch.autograd.grad(out.sum(), base)
    want = torch.autograd.grad(expected.sum(), base)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    assert fused_calls == {"forward": 1, "backward": 1}


def test_fused_forward_then_declined_backward_recomputes_the_weights(monkeypatch):
    """If the fused backward declines (e.g. a process forked after the forward), the weights are
    recomputed from the saved inputs and the composed backward runs."""
    from bsrkit.backends.cpu.backend import CpuBackend

    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    monkeypatch.setattr(CpuBackend, "attention_backward", lambda self, *args: None)
    mask = _with_false_entries(bsrkit.sliding_window_mask(16, 5, 4))
    q, k, v = _inputs((2, 16, 4), (2, 16, 4), (2, 16, 3), seed=6)
    _compare(q, k, v, mask, is_causal=True)


@pytest.mark.parametrize("cpu_path", ["fused", "composed"], indirect=True)
def test_scales_a_gemm_would_fold_into_an_operand_match_torch(cpu_path):
    """A NaN scale, and one so large that scale * key overflows while the scaled scores (0 for a zero
    query row) do not, give what torch's SDPA gives on both CPU paths (the fused loops hand the scale to
    the gemm as alpha, which MKL may fold into an operand or, for NaN, ignore)."""
    mask = bsrkit.sliding_window_mask(8, 8, 4)
    dense = reference.bsr_to_dense(mask).bool()
    q, k, v = (t.detach() for t in _inputs((8, 4), (8, 4), (8, 3), seed=2))
    q[0] = 0
    for scale in (math.nan, 1e308, -1e308, 2.0, 0.5):
        got = bsrkit.scaled_dot_product_attention(q, k, v, mask, scale=scale)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale)
        torch.testing.assert_close(got, want, equal_nan=True, msg=lambda m, s=scale: f"scale={s}: {m}")


def test_numpy_scalars_are_taken_as_torch_takes_them():
    mask = bsrkit.sliding_window_mask(8, 2, 4)
    q = torch.randn(8, 4)
    want = bsrkit.scaled_dot_product_attention(q, q, q, mask, scale=0.5)
    torch.testing.assert_close(
        bsrkit.scaled_dot_product_attention(q, q, q, mask, scale=np.float32(0.5)), want
    )
    with torch.no_grad():
        bsrkit.scaled_dot_product_attention(q, q, q, mask, dropout_p=np.float64(0.1))


def test_a_float_mask_that_requires_grad_is_refused_under_grad_mode():
    """Its values are not differentiated: a learned bias would silently get no gradient."""
    bias = bsrkit.sliding_window_mask(8, 2, 4).to(torch.float32)
    values = bias.values().clone().requires_grad_()
    mask = torch.sparse_bsr_tensor(bias.crow_indices(), bias.col_indices(), values, size=bias.shape)
    q = torch.randn(8, 4)
    with pytest.raises(ValueError, match="expected an attn_mask that does not require grad"):
        bsrkit.scaled_dot_product_attention(q, q, q, mask)
    with torch.no_grad():  # (nothing is recorded: allowed)
        bsrkit.scaled_dot_product_attention(q, q, q, mask)


def test_the_cpu_loops_leave_the_callers_tensors_resizable():
    """torch marks a storage numpy views non-resizable for ever: the loops' arrays of the caller's own
    q, k, v (and a softmax's values) must not be made with .numpy() (a KV cache grown with resize_ then
    failed)."""
    mask = bsrkit.sliding_window_mask(32, 8, 8)
    q, k, v = (torch.randn(32, 8, requires_grad=True) for _ in range(3))
    bsrkit.scaled_dot_product_attention(q, k, v, mask).sum().backward()
    values = torch.randn(mask._nnz(), 8, 8)
    bsr = torch.sparse_bsr_tensor(mask.crow_indices(), mask.col_indices(), values, size=mask.shape)
    bsrkit.bsr_softmax(bsr)
    with torch.no_grad():
        for t in (q, k, v, values):
            t.detach().resize_(t.numel() + 64)


def test_mask_builders_take_numpy_integers_as_ints():
    """Sizes and windows from numpy (a shape read off an array) are ints, as scale and dropout_p take
    numpy numbers; numpy's bool is not."""
    want = bsrkit.sliding_window_mask(32, 3, 8)
    got = bsrkit.sliding_window_mask(np.int64(32), np.int32(3), np.int64(8))
    assert torch.equal(got.to_dense(), want.to_dense())
    assert torch.equal(bsrkit.causal_mask(np.int64(16), 4).to_dense(), bsrkit.causal_mask(16, 4).to_dense())
    with pytest.raises(TypeError, match="expected window to be an int, got numpy.bool"):
        bsrkit.sliding_window_mask(32, np.bool_(True), 8)


def test_a_broadcast_mask_first_used_under_inference_mode_keeps_its_plans(monkeypatch):
    from bsrkit import plans

    checks = []
    original = plans.pattern_defect
    monkeypatch.setattr(plans, "pattern_defect", lambda *a, **k: checks.append(1) or original(*a, **k))
    mask = bsrkit.sliding_window_mask(32, 8, 8)
    q = torch.randn(2, 3, 32, 8)  # (the mask broadcast over batch and heads)
    with torch.inference_mode():
        for _ in range(5):
            y = bsrkit.scaled_dot_product_attention(q, q, q, mask)
    for _ in range(5):
        torch.testing.assert_close(bsrkit.scaled_dot_product_attention(q, q, q, mask), y)
    assert len(checks) <= 2  # (the mask's pattern and its broadcast's, once each)


def test_mask_from_dense_names_a_mask_of_another_dtype():
    for bad in (torch.ones(8, 8), "mask"):
        with pytest.raises(ValueError, match=r"mask_from_dense\(\): expected mask to be a strided bool"):
            bsrkit.mask_from_dense(bad, 4)  # (ArgumentTypeError: a ValueError and a TypeError)


def test_a_numpy_bool_is_named_with_its_module():
    # ("expected is_causal to be a bool, got bool" contradicted itself for numpy.bool)
    np = pytest.importorskip("numpy")
    mask = bsrkit.sliding_window_mask(32, 4, 8)
    q = torch.randn(32, 16)
    with pytest.raises(ValueError, match="expected is_causal to be a bool, got numpy.bool"):
        bsrkit.scaled_dot_product_attention(q, q, q, mask, is_causal=np.True_)


def test_attention_and_softmax_take_non_reentrant_checkpointing_under_create_graph():
    """Their first-order-only backward read the saved tensors a second time when grad mode was on (a
    gradient penalty's first derivative), which non-reentrant checkpointing refuses."""
    from torch.utils.checkpoint import checkpoint

    mask = torch.ones(8, 8, dtype=torch.bool).to_sparse_bsr((4, 4))
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    q0 = torch.randn(2, 8, 8, dtype=torch.float64)
    calls = {
        "attention": lambda q: bsrkit.scaled_dot_product_attention(q, q, q, mask) @ w,
        "softmax": lambda q: bsrkit.bsr_softmax(
            torch.sparse_bsr_tensor(mask.crow_indices(), mask.col_indices(), q[0].view(4, 4, 4), size=(8, 8))
        ).values(),
    }
    for name, call in calls.items():
        grads = []
        for wrapped in (False, True):
            q = q0.clone().requires_grad_()
            y = checkpoint(call, q, use_reentrant=False) if wrapped else call(q)
            (g,) = torch.autograd.grad(y.square().sum(), q, create_graph=True)
            grads.append(g)
        torch.testing.assert_close(grads[0], grads[1], msg=name)


def test_attention_under_autocast_casts_as_torchs_sdpa_and_differentiates_the_float32_inputs():
    g = torch.Generator().manual_seed(6)
    q, k = (torch.randn(1, 2, 32, 8, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 2, 32, 8, generator=g).bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = bsrkit.scaled_dot_product_attention(q, k, v, bsrkit.causal_mask(32, 16))
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    got.float().sum().backward()
    assert q.grad.dtype == k.grad.dtype == torch.float32 and v.grad.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (float64 stays as it is, as torch's)
        q64 = torch.randn(1, 2, 32, 8, dtype=torch.float64)
        assert (
            bsrkit.scaled_dot_product_attention(q64, q64, q64, bsrkit.causal_mask(32, 16)).dtype
            == torch.float64
        )


def test_a_float_mask_under_autocast_keeps_its_plans():
    """The cast copied the mask's index tensors, whose memory keys its plans: every call missed."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 64, 16, generator=g) for _ in range(3))
    mask = torch.randn(64, 64, generator=g).to_sparse_bsr(16)
    bsrkit.cache_clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(4):
            got = bsrkit.scaled_dot_product_attention(q, k, v, mask)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask.to_dense())
    assert plans._plan.cache_info().hits >= 3 and plans._plan.cache_info().misses == 1
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
