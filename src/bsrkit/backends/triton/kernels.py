"""Triton kernels for the products, after the design of ``torch.sparse._triton_ops``
(``_bsr_strided_addmm_kernel``, ``_scatter_mm2_kernel``, ``_scatter_mm6_kernel``), written anew:

* every tensor argument is passed with all its strides, so nothing needs to be contiguous;
* block shapes Triton cannot load directly (not powers of two, < 16) and ragged N are padded in the
  kernel to the next power of two >= 16 with masked loads and stores, not refused; blocks larger than a
  tile are cut into ``BLOCK_M`` row tiles (one program each) and ``BLOCK_K`` chunks (a loop), so any
  block shape compiles within the GPU's registers and shared memory;
* accumulation is float32 for half types, float64 for float64 (``_ACC``); float32 products use IEEE
  precision unless torch allows TF32 for matmuls (:func:`tf32_allowed`), as ``torch.mm`` does;
* grids are 1-D (dimension 0 allows 2**31 - 1 programs; dimensions 1 and 2 only 65535) and every offset
  is computed in int64, so large and strided operands do not overflow 32-bit index arithmetic;
* ``alpha`` is a float64 argument (a plain Python float would be passed as float32).

Kernel signatures group arguments by tensor: ``<tensor>_ptr`` then ``stride_<tensor>_<dim>``; tile sizes
are UPPER_CASE constexprs. These functions never validate or cache (``bsrkit.ops`` and
``bsrkit.plans`` do); the tile rules live in :mod:`bsrkit.backends.triton.tiles`.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from bsrkit.backends.triton.tiles import clamped_tiles

__all__ = ["bsr_dense_addmm", "dot_precision", "sampled_blocks", "scatter_mm_into"]

_ACC = {
    torch.float16: tl.float32,
    torch.bfloat16: tl.float32,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: TF32 for float32 only when torch allows it for matmuls (as torch.mm)."""
    if dtype == torch.float32 and tf32_allowed():
        return "tf32"
    return "ieee"


