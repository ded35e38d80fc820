"""Memory-identity keys for tensors.

A :class:`TensorKey` names *how a piece of memory is viewed* — never the data in it — so that a cached
result derived from a tensor can be found again from any tensor object that views the same memory in the
same way (``bsr.crow_indices()`` returns a new Python object on every call, for example).

Creating a key reads only metadata (a few microseconds); it never synchronises a device or reads data.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["SPARSE_COMPRESSED_LAYOUTS", "TensorKey"]

SPARSE_COMPRESSED_LAYOUTS = frozenset(
    {torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc}
)
_ROW_COMPRESSED = frozenset({torch.sparse_csr, torch.sparse_bsr})
_BLOCKED = frozenset({torch.sparse_bsr, torch.sparse_bsc})


def _strided_identity(t: torch.Tensor) -> tuple[Any, ...]:
    # The conj and neg bits change what the same memory means, so they are part of the identity.
    return (
        t.device,
        t.dtype,
        t.data_ptr(),
        t.storage_offset(),
        t.shape,
        t.stride(),
        t.is_conj(),
        t.is_neg(),
        torch.strided,
    )


def _index_identity(t: torch.Tensor) -> tuple[Any, ...]:
    # Index tensors are integer, strided and on the sparse tensor's device (its device is in the key
    # already); the conj/neg bits never apply to them.
    return (t.data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)


def _compressed_indices(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if t.layout in _ROW_COMPRESSED:
        return t.crow_indices(), t.col_indices()
    return t.ccol_indices(), t.row_indices()


class TensorKey:
    """Hashable key of a tensor by memory identity, holding the tensor only through a weak reference.

    * strided tensors (any dtype): ``(device, dtype, data_ptr, storage_offset, shape, stride, is_conj,
      is_neg, layout)``;
    * sparse compressed tensors (CSR/CSC/BSR/BSC): ``(layout, device, shape, blocksize, identity of the
      compressed indices, identity of the plain indices)``, an index identity being ``(data_ptr,
      storage_offset, shape, stride, dtype)``. The values are deliberately not part of the key: what is
      cached for a sparse tensor (a *plan*) depends on its sparsity pattern only.

    While both tensors are alive, equal keys mean "the same memory viewed the same way". A key whose
    tensor has died compares equal only to itself, so a new tensor allocated at a dead one's address can
    never match an entry made for the dead one.

    ``version`` records the version counters (``t._version``) at key creation; it is not part of
    equality. Caches compare it to detect in-place modification (see :mod:`bsrkit.cache`).
    """

    __slots__ = ("__weakref__", "_hash", "_identity", "_ref", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"TensorKey(): expected a torch.Tensor, got {type(tensor).__name__}")
        layout = tensor.layout
        if layout is torch.strided:
            self._identity: tuple[Any, ...] = _strided_identity(tensor)
            self.version: tuple[int, ...] = (tensor._version,)
        elif layout in SPARSE_COMPRESSED_LAYOUTS:
            compressed, plain = _compressed_indices(tensor)
            if layout in _BLOCKED:
                # values: (*batch, nnz, *blocksize, *dense_dims); batch ndim = compressed.ndim - 1
                nb = compressed.ndim
                blocksize = tuple(tensor.values().shape[nb : nb + 2])
            else:
                blocksize = ()
            self._identity = (
                layout,
                tensor.device,
                tensor.shape,
                blocksize,
                _index_identity(compressed),
                _index_identity(plain),
            )
            self.version = (compressed._version, plain._version)
        else:
            raise TypeError(
                f"TensorKey(): expected a strided or sparse compressed tensor, got layout {layout}"
            )
        self._ref = weakref.ref(tensor)
        self._hash = hash(self._identity)

    @property
    def obj(self) -> torch.Tensor | None:
        """The tensor, or None once it has been garbage-collected."""
        return self._ref()

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, TensorKey) or self._hash != other._hash:
            return False
        if self._ref() is None or other._ref() is None:
            return False
        return self._identity == other._identity

    def __repr__(self) -> str:
        state = "dead" if self._ref() is None else "alive"
        return f"TensorKey({self._identity!r}, {state})"
