"""What a cached value holds: its arrays (tensors, storages, numpy arrays, bytes, looked for inside
containers and objects), their size, and whether one of them keeps a key's memory alive (which would keep
the entry alive for ever: :func:`bsrkit.cache.weak_lru_cache` refuses such a value)."""

from __future__ import annotations

import functools
import types
from collections import deque
from typing import Any

import numpy as np
import torch

__all__ = ["nbytes_of", "pinning_array", "value_arrays"]

# numpy 2 moved byte_bounds to numpy.lib.array_utils; 1.26 (the lowest supported) has numpy.byte_bounds.
_array_utils = getattr(np.lib, "array_utils", None)
_byte_bounds = _array_utils.byte_bounds if _array_utils is not None else np.byte_bounds  # type: ignore[attr-defined]


def value_arrays(value: Any) -> list[Any]:
    """Tensors, storages, numpy arrays and ``bytes`` held by a value, each once, looking inside tuples,
    lists, dicts, sets and other objects' attributes (``__dict__``, ``__slots__``: a dataclass; a tensor's
    Python attributes too), or, for
    an object whose class lists what it owns (``cache_footprint(self)``, an iterable of such values: a
    plan object, e.g. :class:`bsrkit.plans.Pattern`), inside that only."""
    found: list[Any] = []
    seen: set[int] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, (torch.Tensor, np.ndarray, torch.UntypedStorage, bytes, bytearray)):
            found.append(v)
            if isinstance(v, torch.Tensor):  # (and what its Python attributes hold: t.source = argument)
                attributes = getattr(v, "__dict__", None)
                if attributes:
                    stack.extend(attributes.values())
        elif isinstance(v, (tuple, list, deque)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, memoryview):  # (what it exposes: a numpy array of a tensor, bytes)
            stack.append(v.obj)
        elif isinstance(v, (set, frozenset)):
            stack.extend(v)
        elif isinstance(v, types.FunctionType):  # what it captured, not its module's globals
            stack.extend(cell.cell_contents for cell in v.__closure__ or () if _filled(cell))
            stack.extend(v.__defaults__ or ())
            stack.extend((v.__kwdefaults__ or {}).values())
        elif isinstance(v, types.MethodType):
            stack.extend((v.__self__, v.__func__))
        elif isinstance(v, functools.partial):
            stack.extend((v.func, v.args, v.keywords))
        elif not isinstance(v, _OPAQUE):
            footprint = getattr(type(v), "cache_footprint", None)
            if footprint is not None:
                stack.extend(footprint(v))
                continue
            attributes = getattr(v, "__dict__", None)
            if isinstance(attributes, dict):
                stack.extend(attributes.values())
            for cls in type(v).__mro__:
                slots = cls.__dict__.get("__slots__", ())
                for name in (slots,) if isinstance(slots, str) else slots:
                    stack.append(getattr(v, name, None))
    return found


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


# Objects whose attributes are not a value's own data: classes, modules, builtins, scalars (a Python
# function's captures and a method's object are looked into above).
_OPAQUE = (type, types.ModuleType, types.BuiltinFunctionType, str, int, float, complex, bool, type(None),
           torch.dtype, torch.device)  # fmt: skip


def nbytes_of(arrays: list[Any]) -> int:
    total = 0
    for a in arrays:
        if isinstance(a, np.ndarray):
            total += a.nbytes
        elif isinstance(a, torch.UntypedStorage):
            total += a.nbytes()
        elif isinstance(a, (bytes, bytearray)):
            total += len(a)
        elif a.layout is torch.strided:
            total += a.untyped_storage().nbytes() if a.device.type == "meta" else a.nbytes
        else:  # sparse: count its member tensors
            total += sum(m.nbytes for m in _sparse_members(a))
    return total


def _sparse_members(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return (t.crow_indices(), t.col_indices(), t.values())
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return (t.ccol_indices(), t.row_indices(), t.values())
    if t.layout is torch.sparse_coo:
        return (t._indices(), t._values())
    return ()


def _memory_of(a: Any) -> list[Any]:
    """The storages (or storage-less tensors) whose memory an array keeps alive."""
    if isinstance(a, torch.UntypedStorage):
        return [a]
    if isinstance(a, (bytes, bytearray)):
        return []
    if isinstance(a, np.ndarray):
        base = a.base
        while isinstance(base, np.ndarray):
            base = base.base
        # torch.Tensor.numpy() arrays keep their tensor (so its storage) as their base
        return _memory_of(base) if isinstance(base, torch.Tensor) else []
    if a.layout is torch.strided:
        try:
            return [a, a.untyped_storage()]
        except (RuntimeError, NotImplementedError):
            return [a]
    return [a, *(s for m in _sparse_members(a) for s in _memory_of(m))]


def pinning_array(arrays: list[Any], anchors: list[Any]) -> Any:
    """The value array that keeps the memory of a key alive, if any: one that holds one of its storages,
    or views memory inside one (an alias with a storage object of its own: ``torch.from_dlpack``,
    ``torch.frombuffer``, which hold the argument's memory through their deleters)."""
    ids = {id(a) for a in anchors}
    spans = [span for a in anchors if (span := _address_span(a)) is not None]
    for a in arrays:
        memory = _memory_of(a)
        if any(id(m) in ids for m in memory):
            return a
        for m in (a, *memory):  # (a sparse value: its members' storages)
            span = _address_span(m)
            if span is not None and any(
                device == span[0] and low < span[2] and span[1] < high for device, low, high in spans
            ):
                return a
    return None


def _address_span(a: Any) -> tuple[str, int, int] | None:
    """(device, first address, end address) of the memory ``a`` views (a strided tensor: its storage's),
    or None where that is not memory (meta, sparse, empty)."""
    if isinstance(a, np.ndarray):
        if not a.nbytes:
            return None
        low, high = _byte_bounds(a)
        return "cpu", low, high
    try:
        if isinstance(a, torch.Tensor):
            if a.layout is not torch.strided or a.device.type == "meta":
                return None
            a = a.untyped_storage()
        if isinstance(a, torch.UntypedStorage) and a.device.type != "meta" and a.nbytes():
            return str(a.device), a.data_ptr(), a.data_ptr() + a.nbytes()
    except (RuntimeError, NotImplementedError):  # (no memory of its own: a wrapper subclass, vmap's)
        return None
    return None
