"""Fast CPU kernel for ``out[b] (+)= alpha * bsr[b] @ dense[b]``: a compiled loop that calls BLAS gemm.

Work split: the output is cut into *tasks*, one per (batch, panel of ``panel`` columns, block row), in
that order. A task's cost is its row's block count plus a small overhead (the plan's prefix sums,
:func:`bsrkit.backends.cpu.planning.cpu_mm_plan`); each of the ``nthreads`` workers takes one contiguous run of tasks of
about equal cost, found by binary search inside the kernel. Tasks write disjoint output tiles, so no
reduction is needed; and since a run is panel-major, each worker mostly reads its own columns of
``dense`` (threads splitting N, as a dense gemm does), while small products still split evenly over rows.
Inside a task each block is one gemm with beta=1 (beta=0 for the row's first block when overwriting)
straight into the strided output tile: no temporaries, no Python per block, BLAS single-threaded per
worker where the provider allows it (MKL's ``mkl_set_num_threads_local``).

Each operand is passed as (address, per-batch element offsets, row stride, col stride). The caller
guarantees that one of the two strides of every matrix is 1 (see :func:`blas_layout`); the gemm
transpose flags and leading dimensions follow from which one.

Float16/bfloat16 use MKL's ``gemm_{bf16bf16,f16f16}f32``: half inputs, a float32 output buffer, float32
accumulation. Which kinds run depends on the BLAS provider (:func:`supported_kinds`; see
:mod:`bsrkit.backends.cpu.blas`). This module never validates tensors or caches plans (see ``bsrkit.ops``).

The loops themselves are in :mod:`bsrkit.backends.cpu.compiled`, compiled once per machine and cached on
disk (numba's ``cache=True``). Each takes one record of its arguments (a ``NamedTuple`` beside the loop,
``kernel.Args``), which the backend fills by name; the BLAS addresses travel as its last fields, filled in
by the callables returned here. Importing this module imports neither numba nor the BLAS.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bsrkit.backends.cpu.blas import BLASProvider, blas_provider
from bsrkit.backends.cpu.compiled.constants import (
    DOT_COLUMNS,
    DOT_NONE,
    DOT_PAIRS,
    KIND_BF16,
    KIND_F16,
    KIND_F32,
    KIND_F64,
)
from bsrkit.loading import import_module, off_main_thread

__all__ = [
    "DOT_COLUMNS",
    "DOT_NONE",
    "DOT_PAIRS",
    "KIND_BF16",
    "KIND_F16",
    "KIND_F32",
    "KIND_F64",
    "blas_layout",
    "bsr_mm_kernel",
    "bsr_mm_small_kernel",
    "compile_cache_info",
    "data_addresses",
    "data_patcher",
    "sampled_kernel",
    "scatter_mm_kernel",
    "single_thread_mnk",
    "supported_kinds",
    "threading_layer",
]

_KIND_NAMES = {KIND_F32: "float32", KIND_F64: "float64", KIND_BF16: "bfloat16", KIND_F16: "float16"}


def blas_layout(row_stride: int, col_stride: int, rows: int, cols: int) -> tuple[bool, int] | None:
    """(row_major, leading_dimension) under which BLAS can read a strided matrix, or None.

    BLAS needs unit stride along one dimension and a leading dimension at least the other extent;
    dimensions of size <= 1 may have any stride.
    """
    if col_stride == 1 or cols <= 1:
        ld = row_stride if rows > 1 else max(cols, 1)
        if ld >= max(cols, 1):
            return True, ld
    if row_stride == 1 or rows <= 1:
        ld = col_stride if cols > 1 else max(rows, 1)
        if ld >= max(rows, 1):
            return False, ld
    return None


def supported_kinds() -> frozenset[int]:
    """The ``KIND_*`` values the current BLAS provider can run; empty when there is no provider.

    MKL runs all four; SciPy's BLAS has no half gemm, so bfloat16/float16 need another backend there.
    """
    provider = blas_provider()
    if provider is None:
        return frozenset()
    if provider.has_half:
        return frozenset((KIND_F32, KIND_F64, KIND_BF16, KIND_F16))
    return frozenset((KIND_F32, KIND_F64))


# GNU OpenMP cannot run in a process forked from one that used it; numba terminates the child. There the
# kernels run their serial twins, which never touch the threading layer (see compiled.entries).
_forked = False


def in_forked_child() -> bool:
    """True in a process forked from one that may have started numba's threads: only serial loops run."""
    return _forked


