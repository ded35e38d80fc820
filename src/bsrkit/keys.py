"""Memory-identity keys for tensors.

A :class:`TensorKey` names *how a piece of memory is viewed* — never the data in it — so that a cached
result derived from a tensor can be found again from any tensor object that views the same memory in the
same way: ``bsr.crow_indices()`` and ``x[0]`` return a new Python object on every call, and a training loop
may rebuild ``torch.sparse_bsr_tensor(crow, col, values)`` every step from the same index tensors.

A key lives as long as that *memory*, not as long as one Python wrapper. It is held through the tensors'
storages: ``t.untyped_storage()`` returns the same Python object for as long as the storage lives (torch
preserves it while any tensor uses it), and a weak reference to it dies with the storage's last user.

Creating a key reads only metadata (about a microsecond); it never synchronises a device or reads data.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from bsrkit.validation import type_name

__all__ = ["SPARSE_COMPRESSED_LAYOUTS", "TensorAsKey", "TensorKey"]

SPARSE_COMPRESSED_LAYOUTS = frozenset(
    {torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc}
)

# layout -> (row-compressed, blocked), for the sparse compressed layouts
_COMPRESSED_KINDS = {
    torch.sparse_csr: (True, False),
    torch.sparse_csc: (False, False),
    torch.sparse_bsr: (True, True),
    torch.sparse_bsc: (False, True),
}
_STRIDED = torch.strided
_ref = weakref.ref


def _storage(t: torch.Tensor) -> Any:
    """What ``t``'s memory lives as long as: its storage, or ``t`` itself for a tensor without one."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # e.g. wrapper subclasses that have no storage
        return t


