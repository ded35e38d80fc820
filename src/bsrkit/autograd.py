r"""Backward formulas of the products, themselves differentiable (double backward works).

For :math:`Y = \beta C + \alpha\, \mathrm{op}(A) X` with a block-sparse :math:`A` (pattern :math:`P`),
:math:`\mathrm{op}` the identity or the transpose:

* :math:`\partial L/\partial X = \alpha\, \mathrm{op}(A)^T G` — the other product over a cached plan;
* :math:`\partial L/\partial A = \alpha\, (G X^T)|_P` (:math:`\alpha\, (X G^T)|_P` for the transpose) —
  a sampled product (SDDMM) on :math:`A`'s own pattern, returned as a BSR tensor with :math:`A`'s indices;
* :math:`\partial L/\partial C = \beta G`.

For the sampled product :math:`V = \beta V_C + \alpha\, (M_1 M_2)|_P` with the gradient :math:`G_V` of its
values (:math:`G_V` read as the BSR :math:`\hat G` on :math:`P`): :math:`\partial M_1 = \alpha \hat G
M_2^T`, :math:`\partial M_2 = \alpha M_1^T \hat G`, :math:`\partial V_C = \beta G_V`.

Each gradient is summed over the batch dimensions its operand was broadcast along. Each backward is made
of these same two products, called through their :class:`torch.autograd.Function`, so the gradients are
differentiable again (a gradient penalty, ``gradgradcheck``). PyTorch's autograd engine cannot
accumulate a gradient into a *leaf* BSR tensor ("Sparse BSR tensors do not have is_contiguous", measured
on torch 2.13), so make the values the leaf: ``bsr = torch.sparse_bsr_tensor(crow, col, values)`` with
``values.requires_grad``; the BSR gradient then flows into ``values.grad``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.autograd.forward_ad as forward_ad

from bsrkit import dispatch
from bsrkit.eager import eager_under_compile
from bsrkit.operand import Operand
from bsrkit.validation import resolved

if TYPE_CHECKING:
    from bsrkit.backends.base import Backend

__all__ = [
    "SECOND_ORDER_WARNING",
    "BsrDenseAddmm",
    "SampledAddmm",
    "first_order_only",
    "product",
    "refuse_tangents",
    "sampled",
]

# A backward under create_graph whose incoming gradient carries no graph: sampled_addmm's result is a BSR
# tensor, and torch's backward of a BSR's values() and of its constructor returns gradients without one
# (torch 2.13), so the terms of a second derivative that run through that gradient are missing. Exact
# only where the loss is linear in the result's values (the incoming gradient is then a constant).
SECOND_ORDER_WARNING = (
    "sampled_addmm(): differentiated with create_graph, but the gradient of its BSR result reached it "
    "without a graph (torch's BSR values() and constructor pass none): second-order gradients are exact "
    "only if the loss is linear in the result's values"
)


def refuse_tangents(tensors: tuple[Any, ...]) -> None:
    """Forward-mode AD is not implemented: a tangent would be dropped silently (torch's sparse products
    raise NotImplementedError too). Callers ask only inside a dual level (``forward_ad._current_level``)."""
    for t in tensors:
        dual = isinstance(t, torch.Tensor) and t.layout is torch.strided
        if dual and forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                "bsrkit: forward-mode AD (torch.autograd.forward_ad, torch.func.jvp) is not implemented for "
                "its products and attention: use reverse mode (backward, torch.autograd.grad)"
            )


def first_order_only(op: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A backward computed without a graph (``bsr_softmax``'s, the attention's), as torch's
    ``once_differentiable``, but also marked when only its *saved* tensors require grad (a gradient
    penalty: a constant incoming gradient, inputs that require grad), where torch's leaves the gradients
    without a graph, so that a second-order term would silently be missing. Under ``create_graph`` the
    gradients it returns raise a ``RuntimeError`` naming ``op`` when differentiated again."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def backward(ctx: Any, *grads: Any) -> Any:
            ctx = _SavedOnce(ctx)  # (non-reentrant activation checkpointing unpacks them once only)
            with torch.no_grad():
                outputs = fn(ctx, *grads)
            if not torch.is_grad_enabled():
                return outputs
            tracked = [t for t in (*grads, *ctx.saved_tensors) if isinstance(t, torch.Tensor)]
            if not any(t.requires_grad for t in tracked):
                return outputs
            positions = [i for i, o in enumerate(outputs) if isinstance(o, torch.Tensor)]
            message = f"{op}(): double backward is not supported (its backward is computed without a graph)"
            delayed = torch._C._functions.DelayedError(message.encode(), len(positions))
            # A zero on the graph of every tracked tensor (an empty slice's sum: exact, whatever the
            # values), so that differentiating the outputs with respect to any of them (autograd.grad runs
            # only the nodes on the paths to its inputs) reaches the error, never a silent gap.
            zeros = [_values_of(t).flatten()[:0].sum() for t in tracked if t.requires_grad]
            anchor = sum(zeros[1:], zeros[0])
            marked = delayed(*(_anchored(outputs[i], anchor) for i in positions))
            marked = marked if isinstance(marked, tuple) else (marked,)
            result = list(outputs)
            for i, t in zip(positions, marked, strict=True):
                result[i] = t
            return tuple(result)

        return backward

    return decorate


class _SavedOnce:
    """A backward's ``ctx`` whose ``saved_tensors`` are unpacked once and kept (other attributes: the
    context's)."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self.saved_tensors = ctx.saved_tensors

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


