r"""Block-sparse scaled dot-product attention, and the masks it takes.

With a BSR mask :math:`A` of pattern :math:`P` (its stored blocks), scale :math:`s` and bias :math:`C`
(the mask's values within :math:`P`, see :func:`scaled_dot_product_attention`):

.. math::
    S = s\,(Q K^T)|_P + C, \qquad W = \mathrm{softmax}_{\mathrm{row}}(S), \qquad O = W V,

computed as a sampled product (SDDMM, only at :math:`P`), the block-row softmax
(:func:`bsrkit.bsr_softmax`'s kernel) and a BSR times dense product, so work and memory are
:math:`O(\mathrm{nnz})`, never :math:`O(L S)`. The backward reuses the pattern's plans:

.. math::
    dV = W^T dO, \quad dW = (dO\,V^T)|_P, \quad dS = W \odot (dW - \mathrm{rowsum}(dW \odot W)), \quad
    dQ = s\, dS\, K, \quad dK = s\, dS^T Q,

with :math:`dV` and :math:`dK` the transposed product over the cached transpose plan and :math:`dW` an
SDDMM. With dropout, :math:`W` is replaced by :math:`W \odot M / (1-p)` in :math:`O` and :math:`dV`, and
:math:`dW` is multiplied by :math:`M / (1-p)`.

The builders return bool BSR masks ``(L, S)`` whose stored blocks are exactly those holding an allowed
entry, with each entry's value saying whether it is allowed.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from bsrkit import dispatch, plans
from bsrkit.cache import weak_lru_cache
from bsrkit.operand import Operand
from bsrkit.validation import (
    SUPPORTED_DTYPES,
    broadcast_batch,
    check_same_device,
    check_same_dtype,
    check_strided,
)

__all__ = [
    "block_local_mask",
    "causal_mask",
    "mask_from_block_mask",
    "mask_from_dense",
    "scaled_dot_product_attention",
    "sliding_window_mask",
]

_OP = "scaled_dot_product_attention"
# The products' own names, under which the tuning table keys their parameters.
_SAMPLED, _MM, _MM_T = "sampled_addmm", "bsr_dense_mm", "bsr_transposed_dense_mm"


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    r"""Attention restricted to the stored blocks of the BSR ``attn_mask``:
    :math:`\mathrm{softmax}(s\,QK^T + C)\,V` over the allowed entries (see the module's docstring).

    * ``query`` ``(*B, L, E)``, ``key`` ``(*B, S, E)``, ``value`` ``(*B, S, Ev)``; the batch dimensions
      (e.g. ``(batch, heads)``) broadcast with each other and with ``attn_mask``'s. Returns
      ``(*batch, L, Ev)``.
    * ``attn_mask``: a BSR tensor ``(L, S)`` shared by every batch and head, or ``(*Bm, L, S)``. Entries
      outside its stored blocks are excluded. Within them, as in
      ``torch.nn.functional.scaled_dot_product_attention``: a bool mask's False entries are excluded, a
      float mask's values (``query``'s dtype) are added to the scores. (``torch.sparse._triton_ops.
      _scaled_dot_product_attention`` instead ignores the values inside stored blocks, rejects
      ``is_causal`` and has no backward.)
    * ``is_causal``: also exclude key ``j > i`` for query ``i`` (top-left aligned, torch's convention);
      it combines with the mask.
    * A query row with no allowed entry gives 0 (not NaN), and gradient 0.
    * ``dropout_p``: dropout of the attention weights as in torch (kept weights scaled by
      :math:`1/(1-p)`; applied whenever ``dropout_p > 0``).
    * ``scale``: :math:`s`, default :math:`1/\sqrt{E}`.

    Differentiable in ``query``, ``key`` and ``value`` (not in a float mask's values). Half types:
    products and softmax accumulate in float32.
    """
    _check_inputs(query, key, value, attn_mask)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p <= 1:
        raise ValueError(f"{_OP}(): expected dropout_p to be a number in [0, 1], got {dropout_p!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"{_OP}(): expected is_causal to be a bool, got {type(is_causal).__name__}")
    if scale is None:
        if query.shape[-1] == 0:
            raise ValueError(f"{_OP}(): expected query.shape[-1] > 0 when scale is None (1/sqrt(E)), got 0")
        scale = 1 / math.sqrt(query.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{_OP}(): expected scale to be a real number or None, got {type(scale).__name__}")
    batch = broadcast_batch(
        _OP,
        ("query", "key", "value", "attn_mask"),
        (query.shape[:-2], key.shape[:-2], value.shape[:-2], attn_mask.shape[:-2]),
    )
    device, dtype = query.device, query.dtype
    backends = (
        dispatch.select(_OP, "sampled", device, dtype),
        dispatch.select(_OP, "softmax", device, dtype),
        dispatch.select(_OP, "addmm", device, dtype),
    )
    a = Operand.of(_pattern(attn_mask, tuple(batch)))
    bias = _mask_bias(
        attn_mask, is_causal, torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    )
    args = (backends, a, bias, float(scale), float(dropout_p), batch)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return _Attention.apply(query, key, value, *args)
    return _forward(query, key, value, *args, need_weights=False)[0]


def _check_inputs(query: Any, key: Any, value: Any, attn_mask: Any) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_strided(_OP, name, t)
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{_OP}(): expected query.dtype in {SUPPORTED_DTYPES}, got {query.dtype}")
    for name, t in (("key", key), ("value", value)):
        check_same_dtype(_OP, name, t, "query", query)
        check_same_device(_OP, name, t, "query", query)
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.layout is not torch.sparse_bsr:
        got = attn_mask.layout if isinstance(attn_mask, torch.Tensor) else type(attn_mask).__name__
        raise TypeError(
            f"{_OP}(): expected attn_mask to be a torch.sparse_bsr tensor (its stored blocks bound the "
            f"work; see bsrkit.sliding_window_mask and the other builders), got {got}"
        )
    if attn_mask.dense_dim() != 0:
        raise ValueError(f"{_OP}(): expected attn_mask.dense_dim() == 0, got {attn_mask.dense_dim()}")
    if attn_mask.dtype not in (torch.bool, query.dtype):
        raise TypeError(
            f"{_OP}(): expected attn_mask.dtype to be torch.bool or {query.dtype}, got {attn_mask.dtype}"
        )
    check_same_device(_OP, "attn_mask", attn_mask, "query", query)
    L, E = query.shape[-2:]
    S = key.shape[-2]
    if key.shape[-1] != E:
        raise ValueError(f"{_OP}(): expected key.shape[-1] == {E} (query.shape[-1]), got {key.shape[-1]}")
    if value.shape[-2] != S:
        raise ValueError(f"{_OP}(): expected value.shape[-2] == {S} (key.shape[-2]), got {value.shape[-2]}")
    if tuple(attn_mask.shape[-2:]) != (L, S):
        raise ValueError(
            f"{_OP}(): expected attn_mask.shape[-2:] == {(L, S)} (query.shape[-2], key.shape[-2]), got "
            f"{tuple(attn_mask.shape[-2:])}"
        )


@weak_lru_cache(maxsize=64)
def _expanded_pattern(mask: torch.Tensor, batch: tuple[int, ...]) -> torch.Tensor:
    # Broadcast views of copies of the mask's indices, cached so that the plans keyed on them live with
    # the mask's index memory. Copies: a view of that memory in the entry would keep it alive forever.
    crow, col = mask.crow_indices().clone(), mask.col_indices().clone()
    block = mask.values().shape[-3:]
    return torch.sparse_bsr_tensor(
        crow.expand(*batch, crow.shape[-1]),
        col.expand(*batch, col.shape[-1]),
        torch.zeros((), dtype=torch.bool, device=mask.device).expand(*batch, *block),
        size=(*batch, *mask.shape[-2:]),
        check_invariants=False,  # views of a BSR tensor torch accepted
    )


def _pattern(mask: torch.Tensor, batch: tuple[int, ...]) -> torch.Tensor:
    """The mask with its indices broadcast to the call's batch: the kernels walk one pattern per batch
    index. Its plans (block rows, transpose, CPU work split) are cached for as long as the mask lives."""
    return mask if tuple(mask.shape[:-2]) == batch else _expanded_pattern(mask, batch)


def _mask_bias(mask: torch.Tensor, is_causal: bool, dtype: torch.dtype) -> torch.Tensor | None:
    """``(*Bm, nnz, Ms, Ns)`` added to the scores inside the stored blocks (``-inf`` excludes an entry),
    or None when it would be all zeros. O(nnz) elements, computed per call (mask values may change)."""
    values = mask.values()
    bias = None
    if mask.dtype == torch.bool:
        if values.numel() and not bool(values.all()):
            bias = torch.zeros(values.shape, dtype=dtype, device=values.device).masked_fill_(
                ~values, -torch.inf
            )
    else:
        bias = values.to(dtype)
    if is_causal and values.numel():
        Ms, Ns = values.shape[-2:]
        rows = plans.block_rows(Operand.of(mask).source).reshape(values.shape[:-2]).to(values.device)
        cols = mask.col_indices().to(torch.int64)
        first_row = rows[..., None, None] * Ms + torch.arange(Ms, device=values.device)[:, None]
        first_col = cols[..., None, None] * Ns + torch.arange(Ns, device=values.device)
        future = first_col > first_row  # (*Bm, nnz, Ms, Ns)
        if bool(future.any()):
            bias = (
                torch.zeros(values.shape, dtype=dtype, device=values.device) if bias is None else bias.clone()
            )
            bias.masked_fill_(future, -torch.inf)
    return bias


def _forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    backends: tuple[Any, Any, Any],
    a: Operand,
    bias: torch.Tensor | None,
    scale: float,
    dropout_p: float,
    batch: torch.Size,
    need_weights: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(output, attention weights W at the stored blocks, dropout's kept set or None); W is None when
    ``need_weights`` is False and the fused kernel ran."""
    sampled, softmax, addmm = backends
    fused = getattr(addmm, "attention_forward", None)  # an optional capability (CPU: one fused loop)
    if fused is not None and dropout_p == 0 and sampled is addmm and softmax is addmm and a.nnz:
        result = fused(a, query, key, value, bias, scale, need_weights)
        if result is not None:
            return result[0], result[1], None
    scores = dispatch.sampled(_SAMPLED, sampled, a, query, key.mT, batch, scale)
    weights = dispatch.softmax(softmax, a, scores, bias, zero_empty_rows=True)
    del scores
    keep = None
    dropped = weights
    if dropout_p > 0:
        keep = torch.empty(weights.shape, dtype=torch.bool, device=weights.device).bernoulli_(1 - dropout_p)
        dropped = _apply_dropout(weights, keep, dropout_p)
    out = torch.empty((*batch, query.shape[-2], value.shape[-1]), dtype=query.dtype, device=query.device)
    product = a._replace(values=dropped) if _nonempty(a, out, key.shape[-2]) else None
    dispatch.addmm(_MM, addmm, None, product, value, out, batch, 0.0, 1.0, None)
    return out, weights, keep


def _apply_dropout(w: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    if p == 1:
        return torch.zeros_like(w)
    return w.masked_fill(~keep, 0).mul_(1 / (1 - p))


def _nonempty(a: Operand, out: torch.Tensor, inner: int) -> bool:
    """Whether a product with ``a`` into ``out`` over an inner dimension of ``inner`` does any work."""
    return bool(a.nnz and inner and out.numel())


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        backends: tuple[Any, Any, Any],
        a: Operand,
        bias: torch.Tensor | None,
        scale: float,
        dropout_p: float,
        batch: torch.Size,
    ) -> torch.Tensor:
        out, weights, keep = _forward(query, key, value, backends, a, bias, scale, dropout_p, batch)
        ctx.save_for_backward(query, key, value, weights, keep)
        ctx.args = (backends, a, scale, dropout_p, batch)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        query, key, value, weights, keep = ctx.saved_tensors
        (sampled, softmax, addmm), a, scale, dropout_p, batch = ctx.args
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        L, S = query.shape[-2], key.shape[-2]
        grad_q = grad_k = grad_v = None
        if need_v:
            # dV = W^T dO: the transposed product over the pattern's cached transpose plan.
            dropped = weights if keep is None else _apply_dropout(weights, keep, dropout_p)
            dv = torch.empty((*batch, S, value.shape[-1]), dtype=grad.dtype, device=grad.device)
            product = a._replace(values=dropped).transposed() if _nonempty(a, dv, L) else None
            dispatch.addmm(_MM_T, addmm, None, product, grad, dv, batch, 0.0, 1.0, None)
            grad_v = dv.sum_to_size(value.shape)
        if need_q or need_k:
            # dW = (dO V^T)|P (SDDMM), then the softmax's backward.
            dw = dispatch.sampled(_SAMPLED, sampled, a, grad, value.mT, batch, 1.0)
            if keep is not None:
                dw = _apply_dropout(dw, keep, dropout_p)
            ds = dispatch.softmax_backward(softmax, a, weights, dw)
            del dw
            if need_q:
                dq = torch.empty((*batch, L, query.shape[-1]), dtype=grad.dtype, device=grad.device)
                product = a._replace(values=ds) if _nonempty(a, dq, S) else None
                dispatch.addmm(_MM, addmm, None, product, key, dq, batch, 0.0, scale, None)
                grad_q = dq.sum_to_size(query.shape)
            if need_k:
                dk = torch.empty((*batch, S, key.shape[-1]), dtype=grad.dtype, device=grad.device)
                product = a._replace(values=ds).transposed() if _nonempty(a, dk, L) else None
                dispatch.addmm(_MM_T, addmm, None, product, query, dk, batch, 0.0, scale, None)
                grad_k = dk.sum_to_size(key.shape)
        return grad_q, grad_k, grad_v, None, None, None, None, None, None


# -- mask builders -------------------------------------------------------------------------------------


def _blocksize(op: str, blocksize: Any) -> tuple[int, int]:
    bs = (
        (blocksize, blocksize)
        if isinstance(blocksize, int) and not isinstance(blocksize, bool)
        else blocksize
    )
    if (
        not isinstance(bs, tuple)
        or len(bs) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in bs)
    ):
        raise ValueError(f"{op}(): expected blocksize to be an int >= 1 or a pair of them, got {blocksize!r}")
    return bs


def _from_allowed(
    op: str,
    allowed: Any,
    L: int,
    S: int,
    blocksize: tuple[int, int],
    device: torch.device | str | None,
) -> torch.Tensor:
    """The bool BSR of ``allowed(rows, cols)`` (a function of broadcast index tensors), storing the blocks
    that hold an allowed entry. Evaluated per block row, so memory stays O(stored blocks)."""
    Ms, Ns = blocksize
    if L % Ms or S % Ns:
        raise ValueError(f"{op}(): expected the blocksize {blocksize} to divide (L, S) == {(L, S)}")
    MB, NB = L // Ms, S // Ns
    col_ids = torch.arange(S, device=device)
    crow = [0]
    cols, vals = [], []
    for r in range(MB):
        rows = torch.arange(r * Ms, (r + 1) * Ms, device=device)
        ok = allowed(rows[:, None], col_ids[None, :]).expand(Ms, S)  # (Ms, S) for one block row
        blocks = ok.reshape(Ms, NB, Ns).transpose(0, 1)  # (NB, Ms, Ns)
        stored = blocks.flatten(1).any(1).nonzero().flatten()
        cols.append(stored)
        vals.append(blocks[stored])
        crow.append(crow[-1] + stored.numel())
    return torch.sparse_bsr_tensor(
        torch.tensor(crow, dtype=torch.int64, device=device),
        torch.cat(cols) if cols else torch.zeros(0, dtype=torch.int64, device=device),
        torch.cat(vals) if vals else torch.zeros((0, Ms, Ns), dtype=torch.bool, device=device),
        size=(L, S),
    )


def sliding_window_mask(
    L: int,
    window: int | tuple[int, int],
    blocksize: int | tuple[int, int] = 128,
    S: int | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Query ``i`` attends to keys ``i - left <= j <= i + right``, with ``window`` = ``w`` meaning
    ``left = right = w`` (``(w, 0)``: causal sliding window). ``S`` defaults to ``L``."""
    op = "sliding_window_mask"
    left, right = (window, window) if isinstance(window, int) else window
    if left < 0 or right < 0:
        raise ValueError(f"{op}(): expected window sizes >= 0, got {window!r}")
    return _from_allowed(
        op,
        lambda i, j: (j >= i - left) & (j <= i + right),
        L,
        L if S is None else S,
        _blocksize(op, blocksize),
        device,
    )


def causal_mask(
    L: int,
    blocksize: int | tuple[int, int] = 128,
    S: int | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Query ``i`` attends to keys ``j <= i`` (top-left aligned, as ``is_causal`` in torch)."""
    op = "causal_mask"
    return _from_allowed(op, lambda i, j: j <= i, L, L if S is None else S, _blocksize(op, blocksize), device)


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
    ``global_tokens`` keys."""
    op = "block_local_mask"
    Ms, Ns = _blocksize(op, blocksize)
    if neighbours < 0 or global_tokens < 0:
        raise ValueError(
            f"{op}(): expected neighbours >= 0 and global_tokens >= 0, got {neighbours}, {global_tokens}"
        )

    def allowed(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        local = (j // Ns - i // Ms).abs() <= neighbours
        return local | (i < global_tokens) | (j < global_tokens)

    return _from_allowed(op, allowed, L, L if S is None else S, (Ms, Ns), device)


def mask_from_dense(mask: torch.Tensor, blocksize: int | tuple[int, int]) -> torch.Tensor:
    """The bool BSR of a dense bool mask ``(*B, L, S)``: the blocks holding a True entry are stored, with
    the mask's values. Batched masks store the union of the batches' blocks (a batched BSR tensor has one
    block count), False where a batch has nothing."""
    op = "mask_from_dense"
    if not isinstance(mask, torch.Tensor) or mask.layout is not torch.strided or mask.dtype != torch.bool:
        got = f"{mask.layout}, {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"{op}(): expected a strided bool tensor, got {got}")
    if mask.ndim < 2:
        raise ValueError(f"{op}(): expected mask of shape (*B, L, S), got {tuple(mask.shape)}")
    Ms, Ns = _blocksize(op, blocksize)
    *batch, L, S = mask.shape
    if L % Ms or S % Ns:
        raise ValueError(f"{op}(): expected the blocksize {(Ms, Ns)} to divide (L, S) == {(L, S)}")
    blocks = mask.reshape(-1, L // Ms, Ms, S // Ns, Ns).transpose(2, 3)  # (B, MB, NB, Ms, Ns)
    stored = blocks.flatten(3).any(-1).any(0)  # (MB, NB): the union over batches
    counts = stored.sum(1)
    crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    r, c = stored.nonzero(as_tuple=True)
    values = blocks[:, r, c]  # (B, nnz, Ms, Ns)
    nb = values.shape[0]
    return torch.sparse_bsr_tensor(
        crow.expand(*batch, -1).contiguous() if batch else crow,
        c.expand(nb, -1).reshape(*batch, -1).contiguous() if batch else c,
        values.reshape(*batch, *values.shape[1:]).contiguous() if batch else values[0].contiguous(),
        size=mask.shape,
    )


def mask_from_block_mask(block_mask: Any) -> torch.Tensor:
    """The bool BSR of a FlexAttention ``BlockMask`` (``torch.nn.attention.flex_attention``), without
    compiling: its full blocks are stored all True; its partial blocks are stored with ``mask_mod``
    evaluated eagerly on their entries (``mask_mod`` must accept broadcast index tensors, as plain
    tensor expressions do). A BlockMask with batch or head size 1 broadcasts; otherwise the result is
    batched ``(B, H, L, S)`` with the union of the patterns."""
    op = "mask_from_block_mask"
    L, S = block_mask.seq_lengths
    Ms, Ns = block_mask.BLOCK_SIZE
    B, H, MB = block_mask.kv_num_blocks.shape
    NB = -(-S // Ns)
    if L % Ms or S % Ns:
        raise ValueError(f"{op}(): expected the block size {(Ms, Ns)} to divide (L, S) == {(L, S)}")
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