def tf32_allowed() -> bool:
    """Whether torch lets float32 matmuls use TF32. torch >= 2.9 says it in ``fp32_precision`` (the
    matmul's, or where that is ``"none"`` the global one); reading the legacy ``allow_tf32`` after the
    new API was used raises a ``RuntimeError`` there, so it is read only where the new API is absent."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is None:
        return bool(matmul.allow_tf32)
    if precision == "none":
        precision = getattr(torch.backends, "fp32_precision", "none")
    return precision == "tf32"


def _launch(
    meta: dict[str, Any], dtype: torch.dtype, rows: int, inner: int, cols: int
) -> tuple[dict[str, Any], int, int]:
    """What every launch passes, for (rows x inner) @ (inner x cols) block products in ``dtype``: the
    keyword arguments (tiles, accumulator, dot precision, warps, stages), then the number of row tiles
    and column tiles that cover one output block."""
    tiles = clamped_tiles(meta, rows, inner, cols)
    kwargs = {
        **tiles,
        "ACC_DTYPE": _ACC[dtype],
        "PRECISION": dot_precision(dtype),
        "num_warps": meta["num_warps"],
        "num_stages": meta["num_stages"],
    }
    return kwargs, triton.cdiv(rows, tiles["BLOCK_M"]), triton.cdiv(cols, tiles["BLOCK_N"])


@triton.jit
def _split_pid(N_TILES, M_TILES):
    """This program's (outer, m-tile, n-tile), n-tile fastest: neighbouring programs read the same rows
    of the sparse operand. int64, so products with strides cannot overflow."""
    pid = tl.program_id(0).to(tl.int64)
    n_t = pid % N_TILES
    rest = pid // N_TILES
    return rest // M_TILES, rest % M_TILES, n_t


@triton.jit
def _block_product(
    acc, a_ptr, stride_a_m, stride_a_k, d_ptr, stride_d_k, stride_d_n, rm, rn, mask_m, mask_n, Ks,
    ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """acc += a[rm, :Ks] @ d[:Ks, rn], in BLOCK_K chunks; out-of-range rows, columns and k are masked."""
    for k0 in range(0, Ks, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K).to(tl.int64)  # (k0 is int32: Ks is; rk times a stride may pass 2**31)
        mask_k = rk < Ks
        a = tl.load(
            a_ptr + rm[:, None] * stride_a_m + rk[None, :] * stride_a_k,
            mask=mask_m[:, None] & mask_k[None, :], other=0.0,
        )  # fmt: skip
        d = tl.load(
            d_ptr + rk[:, None] * stride_d_k + rn[None, :] * stride_d_n,
            mask=mask_k[:, None] & mask_n[None, :], other=0.0,
        )  # fmt: skip
        acc += tl.dot(a, d, input_precision=PRECISION, out_dtype=ACC_DTYPE)
    return acc


@triton.jit
def _row_product_flat(
    acc, g0, g1, col_ptr, stride_col_g,
    values_ptr, stride_values_g, stride_values_m, stride_values_k, d_ptr, stride_d_k, stride_d_n,
    rm, rn, mask_m, mask_n, Ks,
    ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """acc += sum_{g in [g0, g1)} values[g][rm, :] @ d[col[g]-block rows, rn], as ONE loop over (block,
    k-chunk) pairs: Triton software-pipelines only a loop's own loads, so the loads of the next block are
    in flight while this one multiplies (the nested form restarts the pipeline at every block).
    ``EVEN_K``: BLOCK_K divides Ks, so no k mask."""
    k_chunks = tl.cdiv(Ks, BLOCK_K)
    rk0 = tl.arange(0, BLOCK_K)
    for it in range(0, (g1 - g0) * k_chunks):
        g = g0 + it // k_chunks
        rk = (it % k_chunks) * BLOCK_K + rk0
        c = tl.load(col_ptr + g * stride_col_g).to(tl.int64)
        a_ptrs = (
            values_ptr + g * stride_values_g + rm[:, None] * stride_values_m + rk[None, :] * stride_values_k
        )
        d_ptrs = d_ptr + (c * Ks + rk)[:, None] * stride_d_k + rn[None, :] * stride_d_n
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            d = tl.load(d_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = rk < Ks
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            d = tl.load(d_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc += tl.dot(a, d, input_precision=PRECISION, out_dtype=ACC_DTYPE)
    return acc


@triton.jit
def _bsr_dense_addmm_kernel(
    # BSR operand, batched: crow (B, MB + 1), col (B, nnz), values (B, nnz, Ms, Ks)
    crow_ptr, stride_crow_b, stride_crow_m,
    col_ptr, stride_col_b, stride_col_g,
    values_ptr, stride_values_b, stride_values_g, stride_values_m, stride_values_k,
    # dense (B, K, N)
    dense_ptr, stride_dense_b, stride_dense_k, stride_dense_n,
    # out (B, M, N): out[b, m-block rows, n-tile] (+)= alpha * sum_g values[g] @ dense[col[g]-block, n-tile]
    out_ptr, stride_out_b, stride_out_m, stride_out_n,
    MB, Ms, Ks, N, M_TILES, N_TILES, alpha: tl.float64,
    OVERWRITE: tl.constexpr, ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    FLAT_LOOP: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    row, m_t, n_t = _split_pid(N_TILES, M_TILES)
    b = row // MB
    m = row % MB
    rm = m_t * BLOCK_M + tl.arange(0, BLOCK_M)  # rows inside the block
    rn = n_t * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < Ms
    mask_n = rn < N
    crow = crow_ptr + b * stride_crow_b + m * stride_crow_m
    g0 = tl.load(crow).to(tl.int64)
    g1 = tl.load(crow + stride_crow_m).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    if FLAT_LOOP:
        acc = _row_product_flat(
            acc, g0, g1, col_ptr + b * stride_col_b, stride_col_g,
            values_ptr + b * stride_values_b, stride_values_g, stride_values_m, stride_values_k,
            dense_ptr + b * stride_dense_b, stride_dense_k, stride_dense_n,
            rm, rn, mask_m, mask_n, Ks, ACC_DTYPE, PRECISION, BLOCK_K, EVEN_K,
        )  # fmt: skip
    else:
        for g in range(g0, g1):
            c = tl.load(col_ptr + b * stride_col_b + g * stride_col_g).to(tl.int64)
            acc = _block_product(
                acc,
                values_ptr + b * stride_values_b + g * stride_values_g, stride_values_m, stride_values_k,
                dense_ptr + b * stride_dense_b + c * Ks * stride_dense_k, stride_dense_k, stride_dense_n,
                rm, rn, mask_m, mask_n, Ks, ACC_DTYPE, PRECISION, BLOCK_K,
            )  # fmt: skip
    out_ptrs = out_ptr + b * stride_out_b + (m * Ms + rm)[:, None] * stride_out_m + rn[None, :] * stride_out_n
    mask = mask_m[:, None] & mask_n[None, :]
    result = (acc * alpha).to(ACC_DTYPE)  # alpha is float64: scale in float64, then round once
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
    """``out (+)= alpha * bsr @ dense`` on batch-flattened operands (``overwrite``: ``=``, else ``+=``)."""
    B, M, N = out.shape
    Ms, Ks = values.shape[-2:]
    launch, m_tiles, n_tiles = _launch(meta, out.dtype, Ms, Ks, N)
    grid = (B * (M // Ms) * m_tiles * n_tiles,)
    flat = bool(meta.get("FLAT_LOOP", 0))
    even_k = Ks % launch["BLOCK_K"] == 0
    _bsr_dense_addmm_kernel[grid](
        crow, crow.stride(0), crow.stride(1),
        col, col.stride(0), col.stride(1),
        values, values.stride(0), values.stride(1), values.stride(2), values.stride(3),
        dense, dense.stride(0), dense.stride(1), dense.stride(2),
        out, out.stride(0), out.stride(1), out.stride(2),
        M // Ms, Ms, Ks, N, m_tiles, n_tiles, float(alpha), OVERWRITE=overwrite,
        FLAT_LOOP=flat, EVEN_K=even_k, **launch,
    )  # fmt: skip


@triton.jit
def _scatter_mm_batches_kernel(
    # "scatter_mm" format: acc[r] += sum_{g in [c_r, c_{r+1})} blocks[p_g] @ others[q_g]
    blocks_ptr, stride_blocks_p, stride_blocks_m, stride_blocks_k,
    others_ptr, stride_others_q, stride_others_k, stride_others_n,
    acc_ptr, stride_acc_r, stride_acc_m, stride_acc_n,
    c_offsets_ptr, pq_ptr, stride_pq_g, stride_pq_i,
    Ms, Ks, Ns, M_TILES, N_TILES,
    ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    r, m_t, n_t = _split_pid(N_TILES, M_TILES)
    rm = m_t * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = n_t * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = rm < Ms, rn < Ns
    g0 = tl.load(c_offsets_ptr + r).to(tl.int64)
    g1 = tl.load(c_offsets_ptr + r + 1).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for g in range(g0, g1):
        p = tl.load(pq_ptr + g * stride_pq_g).to(tl.int64)
        q = tl.load(pq_ptr + g * stride_pq_g + stride_pq_i).to(tl.int64)
        acc = _block_product(
            acc,
            blocks_ptr + p * stride_blocks_p, stride_blocks_m, stride_blocks_k,
            others_ptr + q * stride_others_q, stride_others_k, stride_others_n,
            rm, rn, mask_m, mask_n, Ks, ACC_DTYPE, PRECISION, BLOCK_K,
        )  # fmt: skip
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
    R, Ms, Ks, N, Ns, SPLIT_N, M_TILES, N_TILES,
    IS_COMPRESSED: tl.constexpr, ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    outer, m_t, n_t = _split_pid(N_TILES, M_TILES)
    b = outer // R
    i = outer % R
    rm = m_t * BLOCK_M + tl.arange(0, BLOCK_M)
    rj = n_t * BLOCK_N + tl.arange(0, BLOCK_N)  # column inside the Ns-wide tile
    mask_m, mask_n = rm < Ms, rj < Ns
    r = tl.load(r_offsets_ptr + i).to(tl.int64)
    r0 = r // N
    r1 = r % N
    if IS_COMPRESSED:
        m = r0 // Ms
        n = r1 // Ns
        c0 = tl.load(c_indices_ptr + m).to(tl.int64)
        c1 = tl.load(c_indices_ptr + m + 1).to(tl.int64)
        q_base = n * c1 + (SPLIT_N - n) * c0
        g0 = c0
        g1 = c1
    else:
        g0 = tl.load(c_indices_ptr + i).to(tl.int64)
        g1 = tl.load(c_indices_ptr + i + 1).to(tl.int64)
        q_base = g0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for g in range(g0, g1):
        if IS_COMPRESSED:
            p = g
        else:
            p = tl.load(p_offsets_ptr + g).to(tl.int64)
        q = tl.load(q_offsets_ptr + q_base + (g - g0)).to(tl.int64)
        q0 = q // N
        q1 = q % N
        acc = _block_product(
            acc,
            blocks_ptr + p * stride_blocks_p, stride_blocks_m, stride_blocks_k,
            others_ptr + b * stride_others_b + q0 * stride_others_k + q1 * stride_others_n,
            stride_others_k, stride_others_n,
            rm, rj, mask_m, mask_n, Ks, ACC_DTYPE, PRECISION, BLOCK_K,
        )  # fmt: skip
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
    if fmt == "scatter_mm":
        c_offsets, pq = indices_data[1:]
        R = c_offsets.numel() - 1
        if R == 0:
            return
        Ns = others.shape[-1]
        launch, m_tiles, n_tiles = _launch(meta, accumulators.dtype, Ms, Ks, Ns)
        _scatter_mm_batches_kernel[(R * m_tiles * n_tiles,)](
            blocks, *blocks.stride(), others, *others.stride(), accumulators, *accumulators.stride(),
            c_offsets, pq, pq.stride(0), pq.stride(1), Ms, Ks, Ns, m_tiles, n_tiles, **launch,
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
    R = r_offsets.numel()
    if R == 0 or B == 0:
        return
    launch, m_tiles, n_tiles = _launch(meta, accumulators.dtype, Ms, Ks, Ns)
    _scatter_mm_strided_kernel[(B * R * m_tiles * n_tiles,)](
        blocks, *blocks.stride(), others, *others.stride(), accumulators, *accumulators.stride(),
        c_indices, r_offsets, p_offsets, q_offsets, R, Ms, Ks, N, Ns, split_n, m_tiles, n_tiles,
        IS_COMPRESSED=compressed, **launch,
    )  # fmt: skip


@triton.jit
def _sampled_kernel(
    # SDDMM: out[b, g] = alpha * mat1[b, rows[b, g]-block, :] @ mat2[b, :, cols[b, g]-block]
    rows_ptr, stride_rows_b, stride_rows_g,
    cols_ptr, stride_cols_b, stride_cols_g,
    mat1_ptr, stride_mat1_b, stride_mat1_m, stride_mat1_k,
    mat2_ptr, stride_mat2_b, stride_mat2_k, stride_mat2_n,
    out_ptr, stride_out_b, stride_out_g, stride_out_m, stride_out_n,
    nnz, Ms, Ns, K, M_TILES, N_TILES, alpha: tl.float64,
    ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    outer, m_t, n_t = _split_pid(N_TILES, M_TILES)
    b = outer // nnz
    g = outer % nnz
    r = tl.load(rows_ptr + b * stride_rows_b + g * stride_rows_g).to(tl.int64)
    c = tl.load(cols_ptr + b * stride_cols_b + g * stride_cols_g).to(tl.int64)
    rm = m_t * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = n_t * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = rm < Ms, rn < Ns
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    acc = _block_product(
        acc,
        mat1_ptr + b * stride_mat1_b + r * Ms * stride_mat1_m, stride_mat1_m, stride_mat1_k,
        mat2_ptr + b * stride_mat2_b + c * Ns * stride_mat2_n, stride_mat2_k, stride_mat2_n,
        rm, rn, mask_m, mask_n, K, ACC_DTYPE, PRECISION, BLOCK_K,
    )  # fmt: skip
    ptrs = (
        out_ptr
        + b * stride_out_b
        + g * stride_out_g
        + rm[:, None] * stride_out_m
        + rn[None, :] * stride_out_n
    )
    result = (acc * alpha).to(ACC_DTYPE)  # alpha is float64: scale in float64, then round once
    tl.store(ptrs, result.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def sampled_blocks(
    rows: torch.Tensor,  # (B, nnz) block row of each block
    cols: torch.Tensor,  # (B, nnz) block column of each block
    Ms: int,
    Ns: int,
    mat1: torch.Tensor,  # (B, M, K)
    mat2: torch.Tensor,  # (B, K, N)
    alpha: float,
    meta: dict[str, Any],
) -> torch.Tensor:
    """(B, nnz, Ms, Ns) in ``mat1``'s dtype: ``alpha * mat1[rows block] @ mat2[cols block]`` per block."""
    B, nnz = rows.shape
    K = mat1.shape[-1]
    out = torch.empty((B, nnz, Ms, Ns), dtype=mat1.dtype, device=mat1.device)
    if out.numel() == 0:
        return out
    if K == 0:
        return out.zero_()
    launch, m_tiles, n_tiles = _launch(meta, mat1.dtype, Ms, K, Ns)
    _sampled_kernel[(B * nnz * m_tiles * n_tiles,)](
        rows, *rows.stride(), cols, *cols.stride(), mat1, *mat1.stride(), mat2, *mat2.stride(),
        out, *out.stride(), nnz, Ms, Ns, K, m_tiles, n_tiles, float(alpha), **launch,
    )  # fmt: skip
    return out
