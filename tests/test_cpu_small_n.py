"""The CPU backend's vector loops for few columns (``bsr_dense_mm`` with N <= 16, or ``meta={"small_n":
True}``): the layouts each loop takes, against the masked-dense reference, also on the gemm path
(``small_n: False``). The product suite runs on both paths as well (tests/test_products.py, the
``cpu-small-n`` and ``cpu-gemm`` product paths)."""

from __future__ import annotations

import pytest
import torch

import bsrkit
from bsrkit import dispatch, reference
from bsrkit.backends.cpu import backend as cpu_backend
from helpers import CPU_PATHS, assert_close, product_paths, random_bsr

pytestmark = pytest.mark.skipif(
    dispatch.select_backend("bsr_dense_mm", torch.device("cpu"), torch.float32) != "cpu",
    reason="CPU products do not run on the compiled backend here",
)

# (M, K, blocksize): square blocks taking the dot-product loop for N <= 4 (Ks a multiple of the lanes);
# rectangular ones and blocks of odd width (Ks % 8 != 0: the broadcast loop at every N); Ms % 4 != 0.
SHAPES = [
    (64, 96, (16, 16)), (64, 64, (32, 32)), (40, 48, (8, 16)), (30, 45, (3, 5)), (48, 32, (6, 8)),
    (45, 32, (9, 8)),  # an odd row count on the dot-product loops: their leftover rows
]  # fmt: skip


