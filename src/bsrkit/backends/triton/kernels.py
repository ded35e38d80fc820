"""Triton kernels for the products, after the design of ``torch.sparse._triton_ops``
(``_bsr_strided_addmm_kernel``, ``_scatter_mm2_kernel``, ``_scatter_mm6_kernel``), written anew:

* every tensor argument is passed with all its strides, so nothing needs to be contiguous;
* block shapes Triton cannot load directly (not powers of two, < 16) and ragged N are padded in the
  kernel to the next power of two >= 16 with masked loads and stores, not refused;
* accumulation is float32 for half types, float64 for float64 (``_ACC``).

Kernel signatures group arguments by tensor: ``<tensor>_ptr`` then ``stride_<tensor>_<dim>``; tile sizes
are UPPER_CASE constexprs. These functions never validate or cache (``bsrkit.ops`` does).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["bsr_dense_addmm", "scatter_mm_into", "tile"]

_ACC = {
    torch.float16: tl.float32,
    torch.bfloat16: tl.float32,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


def tile(n: int) -> int:
    """The padded tile extent for a block extent n: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(max(n, 1)))


@triton.jit
def _bsr_dense_addmm_kernel(
    # BSR operand, batched: crow (B, MB + 1), col (B, nnz), values (B, nnz, Ms, Ks)
    crow_ptr, stride_crow_b, stride_crow_m,
    col_ptr, stride_col_b, stride_col_g,
    values_ptr, stride_values_b, stride_values_g, stride_values_m, stride_values_k,
    # dense (B, K, N)
    dense_ptr, stride_dense_b, stride_dense_k, stride_dense_n,
    # out (B, M, N): out[b, m-block, n-tile] (+)= alpha * sum_g values[g] @ dense[col[g]-block, n-tile]
    out_ptr, stride_out_b, stride_out_m, stride_out_n,
    Ms, Ks, N, alpha,
    OVERWRITE: tl.constexpr, ACC_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    m = tl.program_id(1)
    n0 = tl.program_id(2) * BLOCK_N
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    rn = n0 + tl.arange(0, BLOCK_N)
    mask_m = rm < Ms
    mask_k = rk < Ks
    mask_n = rn < N
    g0 = tl.load(crow_ptr + b * stride_crow_b + m * stride_crow_m)
    g1 = tl.load(crow_ptr + b * stride_crow_b + (m + 1) * stride_crow_m)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for g in range(g0, g1):
        c = tl.load(col_ptr + b * stride_col_b + g * stride_col_g)
        a = tl.load(
            values_ptr + b * stride_values_b + g * stride_values_g
            + rm[:, None] * stride_values_m + rk[None, :] * stride_values_k,
            mask=mask_m[:, None] & mask_k[None, :], other=0.0,
        )  # fmt: skip
        d = tl.load(
            dense_ptr + b * stride_dense_b + (c * Ks + rk)[:, None] * stride_dense_k
            + rn[None, :] * stride_dense_n,
            mask=mask_k[:, None] & mask_n[None, :], other=0.0,
        )  # fmt: skip
        acc += tl.dot(a, d, out_dtype=ACC_DTYPE)
    out_ptrs = out_ptr + b * stride_out_b + (m * Ms + rm)[:, None] * stride_out_m + rn[None, :] * stride_out_n
    mask = mask_m[:, None] & mask_n[None, :]
    result = acc * alpha
    if not OVERWRITE:
        result += tl.load(out_ptrs, mask=mask, other=0.0).to(ACC_DTYPE)
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=mask)


