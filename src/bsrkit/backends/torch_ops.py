"""Device-agnostic kernels built from torch primitives (batched gemm + index_add), no Python per block.

The portable fallback (:class:`TorchBackend`): it runs every kernel on any device, and is chosen where
no compiled backend can run (non-MKL CPU builds, CUDA without triton) or with ``BSRKIT_BACKEND=torch``.
It also runs ``scatter_mm`` for the CPU backend where accumulators share memory with themselves or an
input. Work is chunked so that gathered operands stay within ``_CHUNK_ELEMENTS`` elements. Half types
are computed in float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from bsrkit.backends.base import ParamSpec
from bsrkit.backends.batching import (
    block_coordinates,
    flatten_addmm,
    flatten_scatter_stacks,
    flatten_strided_scatter,
    non_overlapping,
)

if TYPE_CHECKING:
    from bsrkit.operand import Operand

__all__ = [
    "TorchBackend",
    "accumulate_dtype",
    "bsr_mm_into",
    "sampled_blocks",
    "scatter_mm_into",
    "softmax_backward_blocks",
    "softmax_blocks",
]

_CHUNK_ELEMENTS = 1 << 24


F = TypeVar("F", bound=Callable[..., Any])


def _autocast_off(fn: F) -> F:
    """``fn`` with autocast off: its products are formed in the accumulator's dtype on purpose (under
    ``torch.autocast`` torch's bmm returned the autocast dtype, which a float32 accumulator refused)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@_autocast_off
