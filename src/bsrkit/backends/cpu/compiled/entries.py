# mypy: disable-error-code="call-arg,var-annotated"
# (mypy cannot type what the intrinsics return.)
"""The serial twins of the loops, the C entries of the bsr @ dense ones, and ``DISPATCHERS``.

**Threading layer.** numba's default (GNU OpenMP on Linux wheels): it starts a parallel region in
microseconds, where ``workqueue`` took ~0.1-0.2 ms per call (figures in docs/performance.md). GNU OpenMP
cannot run in a process forked after the first product ("fork() called from a process already using GNU
OpenMP"), so in a forked child the kernels run their serial twins (``*_serial``: the same loop compiled
without a parallel region, :func:`.support.serial_copy`; :mod:`bsrkit.backends.cpu.kernels` picks them),
which never touch the threading layer. The twins also run every product too small to pay for starting the
worker threads. Callers serialise kernel calls with a lock (not every layer is thread-safe).

**C entries.** A tiny product takes tens of microseconds, and numba's dispatcher, which types and unboxes
each of a loop's 25-36 arguments on every call, took ~2 µs of it. So the serial twins of ``bsr_mm`` and
``bsr_mm_small`` are C functions (numba ``cfunc``, cached on disk like the loops) of four int64s: the
address of a packed argument block and the three data addresses that change from call to call (the
record's :data:`.support.Address` fields: blocks, dense, out). A caller packs the block once
(:meth:`PackedEntry.pack`) and keeps it; a call through a ctypes function pointer costs ~0.4 µs. The
entries unpack the block and call the loop itself (its serial copy), so that the arithmetic is the
loop's; the unpacking is generated from the loop's record (:func:`_entry_source`), as are the kinds packed.

The block: ``SLOTS`` int64 slots per field, field i at ``SLOTS * i``: an int or bool there, a float's
bits, or an array's address and extents (1-D: n0; 2-D: n0, n1). Arrays are C-contiguous int64 (or float64:
kinds ``G``, ``F``), kept alive by the caller as long as the block.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numba
import numpy as np
from numba import types

from bsrkit.backends.cpu.compiled.gemm import BsrMMArgs, bsr_mm
from bsrkit.backends.cpu.compiled.intrinsics import int64_pointer, typed_pointer
from bsrkit.backends.cpu.compiled.sampled import sampled
from bsrkit.backends.cpu.compiled.scatter import scatter_mm
from bsrkit.backends.cpu.compiled.small import BsrMMSmallArgs, bsr_mm_small
from bsrkit.backends.cpu.compiled.support import ARRAY_KINDS, QuickLoadCache, field_kinds, serial_copy
from bsrkit.loading import import_module, off_main_thread

__all__ = [
    "DISPATCHERS",
    "SLOTS",
    "PackedEntry",
    "bsr_mm_serial",
    "bsr_mm_small_serial",
    "sampled_serial",
    "scatter_mm_serial",
]

SLOTS = 3


@numba.njit(nogil=True, cache=False)
def _slot_ints1(p, i):
    return numba.carray(int64_pointer(p[SLOTS * i]), (p[SLOTS * i + 1],))


@numba.njit(nogil=True, cache=False)
def _slot_ints2(p, i):
    return numba.carray(int64_pointer(p[SLOTS * i]), (p[SLOTS * i + 1], p[SLOTS * i + 2]))


@numba.njit(nogil=True, cache=False)
def _slot_floats1(p, i):
    return numba.carray(typed_pointer(p[SLOTS * i], np.float64(0)), (p[SLOTS * i + 1],))


@numba.njit(nogil=True, cache=False)
def _slot_floats2(p, i):
    return numba.carray(typed_pointer(p[SLOTS * i], np.float64(0)), (p[SLOTS * i + 1], p[SLOTS * i + 2]))


@numba.njit(nogil=True, cache=False)
def _slot_float(p, i):
    return p[SLOTS * i : SLOTS * i + 1].view(np.float64)[0]


# How the entry reads a field of each kind from the block ``p`` (field ``i``); an Address is an argument.
_READ = {
    "i": "p[{at}]",
    "b": "p[{at}] != 0",
    "f": "_slot_float(p, {i})",
    "1": "_slot_ints1(p, {i})",
    "2": "_slot_ints2(p, {i})",
    "G": "_slot_floats1(p, {i})",
    "F": "_slot_floats2(p, {i})",
}
_DATA = ("a_addr", "b_addr", "c_addr")  # the entry's parameters for the three Address fields, in order


def _entry_source(name: str, body: str, kinds: str) -> str:
    """The C entry ``name(block, a_addr, b_addr, c_addr)`` calling ``body`` with the fields of ``kinds``."""
    data = iter(_DATA)
    fields = [next(data) if k == "a" else _READ[k].format(at=SLOTS * i, i=i) for i, k in enumerate(kinds)]
    return (
        f"def {name}(block, {', '.join(_DATA)}):\n"
        f"    p = numba.carray(int64_pointer(block), ({len(kinds) * SLOTS},))\n"
        f"    {body}(\n" + "".join(f"        {field},\n" for field in fields) + "    )\n"
    )


class _EntryStats:
    """numba's dispatcher statistics, as :func:`kernels.compile_cache_info` reads them."""

    def __init__(self, cache_path: str | None, hits: int, misses: int) -> None:
        self.cache_path = cache_path
        self.cache_hits = {(): hits}
        self.cache_misses = {(): misses}


