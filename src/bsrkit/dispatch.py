"""Dispatch: choose a backend for a call, resolve its parameters, and run one validated product on it.

Everything here receives arguments that :mod:`bsrkit.ops` has validated. The semantics every backend
shares — ``out := beta * input`` first, the empty-product shortcuts, reshaping SDDMM values to the batch
— live here once, so that a backend only implements the kernels of :class:`~bsrkit.backends.base.Backend`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from bsrkit import shortcuts, tuning
from bsrkit.backends import BACKENDS, Backend
from bsrkit.environment import getenv
from bsrkit.operand import Operand
from bsrkit.validation import may_share_memory

__all__ = [
    "BACKEND_ENV",
    "addmm",
    "forced_backend",
    "rerun_prepared",
    "rerun_weight_call",
    "rerun_weight_call_directly",
    "rows",
    "sampled",
    "scatter_mm",
    "select",
    "select_backend",
    "softmax",
    "softmax_backward",
]

BACKEND_ENV = "BSRKIT_BACKEND"

# (kernel, device type, dtype) -> backend, for calls without an override: the reasons are asked once.
_chosen: dict[tuple[str, str, torch.dtype], Backend] = {}


def forced_backend() -> str | None:
    """``$BSRKIT_BACKEND`` (None or empty: no override)."""
    return getenv(BACKEND_ENV)


def select(op: str, kernel: str, device: torch.device, dtype: torch.dtype) -> Backend:
    """The backend that runs ``kernel`` (one of :data:`bsrkit.backends.base.KERNELS`) for public ``op``.

    Without an override: the first backend of :data:`~bsrkit.backends.BACKENDS` that serves
    ``device``'s type on its own and reports no reason against the call — the compiled CPU kernel for
    CPU tensors, Triton for CUDA tensors when triton is installed, else torch primitives.
    ``$BSRKIT_BACKEND`` (``cpu``, ``torch`` or ``triton``) forces one, for testing and comparison; a forced
    backend that cannot run raises ``ValueError`` with its reasons (``triton`` on CPU tensors runs
    Triton's interpreter and needs ``TRITON_INTERPRET=1``).
    """
    forced = forced_backend()
    if forced:
        backend = BACKENDS.get(forced)
        if backend is None:
            raise ValueError(f"{op}(): expected ${BACKEND_ENV} in {tuple(BACKENDS)}, got {forced!r}")
        reasons = backend.not_supported_reasons(kernel, device, dtype)
        if reasons:
            raise ValueError(f"{op}(): ${BACKEND_ENV}={forced} " + "; ".join(reasons))
        return backend
    memo = (kernel, device.type, dtype)
    backend = _chosen.get(memo)
    if backend is None:  # (asked once per kernel, device type and dtype)
        backend = next(
            b
            for b in BACKENDS.values()
            if (b.auto_devices is None or device.type in b.auto_devices)
            and not b.not_supported_reasons(kernel, device, dtype)
        )
        _chosen[memo] = backend
    return backend


def select_backend(op: str, device: torch.device, dtype: torch.dtype) -> str:
    """The name of the backend that runs ``op``'s block products here (see :func:`select`)."""
    return select(op, "addmm", device, dtype).name


def addmm(
    op: str,
    backend: Backend,
    input: torch.Tensor | None,
    a: Operand | None,
    dense: torch.Tensor,
    out: torch.Tensor,
    batch: torch.Size,
    beta: float,
    alpha: float,
    meta: dict[str, Any] | None,
    left: torch.Tensor | None = None,
    right: torch.Tensor | None = None,
    checked: shortcuts.CheckedCall | None = None,
    unproven: bool = False,
) -> torch.Tensor:
    """``out = beta * input + left * (alpha * a @ dense) * right`` (``input`` None: ``beta`` is ignored;
    ``left`` ``(*batch, M)`` scales rows, ``right`` ``(*batch, N)`` columns; None: ones) and return it.

    ``checked``: the call's :class:`~bsrkit.shortcuts.CheckedCall` (standing for everything about it but
    the operands' data, strides and offsets), or None. A repeated product reruns the call its backend
    prepared (:mod:`bsrkit.shortcuts`): with ``checked``, found before the parameter lookup (a tiny
    product skips that and the backend's marshaling); without, by the operands' layouts and the params.

    ``a`` is None when the product contributes nothing (no stored block, ``K == 0`` or ``alpha == 0``).
    With ``beta == 0`` ``input`` is not read (NaN in it does not propagate), as in ``torch.addmm``.
    int8 ``a`` and ``dense`` with an int32 ``out``: the exact integer product (:func:`int8_compute_dtype`).

    ``unproven``: ``a`` is a kept operand whose index data were not compared yet (a deferred proof, see
    :mod:`bsrkit.shortcuts`). Nothing derived from them is used before they are: by the loop of a prepared
    call that compares them itself (``rerun.proves``), else by the whole proof here; either raises
    :class:`~bsrkit.shortcuts.StalePattern` when they changed (the caller recomputes: only a product that
    overwrites ``out`` may take the prepared call, so a discarded ``out`` is simply written again).
    """
    if alpha == 0:  # (no product is formed, as torch.addmm: its scales are not read either)
        left = right = None
    scaled = left is not None or right is not None or not math.isfinite(alpha)
    # Half types with an input: beta * input is added in float32 and the sum rounded once, as torch
    # (rounded to half first, a product or an input term beyond 65504 was inf where the sum is not). An
    # input of out's dtype with beta == 1 (a layer's bias) is exact in out: the kernels accumulate onto
    # it in float32 and round once, with no float32 copy of the operands.
    half_input = (
        out.dtype in (torch.float16, torch.bfloat16)
        and input is not None
        and beta != 0
        and not (beta == 1 and input.dtype == out.dtype and _copies_into(input, out))
    )
    if unproven and (scaled or half_input or dense.dtype is torch.int8):
        _prove(a)  # (these paths recurse, on no prepared call of a kept operand)
    if dense.dtype is torch.int8:
        return _int8_addmm(op, backend, input, a, dense, out, batch, beta, alpha, meta, left, right)
    if scaled or half_input:
        # Form the product, then scale it: inf * 0 is NaN wherever the product is 0 (empty rows
        # included), as the formula says (a gemm may scale an operand instead). Half types form it in
        # float32 (the accumulator's dtype): a product beyond their range that the scales or the input
        # bring back into it must not be rounded to inf first.
        if out.dtype in (torch.float16, torch.bfloat16):
            if a is not None:
                a = a._replace(values=a.values.float())
            dense = dense.float()
        product = torch.empty(out.shape, dtype=dense.dtype, device=out.device)
        addmm(op, backend, None, a, dense, product, batch, 0.0, 1.0, meta)
        _scale_product(product, alpha, left, right)
        if input is None or beta == 0:
            return out.copy_(product)
        if half_input:  # (product is float32 here)
            return out.copy_(product.add_(input.expand(out.shape).to(product.dtype), alpha=beta))
        _scale_input_into(out, input, beta)
        return out.add_(product)
    # out := beta * input first; the kernel then accumulates (or, with beta == 0, overwrites).
    overwrite = input is None or beta == 0
    if not overwrite:
        assert input is not None
        _scale_input_into(out, input, beta)
    if a is None or out.numel() == 0:
        if overwrite:
            out.zero_()
        return out
    # A repeated call reruns the call its backend prepared before (bsrkit.shortcuts): with a checked call
    # on a kept operand (and no meta), keyed before the parameter lookup, which it then skips; else by
    # layouts and params.
    values = a.values
    fast = checked is not None and meta is None and overwrite and a.calls is not None
    if fast:  # (a kept operand: its values' layout is fixed)
        assert checked is not None
        if rerun_prepared(a, checked, dense, out, unproven) is not None:
            return out
        unproven = False  # (proven there, whole, when no call was prepared)
        key: tuple[Any, ...] = _fast_key(checked, dense, out)
    if unproven:
        _prove(a)  # (before the pattern's plans are read)
    Ms, Ks = values.shape[-2:]
    name = tuning.TABLE_NAMES["addmm", "transposed" if a.transposed_block_cols else ""]
    shape = (a.M, a.K, dense.shape[-1])
    params = tuning.resolve(backend, name, out.device, out.dtype, shape, (Ms, Ks), meta, op)
    tuning_state = tuning.resolve_state()  # (what params were resolved with: the first call loads the table)
    if not fast:
        checked = None
        key = (
            backend.name, a.transposed_block_cols,
            values.shape, values.stride(), values.storage_offset(),
            dense.shape, dense.stride(), dense.storage_offset(),
            out.shape, out.stride(), out.storage_offset(), out.dtype,
            batch, alpha, overwrite, tuple(sorted(params.items())),
        )  # fmt: skip
        rerun = shortcuts.prepared_call(a, key, None, tuning_state)
        if rerun is not None:
            rerun(values, dense, out)
            return out
    rerun = backend.addmm(a, dense, out, batch, alpha, overwrite, params)
    if rerun is not None:
        shortcuts.keep_prepared_call(a, key, checked, tuning_state, rerun)
    return out


def _fast_key(checked: Any, dense: torch.Tensor, out: torch.Tensor) -> tuple[Any, ...]:
    """The key of a prepared call kept on a kept operand (see :func:`addmm`)."""
    return (
        id(checked), dense.stride(), dense.storage_offset(), out.stride(), out.storage_offset(),
        torch.get_num_threads(),
    )  # fmt: skip


def rerun_prepared(
    a: Operand, checked: shortcuts.CheckedCall, dense: torch.Tensor, out: torch.Tensor, unproven: bool
) -> Any:
    """``out = a @ dense`` by the call prepared for an earlier product like it (a kept operand ``a``, the
    same ``checked`` call, no ``meta``, ``beta == 0``, ``alpha == 1``: see :func:`addmm`); returns that
    prepared call, or None, computing nothing, when there is none. ``unproven`` as in :func:`addmm`: ``a``
    is proven here (by the loop, or whole) either way, and :class:`~bsrkit.shortcuts.StalePattern` raised
    when it changed."""
    rerun = None
    if a.calls is not None:
        rerun = shortcuts.prepared_call(a, _fast_key(checked, dense, out), checked, tuning.resolve_state())
    if rerun is not None and unproven and rerun.proves:
        # Nothing before this call trusted the index data. Its loop addresses memory through its own
        # (validated) plan only, so a changed pattern steers no access; its verdict covers every entry of
        # the plan (see compiled.small.BsrMMSmallArgs).
        shortcuts.proven_in_loop(rerun(a.values, dense, out, True))
        return rerun
    if unproven:
        _prove(a)
    if rerun is None:
        return None
    rerun(a.values, dense, out)
    return rerun


def rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the 2-D matrix of its last dimension's rows (itself when 2-D; a view where its leading
    dimensions are one stride apart, else a copy)."""
    if t.ndim == 2:
        return t
    # (-1 cannot be inferred with a last dimension of 0: nn.Linear(0, n) takes such an input)
    return t.reshape(-1, t.shape[-1]) if t.shape[-1] else t.reshape(math.prod(t.shape[:-1]), 0)


def rerun_weight_call(
    a: Operand, call: shortcuts.WeightCall, x: torch.Tensor, y: torch.Tensor, unproven: bool
) -> bool:
    """``y = x a^T`` for a kept weight's product (:func:`bsrkit.custom_ops.linear_product`: ``y`` new and
    row-major, ``call`` kept under a key that holds ``x``'s and so ``y``'s layouts and the thread count,
    everything :func:`_fast_key` reads) by :func:`rerun_prepared` on their rows (:func:`rows`); False,
    computing nothing, when it has no prepared call. A prepared call whose loop proves the index data,
    run on ``x``'s own memory (its rows a view), is remembered on ``call`` with ``a`` and the tuning
    state, for :func:`rerun_weight_call_directly`. Raises :class:`~bsrkit.shortcuts.StalePattern` as
    :func:`rerun_prepared`."""
    call.remembered = None
    x2 = rows(x)
    rerun = rerun_prepared(a, call.checked, x2.mT, rows(y).mT, unproven)
    if rerun is not None and unproven and rerun.proves and x2.data_ptr() == x.data_ptr():
        call.remembered = (a, rerun, tuning.resolve_state())
    return rerun is not None


def rerun_weight_call_directly(
    call: shortcuts.WeightCall, values: torch.Tensor, x: torch.Tensor, y: torch.Tensor
) -> Operand | None:
    """``y = x W^T`` by the prepared call ``call`` remembers (:func:`rerun_weight_call`), by data
    addresses where it takes them (``rerun.at``): no operand, key, lookup or views. Returns the operand
    whose pattern it ran on; None, computing nothing, when it remembers none or the tuning state changed
    since. ``values`` are the kept weight's
    (the caller found ``call`` in its table, so the parts and their layouts are those the call was
    prepared with, and ``x``'s and ``y``'s rows are views of their memory: see :mod:`bsrkit.shortcuts`).
    Its loop proves the index data; raises :class:`~bsrkit.shortcuts.StalePattern` when it changed."""
    remembered = call.remembered  # (one read: another thread may replace it)
    if remembered is None:
        return None
    operand, rerun, known = remembered
    state = tuning.resolve_state()
    if known[0] is not state[0] or known[1] is not state[1]:
        return None
    at = rerun.at
    if at is not None:
        shortcuts.proven_in_loop(at(values.data_ptr(), x.data_ptr(), y.data_ptr(), True))
    else:  # (a call that fills a copy of dense from the tensor)
        shortcuts.proven_in_loop(rerun(values, rows(x).mT, rows(y).mT, True))
    return operand


def _prove(a: Operand | None) -> None:
    """The whole proof of an unproven operand's index data (see :func:`addmm`)."""
    if a is not None and a.pattern is not None and not a.pattern.proof.unchanged():
        raise shortcuts.StalePattern


