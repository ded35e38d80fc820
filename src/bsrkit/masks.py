"""The builders of block-sparse attention masks: bool BSR masks ``(L, S)`` whose stored blocks are
exactly those holding an allowed entry, with each entry's value saying whether it is allowed. They take
O(nnz) time and memory (each block row's stored blocks follow from the window's bounds; only their entries
are evaluated). Each runs eagerly under ``torch.compile`` (a graph break: an index construction, not a
product; Inductor failed to compile them). Used by :func:`bsrkit.scaled_dot_product_attention`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from bsrkit.eager import eager_under_compile
from bsrkit.validation import ArgumentTypeError, check_blocksize, check_data_device, check_size, type_name

__all__ = [
    "block_local_mask",
    "causal_mask",
    "mask_from_block_mask",
    "mask_from_dense",
    "sliding_window_mask",
]


def _check_divides(op: str, blocksize: tuple[int, int], L: int, S: int) -> None:
    if L % blocksize[0] or S % blocksize[1]:
        raise ValueError(f"{op}(): expected the blocksize {blocksize} to divide (L, S) == {(L, S)}")


def _lengths(op: str, L: Any, S: Any) -> tuple[int, int]:
    """``(L, S)``, ``S`` defaulting to ``L``: ints >= 0."""
    L = check_size(op, "L", L)
    return L, L if S is None else check_size(op, "S", S)


def _from_intervals(
    op: str,
    L: int,
    S: int,
    blocksize: tuple[int, int],
    intervals: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    allowed: Any,
    device: torch.device | str | None,
) -> torch.Tensor:
    """The bool BSR ``(L, S)`` whose candidate blocks are the block-column ``intervals`` (row, start, end
    exclusive; sorted by row, then start; disjoint) and whose values are ``allowed(i, j, r, c)`` (entry
    and block indices as broadcast tensors). Candidates holding no allowed entry are dropped. O(nnz) time
    and memory: only the stored blocks' entries are ever evaluated."""
    Ms, Ns = blocksize
    _check_divides(op, (Ms, Ns), L, S)
    MB = L // Ms
    row, start, end = intervals
    keep = end > start
    row, start, end = row[keep], start[keep], end[keep]
    lengths = end - start
    nnz = int(lengths.sum())
    rows = torch.repeat_interleave(row, lengths)
    first = torch.cumsum(lengths, 0) - lengths  # index of each interval's first block
    cols = torch.repeat_interleave(start - first, lengths) + torch.arange(nnz, device=device)
    r, c = rows[:, None, None], cols[:, None, None]
    i = r * Ms + torch.arange(Ms, device=device)[:, None]
    j = c * Ns + torch.arange(Ns, device=device)
    values = allowed(i, j, r, c).expand(nnz, Ms, Ns)
    stored = values.reshape(nnz, -1).view(torch.uint8).amax(-1).bool() if nnz else rows.bool()
    if not bool(stored.all()):
        rows, cols, values = rows[stored], cols[stored], values[stored]
    crow = torch.zeros(MB + 1, dtype=torch.int64, device=device)
    crow[1:] = torch.bincount(rows, minlength=MB).cumsum(0)
    return torch.sparse_bsr_tensor(
        crow,
        cols,
        values.contiguous(),
        size=(L, S),
        check_invariants=False,  # (built valid)
    )


