r"""Fused block-sparse attention forward in Triton (flash-attention style over a BSR mask's stored blocks).

One program per (batch, block row, row tile): for each stored block ``g`` of the row (key block
``c = col[g]``), :math:`S = s\,Q_r K_c^T` (plus the block's bias when the mask is partial there, see
:class:`bsrkit.mask_bias.BlockBias`), then the online softmax update

.. math::
    m' = \max(m, \max_j S_{:j}), \quad \ell' = e^{m - m'} \ell + \sum_j e^{S_{:j} - m'}, \quad
    O' = e^{m - m'} O + e^{S - m'} V_c,

and at the end :math:`O / \ell` and the row log-sum-exp :math:`m + \log \ell`. The weights are never
stored: memory beyond the inputs and outputs is the ``(B, L)`` log-sum-exp. A row with no allowed entry
gives 0, or NaN where a key of its stored blocks has a NaN or Inf value (0 times it, as the composed
path). NaN in ``Q``, ``K`` or ``V`` reaches exactly the rows whose math it
reaches: an excluded entry (bias ``-inf``) is set to ``-inf`` whatever its score, and ``exp(NaN - m)`` is
NaN.

The backward is not fused: :func:`bsrkit.attention` recomputes the weights on the composed path.
Importing this module imports triton (the backend imports it on the first fused call).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl

from bsrkit.backends.batching import bsr_batch_of
from bsrkit.backends.triton.kernels import dot_precision
from bsrkit.backends.triton.tiles import tile

if TYPE_CHECKING:
    from bsrkit.mask_bias import BlockBias
    from bsrkit.operand import Operand

__all__ = ["DEFAULT_PARAMS", "MAX_TILE", "forward"]

# Row tile, warps and stages of the launch (rows of a block row per program; blocks taller than BLOCK_M are
# cut into row tiles). The largest block, head and value tiles one program holds in registers.
DEFAULT_PARAMS = {"BLOCK_M": 64, "num_warps": 4, "num_stages": 2}
MAX_TILE = 128


@triton.jit
def _attention_forward_kernel(
    # pattern (B, MB + 1) and (B, nnz); per-block bias index (Bm, nnz); batch map b -> bm (B,)
    crow_ptr, stride_crow_b, stride_crow_m,
    col_ptr, stride_col_b, stride_col_g,
    index_ptr, stride_index_b, stride_index_g,
    batch_map_ptr,
    # bias blocks (P, Ms, Ns), float32
    bias_ptr, stride_bias_p, stride_bias_m, stride_bias_n,
    # q (B, L, E), k (B, S, E), v (B, S, Ev), out (B, L, Ev), lse (B, L)
    q_ptr, stride_q_b, stride_q_l, stride_q_e,
    k_ptr, stride_k_b, stride_k_s, stride_k_e,
    v_ptr, stride_v_b, stride_v_s, stride_v_e,
    out_ptr, stride_out_b, stride_out_l, stride_out_e,
    lse_ptr, stride_lse_b, stride_lse_l,
    MB, Ms, Ns, E, Ev, M_TILES, scale,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    m_t = pid % M_TILES
    row = pid // M_TILES
    b = row // MB
    r = row % MB
    bm = tl.load(batch_map_ptr + b).to(tl.int64)
    rm = m_t * BLOCK_M + tl.arange(0, BLOCK_M)  # rows inside the block
    # (int64, as every offset: times a stride, an int32 arange may pass 2**31)
    rn = tl.arange(0, BLOCK_N).to(tl.int64)
    re = tl.arange(0, BLOCK_E).to(tl.int64)
    rev = tl.arange(0, BLOCK_EV).to(tl.int64)
    mask_m, mask_n, mask_e, mask_ev = rm < Ms, rn < Ns, re < E, rev < Ev
    rows = r * Ms + rm
    q = tl.load(
        q_ptr + b * stride_q_b + rows[:, None] * stride_q_l + re[None, :] * stride_q_e,
        mask=mask_m[:, None] & mask_e[None, :], other=0.0,
    )  # fmt: skip
    crow = crow_ptr + b * stride_crow_b + r * stride_crow_m
    g0 = tl.load(crow).to(tl.int64)
    g1 = tl.load(crow + stride_crow_m).to(tl.int64)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_EV), dtype=tl.float32)
    for g in range(g0, g1):
        c = tl.load(col_ptr + b * stride_col_b + g * stride_col_g).to(tl.int64)
        idx = tl.load(index_ptr + bm * stride_index_b + g * stride_index_g)
        cols = c * Ns + rn
        k = tl.load(
            k_ptr + b * stride_k_b + cols[:, None] * stride_k_s + re[None, :] * stride_k_e,
            mask=mask_n[:, None] & mask_e[None, :], other=0.0,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=tl.float32) * scale
        # (the block-uniform conditions as bounds on row and column, so every mask is a tensor comparison)
        bias_rows = tl.where(idx >= 0, Ms, 0)  # a bias block only where the mask is partial
        bias = tl.load(
            bias_ptr + tl.maximum(idx, 0) * stride_bias_p + rm[:, None] * stride_bias_m
            + rn[None, :] * stride_bias_n,
            mask=(rm[:, None] < bias_rows) & mask_n[None, :], other=0.0,
        )  # fmt: skip
        # an excluded entry (bias -inf) takes no part, even where the score is NaN
        s = tl.where(bias == float("-inf"), float("-inf"), s + bias)
        # idx == -2: no entry of the block is allowed; padding columns are never allowed
        allowed_cols = tl.where(idx != -2, Ns, 0)
        s = tl.where(rn[None, :] < allowed_cols, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (exp(-inf - -inf) would be NaN)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + b * stride_v_b + cols[:, None] * stride_v_s + rev[None, :] * stride_v_e,
            mask=mask_n[:, None] & mask_ev[None, :], other=0.0,
        )  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=tl.float32)
        m_i = m_new
    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    # (a row with nothing allowed: acc, 0, or the 0 * inf = NaN an excluded key's Inf value gave, as the
    # composed path, the reference and torch's SDPA)
    out = acc / l_safe[:, None]
    # (a NaN row has l_i NaN: "l_i > 0" is False, so keep NaN explicitly, as the math gives)
    out = tl.where((l_i != l_i)[:, None], float("nan"), out)
    tl.store(
        out_ptr + b * stride_out_b + rows[:, None] * stride_out_l + rev[None, :] * stride_out_e,
        out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_ev[None, :],
    )  # fmt: skip
    lse = tl.where(nonempty, m_i + tl.log(l_safe), float("-inf"))
    lse = tl.where(l_i != l_i, float("nan"), lse)
    tl.store(lse_ptr + b * stride_lse_b + rows * stride_lse_l, lse, mask=mask_m)


def supported(a: Operand, query: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the fused forward takes the call: blocks and head sizes up to :data:`MAX_TILE`, half types
    and float32."""
    Ms, Ns = a.values.shape[-2:]
    return (
        query.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and max(Ms, Ns, query.shape[-1], value.shape[-1]) <= MAX_TILE
    )