def _scale_product(
    product: torch.Tensor, alpha: float, left: torch.Tensor | None, right: torch.Tensor | None
) -> None:
    if alpha != 1:
        product.mul_(alpha)
    if left is not None:
        product.mul_(left.to(product.dtype).unsqueeze(-1))
    if right is not None:
        product.mul_(right.to(product.dtype).unsqueeze(-2))


def int8_compute_dtype(K: int) -> torch.dtype:
    """The floating type in which an int8 product with inner dimension ``K`` is exact: every partial sum
    is an integer of magnitude at most ``K * 128**2``, exact in float32 up to ``2**24``."""
    return torch.float32 if K * 128 * 128 <= 2**24 else torch.float64


def _int8_addmm(
    op: str,
    backend: Backend,
    input: torch.Tensor | None,
    a: Operand | None,
    dense: torch.Tensor,
    out: torch.Tensor,
    batch: torch.Size,
    beta: float,
    alpha: float,
    meta: dict[str, Any] | None,
    left: torch.Tensor | None,
    right: torch.Tensor | None,
) -> torch.Tensor:
    """int8 x int8 -> int32 on the float kernels: the product exactly; then, with integer scales (or
    none), int32 arithmetic as torch's kernel (each product wrapped to 32 bits); with a floating scale,
    the scalars and scales in float64, rounded once into ``out``."""
    compute = int8_compute_dtype(dense.shape[-2])
    if a is not None:
        a = a._replace(values=a.values.to(compute))
    product = torch.empty(out.shape, dtype=compute, device=out.device)
    addmm(op, backend, None, a, dense.to(compute), product, batch, 0.0, 1.0, meta)
    if not any(s is not None and (s.is_floating_point() or s.is_complex()) for s in (left, right)):
        # Integer beta, alpha (|x| < 2**31, checked) and scales: int32 arithmetic as torch's, each product
        # wrapped to 32 bits, in int64 (float64 rounded terms past 2**53: 2**30 + 1 times 2**31 - 1).
        def wrapped(t: torch.Tensor) -> torch.Tensor:
            return t.to(torch.int32).to(torch.int64)

        total = wrapped(product.to(torch.int64))
        for scale, axis in ((left, -1), (right, -2)):  # (left scales rows, right columns)
            if scale is not None:
                total = wrapped(total * wrapped(scale.to(torch.int64)).unsqueeze(axis))
        total = wrapped(total * int(alpha))
        if input is not None and beta != 0:
            total += wrapped(input.to(torch.int64).expand(out.shape) * int(beta))
        return out.copy_(total)  # (int64 to int32: wraps, as torch's int32 sum)
    result = product.to(torch.float64)
    _scale_product(result, alpha, left, right)
    if input is not None and beta != 0:
        result.add_(input.to(torch.float64).expand(out.shape), alpha=beta)
    # (through int64: a result beyond int32 wraps around as torch's int32 arithmetic does; a float64
    # cast straight to int32 saturates to its most negative value on x86)
    return out.copy_(result.round_().to(torch.int64))