class TensorKey:
    """Hashable key of a tensor by memory identity, alive exactly as long as the memory it names.

    * strided tensors (any dtype, any device, meta and fake included): ``(device, dtype, storage identity,
      storage_offset, shape, stride, is_conj, is_neg, layout)``;
    * sparse compressed tensors (CSR/CSC/BSR/BSC): ``(layout, device, shape, blocksize, identity of the
      compressed indices, identity of the plain indices)`` (flattened), an index identity being
      ``(storage identity, storage_offset, shape, stride, dtype, is_neg)``. The values are deliberately
      not part of the key: what is cached for a sparse tensor (a *plan*) depends on its sparsity pattern
      only, so a BSR tensor rebuilt from the same index tensors with new values has the same key.

    The storage identity is the storage's Python object (``t.untyped_storage()``), held weakly; with the
    offset, shape, strides and dtype it names the memory exactly, so no ``data_ptr()`` is read. It keeps
    apart two live meta or fake tensors with equal metadata (their ``data_ptr()`` is 0, and FakeTensor
    warns on reading it). A storage that is resized keeps its identity (a cache that compares contents
    sees new memory: see :mod:`bsrkit.freshness`).

    **Lifetime.** A key is *alive* while the storages it names are (for a sparse key, those of both index
    tensors): while any tensor at all uses that memory, not only the tensor the key was made from. While
    both are alive, equal keys mean "the same memory viewed the same way". A dead key compares equal only
    to itself, so a tensor allocated later at a dead one's address can never match it.

    ``version`` records the version counters (``t._version``) at key creation; it is not part of equality.
    Caches compare it to detect in-place modification (see :mod:`bsrkit.cache`). Views share their base's
    counter, and the index accessors of one sparse tensor share one counter. Inference tensors have no
    version counter: their ``version`` is ``()`` (caches do not store them).

    A key says nothing about the *contents*: a change made through a tensor with *another* version counter
    on the same memory is invisible to ``version`` (``torch.sparse_bsr_tensor(crow, col, values)`` gives
    its indices a fresh counter, so after ``col.copy_(...)`` on the ``col`` it was built from, a key of
    that BSR tensor, or of one rebuilt from ``col``, has an unchanged ``version``; so does
    ``x.data.add_(1)`` for ``x``), and so are numpy, DLPack and ctypes writes, storage copies and other
    processes. A cache that must not be stale compares the data too (``weak_lru_cache(verify_contents=
    True)``, :mod:`bsrkit.freshness`): bsrkit's own caches do.
    """

    __slots__ = ("__weakref__", "_anchors", "_hash", "_identity", "_ref", "version")

    def __init__(
        self,
        tensor: torch.Tensor,
        *,
        members: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """``members``: ``(compressed indices, plain indices, values)`` of a sparse compressed
        ``tensor``, for a caller that fetched them already (each accessor creates a tensor, ~1 µs)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"TensorKey(): expected a torch.Tensor, got {type_name(tensor)}")
        layout = tensor.layout
        if layout is _STRIDED:
            storage: Any
            try:  # _storage(), inlined: this runs on every cache lookup
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):
                storage = tensor
            # The conj and neg bits change what the same memory means, so they are part of the identity.
            self._identity: tuple[Any, ...] = (
                tensor.device, tensor.dtype, id(storage), tensor.storage_offset(),
                tensor.shape, tensor.stride(), tensor.is_conj(), tensor.is_neg(), _STRIDED,
            )  # fmt: skip
            self._anchors: tuple[weakref.ref[Any], ...] = (_ref(storage),)
            self.version: tuple[int, ...] = () if tensor.is_inference() else (tensor._version,)
        else:
            kind = _COMPRESSED_KINDS.get(layout)
            if kind is None:
                raise TypeError(
                    f"TensorKey(): expected a strided or sparse compressed tensor, got layout {layout}"
                )
            row_compressed, blocked = kind
            if members is not None:
                c, p, values = members
            elif row_compressed:
                c, p, values = tensor.crow_indices(), tensor.col_indices(), None
            else:
                c, p, values = tensor.ccol_indices(), tensor.row_indices(), None
            blocksize: tuple[int, ...] = ()
            if blocked:
                # values: (*batch, nnz, *blocksize, *dense_dims); batch ndim = c.ndim - 1
                nb = c.dim()
                blocksize = (tensor.values() if values is None else values).shape[nb : nb + 2]
            cs: Any
            ps: Any
            try:
                cs, ps = c.untyped_storage(), p.untyped_storage()
            except (RuntimeError, NotImplementedError):
                cs, ps = _storage(c), _storage(p)
            # One flat tuple (it is hashed and compared on every cache lookup). Index tensors are integer,
            # strided and on the sparse tensor's device; the neg bit applies to them (torch._neg_view: the
            # same memory read as other indices), the conj bit does not.
            self._identity = (
                layout, tensor.device, tensor.shape, blocksize,
                id(cs), c.storage_offset(), c.shape, c.stride(), c.dtype, c.is_neg(),
                id(ps), p.storage_offset(), p.shape, p.stride(), p.dtype, p.is_neg(),
            )  # fmt: skip
            self._anchors = (_ref(cs), _ref(ps))
            # (members made under inference mode have no counter, even in a wrapper made outside it)
            inference = tensor.is_inference() or c.is_inference() or p.is_inference()
            self.version = () if inference else (c._version, p._version)
        self._ref = _ref(tensor)
        self._hash = hash(self._identity)

    @property
    def obj(self) -> torch.Tensor | None:
        """The tensor the key was made from, or None once that Python object is gone (its memory, and
        so the key, may live on in other tensors)."""
        return self._ref()

    def current_version(self) -> tuple[int, ...] | None:
        """The version counters :attr:`version` recorded, read again now from the key's tensor (an
        in-place change through it since the key was made moves them), or None once that tensor is
        gone."""
        t = self._ref()
        if t is None:
            return None
        if not self.version:  # (inference tensors: no counters)
            return ()
        if t.layout is _STRIDED:
            return (t._version,)
        c, p = (
            (t.crow_indices(), t.col_indices())
            if _COMPRESSED_KINDS[t.layout][0]
            else (t.ccol_indices(), t.row_indices())
        )
        return (c._version, p._version)

    @property
    def alive(self) -> bool:
        """Whether the memory the key names is still in use by some tensor."""
        return all(r() is not None for r in self._anchors)

    def anchors(self) -> tuple[Any, ...] | None:
        """The objects whose lifetime is the key's (storages; a tensor without storage stands for its
        own), or None once any of them is gone."""
        objs = tuple(r() for r in self._anchors)
        return None if any(o is None for o in objs) else objs

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, TensorKey) or self._hash != other._hash:
            return False
        if self._identity != other._identity:
            return False
        # Equal identities name the same storage objects only while both keys' storages live (an id can
        # be reused by an object created after the first one died).
        for r in self._anchors:
            if r() is None:
                return False
        for r in other._anchors:  # noqa: SIM110 (a loop, not all(): this runs on every cache hit)
            if r() is None:
                return False
        return True

    def __repr__(self) -> str:
        state = "alive" if self.alive else "dead"
        return f"TensorKey({self._identity!r}, {state})"


class TensorAsKey(TensorKey):
    """torch's ``TensorAsKey(obj)`` (``torch.sparse._triton_ops``), by its name and signature: a
    :class:`TensorKey` of ``obj`` (any dtype; ``.obj`` as torch's), equal to ``TensorKey(obj)``."""

    __slots__ = ()

    def __init__(self, obj: torch.Tensor) -> None:
        super().__init__(obj)
