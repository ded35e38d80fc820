r"""Softmax over the stored entries of each row of a BSR tensor, with ``torch.sparse._triton_ops``'s
semantics: the unstored entries count as :math:`-\infty`.

For row :math:`r` of batch :math:`b` with stored entries :math:`x_{rj}` (every column :math:`j` of every
stored block of the row's block row):

.. math:: y_{rj} = \frac{e^{x_{rj} - m_r}}{\sum_{j'} e^{x_{rj'} - m_r}}, \qquad m_r = \max_{j'} x_{rj'}.

Its gradient, on the same entries: :math:`\partial L/\partial x_{rj} = y_{rj}\,(g_{rj} - \sum_{j'} g_{rj'}
y_{rj'})` with :math:`g = \partial L/\partial y`.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from bsrkit import autograd, dispatch
from bsrkit.eager import eager_under_compile
from bsrkit.operand import Operand
from bsrkit.validation import ArgumentTypeError, check_bsr, is_int, resolved, type_name

if TYPE_CHECKING:
    from bsrkit.backends.base import Backend

__all__ = ["bsr_softmax"]


@eager_under_compile
def bsr_softmax(input: torch.Tensor, max_row_nnz: int | None = None) -> torch.Tensor:
    r"""Softmax over each row's stored entries of the BSR tensor ``input`` (unstored entries are
    :math:`-\infty`, so they get no weight); returns a BSR tensor with ``input``'s indices (copies) and
    shape. Semantics of ``torch.sparse._triton_ops.bsr_softmax``:

    * a row with no stored block has no entries and stays empty; a row whose stored entries are all
      :math:`-\infty` gives NaN, as ``torch.softmax`` does on a dense row of :math:`-\infty`;
    * any block shape, batch dimensions ``(*B, M, N)``; float16 and bfloat16 are computed in float32;
    * differentiable in ``input``'s values (build ``input`` from ``values`` with ``requires_grad``).

    ``max_row_nnz`` (torch's tile hint, the largest number of stored entries in a row) is accepted for
    compatibility and checked; the kernels find each row's length themselves.
    """
    op = "bsr_softmax"
    check_bsr(op, "input", input)
    if max_row_nnz is not None:
        if not is_int(max_row_nnz):
            raise ArgumentTypeError(
                f"{op}(): expected max_row_nnz to be an int or None, got {type_name(max_row_nnz)}"
            )
        if max_row_nnz < 1:
            raise ValueError(f"{op}(): expected max_row_nnz >= 1, got {max_row_nnz}")
    backend = dispatch.select(op, "softmax", input.device, input.dtype)  # a bad override fails on any input
    if input._nnz() == 0 or input.numel() == 0:
        return input.clone()
    a = Operand.of(input, op, "input")
    values = input.values()
    if torch.is_grad_enabled() and values.requires_grad:
        y = BsrSoftmax.apply(values, backend, a._replace(values=a.values.detach()))
    else:
        y = dispatch.softmax(backend, a, values)
    crow, col = a.kernel_indices()  # (the pattern the softmax ran on)
    return torch.sparse_bsr_tensor(crow.clone(), col.clone(), y, size=input.shape, check_invariants=False)


class BsrSoftmax(torch.autograd.Function):
    """Softmax of BSR values ``(*B, nnz, Ms, Ns)`` over ``a``'s rows, with its gradient."""

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, backend: Backend, a: Operand) -> torch.Tensor:
        y = dispatch.softmax(backend, a, values)
        ctx.save_for_backward(y)
        ctx.backend = backend
        ctx.a = a
        return y

    @staticmethod
    @eager_under_compile  # (a backward run inside a compiled frame reaches the compiled loops too)
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if torch.is_grad_enabled():
            # Under create_graph: the gradient first_order_only marks reaches the BSR input's values
            # through torch's backward of values() and the BSR constructor, which drop the mark (torch
            # 2.13), so the error it would raise never comes.
            warnings.warn(SECOND_ORDER_WARNING, UserWarning, stacklevel=2)
        return _first_order_backward(ctx, grad)


@autograd.first_order_only("bsr_softmax")
def _first_order_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    (y,) = ctx.saved_tensors
    grad = resolved(grad)  # (a negative view: the kernels read memory)
    return dispatch.softmax_backward(ctx.backend, ctx.a, y, grad), None, None


SECOND_ORDER_WARNING = (
    "bsr_softmax(): differentiated with create_graph, but its backward has no graph (it is first-order "
    "only) and torch's BSR values() and constructor drop the error that would say so: second-order "
    "gradients through bsr_softmax are missing its terms"
)
