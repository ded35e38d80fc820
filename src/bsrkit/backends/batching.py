"""Batch flattening shared by the backends: 3-D operands (torch primitives, Triton), batch index maps (CPU).

Broadcast batch dimensions become stride-0 views; copies are made only where no view exists.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from bsrkit.validation import data_address

if TYPE_CHECKING:
    from bsrkit.operand import Operand

__all__ = [
    "as_3d",
    "block_coordinates",
    "bsr_batch_of",
    "flatten_addmm",
    "flatten_strided_scatter",
    "host_array",
    "needs_torch_scatter",
    "non_overlapping",
]


def as_3d(t: torch.Tensor, shape: tuple[int, int, int]) -> tuple[torch.Tensor, bool]:
    """A view of ``t`` with ``shape``, or a copy (and True) when the batch dims cannot be viewed flat:
    the caller then writes the copy back with ``t.copy_``."""
    try:
        return t.view(shape), False
    except RuntimeError:
        return t.reshape(shape).clone(), True


def flatten_addmm(
    a: Operand, dense: torch.Tensor, out: torch.Tensor, batch: torch.Size
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(crow, col, values, dense, out) with the batch flattened to one dim, and whether ``out`` had to
    be copied (see :func:`as_3d`)."""
    B, M, K, N = math.prod(batch), a.M, a.K, dense.shape[-1]
    crow, col = a.kernel_indices()
    crow = crow.expand(*batch, crow.shape[-1]).reshape(B, crow.shape[-1])
    col = col.expand(*batch, a.nnz).reshape(B, a.nnz)
    values = a.values.expand(*batch, *a.values.shape[-3:]).reshape(B, *a.values.shape[-3:])
    dense3 = dense.expand(*batch, K, N).reshape(B, K, N)
    out3, copied = as_3d(out, (B, M, N))
    return crow, col, values, dense3, out3, copied


def flatten_strided_scatter(
    others: torch.Tensor, accumulators: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``others (*B, K, N)`` and ``accumulators (*B, M, N)`` of the ``bsr_strided_mm*`` formats as 3-D
    tensors, and whether ``accumulators`` had to be copied (see :func:`as_3d`)."""
    K, N = others.shape[-2:]
    M = accumulators.shape[-2]
    acc3, copied = as_3d(accumulators, (math.prod(accumulators.shape[:-2]), M, N))
    return others.reshape(-1, K, N), acc3, copied


def flatten_scatter_stacks(
    others: torch.Tensor, accumulators: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``others (*Q, Ks, Ns)`` and ``accumulators (*R, Ms, Ns)`` of the ``scatter_mm`` format as 3-D
    tensors, and whether ``accumulators`` had to be copied (see :func:`as_3d`)."""
    acc3, copied = as_3d(accumulators, (math.prod(accumulators.shape[:-2]), *accumulators.shape[-2:]))
    return others.reshape(-1, *others.shape[-2:]), acc3, copied


def block_coordinates(a: Operand, batch: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """(block rows, block columns) of ``a``'s stored blocks, each ``(prod(batch), nnz)`` int64."""
    rows = a.plan("rows")  # (Bb, nnz)
    nb = math.prod(batch)
    nnz = a.nnz
    rows_b = rows.reshape(*a.batch, nnz).expand(*batch, nnz).reshape(nb, nnz)
    cols_b = a.kernel_indices()[1].to(torch.int64).expand(*batch, nnz).reshape(nb, nnz)
    return rows_b, cols_b


def bsr_batch_of(bsr_batch: torch.Size, batch: torch.Size) -> np.ndarray:
    """For each flattened output batch index, the flattened index of the BSR batch it broadcasts from
    (int64, for the compiled CPU loops)."""
    n_bsr = math.prod(bsr_batch)
    if not batch:
        return np.zeros(1, dtype=np.int64)
    if bsr_batch == batch:
        return np.arange(n_bsr, dtype=np.int64)
    return np.ascontiguousarray(
        np.broadcast_to(np.arange(n_bsr, dtype=np.int64).reshape(bsr_batch), batch).reshape(-1)
    )


def non_overlapping(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share memory (a sufficient test: sorted by stride, each
    dimension steps past everything the smaller ones span)."""
    span = 0
    for stride, size in sorted((abs(st), s) for s, st in zip(t.shape, t.stride(), strict=True) if s > 1):
        if stride <= span:
            return False
        span += (size - 1) * stride
    return True


def needs_torch_scatter(blocks: torch.Tensor, others: torch.Tensor, accumulators: torch.Tensor) -> bool:
    """Whether ``scatter_mm`` must take the torch primitives (on every backend whose kernel writes the
    accumulators while it reads the operands): accumulators whose elements share memory
    (torch refuses to write them), or that share memory with an input (the kernel would read what it
    writes; the primitives compute every product before adding)."""
    if not non_overlapping(accumulators):
        return True
    acc_storage = accumulators.untyped_storage().data_ptr()
    return acc_storage in (blocks.untyped_storage().data_ptr(), others.untyped_storage().data_ptr())


# The numpy type string of each dtype the loops take.
_TYPESTRS = {
    dtype: np.dtype(kind).str
    for dtype, kind in (
        (torch.float32, np.float32), (torch.float64, np.float64), (torch.int64, np.int64),
        (torch.int32, np.int32), (torch.bool, np.bool_),
    )
}  # fmt: skip


class _ArrayInterface:
    """A view of memory numpy reads through ``__array_interface__``, holding the tensor that owns it:
    numpy keeps this object as the array's ``base``, so the array keeps the memory alive (a temporary
    copy made for the call, freed before the loop read it, was read after free: wrong results, a crash)."""

    __slots__ = ("__array_interface__", "owner")
    __array_interface__: dict[str, Any]
    owner: torch.Tensor


def host_array(t: torch.Tensor) -> np.ndarray:
    """``t.numpy()`` for a contiguous CPU tensor, without its side effect: torch marks every storage that
    numpy views non-resizable, for ever (a caller's ``resize_`` then fails), and the loops take arrays of
    the caller's own tensors. An array on ``t``'s memory that holds ``t`` (as ``.numpy()``'s does)."""
    typestr = _TYPESTRS.get(t.dtype)
    if typestr is None or not t.is_contiguous():
        raise ValueError(f"host_array(): expected a contiguous tensor of {sorted(map(str, _TYPESTRS))}")
    data = data_address(t)  # (a released storage: an error, not a view of address 0)
    view = _ArrayInterface()
    view.owner = t
    view.__array_interface__ = {
        "data": (data, False), "shape": tuple(t.shape), "typestr": typestr, "version": 3,
    }  # fmt: skip
    return np.asarray(view)
