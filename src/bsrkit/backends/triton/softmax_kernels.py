"""Triton kernels of the block-row softmax and its gradient.

One program per (batch, block row, tile of ``BLOCK_M`` rows of the block); it walks the row's stored
blocks in ``BLOCK_N``-column tiles twice: first an online maximum and sum (the sum rescaled whenever the
maximum grows), then the normalised exponentials. Accumulation is float32 (float64 for float64). Every
tensor is passed with all its strides; offsets are int64. Semantics in ``Backend.softmax``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bsrkit.backends.triton.tiles import tile

__all__ = ["softmax_backward_blocks", "softmax_blocks"]

_ACC = {
    torch.float16: tl.float32,
    torch.bfloat16: tl.float32,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


def _tiles(Ms: int, Ns: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): up to 128 columns, and rows so that a tile holds at most 4096 entries."""
    block_n = min(tile(Ns), 128)
    return min(tile(Ms), max(16, 4096 // block_n)), block_n


@triton.jit
def _row_program(MB, M_TILES, crow_ptr, stride_crow_b, stride_crow_m, BLOCK_M: tl.constexpr):
    """This program's (batch, first and last stored block of its block row, rows inside the block)."""
    pid = tl.program_id(0).to(tl.int64)
    m_t = pid % M_TILES
    row = pid // M_TILES
    b = row // MB
    r = row % MB
    crow = crow_ptr + b * stride_crow_b + r * stride_crow_m
    g0 = tl.load(crow).to(tl.int64)
    g1 = tl.load(crow + stride_crow_m).to(tl.int64)
    return b, g0, g1, m_t * BLOCK_M + tl.arange(0, BLOCK_M)


@triton.jit
def _softmax_kernel(
    crow_ptr, stride_crow_b, stride_crow_m,
    # x, bias (broadcast already, or unused), out: (B, nnz, Ms, Ns)
    x_ptr, stride_x_b, stride_x_g, stride_x_m, stride_x_n,
    bias_ptr, stride_bias_b, stride_bias_g, stride_bias_m, stride_bias_n,
    out_ptr, stride_out_b, stride_out_g, stride_out_m, stride_out_n,
    MB, Ms, Ns, M_TILES,
    HAS_BIAS: tl.constexpr, ZERO_EMPTY_ROWS: tl.constexpr, ACC_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b, g0, g1, rm = _row_program(MB, M_TILES, crow_ptr, stride_crow_b, stride_crow_m, BLOCK_M)
    mask_m = rm < Ms
    row_max = tl.full((BLOCK_M,), float("-inf"), ACC_DTYPE)
    row_sum = tl.zeros((BLOCK_M,), ACC_DTYPE)
    for g in range(g0, g1):
        for n0 in range(0, Ns, BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
            mask = mask_m[:, None] & (rn < Ns)[None, :]
            x_ptrs = x_ptr + b * stride_x_b + g * stride_x_g
            z = tl.load(
                x_ptrs + rm[:, None] * stride_x_m + rn[None, :] * stride_x_n, mask=mask, other=float("-inf")
            ).to(ACC_DTYPE)
            if HAS_BIAS:
                bias_ptrs = bias_ptr + b * stride_bias_b + g * stride_bias_g
                c = tl.load(
                    bias_ptrs + rm[:, None] * stride_bias_m + rn[None, :] * stride_bias_n,
                    mask=mask,
                    other=0.0,
                ).to(ACC_DTYPE)
                z = tl.where(c == float("-inf"), c, z + c)  # excluded stays excluded, NaN or not
            new_max = tl.maximum(row_max, tl.max(z, 1))
            # A row still all -inf shifts by 0: its exponentials are 0 and its sum stays 0.
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            row_sum = row_sum * tl.exp(row_max - shift) + tl.sum(tl.exp(z - shift[:, None]), 1)
            row_max = new_max
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    # A row of -inf only (sum 0): 0, or NaN as torch.softmax gives.
    inv = 1.0 / tl.where(row_sum == 0.0, 1.0, row_sum)
    inv = tl.where(row_sum == 0.0, 0.0 if ZERO_EMPTY_ROWS else float("nan"), inv)
    for g in range(g0, g1):
        for n0 in range(0, Ns, BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
            mask = mask_m[:, None] & (rn < Ns)[None, :]
            x_ptrs = x_ptr + b * stride_x_b + g * stride_x_g
            z = tl.load(
                x_ptrs + rm[:, None] * stride_x_m + rn[None, :] * stride_x_n, mask=mask, other=float("-inf")
            ).to(ACC_DTYPE)
            if HAS_BIAS:
                bias_ptrs = bias_ptr + b * stride_bias_b + g * stride_bias_g
                c = tl.load(
                    bias_ptrs + rm[:, None] * stride_bias_m + rn[None, :] * stride_bias_n,
                    mask=mask,
                    other=0.0,
                ).to(ACC_DTYPE)
                z = tl.where(c == float("-inf"), c, z + c)  # excluded stays excluded, NaN or not
            y = tl.exp(z - shift[:, None]) * inv[:, None]
            out_ptrs = out_ptr + b * stride_out_b + g * stride_out_g
            tl.store(
                out_ptrs + rm[:, None] * stride_out_m + rn[None, :] * stride_out_n,
                y.to(out_ptr.dtype.element_ty), mask=mask,
            )  # fmt: skip


@triton.jit
def _softmax_backward_kernel(
    crow_ptr, stride_crow_b, stride_crow_m,
    # y, grad, out: (B, nnz, Ms, Ns); out = y * (grad - sum_row(grad * y))
    y_ptr, stride_y_b, stride_y_g, stride_y_m, stride_y_n,
    grad_ptr, stride_grad_b, stride_grad_g, stride_grad_m, stride_grad_n,
    out_ptr, stride_out_b, stride_out_g, stride_out_m, stride_out_n,
    MB, Ms, Ns, M_TILES,
    ACC_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b, g0, g1, rm = _row_program(MB, M_TILES, crow_ptr, stride_crow_b, stride_crow_m, BLOCK_M)
    mask_m = rm < Ms
    dot = tl.zeros((BLOCK_M,), ACC_DTYPE)
    for g in range(g0, g1):
        for n0 in range(0, Ns, BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
            mask = mask_m[:, None] & (rn < Ns)[None, :]
            y_ptrs = y_ptr + b * stride_y_b + g * stride_y_g
            y = tl.load(y_ptrs + rm[:, None] * stride_y_m + rn[None, :] * stride_y_n, mask=mask, other=0.0)
            grad_ptrs = grad_ptr + b * stride_grad_b + g * stride_grad_g
            dy = tl.load(
                grad_ptrs + rm[:, None] * stride_grad_m + rn[None, :] * stride_grad_n, mask=mask, other=0.0
            )
            dot += tl.sum(y.to(ACC_DTYPE) * dy.to(ACC_DTYPE), 1)
    for g in range(g0, g1):
        for n0 in range(0, Ns, BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
            mask = mask_m[:, None] & (rn < Ns)[None, :]
            y_ptrs = y_ptr + b * stride_y_b + g * stride_y_g
            y = tl.load(y_ptrs + rm[:, None] * stride_y_m + rn[None, :] * stride_y_n, mask=mask, other=0.0)
            grad_ptrs = grad_ptr + b * stride_grad_b + g * stride_grad_g
            dy = tl.load(
                grad_ptrs + rm[:, None] * stride_grad_m + rn[None, :] * stride_grad_n, mask=mask, other=0.0
            )
            dx = y.to(ACC_DTYPE) * (dy.to(ACC_DTYPE) - dot[:, None])
            out_ptrs = out_ptr + b * stride_out_b + g * stride_out_g
            tl.store(
                out_ptrs + rm[:, None] * stride_out_m + rn[None, :] * stride_out_n,
                dx.to(out_ptr.dtype.element_ty), mask=mask,
            )  # fmt: skip


def softmax_blocks(
    crow: torch.Tensor,  # (B, MB + 1)
    x: torch.Tensor,  # (B, nnz, Ms, Ns)
    bias: torch.Tensor | None,  # (B, nnz, Ms, Ns) (stride-0 views welcome) or None
    zero_empty_rows: bool,
) -> torch.Tensor:
    """Softmax over each row's stored entries (see ``Backend.softmax``); a new tensor in x's dtype."""
    B, _, Ms, Ns = x.shape
    MB = crow.shape[1] - 1
    out = torch.empty_like(x)
    block_m, block_n = _tiles(Ms, Ns)
    m_tiles = triton.cdiv(Ms, block_m)
    bias_args = (x, 0, 0, 0, 0) if bias is None else (bias, *bias.stride())
    _softmax_kernel[(B * MB * m_tiles,)](
        crow, *crow.stride(), x, *x.stride(), *bias_args, out, *out.stride(), MB, Ms, Ns, m_tiles,
        HAS_BIAS=bias is not None, ZERO_EMPTY_ROWS=zero_empty_rows, ACC_DTYPE=_ACC[x.dtype],
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return out


def softmax_backward_blocks(crow: torch.Tensor, y: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``y * (grad - sum_row(grad * y))`` on (B, nnz, Ms, Ns) values; a new tensor in y's dtype."""
    B, _, Ms, Ns = y.shape
    MB = crow.shape[1] - 1
    out = torch.empty_like(y)
    block_m, block_n = _tiles(Ms, Ns)
    m_tiles = triton.cdiv(Ms, block_m)
    _softmax_backward_kernel[(B * MB * m_tiles,)](
        crow, *crow.stride(), y, *y.stride(), grad, *grad.stride(), out, *out.stride(), MB, Ms, Ns, m_tiles,
        ACC_DTYPE=_ACC[y.dtype], BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return out
