r"""The ``scatter_mm`` path of ``torch.sparse._triton_ops``: indices data derived once per pattern
(:func:`bsr_scatter_mm_indices_data`, layout identical to torch's), then products driven by them
(:func:`scatter_mm`, :func:`bsr_scatter_mm`). Each public function validates, allocates and makes one
dispatch call, like :mod:`bsrkit.ops`; indices data are checked against the operands once per indices data.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from bsrkit import dispatch, plans, tuning
from bsrkit.eager import eager_under_compile
from bsrkit.operand import Operand
from bsrkit.ops import checked_addmm
from bsrkit.validation import (
    check_bsr,
    check_out,
    check_same_device,
    check_same_dtype,
    check_strided,
)

__all__ = ["bsr_scatter_mm", "bsr_scatter_mm_indices_data", "scatter_mm"]

_INDICES_FORMATS = ("bsr_strided_mm_compressed", "bsr_strided_mm", "scatter_mm")


_INT32_MAX = 2**31 - 1


@eager_under_compile
def bsr_scatter_mm_indices_data(
    bsr: torch.Tensor,
    other: torch.Tensor,
    indices_format: str = "bsr_strided_mm_compressed",
    **meta_input: Any,
) -> tuple[Any, ...]:
    """Indices data for :func:`scatter_mm` computing ``bsr @ other`` (layout identical to torch's).

    Computed with vectorized torch ops and cached in the shared plan cache, keyed on ``bsr``'s indices
    (the entry lives exactly as long as ``bsr``). For the ``bsr_strided_mm*`` formats the last item is
    the meta dict (``SPLIT_N``, ``is_compressed``). Offsets into ``other`` (up to ``K * N``) take the
    dtype of ``bsr``'s indices, as torch's do; where int32 indices cannot hold them a ``ValueError`` says
    so (torch's wrap around to negative values).
    """
    op = "bsr_scatter_mm_indices_data"
    check_bsr(op, "bsr", bsr)
    if bsr.ndim != 2:
        raise ValueError(f"{op}(): expected a 2-D bsr (no batch dimensions), got shape {tuple(bsr.shape)}")
    check_strided(op, "other", other)
    if indices_format not in _INDICES_FORMATS:
        raise ValueError(f"{op}(): expected indices_format in {_INDICES_FORMATS}, got {indices_format!r}")
    M, K = bsr.shape
    Ms, Ks = bsr.values().shape[-2:]
    if other.shape[-2] != K:
        raise ValueError(f"{op}(): expected other.shape[-2] == {K} (bsr.shape[-1]), got {other.shape[-2]}")
    N = other.shape[-1]
    nbatches = math.prod(other.shape[:-2])
    Operand.of(bsr, op)  # the indices data derive from the pattern: validate it (once per pattern)
    if indices_format == "scatter_mm":
        if N % Ms:
            raise ValueError(
                f"{op}(): the 'scatter_mm' format needs other.shape[-1] divisible by the block "
                f"height {Ms}, got {N}"
            )
        tiles = nbatches * (K // Ks) * (N // Ms)  # the largest tile index in its int32 pairs, plus one
        if tiles > _INT32_MAX + 1:
            raise ValueError(
                f"{op}(): the 'scatter_mm' format indexes the tiles of other with int32, but other has "
                f"{tiles} tiles (> 2**31): use another indices_format"
            )
        return plans.scatter_mm_indices(bsr, indices_format, N, nbatches, 0)
    if bsr.col_indices().dtype == torch.int32 and K * N - 1 > _INT32_MAX:
        # The offsets into other take the indices' dtype (torch's layout); torch's own would wrap around.
        raise ValueError(
            f"{op}(): offsets into other reach K * N - 1 = {K * N - 1} > 2**31 - 1, which overflows bsr's "
            "int32 indices: give bsr int64 indices (crow_indices().long(), col_indices().long())"
        )
    meta = tuning.scatter_mm_meta(M, K, N, Ms, Ks, **meta_input)
    if "allow_tf32" not in meta_input:  # as torch: TF32 dots for half types only
        meta["allow_tf32"] = bsr.dtype in (torch.float16, torch.bfloat16)
    data = plans.scatter_mm_indices(bsr, indices_format, N, 0, meta["SPLIT_N"])
    meta["is_compressed"] = indices_format == "bsr_strided_mm_compressed"
    return (*data, meta)


@eager_under_compile
def scatter_mm(
    blocks: torch.Tensor,
    others: torch.Tensor,
    indices_data: tuple[Any, ...],
    *,
    accumulators: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Scattered matrix products, semantics of ``torch.sparse._triton_ops.scatter_mm``.

    * ``"scatter_mm"``: ``(fmt, c_offsets, pq)``; :math:`\mathrm{acc}[r] \mathrel{+}= \sum_{g=c_r}^{c_{r+1}-1}
      \mathrm{blocks}[p_g]\,\mathrm{others}[q_g]` with ``blocks (P, Ms, Ks)``, ``others (Q, Ks, Ns)``,
      ``accumulators (R, Ms, Ns)``.
    * ``"bsr_strided_mm"``: ``(fmt, c_indices, r_offsets, p_offsets, q_offsets, meta)``; for each
      ``i``: ``acc[b, r0:r0+Ms, r1:r1+Ns] += blocks[p_g] @ others[b, q0:q0+Ks, q1:q1+Ns]`` over
      ``g in [c_i, c_{i+1})``, with ``(r0, r1) = divmod(r_offsets[i], N)``, ``(q0, q1) =
      divmod(q_offsets[g], N)`` and ``Ns = N // meta["SPLIT_N"]``.
    * ``"bsr_strided_mm_compressed"``: ``(fmt, c_indices, r_offsets, q_offsets, meta)``; the tile at
      ``r`` (block row ``m = r // N // Ms``, panel ``n = r % N // Ns``) sums ``p in [c_m, c_{m+1})`` with
      ``q = q_offsets[n * c_{m+1} + (SPLIT_N - n) * c_m + (p - c_m)]``.

    ``accumulators`` is accumulated into and returned; when None, a zero tensor is created. Not
    differentiable (as torch's): an argument that requires grad is refused rather than silently cut off.
    """
    _check_no_grad("scatter_mm", blocks=blocks, others=others, accumulators=accumulators)
    return _scatter_mm("scatter_mm", blocks, others, indices_data, accumulators, overwrite=False)


def _check_no_grad(op: str, **tensors: Any) -> None:
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(
                f"{op}(): expected {name} not to require grad (the indices_data path is not differentiable; "
                "bsrkit.bsr_dense_mm, or bsr_scatter_mm without indices_data, are)"
            )


def _check_indices_format(op: str, indices_data: Any) -> str:
    if not isinstance(indices_data, tuple) or not indices_data or indices_data[0] not in _INDICES_FORMATS:
        got = indices_data[0] if isinstance(indices_data, tuple) and indices_data else indices_data
        raise ValueError(
            f"{op}(): expected indices_data[0] (the indices format) in {_INDICES_FORMATS}, got {got!r}"
        )
    return str(indices_data[0])


def _scatter_mm(
    op: str,
    blocks: torch.Tensor,
    others: torch.Tensor,
    indices_data: tuple[Any, ...],
    accumulators: torch.Tensor | None,
    overwrite: bool,
) -> torch.Tensor:
    """:func:`scatter_mm` (``overwrite``: ``accumulators = ...``, as if they were zeros)."""
    check_strided(op, "blocks", blocks, min_ndim=3)
    check_strided(op, "others", others)
    if blocks.ndim != 3:
        raise ValueError(f"{op}(): expected blocks to be 3-D (P, Ms, Ks), got shape {tuple(blocks.shape)}")
    check_same_dtype(op, "others", others, "blocks", blocks)
    check_same_device(op, "others", others, "blocks", blocks)
    fmt = _check_indices_format(op, indices_data)
    _, Ms, Ks = blocks.shape
    if fmt == "scatter_mm":
        if others.ndim != 3 or others.shape[1] != Ks:
            raise ValueError(f"{op}(): expected others of shape (Q, {Ks}, Ns), got {tuple(others.shape)}")
        c_offsets = indices_data[1] if len(indices_data) > 1 else None
        R = c_offsets.numel() - 1 if isinstance(c_offsets, torch.Tensor) else 0  # (else: refused below)
        acc_shape: tuple[int, ...] = (max(R, 0), Ms, others.shape[2])
    else:
        K, N = others.shape[-2:]
        if K % Ks:
            raise ValueError(f"{op}(): expected others.shape[-2] divisible by Ks == {Ks}, got {K}")
        r_offsets = indices_data[2] if len(indices_data) > 2 else None
        if accumulators is not None:
            M = accumulators.shape[-2]
        elif isinstance(r_offsets, torch.Tensor) and r_offsets.numel() and N:
            M = Ms + max(int(r_offsets.max()), 0) // N  # as torch: the rows the tiles reach
        else:
            M = Ms
        acc_shape = (*others.shape[:-2], M, N)
    if accumulators is None:
        accumulators = torch.zeros(acc_shape, dtype=blocks.dtype, device=blocks.device)
        overwrite = False
    else:
        check_out(op, accumulators, acc_shape, blocks.dtype, blocks.device)
    if accumulators.numel() == 0:
        return accumulators
    _run_scatter(op, blocks, others, indices_data, accumulators, tuple(others.shape), acc_shape, overwrite)
    return accumulators


def _run_scatter(
    op: str,
    blocks: torch.Tensor,
    others: torch.Tensor,
    indices_data: tuple[Any, ...],
    accumulators: torch.Tensor,
    others_shape: tuple[int, ...],
    acc_shape: tuple[int, ...],
    overwrite: bool,
) -> None:
    """Check ``indices_data`` against the operands' (logical) shapes once, then one backend call."""
    _, Ms, Ks = blocks.shape
    try:  # once per indices data: every offset stays inside the operands
        plans.check_indices_data(indices_data, blocks.shape[0], Ms, Ks, others_shape, acc_shape)
    except plans.MalformedPatternError as exc:
        raise ValueError(f"{op}(): malformed indices_data: {exc}") from None
    backend = dispatch.select(op, "scatter_mm", blocks.device, blocks.dtype)
    dispatch.scatter_mm(op, backend, blocks, others, indices_data, accumulators, overwrite)


@eager_under_compile
def bsr_scatter_mm(
    bsr: torch.Tensor,
    other: torch.Tensor,
    indices_data: tuple[Any, ...] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``bsr @ other`` for a 2-D ``bsr``, through ``indices_data`` when given (see :func:`scatter_mm`).

    Without ``indices_data`` this is :func:`bsr_dense_mm` (the fastest path for the device, and
    differentiable); with it, arguments that require grad are refused (as in :func:`scatter_mm`).
    """
    op = "bsr_scatter_mm"
    check_bsr(op, "bsr", bsr)
    if bsr.ndim != 2:
        raise ValueError(f"{op}(): expected a 2-D bsr (no batch dimensions), got shape {tuple(bsr.shape)}")
    if indices_data is None:
        return checked_addmm(op, None, bsr, other, beta=0.0, alpha=1.0, out=out, meta=None)
    _check_no_grad(op, bsr=bsr, other=other)
    check_strided(op, "other", other)
    check_same_dtype(op, "other", other, "bsr", bsr)
    check_same_device(op, "other", other, "bsr", bsr)
    M, K = bsr.shape
    if other.shape[-2] != K:
        raise ValueError(f"{op}(): expected other.shape[-2] == {K} (bsr.shape[-1]), got {other.shape[-2]}")
    N = other.shape[-1]
    out_shape = (*other.shape[:-2], M, N)
    if out is None:
        out = torch.empty(out_shape, dtype=bsr.dtype, device=bsr.device)
    else:
        check_out(op, out, out_shape, bsr.dtype, bsr.device)
    if bsr._nnz() == 0 or out.numel() == 0:
        return out.zero_()
    fmt = _check_indices_format(op, indices_data)
    if fmt != "scatter_mm":
        return _scatter_mm(op, bsr.values(), other, indices_data, out, overwrite=True)
    Ms, Ks = bsr.values().shape[-2:]
    if N % Ms:
        raise ValueError(
            f"{op}(): the 'scatter_mm' format needs other.shape[-1] divisible by the block height {Ms}, "
            f"got {N}"
        )
    nb = math.prod(other.shape[:-2])
    KB, MB, NB = K // Ks, M // Ms, N // Ms
    # The tiles of other (Ks x Ms) and of out (Ms x Ms) in the order the "scatter_mm" indices use, as
    # views: (batch, block row, tile column) leading dimensions, no copies.
    others = other.reshape(nb, KB, Ks, NB, Ms).permute(0, 1, 3, 2, 4)
    try:
        acc, copied = out.view(nb, M, N), False
    except RuntimeError:  # batch dims that cannot be flattened: through a copy
        acc, copied = out.reshape(nb, M, N).clone(), True
    tiles = acc.view(nb, MB, Ms, NB, Ms).permute(0, 1, 3, 2, 4)
    _run_scatter(
        op, bsr.values(), others, indices_data, tiles, (nb * KB * NB, Ks, Ms), (nb * MB * NB, Ms, Ms), True
    )
    if copied:
        out.copy_(acc.view(out_shape))
    return out