def _mark_forked() -> None:
    global _forked
    _forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_forked)


def threading_layer() -> str | None:
    """numba's active threading layer (``"workqueue"``, ``"omp"``, ``"tbb"``), or None before the first
    parallel kernel ran."""
    if "numba" not in sys.modules:
        return None
    import numba

    try:
        return str(numba.threading_layer())
    except ValueError:  # no parallel code ran yet
        return None


def _bind(
    name: str,
    compiled: Any,
    serial: Any,
    record: type[Any],
    provider: BLASProvider,
    limit_calls: Callable[[Any, int], Any] | None = None,
) -> Callable[..., None]:
    """``compiled`` taking its argument ``record``, with the provider's addresses filled in, after checking
    the kind.

    Records are normalised to one signature per kernel (``alpha`` a float, arrays C-contiguous): a second
    signature would cost a second compile, and two processes compiling *different* signatures at once
    could mislabel each other's entries in numba's cache index. ``limit_calls(record, mnk)`` keeps each
    gemm call at or below the provider's ``single_thread_mnk`` (when it has one): it returns the record
    with the fields that do so replaced.
    """
    kinds = supported_kinds()
    addresses = {
        "sgemm": provider.sgemm, "dgemm": provider.dgemm, "gemm_bf16": provider.gemm_bf16,
        "gemm_f16": provider.gemm_f16, "set_threads": provider.set_num_threads_local,
    }  # fmt: skip
    arrays = _array_fields(record)

    def prepare(args: Any) -> Any:
        """The compiled kernel's full record (checked, normalised, addresses filled in), for
        :func:`run_prepared`; a caller may then replace its data addresses (:func:`data_patcher`)."""
        if not isinstance(args, record):
            raise TypeError(f"{name}(): expected a {record.__name__}, got {type(args).__name__}")
        if args.kind not in kinds:
            raise ValueError(
                f"{name}(): expected a kind in {sorted(_KIND_NAMES[k] for k in kinds)} (BLAS provider "
                f"{provider.name!r}), got {_KIND_NAMES.get(args.kind, args.kind)}"
            )
        full = args._replace(alpha=float(args.alpha), **addresses, **_contiguous(args, arrays))
        return full if limit_calls is None else limit_calls(full, provider.single_thread_mnk)

    def run_prepared(full: Any) -> None:
        # One thread, or a forked child (GNU OpenMP cannot run there): the serial twin, no parallel region.
        kernel = serial if full.nthreads == 1 or _forked else compiled
        ensure_compiled(kernel, full, full.kind)  # (one signature per kind: see above)
        kernel(*full)

    def run(args: Any) -> None:
        run_prepared(prepare(args))

    run.__name__ = run.__qualname__ = name
    run.prepare = prepare  # type: ignore[attr-defined]
    run.run_prepared = run_prepared  # type: ignore[attr-defined]
    run.serial = serial  # type: ignore[attr-defined]
    run.Args = record  # type: ignore[attr-defined]
    return run


def _array_fields(record: type[Any]) -> tuple[str, ...]:
    """The names of ``record``'s array fields (normalised to C-contiguous)."""
    kinds = import_module("bsrkit.backends.cpu.compiled.support")
    return tuple(
        name
        for name, kind in zip(record._fields, kinds.field_kinds(record), strict=True)
        if kind in kinds.ARRAY_KINDS
    )


