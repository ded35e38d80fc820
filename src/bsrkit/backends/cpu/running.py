"""Running the compiled loops: one call at a time (:data:`KERNEL_LOCK`) on numba's worker threads, and the
prepared calls the CPU backend returns (:func:`prepared`), with their in-loop proof of the index data."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import bsrkit.backends.cpu.kernels as kernels
from bsrkit.loading import import_module
from bsrkit.validation import unallocated

if TYPE_CHECKING:
    from bsrkit.operand import Operand

__all__ = ["KERNEL_LOCK", "Rerun", "live_indices", "prepared", "run", "set_numba_threads"]

# numba's default (workqueue) threading layer must not be entered from two threads at once; the kernel
# already uses every worker thread, so serialising calls costs little.
KERNEL_LOCK = threading.Lock()


def _fresh_lock_in_child() -> None:
    # A forked child has only the forking thread: a lock another thread of the parent held at the fork
    # would stay held for ever (the child's first product hung).
    global KERNEL_LOCK
    KERNEL_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock_in_child)

# A prepared call: ``rerun(values, dense, out, prove=False)`` runs a product with the layouts it was
# prepared for (see bsrkit.backends.base.Backend.addmm: with ``rerun.proves``, ``prove=True`` also compares
# the operand's index data in the loop and returns how many entries differ).
Rerun = Callable[..., Any]


def released(*bases: int) -> RuntimeError:
    """:func:`~bsrkit.validation.unallocated` for the operands of a prepared call whose storage base is
    address 0 (released: the loop would read or write there)."""
    names = ("blocks", "dense operand", "output")
    return unallocated(" and ".join(name for name, base in zip(names, bases, strict=True) if not base))


def prepared(
    kernel: Any,
    full_args: Any,
    values: torch.Tensor,
    dense: torch.Tensor,
    out: torch.Tensor,
    fill: Callable[[torch.Tensor], None] | None = None,
) -> Rerun:
    """The prepared call of the marshaled record ``full_args``: it patches in the data addresses (each
    relative to its operand's data: the operands were passed uncopied, so their storages are the ones
    addressed). A serial call holds the packed block of its C entry (see
    ``compiled.entries.PackedEntry``), which addresses the arrays of ``full_args``: the call holds both.
    The caller keeps it (:mod:`bsrkit.shortcuts`); the backend does not.

    ``fill``: the record addresses a copy of dense (a buffer of the layout the loop reads, which ``fill``
    holds): each call first fills it with its dense operand, under the kernel lock with the loop (two
    threads may run one call), and the record's dense address stays.

    ``rerun.proves``: the record addresses the operand's live index memory (``crow_live``, see
    :class:`.compiled.small.BsrMMSmallArgs`), so ``rerun(..., prove=True)`` compares it in the loop with
    the plan the call runs on and returns the number of differing entries (the flag and the count travel
    in the record's ``proof`` array, set and read under the kernel lock)."""
    a_addr, b_addr, c_addr = kernels.data_addresses(full_args)
    values_at = values.data_ptr() - a_addr
    dense_at = dense.data_ptr() - b_addr if fill is None else None  # (None: the kept copy's, b_addr)
    out_offset = out.data_ptr() - c_addr
    dense_offset = int(dense.storage_offset()) * dense.element_size()  # (a filled call's check of dense)
    proof = getattr(full_args, "proof", None)
    # (a memoryview: item access ~3x cheaper than numpy's)
    flag = memoryview(proof) if proof is not None and full_args.crow_live != 0 else None
    proves = flag is not None
    rerun: Rerun
    # ``at(values address, dense address, out address, prove)``: the call by data addresses, for a caller
    # that has them without the tensors (the layer's direct rerun); None where each call fills a copy of
    # dense, which needs the tensor.
    at: Callable[..., int] | None = None
    d_at = 0 if dense_at is None else dense_at
    nthreads = full_args.nthreads
    if fill is None and nthreads == 1:
        block = kernel.serial.pack(full_args)
        c_call, address = kernel.serial.c_call, block.ctypes.data

        if flag is not None:  # (the common decode call: fewest branches)

            def at(a_addr: int, b_addr: int, c_addr: int, prove: bool = False) -> int:
                a, b, c = a_addr - values_at, b_addr - d_at, c_addr - out_offset
                if not (a and b and c):
                    raise released(a, b, c)
                with KERNEL_LOCK:
                    flag[0] = prove
                    c_call(address, a, b, c)
                    return flag[1]

        else:

            def at(a_addr: int, b_addr: int, c_addr: int, prove: bool = False) -> int:
                a, b, c = a_addr - values_at, b_addr - d_at, c_addr - out_offset
                if not (a and b and c):
                    raise released(a, b, c)
                with KERNEL_LOCK:
                    c_call(address, a, b, c)
                    return 0

        at.keep = (block, full_args)  # type: ignore[attr-defined]  # (what the block addresses)

    elif fill is None:
        patch, run_prepared = kernels.data_patcher(full_args), kernel.run_prepared

        def at(a_addr: int, b_addr: int, c_addr: int, prove: bool = False) -> int:
            a, b, c = a_addr - values_at, b_addr - d_at, c_addr - out_offset
            if not (a and b and c):
                raise released(a, b, c)
            args = patch(a, b, c)
            with KERNEL_LOCK:
                if flag is not None:
                    flag[0] = prove
                set_numba_threads(nthreads)
                run_prepared(args)
                return 0 if flag is None else flag[1]

    if at is not None:
        at_addresses = at

        def rerun(values: torch.Tensor, dense: torch.Tensor, out: torch.Tensor, prove: bool = False) -> int:
            return at_addresses(values.data_ptr(), dense.data_ptr(), out.data_ptr(), prove)

    elif nthreads == 1:  # a serial call on a copy of dense (``fill``)
        block = kernel.serial.pack(full_args)
        c_call, address = kernel.serial.c_call, block.ctypes.data

        def rerun(values: torch.Tensor, dense: torch.Tensor, out: torch.Tensor, prove: bool = False) -> int:
            a_addr, c_addr = values.data_ptr() - values_at, out.data_ptr() - out_offset
            d = dense.data_ptr() - dense_offset  # (fill copies dense with torch's copy_, which crashes on 0)
            if not (a_addr and d and c_addr):
                raise released(a_addr, d, c_addr)
            with KERNEL_LOCK:
                assert fill is not None
                fill(dense)
                if flag is not None:
                    flag[0] = prove
                c_call(address, a_addr, b_addr, c_addr)
                return 0 if flag is None else flag[1]

        rerun.keep = (block, full_args)  # type: ignore[attr-defined]

    else:  # a parallel call on a copy of dense
        patch, run_prepared = kernels.data_patcher(full_args), kernel.run_prepared

        def rerun(values: torch.Tensor, dense: torch.Tensor, out: torch.Tensor, prove: bool = False) -> int:
            a_addr, c_addr = values.data_ptr() - values_at, out.data_ptr() - out_offset
            d = dense.data_ptr() - dense_offset
            if not (a_addr and d and c_addr):
                raise released(a_addr, d, c_addr)
            args = patch(a_addr, b_addr, c_addr)
            with KERNEL_LOCK:
                assert fill is not None
                fill(dense)
                if flag is not None:
                    flag[0] = prove
                set_numba_threads(nthreads)
                run_prepared(args)
                return 0 if flag is None else flag[1]

    rerun.proves = proves  # type: ignore[attr-defined]
    rerun.at = at  # type: ignore[attr-defined]
    return rerun


def live_indices(a: Operand, crow: np.ndarray, col: np.ndarray) -> tuple[int, int, bool]:
    """``(crow address, col address, int64)`` of ``a``'s index memory, for the in-loop proof of a
    prepared call on the plan ``crow``, ``col`` (see :class:`.compiled.small.BsrMMSmallArgs`); ``(0, 0,
    True)`` where the loop cannot compare it: a transposed operand (its plan is another pattern's), indices
    not on the CPU, not C-contiguous, not int64/int32 (both alike) or not of the plan's extent."""
    c, k = a.crow, a.col
    if (
        a.transposed_block_cols
        or c.dtype not in (torch.int64, torch.int32)
        or k.dtype is not c.dtype
        or c.device.type != "cpu"
        or k.device.type != "cpu"
        or not (c.is_contiguous() and k.is_contiguous())
        or c.numel() != crow.size
        or k.numel() != col.size
    ):
        return 0, 0, True
    return c.data_ptr(), k.data_ptr(), c.dtype is torch.int64


_numba_threads = threading.local()  # numba's thread count is per calling thread: remember what we set


def set_numba_threads(n: int) -> None:
    if getattr(_numba_threads, "n", None) != n:
        numba = import_module("numba")
        _launch_numba_threads()
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        _numba_threads.n = n


@functools.cache
def _launch_numba_threads() -> None:
    """Start numba's worker pool, keeping torch's thread count.

    numba's OpenMP layer starts its pool with ``omp_set_num_threads(NUMBA_NUM_THREADS)``, and torch's CPU
    wheels load the same ``libgomp.so.1``: the process-wide count torch reads (``torch.get_num_threads()``)
    and uses for its own ops would silently become numba's (measured: 1 -> 2 after the first product). The
    pool is started here, once, and torch's count put back.
    """
    parallel = import_module("numba.np.ufunc.parallel")  # (the first product's: see bsrkit.loading)
    threads = torch.get_num_threads()
    parallel._launch_threads()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def run(kernel: Any, nthreads: int, *args: Any) -> None:
    """Call a compiled loop on ``nthreads`` numba threads, one call at a time (see ``KERNEL_LOCK``)."""
    with KERNEL_LOCK:
        set_numba_threads(nthreads)
        if hasattr(kernel, "overloads"):  # a numba dispatcher (its kind: the dtypes of its arrays)
            kernels.ensure_compiled(kernel, args, tuple(a.dtype.char for a in args if hasattr(a, "dtype")))
        kernel(*args)
