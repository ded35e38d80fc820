"""Every product path against bsrkit.reference on fresh random inputs: the shared suite runs on each path
of the ``product_path`` fixture (tests/conftest.py: the CPU backend's gemm and vector loops, torch, Triton
in its interpreter); the CPU backend's own machinery (plans, kept calls, threads) is tested after it."""

import gc
import itertools
import weakref

import numpy as np
import pytest
import torch

import bsrkit
from bsrkit import reference
from helpers import DTYPES, assert_close, product_paths, random_bsr

CASES = [
    # (M, K, N, blocksize, density, empty block rows, empty block cols)
    (64, 48, 40, (16, 8), 0.5, (0,), (1,)),
    (30, 45, 17, (3, 5), 0.4, (2,), ()),  # not powers of two, N odd
    (64, 64, 300, (32, 32), 0.6, (), (0,)),  # N spans two panels
    (24, 36, 8, (1, 1), 0.2, (), ()),
    (32, 16, 8, (32, 16), 1.0, (), ()),  # one block
    (24, 20, 33, (6, 4), 0.5, (1,), ()),
    (32, 48, 40, (16, 8), 0.5, (), ()),
    (8, 8, 5, (1, 1), 0.5, (0, 3), ()),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_bsr_dense_mm_matches_reference(product_path, dtype, case):
    product_path.skip_unsupported(dtype)
    M, K, N, bs, density, er, ec = case
    bsr = random_bsr((M, K), bs, density, dtype, empty_rows=er, empty_cols=ec)
    dense = torch.randn(K, N).to(dtype)
    assert_close(product_path.mm(bsr, dense), reference.bsr_dense_mm(bsr, dense), k=K)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exact_on_small_integers(product_path, dtype):
    bsr = random_bsr((40, 60), (4, 6), 0.5, dtype, empty_rows=(3,), integers=True)
    dense = torch.randint(-3, 4, (60, 33)).to(dtype)
    assert torch.equal(product_path.mm(bsr, dense), reference.bsr_dense_mm(bsr, dense))
    g = torch.Generator().manual_seed(3)
    bsr = random_bsr((64, 64), (16, 16), 0.5, dtype, empty_rows=(2,), integers=True, generator=g)
    for N in (1, 2, 3, 8, 16):
        dense = torch.randint(-3, 4, (64, N), generator=g).to(dtype)
        assert torch.equal(product_path.mm(bsr, dense), reference.bsr_dense_mm(bsr, dense))


@pytest.mark.parametrize("dtype", DTYPES)
def test_addmm_beta_alpha(product_path, dtype):
    product_path.skip_unsupported(dtype)
    bsr = random_bsr((32, 24), (8, 4), 0.5, dtype, empty_rows=(1,))
    dense = torch.randn(24, 20).to(dtype)
    inp = torch.randn(32, 20).to(dtype)
    for beta, alpha in [(1, 1), (0.5, -2.0), (0, 3), (2, 0)]:
        got = product_path.addmm(inp, bsr, dense, beta=beta, alpha=alpha)
        assert_close(got, reference.bsr_dense_addmm(inp, bsr, dense, beta=beta, alpha=alpha), k=24)


@pytest.mark.parametrize("N", [1, 4, 16])
def test_addmm_alpha_beta_and_strided_out(product_path, N):
    g = torch.Generator().manual_seed(N)
    bsr = random_bsr((64, 32), (16, 8), 0.5, empty_rows=(0,), generator=g)
    dense = torch.randn((32, N), generator=g)
    inp = torch.randn((64, N), generator=g)
    for beta, alpha in ((1.0, 1.0), (0.5, -2.0), (0.0, 3.0)):
        got = product_path.addmm(inp, bsr, dense, beta=beta, alpha=alpha)
        assert_close(got, reference.bsr_dense_addmm(inp, bsr, dense, beta=beta, alpha=alpha), k=32)
    # out: column-major, and a view with a row stride wider than N (accumulating, and overwriting)
    for out in (torch.empty((N, 64)).mT, torch.empty((64, N + 5))[:, :N]):
        out.copy_(inp)
        product_path.addmm(out, bsr, dense, beta=2.0, alpha=0.5, out=out)
        assert_close(out, reference.bsr_dense_addmm(inp, bsr, dense, beta=2.0, alpha=0.5), k=32)
        product_path.mm(bsr, dense, out=out)
        assert_close(out, reference.bsr_dense_mm(bsr, dense), k=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_addmm_batched_broadcast_non_contiguous(product_path, dtype):
    bsr = random_bsr((2, 24, 20), (6, 4), 0.5, dtype, empty_rows=(0,))
    dense = torch.randn(20, 2, 17).to(dtype).permute(1, 0, 2)  # batched, batch stride not outermost
    inp = torch.randn(17).to(dtype)
    out = torch.empty(2, 17, 24, dtype=dtype).mT  # column-major out
    got = product_path.addmm(inp, bsr, dense, beta=0.5, alpha=-2.0, out=out)
    assert got is out
    assert_close(
        out, reference.bsr_dense_addmm(inp.expand(2, 24, 17), bsr, dense, beta=0.5, alpha=-2.0), k=20
    )


def test_addmm_beta_zero_ignores_nan_input(product_path):
    bsr = random_bsr((16, 16), (4, 4), 0.5, empty_rows=(0,))
    inp = torch.full((16, 8), float("nan"))
    out = product_path.addmm(inp, bsr, torch.randn(16, 8), beta=0)
    assert not out.isnan().any()


def test_addmm_broadcast_input_and_out_is_input(product_path):
    bsr = random_bsr((16, 12), (4, 3), 0.5)
    dense = torch.randn(12, 10)
    row = torch.randn(10)
    assert_close(
        product_path.addmm(row, bsr, dense, beta=2),
        reference.bsr_dense_addmm(row.expand(16, 10), bsr, dense, beta=2),
        k=12,
    )
    acc = torch.randn(16, 10)
    expected = reference.bsr_dense_addmm(acc, bsr, dense, beta=1, alpha=0.5)
    got = product_path.addmm(acc, bsr, dense, alpha=0.5, out=acc)
    assert got is acc
    assert_close(acc, expected, k=12)


@pytest.mark.parametrize(
    "bsr_batch,dense_batch", [((), (3,)), ((2,), ()), ((2,), (2,)), ((2, 1), (1, 3)), ((), (2, 2))]
)
def test_batched_and_broadcast(product_path, bsr_batch, dense_batch):
    bsr = random_bsr((*bsr_batch, 24, 16), (6, 4), 0.5, empty_rows=(1,))
    dense = torch.randn(*dense_batch, 16, 9)
    got = product_path.mm(bsr, dense)
    ref = reference.bsr_dense_mm(bsr, dense)
    assert got.shape == ref.shape
    assert_close(got, ref, k=16)


@pytest.mark.parametrize(
    ("bsr_batch", "dense_batch"), [((3,), (3,)), ((2, 1), (1, 3)), ((), (4,)), ((2,), ())]
)
def test_batched_and_broadcast_few_columns(product_path, bsr_batch, dense_batch):
    g = torch.Generator().manual_seed(7)
    bsr = random_bsr((*bsr_batch, 32, 48), (8, 16), 0.5, empty_rows=(1,), generator=g)
    for N in (1, 2, 3, 8):
        dense = torch.randn((*dense_batch, 48, N), generator=g)
        assert_close(product_path.mm(bsr, dense), reference.bsr_dense_mm(bsr, dense), k=48)


@pytest.mark.parametrize(
    "make_dense",
    [
        lambda: torch.randn(40, 16).t(),  # column-major
        lambda: torch.randn(16, 80)[:, ::2],  # strided columns: needs a copy
        lambda: torch.randn(16, 1).expand(16, 40),  # expanded
        lambda: torch.randn(3, 16, 40)[1],  # offset into storage
        lambda: torch.randn(40, 3, 16).permute(1, 2, 0),  # batched, column-major per matrix
    ],
)
def test_non_contiguous_dense(product_path, make_dense):
    dense = make_dense()
    bsr = random_bsr((32, 16), (8, 4), 0.5, empty_rows=(2,))
    assert_close(product_path.mm(bsr, dense), reference.bsr_dense_mm(bsr, dense), k=16)


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
def test_non_contiguous_dense_few_columns(product_path, N, make_dense):
    bsr = random_bsr((48, 64), (16, 16), 0.5, generator=torch.Generator().manual_seed(N))
    dense = make_dense(64, N)
    assert_close(product_path.mm(bsr, dense), reference.bsr_dense_mm(bsr, dense), k=64)


def test_large_non_contiguous_operands(product_path):
    bsr = random_bsr((256, 192), (32, 32), 0.3, empty_rows=(2,))
    dense = torch.randn(300, 192).mT[:, 50:250]  # (192, 200) transposed and sliced
    out = torch.empty(200, 256).mT
    product_path.mm(bsr, dense, out=out)
    assert_close(out, reference.bsr_dense_mm(bsr, dense), k=192)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "make_out",
    [
        lambda dt: torch.empty(40, 32, dtype=dt).t(),  # column-major
        lambda dt: torch.empty(32, 80, dtype=dt)[:, ::2],  # needs a temporary
        lambda dt: torch.empty(32, 50, dtype=dt)[:, 5:45],  # row stride > N
    ],
)
def test_out_written_in_place(product_path, dtype, make_out):
    product_path.skip_unsupported(dtype)
    bsr = random_bsr((32, 16), (8, 4), 0.5, dtype, empty_rows=(0,))
    dense = torch.randn(16, 40).to(dtype)
    out = make_out(dtype)
    out.fill_(float("nan"))  # every element must be written
    got = product_path.mm(bsr, dense, out=out)
    assert got is out
    assert_close(out, reference.bsr_dense_mm(bsr, dense), k=16)


def test_batched_bsr_with_non_contiguous_batched_out(product_path):
    bsr = random_bsr((2, 16, 8), (4, 4), 0.5)
    dense = torch.randn(2, 8, 6)
    out = torch.empty(6, 2, 16).permute(1, 2, 0)
    product_path.mm(bsr, dense, out=out)
    assert_close(out, reference.bsr_dense_mm(bsr, dense), k=8)


@pytest.mark.parametrize("M,K,N", [(0, 8, 4), (8, 0, 4), (8, 8, 0)])
def test_zero_sizes(product_path, M, K, N):
    bsr = torch.zeros(M, K).to_sparse_bsr((4, 4) if M and K else (1, 1))
    out = product_path.mm(bsr, torch.randn(K, N))
    assert out.shape == (M, N)
    assert not out.any()
    inp = torch.randn(M, N)
    assert torch.equal(product_path.addmm(inp, bsr, torch.randn(K, N), beta=2), 2 * inp)


def test_nnz_zero_writes_zeros(product_path):
    bsr = random_bsr((16, 16), (4, 4), 0.0)
    assert bsr._nnz() == 0
    for N in (3, 5):
        out = torch.full((16, N), float("nan"))
        product_path.mm(bsr, torch.randn(16, N), out=out)
        assert not out.any()
    empty = torch.sparse_bsr_tensor(
        torch.zeros(5, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, 8, 8),
        size=(32, 16),
    )  # every block row empty
    for N in (1, 5):
        out = torch.full((32, N), float("nan"))
        assert torch.equal(product_path.mm(empty, torch.randn(16, N), out=out), torch.zeros(32, N))


def test_transposed_product(product_path):
    """``bsr_transposed_dense_mm``: blocks reach the loops column-major (the CPU's broadcast loop)."""
    bsr = random_bsr((64, 32), (16, 8), 0.5, generator=torch.Generator().manual_seed(5))
    for N in (1, 4, 16):
        dense = torch.randn(64, N)
        got = product_path.transposed_mm(bsr, dense)
        assert_close(got, reference.bsr_transposed_dense_mm(bsr, dense), k=64)
    bsr = random_bsr((12, 20), (3, 5), 0.5, torch.float64, integers=True)
    dense = torch.randint(-3, 4, (12, 6)).double()
    assert torch.equal(product_path.transposed_mm(bsr, dense), reference.bsr_transposed_dense_mm(bsr, dense))


def test_meta_override_and_threads(monkeypatch):
    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    bsr = random_bsr((64, 64), (8, 8), 0.4, empty_rows=(0, 3))
    dense = torch.randn(64, 100)
    ref = reference.bsr_dense_mm(bsr, dense)
    for panel, nthreads in itertools.product([1, 7, 64, 1000], [1, 2, 3]):
        got = bsrkit.bsr_dense_mm(bsr, dense, meta={"panel": panel, "nthreads": nthreads})
        assert_close(got, ref, k=64)
    got = bsrkit.bsr_dense_mm(bsr, dense, meta={"panel": np.int64(7), "nthreads": np.int32(2)})  # (numpy's)
    assert_close(got, ref, k=64)
    with pytest.raises(ValueError, match="unknown"):
        bsrkit.bsr_dense_mm(bsr, dense, meta={"TILE_M": 16})
    with pytest.raises(ValueError, match="int >= 1"):
        bsrkit.bsr_dense_mm(bsr, dense, meta={"panel": 0})


@pytest.mark.parametrize("empty", ["nnz", "alpha", "K", "N"])
def test_meta_is_judged_where_no_kernel_runs(monkeypatch, empty):
    """Whether meta= is accepted depends on its keys and values, not on the pattern's contents."""
    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    bsr = random_bsr(
        (16, 12 if empty != "K" else 0), (4, 3 if empty != "K" else 1), 0.0 if empty == "nnz" else 0.5
    )
    dense = torch.randn(bsr.shape[-1], 0 if empty == "N" else 6)
    alpha = 0.0 if empty == "alpha" else 1.0
    inp = torch.zeros(16, dense.shape[-1])
    for meta, match in (({"TILE_M": 16}, "unknown"), ({"panel": 0}, "int >= 1")):
        with pytest.raises(ValueError, match=match):
            bsrkit.bsr_dense_addmm(inp, bsr, dense, alpha=alpha, meta=meta)
    assert bsrkit.bsr_dense_addmm(inp, bsr, dense, alpha=alpha, meta={"panel": 2}).shape == inp.shape


def test_work_split_writes_every_tile_exactly_once(monkeypatch):
    """The CPU kernel cuts (batch, panel, row) tasks into equal-cost runs, one per thread: a gap would
    leave NaN in ``out`` and an overlap would add a tile twice, for any thread count and panel width."""
    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    # Two batches with the same nnz but unequal rows: batch 0 has all its blocks in block row 0.
    crow = torch.tensor([[0, 4, 4, 4, 4], [0, 1, 2, 3, 4]])
    col = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]])
    values = torch.randint(-3, 4, (2, 4, 4, 3)).float()
    bsr = torch.sparse_bsr_tensor(crow, col, values, size=(2, 16, 12))
    dense = torch.randint(-3, 4, (3, 1, 12, 10)).float()  # broadcast: batch (3, 2)
    inp = torch.randint(-3, 4, (3, 2, 16, 10)).float()
    ref = reference.bsr_dense_mm(bsr, dense)
    ref_add = reference.bsr_dense_addmm(inp, bsr, dense)
    for panel, nthreads in itertools.product([1, 3, 10], [1, 2, 3, 5, 64]):
        meta = {"panel": panel, "nthreads": nthreads}
        out = torch.full(ref.shape, float("nan"))
        bsrkit.bsr_dense_mm(bsr, dense, out=out, meta=meta)
        assert torch.equal(out, ref), meta
        assert torch.equal(bsrkit.bsr_dense_addmm(inp, bsr, dense, meta=meta), ref_add), meta


