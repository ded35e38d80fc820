"""bsrkit's block-sparse attention inside Hugging Face transformers.

Importing this module registers ``"bsrkit"`` with transformers' ``AttentionInterface`` (and, for the
masks, the same builder as ``"sdpa"``), so a model loaded or configured with ``attn_implementation=
"bsrkit"`` (or ``model.config._attn_implementation = "bsrkit"``) runs :func:`bsrkit.
scaled_dot_product_attention`::

    import bsrkit.integrations.transformers  # registers "bsrkit"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="bsrkit")

The model's mask (causal, sliding window, padding: a bool ``(B, 1, L, S)`` tensor, or None for plain
causal attention) becomes a bool BSR mask of the largest blocksize of 128, 64, 32, 16 that divides L
and S, built once per mask tensor (every layer receives the same one) and cached for as long as that
tensor lives; without a mask (plain causal attention), each layer builds its causal mask (none is kept
alive: one at L = 8192 holds 34 MB). Grouped-query attention repeats the key and value heads. A padded
query row with nothing to attend gives 0, as SDPA. A user's mask that broadcasts over the queries or keys
(``(B, 1, 1, S)``) is broadcast, as SDPA does.
Cases it cannot run fall back to transformers' own SDPA path with the same arguments: decoding (one query
row), no blocksize dividing L and S, float masks, position biases, attention weights requested, tensors on
the meta device. Soft-capping and attention sinks (``s_aux``, ``sinks``), which SDPA cannot apply either,
raise ``ValueError`` naming ``attn_implementation="eager"`` (they were silently dropped).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import bsrkit
from bsrkit.attention import causal_mask, mask_from_dense
from bsrkit.cache import library_cache, weak_lru_cache
from bsrkit.eager import eager_under_compile

__all__ = ["BLOCKSIZES", "NAME", "attention_forward"]

NAME = "bsrkit"
# Blocksizes tried, largest first (larger blocks run the fused kernels faster); one must divide L and S.
BLOCKSIZES = (128, 64, 32, 16)


def _blocksize(L: int, S: int) -> int | None:
    return next((b for b in BLOCKSIZES if L % b == 0 and S % b == 0), None)


@eager_under_compile  # (Dynamo cannot trace the cache's lock and weak references: a graph break)
@library_cache
@weak_lru_cache(maxsize=8, verify_contents=True)
def _bsr_of(mask: torch.Tensor, blocksize: int) -> torch.Tensor:
    """The bool BSR mask of a model's dense bool mask, one per mask tensor (the layers share it). A hit
    compares the mask's bytes with the ones it was built from: a user's 4-D mask written through numpy or
    ``.data`` (no version counter moves) is rebuilt, as every cache hit in bsrkit is proven."""
    return mask_from_dense(mask, blocksize)


# Keywords that change the attention and that neither path applies (soft-capping: Gemma 2; sinks: GPT-OSS).
_NOT_APPLIED = {"softcap": "soft-capping", "s_aux": "attention sinks", "sinks": "attention sinks"}


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``(B, H, L, D)``, ``key``/``value``
    ``(B, Hkv, S, D)``; returns ``(output (B, L, H, Dv), None)`` as ``sdpa_attention_forward`` does."""
    for name in _NOT_APPLIED:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"bsrkit attention: {name}= ({_NOT_APPLIED[name]}) is applied neither by bsrkit's attention "
                "nor by SDPA, its fallback: load the model with attn_implementation='eager'"
            )
    L, S = query.shape[2], key.shape[2]
    blocksize = None if L == 1 else _blocksize(L, S)  # (a decode step's one row: SDPA, at once)
    if attention_mask is not None and attention_mask.shape[-2:] != (L, S) and attention_mask.ndim >= 2:
        try:  # (a user's mask broadcasting over the queries or keys, (B, 1, 1, S): SDPA broadcasts it)
            attention_mask = attention_mask.expand(*attention_mask.shape[:-2], L, S)
        except RuntimeError:
            blocksize = None  # (SDPA names it)
    unsupported = (
        blocksize is None
        or query.is_meta
        or kwargs.get("position_bias") is not None
        or kwargs.get("output_attentions", False)
        or (attention_mask is not None and attention_mask.dtype != torch.bool)
    )
    if unsupported:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    assert blocksize is not None
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        # (no mask: plain causal attention, or none; transformers' causal is top-left aligned when L == S)
        if causal and L != S:
            return sdpa_attention_forward(
                module,
                query,
                key,
                value,
                None,
                dropout=dropout,
                scaling=scaling,
                is_causal=is_causal,
                **kwargs,
            )
        mask = causal_mask(L, blocksize, S, device=query.device) if causal else None
        if mask is None:
            return sdpa_attention_forward(
                module, query, key, value, None, dropout=dropout, scaling=scaling, is_causal=False, **kwargs
            )
    else:
        mask = _bsr_of(attention_mask, blocksize)
    # (after the fallbacks: sdpa_attention_forward repeats grouped key/value heads itself)
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    out = bsrkit.scaled_dot_product_attention(query, key, value, mask, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