def forward(
    a: Operand,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: BlockBias,
    scale: float,
    params: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output ``(*batch, L, Ev)`` in ``query``'s dtype, row log-sum-exp ``(*batch, L)`` float32); ``a``'s
    indices have the call's batch (see :func:`supported` for what it takes)."""
    meta = {**DEFAULT_PARAMS, **(params or {})}
    batch = a.batch
    Ms, Ns = a.values.shape[-2:]
    L, S = a.M, a.K
    E, Ev = query.shape[-1], value.shape[-1]
    q = query.expand(*batch, L, E).reshape(-1, L, E)
    k = key.expand(*batch, S, E).reshape(-1, S, E)
    v = value.expand(*batch, S, Ev).reshape(-1, S, Ev)
    B = q.shape[0]
    out = torch.empty((B, L, Ev), dtype=query.dtype, device=query.device)
    lse = torch.empty((B, L), dtype=torch.float32, device=query.device)
    MB = L // Ms
    nnz = a.nnz
    if B * MB == 0:
        return out.reshape(*batch, L, Ev), lse.reshape(*batch, L)
    crow, col = a.kernel_indices()
    crow = crow.reshape(B, MB + 1)
    col = col.reshape(B, nnz)
    index = bias.block_index.reshape(-1, nnz)
    batch_map = torch.tensor(bsr_batch_of(bias.batch, batch), device=query.device)  # (a copy: may be a view)
    bias_values = bias.values.to(torch.float32)
    if bias_values.shape[0] == 0:
        bias_values = bias_values.new_zeros((1, Ms, Ns))
    block_m = min(meta["BLOCK_M"], tile(Ms))
    m_tiles = triton.cdiv(Ms, block_m)
    _attention_forward_kernel[(B * MB * m_tiles,)](
        crow, *crow.stride(), col, *col.stride(), index, *index.stride(), batch_map,
        bias_values, *bias_values.stride(),
        q, *q.stride(), k, *k.stride(), v, *v.stride(), out, *out.stride(), lse, *lse.stride(),
        MB, Ms, Ns, E, Ev, m_tiles, float(scale),
        PRECISION=dot_precision(query.dtype),
        BLOCK_M=block_m, BLOCK_N=tile(Ns), BLOCK_E=tile(E), BLOCK_EV=tile(Ev),
        num_warps=meta["num_warps"], num_stages=meta["num_stages"],
    )  # fmt: skip
    return out.reshape(*batch, L, Ev), lse.reshape(*batch, L)
