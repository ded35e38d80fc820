r"""The content proof: what every cache hit checks before it trusts what was derived from tensor data.

A cache key (:class:`bsrkit.keys.TensorKey`) names *memory*; version counters say whether torch ops moved
through the aliases the key saw. Neither says what the memory holds now: numpy, DLPack and ctypes views,
``.data``, a storage-level copy, another process writing shared memory, a collective's broadcast, or an
in-place op through an alias with its own counter (the index tensors a BSR was built from) all write it
unseen. So an entry derived from tensor data keeps a :class:`Snapshot`: a copy of the bytes it was derived
from, taken *before* the derivation, and a hit first asks :meth:`Snapshot.unchanged`.

**Soundness.** For every byte the derivation could have read, the snapshot holds its value at the time
the derivation started; :meth:`~Snapshot.unchanged` compares each with the memory now. Equal bytes mean the
same inputs, so the derived value is what a rebuild would give (derivations are deterministic functions
of those bytes and of the key's metadata, which key equality already fixes). A write during the
derivation makes the snapshot differ from the memory, so the next hit rebuilds. What is compared is the
whole byte range a view spans (from its first to its last element), a superset of what it reads: a write
between the elements (another column of a matrix) is a needless rebuild, never a stale hit.

**Derived from the copy.** The derivation reads the snapshot's copy (:meth:`Snapshot.copies`), never the
live memory: otherwise a write during the derivation that is undone before the next hit (the memory reads
A, the derivation sees B, the memory returns to A) would leave a value derived from B behind a snapshot
that proves A. Derived from the copy, the value and the bytes every hit compares are the same bytes by
construction, whatever writes the memory and whenever.

**Cost.** Per tensor a copy at snapshot time and, per hit, a check that the storage is alive, unmoved and
large enough, then a byte comparison: about 0.55 µs for a small pattern's ``crow`` and ``col`` together,
about 1 µs at 13 KiB (measured in ``docs/performance.md``), then memory-bound (the memory and the copy are
both read). A CPU product with few columns on a kept operand pays only the storage check here
(:meth:`Snapshot.intact`): its compiled loop compares the bytes while it runs (the deferred proof of
:mod:`bsrkit.shortcuts`), reading only the live index entries beside the copies it reads anyway.

**Per device** (``$BSRKIT_CHECK_PLANS``, read on every check):

* unset, empty or ``auto``: host (CPU) memory is compared on every hit; device (CUDA) memory is not (a
  comparison there needs a host synchronisation): a CUDA hit is as fresh as the memory identity and
  version counters say;
* ``1``: every device is compared on every hit (CUDA: one ``torch.equal``, a host synchronisation);
* ``0``: nothing is compared (memory identity and version counters only): for measuring what the proof
  costs; writes that move no version counter the keys see can then give stale results (the keys see a
  BSR tensor's own counter, not those of the tensors it was built from, a ``BSRLinear``'s buffers
  among them).

Meta and fake tensors hold no data: they have nothing to compare.
"""

from __future__ import annotations

import ctypes
import sys
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from bsrkit.environment import getenv, reader
from bsrkit.validation import byte_span, unallocated

__all__ = ["CHECK_ENV", "Snapshot", "check_mode", "content_tensors", "with_data"]

CHECK_ENV = "BSRKIT_CHECK_PLANS"

# Modes: compare host memory, compare device memory.
_AUTO, _ALL, _NONE = (True, False), (True, True), (False, False)
_MODES: dict[str | bytes | None, tuple[bool, bool]] = {
    None: _AUTO, "": _AUTO, "auto": _AUTO, "1": _ALL, "0": _NONE,
    b"": _AUTO, b"auto": _AUTO, b"1": _ALL, b"0": _NONE,
}  # fmt: skip

# Up to this many bytes a region is compared by copying it to bytes (~80 ns + 30 ns/KiB); above, by the C
# library's memcmp through ctypes (~370 ns + 20 ns/KiB, no copy), or numpy where there is no memcmp.
_BYTES_COMPARE_MAX = 1 << 15


def _find_memcmp() -> Any:
    try:
        libc = ctypes.CDLL(None) if sys.platform != "win32" else ctypes.cdll.msvcrt
        memcmp = libc.memcmp
    except (OSError, AttributeError):
        return None
    memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    memcmp.restype = ctypes.c_int
    return memcmp


_memcmp = _find_memcmp()


_raw_mode = reader(CHECK_ENV)