@pytest.mark.parametrize("product_path", product_paths(*CPU_PATHS), indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference_at_every_width(product_path, dtype, shape):
    M, K, blocksize = shape
    g = torch.Generator().manual_seed(M + K)
    bsr = random_bsr((M, K), blocksize, 0.4, dtype, empty_rows=(1,), generator=g)
    for N in (1, 2, 3, 4, 5, 8, 9, 16, 17):
        dense = torch.randn((K, N), generator=g).to(dtype)
        assert_close(product_path.mm(bsr, dense), reference.bsr_dense_mm(bsr, dense), k=K)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_column_major_out_is_written_right_at_every_width(dtype, shape):
    """``out`` the transposed view of a row-major ``(N, M)`` (what BSRLinear hands the kernel): each loop
    writes it column by column where its columns are contiguous; overwritten (mm) and added to with
    beta and alpha (addmm), the rows outside the pattern included."""
    M, K, blocksize = shape
    g = torch.Generator().manual_seed(M * K)
    bsr = random_bsr((M, K), blocksize, 0.4, dtype, empty_rows=(1,), generator=g)
    for N in (1, 2, 3, 4, 5, 8, 9, 16):
        dense = torch.randn((N, K), generator=g).to(dtype).mT  # (x.mT: column-major too)
        out = torch.full((N, M), float("nan"), dtype=dtype).mT
        bsrkit.bsr_dense_mm(bsr, dense, out=out)
        assert_close(out, reference.bsr_dense_mm(bsr, dense), k=K)
        start = torch.randn((N, M), generator=g).to(dtype)
        out = start.clone().mT
        bsrkit.bsr_dense_addmm(out.clone(), bsr, dense, beta=0.5, alpha=-2.0, out=out)
        expected = 0.5 * start.mT - 2.0 * reference.bsr_dense_mm(bsr, dense)
        assert_close(out, expected, k=K)


@pytest.mark.parametrize("parallel", [False, True], ids=["serial entry", "parallel loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_two_row_major_columns_are_read_in_place(monkeypatch, dtype, parallel):
    """N = 2, row-major: the two-column loop reads dense as it is (DOT_PAIRS), without the transposed copy
    the other layouts take, on the serial C entry and in the parallel loop; prepared once, then reused."""
    from types import SimpleNamespace

    from bsrkit.backends.cpu import kernels

    real = kernels.bsr_mm_small_kernel()
    seen = []

    def prepare(args):
        seen.append((args.dot, args.x_addr, args.nthreads))
        return real.prepare(args)

    spy = SimpleNamespace(prepare=prepare, run_prepared=real.run_prepared, serial=real.serial, Args=real.Args)
    monkeypatch.setattr(kernels, "bsr_mm_small_kernel", lambda: spy)
    meta = None
    if parallel:  # (products this small run serially unless the cut-off says otherwise)
        monkeypatch.setattr(cpu_backend, "_SERIAL_WORK", 0)
        meta = {"nthreads": 2}
    g = torch.Generator().manual_seed(11)
    bsr = random_bsr((72, 96), (24, 16), 0.5, dtype, empty_rows=(1,), generator=g)  # Ms = 24: 6 row quads
    dense = torch.randn((96, 2), generator=g).to(dtype)
    for _ in range(2):
        assert_close(bsrkit.bsr_dense_mm(bsr, dense, meta=meta), reference.bsr_dense_mm(bsr, dense), k=96)
    assert seen == [(kernels.DOT_PAIRS, dense.data_ptr(), 2 if parallel else 1)]
    odd = random_bsr((45, 32), (9, 8), 0.5, dtype, generator=g)  # Ms % 4 = 1: the one-row remainder
    dense = torch.randn((3, 32, 2), generator=g).to(dtype)  # batched, broadcast over the blocks
    assert_close(bsrkit.bsr_dense_mm(odd, dense, meta=meta), reference.bsr_dense_mm(odd, dense), k=32)
    assert seen[-1][0] == kernels.DOT_PAIRS


def test_nan_and_inf_propagate_as_in_ieee_arithmetic():
    """No fast-math: inf * 0 is NaN, a NaN in dense reaches exactly the rows of blocks that read it."""
    bsr = random_bsr((32, 32), (16, 16), 1.0, generator=torch.Generator().manual_seed(1))
    bsr.values()[0, 0, 0] = float("inf")
    for N in (1, 4, 16):
        dense = torch.zeros(32, N)
        ref = reference.bsr_dense_mm(bsr, dense)
        torch.testing.assert_close(
            bsrkit.bsr_dense_mm(bsr, dense, meta={"small_n": True}), ref, equal_nan=True
        )
        assert ref[0].isnan().all() and not ref[1:].isnan().any()


def test_the_default_follows_n(monkeypatch):
    """Auto: the vector loops up to ``_SMALL_N_MAX`` columns for float32/float64, else a gemm per block;
    half types always take the gemm path (meta or not)."""
    calls = []
    real = cpu_backend._addmm_small
    monkeypatch.setattr(cpu_backend, "_addmm_small", lambda *a: calls.append(a[1].shape[-1]) or real(*a))
    bsr = random_bsr((32, 32), (8, 8), 0.5, generator=torch.Generator().manual_seed(2))
    for N in (1, cpu_backend._SMALL_N_MAX, cpu_backend._SMALL_N_MAX + 1):
        bsrkit.bsr_dense_mm(bsr, torch.randn(32, N))
    bsrkit.bsr_dense_mm(bsr, torch.randn(32, 40), meta={"small_n": True})
    bsrkit.bsr_dense_mm(bsr, torch.randn(32, 2), meta={"small_n": False})
    assert calls == [1, cpu_backend._SMALL_N_MAX, 40]
    half = bsr.to(torch.bfloat16)
    dense = torch.randn(32, 4).to(torch.bfloat16)
    got = bsrkit.bsr_dense_mm(half, dense, meta={"small_n": True})
    assert calls == [1, cpu_backend._SMALL_N_MAX, 40]
    assert_close(got, reference.bsr_dense_mm(half, dense), k=32)


def test_meta_small_n_must_be_a_bool():
    bsr = random_bsr((16, 16), (8, 8), 1.0)
    with pytest.raises(ValueError, match=r"bsr_dense_mm\(\): expected meta\['small_n'\] to be a bool, got 1"):
        bsrkit.bsr_dense_mm(bsr, torch.randn(16, 2), meta={"small_n": 1})


def test_prepared_calls_keep_no_large_copy_of_dense():
    """The vector loops copy a dense of few columns into the layout they read; a prepared call kept that
    copy (45 MiB held for four batched inputs long freed). A decode step's column is kept and refilled."""
    import gc

    from bsrkit import shortcuts
    from bsrkit.cached_values import nbytes_of, value_arrays

    crow, col = torch.tensor([0, 1]), torch.tensor([0])
    w = torch.sparse_bsr_tensor(crow, col, torch.randn(1, 16, 16), size=(16, 4096))
    for b in (64, 128):
        x = torch.randn(b, 4096, 3)
        torch.testing.assert_close(bsrkit.bsr_dense_mm(w, x), w.to_dense() @ x)
        bsrkit.bsr_dense_mm(w, x, meta={"panel": 256})
        del x
    gc.collect()
    operand = shortcuts._operands[id(w)][3]
    held = nbytes_of(value_arrays([list(operand.calls.values()), list(operand.pattern.calls.values())]))
    assert held < 2**20
    x = torch.randn(4096, 1)
    for _ in range(2):  # (the repeated call refills its kept copy)
        torch.testing.assert_close(bsrkit.bsr_dense_mm(w, x), w.to_dense() @ x)
        x = torch.randn(4096, 1)


@pytest.mark.parametrize("N", [1, 4, 8, 16])
def test_long_sums_round_like_torch_mm(N):
    # Positive terms (sums that only grow, the worst case for rounding) over K = 16384 in float32: each
    # block's sums start from zero and are then added (a serial sum over K measured 18-25x torch.mm's
    # error at N = 8 and 16, 2-3x at N = 1 and 4; blockwise, 1.2-4x).
    g = torch.Generator().manual_seed(N)
    w, x = torch.rand((64, 16384), generator=g), torch.rand((16384, N), generator=g)
    exact = w.double() @ x.double()
    ours = (bsrkit.bsr_dense_mm(w.to_sparse_bsr((32, 32)), x).double() - exact).abs().max()
    torchs = ((w @ x).double() - exact).abs().max()
    assert ours <= 6 * torchs, (ours.item(), torchs.item())