def bsr_mm_into(
    crow: torch.Tensor,  # (B, MB + 1), one row per output batch (already broadcast)
    col: torch.Tensor,  # (B, nnz)
    values: torch.Tensor,  # (B, nnz, Ms, Ks)
    dense: torch.Tensor,  # (B, K, N)
    out: torch.Tensor,  # (B, M, N); accumulated into unless overwrite
    alpha: float,
    overwrite: bool,
) -> None:
    acc_dtype = accumulate_dtype(out.dtype)
    _, nnz, Ms, Ks = values.shape
    B, M, N = out.shape
    step = max(1, _CHUNK_ELEMENTS // max(1, (Ms + Ks) * N))
    for b in range(B):
        acc = torch.zeros((M // Ms, Ms, N), dtype=acc_dtype, device=out.device)
        row_of = torch.repeat_interleave(torch.arange(M // Ms, device=out.device), crow[b].diff())
        dense_blocks = dense[b].unflatten(0, (-1, Ks))
        for g0 in range(0, nnz, step):
            g1 = min(nnz, g0 + step)
            prods = torch.bmm(values[b, g0:g1].to(acc_dtype), dense_blocks[col[b, g0:g1]].to(acc_dtype))
            acc.index_add_(0, row_of[g0:g1], prods)
        acc = acc.view(M, N)
        if alpha != 1:
            acc.mul_(alpha)
        if overwrite:
            out[b].copy_(acc)
        else:
            out[b].add_(acc.to(out.dtype) if acc_dtype == out.dtype else acc)


def _gather_products(
    blocks: torch.Tensor,
    p: torch.Tensor,
    others_flat: torch.Tensor,  # (B, K * N): each batch's others, row-major
    q: torch.Tensor,
    acc_flat: torch.Tensor,  # (B, M * N), accumulate dtype
    r: torch.Tensor,
    N: int,
    Ns: int,
) -> None:
    """acc[b, r0:r0+Ms, r1:r1+Ns] += blocks[p] @ others[b, q0:q0+Ks, q1:q1+Ns] for each (r, p, q)."""
    _, Ms, Ks = blocks.shape
    B = others_flat.shape[0]
    device = blocks.device
    k_grid = (torch.arange(Ks, device=device) * N)[:, None] + torch.arange(Ns, device=device)
    m_grid = (torch.arange(Ms, device=device) * N)[:, None] + torch.arange(Ns, device=device)
    step = max(1, _CHUNK_ELEMENTS // max(1, B * (Ms + Ks) * Ns))
    for g0 in range(0, p.numel(), step):
        g1 = min(p.numel(), g0 + step)
        q_idx = (q[g0:g1, None, None] + k_grid).reshape(-1)
        rhs = others_flat[:, q_idx].reshape(B, g1 - g0, Ks, Ns).to(acc_flat.dtype)
        prods = torch.matmul(blocks[p[g0:g1]].to(acc_flat.dtype), rhs)  # (B, G, Ms, Ns)
        r_idx = (r[g0:g1, None, None] + m_grid).reshape(-1)
        acc_flat.index_add_(1, r_idx, prods.reshape(B, -1))


@_autocast_off
def scatter_mm_into(
    blocks: torch.Tensor, others: torch.Tensor, indices_data: tuple, accumulators: torch.Tensor
) -> None:
    """The three formats of ``scatter_mm`` (semantics in ``bsrkit.scatter.scatter_mm``), accumulating; for
    the ``bsr_strided_mm*`` formats ``others`` and ``accumulators`` are 3-D."""
    fmt = indices_data[0]
    acc_dtype = accumulate_dtype(accumulators.dtype)
    device = blocks.device
    if fmt == "scatter_mm":
        c_offsets, pq = indices_data[1:]
        pq = pq.reshape(-1, 2).long()
        rows = torch.repeat_interleave(
            torch.arange(c_offsets.numel() - 1, device=device), c_offsets.long().diff()
        )
        acc = torch.zeros(accumulators.shape, dtype=acc_dtype, device=device)
        _, Ms, Ks = blocks.shape
        Ns = others.shape[-1]
        step = max(1, _CHUNK_ELEMENTS // max(1, (Ms + Ks) * Ns))
        for g0 in range(0, pq.shape[0], step):
            g1 = min(pq.shape[0], g0 + step)
            prods = torch.bmm(blocks[pq[g0:g1, 0]].to(acc_dtype), others[pq[g0:g1, 1]].to(acc_dtype))
            acc.index_add_(0, rows[g0:g1], prods)
        accumulators.add_(acc.to(accumulators.dtype))
        return

    B, K, N = others.shape
    Ms = blocks.shape[1]
    meta = indices_data[-1]
    split_n = meta["SPLIT_N"]
    Ns = N // split_n
    if fmt == "bsr_strided_mm":
        c_indices, r_offsets, p_offsets, q_offsets = (x.long() for x in indices_data[1:5])
        counts = c_indices.diff()
        r = torch.repeat_interleave(r_offsets, counts)
        g0, g1 = int(c_indices[0]), int(c_indices[-1])  # rows' ranges [c_i, c_i+1) tile [g0, g1)
        p = p_offsets[g0:g1]
        q = q_offsets[g0:g1]
    else:  # "bsr_strided_mm_compressed"
        c_indices, r_offsets, q_offsets = (x.long() for x in indices_data[1:4])
        m = (r_offsets // N) // Ms
        n = (r_offsets % N) // Ns
        c0, c1 = c_indices[m], c_indices[m + 1]
        counts = c1 - c0
        j = torch.repeat_interleave(torch.arange(r_offsets.numel(), device=device), counts)
        i = torch.arange(j.numel(), device=device) - torch.cumsum(counts, 0).sub(counts)[j]
        r = r_offsets[j]
        p = c0[j] + i
        q = q_offsets[n[j] * c1[j] + (split_n - n[j]) * c0[j] + i]
    acc = torch.zeros((B, accumulators.shape[-2] * N), dtype=acc_dtype, device=device)
    _gather_products(blocks, p, others.reshape(B, K * N), q, acc, r, N, Ns)
    accumulators.add_(acc.view(accumulators.shape).to(accumulators.dtype))


def _add_into_shared(target: torch.Tensor, addend: torch.Tensor) -> None:
    """``target += addend`` for a ``target`` whose elements share memory (torch refuses to write it): each
    memory location gets the sum of ``addend`` over every element viewing it, as one ``+=`` per element
    would (torch's ``scatter_mm`` adds row by row into such accumulators)."""
    if target.numel() == 0:
        return
    span = 1 + sum((size - 1) * stride for size, stride in zip(target.shape, target.stride(), strict=True))
    memory = target.as_strided((span,), (1,))  # (from target's first element, its storage offset)
    where = torch.zeros((), dtype=torch.int64, device=target.device)  # (each element's offset: numel of them)
    for dim, (size, stride) in enumerate(zip(target.shape, target.stride(), strict=True)):
        step = torch.arange(size, device=target.device) * stride
        where = where + step.view(size, *[1] * (target.ndim - 1 - dim))
    memory.index_add_(0, where.reshape(-1), addend.reshape(-1))


@_autocast_off
def sampled_blocks(
    rows: torch.Tensor,  # (B, nnz) block row of each block
    cols: torch.Tensor,  # (B, nnz) block column of each block
    Ms: int,
    Ns: int,
    mat1: torch.Tensor,  # (*B1, M, K)
    mat2: torch.Tensor,  # (*B2, K, N)
    batch: torch.Size,
    alpha: float,
) -> torch.Tensor:
    """(B, nnz, Ms, Ns): ``alpha * mat1[rows block] @ mat2[cols block]``, batched gemms over chunks."""
    B, nnz = rows.shape
    M, K = mat1.shape[-2:]
    N = mat2.shape[-1]
    acc_dtype = accumulate_dtype(mat1.dtype)
    # Block views, no copies: a (B, MB, Ms, K) and b (B, NB, K, Ns).
    a = mat1.expand(*batch, M, K).reshape(B, M // Ms, Ms, K)
    b = mat2.expand(*batch, K, N).reshape(B, K, N // Ns, Ns).permute(0, 2, 1, 3)
    out = torch.empty((B, nnz, Ms, Ns), dtype=mat1.dtype, device=mat1.device)
    bidx = torch.arange(B, device=mat1.device)[:, None]
    step = max(1, _CHUNK_ELEMENTS // max(1, B * (Ms + Ns) * max(K, 1)))
    for g0 in range(0, nnz, step):
        g1 = min(nnz, g0 + step)
        lhs = a[bidx, rows[:, g0:g1]].to(acc_dtype)  # (B, G, Ms, K)
        rhs = b[bidx, cols[:, g0:g1]].to(acc_dtype)  # (B, G, K, Ns)
        prod = torch.matmul(lhs, rhs)
        if alpha != 1:
            prod.mul_(alpha)
        out[:, g0:g1] = prod
    return out


class TorchBackend:
    """Torch primitives on any device: batched gemms over gathered blocks, ``index_add`` to scatter."""

    name = "torch"
    display_name = "torch"
    param_schema: ClassVar[Mapping[str, ParamSpec]] = {}  # nothing to tune: ``meta=`` is ignored
    tune_flag = ""
    auto_devices: ClassVar[frozenset[str] | None] = None  # any device: the fallback
    capabilities: ClassVar[frozenset[str]] = frozenset()

    def not_supported_reasons(self, kernel: str, device: torch.device, dtype: torch.dtype) -> list[str]:
        return []

    def tuning_device(self, device: torch.device) -> str:
        return str(device)

    def complete_params(
        self,
        kernel: str,
        dtype: torch.dtype,
        shape: tuple[int, int, int],
        blocksize: tuple[int, int],
        chosen: dict[str, Any],
    ) -> dict[str, Any]:
        return {}

    def addmm(
        self,
        a: Operand,
        dense: torch.Tensor,
        out: torch.Tensor,
        batch: torch.Size,
        alpha: float,
        overwrite: bool,
        params: dict[str, Any],
    ) -> None:
        crow, col, values, dense3, out3, copied = flatten_addmm(a, dense, out, batch)
        bsr_mm_into(crow, col, values, dense3, out3, alpha, overwrite)
        if copied:
            out.copy_(out3.view(out.shape))

    def sampled(
        self,
        a: Operand,
        mat1: torch.Tensor,
        mat2: torch.Tensor,
        batch: torch.Size,
        alpha: float,
        params: dict[str, Any],
    ) -> torch.Tensor:
        rows, cols = block_coordinates(a, batch)
        Ms, Ns = a.values.shape[-2:]
        return sampled_blocks(rows, cols, Ms, Ns, mat1, mat2, batch, alpha)

    def scatter_mm(
        self,
        blocks: torch.Tensor,
        others: torch.Tensor,
        indices_data: tuple[Any, ...],
        accumulators: torch.Tensor,
        params: dict[str, Any],
        overwrite: bool = False,
    ) -> None:
        if overwrite:
            accumulators.zero_()
        if not non_overlapping(accumulators):  # (an expanded one: torch writes none of its elements)
            sums = torch.zeros(accumulators.shape, dtype=accumulators.dtype, device=accumulators.device)
            self.scatter_mm(blocks, others, indices_data, sums, params)
            _add_into_shared(accumulators, sums)
            return
        if indices_data[0] == "scatter_mm":
            others3, acc3, copied = flatten_scatter_stacks(others, accumulators)
        else:
            others3, acc3, copied = flatten_strided_scatter(others, accumulators)
        scatter_mm_into(blocks, others3, indices_data, acc3)
        if copied:
            accumulators.copy_(acc3.view(accumulators.shape))

    def softmax(
        self,
        a: Operand,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        zero_empty_rows: bool,
    ) -> torch.Tensor:
        batch = x.shape[:-3]
        rows, _ = block_coordinates(a, batch)
        x3 = x.reshape(-1, *x.shape[-3:])
        bias3 = None if bias is None else bias.expand(x.shape).reshape(x3.shape)
        y = softmax_blocks(rows, a.M // x.shape[-2], x3, bias3, zero_empty_rows)
        return y.reshape(x.shape)

    def softmax_backward(self, a: Operand, y: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        rows, _ = block_coordinates(a, y.shape[:-3])
        y3 = y.reshape(-1, *y.shape[-3:])
        dx = softmax_backward_blocks(rows, a.M // y.shape[-2], y3, grad.reshape(y3.shape))
        return dx.reshape(y.shape)


# -- the block-row softmax (``TorchBackend.softmax``): segment reductions over each block row ---------


def _row_reduce(rows: torch.Tensor, MB: int, per_block: torch.Tensor, reduce: str) -> torch.Tensor:
    """``per_block (B, nnz, Ms)`` reduced over the blocks of each block row, gathered back per block."""
    B, nnz, Ms = per_block.shape
    index = rows[:, :, None].expand(B, nnz, Ms)
    init = -torch.inf if reduce == "amax" else 0.0
    per_row = torch.full((B, MB, Ms), init, dtype=per_block.dtype, device=per_block.device)
    per_row.scatter_reduce_(1, index, per_block, reduce, include_self=True)
    return per_row.gather(1, index)


def softmax_blocks(
    rows: torch.Tensor,  # (B, nnz) block row of each block
    MB: int,  # block rows
    x: torch.Tensor,  # (B, nnz, Ms, Ns)
    bias: torch.Tensor | None,  # (B, nnz, Ms, Ns) or None
    zero_empty_rows: bool,
) -> torch.Tensor:
    """Softmax over each row's stored entries (see ``Backend.softmax``), in x's dtype."""
    acc_dtype = accumulate_dtype(x.dtype)
    z = x.to(acc_dtype)
    if bias is not None:
        c = bias.to(acc_dtype)
        z = torch.where(c == -torch.inf, c, z + c)  # an excluded entry stays excluded, NaN or not
    m = _row_reduce(rows, MB, z.amax(-1), "amax")
    # A row of -inf only: shift by 0, so that exp gives 0 and the sum 0 (0 / 0 = NaN, as torch.softmax).
    m = torch.where(m == -torch.inf, 0.0, m)
    e = torch.exp(z - m[..., None])
    s = _row_reduce(rows, MB, e.sum(-1), "sum")
    if zero_empty_rows:
        s = torch.where(s == 0, 1.0, s)
    return (e / s[..., None]).to(x.dtype)


def softmax_backward_blocks(rows: torch.Tensor, MB: int, y: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``y * (grad - sum_row(grad * y))`` on (B, nnz, Ms, Ns) values, in y's dtype."""
    acc_dtype = accumulate_dtype(y.dtype)
    y32, g32 = y.to(acc_dtype), grad.to(acc_dtype)
    r = _row_reduce(rows, MB, (y32 * g32).sum(-1), "sum")
    return (y32 * (g32 - r[..., None])).to(y.dtype)
