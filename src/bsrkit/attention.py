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
allowed are skipped (:func:`bsrkit.mask_bias.block_bias`); memory beyond the inputs and outputs is O(L).
``BSRKIT_FUSED_ATTENTION=0`` turns the fused loops off.

The mask builders (:mod:`bsrkit.masks`, re-exported here) return bool BSR masks whose stored blocks are
exactly those holding an allowed entry. NaN in ``query``, ``key`` or the bias reaches the output rows that
attend it, as the math does; an entry a mask excludes stays excluded whatever its score. NaN or Inf in
``value`` reaches the output of every row whose stored blocks hold its key, allowed or not: the excluded
entries of a stored block weigh it by an exact 0, and 0 * Inf is NaN (torch's SDPA weighs every key so,
and gives NaN in every row), a row with no allowed entry included; so does NaN or Inf in ``key`` reach
those rows' ``query`` gradient. The fused CPU loops differ in what they skip whole: stored blocks with
no allowed entry (a bool block all False, or one ``is_causal`` hides), which the composed path and the
Triton kernel read. Under
``torch.compile`` this runs eagerly (a graph break around the compiled loops).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import torch

from bsrkit import autograd, dispatch, plans
from bsrkit.backends.base import Backend, FusedAttention, fused_attention
from bsrkit.cache import library_cache, weak_lru_cache
from bsrkit.eager import eager_under_compile
from bsrkit.environment import flag
from bsrkit.mask_bias import BlockBias, cached_block_bias
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
    ArgumentTypeError,
    autocast_inputs,
    broadcast_batch,
    check_same_device,
    check_same_dtype,
    check_strided,
    resolved,
    type_name,
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


def _first_duplicate(source: Any) -> tuple[int, int, int] | None:
    """(batch, block row, block column) of the first block column a row of the pattern stores twice, or
    None. Products sum what is stored (a duplicate is two terms); attention must not weigh keys twice."""
    _, col = plans.indices(source)
    rows = plans.derive("rows", source)
    width = int(col.max()) + 1 if col.numel() else 1
    ordered = (rows * width + col).sort(dim=1).values
    twice = ordered[:, 1:] == ordered[:, :-1]
    if not bool(twice.any()):
        return None
    b, i = (int(v) for v in twice.nonzero()[0])
    key = int(ordered[b, i])
    return b, key // width, key % width


