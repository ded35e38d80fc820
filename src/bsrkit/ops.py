r"""Public products. Each validates its arguments, fetches cached plans, and hands tensors and plan to
one backend chosen by :func:`select_backend`; nothing else happens here.

Notation: ``bsr`` is a BSR tensor of shape ``(*Bb, M, K)`` with blocks ``(Ms, Ks)``; ``dense`` is strided
``(*Bd, K, N)``; batch dimensions broadcast to ``batch = broadcast(Bb, Bd)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad

from bsrkit import autograd, dispatch, shortcuts
from bsrkit.dispatch import select_backend
from bsrkit.eager import eager_under_compile
from bsrkit.freshness import check_mode
from bsrkit.operand import Operand
from bsrkit.validation import (
    SUPPORTED_DTYPES,
    ArgumentTypeError,
    broadcast_batch,
    check_bsr,
    check_coefficient,
    check_dtype,
    check_max_grid,
    check_meta,
    check_out,
    check_out_needs_no_grad,
    check_same_device,
    check_same_dtype,
    check_strided,
    mark_written,
    may_share_memory,
    resolved,
)

__all__ = [
    "_int_bsr_dense_addmm",
    "bsr_dense_addmm",
    "bsr_dense_mm",
    "bsr_transposed_dense_mm",
    "sampled_addmm",
    "select_backend",
]

# -- the main products --------------------------------------------------------------------------------


@eager_under_compile
def bsr_dense_mm(
    bsr: torch.Tensor,
    dense: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    skip_checks: bool = False,
    max_grid: tuple[int | None, int | None, int | None] | None = None,
    meta: dict[str, Any] | None = None,
) -> torch.Tensor:
    r"""Block-sparse times dense: :math:`\mathrm{out}[b] = \mathrm{bsr}[b]\,\mathrm{dense}[b]`.

    Only stored blocks contribute: :math:`\mathrm{out}_{iM_s..,:} = \sum_{j \in \mathrm{row}\ i}
    V_{ij} \, \mathrm{dense}_{jK_s..,:}`. Any block shape, batch broadcasting, any strides of ``dense``
    and ``out``; float16/bfloat16 accumulate in float32. ``out`` (shape ``(*batch, M, N)``, dtype of
    ``dense``) is written in place and returned (its version counter moves, as a torch op's out's); one
    that shares memory with ``dense`` or the blocks gets the product through a temporary, as numpy's
    matmul gives it: the operands as they were before the call. ``meta`` overrides backend parameters
    (CPU: ``panel``, ``nthreads``; Triton: ``BLOCK_M``, ``BLOCK_K``, ``BLOCK_N``, ``num_warps``,
    ``num_stages``).

    ``skip_checks`` and ``max_grid`` are accepted as torch's are. Here the checks always run (they cost
    microseconds and are what keeps a malformed tensor from touching memory outside its operands), and
    ``max_grid`` (a tuple of three ints or Nones, which torch uses to cut its 3-D launch grid) has nothing
    to bound: bsrkit's Triton grids are 1-D, within the hardware limit for any size.
    """
    if max_grid is not None:
        check_max_grid("bsr_dense_mm", max_grid)
    return checked_addmm("bsr_dense_mm", None, bsr, dense, beta=0.0, alpha=1.0, out=out, meta=meta)


@eager_under_compile
def bsr_transposed_dense_mm(
    bsr: torch.Tensor,
    dense: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    meta: dict[str, Any] | None = None,
) -> torch.Tensor:
    r""":math:`\mathrm{out} = \mathrm{bsr}^T\,\mathrm{dense}` (``bsr.mT @ dense``), without materialising
    the transpose: a cached plan maps the blocks of the transpose to the original's (only the block values
    are gathered, ``nnz * Ms * Ks`` elements). ``dense`` is ``(*Bd, M, N)``; ``out`` ``(*batch, K, N)``.
    Differentiable in ``dense`` (:math:`\partial \mathrm{dense} = \mathrm{bsr}\, G`) and in the BSR values
    (:math:`(\mathrm{dense}\, G^T)|_P`), as :func:`bsr_dense_mm` is.
    """
    return checked_addmm(
        "bsr_transposed_dense_mm", None, bsr, dense, beta=0.0, alpha=1.0, out=out, meta=meta, transpose=True
    )


@eager_under_compile
def bsr_dense_addmm(
    input: torch.Tensor,
    bsr: torch.Tensor,
    dense: torch.Tensor,
    *,
    beta: float = 1,
    alpha: float = 1,
    left_alpha: torch.Tensor | None = None,
    right_alpha: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    skip_checks: bool = False,
    max_grid: tuple[int | None, int | None, int | None] | None = None,
    meta: dict[str, Any] | None = None,
) -> torch.Tensor:
    r""":math:`\mathrm{out} = \beta\,\mathrm{input} + \ell \odot \alpha\,(\mathrm{bsr} @ \mathrm{dense})
    \odot r`, torch's formula: ``left_alpha`` :math:`\ell` scales rows (shape ``(*batch, M)``, broadcast
    along columns), ``right_alpha`` :math:`r` scales columns (``(*batch, N)``); None means ones. Both are
    differentiable, as are ``input``, ``dense`` and the BSR values.

    ``input`` broadcasts to ``(*batch, M, N)``. With ``beta == 0``, ``input`` is ignored (NaN in it does
    not propagate), as in ``torch.addmm``; with ``alpha == 0`` no product is formed (NaN and Inf in the
    blocks, ``dense`` or the scales do not reach the result). Otherwise non-finite values follow the
    formula: an infinite scale or ``alpha`` times a zero product is NaN, in rows without stored blocks and
    with ``nnz == 0`` too (there torch's Triton kernel returns ``beta * input`` without reading the
    scales). int8 ``bsr`` and ``dense`` give an exact int32 result (see
    :func:`_int_bsr_dense_addmm`). Otherwise as :func:`bsr_dense_mm` (``skip_checks`` and ``max_grid``
    included).
    """
    op = "bsr_dense_addmm"
    check_strided(op, "input", input, min_ndim=0)
    check_max_grid(op, max_grid)
    return checked_addmm(
        op, input, bsr, dense, beta=beta, alpha=alpha, out=out, meta=meta, left=left_alpha, right=right_alpha
    )


@eager_under_compile
def _int_bsr_dense_addmm(
    input: torch.Tensor,
    bsr: torch.Tensor,
    dense: torch.Tensor,
    *,
    beta: float = 1,
    alpha: float = 1,
    left_alpha: torch.Tensor | None = None,
    right_alpha: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    skip_checks: bool = False,
    max_grid: tuple[int | None, int | None, int | None] | None = None,
    meta: dict[str, Any] | None = None,
) -> torch.Tensor:
    """torch's entry point for int8 products: int8 ``bsr`` times int8 ``dense`` into an int32 ``out``,
    exactly (``beta``, ``alpha`` integers; ``input`` an integer tensor). Computed on the float kernels in a
    floating type wide enough for every partial sum to be exact (float32 while ``K * 128**2 <= 2**24``,
    else float64). Integer ``left_alpha``/``right_alpha`` (or none) then scale in int32 arithmetic, each
    product wrapping around as in torch's kernel; floating ones scale in float64, and the result is
    rounded to the nearest integer once (torch's kernel truncates toward zero: 3 * 0.5 gives 2 here, 1
    there)."""
    return bsr_dense_addmm(
        input, bsr, dense, beta=beta, alpha=alpha, left_alpha=left_alpha, right_alpha=right_alpha,
        out=out, skip_checks=skip_checks, max_grid=max_grid, meta=meta,
    )  # fmt: skip


_ADDMM_DTYPES = (*SUPPORTED_DTYPES, torch.int8)


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _check_coefficient_range(op: str, dtype: torch.dtype, beta: float, alpha: float) -> None:
    """Finite coefficients the kernels' scalars cannot hold (float32 for float32 and half products; exact
    integers for int8's int32 arithmetic, through float64): refused as torch.addmm refuses them, not
    turned into inf (unlike an infinite one, it would skip the formula's NaN for 0 * inf) or rounded."""
    limit = {torch.float64: math.inf, torch.int8: 2.0**31}.get(dtype, _FLOAT32_MAX)
    for name, value in (("beta", beta), ("alpha", alpha)):
        if math.isfinite(value) and abs(value) >= limit:
            raise ValueError(
                f"{op}(): expected |{name}| < {limit:g} for a {dtype} product (the kernels' scalars "
                f"cannot hold it), got {value!r}"
            )


def _needs_grad(*tensors: Any) -> bool:
    if forward_ad._current_level >= 0:  # (inside a dual level only: a module attribute read otherwise)
        autograd.refuse_tangents(tensors)
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # noqa: SIM110 (a loop, not any(): every product runs this)
        if isinstance(t, torch.Tensor) and t.requires_grad:  # (non-tensors: validation names them)
            return True
    return False


def checked_addmm(
    op: str,
    input: torch.Tensor | None,
    bsr: torch.Tensor,
    dense: torch.Tensor,
    *,
    beta: Any,
    alpha: Any,
    out: torch.Tensor | None,
    meta: dict[str, Any] | None,
    transpose: bool = False,
    left: torch.Tensor | None = None,
    right: torch.Tensor | None = None,
    checked: shortcuts.CheckedCall | None = None,
    operand: Operand | None = None,
) -> torch.Tensor:
    """Validate, then ``out = beta * input + left * (alpha * op(bsr) @ dense) * right`` with op =
    transpose or identity (``left``/``right``: row and column scales, or None). The entry for every
    public function of bsrkit that is this product under another name (errors name ``op``).

    ``checked``: the :class:`~bsrkit.shortcuts.CheckedCall` of an earlier call with the same metadata
    (:func:`checked_call`), which skips the checks; ``operand``: ``Operand.of(bsr)``, if the caller has it."""
    if type(alpha) is not float and type(alpha) is not int:  # (numpy's, a bool, a 0-d tensor: a float)
        alpha = check_coefficient(op, "alpha", alpha)
    if type(beta) is not float and type(beta) is not int:
        beta = check_coefficient(op, "beta", beta)
    if forward_ad._current_level >= 0:  # (in a dual level, every call: a checked call skips _needs_grad)
        autograd.refuse_tangents((input, dense, left, right))
    try:
        if dense.is_neg():
            dense = resolved(dense)  # (the kernels read memory: see validation.resolved)
    except AttributeError:  # (not a tensor: validation names it; try costs nothing where it passes)
        pass
    if input is not None or left is not None or right is not None:
        input, left, right = (
            t if not isinstance(t, torch.Tensor) else resolved(t) for t in (input, left, right)
        )
    if isinstance(out, torch.Tensor) and out.is_neg() and not _needs_grad(input, bsr, dense, left, right):
        # Written through a plain tensor, then copied in (torch's copy_ writes a negative view right).
        result = checked_addmm(
            op, input, bsr, dense, beta=beta, alpha=alpha, out=None, meta=meta, transpose=transpose,
            left=left, right=right, operand=operand,
        )  # fmt: skip
        check_out(op, out, result.shape, result.dtype, result.device)
        return out.copy_(result)
    signature = None
    if checked is None and input is None and left is None and right is None and meta is None:
        signature = _call_signature(op, transpose, bsr, dense, out, beta, alpha)
        checked = shortcuts.checked_call(signature) if signature is not None else None
    if checked is None:
        checked = _validate_addmm(op, input, bsr, dense, beta, alpha, out, meta, transpose, left, right)
        if signature is not None:
            shortcuts.keep_checked_call(signature, checked)
    differentiable, backend, batch, out_shape, out_dtype, K, out_numel, like_dense = checked
    if left is not None and not _broadcasts(left, out_shape[:-1]):  # (torch's view: (*batch, M, 1))
        left = left.reshape(out_shape[:-1])
    if right is not None and not _broadcasts(right, (*batch, out_shape[-1])):  # ((*batch, 1, N))
        right = right.reshape(*batch, out_shape[-1])
    if dense.is_meta:  # (shapes only, as torch's ops on meta: no pattern to read)
        return out if out is not None else torch.empty(out_shape, dtype=out_dtype, device="meta")
    beta, alpha = float(beta), float(alpha)  # (checked real numbers; -0.0 and 0.0 share a checked call)
    # The sparse operand, or None when nothing is stored (no plan is fetched for an empty product).
    a = None
    unproven = False  # a kept operand whose index data dispatch.addmm proves (a deferred proof)
    if out_numel:
        if operand is not None:
            a = operand  # (proven by the caller)
        elif signature is not None and not (transpose or differentiable):  # (may rerun a prepared call)
            unproven = check_mode()[0]  # (host memory is compared: later, by dispatch.addmm)
            a = shortcuts.kept_operand(bsr, compare=unproven)
            unproven = unproven and a is not None
        if a is None:
            a = Operand.of(bsr, op)  # validates the pattern (once per pattern)
        if not (K and a.nnz and alpha):
            if unproven and a.pattern is not None and not a.pattern.proof.unchanged():
                Operand.of(bsr, op)  # (a changed pattern is judged all the same: a malformed one raises)
            a, unproven = None, False
        elif transpose:
            a = a.transposed()
    if a is None and meta:  # (no kernel runs, so dispatch never resolves meta: judged all the same)
        dispatch.check_meta(op, backend, meta)
    if differentiable:
        return autograd.BsrDenseAddmm.apply(
            op, backend, input, bsr, dense, left, right, a, batch, beta, alpha, meta, transpose
        )
    if out is None:
        # (like dense: through its dtype and device, 0.5-1 µs cheaper than torch.empty's keywords)
        if a is None and input is None and left is None and right is None and math.isfinite(alpha):
            # Nothing contributes (no stored block, K == 0 or alpha == 0): what dispatch.addmm would give.
            if like_dense:
                return dense.new_zeros(out_shape)
            return torch.zeros(out_shape, dtype=out_dtype, device=dense.device)
        if like_dense == _SAME_SHAPE:
            out = torch.empty_like(dense, memory_format=torch.contiguous_format)
        elif like_dense:
            out = dense.new_empty(out_shape)
        else:
            out = torch.empty(out_shape, dtype=out_dtype, device=dense.device)
    else:
        mark_written(op, "out", out)
        if may_share_memory(out, dense, None if a is None else a.values):
            # The kernels read dense and the blocks (where any are read: a's) while writing out: computed
            # in a temporary and copied in, as numpy's matmul does, so the operands are read as they were.
            result = checked_addmm(
                op, input, bsr, dense, beta=beta, alpha=alpha, out=None, meta=meta, transpose=transpose,
                left=left, right=right, operand=operand,
            )  # fmt: skip
            return out.copy_(result)
    if not unproven:
        return dispatch.addmm(
            op, backend, input, a, dense, out, batch, beta, alpha, meta, left, right, checked
        )
    assert a is not None
    try:
        return dispatch.addmm(
            op, backend, input, a, dense, out, batch, beta, alpha, meta, left, right, checked, True
        )
    except shortcuts.StalePattern:
        # (Only products that overwrite out take the deferred proof: out is written anew.)
        a = Operand.after_stale(bsr, a, op)
        return dispatch.addmm(
            op, backend, input, a, dense, out, batch, beta, alpha, meta, left, right, checked
        )


def checked_call(
    op: str, transpose: bool, bsr: torch.Tensor, dense: torch.Tensor, out: torch.Tensor | None
) -> shortcuts.CheckedCall | None:
    """The checked call kept for an earlier ``checked_addmm(op, None, bsr, dense, beta=0.0, alpha=1.0,
    out=out, meta=None, transpose=transpose)`` that passed its checks, or None."""
    signature = _call_signature(op, transpose, bsr, dense, out, 0.0, 1.0)
    return shortcuts.checked_call(signature) if signature is not None else None


# A call's checks depend only on its metadata (types, layouts, dtypes, devices, shapes, scalars, grad
# mode, the forced backend), not on data: a call like an earlier valid one (the common repeated product)
# skips them (bsrkit.shortcuts). Only calls without input, scales and meta have a signature (it is cheap).


def _call_signature(
    op: str, transpose: bool, bsr: Any, dense: Any, out: Any, beta: Any, alpha: Any
) -> tuple[Any, ...] | None:
    """What :func:`_validate_addmm`'s outcome depends on, or None for arguments it would reject anyway:
    per tensor its type, layout, dtype, device, shape and ``requires_grad`` (one flat tuple: this runs
    on every product)."""
    if not (isinstance(bsr, torch.Tensor) and isinstance(dense, torch.Tensor)):
        return None
    if bsr.layout is not torch.sparse_bsr:
        return None
    if out is None:
        out_signature: Any = None
    elif isinstance(out, torch.Tensor):
        # (the strides too: whether out's elements are distinct memory, checked once, depends on them)
        out_signature = (
            type(out),
            out.layout,
            out.dtype,
            out.device,
            out.shape,
            out.stride(),
            out.requires_grad,
        )
    else:
        return None
    return (
        op, transpose, type(beta), beta, type(alpha), alpha, torch.is_grad_enabled(),
        dispatch.forced_backend(), bsr.dense_dim(),
        type(bsr), bsr.dtype, bsr.device, bsr.shape, bsr.requires_grad,
        type(dense), dense.layout, dense.dtype, dense.device, dense.shape, dense.requires_grad,
        out_signature,
    )  # fmt: skip


def _broadcasts(t: torch.Tensor, shape: tuple[int, ...]) -> bool:
    try:
        return torch.broadcast_shapes(t.shape, shape) == shape
    except RuntimeError:
        return False


def _validate_addmm(
    op: str,
    input: torch.Tensor | None,
    bsr: torch.Tensor,
    dense: torch.Tensor,
    beta: Any,
    alpha: Any,
    out: torch.Tensor | None,
    meta: dict[str, Any] | None,
    transpose: bool,
    left: torch.Tensor | None,
    right: torch.Tensor | None,
) -> shortcuts.CheckedCall:
    """Check every argument of :func:`checked_addmm` but the pattern (see :meth:`Operand.of`) and the
    memory of ``out``; return what the call computes."""
    differentiable = _needs_grad(input, bsr, dense, left, right)
    if differentiable and out is not None:
        raise ValueError(
            f"{op}(): expected out=None when an argument requires grad (out= is not differentiable)"
        )
    beta = check_coefficient(op, "beta", beta)
    alpha = check_coefficient(op, "alpha", alpha)
    check_bsr(op, "bsr", bsr, dtypes=_ADDMM_DTYPES)
    dense_name = _dense_name(op)
    check_strided(op, dense_name, dense)
    check_same_dtype(op, dense_name, dense, "bsr", bsr)
    check_same_device(op, dense_name, dense, "bsr", bsr)
    integer = bsr.dtype is torch.int8
    out_dtype = torch.int32 if integer else dense.dtype
    if integer and not (beta.is_integer() and alpha.is_integer()):
        raise ValueError(f"{op}(): expected integer beta and alpha for int8 products, got {beta} and {alpha}")
    _check_coefficient_range(op, bsr.dtype, beta, alpha)
    if integer and differentiable:  # (only a float scale can require grad here)
        name = "left_alpha" if left is not None and left.requires_grad else "right_alpha"
        raise ValueError(
            f"{op}(): expected {name} not to require grad in an int8 product (its exact int32 result "
            "cannot carry a gradient), got one that does: detach it, or scale a float product"
        )
    # (int8 products run on the float kernels: see dispatch.int8_compute_dtype)
    backend = dispatch.select(op, "addmm", bsr.device, torch.float32 if integer else bsr.dtype)
    M, K = bsr.shape[-2:]
    if transpose:
        M, K = K, M
    if dense.shape[-2] != K:
        where = "bsr.shape[-2]" if transpose else "bsr.shape[-1]"
        raise ValueError(f"{op}(): expected {dense_name}.shape[-2] == {K} ({where}), got {dense.shape[-2]}")
    batch = broadcast_batch(op, ("bsr", dense_name), (bsr.shape[:-2], dense.shape[:-2]))
    out_shape = (*batch, M, dense.shape[-1])
    for name, scale, extent in (("left_alpha", left, M), ("right_alpha", right, dense.shape[-1])):
        if scale is None:
            continue
        check_strided(op, name, scale, min_ndim=1)
        if not integer:
            check_same_dtype(op, name, scale, dense_name, dense)
        elif scale.is_complex() or scale.dtype is torch.bool:
            check_dtype(op, name, scale, _INT8_SCALE_DTYPES)
        check_same_device(op, name, scale, dense_name, dense)
        count = math.prod(batch) * extent  # (torch views any scale of as many elements, in order)
        if not (_broadcasts(scale, (*batch, extent)) or scale.numel() == count):
            raise ValueError(
                f"{op}(): expected {name}.shape to broadcast to {(*batch, extent)} (or {name} to hold "
                f"{count} elements, as torch views it), got {tuple(scale.shape)}"
            )
    if input is not None:
        if integer:
            check_dtype(op, "input", input, (torch.int8, torch.int32))
        else:
            check_same_dtype(op, "input", input, "bsr", bsr)
        check_same_device(op, "input", input, "bsr", bsr)
        if not _broadcasts(input, out_shape):
            raise ValueError(
                f"{op}(): expected input.shape to broadcast to {out_shape}, got {tuple(input.shape)}"
            )
    check_meta(op, meta)
    if out is not None:
        check_out(op, out, out_shape, out_dtype, dense.device)
    # How an output is allocated like dense (a plain tensor of out's dtype), if it can be.
    like_dense = 0
    if out_dtype is dense.dtype and type(dense) is torch.Tensor:
        like_dense = _SAME_SHAPE if out_shape == tuple(dense.shape) else _SAME_DTYPE
    return shortcuts.CheckedCall(
        differentiable, backend, batch, out_shape, out_dtype, K, math.prod(out_shape), like_dense
    )


_SAME_DTYPE, _SAME_SHAPE = 1, 2

# What scales an int8 product takes (applied in float64 to the exact product, rounded once).
_INT8_SCALE_DTYPES = (
    torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
    torch.float64,
)  # fmt: skip

# The dense operand's name in the public ops that name it otherwise than ``dense`` (as torch's do).
_DENSE_NAMES = {"bsr_scatter_mm": "other"}


def _dense_name(op: str) -> str:
    return _DENSE_NAMES.get(op, "dense")


# -- sampled dense-dense products (SDDMM) ------------------------------------------------------------


@eager_under_compile
def sampled_addmm(
    input: torch.Tensor,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    *,
    beta: float = 1.0,
    alpha: float = 1.0,
    out: torch.Tensor | None = None,
    skip_checks: bool = False,
    max_grid: tuple[int | None, int | None, int | None] | None = None,
) -> torch.Tensor:
    r"""``beta * input + alpha * (mat1 @ mat2)`` evaluated only at ``input``'s stored blocks.

    For each stored block :math:`(i, j)` of the BSR ``input`` (blocks ``(Ms, Ns)``):
    :math:`V_{ij} \leftarrow \beta V_{ij} + \alpha\, \mathrm{mat1}_{iM_s..,:}\, \mathrm{mat2}_{:, jN_s..}`.
    ``mat1`` is ``(*B1, M, K)``, ``mat2`` ``(*B2, K, N)``; batch dims broadcast with ``input``'s. The
    result is a BSR tensor with ``input``'s indices, in ``mat1``'s dtype. With ``beta == 0`` the input
    values are ignored, and ``input`` may be a boolean mask (only its pattern is used), as in torch;
    with ``alpha == 0`` no product is formed (NaN and Inf in ``mat1``/``mat2`` do not reach the result,
    as in ``torch.addmm`` and torch's Triton kernel).
    Differentiable in ``mat1``, ``mat2`` and ``input``'s values, as torch's is.
    ``out``, if given, is a BSR tensor of the result's shape, dtype and nnz: as torch does, ``input``'s
    indices are copied into it (a different pattern is replaced, never mixed) and its values written.
    Half types are computed in float32. ``skip_checks`` and ``max_grid`` as in :func:`bsr_dense_mm`.
    """
    op = "sampled_addmm"
    beta = check_coefficient(op, "beta", beta)
    alpha = check_coefficient(op, "alpha", alpha)
    check_max_grid(op, max_grid)
    check_bsr(op, "input", input, dtypes=(*SUPPORTED_DTYPES, torch.bool))
    mask_only = input.dtype is torch.bool
    if mask_only and beta != 0:
        raise ValueError(f"{op}(): expected beta == 0 with a boolean input (a mask), got beta == {beta}")
    ref_name, ref = ("mat2", mat2) if mask_only else ("input", input)
    check_strided(op, "mat1", mat1)
    check_strided(op, "mat2", mat2)
    check_dtype(op, "mat1", mat1)
    _check_coefficient_range(op, mat1.dtype, beta, alpha)
    for name, t in (("mat1", mat1), ("mat2", mat2)):
        check_same_dtype(op, name, t, ref_name, ref)
        check_same_device(op, name, t, "input", input)
    M, N = input.shape[-2:]
    if mat1.shape[-2] != M:
        raise ValueError(f"{op}(): expected mat1.shape[-2] == {M} (input.shape[-2]), got {mat1.shape[-2]}")
    if mat2.shape[-1] != N:
        raise ValueError(f"{op}(): expected mat2.shape[-1] == {N} (input.shape[-1]), got {mat2.shape[-1]}")
    if mat1.shape[-1] != mat2.shape[-2]:
        raise ValueError(
            f"{op}(): expected mat2.shape[-2] == {mat1.shape[-1]} (mat1.shape[-1]), got {mat2.shape[-2]}"
        )
    batch = broadcast_batch(
        op, ("input", "mat1", "mat2"), (input.shape[:-2], mat1.shape[:-2], mat2.shape[:-2])
    )
    nnz = input._nnz()
    if out is not None:
        check_bsr(op, "out", out)
        if out.shape != (*batch, M, N) or out._nnz() != nnz:
            raise ValueError(
                f"{op}(): expected out to be a BSR tensor of shape {(*batch, M, N)} with nnz == {nnz}, "
                f"got shape {tuple(out.shape)} and nnz == {out._nnz()}"
            )
        if out.values().shape[-2:] != input.values().shape[-2:]:
            raise ValueError(
                f"{op}(): expected out's blocksize {tuple(input.values().shape[-2:])} (input's), "
                f"got {tuple(out.values().shape[-2:])}"
            )
        if out.dtype != mat1.dtype:
            raise ArgumentTypeError(f"{op}(): expected out.dtype == {mat1.dtype}, got {out.dtype}")
        check_out_needs_no_grad(op, "out", out)  # (before anything is written into it)
    differentiable = _needs_grad(input, mat1, mat2)
    if out is not None and differentiable:
        raise ValueError(
            f"{op}(): expected out=None when an argument requires grad (out= is not differentiable)"
        )
    backend = dispatch.select(op, "sampled", mat1.device, mat1.dtype)
    if input.is_meta:  # (shapes only, as torch's ops on meta: no pattern to read)
        if out is not None:
            return out
        blocks = input.values().shape[-2:]
        values = torch.empty((*batch, nnz, *blocks), dtype=mat1.dtype, device="meta")
        crow, col = input.crow_indices().expand(*batch, -1), input.col_indices().expand(*batch, -1)
        return torch.sparse_bsr_tensor(
            crow.clone(), col.clone(), values, size=(*batch, M, N), check_invariants=False
        )
    mat1, mat2 = resolved(mat1), resolved(mat2)  # (the kernels read memory)
    a = Operand.of(input, op, "input")
    if differentiable:
        values = autograd.SampledAddmm.apply(op, backend, input, a, mat1, mat2, batch, beta, alpha)
    else:
        values = dispatch.sampled_addmm(op, backend, a, mat1, mat2, batch, beta, alpha, input)
    # The pattern the values were computed on (on the CPU the validated copy, not input's live memory,
    # which a racing write may have changed since), in memory of the result's own, as torch's copies.
    crow, col = a.kernel_indices()
    crow, col = crow.expand(*batch, -1), col.expand(*batch, -1)
    if out is None:
        contiguous = torch.contiguous_format
        crow, col = crow.clone(memory_format=contiguous), col.clone(memory_format=contiguous)
        return torch.sparse_bsr_tensor(crow, col, values, size=(*batch, M, N), check_invariants=False)
    # torch copies input into out: out takes input's pattern (where it holds it already, an index tensor
    # shared across the batch, an expanded view, cannot take a copy, and needs none; one that must is
    # refused before anything is written)
    writes = [
        (m, t) for m, t in ((out.crow_indices(), crow), (out.col_indices(), col)) if not torch.equal(m, t)
    ]
    for mine, _ in writes:
        if torch._debug_has_internal_overlap(mine) == 1:
            raise ValueError(
                f"{op}(): out's pattern differs from input's and its index tensors share memory across the "
                "batch (an expanded view), so they cannot take input's: pass an out with its own indices"
            )
    if torch._debug_has_internal_overlap(out.values()) == 1:
        raise ValueError(f"{op}(): expected out's values whose elements are distinct memory (not expanded)")
    for mine, theirs in writes:
        mine.copy_(theirs)
    out.values().copy_(values)
    return out
