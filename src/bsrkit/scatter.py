r"""The ``scatter_mm`` path of ``torch.sparse._triton_ops``: indices data derived once per pattern
(:func:`bsr_scatter_mm_indices_data`, layout identical to torch's), then products driven by them
(:func:`scatter_mm`, :func:`bsr_scatter_mm`). Each public function validates, allocates and makes one
dispatch call, like :mod:`bsrkit.ops`; indices data are checked against the operands once per indices data.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad

from bsrkit import dispatch, plans
from bsrkit.autograd import refuse_tangents
from bsrkit.eager import eager_under_compile
from bsrkit.freshness import check_mode
from bsrkit.operand import Operand
from bsrkit.ops import checked_addmm
from bsrkit.validation import (
    check_bsr,
    check_out,
    check_same_device,
    check_same_dtype,
    check_strided,
    is_int,
    mark_written,
    may_share_memory,
    resolved,
    type_name,
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
        return _handed_out(_indices_data(bsr, indices_format, N, nbatches, 0))
    if bsr.col_indices().dtype == torch.int32 and K * N - 1 > _INT32_MAX:
        # The offsets into other take the indices' dtype (torch's layout); torch's own would wrap around.
        raise ValueError(
            f"{op}(): offsets into other reach K * N - 1 = {K * N - 1} > 2**31 - 1, which overflows bsr's "
            "int32 indices: give bsr int64 indices (crow_indices().long(), col_indices().long())"
        )
    meta = _meta("bsr_scatter_mm_indices_data", M, K, N, Ms, Ks, dict(meta_input))
    if "allow_tf32" not in meta_input:  # as torch: TF32 dots for half types only
        meta["allow_tf32"] = bsr.dtype in (torch.float16, torch.bfloat16)
    data = _indices_data(bsr, indices_format, N, 0, meta["SPLIT_N"])
    meta["is_compressed"] = indices_format == "bsr_strided_mm_compressed"
    return (*_handed_out(data), meta)


def _handed_out(data: tuple[Any, ...]) -> tuple[Any, ...]:
    """The caller's own copy of cached indices data: a write into it cannot change the cached data,
    which every later product compares the caller's against (:func:`_check_indices_data_of`)."""
    return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in data)


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

    ``accumulators`` is returned, accumulated into, except in the ``"bsr_strided_mm"`` format, which
    overwrites them (elements no tile reaches become 0), as torch's does on every device (its CPU loop
    zeroes them first); when None, a zero tensor is created. ``indices_data`` may be a list, as torch
    takes it. Not differentiable (as torch's): an argument that requires grad is refused rather than
    silently cut off.
    """
    _check_no_grad("scatter_mm", blocks=blocks, others=others, accumulators=accumulators)
    indices_data = _as_tuple(indices_data)
    overwrite = bool(indices_data) and indices_data[0] == "bsr_strided_mm"
    return _scatter_mm("scatter_mm", blocks, others, indices_data, accumulators, overwrite=overwrite)


def _as_tuple(indices_data: Any) -> Any:
    """Indices data given as a list (torch unpacks either) as a tuple: the one form checked and cached."""
    return tuple(indices_data) if isinstance(indices_data, list) else indices_data


def _check_no_grad(op: str, **tensors: Any) -> None:
    if forward_ad._current_level >= 0:  # (nor forward-mode: a tangent would be dropped)
        refuse_tangents(tuple(tensors.values()))
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(
                f"{op}(): expected {name} not to require grad (the indices_data path is not differentiable; "
                "bsrkit.bsr_dense_mm, or bsr_scatter_mm without indices_data, are)"
            )


def _check_indices_format(op: str, indices_data: Any) -> str:
    if not isinstance(indices_data, tuple) or not indices_data:
        raise ValueError(
            f"{op}(): expected indices_data to be a tuple (format, ...), got {type_name(indices_data)}"
            + (" (empty)" if isinstance(indices_data, tuple) else "")
        )
    if indices_data[0] not in _INDICES_FORMATS:
        raise ValueError(
            f"{op}(): expected indices_data[0] (the indices format) in {_INDICES_FORMATS}, got "
            f"{indices_data[0]!r}"
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
        # (hand-made tiles may overlap, and each sums into its place: see scatter_mm)
        check_out(op, accumulators, acc_shape, blocks.dtype, blocks.device, "accumulators", distinct=False)
        mark_written(op, "accumulators", accumulators)
    blocks, others = resolved(blocks), resolved(others)  # (the kernels read memory)
    if accumulators.is_neg():  # (read and written as memory: summed in a copy of its values, put back)
        summed = resolved(accumulators)
        _run_scatter(op, blocks, others, indices_data, summed, tuple(others.shape), acc_shape, overwrite)
        return accumulators.copy_(summed)
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
        judged = plans.check_indices_data(indices_data, blocks.shape[0], Ms, Ks, others_shape, acc_shape)
    except plans.MalformedPatternError as exc:
        raise ValueError(f"{op}(): malformed indices_data: {exc}") from None
    if accumulators.numel() == 0:  # (judged all the same: an empty result does not excuse bad data)
        return
    if blocks.device.type == "cpu":
        # The kernels run on the bytes that were validated (a write racing this call cannot steer an
        # access). On a device, the live tensors: there the verdict is not compared on a hit by default
        # (see bsrkit.freshness), and a copy taken then would be served after writes no counter saw.
        indices_data = judged
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
    ``indices_data`` must be what :func:`bsr_scatter_mm_indices_data` (bsrkit's or torch's) gives for
    ``bsr``'s pattern as it is now and ``other``'s width: data made for another width, or before the
    pattern was written in place, raise ``ValueError`` (torch computes a wrong product with them). An
    ``out`` sharing memory with ``other`` or the blocks gets the product through a temporary on both
    paths (the operands as they were before the call).
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
    other = resolved(other)  # (the kernels read memory)
    M, K = bsr.shape
    if other.shape[-2] != K:
        raise ValueError(f"{op}(): expected other.shape[-2] == {K} (bsr.shape[-1]), got {other.shape[-2]}")
    N = other.shape[-1]
    out_shape = (*other.shape[:-2], M, N)
    if out is None:
        out = torch.empty(out_shape, dtype=bsr.dtype, device=bsr.device)
    else:
        check_out(op, out, out_shape, bsr.dtype, bsr.device)
        if out.is_neg():  # (the kernels write memory: the product goes through copy_, which negates)
            return out.copy_(bsr_scatter_mm(bsr, other, indices_data))
        mark_written(op, "out", out)
        if may_share_memory(out, other, bsr.values()):
            # (out is zeroed, then accumulated into, while other and the blocks are read: the product goes
            # through a temporary, the operands read as they were)
            return out.copy_(bsr_scatter_mm(bsr, other, indices_data))
    if bsr._nnz() == 0 or out.numel() == 0:
        return out.zero_()
    indices_data = _as_tuple(indices_data)
    fmt = _check_indices_format(op, indices_data)
    Ms, Ks = bsr.values().shape[-2:]
    if fmt == "scatter_mm" and N % Ms:
        raise ValueError(
            f"{op}(): the 'scatter_mm' format needs other.shape[-1] divisible by the block height {Ms}, "
            f"got {N}"
        )
    nb = math.prod(other.shape[:-2])
    _check_indices_data_of(op, bsr, indices_data, fmt, N, nb)
    if fmt != "scatter_mm":
        return _scatter_mm(op, bsr.values(), other, indices_data, out, overwrite=True)
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


def _check_indices_data_of(
    op: str, bsr: torch.Tensor, indices_data: tuple[Any, ...], fmt: str, N: int, nbatches: int
) -> None:
    """``indices_data`` must be what :func:`bsr_scatter_mm_indices_data` gives for ``bsr``'s pattern as
    it is now and ``other``'s width ``N`` (bsrkit's or torch's: the same layout). Bounds alone would let
    data made for another ``N`` or an earlier pattern through, and the product would be silently wrong.
    The data bsrkit hands out are copies of the cached ones (a caller may write them): they are
    compared as any other. On a device, data are compared by shape only, unless in the checked mode
    (``$BSRKIT_CHECK_PLANS=1``): comparing their contents would make every call wait for the device."""
    strided = fmt != "scatter_mm"
    compare = bsr.device.type == "cpu" or check_mode()[1]
    meta = indices_data[-1] if strided and isinstance(indices_data[-1], dict) else None
    split_n = meta.get("SPLIT_N") if meta is not None else None
    Operand.of(bsr, op)  # (the pattern validated, once per pattern, before anything derives from it)
    expected: tuple[Any, ...] | None = None
    if not strided:
        expected = _indices_data(bsr, fmt, N, nbatches, 0)
    elif is_int(split_n) and split_n > 0 and N % split_n == 0:
        expected = _indices_data(bsr, fmt, N, 0, split_n)
    if (
        expected is None
        or len(indices_data) != len(expected) + strided
        or not all(
            isinstance(g, torch.Tensor)
            and g.shape == e.shape
            and (not compare or torch.equal(g.to(e.dtype), e))
            for g, e in zip(indices_data[1 : len(expected)], expected[1:], strict=True)
        )
    ):
        batches = "" if strided else f" with other's {nbatches} batch(es) (the format fixes the count)"
        raise ValueError(
            f"{op}(): expected indices_data made by bsr_scatter_mm_indices_data for this bsr as it is now "
            f"and other.shape[-1] == {N}{batches}, got indices data for another pattern, width or batch"
        )


# -- torch's indices data: format and launch meta (one place; the CPU backend reads what it writes) -----


def _indices_data(
    bsr: torch.Tensor, indices_format: str, N: int, nbatches: int, split_n: int
) -> tuple[Any, ...]:
    """:func:`_build_scatter_mm`, cached on ``bsr``'s pattern in the shared plan cache."""
    return plans.cached("scatter_mm", bsr, indices_format, N, nbatches, split_n)


def _build_scatter_mm(
    bsr: torch.Tensor, indices_format: str, N: int, nbatches: int, split_n: int
) -> tuple[Any, ...]:
    """The ``indices_data`` of ``torch.sparse._triton_ops.bsr_scatter_mm_indices_data``, vectorized.

    The layout (and dtypes) match torch's exactly, so indices data from either library drive either
    library's ``scatter_mm``.
    """
    crow, col = bsr.crow_indices(), bsr.col_indices()
    M, K = bsr.shape[-2:]
    Ms, Ks = bsr.values().shape[-2:]
    device = crow.device
    nnz = col.shape[0]
    counts = crow.diff()
    row_of = torch.repeat_interleave(torch.arange(M // Ms, device=device), counts)  # (nnz,)
    within = torch.arange(nnz, device=device) - crow[:-1][row_of]  # position of block in its row

    if indices_format in ("bsr_strided_mm_compressed", "bsr_strided_mm"):
        Ns = N // split_n
        n_off = torch.arange(split_n, dtype=torch.int32, device=device) * Ns
        # Row m's chunk starts at split_n * crow[m]; inside it, item (n, i) sits at n * count + i.
        pos = (
            split_n * crow[:-1][row_of, None]
            + torch.arange(split_n, device=device) * counts[row_of, None]
            + within[:, None]
        )
        q_values = col[:, None] * (Ks * N) + n_off
        q_offsets = torch.empty(nnz * split_n, dtype=q_values.dtype, device=device)
        q_offsets[pos.reshape(-1)] = q_values.reshape(-1)
        nonzero_rows = counts.nonzero()
        r_offsets = (nonzero_rows * (Ms * N) + n_off).view(-1)
        nnz_per_row = counts[nonzero_rows].repeat_interleave(split_n)
        if indices_format == "bsr_strided_mm_compressed":
            # Swizzle as torch does: output tiles with longer sums first.
            order = nnz_per_row.sort(descending=True, stable=True).indices
            # A copy of crow: a plan must not share memory with its source (it would keep it alive).
            return (indices_format, crow.clone(), r_offsets[order], q_offsets)
        p_values = torch.arange(nnz, dtype=torch.int32, device=device)[:, None].expand(nnz, split_n)
        p_offsets = torch.empty(nnz * split_n, dtype=torch.int32, device=device)
        p_offsets[pos.reshape(-1)] = p_values.reshape(-1)
        c_indices = torch.cat((crow[:1], torch.cumsum(nnz_per_row, 0)))
        return (indices_format, c_indices, r_offsets, p_offsets, q_offsets)

    # "scatter_mm": one output tile per (batch, block row, Ms-wide column block).
    Ns = Ms
    NB = N // Ns
    MB = M // Ms
    tiles_m = torch.arange(MB, device=device).repeat_interleave(NB).repeat(nbatches)
    tiles_n = torch.arange(NB, device=device).repeat(MB * nbatches)
    tiles_b = torch.arange(nbatches, device=device).repeat_interleave(MB * NB)
    tile_counts = counts[tiles_m]
    c_indices = torch.cat((counts.new_zeros(1), tile_counts.cumsum(0))).to(torch.int32)
    g_tile = torch.repeat_interleave(torch.arange(tiles_m.numel(), device=device), tile_counts)
    t = torch.arange(g_tile.numel(), device=device) - c_indices[:-1].to(torch.int64)[g_tile]
    p = crow[tiles_m[g_tile]] + t
    q = (col[p] + tiles_b[g_tile] * (K // Ks)) * NB + tiles_n[g_tile]
    pq = torch.stack((p, q), dim=1).to(torch.int32)
    return (indices_format, c_indices, pq)


# A tile's cost beyond its gemms (in gemms of a full panel): loop overhead.


plans.register("scatter_mm", _build_scatter_mm)


# The indices data meta of torch.sparse._triton_ops.scatter_mm_meta, so that indices data from bsrkit drive
# torch's Triton scatter_mm and back. Its tuned points, for n x n x n products with square blocks:
# (n, blocksize) -> (SPLIT_N, TILE_M, TILE_N, GROUP_SIZE, num_warps); num_stages is 1 everywhere.
_TORCH_SCATTER_MM_POINTS = {
    (256, 16): (1, 16, 16, 4, 4), (256, 32): (2, 32, 16, 4, 4), (256, 64): (1, 32, 32, 4, 4),
    (256, 128): (1, 32, 32, 2, 4),
    (512, 16): (8, 16, 64, 2, 2), (512, 32): (8, 32, 64, 4, 2), (512, 64): (4, 32, 128, 4, 4),
    (512, 128): (8, 64, 64, 4, 4),
    (1024, 16): (4, 16, 128, 2, 1), (1024, 32): (8, 32, 64, 2, 1), (1024, 64): (16, 64, 64, 4, 2),
    (1024, 128): (16, 64, 64, 4, 4), (1024, 256): (16, 64, 64, 2, 4),
    (2048, 16): (4, 16, 128, 8, 1), (2048, 32): (4, 32, 64, 4, 1), (2048, 64): (4, 64, 128, 4, 4),
    (2048, 128): (8, 64, 64, 4, 4), (2048, 256): (4, 64, 64, 2, 4),
    (4096, 16): (2, 16, 256, 2, 2), (4096, 32): (2, 32, 64, 2, 1), (4096, 64): (2, 64, 128, 2, 4),
}  # fmt: skip
# Elsewhere SPLIT_N follows N (torch's heuristic for its reference GPU).
_SPLIT_N_BY_N = {16: 1, 32: 2, 64: 4, 128: 8, 256: 16, 512: 8, 1024: 16, 4096: 32, 8192: 64}
_SCATTER_MM_KEYS = ("GROUP_SIZE", "TILE_M", "TILE_N", "SPLIT_N", "num_warps", "num_stages")


def scatter_mm_meta(
    M: int,
    K: int,
    N: int,
    Ms: int,
    Ks: int,
    GROUP_SIZE: int | None = None,
    TILE_M: int | None = None,
    TILE_N: int | None = None,
    SPLIT_N: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The meta of the ``bsr_strided_mm*`` indices formats, equal to torch's ``scatter_mm_meta`` for the
    same inputs (and torch's signature): ``SPLIT_N`` (N is cut into SPLIT_N panels of ``Ns = N //
    SPLIT_N`` columns) and the launch parameters of torch's Triton kernel (``TILE_M``, ``TILE_N``,
    ``GROUP_SIZE``, ``num_warps``, ``num_stages``; None: chosen); other keywords pass through.

    One deviation: a default ``SPLIT_N`` that does not divide ``N`` (torch's result would be wrong) is
    replaced by their greatest common divisor. Torch also consults a per-GPU table on CUDA machines; that
    is not reproduced here.
    """
    given = dict(
        GROUP_SIZE=GROUP_SIZE, TILE_M=TILE_M, TILE_N=TILE_N, SPLIT_N=SPLIT_N, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return _meta("scatter_mm_meta", M, K, N, Ms, Ks, {**extra, **given})


def _meta(op: str, M: int, K: int, N: int, Ms: int, Ks: int, meta_input: dict[str, Any]) -> dict[str, Any]:
    """:func:`scatter_mm_meta`, errors naming ``op``; the integers given (numpy's too) as ints."""
    # (None means not given, as in torch; popped either way, so that no None passes through)
    given = {k: v for k in _SCATTER_MM_KEYS if (v := meta_input.pop(k, None)) is not None}
    for name, value in given.items():
        if not is_int(value) or value < 1:
            raise ValueError(f"{op}(): expected {name} to be a positive int, got {value!r}")
        given[name] = int(value)  # (a numpy integer would overflow or reach Triton's launcher)
    split_n = given.get("SPLIT_N")
    if split_n is not None and N > 0 and N % split_n:
        raise ValueError(f"{op}(): expected SPLIT_N to be a positive divisor of N == {N}, got {split_n!r}")
    point = _TORCH_SCATTER_MM_POINTS.get((M, Ms)) if M == K == N and Ms == Ks and not given else None
    if point is not None:
        split_n, tile_m, tile_n, group_size, num_warps = point
        return {
            "TILE_M": tile_m, "TILE_N": tile_n, "GROUP_SIZE": group_size, "num_stages": 1,
            "num_warps": num_warps, "SPLIT_N": split_n, **meta_input,
        }  # fmt: skip
    if split_n is None:
        split_n = _SPLIT_N_BY_N.get(N, 16)
        if Ms >= 512 and N >= 2048:
            split_n = 1
        split_n = math.gcd(N, split_n) if N > 0 else split_n  # must divide N
    Ns = N // split_n
    wide = 32 if Ns >= 512 else 64
    if min(M, N) >= 1024:
        default_warps = {16: 1, 32: 1, 64: 2}.get(Ms, 4)
    elif min(M, N) == 256:
        default_warps = {16: 1, 32: 4}.get(Ms, 4)
    else:
        default_warps = {16: 1, 32: 2}.get(Ms, 4)
    return {
        "TILE_M": given.get("TILE_M", min(wide, Ms)),
        "TILE_N": given.get("TILE_N", min(wide, Ns)),
        "GROUP_SIZE": given.get("GROUP_SIZE", 4),
        "num_stages": given.get("num_stages", 1),
        "num_warps": given.get("num_warps", default_warps),
        "SPLIT_N": split_n,
        **meta_input,
    }
