"""The products as ``torch.library`` custom ops, with fake (meta) kernels and autograd formulas (made of
the same two ops, so twice differentiable), so that ``torch.compile(..., fullgraph=True)`` traces models
that use them (``bsrkit.nn.BSRLinear``); ``bsrkit::linear_product`` is :func:`linear_product` as a plain
``torch.library`` op (no autograd), for traced calls that need no gradient.

The sparse operand travels as strided parts (``crow``, ``col``, ``values``): custom ops cannot take BSR
tensors. ``linear`` keeps one BSR wrapper per weight (:func:`bsrkit.shortcuts.kept_weight`), so its
repeated calls take the public products' shortcuts, and its plans live as long as the weight's tensors
(a module's buffers and parameter); ``bsr_mm`` and ``sampled_mm`` cache plans on the ``(crow, col)``
pair. Imported by :mod:`bsrkit.nn`, not by ``import bsrkit``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad

from bsrkit import dispatch, ops, shortcuts
from bsrkit.autograd import check_indices_unchanged, refuse_tangents
from bsrkit.freshness import check_mode
from bsrkit.operand import Operand
from bsrkit.validation import check_operand_dtypes, check_same_device, resolved

__all__ = [
    "EagerLinear",
    "bsr_mm",
    "differentiable_linear",
    "linear",
    "linear_product",
    "linear_product_op",
    "sampled_mm",
]


def linear_product(
    crow: torch.Tensor,
    col: torch.Tensor,
    values: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    M: int,
    K: int,
    transposed: bool,
    used: list[Operand] | None = None,
) -> torch.Tensor:
    r""":math:`y = x W^T + b` (``transposed``: :math:`y = x W`) for the BSR weight :math:`W = ` ``(crow,
    col, values)`` of shape ``(M, K)`` and ``x`` ``(..., K)`` (``(..., M)``); ``y`` is row-major, ``(...,
    M)`` (``(..., K)``). Computes nothing for autograd: :func:`linear` is the differentiable op, and
    :class:`bsrkit.nn.BSRLinear` calls this directly where no gradient is needed (it skips the
    dispatcher's ~30 µs). ``used``: a list that receives the operand whose (validated) pattern the product
    ran on, where one did (:class:`EagerLinear`'s backward computes with that pattern).

    The kernel writes :math:`y^T = W x^T` into the transposed view of a row-major ``y`` (its rows: every
    leading index of ``x``): ``x^T`` is a column-major view, read without a copy where ``x``'s rows are
    one strided matrix, and the output has the layout every later op expects."""
    if forward_ad._current_level >= 0:  # (a dual level: a tangent would be dropped, the kept weight's too)
        refuse_tangents((x, values, bias))
    if x.is_neg():
        x = resolved(x)  # (the kernels read memory)
    weight, calls = shortcuts.kept_weight(crow, col, values, (M, K))
    y = x.new_empty(*x.shape[:-1], K if transposed else M)  # (sizes as arguments: ~0.5 µs less than a tuple)
    if bias is not None and y.dtype in (torch.float16, torch.bfloat16):
        # The bias added to the float32 sums and the result rounded once, as F.linear (added to the
        # product already rounded, ~12% of the outputs were one rounding off): the product with an input
        # (detached: this op computes no gradient, bsrkit::linear's backward does).
        validated = Operand.of(weight, _OP, "weight", members_proven=True)
        ops.checked_addmm(
            _OP, bias.detach()[:, None], weight, dispatch.rows(x).mT, beta=1.0, alpha=1.0,
            out=dispatch.rows(y).mT, meta=None, transpose=transposed, operand=validated,
        )  # fmt: skip
        if used is not None:
            used.append(validated)
        return y
    # What the checks and the prepared call of this product depend on beyond the kept weight's own (fixed)
    # metadata: x's whole layout (y is new and row-major: its layout is x's shape's) and the thread count.
    signature = (x.shape, x.stride(), x.storage_offset(), x.dtype, x.device, x.requires_grad, transposed,
                 torch.is_grad_enabled(), dispatch.forced_backend(), torch.get_num_threads())  # fmt: skip
    call = calls.get(signature)
    a, done = None, False
    if call is not None and not transposed and y.numel():
        unproven = check_mode()[0]
        try:
            if unproven:  # (the direct rerun: its loop is the whole proof, see bsrkit.shortcuts)
                a = dispatch.rerun_weight_call_directly(call, values, x, y)
                done = a is not None
            if not done:
                # A kept operand with the cheap half of its proof; rerun_prepared (or its loop) proves the
                # rest before anything derived from the index data is used.
                a = shortcuts.kept_operand(weight, compare=unproven, members_proven=True)
                if a is not None:
                    done = dispatch.rerun_weight_call(a, call, x, y, unproven)
        except shortcuts.StalePattern:
            remembered = call.remembered
            stale = a if a is not None or remembered is None else remembered[0]
            call.remembered = None
            a = Operand.after_stale(weight, stale, _OP, "weight")
    if not done:
        if a is None:
            # (validates the pattern once; errors name the weight; kept_weight compared its members)
            a = Operand.of(weight, _OP, "weight", members_proven=True)
        checked = None if call is None else call.checked
        dense, out = dispatch.rows(x).mT, dispatch.rows(y).mT
        ops.checked_addmm(
            _OP, None, weight, dense, beta=0.0, alpha=1.0, out=out, meta=None, transpose=transposed,
            checked=checked, operand=a,
        )  # fmt: skip
        if checked is None:
            checked = ops.checked_call(_OP, transposed, weight, dense, out)
            if checked is not None:
                shortcuts.keep_weight_call(calls, signature, checked)
    if used is not None and a is not None:
        used.append(a)
    if bias is not None:
        y += bias
    return y


_OP = "bsr_linear"


# The no-grad product as a plain torch.library op: no autograd kernel, so none of custom_op's Python layers
# (a compiled no-grad layer call measured ~20 µs less). BSRLinear calls it under torch.compile where no
# gradient is needed, and the differentiable ``linear`` where one is.
_LIBRARY = torch.library.Library("bsrkit", "FRAGMENT")
_LIBRARY.define(
    "linear_product(Tensor crow, Tensor col, Tensor values, Tensor x, Tensor? bias, SymInt M, SymInt K, "
    "bool transposed) -> Tensor"
)
for _device in ("CPU", "CUDA"):
    _LIBRARY.impl("linear_product", linear_product, _device)
linear_product_op = torch.ops.bsrkit.linear_product  # (the op; the name also lists it in torch.ops.bsrkit)


@torch.library.register_fake("bsrkit::linear_product")
def _(crow, col, values, x, bias, M, K, transposed):
    _check_linear(values, dispatch.rows(x), M, K, transposed, op="linear_product")
    return x.new_empty((*x.shape[:-1], K if transposed else M))


@torch.library.custom_op("bsrkit::linear", mutates_args=())
def linear(
    crow: torch.Tensor,
    col: torch.Tensor,
    values: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    M: int,
    K: int,
    transposed: bool,
) -> torch.Tensor:
    """:func:`linear_product` as a custom op (differentiable, twice; traceable by ``torch.compile``)."""
    _check_linear(values, x, M, K, transposed)
    return linear_product(crow, col, values, x, bias, M, K, transposed)


@linear.register_fake
def _(crow, col, values, x, bias, M, K, transposed):
    _check_linear(values, x, M, K, transposed)
    return x.new_empty((x.shape[0], K if transposed else M))


@torch.library.custom_op("bsrkit::bsr_mm", mutates_args=())
def bsr_mm(
    crow: torch.Tensor,
    col: torch.Tensor,
    values: torch.Tensor,
    dense: torch.Tensor,
    M: int,
    K: int,
    transposed: bool,
) -> torch.Tensor:
    """``A @ dense`` (or ``A.mT @ dense``) for the 2-D BSR ``A = (crow, col, values)`` of shape (M, K)."""
    _check_bsr_mm(values, dense, M, K, transposed)
    out = torch.empty((K if transposed else M, dense.shape[-1]), dtype=dense.dtype, device=dense.device)
    a = None  # no operand when nothing is computed; none either when nothing is stored
    if out.numel():
        a = Operand.parts(crow, col, values, M, K, (crow, col), "bsr_mm", "weight")
        if not (a.nnz and M and K):
            a = None
        elif transposed:
            a = a.transposed()
    backend = dispatch.select("bsr_mm", "addmm", dense.device, dense.dtype)
    return dispatch.addmm("bsr_dense_mm", backend, None, a, dense, out, torch.Size(), 0.0, 1.0, None)


@bsr_mm.register_fake
def _(crow, col, values, dense, M, K, transposed):
    _check_bsr_mm(values, dense, M, K, transposed)
    return dense.new_empty((K if transposed else M, dense.shape[-1]))


@torch.library.custom_op("bsrkit::sampled_mm", mutates_args=())
def sampled_mm(
    crow: torch.Tensor, col: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, Ms: int, Ns: int
) -> torch.Tensor:
    """Values ``(nnz, Ms, Ns)`` of ``mat1 @ mat2`` at the blocks of the pattern ``(crow, col)``."""
    _check_sampled_mm(mat1, mat2)
    nnz = col.shape[-1]
    shape_only = mat1.new_empty(()).expand(nnz, Ms, Ns)  # values are not read: only their shape
    a = Operand.parts(
        crow, col, shape_only, mat1.shape[-2], mat2.shape[-1], (crow, col), "sampled_mm", "weight"
    )
    backend = dispatch.select("sampled_mm", "sampled", mat1.device, mat1.dtype)
    return dispatch.sampled("sampled_addmm", backend, a, mat1, mat2, torch.Size(), 1.0)


@sampled_mm.register_fake
def _(crow, col, mat1, mat2, Ms, Ns):
    _check_sampled_mm(mat1, mat2)
    return mat1.new_empty((col.shape[-1], Ms, Ns))


def _check_linear(
    values: torch.Tensor, x: torch.Tensor, M: int, K: int, transposed: bool, op: str = "linear"
) -> None:
    """The checks of :func:`_check_bsr_mm` for the rows ``x`` (``(N, inner)``; ``x.mT`` is the dense
    operand), naming ``x``."""
    _check_values_with(op, "x", x, values)
    inner = M if transposed else K
    if x.ndim != 2 or x.shape[1] != inner:
        raise ValueError(f"{op}(): expected x of shape (N, {inner}), got {tuple(x.shape)}")


def _check_bsr_mm(values: torch.Tensor, dense: torch.Tensor, M: int, K: int, transposed: bool) -> None:
    """The checks the kernels rely on (the pattern is checked by :meth:`Operand.parts`): one dtype, one
    device, 3-D ``values``, 2-D ``dense`` of the inner size. A mismatch would read memory as the wrong
    type."""
    op = "bsr_mm"
    _check_values_with(op, "dense", dense, values)
    inner = M if transposed else K
    if dense.ndim != 2 or dense.shape[0] != inner:
        raise ValueError(f"{op}(): expected dense of shape ({inner}, N), got {tuple(dense.shape)}")


def _check_values_with(op: str, name: str, other: torch.Tensor, values: torch.Tensor) -> None:
    check_operand_dtypes(op, name, other, "values", values)
    check_same_device(op, name, other, "values", values)
    if values.ndim != 3:
        raise ValueError(f"{op}(): expected values of shape (nnz, Ms, Ks), got {tuple(values.shape)}")


def _check_sampled_mm(mat1: torch.Tensor, mat2: torch.Tensor) -> None:
    op = "sampled_mm"
    check_operand_dtypes(op, "mat2", mat2, "mat1", mat1)
    check_same_device(op, "mat2", mat2, "mat1", mat1)
    if mat1.ndim != 2 or mat2.ndim != 2 or mat1.shape[1] != mat2.shape[0]:
        raise ValueError(
            f"{op}(): expected mat1 (M, K) and mat2 (K, N), got {tuple(mat1.shape)} and {tuple(mat2.shape)}"
        )


def _setup_bsr_mm(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    crow, col, values, dense, M, K, transposed = inputs
    ctx.save_for_backward(crow, col, values, dense)
    ctx.shape = (M, K, transposed)


def _backward_bsr_mm(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    # Y = A X:   dA = (G X^T)|P,  dX = A^T G.      Y = A^T X:   dA = (X G^T)|P,  dX = A G.
    crow, col, values, dense = ctx.saved_tensors
    M, K, transposed = ctx.shape
    Ms, Ks = values.shape[-2:]
    grad_values = grad_dense = None
    if ctx.needs_input_grad[2]:
        if transposed:
            grad_values = sampled_mm(crow, col, dense, grad.mT, Ms, Ks)
        else:
            grad_values = sampled_mm(crow, col, grad, dense.mT, Ms, Ks)
    if ctx.needs_input_grad[3]:
        grad_dense = bsr_mm(crow, col, values, grad, M, K, not transposed)
    return None, None, grad_values, grad_dense, None, None, None


torch.library.register_autograd("bsrkit::bsr_mm", _backward_bsr_mm, setup_context=_setup_bsr_mm)


def _setup_sampled_mm(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    crow, col, mat1, mat2, _, _ = inputs
    ctx.save_for_backward(crow, col, mat1, mat2)


def _backward_sampled_mm(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    # V = (M1 M2)|P, G the BSR (crow, col, grad) of shape (M, N):  dM1 = G M2^T,  dM2 = M1^T G = (G^T M1)^T.
    crow, col, mat1, mat2 = ctx.saved_tensors
    M, N = mat1.shape[0], mat2.shape[1]
    grad_mat1 = grad_mat2 = None
    if ctx.needs_input_grad[2]:
        grad_mat1 = bsr_mm(crow, col, grad, mat2.mT, M, N, False)
    if ctx.needs_input_grad[3]:
        grad_mat2 = bsr_mm(crow, col, grad, mat1, M, N, True).mT
    return None, None, grad_mat1, grad_mat2, None, None


torch.library.register_autograd("bsrkit::sampled_mm", _backward_sampled_mm, setup_context=_setup_sampled_mm)


def _setup_linear(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    crow, col, values, x, bias, M, K, transposed = inputs
    ctx.save_for_backward(crow, col, values, x)
    ctx.shape = (M, K, transposed, bias is not None)


def _backward_linear(
    ctx: Any, grad: torch.Tensor, saved: tuple[torch.Tensor, ...] | None = None
) -> tuple[Any, ...]:
    # Y = X W^T + b:  dW = (G^T X)|P,  dX = G W,  db = sum_rows G.
    # Y = X W + b:    dW = (X^T G)|P,  dX = G W^T.
    # (saved: ctx.saved_tensors as the caller read them: non-reentrant checkpointing unpacks them once)
    crow, col, values, x = ctx.saved_tensors if saved is None else saved
    M, K, transposed, has_bias = ctx.shape
    Ms, Ks = values.shape[-2:]
    grad_values = grad_x = grad_bias = None
    if ctx.needs_input_grad[2]:
        if transposed:
            grad_values = sampled_mm(crow, col, x.mT, grad, Ms, Ks)
        else:
            grad_values = sampled_mm(crow, col, grad.mT, x, Ms, Ks)
    if ctx.needs_input_grad[3]:
        grad_x = linear(crow, col, values, grad, None, M, K, not transposed)
    if has_bias and ctx.needs_input_grad[4]:
        grad_bias = grad.sum(0)
    return None, None, grad_values, grad_x, grad_bias, None, None, None


torch.library.register_autograd("bsrkit::linear", _backward_linear, setup_context=_setup_linear)


class EagerLinear(torch.autograd.Function):
    """The differentiable ``linear`` for eager calls: the same forward (:func:`linear_product`) and
    backward (:func:`_backward_linear`, made of the custom ops: twice differentiable), without
    ``torch.library``'s Python layers around a custom op's autograd (a layer call at decode sizes with
    gradients measured ~80 µs more through them). ``torch.compile`` traces :func:`linear` instead."""

    @staticmethod
    def forward(
        ctx: Any,
        crow: torch.Tensor,
        col: torch.Tensor,
        values: torch.Tensor,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        M: int,
        K: int,
        transposed: bool,
    ) -> torch.Tensor:
        _check_linear(values, x, M, K, transposed)
        ctx.save_for_backward(crow, col, values, x)
        ctx.shape = (M, K, transposed, bias is not None)
        used: list[Operand] = []
        y = linear_product(crow, col, values, x, bias, M, K, transposed, used=used)
        # The pattern computed with, for the backward to compare with the live one (a write moving no
        # counter torch's saved tensors see, numpy's or a collective's, would give another matrix's
        # gradient) and then to compute with: on the CPU, the validated copy the product read (a copy
        # taken before the product could differ from it under a write racing from another thread); a
        # device comparison would synchronise.
        ctx.pattern = None
        if crow.device.type == "cpu" and any(ctx.needs_input_grad):
            pattern = used[0].pattern if used else None
            ctx.pattern = pattern.indices if pattern is not None else (crow.clone(), col.clone())
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        saved = ctx.saved_tensors  # (read once: non-reentrant activation checkpointing allows no more)
        if ctx.pattern is not None:
            check_indices_unchanged(ctx.pattern, saved[:2], "BSRLinear", "weight")
            # (then the pattern the forward ran on, whatever writes the live one from now on: a thread
            # writing it cannot split one call's output and gradients between two patterns)
            saved = (*ctx.pattern, *saved[2:])
        return _backward_linear(ctx, grad, saved)


def differentiable_linear(
    crow: torch.Tensor,
    col: torch.Tensor,
    values: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    M: int,
    K: int,
    transposed: bool,
) -> torch.Tensor:
    """:func:`linear_product` recorded for autograd: the custom op :func:`linear` where it is traced
    (``torch.compile``) or shapes only (``x`` on meta), :class:`EagerLinear` otherwise (cheaper, and its
    backward refuses a pattern written since the forward: the traced op's cannot compare data)."""
    if torch.compiler.is_compiling() or x.is_meta:
        return linear(crow, col, values, x, bias, M, K, transposed)
    if forward_ad._current_level >= 0:  # (before autograd.Function's own, which names no op)
        refuse_tangents((x, values, bias))
    return EagerLinear.apply(crow, col, values, x, bias, M, K, transposed)