_DUPLICATE_PLAN = "attention_duplicate_block"
plans.register(_DUPLICATE_PLAN, _first_duplicate)
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
    * A query row with no allowed entry gives 0 (not NaN), and gradient 0, unless a key of its stored
      blocks has a NaN or Inf value (0 times it is NaN, as in torch's SDPA; the fused CPU loops skip the
      blocks with no allowed entry at all).
    * ``dropout_p``: dropout of the attention weights as in torch (kept weights scaled by
      :math:`1/(1-p)`; applied whenever ``dropout_p > 0``).
    * ``scale``: :math:`s`, default :math:`1/\sqrt{E}`.

    Differentiable in ``query``, ``key`` and ``value``; a float mask whose values require grad is refused
    under grad mode (its values are not differentiated: a learned bias would get no gradient). Half types:
    products and softmax accumulate in float32. Under ``torch.autocast`` the float32 and half inputs are
    cast to the autocast dtype first, as torch's SDPA's are there (float64 ones are left as they are).
    """
    query, key, value, attn_mask = autocast_inputs((query, key, value, attn_mask))  # (as torch's SDPA)
    _check_inputs(query, key, value, attn_mask)
    query, key, value = resolved(query), resolved(key), resolved(value)  # (the kernels read memory)
    # (numbers.Real: numpy's scalars too, as torch's SDPA takes them)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise ArgumentTypeError(
            f"{_OP}(): expected dropout_p to be a real number, got {type_name(dropout_p)}"
        )
    if not 0 <= dropout_p <= 1:
        raise ValueError(f"{_OP}(): expected dropout_p in [0, 1], got {dropout_p!r}")
    if not isinstance(is_causal, bool):
        raise ArgumentTypeError(f"{_OP}(): expected is_causal to be a bool, got {type_name(is_causal)}")
    if scale is None:
        if query.shape[-1] == 0:
            raise ValueError(f"{_OP}(): expected query.shape[-1] > 0 when scale is None (1/sqrt(E)), got 0")
        scale = 1 / math.sqrt(query.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ArgumentTypeError(
            f"{_OP}(): expected scale to be a real number or None, got {type_name(scale)}"
        )
    batch = broadcast_batch(
        _OP,
        ("query", "key", "value", "attn_mask"),
        (query.shape[:-2], key.shape[:-2], value.shape[:-2], attn_mask.shape[:-2]),
    )
    device, dtype = query.device, query.dtype
    if device.type == "meta":  # (shapes only, as torch's ops on meta: no pattern to read)
        return torch.empty((*batch, query.shape[-2], value.shape[-1]), dtype=dtype, device=device)
    sampled = dispatch.select(_OP, "sampled", device, dtype)
    softmax = dispatch.select(_OP, "softmax", device, dtype)
    addmm = dispatch.select(_OP, "addmm", device, dtype)
    a = Operand.of(_pattern(attn_mask, tuple(batch)), _OP, "attn_mask")
    duplicate = a.plan(_DUPLICATE_PLAN) if a.nnz > 1 else None
    if duplicate is not None:
        b, row, col = duplicate
        where = f" of batch {b}" if attn_mask.ndim > 2 else ""
        raise ValueError(
            f"{_OP}(): malformed attn_mask: block row {row}{where} stores block column {col} twice "
            "(attention would weigh its keys twice; torch's invariant check refuses such a pattern too)"
        )
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    fused = None
    if _may_fuse(sampled, softmax, addmm, a, query, value, dropout_p, float(scale)):
        fused = fused_attention(addmm)
    call = _Call(
        sampled,
        softmax,
        addmm,
        fused,
        a,
        attn_mask,
        is_causal,
        compute,
        float(scale),
        float(dropout_p),
        batch,
    )
    if torch.autograd.forward_ad._current_level >= 0:
        autograd.refuse_tangents((query, key, value, attn_mask))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return _Attention.apply(query, key, value, call)
    return _forward(query, key, value, call)[0]


FUSED_ENV = "BSRKIT_FUSED_ATTENTION"
_FUSED_SCALE_MAX = 1.0  # (1/sqrt(E) for any E >= 1; see _may_fuse)


class _Call(NamedTuple):
    """One attention call's backends and arguments, as the forward and the backward share them."""

    sampled: Backend
    softmax: Backend
    addmm: Backend
    fused: FusedAttention | None  # the fused loops that take this call, or None: the composed path
    a: Operand  # the mask's pattern, broadcast to the batch
    mask: torch.Tensor
    is_causal: bool
    compute: torch.dtype  # the softmax's dtype
    scale: float
    dropout_p: float
    batch: torch.Size


def _may_fuse(
    sampled: Backend,
    softmax: Backend,
    addmm: Backend,
    a: Operand,
    query: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float,
    scale: float,
) -> bool:
    """Whether a backend's fused loops (an optional capability: :func:`~bsrkit.backends.base.fused_attention`)
    may take this call; otherwise the composed path (SDDMM, softmax, products) runs.
    ``BSRKIT_FUSED_ATTENTION=0`` turns them off (for testing the composed path). Dropout is composed, and
    so is a scale that is not finite or above 1 in size: the fused loops hand it to the gemm as alpha,
    which a BLAS may fold into an operand (``scale * key`` overflows where the scaled product does not:
    a zero query row gave NaN) or, for NaN, ignore in some shapes; the composed path scales the formed
    product."""
    if not flag(FUSED_ENV, True):
        return False
    if not (math.isfinite(scale) and abs(scale) <= _FUSED_SCALE_MAX):
        return False
    if dropout_p > 0 or sampled is not addmm or softmax is not addmm or not a.nnz:
        return False
    return bool(query.shape[-1] and value.shape[-1])  # (BLAS rejects a leading dimension of 0)