def _scale_input_into(out: torch.Tensor, input: torch.Tensor, beta: float) -> None:
    """out := beta * input (``input`` broadcasts to ``out``; it may be ``out`` itself)."""
    if not _same_view(input, out):
        out.copy_(input.expand(out.shape))
    if beta != 1:
        out.mul_(beta)


def _copies_into(input: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``out := input`` can be written in place: ``input`` is ``out``'s own view, or apart from it
    (one overlapping ``out`` otherwise, ``out.mT`` say, is copied through float32)."""
    return _same_view(input, out) or not may_share_memory(input, out)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def check_meta(op: str, backend: Backend, meta: dict[str, Any]) -> None:
    """Judge ``meta`` for a product that runs no kernel (nothing stored, ``K == 0`` or ``alpha == 0``),
    as :func:`addmm` judges it where one runs (:func:`bsrkit.tuning.check_meta`)."""
    tuning.check_meta(backend, meta, op)


def sampled(
    op: str,
    backend: Backend,
    a: Operand,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    batch: torch.Size,
    alpha: float,
    meta: dict[str, Any] | None = None,
) -> torch.Tensor:
    """``alpha * (mat1 @ mat2)`` at ``a``'s blocks: values of shape ``(*batch, nnz, Ms, Ns)``. A
    non-finite ``alpha`` scales the formed product (a gemm may scale an operand instead, and with
    ``K == 0`` there is no operand): ``inf * 0`` and ``nan * x`` are NaN, as the formula says.
    ``alpha == 0`` forms no product (zeros, whatever NaN or Inf the matrices hold), as ``torch.addmm``
    and torch's Triton kernel, on every backend."""
    Ms, Ns = a.values.shape[-2:]
    if alpha == 0:
        nnz = a.values.shape[-3]
        return torch.zeros((*batch, nnz, Ms, Ns), dtype=mat1.dtype, device=mat1.device)
    shape = (mat1.shape[-2], mat1.shape[-1], mat2.shape[-1])
    name = tuning.TABLE_NAMES["sampled", ""]
    params = tuning.resolve(backend, name, mat1.device, mat1.dtype, shape, (Ms, Ns), meta, op)
    finite = math.isfinite(alpha)
    values = backend.sampled(a, mat1, mat2, batch, alpha if finite else 1.0, params)
    if not finite:
        values.mul_(alpha)
    return values.reshape(*batch, *values.shape[1:])


def sampled_addmm(
    op: str,
    backend: Backend,
    a: Operand,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    batch: torch.Size,
    beta: float,
    alpha: float,
    input: torch.Tensor,
) -> torch.Tensor:
    """``beta * input.values() + alpha * (mat1 @ mat2)`` at ``a``'s blocks (:func:`sampled`; the BSR
    ``input``'s values broadcast to ``(*batch, nnz, Ms, Ns)``, not read when ``beta == 0``). Half types
    add in float32 and round once, as torch: a sum of terms beyond their range (a product of 70000 and
    an input of -60000) must not be inf, nor a ``beta`` beyond it raise."""
    dtype = mat1.dtype
    half = dtype in (torch.float16, torch.bfloat16) and beta != 0
    if half:
        mat1, mat2 = mat1.float(), mat2.float()
    values = sampled(op, backend, a, mat1, mat2, batch, alpha)
    if beta != 0:
        in_values = input.values()
        values.add_(in_values.expand(*batch, *in_values.shape[-3:]).to(values.dtype), alpha=beta)
    return values.to(dtype) if half else values


def scatter_mm(
    op: str,
    backend: Backend,
    blocks: torch.Tensor,
    others: torch.Tensor,
    indices_data: tuple[Any, ...],
    accumulators: torch.Tensor,
    overwrite: bool = False,
) -> torch.Tensor:
    """``accumulators += scatter_mm(blocks, others, indices_data)`` (``overwrite``: ``=``, the elements
    no tile reaches set to 0); returns ``accumulators``."""
    _, Ms, Ks = blocks.shape
    # The scatter formats take no meta= (torch's API has none): the backend's defaults, no table lookup.
    name = tuning.TABLE_NAMES["scatter_mm", ""]
    shape = (Ms, Ks, others.shape[-1])
    params = tuning.resolve(backend, name, blocks.device, blocks.dtype, shape, (Ms, Ks), {}, op)
    backend.scatter_mm(blocks, others, indices_data, accumulators, params, overwrite)
    return accumulators


def softmax(
    backend: Backend,
    a: Operand,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    zero_empty_rows: bool = False,
) -> torch.Tensor:
    """Row softmax of ``x (+ bias)`` over ``a``'s stored entries (see ``Backend.softmax``); values of
    ``x``'s shape. The empty case (no entry at all) returns an empty tensor without calling the backend."""
    if x.numel() == 0:
        return torch.empty_like(x)
    return backend.softmax(a, x, bias, zero_empty_rows)


def softmax_backward(backend: Backend, a: Operand, y: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``y * (grad - sum_row(grad * y))`` over ``a``'s stored entries (see ``Backend.softmax_backward``)."""
    if y.numel() == 0:
        return torch.empty_like(y)
    return backend.softmax_backward(a, y, grad)