def test_in_place_index_change_is_never_stale(product_path):
    dense_a = torch.zeros(8, 8)
    dense_a[:4, :4] = 1.0
    bsr = dense_a.to_sparse_bsr((4, 4))
    x = torch.randn(8, 3)
    assert_close(product_path.mm(bsr, x), reference.bsr_dense_mm(bsr, x))
    bsr.col_indices()[0] = 1  # move the block to block column 1
    assert_close(product_path.mm(bsr, x), reference.bsr_dense_mm(bsr, x))


def test_plan_cache_entry_dies_with_the_bsr(monkeypatch):
    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")  # the backend that plans
    bsrkit.cache_clear()
    bsr = random_bsr((32, 32), (8, 8), 0.5)
    x = torch.randn(32, 4)
    bsrkit.bsr_dense_mm(bsr, x)
    bsrkit.bsr_dense_mm(bsr, x)
    info = bsrkit.cache_info()
    # One entry per pattern: the validity verdict (every backend), which holds the CPU kernel's plan,
    # derived from the validated bytes; the second product finds both in one hit.
    assert (info.misses, info.hits, info.currsize) == (1, 1, 1)
    crow_ref = weakref.ref(bsr.crow_indices())  # a fresh alias: dies now, says nothing
    del crow_ref
    del bsr
    gc.collect()
    info = bsrkit.cache_info()
    assert (info.currsize, info.nbytes, info.dead_evictions) == (0, 0, 1)