def _check_inputs(query: Any, key: Any, value: Any, attn_mask: Any) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_strided(_OP, name, t)
    if query.dtype not in SUPPORTED_DTYPES:
        raise ArgumentTypeError(f"{_OP}(): expected query.dtype in {SUPPORTED_DTYPES}, got {query.dtype}")
    for name, t in (("key", key), ("value", value)):
        check_same_dtype(_OP, name, t, "query", query)
        check_same_device(_OP, name, t, "query", query)
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.layout is not torch.sparse_bsr:
        got = attn_mask.layout if isinstance(attn_mask, torch.Tensor) else type_name(attn_mask)
        raise ArgumentTypeError(
            f"{_OP}(): expected attn_mask to be a torch.sparse_bsr tensor (its stored blocks bound the "
            f"work; see bsrkit.sliding_window_mask and the other builders), got {got}"
        )
    if attn_mask.dense_dim() != 0:
        raise ValueError(f"{_OP}(): expected attn_mask.dense_dim() == 0, got {attn_mask.dense_dim()}")
    if attn_mask.dtype not in (torch.bool, query.dtype):
        raise ArgumentTypeError(
            f"{_OP}(): expected attn_mask.dtype to be torch.bool or {query.dtype}, got {attn_mask.dtype}"
        )
    check_same_device(_OP, "attn_mask", attn_mask, "query", query)
    if attn_mask.requires_grad and torch.is_grad_enabled():
        # (not differentiated: a learned bias would silently get no gradient)
        raise ValueError(
            f"{_OP}(): expected an attn_mask that does not require grad (bsrkit does not differentiate "
            "a float mask's values), got one that does: detach it, or use torch's "
            "scaled_dot_product_attention for a learned bias"
        )
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


@library_cache
@weak_lru_cache(maxsize=64, verify_contents=True)
def _expanded_pattern(mask: torch.Tensor, batch: tuple[int, ...]) -> torch.Tensor:
    # Broadcast views of copies of the mask's indices, cached so that the plans keyed on them live with
    # the mask's index memory. Copies: a view of that memory in the entry would keep it alive forever.
    # Plain tensors, also under the caller's inference mode: an inference tensor is never cached or kept,
    # so the entry would leave every later call, in any mode or thread, without cached plans. (An
    # inference mask's call is not cached at all.)
    with torch.inference_mode(False):
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
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: _Call
) -> tuple[torch.Tensor, _Saved]:
    if call.fused is not None:
        bias = cached_block_bias(call.mask, call.is_causal, call.compute)
        result = call.fused.attention_forward(call.a, query, key, value, bias, call.scale)
        if result is not None:
            return result[0], _Saved(True, result[0], result[1], bias, None, None)
    weights = _weights(query, key, call)
    keep = None
    dropped = weights
    if call.dropout_p > 0:
        keep = torch.empty(weights.shape, dtype=torch.bool, device=weights.device).bernoulli_(
            1 - call.dropout_p
        )
        dropped = _apply_dropout(weights, keep, call.dropout_p)
    batch = call.batch
    out = torch.empty((*batch, query.shape[-2], value.shape[-1]), dtype=query.dtype, device=query.device)
    product = call.a._replace(values=dropped) if _nonempty(call.a, out, key.shape[-2]) else None
    dispatch.addmm(_MM, call.addmm, None, product, value, out, batch, 0.0, 1.0, None)
    return out, _Saved(False, None, None, None, weights, keep)


