r"""Backward formulas of the products.

For :math:`Y = \beta C + \alpha A X` with a block-sparse :math:`A` (pattern :math:`P`):

* :math:`\partial L/\partial X = \alpha A^T G` — the transposed product over a cached plan;
* :math:`\partial L/\partial A = \alpha\, (G X^T)|_P` — a sampled product (SDDMM) on :math:`A`'s own
  pattern, returned as a BSR tensor with :math:`A`'s indices;
* :math:`\partial L/\partial C = \beta G`,

each summed over the batch dimensions its operand was broadcast along. PyTorch's autograd engine cannot
accumulate a gradient into a *leaf* BSR tensor ("Sparse BSR tensors do not have is_contiguous", measured
on torch 2.13), so make the values the leaf: ``bsr = torch.sparse_bsr_tensor(crow, col, values)`` with
``values.requires_grad``; the BSR gradient then flows into ``values.grad``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from bsrkit import dispatch
from bsrkit.operand import Operand

if TYPE_CHECKING:
    from bsrkit.backends.base import Backend

__all__ = ["BsrDenseAddmm"]


def _sum_to(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum ``t`` over the dimensions along which a tensor of ``shape`` was broadcast to ``t.shape``."""
    if t.shape == shape:
        return t
    lead = t.ndim - len(shape)
    dims = tuple(range(lead)) + tuple(
        lead + i for i, s in enumerate(shape) if s == 1 and t.shape[lead + i] != 1
    )
    return t.sum(dim=dims, keepdim=False).reshape(shape) if dims else t.reshape(shape)


class BsrDenseAddmm(torch.autograd.Function):
    r"""``beta * input + left * (alpha * bsr @ dense) * right`` with gradients for every tensor.

    With :math:`P = \alpha A X` and :math:`G' = \ell \odot G \odot r`: :math:`\partial X = \alpha A^T G'`,
    :math:`\partial A = \alpha (G' X^T)|_P`, :math:`\partial \ell = \sum_n G \odot P \odot r`,
    :math:`\partial r = \sum_m G \odot P \odot \ell`, :math:`\partial C = \beta G`. Called by
    :mod:`bsrkit.ops` with validated arguments: ``a`` is ``bsr``'s operand (None when nothing is stored)
    and ``batch`` the broadcast batch shape.
    """

    @staticmethod
    def forward(
        ctx: Any,
        op: str,
        backend: Backend,
        input: torch.Tensor | None,
        bsr: torch.Tensor,
        dense: torch.Tensor,
        left: torch.Tensor | None,
        right: torch.Tensor | None,
        a: Operand | None,
        batch: torch.Size,
        beta: float,
        alpha: float,
        meta: dict[str, Any] | None,
    ) -> torch.Tensor:
        out = torch.empty((*batch, bsr.shape[-2], dense.shape[-1]), dtype=dense.dtype, device=dense.device)
        dispatch.addmm(op, backend, input, a, dense, out, batch, beta, alpha, meta, left, right)
        ctx.bsr = bsr.detach()
        ctx.save_for_backward(dense, left, right)
        ctx.scalars = (beta, alpha)
        ctx.input_shape = None if input is None else input.shape
        ctx.backend, ctx.meta, ctx.has_operand = backend, meta, a is not None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        dense, left, right = ctx.saved_tensors
        bsr = ctx.bsr
        beta, alpha = ctx.scalars
        batch = grad.shape[:-2]
        grad_input = grad_bsr = grad_dense = grad_left = grad_right = None
        if ctx.needs_input_grad[2] and ctx.input_shape is not None:
            grad_input = _sum_to(grad * beta, ctx.input_shape)
        if ctx.needs_input_grad[5] or ctx.needs_input_grad[6]:
            product = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)  # P = alpha A X
            a = Operand.of(bsr) if ctx.has_operand else None  # (bsr, detached, outlives the forward's key)
            dispatch.addmm(
                "bsr_dense_addmm", ctx.backend, None, a, dense, product, batch, 0.0, alpha, ctx.meta
            )
            if ctx.needs_input_grad[5]:
                gp = grad * product if right is None else grad * product * right.unsqueeze(-2)
                grad_left = _sum_to(gp.sum(-1), left.shape)
            if ctx.needs_input_grad[6]:
                gp = grad * product if left is None else grad * product * left.unsqueeze(-1)
                grad_right = _sum_to(gp.sum(-2), right.shape)
        if left is not None:
            grad = grad * left.unsqueeze(-1)
        if right is not None:
            grad = grad * right.unsqueeze(-2)
        if ctx.needs_input_grad[3]:
            # dA = alpha (G' X^T)|P: an SDDMM on bsr's own pattern.
            backend = dispatch.select("sampled_addmm", "sampled", grad.device, grad.dtype)
            values = dispatch.sampled("sampled_addmm", backend, Operand.of(bsr), grad, dense.mT, batch, alpha)
            values = _sum_to(values, bsr.values().shape)
            grad_bsr = torch.sparse_bsr_tensor(
                bsr.crow_indices(), bsr.col_indices(), values, size=bsr.shape, check_invariants=False
            )
        if ctx.needs_input_grad[4]:
            # dX = alpha A^T G': the transposed product over the cached transpose plan.
            op = "bsr_transposed_dense_mm"
            backend = dispatch.select(op, "addmm", grad.device, grad.dtype)
            M, K = bsr.shape[-2:]
            out = torch.empty((*batch, K, grad.shape[-1]), dtype=grad.dtype, device=grad.device)
            a = Operand.of(bsr).transposed() if bsr._nnz() and M and alpha and out.numel() else None
            g = dispatch.addmm(op, backend, None, a, grad, out, batch, 0.0, alpha, None)
            grad_dense = _sum_to(g, dense.shape)
        return (None, None, grad_input, grad_bsr, grad_dense, grad_left, grad_right) + (None,) * 5
