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


# layout -> (row-compressed, blocked), for the sparse compressed layouts
_COMPRESSED_KINDS = {
    torch.sparse_csr: (True, False),
    torch.sparse_csc: (False, False),
    torch.sparse_bsr: (True, True),
    torch.sparse_bsc: (False, True),
}
_STRIDED = torch.strided


class TensorKey:
    """Hashable key of a tensor by memory identity, holding the tensor only through a weak reference.

    * strided tensors (any dtype): ``(device, dtype, data_ptr, storage_offset, shape, stride, is_conj,
      is_neg, layout)``;
    * sparse compressed tensors (CSR/CSC/BSR/BSC): ``(layout, device, shape, blocksize, identity of the
      compressed indices, identity of the plain indices)`` (flattened), an index identity being
      ``(data_ptr, storage_offset, shape, stride, dtype)``. The values are deliberately not part of the
      key: what is cached for a sparse tensor (a *plan*) depends on its sparsity pattern only.

    While both tensors are alive, equal keys mean "the same memory viewed the same way". A key whose
    tensor has died compares equal only to itself, so a new tensor allocated at a dead one's address can
    never match an entry made for the dead one.

    ``version`` records the version counters (``t._version``) at key creation; it is not part of
    equality. Caches compare it to detect in-place modification (see :mod:`bsrkit.cache`). Inference
    tensors have no version counter: their ``version`` is ``()`` (caches do not store them).
    """

    __slots__ = ("__weakref__", "_hash", "_identity", "_ref", "version")

    def __init__(
        self,
        tensor: torch.Tensor,
        *,
        members: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """``members``: ``(compressed indices, plain indices, values)`` of a sparse compressed
        ``tensor``, for a caller that fetched them already (each accessor creates a tensor, ~1 µs)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"TensorKey(): expected a torch.Tensor, got {type(tensor).__name__}")
        layout = tensor.layout
        if layout is _STRIDED:
            self._identity: tuple[Any, ...] = _strided_identity(tensor)
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
            # One flat tuple (it is hashed and compared on every cache lookup). Index tensors are integer,
            # strided and on the sparse tensor's device; the conj/neg bits never apply to them.
            self._identity = (
                layout, tensor.device, tensor.shape, blocksize,
                c.data_ptr(), c.storage_offset(), c.shape, c.stride(), c.dtype,
                p.data_ptr(), p.storage_offset(), p.shape, p.stride(), p.dtype,
            )  # fmt: skip
            self.version = () if tensor.is_inference() else (c._version, p._version)
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