def _weights(query: torch.Tensor, key: torch.Tensor, call: _Call) -> torch.Tensor:
    """The attention weights at the stored blocks, composed: SDDMM, then the block-row softmax."""
    a, dtype = call.a, query.dtype
    if dtype is not call.compute:
        # Half types: the scores in float32 (rounded to half they lost digits, and overflowed past 65504
        # to inf, then NaN, where torch stays finite); the weights, in [0, 1], rounded once at the end.
        query, key = query.to(call.compute), key.to(call.compute)
    scores = dispatch.sampled(_SAMPLED, call.sampled, a, query, key.mT, call.batch, call.scale)
    bias = cached_block_bias(call.mask, call.is_causal, call.compute).dense()
    weights = dispatch.softmax(call.softmax, a, scores, bias, zero_empty_rows=True)
    return weights.to(dtype)


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
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: _Call
    ) -> torch.Tensor:
        out, saved = _forward(query, key, value, call)
        if saved.fused:
            ctx.save_for_backward(query, key, value, saved.out, saved.lse)
        else:
            ctx.save_for_backward(query, key, value, saved.weights, saved.keep)
        ctx.call, ctx.was_fused, ctx.bias = call, saved.fused, saved.bias
        return out

    @staticmethod
    @autograd.first_order_only("scaled_dot_product_attention")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        call: _Call = ctx.call
        query, key, value, x, y = ctx.saved_tensors
        grad = resolved(grad)  # (a negative view: the kernels read memory)
        if ctx.was_fused:
            assert call.fused is not None
            result = call.fused.attention_backward(
                call.a, query, key, value, x, y, grad, ctx.bias, call.scale
            )
            if result is not None:
                dq, dk, dv = result
                return (
                    dq.sum_to_size(query.shape),
                    dk.sum_to_size(key.shape),
                    dv.sum_to_size(value.shape),
                    None,
                )
            # (the fused loops declined the backward: recompute the weights, then as composed)
            weights, keep = _weights(query, key, call), None
        else:
            weights, keep = x, y
        needs = ctx.needs_input_grad[:3]
        return (*_composed_backward(call, needs, grad, query, key, value, weights, keep), None)


def _composed_backward(
    call: _Call,
    needs: tuple[bool, bool, bool],
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    weights: torch.Tensor,
    keep: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    a, scale, dropout_p, batch = call.a, call.scale, call.dropout_p, call.batch
    need_q, need_k, need_v = needs
    L, S = query.shape[-2], key.shape[-2]
    grad_q = grad_k = grad_v = None
    if need_v:
        # dV = W^T dO: the transposed product over the pattern's cached transpose plan.
        dropped = weights if keep is None else _apply_dropout(weights, keep, dropout_p)
        dv = torch.empty((*batch, S, value.shape[-1]), dtype=grad.dtype, device=grad.device)
        product = a._replace(values=dropped).transposed() if _nonempty(a, dv, L) else None
        dispatch.addmm(_MM_T, call.addmm, None, product, grad, dv, batch, 0.0, 1.0, None)
        grad_v = dv.sum_to_size(value.shape)
    if need_q or need_k:
        # dW = (dO V^T)|P (SDDMM), then the softmax's backward.
        dw = dispatch.sampled(_SAMPLED, call.sampled, a, grad, value.mT, batch, 1.0)
        if keep is not None:
            dw = _apply_dropout(dw, keep, dropout_p)
        ds = dispatch.softmax_backward(call.softmax, a, weights, dw)
        del dw
        if need_q:
            dq = torch.empty((*batch, L, query.shape[-1]), dtype=grad.dtype, device=grad.device)
            product = a._replace(values=ds) if _nonempty(a, dq, S) else None
            dispatch.addmm(_MM, call.addmm, None, product, key, dq, batch, 0.0, scale, None)
            grad_q = dq.sum_to_size(query.shape)
        if need_k:
            dk = torch.empty((*batch, S, key.shape[-1]), dtype=grad.dtype, device=grad.device)
            product = a._replace(values=ds).transposed() if _nonempty(a, dk, L) else None
            dispatch.addmm(_MM_T, call.addmm, None, product, query, dk, batch, 0.0, scale, None)
            grad_k = dk.sum_to_size(key.shape)
    return grad_q, grad_k, grad_v
