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

That is the composed path, on every backend. Where the backend has fused loops (the CPU backend with
MKL, float32/float64, no dropout) one loop per direction does all of it per block row instead, flash-
attention style: the weights are never stored (the forward saves each row's log-sum-exp, the backward
recomputes :math:`W` from it), blocks whose entries are all allowed get no bias work and blocks with none
allowed are skipped (:func:`block_bias`); memory beyond the inputs and outputs is O(L).
``BSRKIT_FUSED_ATTENTION=0`` turns the fused loops off.

The mask builders (:mod:`bsrkit.masks`, re-exported here) return bool BSR masks whose stored blocks are
exactly those holding an allowed entry. NaN in ``query``, ``key`` or the bias reaches the output rows that
attend it, as the math does; an entry a mask excludes stays excluded whatever its score. Under
``torch.compile`` this runs eagerly (a graph break around the compiled loops).
"""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

import torch

from bsrkit import autograd, dispatch, plans
from bsrkit.cache import weak_lru_cache
from bsrkit.eager import eager_under_compile
from bsrkit.masks import (  # (re-exported: the builders lived here)
    block_local_mask,
    causal_mask,
    mask_from_block_mask,
    mask_from_dense,
    sliding_window_mask,
)
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


@eager_under_compile
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
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    fused = _fused_backend(backends, a, query, value, dropout_p)
    args = (backends, fused, a, attn_mask, is_causal, compute, float(scale), float(dropout_p), batch)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return _Attention.apply(query, key, value, *args)
    return _forward(query, key, value, *args)[0]


def _fused_backend(
    backends: tuple[Any, Any, Any], a: Operand, query: torch.Tensor, value: torch.Tensor, dropout_p: float
) -> Any:
    """The backend whose fused loops (``attention_forward``/``attention_backward``, an optional
    capability) take this call, or None: then the composed path (SDDMM, softmax, products) runs.
    ``BSRKIT_FUSED_ATTENTION=0`` turns them off (for testing the composed path). Dropout is composed."""
    sampled, softmax, addmm = backends
    if os.environ.get("BSRKIT_FUSED_ATTENTION", "1") == "0" or not hasattr(addmm, "attention_forward"):
        return None
    if dropout_p > 0 or sampled is not addmm or softmax is not addmm or not a.nnz:
        return None
    if query.shape[-1] == 0 or value.shape[-1] == 0:  # (BLAS rejects a leading dimension of 0)
        return None
    return addmm


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


@weak_lru_cache(maxsize=64, verify_contents=True)
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


class BlockBias(NamedTuple):
    """The mask per stored block (:func:`block_bias`): ``block_index`` ``(*Bm, nnz)`` int64, -1 = every entry
    allowed (no bias), -2 = nothing allowed (skipped), ``i >= 0``: add ``values[i]`` ``(Ms, Ns)``;
    ``batch`` = the mask's batch shape ``Bm``."""

    block_index: torch.Tensor
    values: torch.Tensor
    batch: torch.Size


def block_bias(mask: torch.Tensor, is_causal: bool, dtype: torch.dtype) -> BlockBias:
    """The mask (and ``is_causal``) per stored block, for the fused loops: a block with every entry
    allowed needs no bias and a block with none is skipped; only the others (a window's edges, a causal
    diagonal, every block of a float mask) get a bias block. O(nnz) time and memory."""
    values = mask.values()
    nnz, Ms, Ns = values.shape[-3:]
    vals = values.reshape(-1, nnz, Ms, Ns)
    if mask.dtype == torch.bool:
        flat = vals.flatten(-2).view(torch.uint8)  # (amin/amax over bytes: ~30x faster than all/any)
        full, empty = flat.amin(-1) == 1, flat.amax(-1) == 0
    else:
        full = empty = torch.zeros(vals.shape[:2], dtype=torch.bool, device=values.device)
    if is_causal:
        rows = plans.block_rows(Operand.of(mask).source).reshape(vals.shape[:2]).to(values.device)
        cols = mask.col_indices().reshape(vals.shape[:2]).to(torch.int64)
        future = cols * Ns > rows * Ms + Ms - 1  # every key after every query of the block
        full = full & (cols * Ns + Ns - 1 <= rows * Ms)
        empty = empty | future
    partial = ~(full | empty)
    index = torch.full(vals.shape[:2], -1, dtype=torch.int64, device=values.device)
    index[empty] = -2
    pb, pg = partial.nonzero(as_tuple=True)
    index[pb, pg] = torch.arange(pb.numel(), device=values.device)
    blocks = vals[pb, pg]
    if mask.dtype == torch.bool:
        bias = torch.zeros(blocks.shape, dtype=dtype, device=values.device).masked_fill_(~blocks, -torch.inf)
    else:
        bias = blocks.to(dtype)
    if is_causal and pb.numel():
        first_row = rows[pb, pg][:, None, None] * Ms + torch.arange(Ms, device=values.device)[:, None]
        first_col = cols[pb, pg][:, None, None] * Ns + torch.arange(Ns, device=values.device)
        bias.masked_fill_(first_col > first_row, -torch.inf)
    return BlockBias(index.reshape(*values.shape[:-3], nnz), bias, values.shape[:-3])