def bsr_dense_addmm(
    crow: torch.Tensor,  # (B, MB + 1)
    col: torch.Tensor,  # (B, nnz)
    values: torch.Tensor,  # (B, nnz, Ms, Ks)
    dense: torch.Tensor,  # (B, K, N)
    out: torch.Tensor,  # (B, M, N)
    alpha: float,
    overwrite: bool,
    meta: dict[str, Any],
) -> None:
    B, M, N = out.shape
    Ms, Ks = values.shape[-2:]
    block_n = meta["BLOCK_N"]
    grid = (B, M // Ms, triton.cdiv(N, block_n))
    _bsr_dense_addmm_kernel[grid](
        crow, crow.stride(0), crow.stride(1),
        col, col.stride(0), col.stride(1),
        values, values.stride(0), values.stride(1), values.stride(2), values.stride(3),
        dense, dense.stride(0), dense.stride(1), dense.stride(2),
        out, out.stride(0), out.stride(1), out.stride(2),
        Ms, Ks, N, alpha,
        OVERWRITE=overwrite, ACC_DTYPE=_ACC[out.dtype],
        BLOCK_M=tile(Ms), BLOCK_K=tile(Ks), BLOCK_N=block_n,
        num_warps=meta["num_warps"], num_stages=meta["num_stages"],
    )  # fmt: skip


@triton.jit
def _scatter_mm_batches_kernel(
    # "scatter_mm" format: acc[r] += sum_{g in [c_r, c_{r+1})} blocks[p_g] @ others[q_g]
    blocks_ptr, stride_blocks_p, stride_blocks_m, stride_blocks_k,
    others_ptr, stride_others_q, stride_others_k, stride_others_n,
    acc_ptr, stride_acc_r, stride_acc_m, stride_acc_n,
    c_offsets_ptr, pq_ptr, stride_pq_g, stride_pq_i,
    Ms, Ks, Ns,
    ACC_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_k, mask_n = rm < Ms, rk < Ks, rn < Ns
    g0 = tl.load(c_offsets_ptr + r)
    g1 = tl.load(c_offsets_ptr + r + 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for g in range(g0, g1):
        p = tl.load(pq_ptr + g * stride_pq_g)
        q = tl.load(pq_ptr + g * stride_pq_g + stride_pq_i)
        a = tl.load(
            blocks_ptr + p * stride_blocks_p + rm[:, None] * stride_blocks_m + rk[None, :] * stride_blocks_k,
            mask=mask_m[:, None] & mask_k[None, :], other=0.0,
        )  # fmt: skip
        d = tl.load(
            others_ptr + q * stride_others_q + rk[:, None] * stride_others_k + rn[None, :] * stride_others_n,
            mask=mask_k[:, None] & mask_n[None, :], other=0.0,
        )  # fmt: skip
        acc += tl.dot(a, d, out_dtype=ACC_DTYPE)
    ptrs = acc_ptr + r * stride_acc_r + rm[:, None] * stride_acc_m + rn[None, :] * stride_acc_n
    mask = mask_m[:, None] & mask_n[None, :]
    acc += tl.load(ptrs, mask=mask, other=0.0).to(ACC_DTYPE)
    tl.store(ptrs, acc.to(acc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scatter_mm_strided_kernel(
    # "bsr_strided_mm[_compressed]" formats; tile (r0, r1) = divmod(r_offsets[i], N) of acc[b]
    blocks_ptr, stride_blocks_p, stride_blocks_m, stride_blocks_k,
    others_ptr, stride_others_b, stride_others_k, stride_others_n,
    acc_ptr, stride_acc_b, stride_acc_m, stride_acc_n,
    c_indices_ptr, r_offsets_ptr, p_offsets_ptr, q_offsets_ptr,
    Ms, Ks, N, Ns, SPLIT_N,
    IS_COMPRESSED: tl.constexpr, ACC_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    i = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    rj = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)  # column inside the Ns-wide tile
    mask_m, mask_k, mask_n = rm < Ms, rk < Ks, rj < Ns
    r = tl.load(r_offsets_ptr + i)
    r0 = r // N
    r1 = r % N
    if IS_COMPRESSED:
        m = r0 // Ms
        n = r1 // Ns
        c0 = tl.load(c_indices_ptr + m)
        c1 = tl.load(c_indices_ptr + m + 1)
        q_base = n * c1 + (SPLIT_N - n) * c0
        g0 = c0
        g1 = c1
    else:
        g0 = tl.load(c_indices_ptr + i)
        g1 = tl.load(c_indices_ptr + i + 1)
        q_base = g0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for g in range(g0, g1):
        if IS_COMPRESSED:
            p = g
        else:
            p = tl.load(p_offsets_ptr + g)
        q = tl.load(q_offsets_ptr + q_base + (g - g0))
        q0 = q // N
        q1 = q % N
        a = tl.load(
            blocks_ptr + p * stride_blocks_p + rm[:, None] * stride_blocks_m + rk[None, :] * stride_blocks_k,
            mask=mask_m[:, None] & mask_k[None, :], other=0.0,
        )  # fmt: skip
        d = tl.load(
            others_ptr + b * stride_others_b + (q0 + rk)[:, None] * stride_others_k
            + (q1 + rj)[None, :] * stride_others_n,
            mask=mask_k[:, None] & mask_n[None, :], other=0.0,
        )  # fmt: skip
        acc += tl.dot(a, d, out_dtype=ACC_DTYPE)
    ptrs = acc_ptr + b * stride_acc_b + (r0 + rm)[:, None] * stride_acc_m + (r1 + rj)[None, :] * stride_acc_n
    mask = mask_m[:, None] & mask_n[None, :]
    acc += tl.load(ptrs, mask=mask, other=0.0).to(ACC_DTYPE)
    tl.store(ptrs, acc.to(acc_ptr.dtype.element_ty), mask=mask)


def scatter_mm_into(
    blocks: torch.Tensor,
    others: torch.Tensor,
    indices_data: tuple[Any, ...],
    accumulators: torch.Tensor,
    meta: dict[str, Any],
) -> None:
    """The three ``scatter_mm`` formats, accumulating into ``accumulators`` (3-D for the strided ones)."""
    fmt = indices_data[0]
    _, Ms, Ks = blocks.shape
    acc_dtype = _ACC[accumulators.dtype]
    if fmt == "scatter_mm":
        c_offsets, pq = indices_data[1:]
        R = c_offsets.numel() - 1
        Ns = others.shape[-1]
        block_n = min(meta["BLOCK_N"], tile(Ns))
        if R == 0:
            return
        _scatter_mm_batches_kernel[(R, triton.cdiv(Ns, block_n))](
            blocks, *blocks.stride(), others, *others.stride(), accumulators, *accumulators.stride(),
            c_offsets, pq, pq.stride(0), pq.stride(1), Ms, Ks, Ns,
            ACC_DTYPE=acc_dtype, BLOCK_M=tile(Ms), BLOCK_K=tile(Ks), BLOCK_N=block_n,
        )  # fmt: skip
        return
    B, _, N = others.shape
    split_n = indices_data[-1]["SPLIT_N"]
    Ns = N // split_n
    compressed = fmt == "bsr_strided_mm_compressed"
    if compressed:
        c_indices, r_offsets, q_offsets = indices_data[1:4]
        p_offsets = q_offsets  # unused
    else:
        c_indices, r_offsets, p_offsets, q_offsets = indices_data[1:5]
    if r_offsets.numel() == 0 or B == 0:
        return
    block_n = min(meta["BLOCK_N"], tile(Ns))
    _scatter_mm_strided_kernel[(B, r_offsets.numel(), triton.cdiv(Ns, block_n))](
        blocks, *blocks.stride(), others, *others.stride(), accumulators, *accumulators.stride(),
        c_indices, r_offsets, p_offsets, q_offsets, Ms, Ks, N, Ns, split_n,
        IS_COMPRESSED=compressed, ACC_DTYPE=acc_dtype,
        BLOCK_M=tile(Ms), BLOCK_K=tile(Ks), BLOCK_N=block_n,
    )  # fmt: skip
