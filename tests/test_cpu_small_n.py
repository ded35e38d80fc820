"""The CPU backend's vector loops for few columns (``bsr_dense_mm`` with N <= 16, or ``meta={"small_n":
True}``), against the masked-dense reference; every case also on the gemm path (``small_n: False``)."""

from __future__ import annotations

import pytest
import torch

import bsrkit
from bsrkit import dispatch, reference
from bsrkit.backends.cpu import backend as cpu_backend
from helpers import assert_close, random_bsr

pytestmark = pytest.mark.skipif(
    dispatch.select_backend("bsr_dense_mm", torch.device("cpu"), torch.float32) != "cpu",
    reason="CPU products do not run on the compiled backend here",
)

PATHS = (True, False)  # meta["small_n"]: the vector loops, or a gemm per block

# (M, K, blocksize): square blocks taking the dot-product loop for N <= 4 (Ks a multiple of the lanes);
# rectangular ones and blocks of odd width (Ks % 8 != 0: the broadcast loop at every N); Ms % 4 != 0.
SHAPES = [
    (64, 96, (16, 16)), (64, 64, (32, 32)), (40, 48, (8, 16)), (30, 45, (3, 5)), (48, 32, (6, 8)),
    (45, 32, (9, 8)),  # an odd row count on the dot-product loops: their leftover rows
]  # fmt: skip


@pytest.mark.parametrize("small", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference_at_every_width(small, dtype, shape):
    M, K, blocksize = shape
    g = torch.Generator().manual_seed(M + K)
    bsr = random_bsr((M, K), blocksize, 0.4, dtype, empty_rows=(1,), generator=g)
    for N in (1, 2, 3, 4, 5, 8, 9, 16, 17):
        dense = torch.randn((K, N), generator=g).to(dtype)
        got = bsrkit.bsr_dense_mm(bsr, dense, meta={"small_n": small})
        assert_close(got, reference.bsr_dense_mm(bsr, dense), k=K)


@pytest.mark.parametrize("small", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exact_on_small_integers(small, dtype):
    g = torch.Generator().manual_seed(3)
    bsr = random_bsr((64, 64), (16, 16), 0.5, dtype, empty_rows=(2,), integers=True, generator=g)
    for N in (1, 2, 3, 8, 16):
        dense = torch.randint(-3, 4, (64, N), generator=g).to(dtype)
        got = bsrkit.bsr_dense_mm(bsr, dense, meta={"small_n": small})
        assert torch.equal(got, reference.bsr_dense_mm(bsr, dense))


@pytest.mark.parametrize("small", PATHS)
@pytest.mark.parametrize("N", [1, 4, 16])
def test_addmm_alpha_beta_and_strided_out(small, N):
    g = torch.Generator().manual_seed(N)
    bsr = random_bsr((64, 32), (16, 8), 0.5, empty_rows=(0,), generator=g)
    dense = torch.randn((32, N), generator=g)
    inp = torch.randn((64, N), generator=g)
    for beta, alpha in ((1.0, 1.0), (0.5, -2.0), (0.0, 3.0)):
        got = bsrkit.bsr_dense_addmm(inp, bsr, dense, beta=beta, alpha=alpha, meta={"small_n": small})
        assert_close(got, reference.bsr_dense_addmm(inp, bsr, dense, beta=beta, alpha=alpha), k=32)
    # out: column-major, and a view with a row stride wider than N (accumulating, and overwriting)
    for out in (torch.empty((N, 64)).mT, torch.empty((64, N + 5))[:, :N]):
        out.copy_(inp)
        bsrkit.bsr_dense_addmm(out, bsr, dense, beta=2.0, alpha=0.5, out=out, meta={"small_n": small})
        assert_close(out, reference.bsr_dense_addmm(inp, bsr, dense, beta=2.0, alpha=0.5), k=32)
        bsrkit.bsr_dense_mm(bsr, dense, out=out, meta={"small_n": small})
        assert_close(out, reference.bsr_dense_mm(bsr, dense), k=32)


@pytest.mark.parametrize("small", PATHS)
@pytest.mark.parametrize("N", [1, 2, 8, 12])
@pytest.mark.parametrize(
    "make_dense",
    [
        lambda K, N: torch.randn(N, K).mT,  # column-major (a token batch x.T): read in place for N <= 4
        lambda K, N: torch.randn(K, 2 * N)[:, ::2],  # no unit stride: copied
        lambda K, N: torch.randn(K, N + 3)[:, :N],  # row stride wider than N
    ],
    ids=["column-major", "strided", "padded-rows"],
)
def test_non_contiguous_dense(small, N, make_dense):
    bsr = random_bsr((48, 64), (16, 16), 0.5, generator=torch.Generator().manual_seed(N))
    dense = make_dense(64, N)
    assert_close(
        bsrkit.bsr_dense_mm(bsr, dense, meta={"small_n": small}), reference.bsr_dense_mm(bsr, dense), k=64
    )


@pytest.mark.parametrize("small", PATHS)
@pytest.mark.parametrize(
    ("bsr_batch", "dense_batch"), [((3,), (3,)), ((2, 1), (1, 3)), ((), (4,)), ((2,), ())]
)
def test_batched_and_broadcast(small, bsr_batch, dense_batch):
    g = torch.Generator().manual_seed(7)
    bsr = random_bsr((*bsr_batch, 32, 48), (8, 16), 0.5, empty_rows=(1,), generator=g)
    for N in (1, 2, 3, 8):
        dense = torch.randn((*dense_batch, 48, N), generator=g)
        got = bsrkit.bsr_dense_mm(bsr, dense, meta={"small_n": small})
        assert_close(got, reference.bsr_dense_mm(bsr, dense), k=48)


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


@pytest.mark.parametrize("small", PATHS)
def test_transposed_operand(small):
    """``bsr_transposed_dense_mm``: blocks reach the loops column-major (the broadcast loop)."""
    bsr = random_bsr((64, 32), (16, 8), 0.5, generator=torch.Generator().manual_seed(5))
    for N in (1, 4, 16):
        dense = torch.randn(64, N)
        got = bsrkit.bsr_transposed_dense_mm(bsr, dense, meta={"small_n": small})
        assert_close(got, reference.bsr_transposed_dense_mm(bsr, dense), k=64)


@pytest.mark.parametrize("small", PATHS)
def test_nnz_zero_and_all_rows_empty_write_zeros(small):
    empty = torch.sparse_bsr_tensor(
        torch.zeros(5, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, 8, 8),
        size=(32, 16),
    )
    for N in (1, 5):
        out = torch.full((32, N), float("nan"))
        assert torch.equal(bsrkit.bsr_dense_mm(empty, torch.randn(16, N), out=out, meta={"small_n": small}),
                           torch.zeros(32, N))  # fmt: skip


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
