"""Helpers shared by the demo and the benchmark scripts: timing medians and random BSR weights."""

from __future__ import annotations

import contextlib
import ctypes
import statistics
import time
from collections.abc import Callable

import torch

from bsrkit.validation import check_size, kept_blocks

__all__ = [
    "last_level_cache_bytes",
    "median_seconds",
    "min_seconds",
    "peak_rss_mib",
    "random_bsr_weight",
    "streamed_copies",
]

# Without a known last-level cache size, copies for a streamed timing span this much (above the L3 of the
# servers measured here: 48 MiB).
_STREAM_FALLBACK_BYTES = 256 << 20
_STREAM_MAX_COPIES = 1024


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, after one warm-up call (compile, caches)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def seconds_per_call(fn: Callable[[], object], calls: int) -> float:
    """Mean seconds per call of ``fn`` over ``calls`` back-to-back calls (one timed loop)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def _rss_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _return_free_memory() -> None:
    """Give the C allocator's free memory back to the system (glibc's ``malloc_trim``; elsewhere nothing):
    after a first call's temporaries were freed, glibc keeps them resident and reuses them, so a later
    call's peak resident memory would not show its own temporaries (measured: 45 MiB, then 3)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def peak_rss_mib(fn: Callable[[], object]) -> float | None:
    """Peak resident memory one call of ``fn()`` adds (MiB): the allocator's free memory is returned
    (:func:`_return_free_memory`) and the process's peak RSS reset through ``/proc/self/clear_refs``
    first. None where that is unavailable (not Linux)."""
    _return_free_memory()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    except OSError:
        return None
    before = _rss_kib("VmRSS")
    fn()
    peak = _rss_kib("VmHWM")
    if before is None or peak is None:
        return None
    return (peak - before) / 1024


def min_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of ``repeats`` calls of ``fn()`` (after a warm-up call): on a shared machine, the calls nobody
    preempted."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def random_block_mask(grid: tuple[int, int], density: float, generator: torch.Generator) -> torch.Tensor:
    """A bool ``grid`` of blocks with exactly the density's share set (:func:`~bsrkit.validation.
    kept_blocks`), at least one (a draw of none timed a product that computes nothing), at random."""
    count = grid[0] * grid[1]
    mask = torch.zeros(count, dtype=torch.bool)
    mask[torch.randperm(count, generator=generator)[: max(1, kept_blocks(density, count))]] = True
    return mask.reshape(grid)