# -- bad input -----------------------------------------------------------------------------------------


def test_errors_name_the_argument():
    bsr = random_bsr((8, 8), (4, 4), 0.5)
    x = torch.randn(8, 3)
    with pytest.raises(TypeError, match=r"bsr_dense_mm\(\): expected bsr to have layout torch.sparse_bsr"):
        bsrkit.bsr_dense_mm(torch.randn(8, 8), x)
    with pytest.raises(TypeError, match="expected bsr to be a torch.Tensor"):
        bsrkit.bsr_dense_mm([1], x)
    with pytest.raises(ValueError, match=r"expected dense.shape\[-2\] == 8 \(bsr.shape\[-1\]\), got 7"):
        bsrkit.bsr_dense_mm(bsr, torch.randn(7, 3))
    with pytest.raises(TypeError, match="expected dense.dtype == torch.float32"):
        bsrkit.bsr_dense_mm(bsr, x.double())
    with pytest.raises(ValueError, match="expected dense.device == cpu"):
        bsrkit.bsr_dense_mm(bsr, x.to("meta"))
    with pytest.raises(ValueError, match=r"expected out.shape == \(8, 3\), got \(8, 4\)"):
        bsrkit.bsr_dense_mm(bsr, x, out=torch.empty(8, 4))
    with pytest.raises(TypeError, match="expected out.dtype == torch.float32, got torch.float64"):
        bsrkit.bsr_dense_mm(bsr, x, out=torch.empty(8, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        bsrkit.bsr_dense_mm(bsr, torch.randn(8))
    with pytest.raises(ValueError, match="broadcastable batch"):
        bsrkit.bsr_dense_mm(random_bsr((2, 8, 8), (4, 4), 0.5), torch.randn(3, 8, 3))
    with pytest.raises(ValueError, match="expected input.shape to broadcast"):
        bsrkit.bsr_dense_addmm(torch.randn(5, 3), bsr, x)
    with pytest.raises(TypeError, match="expected beta to be a real number"):
        bsrkit.bsr_dense_addmm(torch.randn(8, 3), bsr, x, beta="1")
    with pytest.raises(TypeError, match="expected bsr.dtype in"):
        bsrkit.bsr_dense_mm(torch.ones(4, 4, dtype=torch.int32).to_sparse_bsr((2, 2)), x.int())
    empty = random_bsr((8, 8), (4, 4), 0.0)
    with pytest.raises(ValueError, match="BSRKIT_BACKEND"):
        import os

        os.environ["BSRKIT_BACKEND"] = "gpu"
        try:
            bsrkit.bsr_dense_mm(empty, x)  # even where no kernel runs
        finally:
            del os.environ["BSRKIT_BACKEND"]


# (not in Triton's interpreter: it is not thread-safe, and a GPU would test the driver, not bsrkit)
@pytest.mark.parametrize("product_path", product_paths("cpu-gemm", "cpu-small-n", "torch"), indirect=True)
def test_concurrent_products_from_threads(product_path):
    import threading

    bsr = random_bsr((64, 64), (8, 8), 0.5, empty_rows=(1,))
    xs = [torch.randn(64, 32) for _ in range(4)]
    refs = [reference.bsr_dense_mm(bsr, x) for x in xs]
    results = [None] * 4
    barrier = threading.Barrier(4)

    def work(i):
        barrier.wait()
        for _ in range(5):
            results[i] = product_path.mm(bsr, xs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, ref in zip(results, refs, strict=True):
        assert_close(got, ref, k=64)


def test_out_sharing_memory_with_dense_gets_the_product_of_dense_as_it_was():
    """Computed in a temporary and copied in (as numpy's matmul): out on dense itself, an interleaved view
    beside it (no element in common, one byte range), and an alias through another storage object
    (``torch.from_numpy``, ``from_dlpack``: the check compared storages and let these through)."""
    bsr = random_bsr((8, 8), (2, 2), 0.6)
    d = torch.randn(8, 8)
    expected = reference.bsr_dense_mm(bsr, d)
    assert_close(bsrkit.bsr_dense_mm(bsr, d, out=d), expected, k=8)
    buf = torch.randn(8, 16)
    dense, out = buf[:, 0::2], buf[:, 1::2]
    expected = reference.bsr_dense_mm(bsr, dense)
    assert_close(bsrkit.bsr_dense_mm(bsr, dense, out=out), expected, k=8)
    array = np.random.default_rng(0).standard_normal((9, 8)).astype(np.float32)
    for alias in (torch.from_numpy, torch.from_dlpack):
        dense, out = torch.from_numpy(array[:8]), alias(array[1:])  # (rows 1-7 in common)
        expected = reference.bsr_dense_mm(bsr, dense.clone())
        assert_close(bsrkit.bsr_dense_mm(bsr, dense, out=out), expected, k=8)
        assert_close(out, expected, k=8)


def test_an_out_with_overlapping_elements_is_refused_on_every_path():
    """An expanded out would take every row's write at one place (torch refuses it as well)."""
    bsr = random_bsr((8, 8), (4, 4), 0.6)
    x = torch.randn(8, 5)
    calls = [
        lambda out: bsrkit.bsr_dense_mm(bsr, x, out=out),
        lambda out: bsrkit.bsr_dense_addmm(torch.zeros(8, 5), bsr, x, out=out),
        lambda out: bsrkit.bsr_dense_addmm(torch.zeros(8, 5), bsr, x, left_alpha=torch.ones(8), out=out),
        lambda out: bsrkit.bsr_scatter_mm(bsr, x, bsrkit.bsr_scatter_mm_indices_data(bsr, x), out=out),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="expected out whose elements are distinct memory"):
            call(torch.zeros(1, 5).expand(8, 5))
    out = torch.zeros(8, 10)[:, ::2]  # strided but distinct: accepted
    bsrkit.bsr_dense_mm(bsr, x, out=out)
    assert_close(out, reference.bsr_dense_mm(bsr, x), k=8)


def test_out_sharing_memory_with_the_blocks_gets_the_product_of_the_blocks_as_they_were():
    """The kernels read the blocks while they write out: through a temporary (as torch.mm(a, b, out=a))."""
    buf = torch.randn(16 * 16)
    crow, col = torch.tensor([0, 2, 4, 6, 8]), torch.tensor([0, 2, 1, 3, 0, 2, 1, 3])
    bsr = torch.sparse_bsr_tensor(crow, col, buf[:128].view(8, 4, 4), size=(16, 16))
    d = torch.randn(16, 16)
    kept = buf.clone()
    for call in (
        lambda out: bsrkit.bsr_dense_mm(bsr, d, out=out),
        lambda out: bsrkit.bsr_dense_addmm(torch.zeros(16, 16), bsr, d, out=out),
    ):
        buf.copy_(kept)
        expected = reference.bsr_dense_mm(bsr, d)
        assert_close(call(buf.view(16, 16)), expected, k=16)
    buf.copy_(kept)
    # (the transposed product reads its plan's gathered copy of the blocks: out may be anywhere)
    expected = reference.bsr_dense_mm(bsr.to_dense().mT.to_sparse_bsr((4, 4)), d)
    assert_close(bsrkit.bsr_transposed_dense_mm(bsr, d, out=buf.view(16, 16)), expected, k=16)
    out = torch.empty(16, 16)
    bsrkit.bsr_dense_mm(bsr, d, out=out)  # (its own memory: accepted)
    assert_close(out, reference.bsr_dense_mm(bsr, d), k=16)


def test_a_repeated_call_checks_out_s_strides_again():
    """A call's checks are kept by its metadata: an expanded out after a plain out of the same shape is
    refused all the same (whether out's elements are distinct memory depends on its strides)."""
    bsr = random_bsr((16, 16), (4, 4), 0.6)
    d = torch.randn(16, 8)
    for _ in range(2):
        bsrkit.bsr_dense_mm(bsr, d, out=torch.empty(16, 8))
        with pytest.raises(ValueError, match="expected out whose elements are distinct memory"):
            bsrkit.bsr_dense_mm(bsr, d, out=torch.zeros(1, 8).expand(16, 8))


def test_sampled_addmm_gives_its_result_its_own_index_memory():
    """As torch's: a later write to input's pattern does not change an earlier result."""
    crow, col = torch.tensor([0, 1, 2]), torch.tensor([0, 1])
    input = torch.sparse_bsr_tensor(crow, col, torch.randn(2, 2, 2), size=(4, 4))
    m1, m2 = torch.randn(4, 3), torch.randn(3, 4)
    result = bsrkit.sampled_addmm(input, m1, m2)
    before = result.to_dense().clone()
    for got, theirs in ((result.crow_indices(), crow), (result.col_indices(), col)):
        assert got.untyped_storage().data_ptr() != theirs.untyped_storage().data_ptr()
    input.col_indices().copy_(torch.tensor([1, 0]))
    assert torch.equal(result.to_dense(), before)


def test_out_beside_dense_in_one_buffer_is_accepted():
    """Two halves of one buffer share a storage but no memory: out may be one, dense the other."""
    bsr = random_bsr((8, 8), (2, 2), 0.6)
    buf = torch.randn(16, 5)
    ref = reference.bsr_dense_mm(bsr, buf[:8])
    bsrkit.bsr_dense_mm(bsr, buf[:8], out=buf[8:])
    assert_close(buf[8:], ref, k=8)
    ref = reference.bsr_dense_mm(bsr, buf[:8])
    bsrkit.bsr_dense_mm(bsr, buf[:8], out=buf[7:15])  # one row in common: through a temporary
    assert_close(buf[7:15], ref, k=8)


def test_bsr_made_in_inference_mode(product_path):
    """Inference tensors have no version counter: products on them run uncached, and are right."""
    with torch.inference_mode():
        bsr = random_bsr((32, 24), (8, 4), 0.5, empty_rows=(1,))
        dense = torch.randn(24, 10)
        got = product_path.mm(bsr, dense)
        ref = reference.bsr_dense_mm(bsr, dense)
        assert_close(
            product_path.transposed_mm(bsr, got),
            reference.bsr_dense_mm(bsr.to_dense().mT.to_sparse_bsr((4, 8)), ref),
            k=32,
        )
    assert_close(got, ref, k=24)


@pytest.mark.parametrize("N", [1, 8, 40])  # the vector loops (N <= 16) and the gemm loop
def test_repeated_calls_follow_new_data(monkeypatch, N):
    """The CPU backend reuses a call's marshaled arguments for calls of the same layouts: every repeat
    must still read the current values, dense and out (new tensors, views at other offsets, in-place
    changes), and more layouts than it keeps per plan must stay correct."""
    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    bsr = random_bsr((32, 48), (8, 16), 0.5, empty_rows=(1,))
    crow, col = bsr.crow_indices(), bsr.col_indices()
    big = torch.randn(3, 48, N)
    for step in range(3):
        values = torch.randn_like(bsr.values())  # a rebuilt weight: same pattern, new values memory
        weight = torch.sparse_bsr_tensor(crow, col, values, size=bsr.shape)
        for dense in (torch.randn(48, N), big[step], big[(step + 1) % 3]):  # new memory, other offsets
            out = torch.full((32, N), float("nan"))
            bsrkit.bsr_dense_mm(weight, dense, out=out)
            assert_close(out, reference.bsr_dense_mm(weight, dense), k=48)
        values.mul_(-2)  # in place: the next product reads it
        assert_close(bsrkit.bsr_dense_mm(weight, big[0]), reference.bsr_dense_mm(weight, big[0]), k=48)
    for n in range(1, 20):  # more signatures than a plan keeps
        dense = torch.randn(48, n)
        assert_close(bsrkit.bsr_dense_mm(bsr, dense), reference.bsr_dense_mm(bsr, dense), k=48)
        addend = torch.randn(32, n)
        assert_close(
            bsrkit.bsr_dense_addmm(addend, bsr, dense, beta=0.5, alpha=2.0),
            reference.bsr_dense_addmm(addend, bsr, dense, beta=0.5, alpha=2.0),
            k=48,
        )


def test_a_remembered_verdict_lets_no_invalid_call_through(monkeypatch):
    """Calls like an earlier valid one skip the argument checks (their verdict depends only on metadata);
    whatever differs in a later call (memory, grad mode, forced backend, scalar values, the pattern) must
    still be caught."""
    from bsrkit import ops

    bsr = random_bsr((32, 32), (8, 8), 0.5)
    x = torch.randn(32, 6)
    out = torch.empty(32, 6)
    bsrkit.bsr_dense_mm(bsr, x, out=out)
    before = bsrkit.shortcut_info()
    bsrkit.bsr_dense_mm(bsr, x, out=out)
    assert bsrkit.shortcut_info().checked_hits == before.checked_hits + 1  # (the checks were skipped)
    shared = torch.randn(32, 6)  # out and dense on one storage: data, not metadata
    expected = reference.bsr_dense_mm(bsr, shared)
    assert_close(bsrkit.bsr_dense_mm(bsr, shared, out=shared), expected, k=8)
    wants_grad = x.clone().requires_grad_()
    with pytest.raises(ValueError, match="out=None"):
        bsrkit.bsr_dense_mm(bsr, wants_grad, out=out)
    monkeypatch.setenv("BSRKIT_BACKEND", "no-such-backend")
    with pytest.raises(ValueError, match="BSRKIT_BACKEND"):
        bsrkit.bsr_dense_mm(bsr, x, out=out)
    monkeypatch.delenv("BSRKIT_BACKEND")
    q = (torch.randn(32, 32) * 4).to(torch.int8).to_sparse_bsr((8, 8))
    qx = torch.randint(-8, 8, (32, 6), dtype=torch.int8)
    expected = q.to_dense().int() @ qx.int()
    assert torch.equal(bsrkit.bsr_dense_addmm(torch.zeros(32, 6, dtype=torch.int32), q, qx), expected)
    assert torch.equal(bsrkit.bsr_dense_mm(q, qx), expected)
    with pytest.raises(ValueError, match="integer beta and alpha"):
        ops.checked_addmm("bsr_dense_mm", None, q, qx, beta=0.0, alpha=0.5, out=None, meta=None)
    broken = torch.sparse_bsr_tensor(
        bsr.crow_indices(),
        bsr.col_indices().clone().fill_(7),
        bsr.values(),
        size=bsr.shape,
        check_invariants=False,
    )  # the same metadata, a column out of range
    with pytest.raises(ValueError, match="malformed"):
        bsrkit.bsr_dense_mm(broken, x, out=out)
    bsrkit.bsr_dense_mm(bsr, x, out=out)
    assert_close(out, reference.bsr_dense_mm(bsr, x), k=32)


@pytest.mark.parametrize("N", [8, 40])  # the vector loops and the gemm loop
def test_prepared_calls_are_reused_only_for_the_same_call(monkeypatch, tmp_path, N):
    """A backend's prepared call is kept (bsrkit.shortcuts) and reused for a call with the same checked
    call, strides and offsets, thread count and tuning state: each of these changing prepares a new call
    (or keeps none at all), and every result matches the reference."""
    from bsrkit import shortcuts, tuning

    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    monkeypatch.setenv("BSRKIT_TUNING_TABLE", str(tmp_path / "none.json"))  # (no table: defaults)
    # (seeded: drawn from the global generator, the pattern depended on the tests run before; one was empty)
    bsr = random_bsr((32, 48), (8, 16), 0.5, empty_rows=(1,), generator=torch.Generator().manual_seed(0))
    assert bsr._nnz()
    big = torch.randn(2, 48, 2 * N)

    def check(dense, out=None, prepared=1, reused=0):
        before = bsrkit.shortcut_info()
        got = bsrkit.bsr_dense_mm(bsr, dense, out=out)
        assert_close(got, reference.bsr_dense_mm(bsr, dense), k=48)
        after = bsrkit.shortcut_info()
        if prepared is not None:
            counts = (after.call_misses - before.call_misses, after.call_hits - before.call_hits)
            assert counts == (prepared, reused)

    check(torch.randn(48, N))
    check(torch.randn(48, N), prepared=0, reused=1)  # new memory, same layout: reused
    check(big[1, :, :N])  # another offset and stride
    check(big[1, :, N:])  # another offset
    check(torch.randn(N, 48).mT, prepared=None)  # column-major (the vector loops copy it: nothing kept)
    check(torch.randn(48, N), torch.full((N, 32), float("nan")).mT)  # out= column-major
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        check(torch.randn(48, N))
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():  # another checked call (grad mode is in its signature)
        check(torch.randn(48, N))
    shortcuts.clear()  # new checked-call objects: the kept calls of the old ones are not theirs
    check(torch.randn(48, N))
    check(torch.randn(48, N), prepared=0, reused=1)
    # A tuning table that changes the parameters: a new table object, so no kept call is reused.
    key = tuning.table_key(tuning.cpu_device_name(), "bsr_dense_mm", torch.float32, (32, 48, N), (8, 16))
    tuning.save_entries({key: {"small_n": N > 16, "panel": 8}}, tmp_path / "table.json")
    monkeypatch.setenv("BSRKIT_TUNING_TABLE", str(tmp_path / "table.json"))
    check(torch.randn(48, N))  # (the same key: its kept call is replaced)
    check(torch.randn(48, N), prepared=0, reused=1)
    monkeypatch.setenv("BSRKIT_BACKEND", "torch")  # another backend: nothing kept, still right
    check(torch.randn(48, N), prepared=0)


def test_prepared_calls_without_a_checked_call_are_keyed_by_layout_and_params(monkeypatch):
    """Calls that carry no checked call (meta=, input=, the custom op of BSRLinear) reuse a prepared call
    only for the same layouts, scalars and parameters."""
    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    bsr = random_bsr((32, 48), (8, 16), 0.5, generator=torch.Generator().manual_seed(1))
    addend = torch.randn(32, 40)

    def counts(call):
        before = bsrkit.shortcut_info()
        call()
        after = bsrkit.shortcut_info()
        return after.call_misses - before.call_misses, after.call_hits - before.call_hits

    x = torch.randn(48, 40)
    assert counts(lambda: bsrkit.bsr_dense_mm(bsr, x, meta={"panel": 16})) == (1, 0)
    assert counts(lambda: bsrkit.bsr_dense_mm(bsr, torch.randn(48, 40), meta={"panel": 16})) == (0, 1)
    assert counts(lambda: bsrkit.bsr_dense_mm(bsr, x, meta={"panel": 8})) == (1, 0)  # other params
    got = bsrkit.bsr_dense_addmm(addend, bsr, x, beta=0.5, alpha=2.0)
    assert_close(got, reference.bsr_dense_addmm(addend, bsr, x, beta=0.5, alpha=2.0), k=48)
    assert counts(lambda: bsrkit.bsr_dense_addmm(addend, bsr, x, beta=0.5, alpha=2.0)) == (0, 1)
    assert counts(lambda: bsrkit.bsr_dense_addmm(addend, bsr, x, beta=0.5, alpha=3.0)) == (1, 0)  # alpha
    got = bsrkit.bsr_dense_addmm(addend, bsr, x, beta=0.5, alpha=3.0)
    assert_close(got, reference.bsr_dense_addmm(addend, bsr, x, beta=0.5, alpha=3.0), k=48)


def test_prepared_calls_are_thread_safe(monkeypatch):
    """Threads running the same kept call at once, each with its own data: each gets its own result."""
    import threading

    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    bsr = random_bsr((32, 32), (8, 8), 0.5)
    bsrkit.bsr_dense_mm(bsr, torch.randn(32, 24))  # keep the call
    barrier = threading.Barrier(4)
    failures = []

    def work(seed):
        dense = torch.randn(32, 24, generator=torch.Generator().manual_seed(seed))
        expected = reference.bsr_dense_mm(bsr, dense)
        barrier.wait()
        for _ in range(200):
            if not torch.allclose(bsrkit.bsr_dense_mm(bsr, dense), expected, atol=1e-5):
                failures.append(seed)
                return

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not failures


def test_empty_products_return_zeros_of_the_right_kind():
    """nnz == 0, K == 0 or alpha == 0 without out=: zeros at once (dense's dtype, int32 for int8); a
    non-finite alpha still gives NaN (inf * 0), as the formula says."""
    for dtype in (torch.float32, torch.float64):
        got = bsrkit.bsr_dense_mm(
            torch.zeros(32, 32, dtype=dtype).to_sparse_bsr((8, 8)), torch.randn(32, 5).to(dtype)
        )
        assert got.dtype == dtype and got.shape == (32, 5) and not got.any()
    empty = torch.zeros(32, 32).to_sparse_bsr((8, 8))
    q = torch.zeros(32, 32, dtype=torch.int8).to_sparse_bsr((8, 8))
    got = bsrkit.bsr_dense_mm(q, torch.ones(32, 5, dtype=torch.int8))
    assert got.dtype == torch.int32 and not got.any()
    bsr = random_bsr((32, 32), (8, 8), 0.5)
    assert not bsrkit.bsr_dense_addmm(torch.ones(32, 5), bsr, torch.randn(32, 5), beta=0, alpha=0).any()
    nan = bsrkit.bsr_dense_addmm(torch.ones(32, 5), empty, torch.randn(32, 5), beta=0, alpha=float("inf"))
    assert nan.isnan().all()


def test_products_on_meta_tensors_give_shapes_only():
    """As torch's ops on meta (shape inference, meta-device model building): no pattern to read."""
    bsr = torch.randn(64, 32).to_sparse_bsr(16).to("meta")
    x = torch.randn(32, 8, device="meta")
    for result, shape in (
        (bsrkit.bsr_dense_mm(bsr, x), (64, 8)),
        (bsrkit.bsr_dense_addmm(torch.empty(64, 8, device="meta"), bsr, x), (64, 8)),
        (bsrkit.bsr_transposed_dense_mm(bsr, torch.randn(64, 8, device="meta")), (32, 8)),
        (bsrkit.bsr_dense_mm(bsr, x.requires_grad_()), (64, 8)),
        (bsrkit.bsr_scatter_mm(bsr, x), (64, 8)),
    ):
        assert result.device.type == "meta" and tuple(result.shape) == shape
    s = bsrkit.sampled_addmm(bsr, torch.randn(3, 64, 4, device="meta"), torch.randn(4, 32, device="meta"))
    assert s.device.type == "meta" and s.layout is torch.sparse_bsr and tuple(s.shape) == (3, 64, 32)
    q = torch.randn(2, 64, 8, device="meta")
    mask = bsrkit.sliding_window_mask(64, 8, 16).to("meta")
    a = bsrkit.scaled_dot_product_attention(q, q, torch.randn(2, 64, 5, device="meta"), mask)
    assert a.device.type == "meta" and tuple(a.shape) == (2, 64, 5)
    with pytest.raises(ValueError, match=r"expected dense.shape\[-2\] == 32"):  # (still checked)
        bsrkit.bsr_dense_mm(bsr, torch.randn(31, 8, device="meta"))


def test_the_reference_agrees_with_the_documented_semantics():
    """The oracle itself: int8 products are int32 (exact); a non-finite dense entry meets only stored
    blocks (torch's BSR product gives the same); a non-finite value reaches only rows whose stored
    blocks hold its key."""
    w = torch.full((16, 16), 127, dtype=torch.int8)
    bsr = w.to_sparse_bsr((8, 8))
    x = torch.full((16, 4), 127, dtype=torch.int8)
    for got in (reference.bsr_dense_mm(bsr, x), reference.bsr_transposed_dense_mm(bsr, x)):
        assert got.dtype == torch.int32 and got[0, 0].item() == 16 * 127 * 127
    dense = torch.zeros(4, 4)
    dense[:2, :2] = torch.arange(1.0, 5.0).reshape(2, 2)
    b = dense.to_sparse_bsr((2, 2))  # one stored block, top left
    y = torch.tensor([[1.0], [1.0], [torch.inf], [torch.nan]])
    want = b @ y  # (torch's own BSR product)
    torch.testing.assert_close(reference.bsr_dense_mm(b, y), want, equal_nan=True)
    torch.testing.assert_close(bsrkit.bsr_dense_mm(b, y), want, equal_nan=True)
    torch.testing.assert_close(
        reference.bsr_transposed_dense_mm(b, y),
        b.to_dense().mT.contiguous().to_sparse_bsr((2, 2)) @ y,
        equal_nan=True,
    )
    mask = bsrkit.mask_from_dense(
        torch.tensor([[True, False], [False, True]]).repeat_interleave(2, 0).repeat_interleave(2, 1), 2
    )
    q, v = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    v[3] = torch.nan  # in the second block column only: rows 0-1 never hold it
    out = reference.scaled_dot_product_attention(q, q, v, mask)
    assert torch.isfinite(out[:2]).all() and torch.isnan(out[2:]).all()
    torch.testing.assert_close(bsrkit.scaled_dot_product_attention(q, q, v, mask), out, equal_nan=True)


def test_a_write_through_out_moves_its_version_counter_on_every_path():
    """The kernels wrote out without moving its counter: a tensor autograd saved and then overwritten gave
    a wrong gradient silently (torch's out= raises), an inference tensor was written outside inference
    mode, and caches keyed on the counter (weak_lru_cache's) served a stale value."""
    bsr = random_bsr((8, 8), (2, 2), 0.6)
    x = torch.randn(8, 4)
    data = bsrkit.bsr_scatter_mm_indices_data(bsr, x)
    acc_blocks, acc_others = torch.randn(2, 2, 2), torch.randn(2, 2, 4)
    acc_data = ("scatter_mm", torch.tensor([0, 1, 2]), torch.tensor([[0, 1], [1, 0]]))
    writes = {
        "mm": lambda out: bsrkit.bsr_dense_mm(bsr, x, out=out),
        "addmm": lambda out: bsrkit.bsr_dense_addmm(
            torch.ones(8, 4), bsr, x, left_alpha=torch.ones(8), out=out
        ),
        "transposed": lambda out: bsrkit.bsr_transposed_dense_mm(bsr, x, out=out),
        "scatter, indices data": lambda out: bsrkit.bsr_scatter_mm(bsr, x, data, out=out),
        "scatter_mm accumulators": lambda out: bsrkit.scatter_mm(
            acc_blocks, acc_others, acc_data, accumulators=out.view(4, 2, 4)[:2]
        ),
    }
    for name, write in writes.items():
        for _ in range(2):  # (the second call repeats the first's checks)
            weight = torch.ones(8, 4, requires_grad=True)
            saved = torch.zeros(8, 4)
            y = weight * saved  # (saves `saved`)
            before = saved._version
            write(saved)
            assert saved._version > before, name
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.sum().backward()
        with torch.inference_mode():
            frozen = torch.zeros(8, 4)
        with pytest.raises(ValueError, match="inference tensor"):
            write(frozen)
        with torch.inference_mode():
            write(frozen)  # (inside inference mode: written, as torch writes it)
        assert frozen.abs().sum() > 0, name


@pytest.mark.parametrize("dtype", [torch.float16])  # (bfloat16's range is float32's, the accumulator's)
@pytest.mark.parametrize("scaled", [False, True])
def test_half_addmm_rounds_the_sum_once_where_the_product_overflows(product_path, scaled, dtype):
    """A product beyond float16's range that beta * input brings back into it: torch.addmm rounds the sum
    once. The unscaled path rounded the product to half first (inf)."""
    big = 35000.0
    product_path.skip_unsupported(dtype)
    a = torch.zeros(2, 4, dtype=dtype)
    a[0, :2] = 1
    bsr = a.to_sparse_bsr((1, 2))
    dense = torch.full((4, 3), big, dtype=dtype)
    input = torch.full((2, 3), -1.5 * big, dtype=dtype)
    scales = {"right_alpha": torch.ones(3, dtype=dtype)} if scaled else {}
    got = product_path.addmm(input, bsr, dense, **scales)
    expected = torch.addmm(input.double(), a.double(), dense.double()).to(dtype)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(got, expected)


def test_sampled_addmm_refuses_coefficients_beyond_float32_by_name():
    """alpha = 1e39 became inf in the kernel (NaN entries), beta = 1e39 a raw torch error; as
    bsr_dense_addmm, both are refused by name."""
    mask = random_bsr((8, 8), (2, 2), 0.5)
    m1, m2 = torch.randn(8, 3), torch.randn(3, 8)
    for name in ("alpha", "beta"):
        with pytest.raises(ValueError, match=rf"expected \|{name}\| < 3.40282e\+38"):
            bsrkit.sampled_addmm(mask, m1, m2, **{name: 1e39})
    got = bsrkit.sampled_addmm(mask.double(), m1.double(), m2.double(), alpha=1e39)  # (float64 holds it)
    assert_close(
        got.to_dense(),
        reference.sampled_addmm(mask.double(), m1.double(), m2.double(), alpha=1e39).to_dense(),
    )


def test_sampled_addmm_refuses_an_out_requiring_grad_before_writing_it():
    """It wrote out's values, then raised an unrelated error."""
    mask = random_bsr((8, 8), (2, 2), 0.5)
    m1, m2 = torch.randn(8, 3), torch.randn(3, 8)
    values = torch.zeros_like(mask.values()).requires_grad_()
    out = torch.sparse_bsr_tensor(
        mask.crow_indices().clone(), mask.col_indices().clone(), values, size=(8, 8)
    )
    with pytest.raises(ValueError, match="expected out not to require grad"):
        bsrkit.sampled_addmm(mask, m1, m2, out=out)
    assert not values.detach().any()


def test_sampled_addmm_takes_a_batched_out_whose_shared_pattern_is_an_expanded_view():
    """out holding input's pattern as one expanded index tensor (a batch sharing one pattern) took a copy
    of it, which torch refuses into an expanded tensor."""
    crow, col = torch.tensor([0, 1, 2, 2, 3]).expand(2, -1), torch.tensor([0, 2, 3]).expand(2, -1)
    input = torch.sparse_bsr_tensor(crow, col, torch.randn(2, 3, 2, 2), size=(2, 8, 8))
    out = torch.sparse_bsr_tensor(crow, col, torch.zeros(2, 3, 2, 2), size=(2, 8, 8))
    m1, m2 = torch.randn(8, 3), torch.randn(3, 8)
    bsrkit.sampled_addmm(input, m1, m2, out=out)
    assert_close(out.to_dense(), reference.sampled_addmm(input, m1, m2).to_dense())


def test_coefficients_take_numpy_s_bool_and_name_an_integer_beyond_float64():
    """np.True_ was refused (torch.addmm takes it, as Python's True); 10**400 escaped as a bare
    OverflowError naming neither the op nor the argument."""
    bsr = random_bsr((4, 4), (2, 2), 0.5)
    x, input = torch.randn(4, 3), torch.randn(4, 3)
    assert_close(
        bsrkit.bsr_dense_addmm(input, bsr, x, alpha=np.True_, beta=np.False_), reference.bsr_dense_mm(bsr, x)
    )
    for call in (
        lambda **kw: bsrkit.bsr_dense_addmm(input, bsr, x, **kw),
        lambda **kw: bsrkit.sampled_addmm(bsr, x, x.mT, **kw),
    ):
        for name in ("alpha", "beta"):
            with pytest.raises(ValueError, match=f"expected {name} within float64's range"):
                call(**{name: 10**400})


def test_sampled_addmm_refuses_an_out_whose_expanded_pattern_cannot_take_input_s_before_writing():
    """A batched input whose patterns differ per batch, an out whose indices are one expanded view: torch
    refused the second index copy after the first had been written."""
    crow = torch.tensor([[0, 1, 2], [0, 2, 2]])
    col = torch.tensor([[0, 1], [0, 1]])
    input = torch.sparse_bsr_tensor(crow, col, torch.randn(2, 2, 2, 2), size=(2, 4, 4))
    out_crow, out_col = torch.tensor([0, 2, 2]).expand(2, -1), torch.tensor([0, 1]).expand(2, -1)
    out = torch.sparse_bsr_tensor(out_crow, out_col, torch.zeros(2, 2, 2, 2), size=(2, 4, 4))
    with pytest.raises(ValueError, match="out's pattern differs from input's"):
        bsrkit.sampled_addmm(input, torch.randn(4, 3), torch.randn(3, 4), out=out)
    assert out.crow_indices().tolist() == [[0, 2, 2], [0, 2, 2]]


def test_a_half_type_input_aliasing_out_through_another_storage_is_read_as_it_was():
    """The same memory through two numpy views (two storage objects, a row apart): comparing storages
    missed it, and the input was copied into out over itself (errors of 4); the byte ranges see it."""
    torch.manual_seed(0)
    memory = np.zeros(33 * 32, dtype=np.float16)
    out = torch.from_numpy(memory[32:]).view(32, 32)
    input = torch.from_numpy(memory[:-32]).view(32, 32)
    out.copy_(torch.randn(32, 32))
    bsr = torch.randn(32, 32).half().to_sparse_bsr(16)
    dense = torch.randn(32, 32).half()
    expected = input.double() + bsr.to_dense().double() @ dense.double()
    bsrkit.bsr_dense_addmm(input, bsr, dense, out=out)
    reference.assert_close(out, expected, torch.float16, 32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_a_half_type_input_overlapping_out_is_read_as_it_was(dtype, beta):
    """out := input + bsr @ dense with input = out.mT: an input of out's dtype with beta == 1 is
    accumulated onto in place, but one overlapping out otherwise must be read before out is written (it
    raised torch's overlap error)."""
    torch.manual_seed(0)
    bsr = torch.randn(32, 32).to(dtype).to_sparse_bsr(16)
    dense = torch.randn(32, 32).to(dtype)
    out = torch.randn(32, 32).to(dtype)
    expected = beta * out.double().mT + bsr.to_dense().double() @ dense.double()
    bsrkit.bsr_dense_addmm(out.mT, bsr, dense, beta=beta, out=out)
    reference.assert_close(out, expected, dtype, 32)