@weak_lru_cache(maxsize=64, maxbytes=2**28, verify_contents=True)
def _cached_block_bias(
    mask: torch.Tensor, values: torch.Tensor, is_causal: bool, dtype: torch.dtype
) -> BlockBias:
    """:func:`block_bias`, cached for as long as the mask's indices and values live; ``values`` (the
    mask's) is in the key so that a hit proves them unchanged too, whatever wrote them."""
    return block_bias(mask, is_causal, dtype)


class _Saved(NamedTuple):
    """What the backward needs besides query, key, value: the fused path's output and log-sum-exp and
    the block bias, or the composed path's weights and dropout's kept set."""

    fused: bool
    out: torch.Tensor | None
    lse: torch.Tensor | None
    bias: BlockBias | None
    weights: torch.Tensor | None
    keep: torch.Tensor | None


def _forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    backends: tuple[Any, Any, Any],
    fused: Any,
    a: Operand,
    mask: torch.Tensor,
    is_causal: bool,
    compute: torch.dtype,
    scale: float,
    dropout_p: float,
    batch: torch.Size,
) -> tuple[torch.Tensor, _Saved]:
    if fused is not None:
        bias = _cached_block_bias(mask, mask.values(), is_causal, compute)
        result = fused.attention_forward(a, query, key, value, bias, scale)
        if result is not None:
            return result[0], _Saved(True, result[0], result[1], bias, None, None)
    addmm = backends[2]
    weights = _weights(query, key, backends, a, mask, is_causal, compute, scale, batch)
    keep = None
    dropped = weights
    if dropout_p > 0:
        keep = torch.empty(weights.shape, dtype=torch.bool, device=weights.device).bernoulli_(1 - dropout_p)
        dropped = _apply_dropout(weights, keep, dropout_p)
    out = torch.empty((*batch, query.shape[-2], value.shape[-1]), dtype=query.dtype, device=query.device)
    product = a._replace(values=dropped) if _nonempty(a, out, key.shape[-2]) else None
    dispatch.addmm(_MM, addmm, None, product, value, out, batch, 0.0, 1.0, None)
    return out, _Saved(False, None, None, None, weights, keep)


def _weights(
    query: torch.Tensor,
    key: torch.Tensor,
    backends: tuple[Any, Any, Any],
    a: Operand,
    mask: torch.Tensor,
    is_causal: bool,
    compute: torch.dtype,
    scale: float,
    batch: torch.Size,
) -> torch.Tensor:
    """The attention weights at the stored blocks, composed: SDDMM, then the block-row softmax."""
    sampled, softmax, _ = backends
    scores = dispatch.sampled(_SAMPLED, sampled, a, query, key.mT, batch, scale)
    return dispatch.softmax(softmax, a, scores, _mask_bias(mask, is_causal, compute), zero_empty_rows=True)


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
        fused: Any,
        a: Operand,
        mask: torch.Tensor,
        is_causal: bool,
        compute: torch.dtype,
        scale: float,
        dropout_p: float,
        batch: torch.Size,
    ) -> torch.Tensor:
        out, saved = _forward(
            query, key, value, backends, fused, a, mask, is_causal, compute, scale, dropout_p, batch
        )
        if saved.fused:
            ctx.save_for_backward(query, key, value, saved.out, saved.lse)
        else:
            ctx.save_for_backward(query, key, value, saved.weights, saved.keep)
        ctx.args = (
            backends,
            fused,
            a,
            mask,
            is_causal,
            compute,
            scale,
            dropout_p,
            batch,
            saved.fused,
            saved.bias,
        )
        return out

    @staticmethod
    @autograd.first_order_only("scaled_dot_product_attention")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        backends, fused, a, mask, is_causal, compute, scale, _, batch, was_fused, bias = ctx.args
        query, key, value, x, y = ctx.saved_tensors
        nones = (None,) * 9
        if was_fused:
            result = fused.attention_backward(a, query, key, value, x, y, grad, bias, scale)
            if result is not None:
                dq, dk, dv = result
                return (
                    dq.sum_to_size(query.shape),
                    dk.sum_to_size(key.shape),
                    dv.sum_to_size(value.shape),
                    *nones,
                )
            # (the fused loops declined the backward: recompute the weights, then as composed)
            weights, keep = _weights(query, key, backends, a, mask, is_causal, compute, scale, batch), None
        else:
            weights, keep = x, y
        return (*_composed_backward(ctx, grad, query, key, value, weights, keep), *nones)


def _composed_backward(
    ctx: Any,
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    weights: torch.Tensor,
    keep: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    (sampled, softmax, addmm), _, a, _, _, _, scale, dropout_p, batch, _, _ = ctx.args
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
    return grad_q, grad_k, grad_v