def random_bsr_weight(
    n: int, blocksize: int, density: float, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """An n x n float32 BSR matrix with ``density`` of its blocks stored (:func:`random_block_mask`), and
    its dense twin."""
    n, blocksize = (
        check_size("random_bsr_weight", "n", n),
        check_size("random_bsr_weight", "blocksize", blocksize),
    )
    if blocksize < 1 or n % blocksize:
        raise ValueError(
            f"random_bsr_weight(): expected a blocksize >= 1 that divides n, got n == {n}, "
            f"blocksize == {blocksize}"
        )
    g = torch.Generator().manual_seed(seed)
    nb = n // blocksize
    mask = random_block_mask((nb, nb), density, g)
    full = mask.repeat_interleave(blocksize, 0).repeat_interleave(blocksize, 1)
    dense = torch.randn((n, n), generator=g) * full
    return dense.to_sparse_bsr((blocksize, blocksize)), dense


DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def run_point(
    op: str, n: int, blocksize: int, density: float, dtype: torch.dtype, repeats: int, seed: int = 0
) -> dict[str, object]:
    """One grid point: median seconds of bsrkit, torch native BSR and dense, measured in one run.

    ``op`` is ``"mm"`` (``bsr @ dense``), ``"addmm"`` (``input + bsr @ dense``) or ``"sampled"``
    (``sampled_addmm``; torch native is ``torch.sparse.sampled_addmm`` on the CSR of the same elements,
    dense is the full ``x @ y``); all n x n.
    """
    import bsrkit

    bsr, w = random_bsr_weight(n, blocksize, density, seed)
    bsr, w = bsr.to(dtype), w.to(dtype)
    x = torch.randn((n, n), generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    # (every contender allocates its result, as torch's must: a preallocated out= for bsrkit alone would
    # time less work than its peers')
    if op == "mm":
        ours = lambda: bsrkit.bsr_dense_mm(bsr, x)  # noqa: E731
        native = lambda: bsr @ x  # noqa: E731
        dense = lambda: w @ x  # noqa: E731
    elif op == "addmm":
        c = torch.randn((n, n)).to(dtype)
        ours = lambda: bsrkit.bsr_dense_addmm(c, bsr, x)  # noqa: E731
        native = lambda: torch.addmm(c, bsr, x)  # noqa: E731
        dense = lambda: torch.addmm(c, w, x)  # noqa: E731
    elif op == "sampled":
        y = torch.randn((n, n), generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
        csr = w.to_sparse_csr()  # torch's sampled_addmm takes CSR: the same stored elements
        ours = lambda: bsrkit.sampled_addmm(bsr, x, y, beta=0.0)  # noqa: E731
        native = lambda: torch.sparse.sampled_addmm(csr, x, y, beta=0.0)  # noqa: E731
        dense = lambda: x @ y  # noqa: E731
    else:
        raise ValueError(f"run_point(): expected op in ('mm', 'addmm', 'sampled'), got {op!r}")
    t_ours = median_seconds(ours, repeats)
    try:
        t_native: float | None = median_seconds(native, repeats)
    except (NotImplementedError, RuntimeError):  # torch has no CPU kernel for half types: "n/a"
        t_native = None
    t_dense = median_seconds(dense, repeats)
    flop = 2 * bsr._nnz() * blocksize * blocksize * n
    return {
        "op": op,
        "n": n,
        "blocksize": blocksize,
        "density": density,
        "dtype": str(dtype).removeprefix("torch."),
        "nnz_blocks": bsr._nnz(),
        "bsrkit_s": t_ours,
        "native_s": t_native,
        "dense_s": t_dense,
        "x_native": t_native / t_ours if t_native is not None else None,
        "x_dense": t_dense / t_ours,
        "gflops": flop / t_ours / 1e9,
        "native_gflops": flop / t_native / 1e9 if t_native is not None else None,
        "dense_gflops": 2 * n**3 / t_dense / 1e9,
    }


def last_level_cache_bytes() -> int | None:
    """The size of CPU 0's largest cache (Linux sysfs), or None where it cannot be read."""
    import glob

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else None


def streamed_copies(bsr: torch.Tensor) -> list[torch.Tensor]:
    """``bsr`` and copies of it (own index and value memory each) whose stored bytes together span four
    times the last-level cache (or 256 MiB where its size is unknown): a product timed round-robin over
    them reads its weight from memory, as each layer of a model's decode step does, not from a cache that
    one repeated weight stays in. At most ``_STREAM_MAX_COPIES`` copies: a weight of a few KiB is timed on
    fewer (its call's fixed cost outweighs where its bytes come from)."""
    span = 4 * (last_level_cache_bytes() or _STREAM_FALLBACK_BYTES // 4)
    parts = (bsr.crow_indices(), bsr.col_indices(), bsr.values())
    nbytes = max(1, sum(t.numel() * t.element_size() for t in parts))
    count = min(_STREAM_MAX_COPIES, max(1, -(-span // nbytes)))
    copies = [bsr]
    for _ in range(count - 1):
        crow, col, values = (t.clone() for t in parts)
        copies.append(torch.sparse_bsr_tensor(crow, col, values, size=bsr.shape, check_invariants=False))
    return copies


def format_table(rows: list[dict[str, object]]) -> str:
    """The rows of :func:`run_point` as an aligned text table."""
    header = (
        f"{'op':>7} {'dtype':>8} {'n':>5} {'bs':>3} {'density':>7} | {'bsrkit ms':>9} {'native ms':>9} "
        f"{'dense ms':>9} | {'x native':>8} {'x dense':>7} | {'GF/s':>6} {'nativeGF':>8} {'denseGF':>7}"
    )
    lines = [header, "-" * len(header)]

    def cell(value: object, width: int, digits: int, scale: float = 1.0) -> str:
        return f"{'n/a':>{width}}" if value is None else f"{float(value) * scale:>{width}.{digits}f}"  # type: ignore[arg-type]

    for r in rows:
        lines.append(
            f"{r['op']:>7} {r['dtype']:>8} {r['n']:>5} {r['blocksize']:>3} {r['density']:>7.4g} | "
            f"{cell(r['bsrkit_s'], 9, 2, 1e3)} {cell(r['native_s'], 9, 2, 1e3)} "
            f"{cell(r['dense_s'], 9, 2, 1e3)} | {cell(r['x_native'], 8, 2)} {cell(r['x_dense'], 7, 2)} | "
            f"{cell(r['gflops'], 6, 1)} {cell(r['native_gflops'], 8, 1)} {cell(r['dense_gflops'], 7, 1)}"
        )
    return "\n".join(lines)