def _contiguous(args: Any, arrays: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The array fields of ``args`` that are not C-contiguous, as C-contiguous copies."""
    return {f: np.ascontiguousarray(a) for f in arrays if not (a := getattr(args, f)).flags.c_contiguous}


def data_patcher(full: Any) -> Callable[[int, int, int], Any]:
    """``patch(a, b, c)``: the prepared record ``full`` with other data addresses (blocks, dense, out: its
    :data:`~.compiled.support.Address` fields), for a kept call (the positions found once, here)."""
    record: Any = type(full)
    a_at, b_at, c_at = _data_fields(record)
    values = list(full)
    make = record._make

    def patch(a: int, b: int, c: int) -> Any:
        args = values.copy()  # (another thread may run the same call: patch a copy)
        args[a_at], args[b_at], args[c_at] = a, b, c
        return make(args)

    return patch


def data_addresses(full: Any) -> tuple[int, int, int]:
    """The data addresses (blocks, dense, out) of a record."""
    record: Any = type(full)
    a, b, c = _data_fields(record)
    return full[a], full[b], full[c]


@functools.cache
def _data_fields(record: Any) -> tuple[int, int, int]:
    """The positions of ``record``'s three :data:`~.compiled.support.Address` fields."""
    kinds = import_module("bsrkit.backends.cpu.compiled.support").field_kinds(record)
    a, b, c = (i for i, kind in enumerate(kinds) if kind == "a")
    return a, b, c


_compiled: set[tuple[int, Any]] = set()


def ensure_compiled(dispatcher: Any, args: Sequence[Any], key: Any) -> None:
    """Before the first call of a compiled loop with arguments of kind ``key``: load (or compile) its
    machine code off the main thread (see :mod:`bsrkit.loading`; a Ctrl-C inside numba's compile would
    leave llvmlite's lock held). Later calls: one set lookup."""
    if (id(dispatcher), key) in _compiled or not hasattr(dispatcher, "overloads"):
        return  # (done; or not a numba dispatcher: the C entries compile off the main thread themselves)
    numba = import_module("numba")
    off_main_thread(dispatcher.compile, tuple(numba.typeof(a) for a in args))
    _compiled.add((id(dispatcher), key))


def _loops() -> Any:
    """The compiled loops (:mod:`.compiled.entries` and the modules it imports), imported at the first
    product (importing numba costs ~0.3 s; loading or compiling the loops, seconds), off the main thread
    (see :mod:`bsrkit.loading`)."""
    return import_module("bsrkit.backends.cpu.compiled.entries")


@functools.cache
def bsr_mm_kernel() -> Any:  # Callable[..., None] | None
    """The kernel for ``out[b] (+)= alpha * bsr[b] @ dense[b]`` (compiled, or loaded from the on-disk
    cache, at the first call); None when no BLAS provider exists. Takes a :class:`.compiled.gemm.BsrMMArgs`
    (``.Args``)."""
    provider = blas_provider()
    if provider is None:
        return None
    loops = _loops()

    def limit_panel(args: Any, mnk: int) -> Any:
        if mnk:  # each gemm is (Ms x panel) += (Ms x Ks) @ (Ks x panel)
            return args._replace(panel=max(1, min(args.panel, mnk // max(args.Ms * args.Ks, 1))))
        return args

    record = import_module("bsrkit.backends.cpu.compiled.gemm").BsrMMArgs
    return _bind("bsr_mm_kernel", loops.bsr_mm, loops.bsr_mm_serial, record, provider, limit_panel)


@functools.cache
def bsr_mm_small_kernel() -> Any:  # Callable[..., None] with .prepare and .run_prepared
    """The kernel for ``out[b] (+)= alpha * bsr[b] @ dense[b]`` with few columns (float32/float64): vector
    loops over each block row, no BLAS call (a gemm per block costs more to call than it computes there).
    Takes a :class:`.compiled.small.BsrMMSmallArgs` (``.Args``).

    Same tasks and work split as :func:`bsr_mm_kernel` (one panel). ``dense`` arrives as ``X``, copied
    zero-padded to ``Wp`` columns where its layout is not the one read: ``dot`` = ``DOT_COLUMNS`` (``Wp`` 1,
    2 or 4, Ks a multiple of the vector lanes, blocks with unit column stride) reads X as ``(Wp, K)`` rows,
    dot products along k; ``DOT_PAIRS`` is the same for ``Wp = 2`` reading a row-major ``(K, 2)`` X (dense
    as it is); ``DOT_NONE``: X is ``(K, Wp)`` (``Wp`` a multiple of the lanes) and each element of a block
    is broadcast against a row of X. ``x_ld`` is X's leading dimension; blocks and output are read and
    written through any strides, the output only in its ``N`` columns.
    """
    loops = _loops()
    record = import_module("bsrkit.backends.cpu.compiled.small").BsrMMSmallArgs
    arrays = _array_fields(record)

    def prepare(args: Any) -> Any:
        if not isinstance(args, record):
            raise TypeError(f"bsr_mm_small_kernel(): expected a {record.__name__}, got {type(args).__name__}")
        return args._replace(alpha=float(args.alpha), **_contiguous(args, arrays))

    def run_prepared(full: Any) -> None:
        kernel = loops.bsr_mm_small_serial if full.nthreads == 1 or _forked else loops.bsr_mm_small
        kernel(*full)

    def run(args: Any) -> None:
        run_prepared(prepare(args))

    run.prepare = prepare  # type: ignore[attr-defined]
    run.run_prepared = run_prepared  # type: ignore[attr-defined]
    run.serial = loops.bsr_mm_small_serial  # type: ignore[attr-defined]
    run.Args = record  # type: ignore[attr-defined]
    return run


@functools.cache
def sampled_kernel() -> Any:  # Callable[..., None] | None
    """The SDDMM kernel: ``C[b, g] = alpha * A[b, rows[g]] @ B[b, :, cols[g]]``; takes a
    :class:`.compiled.sampled.SampledArgs` (``.Args``).

    One gemm per stored block with the full inner dimension K (no gathered copies); blocks are split
    evenly over the worker threads (every block costs the same). ``C`` is ``(B, nnz, Ms, Ns)``
    contiguous (float32 for half inputs). None when no BLAS provider exists.
    """
    provider = blas_provider()
    if provider is None:
        return None
    loops = _loops()

    def k_chunk(args: Any, mnk: int) -> Any:
        K = args.K  # each gemm is (Ms x Ns) (+)= (Ms x k) @ (k x Ns), over chunks k of K
        return args._replace(k_chunk=max(1, min(K, mnk // max(args.Ms * args.Ns, 1))) if mnk else max(K, 1))

    record = import_module("bsrkit.backends.cpu.compiled.sampled").SampledArgs
    return _bind("sampled_kernel", loops.sampled, loops.sampled_serial, record, provider, k_chunk)


@functools.cache
def scatter_mm_kernel() -> Any:  # Callable[..., None] | None
    """The ``scatter_mm`` kernel: ``C[b, tile] += alpha * sum over the tile's pairs of A[p] @ B[b, q]``;
    takes a :class:`.compiled.scatter.ScatterMMArgs` (``.Args``).

    Driven by a :class:`bsrkit.backends.cpu.planning.CpuScatterPlan`: ``tiles`` (T, 5) = (matrix, row, column, first
    pair, end pair) of each output tile of C; ``pairs`` (G, 4) = (block p, matrix, row, column) of B;
    ``tasks`` (S, 3) = (tile, column offset, width) and ``cum`` their cost prefix sums. Element offsets
    are ``boff[b] + moff[matrix] + row * rs + column * cs``. Each worker takes one contiguous run of
    (batch, task) of about equal cost; each pair is one gemm ``(Ms x w) += (Ms x Ks) @ (Ks x w)`` into
    the strided tile (``overwrite``: ``=`` for a tile's first pair, and tiles without pairs written 0).
    Tasks must write disjoint tiles unless ``nthreads`` is 1. None when no BLAS provider exists.
    """
    provider = blas_provider()
    if provider is None:
        return None
    loops = _loops()
    record = import_module("bsrkit.backends.cpu.compiled.scatter").ScatterMMArgs
    return _bind("scatter_mm_kernel", loops.scatter_mm, loops.scatter_mm_serial, record, provider)


def single_thread_mnk() -> int:
    """Up to which ``m * n * k`` one gemm call of the BLAS provider stays single-threaded (0: any)."""
    provider = blas_provider()
    return 0 if provider is None else provider.single_thread_mnk


def compile_cache_info() -> dict[str, dict[str, Any]]:
    """Per compiled kernel: on-disk cache ``path`` (None: compiled in memory only), ``hits`` (loaded from
    the cache) and ``misses`` (compiled) in this process. Empty before the first CPU product."""
    jit = sys.modules.get("bsrkit.backends.cpu.compiled.entries")
    if jit is None:
        return {}
    info = {}
    for name, dispatcher in jit.DISPATCHERS.items():
        stats = dispatcher.stats
        info[name] = {
            "path": stats.cache_path,
            "hits": sum(stats.cache_hits.values()),
            "misses": sum(stats.cache_misses.values()),
        }
    return info
