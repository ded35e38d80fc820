"""The deferred proof: a repeated product on a kept operand (the CPU vector loops for N <= 16, the gemm
loop above) skips the Python comparison of its index data; the prepared call's loop compares every entry
of its plan with the live memory instead, and a difference rebuilds the pattern and recomputes the
product.

Each test watches the counters (``bsrkit.shortcut_info()``: ``loop_proofs``, ``loop_stale``) and that
``Snapshot.unchanged`` is not what caught the write; serially (the C entry) and on two numba threads (the
parallel loop, each worker comparing its own share of the rows).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

import bsrkit
from bsrkit import dispatch, freshness, reference
from bsrkit.backends.cpu import backend as cpu_backend
from helpers import assert_close

pytestmark = pytest.mark.skipif(
    dispatch.select_backend("bsr_dense_mm", torch.device("cpu"), torch.float32) != "cpu",
    reason="CPU products do not run on the compiled backend here",
)

BS, GRID = 8, 6  # a 6 x 6 grid of 8 x 8 blocks
SIZE = BS * GRID
CROW = [0, 3, 5, 5, 8, 10, 12]  # block row 2 empty
COL = [0, 2, 5, 1, 3, 0, 4, 5, 2, 3, 1, 5]


@pytest.fixture(params=["serial", "parallel"])
def threads(request, monkeypatch) -> Iterator[str]:
    """Serial: the C entry of the loop's serial twin; parallel: the prepared call on two numba threads
    (every product past the serial cut-off)."""
    if request.param == "parallel":
        monkeypatch.setattr(cpu_backend, "_SERIAL_WORK", 0)
        before = torch.get_num_threads()
        torch.set_num_threads(2)
        yield request.param
        torch.set_num_threads(before)
    else:
        yield request.param


@pytest.fixture
def python_proofs(monkeypatch) -> list[int]:
    """Counts the whole Python proofs (``Snapshot.unchanged``) made while a test runs."""
    calls: list[int] = []
    real = freshness.Snapshot.unchanged

    def counted(self: freshness.Snapshot) -> bool:
        calls.append(1)
        return real(self)

    monkeypatch.setattr(freshness.Snapshot, "unchanged", counted)
    return calls


def _bsr(dtype: torch.dtype = torch.int64, batch: tuple[int, ...] = ()) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    n = int(np.prod(batch)) if batch else 1
    crow = torch.tensor([CROW] * n, dtype=dtype).reshape(*batch, len(CROW))
    col = torch.tensor([COL] * n, dtype=dtype).reshape(*batch, len(COL))
    values = torch.randn(*batch, len(COL), BS, BS, generator=g)
    return torch.sparse_bsr_tensor(crow, col, values, size=(*batch, SIZE, SIZE))


def _counts() -> tuple[int, int, int]:
    info = bsrkit.shortcut_info()
    return info.call_hits, info.loop_proofs, info.loop_stale


def _check(b: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> tuple[int, int, int]:
    """One product against the reference; the change in (call hits, loop proofs, loop stale)."""
    before = _counts()
    got = bsrkit.bsr_dense_mm(b, x, out=out)
    assert_close(got, reference.bsr_dense_mm(b, x), k=SIZE)
    return tuple(a - b for a, b in zip(_counts(), before, strict=True))  # type: ignore[return-value]


def _warm(b: torch.Tensor, x: torch.Tensor) -> None:
    """The first product keeps the operand and its prepared call; the second reruns it, proven in the
    loop."""
    _check(b, x)
    assert _check(b, x) == (1, 1, 0)


@pytest.mark.parametrize("layout", ["row-major", "column-major"])
# The vector loops' dot products (1, 2 and 4 columns) and broadcast (5, 16), and the gemm loop (40).
@pytest.mark.parametrize("N", [1, 2, 3, 4, 5, 16, 40])
def test_a_repeated_product_is_proven_in_the_loop_not_in_python(threads, python_proofs, N, layout):
    """Whether the loop reads dense in place or a copy that its prepared call keeps and fills."""

    def dense() -> torch.Tensor:
        return torch.randn(SIZE, N) if layout == "row-major" else torch.randn(N, SIZE).mT

    b = _bsr()
    _warm(b, dense())
    python_proofs.clear()
    for _ in range(3):
        assert _check(b, dense()) == (1, 1, 0)
    assert python_proofs == []
    b.col_indices().numpy()[-1] = 0
    assert _check(b, dense()) == (1, 0, 1)


def _numpy_col(b: torch.Tensor) -> None:
    b.col_indices().numpy()[4] = 5  # block (1, 3) moves to column 5


def _dot_data(b: torch.Tensor) -> None:
    new = b.col_indices().clone()
    new[-1] = 0
    b.col_indices().data.copy_(new)


def _ctypes_first(b: torch.Tensor) -> None:
    one = torch.tensor([4], dtype=b.col_indices().dtype)
    ctypes.memmove(b.col_indices().data_ptr(), one.data_ptr(), one.element_size())


def _crow_moves_rows(b: torch.Tensor) -> None:
    b.crow_indices().numpy()[...] = [0, 1, 4, 6, 8, 11, 12]  # no empty row now, blocks in other rows


def _empty_last_row(b: torch.Tensor) -> None:
    b.crow_indices().numpy()[..., -2] = 12  # block row 5 empty: only the last worker reads that entry


WRITES: dict[str, Callable[[torch.Tensor], None]] = {
    "numpy_col": _numpy_col,
    "dot_data": _dot_data,
    "ctypes_first_entry": _ctypes_first,
    "crow_moves_rows": _crow_moves_rows,
    "empty_last_row": _empty_last_row,
}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("write", WRITES)
def test_a_write_while_kept_is_caught_by_the_loop(threads, write, dtype):
    b, x = _bsr(dtype), torch.randn(SIZE, 4)  # (copied for the four-column loop: see above)
    _warm(b, x)
    WRITES[write](b)
    assert _check(b, x) == (1, 0, 1)  # the prepared call ran, its loop found the write
    assert _check(b, x) == (1, 1, 0)  # rebuilt: proven in the loop again
    assert _check(b, torch.randn(SIZE, 4)) == (1, 1, 0)


@pytest.mark.parametrize("N", [1, 40])  # the vector loops; the gemm loop in three panels of 16 columns
@pytest.mark.parametrize("at", range(len(COL)))
def test_every_entry_is_compared(threads, at, N, monkeypatch, tmp_path):
    """A write to any one column index (each read by one worker only) or any inner row pointer."""
    from bsrkit import tuning

    key = tuning.table_key(tuning.cpu_device_name(), "bsr_dense_mm", torch.float32, (SIZE, SIZE, N), (BS, BS))
    tuning.save_entries({key: {"panel": 16}}, tmp_path / "table.json")
    monkeypatch.setenv("BSRKIT_TUNING_TABLE", str(tmp_path / "table.json"))
    b, x = _bsr(), torch.randn(SIZE, N)
    _warm(b, x)
    col = b.col_indices().numpy()
    col[at] = (col[at] + 1) % GRID
    assert _check(b, x)[2] == 1
    r = 1 + at % (len(CROW) - 2)  # an inner row pointer, moved by one where that keeps it valid
    crow = b.crow_indices().numpy()
    crow[r] += 1 if crow[r] < crow[r + 1] else -1
    assert crow[r - 1] <= crow[r] <= crow[r + 1]
    assert _check(b, x)[2] == 1


def test_a_batched_pattern_written_in_its_second_batch_only(threads):
    b, x = _bsr(batch=(2,)), torch.randn(2, SIZE, 2)
    _warm(b, x)
    b.col_indices().numpy()[1, 7] = 0
    assert _check(b, x)[2] == 1
    b.crow_indices().numpy()[1, 3] = 6  # (and a row pointer of that batch)
    assert _check(b, x)[2] == 1
    assert _check(b, x) == (1, 1, 0)


def test_a_pattern_broadcast_over_batches_of_dense(threads):
    b, x = _bsr(), torch.randn(3, SIZE, 2)
    _warm(b, x)
    b.col_indices().numpy()[-1] = 1
    assert _check(b, x)[2] == 1


def test_with_out_the_output_is_written_again(threads):
    b, x = _bsr(), torch.randn(SIZE, 16)
    out = torch.empty(SIZE, 16)
    _check(b, x, out)
    assert _check(b, x, out) == (1, 1, 0)
    b.col_indices().numpy()[0] = 3
    assert _check(b, x, out)[2] == 1


def test_a_malformed_write_raises_on_the_next_product(threads):
    b, x = _bsr(), torch.randn(SIZE, 2)
    _warm(b, x)
    b.col_indices().numpy()[2] = GRID  # out of range
    before = bsrkit.shortcut_info().loop_stale
    with pytest.raises(ValueError, match=r"col_indices in \[0, 6\)"):
        bsrkit.bsr_dense_mm(b, x)
    assert bsrkit.shortcut_info().loop_stale == before + 1
    with pytest.raises(ValueError, match="malformed"):  # (and again: a malformed pattern is never kept)
        bsrkit.bsr_dense_mm(b, x)
    b.col_indices().numpy()[2] = 1
    _warm(b, x)
    b.crow_indices().numpy()[3] = 9  # a decrease after block row 3
    with pytest.raises(ValueError, match="non-decreasing"):
        bsrkit.bsr_dense_mm(b, x)
    assert bsrkit.shortcut_info().loop_stale == before + 2


def test_check_mode_0_compares_nothing_in_the_loop_either(threads, monkeypatch):
    b, x = _bsr(), torch.randn(SIZE, 2)
    _warm(b, x)
    monkeypatch.setenv("BSRKIT_CHECK_PLANS", "0")
    old = reference.bsr_dense_mm(b, x)
    b.col_indices().numpy()[0] = 3
    before = _counts()
    got = bsrkit.bsr_dense_mm(b, x)
    assert tuple(a - b for a, b in zip(_counts(), before, strict=True)) == (1, 0, 0)
    assert_close(got, old, k=SIZE)  # the old pattern's product: nothing was compared
    monkeypatch.setenv("BSRKIT_CHECK_PLANS", "auto")
    assert _check(b, x)[2] == 1


@pytest.mark.parametrize("how", ["transposed", "addmm"])
def test_other_products_keep_the_python_proof(threads, python_proofs, how):
    """The transposed product and products with an input take no deferred proof: a write is caught in
    Python, as before."""
    b = _bsr()
    x = torch.randn(SIZE, 2)

    def product() -> None:
        if how == "transposed":
            got, want = bsrkit.bsr_transposed_dense_mm(b, x), reference.bsr_transposed_dense_mm(b, x)
        else:
            inp = torch.ones(SIZE, 2)
            got, want = (
                bsrkit.bsr_dense_addmm(inp, b, x, beta=0.5),
                reference.bsr_dense_addmm(inp, b, x, beta=0.5),
            )
        assert_close(got, want, k=SIZE)

    for _ in range(2):
        product()
    proofs = bsrkit.shortcut_info().loop_proofs
    python_proofs.clear()
    b.col_indices().numpy()[5] = 2
    product()
    assert python_proofs and bsrkit.shortcut_info().loop_proofs == proofs


def test_an_empty_pattern_written_malformed_still_raises():
    """No stored block: no product runs, yet a kept operand whose pattern changed is judged again."""
    crow = torch.zeros(GRID + 1, dtype=torch.int64)
    b = torch.sparse_bsr_tensor(
        crow, torch.zeros(0, dtype=torch.int64), torch.zeros(0, BS, BS), size=(SIZE, SIZE)
    )
    x = torch.randn(SIZE, 2)
    for _ in range(2):
        assert torch.equal(bsrkit.bsr_dense_mm(b, x), torch.zeros(SIZE, 2))
    b.crow_indices().numpy()[2] = 1
    with pytest.raises(ValueError, match="malformed"):
        bsrkit.bsr_dense_mm(b, x)


def test_writes_racing_the_products_never_break_them(threads):
    """A thread writes two valid patterns in turn while products run (each may see either, or a mix: a
    write during a product has no defined result); no product fails, and once the writes stop the next
    one is right."""
    import threading

    b, x = _bsr(), torch.randn(SIZE, 2)
    _warm(b, x)
    col = b.col_indices().numpy()
    patterns = [np.array(COL), np.array(COL[::-1])]
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            col[:] = patterns[i % 2]
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    deadline = time.monotonic() + 10  # (the writer competes for the GIL: runs took 2-90 s for 300)
    try:
        for i in range(300):
            assert bsrkit.bsr_dense_mm(b, x).isfinite().all()
            if i >= 30 and time.monotonic() > deadline:
                break
    finally:
        stop.set()
        t.join()
    # (A plan built while the writer ran was derived from its snapshot's copy, so whatever bytes the
    # memory ends with, a hit serves their plan: test_freshness's writes undone during a derivation.)
    _check(b, x)
    assert _check(b, x) == (1, 1, 0)


@pytest.mark.parametrize("how", ["a new out layout", "int8", "inf alpha"])
def test_a_kept_operand_without_a_proving_call_is_proven_in_python(threads, monkeypatch, how):
    """A deferred proof whose product finds no prepared call that proves (a miss: another layout of out;
    the int8 and scaled paths, which recurse) makes the whole Python proof before anything else."""
    from bsrkit import ops

    proved: list[bool] = []
    real = dispatch._prove

    def spy(a: object) -> None:
        try:
            real(a)  # type: ignore[arg-type]
        except Exception:
            proved.append(False)
            raise
        proved.append(True)

    monkeypatch.setattr(dispatch, "_prove", spy)
    b = _bsr()
    x = torch.randn(SIZE, 2)
    if how == "int8":
        b = torch.sparse_bsr_tensor(
            b.crow_indices(), b.col_indices(), b.values().mul(4).to(torch.int8), size=(SIZE, SIZE)
        )
        x = torch.randint(-8, 8, (SIZE, 2), dtype=torch.int8)

    def product(out: torch.Tensor | None = None) -> None:
        if how == "inf alpha":  # (no public product has it without input=: the entry they share)
            inf = float("inf")
            got = ops.checked_addmm("bsr_dense_mm", None, b, x, beta=0.0, alpha=inf, out=None, meta=None)
            want = reference.bsr_dense_addmm(torch.zeros(SIZE, 2), b, x, beta=0, alpha=inf)
            torch.testing.assert_close(got, want, equal_nan=True)
        elif how == "int8":
            assert torch.equal(bsrkit.bsr_dense_mm(b, x), b.to_dense().int() @ x.int())
        else:
            got = bsrkit.bsr_dense_mm(b, x, out=out)
            assert_close(got, reference.bsr_dense_mm(b, x), k=SIZE)

    for _ in range(2):
        product()
    assert proved == ([] if how == "a new out layout" else [True])  # (the second product's)
    b.col_indices().numpy()[3] = 4
    stale = bsrkit.shortcut_info().loop_stale
    product(torch.empty(2, SIZE).mT if how == "a new out layout" else None)
    assert proved[-1] is False and bsrkit.shortcut_info().loop_stale == stale
    product()


@pytest.mark.parametrize("N", [1, 5])  # (the dot loop; the broadcast loop)
def test_the_vector_loops_keep_their_partial_sums_alive(threads, N):
    """16 x 16 blocks: a row's partial sums (2 KB and more) outgrow the allocator's per-thread cache, so
    memory freed early goes to the worker's next allocation. The loops write the sums through a pointer
    into their array, kept alive to the end (``intrinsics.keep_alive``): a loop that allocated after
    taking the pointer, without it, aborted here. Each product, repeated and after column writes (each
    rebuilding the pattern), is right."""
    from bsrkit.benchmarking import random_bsr_weight

    b, _ = random_bsr_weight(256, 16, 0.3, seed=5)
    crow, col = b.crow_indices().numpy(), b.col_indices().numpy()
    for row in range(6):
        x = torch.randn(256, N)
        assert_close(bsrkit.bsr_dense_mm(b, x), reference.bsr_dense_mm(b, x), k=256)
        # (the row's blocks in reverse column order: a valid pattern, moving no version counter)
        col[crow[row] : crow[row + 1]] = col[crow[row] : crow[row + 1]][::-1].copy()


def test_keep_alive_holds_an_array_addressed_by_a_pointer():
    """What the vector loops rely on (see ``intrinsics.keep_alive``): without a later use, numba frees an
    array after its last use as an array, and the next allocation takes its memory."""
    import numba

    from bsrkit.backends.cpu.compiled.intrinsics import keep_alive

    def reuses(keep: bool) -> int:
        @numba.njit
        def allocate_after(n):  # type: ignore[no-untyped-def]
            first = np.full(n, 1.0)
            address = first.ctypes.data
            k = 0
            while k < n:  # (a later block: first's last use is behind it)
                k += 1
            same = 0  # (allocations that got first's memory)
            for _ in range(8):
                other = np.empty(n, np.float64)
                same += address == other.ctypes.data
            if keep:
                keep_alive(first)
            return same

        return int(allocate_after(256))

    assert reuses(keep=False) > 0  # (the hazard is real here: else this test shows nothing)
    assert reuses(keep=True) == 0