def _values_of(t: torch.Tensor) -> torch.Tensor:
    return t if t.layout is torch.strided else t.values()


def _anchored(t: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """``t`` (computed without a graph) plus the zero ``anchor``: the same values, on anchor's graph."""
    if t.layout is torch.strided:
        return t + anchor.to(t.dtype)
    return t.detach().requires_grad_()  # (a sparse gradient: marked alone, as before)


def _sum_to(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum ``t`` over the dimensions along which a tensor of ``shape`` was broadcast to ``t.shape``."""
    if t.shape == shape:
        return t
    lead = t.ndim - len(shape)
    dims = tuple(range(lead)) + tuple(
        lead + i for i, s in enumerate(shape) if s == 1 and t.shape[lead + i] != 1
    )
    return t.sum(dim=dims, keepdim=False).reshape(shape) if dims else t.reshape(shape)


def _like_pattern(bsr: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The BSR with ``bsr``'s pattern and ``values`` (whose batch may be wider than ``bsr``'s)."""
    crow, col = bsr.crow_indices(), bsr.col_indices()
    batch = values.shape[:-3]
    if crow.shape[:-1] != batch:
        crow, col = crow.expand(*batch, -1).contiguous(), col.expand(*batch, -1).contiguous()
    size = (*batch, *bsr.shape[-2:])
    return torch.sparse_bsr_tensor(crow, col, values, size=size, check_invariants=False)


def product(
    bsr: torch.Tensor,
    dense: torch.Tensor,
    transpose: bool,
    alpha: float,
    meta: dict[str, Any] | None = None,
) -> torch.Tensor:
    """``alpha * op(bsr) @ dense`` (op: transpose or identity) for operands checked before (a forward's),
    differentiable in both."""
    op = "bsr_transposed_dense_mm" if transpose else "bsr_dense_mm"
    backend = dispatch.select(op, "addmm", dense.device, dense.dtype)
    M, K = bsr.shape[-2:]
    if transpose:
        M, K = K, M
    batch = torch.broadcast_shapes(bsr.shape[:-2], dense.shape[:-2])
    a = None
    if bsr._nnz() and M and K and alpha and dense.shape[-1]:
        a = Operand.of(bsr, op)
        if transpose:
            a = a.transposed()
    return BsrDenseAddmm.apply(
        op, backend, None, bsr, dense, None, None, a, batch, 0.0, alpha, meta, transpose
    )


def sampled(pattern: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, alpha: float) -> torch.Tensor:
    """The values ``alpha * (mat1 @ mat2)|P`` at ``pattern``'s blocks, differentiable in both matrices."""
    op = "sampled_addmm"
    backend = dispatch.select(op, "sampled", mat1.device, mat1.dtype)
    batch = torch.broadcast_shapes(pattern.shape[:-2], mat1.shape[:-2], mat2.shape[:-2])
    a = Operand.of(pattern, op, "input")
    return SampledAddmm.apply(op, backend, pattern, a, mat1, mat2, batch, 0.0, alpha)


def _forward_pattern(a: Operand | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The validated ``(crow, col)`` a forward computed with, on the CPU (where its hits compare the index
    data), for :func:`_check_unchanged`; None without stored blocks or off the CPU."""
    if a is None or a.pattern is None or a.crow.device.type != "cpu":
        return None
    return a.pattern.indices


def _check_unchanged(
    saved: tuple[torch.Tensor, torch.Tensor] | None, bsr: torch.Tensor, op: str, name: str
) -> None:
    """Refuse a backward whose BSR operand's pattern was written in place after its forward (the gradient
    would be another matrix's: torch refuses a saved tensor written in place the same way)."""
    if saved is None:
        return
    check_indices_unchanged(saved, Operand.of(bsr, op, name).kernel_indices(), op, name)


def check_indices_unchanged(
    saved: tuple[torch.Tensor, torch.Tensor], now: tuple[torch.Tensor, torch.Tensor], op: str, name: str
) -> None:
    """Refuse a backward whose pattern ``now`` (``(crow, col)``) differs from the one its forward computed
    with (``saved``, a copy): see :func:`_check_unchanged`."""
    crow, col = now
    if (crow is saved[0] and col is saved[1]) or (torch.equal(crow, saved[0]) and torch.equal(col, saved[1])):
        return
    raise RuntimeError(
        f"{op}(): {name}'s index data were written in place between the forward and the backward (its "
        "gradient would be another matrix's): write a copy, or run the forward again"
    )


class BsrDenseAddmm(torch.autograd.Function):
    r"""``beta * input + left * (alpha * op(bsr) @ dense) * right`` with gradients for every tensor.

    With :math:`P = \alpha\, \mathrm{op}(A) X` and :math:`G' = \ell \odot G \odot r`: :math:`\partial X =
    \alpha\, \mathrm{op}(A)^T G'`, :math:`\partial A = \alpha (G' X^T)|_P` (transposed: :math:`\alpha (X
    G'^T)|_P`), :math:`\partial \ell = \sum_n G \odot P \odot r`, :math:`\partial r = \sum_m G \odot P
    \odot \ell`, :math:`\partial C = \beta G`. Called by :mod:`bsrkit.ops` with validated arguments:
    ``a`` is ``op(bsr)``'s operand (None when nothing is stored) and ``batch`` the broadcast batch shape.
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
        transpose: bool = False,
    ) -> torch.Tensor:
        M = bsr.shape[-1] if transpose else bsr.shape[-2]
        out = torch.empty((*batch, M, dense.shape[-1]), dtype=dense.dtype, device=dense.device)
        dispatch.addmm(op, backend, input, a, dense, out, batch, beta, alpha, meta, left, right)
        ctx.save_for_backward(bsr, dense, left, right)
        ctx.pattern = _forward_pattern(a)  # (a transposed operand keeps bsr's own validated pattern)
        ctx.op = op
        ctx.scalars = (beta, alpha, transpose)
        ctx.input_shape = None if input is None else input.shape
        ctx.meta = meta
        return out

    @staticmethod
    @eager_under_compile  # (a backward run inside a compiled frame reaches the compiled loops too)
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        bsr, dense, left, right = ctx.saved_tensors
        beta, alpha, transpose = ctx.scalars
        grad = resolved(grad)  # (a negative view: the kernels read memory)
        _check_unchanged(ctx.pattern, bsr, ctx.op, "bsr")
        grad_input = grad_bsr = grad_dense = grad_left = grad_right = None
        if ctx.needs_input_grad[2] and ctx.input_shape is not None:
            grad_input = _sum_to(grad * beta, ctx.input_shape)
        if ctx.needs_input_grad[5] or ctx.needs_input_grad[6]:
            p = product(bsr, dense, transpose, alpha, ctx.meta)  # P = alpha op(A) X
            if ctx.needs_input_grad[5]:
                gp = grad * p if right is None else grad * p * right.unsqueeze(-2)
                grad_left = _sum_to(gp.sum(-1), left.shape)
            if ctx.needs_input_grad[6]:
                gp = grad * p if left is None else grad * p * left.unsqueeze(-1)
                grad_right = _sum_to(gp.sum(-2), right.shape)
        if left is not None:
            grad = grad * left.unsqueeze(-1)
        if right is not None:
            grad = grad * right.unsqueeze(-2)
        if ctx.needs_input_grad[3]:
            # dA = alpha (G' X^T)|P, or alpha (X G'^T)|P for op = transpose: an SDDMM on A's own pattern.
            m1, m2 = (dense, grad.mT) if transpose else (grad, dense.mT)
            values = _sum_to(sampled(bsr, m1, m2, alpha), bsr.values().shape)
            grad_bsr = _like_pattern(bsr, values)
        if ctx.needs_input_grad[4]:
            # dX = alpha op(A)^T G': the other product over the cached (transpose) plan.
            grad_dense = _sum_to(product(bsr, grad, not transpose, alpha), dense.shape)
        return (None, None, grad_input, grad_bsr, grad_dense, grad_left, grad_right) + (None,) * 6


class SampledAddmm(torch.autograd.Function):
    r"""The values ``beta * input.values() + alpha * (mat1 @ mat2)|P`` of :func:`bsrkit.sampled_addmm`,
    with gradients for ``input``'s values, ``mat1`` and ``mat2`` (see the module's formulas). Called with
    validated arguments: ``a`` is ``input``'s operand and ``batch`` the broadcast batch shape."""

    @staticmethod
    def forward(
        ctx: Any,
        op: str,
        backend: Backend,
        input: torch.Tensor,
        a: Operand,
        mat1: torch.Tensor,
        mat2: torch.Tensor,
        batch: torch.Size,
        beta: float,
        alpha: float,
    ) -> torch.Tensor:
        values = dispatch.sampled_addmm(op, backend, a, mat1, mat2, batch, beta, alpha, input)
        ctx.save_for_backward(input, mat1, mat2)
        ctx.scalars = (beta, alpha)
        ctx.pattern, ctx.op = _forward_pattern(a), op
        return values

    @staticmethod
    @eager_under_compile
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        input, mat1, mat2 = ctx.saved_tensors
        beta, alpha = ctx.scalars
        grad = resolved(grad)  # (a negative view: the kernels read memory)
        _check_unchanged(ctx.pattern, input, ctx.op, "input")
        if torch.is_grad_enabled() and not grad.requires_grad and (mat1.requires_grad or mat2.requires_grad):
            warnings.warn(SECOND_ORDER_WARNING, UserWarning, stacklevel=2)
        grad_input = grad_mat1 = grad_mat2 = None
        g = _like_pattern(input, grad)  # the values' gradient as a BSR on input's pattern
        if ctx.needs_input_grad[2] and beta != 0:
            grad_input = _like_pattern(input, _sum_to(grad * beta, input.values().shape))
        if ctx.needs_input_grad[4]:
            grad_mat1 = _sum_to(product(g, mat2.mT, False, alpha), mat1.shape)  # alpha G M2^T
        if ctx.needs_input_grad[5]:
            grad_mat2 = _sum_to(product(g, mat1, True, alpha).mT, mat2.shape)  # alpha (G^T M1)^T
        return None, None, grad_input, None, grad_mat1, grad_mat2, None, None, None