def check_mode() -> tuple[bool, bool]:
    """(compare host memory, compare device memory) under ``$BSRKIT_CHECK_PLANS``."""
    mode = _MODES.get(_raw_mode())
    if mode is None:
        raw = getenv(CHECK_ENV)
        mode = _MODES.get(raw)
        if mode is None:
            raise ValueError(f"bsrkit: expected ${CHECK_ENV} in ('auto', '0', '1') or unset, got {raw!r}")
    return mode


def content_tensors(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The strided tensors whose data a value derived from ``t`` may depend on, as far as a
    :class:`~bsrkit.keys.TensorKey` names it: ``t`` itself, or a sparse compressed tensor's two index
    tensors (its values are not part of its key)."""
    layout = t.layout
    if layout is torch.strided:
        return (t,)
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return (t.crow_indices(), t.col_indices())
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return (t.ccol_indices(), t.row_indices())
    raise TypeError(f"bsrkit: expected a strided or sparse compressed tensor, got layout {layout}")


def with_data(t: torch.Tensor, data: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``t`` with its :func:`content_tensors` replaced by ``data`` (tensors of the same metadata): a
    strided tensor is ``data[0]``; a sparse compressed tensor is rebuilt on them, its values a tensor of
    their shape and dtype that holds no memory (values are not part of its key: nothing derived from it
    may read them)."""
    if t.layout is torch.strided:
        return data[0]
    values = t.values()
    stub = torch.zeros((), dtype=values.dtype, device=values.device).expand(values.shape)
    return torch.sparse_compressed_tensor(
        data[0], data[1], stub, size=t.shape, layout=t.layout, check_invariants=False
    )


def _host_region(storage: Any, start: int, nbytes: int) -> tuple[Any, ...]:
    """``(weak ref to the storage, its data address, end byte, view, copy)`` for bytes ``start`` to
    ``start + nbytes`` of a CPU storage. The view does not own (or pin) the memory: it is read only after
    the storage is found alive, unmoved and still large enough (see :meth:`Snapshot.unchanged`). Up to
    ``_BYTES_COMPARE_MAX`` bytes, the view is a numpy array and the copy ``bytes``; above, a
    ``_LargeRegion`` compares them."""
    base = storage.data_ptr()
    buffer = (ctypes.c_ubyte * nbytes).from_address(base + start)
    view: Any = np.frombuffer(memoryview(buffer).cast("B"), dtype=np.uint8)
    kept: Any = view.tobytes()
    if nbytes > _BYTES_COMPARE_MAX:
        view = _LargeRegion(view, kept)
    return (weakref.ref(storage), base, start + nbytes, view, kept)


class _LargeRegion:
    """A large region's comparison without a copy: memcmp of the memory and the kept bytes."""

    __slots__ = ("address", "kept", "kept_address", "nbytes", "view")

    def __init__(self, view: np.ndarray, kept: bytes) -> None:
        self.view = view
        self.kept = kept
        self.address = view.ctypes.data
        self.kept_address = ctypes.cast(ctypes.c_char_p(kept), ctypes.c_void_p).value
        self.nbytes = view.nbytes

    def equal(self) -> bool:
        if _memcmp is not None:
            return bool(_memcmp(self.address, self.kept_address, self.nbytes) == 0)
        return bool(np.array_equal(self.view, np.frombuffer(self.kept, dtype=np.uint8)))


class _DeviceRegion:
    """Bytes of a storage on an accelerator: a copy on the same device, compared only in the checked
    mode (the comparison synchronises with the host). Without a copy (taken while the mode was off), a
    checked comparison fails: unproven is not unchanged."""

    __slots__ = ("kept", "ref", "size", "start")

    def __init__(self, storage: Any, start: int, nbytes: int, copy: bool) -> None:
        self.ref = weakref.ref(storage)
        self.start = start
        self.size = nbytes
        self.kept = _bytes_of(storage, start, nbytes).clone() if copy else None

    def unchanged(self) -> bool:
        s = self.ref()
        if s is None or s.nbytes() < self.start + self.size or self.kept is None:
            return False
        return torch.equal(_bytes_of(s, self.start, self.size), self.kept)


def _bytes_of(storage: Any, start: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor viewing ``nbytes`` bytes of ``storage`` from ``start``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, start, (nbytes,), (1,))


class Snapshot:
    """A copy of the data of some tensors, and the check that their memory still holds it.

    Take it *before* deriving anything from the tensors (see the module's docstring for why that order is
    sound); keep it with what was derived; trust the derived value only while :meth:`unchanged`.
    The snapshot holds no tensor or storage alive (weak references only).
    """

    __slots__ = ("_device", "_host", "_opaque", "_where")

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        check_mode()  # (a bad $BSRKIT_CHECK_PLANS raises at the first product, not at its first hit)
        host: list[tuple[Any, ...]] = []
        device: list[_DeviceRegion] = []
        # Per tensor, where its copy is (for copies()): ("host" | "device", index), or None: no data.
        where: list[tuple[str, int] | None] = []
        opaque = False  # a tensor whose data cannot be read as bytes (a storage-less wrapper subclass)
        copy_device: bool | None = None
        for t in tensors:
            where.append(None)
            if t.device.type == "meta" or t.numel() == 0:
                continue  # no data to be stale
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                opaque = True
                continue
            if storage.device.type == "meta":  # (a fake tensor: no data either)
                continue
            start, nbytes = byte_span(t)
            if storage.nbytes() < start + nbytes:  # (released or shrunk: reading it would leave the memory)
                raise unallocated(f"tensor of shape {tuple(t.shape)}")
            if storage.device.type == "cpu":
                where[-1] = ("host", len(host))
                host.append(_host_region(storage, start, nbytes))
            else:
                if copy_device is None:
                    copy_device = check_mode()[1]
                where[-1] = ("device", len(device))
                device.append(_DeviceRegion(storage, start, nbytes, copy_device))
        self._host = tuple(host)
        self._device = tuple(device)
        self._opaque = opaque
        self._where = tuple(where)

    def copies(self, tensors: Iterable[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Tensors with the metadata of ``tensors`` (those the snapshot was taken of, in the same order)
        whose data is the snapshot's copy: what a derivation reads (see the module's docstring). They
        share no memory with ``tensors``. A device tensor's copy is taken now where the snapshot kept
        none (outside the checked mode: the device's stream order makes it the data every later kernel
        reads); a tensor without data (meta, empty) gets an empty one of its metadata, a fake or opaque
        tensor is itself (nothing derived from it is ever proven: see :meth:`unchanged`)."""
        out: list[torch.Tensor] = []
        for t, where in zip(tensors, self._where, strict=True):
            if where is None:
                if t.numel() == 0 or t.device.type == "meta":
                    out.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device))
                else:
                    out.append(t)
                continue
            kind, i = where
            if kind == "host":  # (a writable copy of the kept bytes: torch refuses read-only buffers)
                data = torch.frombuffer(bytearray(self._host[i][4]), dtype=torch.uint8)
            else:
                region = self._device[i]
                kept = region.kept
                if kept is None:
                    kept = _bytes_of(t.untyped_storage(), region.start, region.size).clone()
                data = kept
            copy = data.view(t.dtype).as_strided(t.shape, t.stride(), 0)
            # (the kept bytes are the memory; the conjugate and negative bits say how t reads it)
            if t.is_conj():
                copy = copy.conj()
            if t.is_neg():
                copy = torch._neg_view(copy)
            out.append(copy)
        return tuple(out)

    def unchanged(self) -> bool:
        """Whether every byte the snapshot copied still holds its value (under ``$BSRKIT_CHECK_PLANS``:
        host memory by default, device memory in the checked mode ``1``, nothing with ``0``)."""
        check_host, check_device = check_mode()
        if not check_host:  # (mode 0: nothing is compared)
            return True
        if self._opaque:
            return False  # unproven is not unchanged
        # (inline, not a method per region: this runs on every cache hit)
        for ref, base, end, view, kept in self._host:
            s = ref()
            if s is None or s.data_ptr() != base or s.nbytes() < end:
                return False  # gone, reallocated (resized) or shrunk: not the memory the copy was taken from
            if view.__class__ is _LargeRegion:
                if not view.equal():
                    return False
            elif view.tobytes() != kept:
                return False
        if check_device:
            for d in self._device:
                if not d.unchanged():
                    return False
        return True

    def intact(self) -> bool:
        """The first half of :meth:`unchanged`, without reading any data: every host storage alive,
        unmoved and still large enough, so that its copied bytes may be read at the addresses they were
        copied from; no opaque tensor and no device memory (which only :meth:`unchanged` can prove).

        For a compiled loop that compares the memory itself while it runs (a CPU prepared call: see
        :mod:`bsrkit.shortcuts`): its caller asks this first, then trusts the derived value only if the
        loop compared every byte of the snapshot and found it unchanged. Ignores
        ``$BSRKIT_CHECK_PLANS`` (the caller reads it)."""
        if self._opaque or self._device:
            return False
        for ref, base, end, _, _ in self._host:
            s = ref()
            if s is None or s.data_ptr() != base or s.nbytes() < end:
                return False
        return True