# Every entry, for a forked child to replace their locks (one held by another thread of the parent at the
# fork would stay held: the child's first compile of it would hang).
_ENTRIES: weakref.WeakSet[PackedEntry] = weakref.WeakSet()


def _fresh_locks_in_child() -> None:
    for entry in list(_ENTRIES):
        entry._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_locks_in_child)


class PackedEntry:
    """A serial twin behind its C entry: ``c_call(block, a, b, c)`` (a ctypes function pointer, compiled
    or loaded from the on-disk cache at first use); :meth:`pack` makes a block of a record; calling the
    object with a loop's full argument list packs and runs it (what a call without a kept block does)."""

    def __init__(self, loop: Any, record: type[Any], name: str) -> None:
        self.__name__ = name
        self.record = record
        self.kinds = field_kinds(record)  # per field: see .support (i int, b bool, f float, a address, ...)
        self.data_at = tuple(i for i, kind in enumerate(self.kinds) if kind == "a")
        if len(self.data_at) != len(_DATA):
            raise TypeError(f"{record.__name__}: expected {len(_DATA)} Address fields, got {self.data_at}")
        body = f"_{name}_body"
        namespace = {
            "__name__": __name__,  # (numba rebuilds a loaded entry's environment from its module)
            **{k: v for k, v in globals().items() if k.startswith("_slot_")},
            "numba": numba,
            "int64_pointer": int64_pointer,
            body: serial_copy(loop, body, cache=False),
        }
        # (compiled under this file's name: numba caches a function by its file, and the stamp covers it)
        exec(compile(_entry_source(f"_{name}_entry", body, self.kinds), __file__, "exec"), namespace)
        self._entry = namespace[f"_{name}_entry"]
        self._cfunc: Any = None
        self._c_call: Any = None
        self._lock = threading.Lock()
        _ENTRIES.add(self)

    @property
    def c_call(self) -> Any:
        if self._c_call is None:
            with self._lock:
                if self._c_call is None:  # (a compile takes numba's lock: see bsrkit.loading)
                    self._c_call = off_main_thread(self._compile)
        return self._c_call

    def _compile(self) -> Any:
        CFunc = import_module("numba.core.ccallback").CFunc

        cfunc: Any = CFunc(self._entry, ((types.int64,) * 4, types.void), {}, {})
        with contextlib.suppress(RuntimeError):  # (no writable cache location, see support.njit: in memory)
            cfunc._cache = QuickLoadCache(self._entry)
        cfunc.compile()
        self._cfunc = cfunc
        # CFUNCTYPE: the call releases the GIL while the loop runs, as the nogil loops do.
        prototype = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)
        return prototype(cfunc.address)

    def pack(self, args: Sequence[Any]) -> np.ndarray:
        """The block of a full argument list (its data addresses are not read: they travel per call)."""
        if len(args) != len(self.kinds):
            raise TypeError(f"{self.__name__}(): expected {len(self.kinds)} arguments, got {len(args)}")
        block = np.zeros(len(args) * SLOTS, np.int64)
        for i, (kind, value) in enumerate(zip(self.kinds, args, strict=True)):
            at = i * SLOTS
            if kind == "f":
                block[at : at + 1].view(np.float64)[0] = value
            elif kind in ARRAY_KINDS:
                dtype = np.float64 if kind in "GF" else np.int64
                ndim = 2 if kind in "2F" else 1
                if (
                    not isinstance(value, np.ndarray)
                    or value.dtype != dtype
                    or value.ndim != ndim
                    or not value.flags.c_contiguous
                ):
                    field = self.record._fields[i]
                    raise TypeError(
                        f"{self.__name__}(): expected argument {i} ({field}) a C-contiguous {dtype} array"
                    )
                block[at] = value.ctypes.data
                block[at + 1 : at + 1 + value.ndim] = value.shape
            else:
                block[at] = int(value)
        return block

    def __call__(self, *args: Any) -> None:
        block = self.pack(args)
        a, b, c = self.data_at
        self.c_call(block.ctypes.data, args[a], args[b], args[c])

    @property
    def signatures(self) -> list[Any]:
        return [] if self._cfunc is None else [self._cfunc._sig]

    @property
    def stats(self) -> _EntryStats:
        cfunc = self._cfunc
        if cfunc is None:
            return _EntryStats(None, 0, 0)
        path = getattr(cfunc._cache, "cache_path", None)
        return _EntryStats(path, cfunc.cache_hits, 1 - cfunc.cache_hits)


bsr_mm_serial = PackedEntry(bsr_mm, BsrMMArgs, "bsr_mm_serial")
bsr_mm_small_serial = PackedEntry(bsr_mm_small, BsrMMSmallArgs, "bsr_mm_small_serial")
sampled_serial = serial_copy(sampled, "sampled_serial")
scatter_mm_serial = serial_copy(scatter_mm, "scatter_mm_serial")

DISPATCHERS = {
    "bsr_mm": bsr_mm,
    "sampled": sampled,
    "bsr_mm_serial": bsr_mm_serial,
    "bsr_mm_small": bsr_mm_small,
    "bsr_mm_small_serial": bsr_mm_small_serial,
    "sampled_serial": sampled_serial,
    "scatter_mm": scatter_mm,
    "scatter_mm_serial": scatter_mm_serial,
}
