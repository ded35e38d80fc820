r"""What an attention mask adds to the scores inside its stored blocks: the mask types the backends consume.

For a BSR mask ``P`` with blocks ``(Ms, Ns)``, the score of query row ``i`` and key column ``j`` inside a
stored block gets a bias :math:`b_{ij}`:

* bool mask: :math:`b_{ij} = 0` where the mask's value is True, :math:`-\infty` where False;
* float mask: :math:`b_{ij}` = the mask's value;
* ``is_causal``: additionally :math:`b_{ij} = -\infty` where :func:`after` (the key comes after the query,
  :math:`j > i`) — the one place that rule is written.

:class:`BlockBias` is that bias per stored block: blocks with every entry allowed and blocks with none
are flagged, not stored, so a window's interior or a causal mask's lower triangle costs nothing; the fused
loops skip empty blocks. :meth:`BlockBias.dense` expands it for the composed path. This module sits below
the backends (they consume ``BlockBias``) and above the plans (``is_causal`` needs each block's row).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from bsrkit import plans
from bsrkit.cache import library_cache, weak_lru_cache

__all__ = ["BlockBias", "after", "block_bias", "cached_block_bias"]


def after(key_col: torch.Tensor, query_row: torch.Tensor) -> torch.Tensor:
    """The causal rule: a key at column ``key_col`` is hidden from a query at row ``query_row`` when it
    comes later (broadcasting)."""
    return key_col > query_row


class BlockBias(NamedTuple):
    """The mask per stored block (:func:`block_bias`): ``block_index`` ``(*Bm, nnz)`` int64, -1 = every entry
    allowed (no bias), -2 = nothing allowed (skipped), ``i >= 0``: add ``values[i]`` ``(Ms, Ns)``;
    ``batch`` = the mask's batch shape ``Bm``."""

    block_index: torch.Tensor
    values: torch.Tensor
    batch: torch.Size

    def dense(self) -> torch.Tensor | None:
        """The bias of every stored entry, ``(*Bm, nnz, Ms, Ns)`` (0 where allowed, ``-inf`` where not),
        or None when every entry is allowed."""
        index = self.block_index
        if not bool((index != -1).any()):
            return None
        Ms, Ns = self.values.shape[-2:]
        bias = torch.zeros((*index.shape, Ms, Ns), dtype=self.values.dtype, device=self.values.device)
        bias[index == -2] = -torch.inf
        partial = index >= 0
        bias[partial] = self.values[index[partial]]
        return bias


def block_bias(mask: torch.Tensor, is_causal: bool, dtype: torch.dtype) -> BlockBias:
    """The mask (and ``is_causal``) per stored block, biases in ``dtype``: a block with every entry
    allowed needs no bias and a block with none is skipped; only the others (a window's edges, a causal
    diagonal, every block of a float mask) get a bias block. O(nnz) time and memory."""
    values = mask.values()
    nnz, Ms, Ns = values.shape[-3:]
    vals = values.reshape(math.prod(values.shape[:-3]), nnz, Ms, Ns)
    device = values.device
    if mask.dtype == torch.bool:
        flat = vals.flatten(-2).view(torch.uint8)  # (amin/amax over bytes: ~30x faster than all/any)
        full, empty = flat.amin(-1) == 1, flat.amax(-1) == 0
    else:
        full = empty = torch.zeros(vals.shape[:2], dtype=torch.bool, device=device)
    if is_causal:
        rows = plans.derive("rows", mask).reshape(vals.shape[:2]).to(device)
        cols = mask.col_indices().reshape(vals.shape[:2]).to(torch.int64)
        # A block's corners decide it: hidden whole when its first key comes after its last query, not at
        # all when its last key does not come after its first query.
        first_row, first_col = rows * Ms, cols * Ns
        empty = empty | after(first_col, first_row + Ms - 1)
        full = full & ~after(first_col + Ns - 1, first_row)
    partial = ~(full | empty)
    index = torch.full(vals.shape[:2], -1, dtype=torch.int64, device=device)
    index[empty] = -2
    pb, pg = partial.nonzero(as_tuple=True)
    index[pb, pg] = torch.arange(pb.numel(), device=device)
    blocks = vals[pb, pg]
    if mask.dtype == torch.bool:
        bias = torch.zeros(blocks.shape, dtype=dtype, device=device).masked_fill_(~blocks, -torch.inf)
    else:
        bias = blocks.to(dtype)
    if is_causal and pb.numel():
        query_row = rows[pb, pg][:, None, None] * Ms + torch.arange(Ms, device=device)[:, None]
        key_col = cols[pb, pg][:, None, None] * Ns + torch.arange(Ns, device=device)
        bias.masked_fill_(after(key_col, query_row), -torch.inf)
    return BlockBias(index.reshape(*values.shape[:-3], nnz), bias, values.shape[:-3])


@library_cache
@weak_lru_cache(maxsize=64, maxbytes=2**28, verify_contents=True)
def _cached(mask: torch.Tensor, values: torch.Tensor, is_causal: bool, dtype: torch.dtype) -> BlockBias:
    # (mask and values: copies; the mask's own values hold no memory, see weak_lru_cache)
    on_copies = torch.sparse_bsr_tensor(
        mask.crow_indices(), mask.col_indices(), values, size=mask.shape, check_invariants=False
    )
    return block_bias(on_copies, is_causal, dtype)


def cached_block_bias(mask: torch.Tensor, is_causal: bool, dtype: torch.dtype) -> BlockBias:
    """:func:`block_bias`, cached for as long as the mask's indices and values live; the values are in
    the key so that a hit proves them unchanged too, whatever wrote them."""
    return _cached(mask, mask.values(), is_causal, dtype)