@eager_under_compile
def sliding_window_mask(
    L: int,
    window: int | tuple[int, int],
    blocksize: int | tuple[int, int] = 128,
    S: int | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Query ``i`` attends to keys ``i - left <= j <= i + right``, with ``window`` = ``w`` meaning
    ``left = right = w`` (``(w, 0)``: causal sliding window). ``S`` defaults to ``L``. O(nnz) time and
    memory: the stored blocks of block row ``r`` are the block columns meeting
    ``[r Ms - left, r Ms + Ms - 1 + right]``."""
    op = "sliding_window_mask"
    if isinstance(window, (tuple, list)) and len(window) != 2:
        raise ArgumentTypeError(f"{op}(): expected window to be an int or a pair of ints, got {window!r}")
    pair = window if isinstance(window, (tuple, list)) else (window, window)
    left, right = (check_size(op, "window", w) for w in pair)
    L, S = _lengths(op, L, S)
    Ms, Ns = check_blocksize(op, blocksize)
    device = check_data_device(op, device)
    r = torch.arange(L // Ms if L % Ms == 0 else 0, device=device)
    lo = (r * Ms - left).clamp(min=0)  # first and last allowed key column of the block row
    hi = (r * Ms + Ms - 1 + right).clamp(max=S - 1)
    start = torch.div(lo, Ns, rounding_mode="floor")
    end = torch.where(lo <= hi, torch.div(hi, Ns, rounding_mode="floor") + 1, start)
    return _from_intervals(
        op, L, S, (Ms, Ns), (r, start, end), lambda i, j, r, c: (j >= i - left) & (j <= i + right), device
    )


@eager_under_compile
def causal_mask(
    L: int,
    blocksize: int | tuple[int, int] = 128,
    S: int | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Query ``i`` attends to keys ``j <= i`` (top-left aligned, as ``is_causal`` in torch). O(nnz)."""
    op = "causal_mask"
    L, S = _lengths(op, L, S)
    Ms, Ns = check_blocksize(op, blocksize)
    device = check_data_device(op, device)
    r = torch.arange(L // Ms if L % Ms == 0 else 0, device=device)
    hi = (r * Ms + Ms - 1).clamp(max=S - 1)
    end = torch.where(hi >= 0, torch.div(hi, Ns, rounding_mode="floor") + 1, 0)
    return _from_intervals(
        op, L, S, (Ms, Ns), (r, torch.zeros_like(r), end), lambda i, j, r, c: j <= i, device
    )


@eager_under_compile
def block_local_mask(
    L: int,
    blocksize: int | tuple[int, int] = 128,
    S: int | None = None,
    *,
    neighbours: int = 0,
    global_tokens: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Block-local attention with global tokens (Longformer/BigBird style): query block ``r`` attends to
    key blocks ``r - neighbours .. r + neighbours`` (blocks of ``blocksize``), the first
    ``global_tokens`` queries attend to every key, and every query attends to the first
    ``global_tokens`` keys. O(nnz): each block row stores at most two runs of block columns."""
    op = "block_local_mask"
    Ms, Ns = check_blocksize(op, blocksize)
    neighbours = check_size(op, "neighbours", neighbours)
    global_tokens = check_size(op, "global_tokens", global_tokens)
    L, S = _lengths(op, L, S)
    device = check_data_device(op, device)
    NB = S // Ns if S % Ns == 0 else 0
    r = torch.arange(L // Ms if L % Ms == 0 else 0, device=device)
    g = global_tokens
    n_global = min(-(-g // Ns), NB)  # block columns holding a global key
    local_lo = (r - neighbours).clamp(min=0)
    local_hi = torch.maximum((r + neighbours + 1).clamp(max=NB), local_lo)  # (exclusive)
    global_row = r * Ms < g  # the block row holds a global query: every column
    merged = local_lo <= n_global  # [0, n_global) and the local run touch: one run
    first_end = torch.where(merged, torch.maximum(local_hi, torch.full_like(r, n_global)), n_global)
    first_end = torch.where(global_row, NB, first_end)
    second_start = torch.where(merged | global_row, first_end, local_lo)
    second_end = torch.where(merged | global_row, first_end, local_hi)
    rows = torch.stack([r, r], 1).reshape(-1)
    starts = torch.stack([torch.zeros_like(r), second_start], 1).reshape(-1)
    ends = torch.stack([first_end, second_end], 1).reshape(-1)

    def allowed(i: torch.Tensor, j: torch.Tensor, r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return ((c - r).abs() <= neighbours) | (i < g) | (j < g)

    return _from_intervals(op, L, S, (Ms, Ns), (rows, starts, ends), allowed, device)


@eager_under_compile
def mask_from_dense(mask: torch.Tensor, blocksize: int | tuple[int, int]) -> torch.Tensor:
    """The bool BSR of a dense bool mask ``(*B, L, S)``: the blocks holding a True entry are stored, with
    the mask's values. Batched masks store the union of the batches' blocks (a batched BSR tensor has one
    block count), False where a batch has nothing."""
    op = "mask_from_dense"
    if not isinstance(mask, torch.Tensor) or mask.layout is not torch.strided or mask.dtype != torch.bool:
        got = f"{mask.layout}, {mask.dtype}" if isinstance(mask, torch.Tensor) else type_name(mask)
        raise ArgumentTypeError(f"{op}(): expected mask to be a strided bool tensor, got {got}")
    if mask.ndim < 2:
        raise ValueError(f"{op}(): expected mask of shape (*B, L, S), got {tuple(mask.shape)}")
    if mask.is_meta:
        raise ValueError(f"{op}(): expected mask to hold data, got a tensor on the meta device")
    Ms, Ns = check_blocksize(op, blocksize)
    *batch, L, S = mask.shape
    _check_divides(op, (Ms, Ns), L, S)
    nb = math.prod(batch)  # (explicit sizes: a mask with no entry has no -1 to infer)
    blocks = mask.reshape(nb, L // Ms, Ms, S // Ns, Ns).transpose(2, 3)  # (B, MB, NB, Ms, Ns)
    stored = blocks.flatten(3).any(-1).any(0)  # (MB, NB): the union over batches
    counts = stored.sum(1)
    crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    r, c = stored.nonzero(as_tuple=True)
    values = blocks[:, r, c]  # (B, nnz, Ms, Ns)
    return torch.sparse_bsr_tensor(
        crow.expand(*batch, -1).contiguous() if batch else crow,
        c.expand(nb, -1).reshape(*batch, c.numel()).contiguous() if batch else c,
        values.reshape(*batch, *values.shape[1:]).contiguous() if batch else values[0].contiguous(),
        size=mask.shape,
    )


@eager_under_compile
def mask_from_block_mask(block_mask: Any) -> torch.Tensor:
    """The bool BSR of a FlexAttention ``BlockMask`` (``torch.nn.attention.flex_attention``), without
    compiling: its full blocks are stored all True; its partial blocks are stored with ``mask_mod``
    evaluated eagerly on their entries (``mask_mod`` must accept broadcast index tensors, as plain
    tensor expressions do). A BlockMask with batch or head size 1 broadcasts; otherwise the result is
    batched ``(B, H, L, S)`` with the union of the patterns."""
    op = "mask_from_block_mask"
    if not all(hasattr(block_mask, a) for a in ("seq_lengths", "BLOCK_SIZE", "kv_num_blocks", "mask_mod")):
        raise ArgumentTypeError(
            f"{op}(): expected block_mask to be a torch.nn.attention.flex_attention.BlockMask, got "
            f"{type_name(block_mask)}"
        )
    L, S = block_mask.seq_lengths
    Ms, Ns = block_mask.BLOCK_SIZE
    B, H, MB = block_mask.kv_num_blocks.shape
    NB = -(-S // Ns)
    _check_divides(op, (Ms, Ns), L, S)
    if L // Ms != MB:  # (a sliced BlockMask keeps the whole seq_lengths: its rows would start at 0)
        raise ValueError(
            f"{op}(): expected block_mask to hold the {L // Ms} block rows of its seq_lengths {(L, S)}, got "
            f"{MB} (a BlockMask sliced along the queries: build the mask of the whole sequence)"
        )
    device = block_mask.kv_num_blocks.device

    def dense_blocks(num: torch.Tensor | None, idx: torch.Tensor | None) -> torch.Tensor:
        present = torch.zeros((B, H, MB, NB + 1), dtype=torch.bool, device=device)
        if num is not None and idx is not None:
            k = torch.arange(idx.shape[-1], device=device)
            cols = torch.where(k < num[..., None], idx.long(), NB)
            present.scatter_(-1, cols, True)
        return present[..., :NB]

    full = dense_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    partial = dense_blocks(block_mask.kv_num_blocks, block_mask.kv_indices) & ~full
    stored = (full | partial).flatten(0, 1).any(0)  # (MB, NB), union over (B, H)
    r, c = stored.nonzero(as_tuple=True)
    q_idx = r[:, None, None] * Ms + torch.arange(Ms, device=device)[:, None]  # (nnz, Ms, 1)
    kv_idx = c[:, None, None] * Ns + torch.arange(Ns, device=device)  # (nnz, 1, Ns)
    b_idx = torch.arange(B, device=device)[:, None, None, None, None]
    h_idx = torch.arange(H, device=device)[None, :, None, None, None]
    values = full[:, :, r, c][..., None, None].expand(B, H, r.numel(), Ms, Ns).clone()
    is_partial = partial[:, :, r, c]
    if bool(is_partial.any()):
        evaluated = block_mask.mask_mod(b_idx, h_idx, q_idx[None, None], kv_idx[None, None])
        evaluated = evaluated.expand(B, H, r.numel(), Ms, Ns)
        values = torch.where(is_partial[..., None, None], evaluated, values)
    counts = stored.sum(1)
    crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    if B == 1 and H == 1:
        return torch.sparse_bsr_tensor(crow, c, values[0, 0].contiguous(), size=(L, S))
    return torch.sparse_bsr_tensor(
        crow.expand(B, H, -1).contiguous(),
        c.expand(B, H, -1).contiguous(),
        values.contiguous(),
        size=(B, H, L, S),
    )
