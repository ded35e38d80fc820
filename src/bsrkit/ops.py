r"""Public products. Each validates its arguments, fetches cached plans, and hands tensors and plan to
one backend chosen by :func:`select_backend`; nothing else happens here.

Notation: ``bsr`` is a BSR tensor of shape ``(*Bb, M, K)`` with blocks ``(Ms, Ks)``; ``dense`` is strided
``(*Bd, K, N)``; batch dimensions broadcast to ``batch = broadcast(Bb, Bd)``.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any, NamedTuple

import numpy as np
import torch

from bsrkit import plans, tuning
from bsrkit.backends import torch_ops
from bsrkit.backends import triton as triton_backend
from bsrkit.backends.cpu import blas_layout
from bsrkit.keys import TensorKey
from bsrkit.validation import (
    broadcast_batch,
    check_bsr,
    check_out,
    check_same_device,
    check_same_dtype,
    check_strided,
)

__all__ = [
    "Operand",
    "bsr_dense_addmm",
    "bsr_dense_mm",
    "bsr_scatter_mm",
    "bsr_scatter_mm_indices_data",
    "bsr_transposed_dense_mm",
    "sampled_addmm",
    "scatter_mm",
    "select_backend",
]

BACKEND_ENV = "BSRKIT_BACKEND"
_BACKENDS = ("cpu", "torch", "triton")
_INDICES_FORMATS = ("bsr_strided_mm_compressed", "bsr_strided_mm", "scatter_mm")


class Operand(NamedTuple):
    """The sparse operand of a product, as parts: what every backend consumes.

    ``values`` is ``(*Bb, nnz, Ms, Ks)`` (for a transposed operand a strided view of the original's
    blocks); ``source`` is what its plans are cached on (see :mod:`bsrkit.plans`); a transposed operand has
    ``transposed_block_cols`` > 0 and borrows its source's plans.
    """

    crow: torch.Tensor
    col: torch.Tensor
    values: torch.Tensor
    M: int
    K: int
    source: Any
    transposed_block_cols: int = 0

    @property
    def batch(self) -> torch.Size:
        return self.values.shape[:-3]

    @property
    def nnz(self) -> int:
        return self.values.shape[-3]

    @classmethod
    def of(cls, bsr: torch.Tensor) -> Operand:
        M, K = bsr.shape[-2:]
        crow, col, values = bsr.crow_indices(), bsr.col_indices(), bsr.values()
        # The plans' cache key, from the members fetched here anyway (each accessor costs ~1 µs).
        return cls(crow, col, values, M, K, TensorKey(bsr, members=(crow, col, values)))

    def transposed(self) -> Operand:
        """The operand of ``bsr.mT``: the plan maps its blocks to the original's; no dense transpose."""
        Ks = self.values.shape[-1]
        t = plans.transpose_plan(self.source, self.K // Ks if Ks else 0)
        batch = self.batch
        flat = self.values.reshape(-1, *self.values.shape[-3:])
        gathered = flat[torch.arange(flat.shape[0])[:, None], t.perm]  # (B, nnz, Ms, Ks), a copy
        values_t = gathered.reshape(*batch, *gathered.shape[1:]).mT  # blocks (Ks, Ms), column-major
        crow_t = t.crow.reshape(*batch, -1)
        col_t = t.col.reshape(*batch, -1)
        return Operand(crow_t, col_t, values_t, self.K, self.M, self.source, self.K // Ks if Ks else 0)


def select_backend(op: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend for one call: ``"cpu"`` (compiled MKL kernel), ``"triton"`` (GPU kernels; CUDA tensors
    when triton is installed) or ``"torch"`` (torch primitives: every other case, e.g. CUDA without
    triton — the documented fallback).

    ``BSRKIT_BACKEND`` (``cpu``, ``torch`` or ``triton``) overrides the choice, for testing and comparison;
    ``triton`` on CPU tensors runs Triton's interpreter and needs ``TRITON_INTERPRET=1``.
    """
    forced = os.environ.get(BACKEND_ENV)
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(f"{op}(): expected ${BACKEND_ENV} in {_BACKENDS}, got {forced!r}")
        if forced == "triton":
            if not triton_backend.available():
                raise ValueError(f"{op}(): ${BACKEND_ENV}=triton needs the triton package (bsrkit[triton])")
            if device.type == "cpu" and not triton_backend.interpreting():
                raise ValueError(
                    f"{op}(): ${BACKEND_ENV}=triton on CPU tensors needs TRITON_INTERPRET=1 "
                    "(Triton's interpreter)"
                )
            return forced
        if forced == "cpu" and device.type != "cpu":
            raise ValueError(f"{op}(): ${BACKEND_ENV}=cpu needs CPU tensors, got device {device}")
        if forced == "cpu" and _cpu_kernel() is None:
            raise ValueError(
                f"{op}(): ${BACKEND_ENV}=cpu needs MKL's gemm exported by torch's CPU library, "
                "which this torch build lacks"
            )
        return forced
    if device.type == "cpu" and _cpu_kernel() is not None:
        return "cpu"
    if device.type == "cuda" and triton_backend.available():
        return "triton"
    return "torch"


_compiled: list[Any] = []  # the CPU kernel once looked up (None when unavailable): no import per call


def _cpu_kernel() -> Any:
    if not _compiled:
        from bsrkit.backends.cpu import bsr_mm_kernel

        _compiled.append(bsr_mm_kernel())
    return _compiled[0]


# -- the main products --------------------------------------------------------------------------------


def bsr_dense_mm(
    bsr: torch.Tensor,
    dense: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    meta: dict[str, Any] | None = None,
) -> torch.Tensor:
    r"""Block-sparse times dense: :math:`\mathrm{out}[b] = \mathrm{bsr}[b]\,\mathrm{dense}[b]`.

    Only stored blocks contribute: :math:`\mathrm{out}_{iM_s..,:} = \sum_{j \in \mathrm{row}\ i}
    V_{ij} \, \mathrm{dense}_{jK_s..,:}`. Any block shape, batch broadcasting, any strides of ``dense``
    and ``out``; float16/bfloat16 accumulate in float32. ``out`` (shape ``(*batch, M, N)``, dtype of
    ``dense``) is written in place and returned. ``meta`` overrides backend parameters (CPU: ``panel``,
    ``nthreads``).
    """
    if _needs_grad(bsr, dense):
        return _autograd_addmm("bsr_dense_mm", None, bsr, dense, 0.0, 1.0, out, meta)
    return _addmm("bsr_dense_mm", None, bsr, dense, beta=0.0, alpha=1.0, out=out, meta=meta)


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
    Not differentiable itself (it is the backward of :func:`bsr_dense_mm` w.r.t. ``dense``).
    """
    return _addmm(
        "bsr_transposed_dense_mm", None, bsr, dense, beta=0.0, alpha=1.0, out=out, meta=meta, transpose=True
    )


def _needs_grad(*tensors: Any) -> bool:
    # (non-tensors fall through to validation, which names them)
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _autograd_addmm(
    op: str,
    input: torch.Tensor | None,
    bsr: torch.Tensor,
    dense: torch.Tensor,
    beta: Any,
    alpha: Any,
    out: torch.Tensor | None,
    meta: dict[str, Any] | None,
) -> torch.Tensor:
    if out is not None:
        raise ValueError(
            f"{op}(): expected out=None when an argument requires grad (out= is not differentiable)"
        )
    from bsrkit.autograd import BsrDenseAddmm

    return BsrDenseAddmm.apply(op, input, bsr, dense, beta, alpha, meta)


def bsr_dense_addmm(
    input: torch.Tensor,
    bsr: torch.Tensor,
    dense: torch.Tensor,
    *,
    beta: float = 1,
    alpha: float = 1,
    out: torch.Tensor | None = None,
    meta: dict[str, Any] | None = None,
) -> torch.Tensor:
    r""":math:`\mathrm{out} = \beta\,\mathrm{input} + \alpha\,(\mathrm{bsr} @ \mathrm{dense})`.

    ``input`` broadcasts to ``(*batch, M, N)``. With ``beta == 0``, ``input`` is ignored (NaN in it does
    not propagate), as in ``torch.addmm``. Otherwise as :func:`bsr_dense_mm`.
    """
    check_strided("bsr_dense_addmm", "input", input, min_ndim=0)
    if _needs_grad(input, bsr, dense):
        return _autograd_addmm("bsr_dense_addmm", input, bsr, dense, beta, alpha, out, meta)
    return _addmm("bsr_dense_addmm", input, bsr, dense, beta=beta, alpha=alpha, out=out, meta=meta)


def _check_scalar(op: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}(): expected {name} to be a real number, got {type(value).__name__}")
    return float(value)


def _addmm(
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
) -> torch.Tensor:
    """Validate, then ``out = beta * input + alpha * op(bsr) @ dense`` with op = transpose or identity."""
    beta = _check_scalar(op, "beta", beta)
    alpha = _check_scalar(op, "alpha", alpha)
    check_bsr(op, "bsr", bsr)
    check_strided(op, "dense", dense)
    check_same_dtype(op, "dense", dense, "bsr", bsr)
    check_same_device(op, "dense", dense, "bsr", bsr)
    backend = select_backend(op, bsr.device, bsr.dtype)  # here, so a bad override fails on every input
    M, K = bsr.shape[-2:]
    if transpose:
        M, K = K, M
    if dense.shape[-2] != K:
        where = "bsr.shape[-2]" if transpose else "bsr.shape[-1]"
        raise ValueError(f"{op}(): expected dense.shape[-2] == {K} ({where}), got {dense.shape[-2]}")
    N = dense.shape[-1]
    batch = broadcast_batch(op, ("bsr", "dense"), (bsr.shape[:-2], dense.shape[:-2]))
    out_shape = (*batch, M, N)
    if input is not None:
        check_same_dtype(op, "input", input, "bsr", bsr)
        check_same_device(op, "input", input, "bsr", bsr)
        try:
            ok = torch.broadcast_shapes(input.shape, out_shape) == out_shape
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"{op}(): expected input.shape to broadcast to {out_shape}, got {tuple(input.shape)}"
            )
    if out is None:
        out = torch.empty(out_shape, dtype=dense.dtype, device=dense.device)
    else:
        check_out(op, out, out_shape, dense.dtype, dense.device)
        if (
            out.numel()
            and dense.numel()
            and out.untyped_storage().data_ptr() == dense.untyped_storage().data_ptr()
        ):
            # The kernels read dense while writing out: shared memory would give a silently wrong result.
            raise ValueError(f"{op}(): expected out not to share memory with dense, got overlapping tensors")
    if meta is not None and not isinstance(meta, dict):
        raise TypeError(f"{op}(): expected meta to be a dict or None, got {type(meta).__name__}")

    # out := beta * input first; the kernel then accumulates (or, with beta == 0, overwrites).
    overwrite = input is None or beta == 0
    if not overwrite:
        assert input is not None
        if not _same_view(input, out):
            out.copy_(input.expand(out_shape))
        if beta != 1:
            out.mul_(beta)
    if out.numel() == 0:
        return out
    if K == 0 or bsr._nnz() == 0 or alpha == 0:
        if overwrite:
            out.zero_()
        return out

    a = Operand.of(bsr)
    run_product(op, backend, a.transposed() if transpose else a, dense, out, batch, alpha, overwrite, meta)
    return out


def run_product(
    op: str,
    backend: str,
    a: Operand,
    dense: torch.Tensor,
    out: torch.Tensor,
    batch: torch.Size,
    alpha: float,
    overwrite: bool,
    meta: dict[str, Any] | None,
) -> None:
    """``out (+)= alpha * a @ dense`` on validated, non-empty arguments: the one call into a backend."""
    if backend == "cpu":
        _cpu_addmm(op, a, dense, out, batch, alpha, overwrite, meta)
    elif backend == "triton":
        _triton_addmm(op, a, dense, out, batch, alpha, overwrite, meta)
    else:
        _torch_addmm(a, dense, out, batch, alpha, overwrite)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _batch_offsets(t: torch.Tensor, t_batch_ndim: int, batch: torch.Size) -> np.ndarray:
    """Element offset (from the storage start) of each flattened index of ``batch``, for ``t`` whose
    first ``t_batch_ndim`` dimensions broadcast to ``batch``. No copies: broadcast dims add 0."""
    nd = len(batch)
    if t_batch_ndim == 0:
        if nd == 0:  # the common unbatched call: the cheapest array numpy makes
            return np.array((t.storage_offset(),), dtype=np.int64)
        return np.full(math.prod(batch), t.storage_offset(), dtype=np.int64)
    offsets = np.full(tuple(batch), t.storage_offset(), dtype=np.int64)
    lead = nd - t_batch_ndim
    for d in range(t_batch_ndim):
        size = t.shape[d]
        if size == 1:
            continue
        view = [1] * nd
        view[lead + d] = size
        offsets = offsets + (np.arange(size, dtype=np.int64) * t.stride(d)).reshape(view)
    return np.ascontiguousarray(offsets.reshape(-1))


def _blas_operand(t: torch.Tensor) -> tuple[torch.Tensor, bool, int]:
    """``t`` (a stack of matrices) with a layout BLAS can read, copying only when it cannot."""
    rows, cols = t.shape[-2:]
    layout = blas_layout(t.stride(-2), t.stride(-1), rows, cols)
    if layout is None:
        t = t.contiguous()
        layout = blas_layout(t.stride(-2), t.stride(-1), rows, cols)
        assert layout is not None
    return t, layout[0], layout[1]


# numba's default (workqueue) threading layer must not be entered from two threads at once; the kernel
# already uses every worker thread, so serialising calls costs little.
_KERNEL_LOCK = threading.Lock()

_numba_threads = threading.local()  # numba's thread count is per calling thread: remember what we set


def _set_numba_threads(n: int) -> None:
    if getattr(_numba_threads, "n", None) != n:
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
        _numba_threads.n = n


_KINDS = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}


def _cpu_addmm(
    op: str,
    a: Operand,
    dense: torch.Tensor,
    out: torch.Tensor,
    batch: torch.Size,
    alpha: float,
    overwrite: bool,
    meta: dict[str, Any] | None,
) -> None:
    kernel = _cpu_kernel()
    M = a.M
    N = dense.shape[-1]
    values = a.values
    Ms, Ks = values.shape[-2:]
    params = tuning.cpu_mm_meta(op, out.dtype, (M, a.K, N), (Ms, Ks), meta)
    nthreads = params["nthreads"]
    plan = plans.cpu_mm_plan(a.source, a.transposed_block_cols)
    values, a_rowmajor, lda = _blas_operand(values)
    dense, b_rowmajor, ldb = _blas_operand(dense)

    half = out.dtype in (torch.float16, torch.bfloat16)
    if half:  # accumulate in a float32 buffer, written back once
        target = torch.empty(out.shape, dtype=torch.float32) if overwrite else out.float()
    else:
        target = out
    target_layout = blas_layout(target.stride(-2), target.stride(-1), M, N)
    if target_layout is None or (half and not target_layout[0]):  # half gemm writes row-major only
        target = target.contiguous()
        target_layout = blas_layout(target.stride(-2), target.stride(-1), M, N)
        assert target_layout is not None

    bsr_batch = a.batch
    n_bsr = math.prod(bsr_batch)
    if not batch:
        bsr_of = np.zeros(1, dtype=np.int64)
    elif bsr_batch == batch:
        bsr_of = np.arange(n_bsr, dtype=np.int64)
    else:
        bsr_of = np.ascontiguousarray(
            np.broadcast_to(np.arange(n_bsr, dtype=np.int64).reshape(bsr_batch), batch).reshape(-1)
        )
    a_boff = _batch_offsets(values, values.ndim - 3, bsr_batch)
    isz_ab = values.element_size()
    args = (
        _KINDS[out.dtype], plan.crow, plan.col, plan.cost, bsr_of, nthreads,
        values.data_ptr() - values.storage_offset() * isz_ab, a_boff, values.stride(-3),
        a_rowmajor, lda,
        dense.data_ptr() - dense.storage_offset() * isz_ab, _batch_offsets(dense, dense.ndim - 2, batch),
        b_rowmajor, dense.stride(-2), dense.stride(-1), ldb,
        target.data_ptr() - target.storage_offset() * target.element_size(),
        _batch_offsets(target, target.ndim - 2, batch), target.stride(-2), target.stride(-1),
        target_layout[0], target_layout[1],
        Ms, Ks, N, params["panel"], alpha, overwrite, isz_ab, target.element_size(),
    )  # fmt: skip
    with _KERNEL_LOCK:
        _set_numba_threads(nthreads)
        kernel(*args)
    if target is not out:
        out.copy_(target)


def _flatten_batch(
    a: Operand, dense: torch.Tensor, out: torch.Tensor, batch: torch.Size
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(crow, col, values, dense, out) with the batch flattened to one dim, for the backends that take
    3-D operands. Broadcast dims become stride-0 views; copies only where no view exists. The last item
    says whether ``out`` had to be copied (the caller writes it back with ``out.copy_``)."""
    B, M, K, N = math.prod(batch), a.M, a.K, dense.shape[-1]
    crow = a.crow.expand(*batch, a.crow.shape[-1]).reshape(B, a.crow.shape[-1])
    col = a.col.expand(*batch, a.nnz).reshape(B, a.nnz)
    values = a.values.expand(*batch, *a.values.shape[-3:]).reshape(B, *a.values.shape[-3:])
    dense3 = dense.expand(*batch, K, N).reshape(B, K, N)
    out3, copied = _as_3d(out, (B, M, N))
    return crow, col, values, dense3, out3, copied


def _as_3d(t: torch.Tensor, shape: tuple[int, int, int]) -> tuple[torch.Tensor, bool]:
    """A view of ``t`` with ``shape``, or a copy (and True) when the batch dims cannot be viewed flat."""
    if _viewable3(t):
        return t.view(shape), False
    return t.reshape(shape).clone(), True


def _torch_addmm(
    a: Operand,
    dense: torch.Tensor,
    out: torch.Tensor,
    batch: torch.Size,
    alpha: float,
    overwrite: bool,
) -> None:
    crow, col, values, dense3, out3, copied = _flatten_batch(a, dense, out, batch)
    torch_ops.bsr_mm_into(crow, col, values, dense3, out3, alpha, overwrite)
    if copied:
        out.copy_(out3.view(out.shape))


def _triton_addmm(
    op: str,
    a: Operand,
    dense: torch.Tensor,
    out: torch.Tensor,
    batch: torch.Size,
    alpha: float,
    overwrite: bool,
    meta: dict[str, Any] | None,
) -> None:
    from bsrkit.backends.triton import kernels

    Ms, Ks = a.values.shape[-2:]
    params = tuning.triton_meta(op, out.device, out.dtype, (a.M, a.K, dense.shape[-1]), (Ms, Ks), meta)
    crow, col, values, dense3, out3, copied = _flatten_batch(a, dense, out, batch)
    kernels.bsr_dense_addmm(crow, col, values, dense3, out3, alpha, overwrite, params)
    if copied:
        out.copy_(out3.view(out.shape))


def _viewable3(t: torch.Tensor) -> bool:
    try:
        t.view(-1, *t.shape[-2:])
    except RuntimeError:
        return False
    return True


# -- scatter_mm and its indices data ----------------------------------------------------------------


def bsr_scatter_mm_indices_data(
    bsr: torch.Tensor,
    other: torch.Tensor,
    indices_format: str = "bsr_strided_mm_compressed",
    **meta_input: Any,
) -> tuple[Any, ...]:
    """Indices data for :func:`scatter_mm` computing ``bsr @ other`` (layout identical to torch's).

    Computed with vectorized torch ops and cached in the shared plan cache, keyed on ``bsr``'s indices
    (the entry lives exactly as long as ``bsr``). For the ``bsr_strided_mm*`` formats the last item is
    the meta dict (``SPLIT_N``, ``is_compressed``).
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
    if indices_format == "scatter_mm":
        if N % Ms:
            raise ValueError(
                f"{op}(): the 'scatter_mm' format needs other.shape[-1] divisible by the block "
                f"height {Ms}, got {N}"
            )
        return plans.scatter_mm_indices(bsr, indices_format, N, nbatches, 0)
    meta = tuning.scatter_mm_meta(M, K, N, Ms, Ks, **meta_input)
    data = plans.scatter_mm_indices(bsr, indices_format, N, 0, meta["SPLIT_N"])
    meta["is_compressed"] = indices_format == "bsr_strided_mm_compressed"
    return (*data, meta)


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

    ``accumulators`` is accumulated into and returned; when None, a zero tensor is created.
    """
    op = "scatter_mm"
    check_strided(op, "blocks", blocks, min_ndim=3)
    check_strided(op, "others", others)
    if blocks.ndim != 3:
        raise ValueError(f"{op}(): expected blocks to be 3-D (P, Ms, Ks), got shape {tuple(blocks.shape)}")
    check_same_dtype(op, "others", others, "blocks", blocks)
    check_same_device(op, "others", others, "blocks", blocks)
    if not isinstance(indices_data, tuple) or not indices_data or indices_data[0] not in _INDICES_FORMATS:
        got = indices_data[0] if isinstance(indices_data, tuple) and indices_data else indices_data
        raise ValueError(
            f"{op}(): expected indices_data[0] (the indices format) in {_INDICES_FORMATS}, got {got!r}"
        )
    fmt = indices_data[0]
    _, Ms, Ks = blocks.shape
    if fmt == "scatter_mm":
        if others.ndim != 3 or others.shape[1] != Ks:
            raise ValueError(f"{op}(): expected others of shape (Q, {Ks}, Ns), got {tuple(others.shape)}")
        R = indices_data[1].numel() - 1
        acc_shape: tuple[int, ...] = (R, Ms, others.shape[2])
        others3 = others
    else:
        K, N = others.shape[-2:]
        if K % Ks:
            raise ValueError(f"{op}(): expected others.shape[-2] divisible by Ks == {Ks}, got {K}")
        r_offsets = indices_data[2]
        M = Ms + int(r_offsets.max()) // N if r_offsets.numel() else Ms
        M = accumulators.shape[-2] if accumulators is not None else M
        acc_shape = (*others.shape[:-2], M, N)
        others3 = others.reshape(-1, K, N)
    if accumulators is None:
        accumulators = torch.zeros(acc_shape, dtype=blocks.dtype, device=blocks.device)
    else:
        check_out(op, accumulators, acc_shape, blocks.dtype, blocks.device)
    backend = select_backend(op, blocks.device, blocks.dtype)
    if backend == "triton":
        from bsrkit.backends.triton import kernels

        params = tuning.triton_meta(op, blocks.device, blocks.dtype, (Ms, Ks, others.shape[-1]), (Ms, Ks), {})
        run = lambda acc: kernels.scatter_mm_into(blocks, others3, indices_data, acc, params)  # noqa: E731
    else:
        run = lambda acc: torch_ops.scatter_mm_into(blocks, others3, indices_data, acc)  # noqa: E731
    if fmt == "scatter_mm":
        run(accumulators)
    else:
        target, copied = _as_3d(accumulators, (math.prod(acc_shape[:-2]), acc_shape[-2], acc_shape[-1]))
        run(target)
        if copied:
            accumulators.copy_(target.view(acc_shape))
    return accumulators


def bsr_scatter_mm(
    bsr: torch.Tensor,
    other: torch.Tensor,
    indices_data: tuple[Any, ...] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``bsr @ other`` for a 2-D ``bsr``, through ``indices_data`` when given (see :func:`scatter_mm`).

    Without ``indices_data`` this is :func:`bsr_dense_mm` (the fastest path for the device).
    """
    op = "bsr_scatter_mm"
    check_bsr(op, "bsr", bsr)
    if bsr.ndim != 2:
        raise ValueError(f"{op}(): expected a 2-D bsr (no batch dimensions), got shape {tuple(bsr.shape)}")
    if indices_data is None:
        return _addmm(op, None, bsr, other, beta=0.0, alpha=1.0, out=out, meta=None)
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
    out.zero_()
    if bsr._nnz() == 0 or out.numel() == 0:
        return out
    fmt = indices_data[0] if isinstance(indices_data, tuple) and indices_data else None
    if fmt == "scatter_mm":
        Ms, Ks = bsr.values().shape[-2:]
        nb = math.prod(other.shape[:-2])
        # Tiles of other (Ks x Ms) and of out (Ms x Ms), in the order the "scatter_mm" indices use.
        others = other.reshape(nb, K // Ks, Ks, N // Ms, Ms).permute(0, 1, 3, 2, 4).reshape(-1, Ks, Ms)
        acc = scatter_mm(bsr.values(), others, indices_data)
        tiles = acc.view(nb, M // Ms, N // Ms, Ms, Ms).permute(0, 1, 3, 2, 4).reshape(out_shape)
        out.copy_(tiles)
        return out
    return scatter_mm(bsr.values(), other, indices_data, accumulators=out)


# -- sampled dense-dense products (SDDMM) ------------------------------------------------------------


def sampled_addmm(
    input: torch.Tensor,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    *,
    beta: float = 1.0,
    alpha: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""``beta * input + alpha * (mat1 @ mat2)`` evaluated only at ``input``'s stored blocks.

    For each stored block :math:`(i, j)` of the BSR ``input`` (blocks ``(Ms, Ns)``):
    :math:`V_{ij} \leftarrow \beta V_{ij} + \alpha\, \mathrm{mat1}_{iM_s..,:}\, \mathrm{mat2}_{:, jN_s..}`.
    ``mat1`` is ``(*B1, M, K)``, ``mat2`` ``(*B2, K, N)``; batch dims broadcast with ``input``'s. The
    result is a BSR tensor with ``input``'s indices (``out``, if given, must be such a tensor: its values
    are written). With ``beta == 0`` the input values are ignored. Half types are computed in float32.
    """
    op = "sampled_addmm"
    beta = _check_scalar(op, "beta", beta)
    alpha = _check_scalar(op, "alpha", alpha)
    check_bsr(op, "input", input)
    for name, t in (("mat1", mat1), ("mat2", mat2)):
        check_strided(op, name, t)
        check_same_dtype(op, name, t, "input", input)
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
    values = sampled_values(Operand.of(input), mat1, mat2, batch, alpha)
    if beta != 0:
        in_values = input.values()
        values.add_(in_values.expand(*batch, *in_values.shape[-3:]), alpha=beta)
    crow = input.crow_indices().expand(*batch, -1)
    col = input.col_indices().expand(*batch, -1)
    if out is not None:
        check_bsr(op, "out", out)
        if out.shape != (*batch, M, N) or out.values().shape != values.shape:
            raise ValueError(
                f"{op}(): expected out to be a BSR tensor of shape {(*batch, M, N)} with values of shape "
                f"{tuple(values.shape)}, got shape {tuple(out.shape)} and values {tuple(out.values().shape)}"
            )
        if out.dtype != input.dtype:
            raise TypeError(f"{op}(): expected out.dtype == {input.dtype}, got {out.dtype}")
        out.values().copy_(values)
        return out
    return torch.sparse_bsr_tensor(
        crow.contiguous(), col.contiguous(), values, size=(*batch, M, N), check_invariants=False
    )


def sampled_values(
    a: Operand, mat1: torch.Tensor, mat2: torch.Tensor, batch: torch.Size, alpha: float
) -> torch.Tensor:
    """``alpha * (mat1 @ mat2)`` at ``a``'s blocks: values of shape ``(*batch, nnz, Ms, Ns)``."""
    Ms, Ns = a.values.shape[-2:]
    rows = plans.block_rows(a.source)  # (Bb, nnz)
    nb = math.prod(batch)
    nnz = a.nnz
    rows_b = rows.reshape(*a.batch, nnz).expand(*batch, nnz).reshape(nb, nnz)
    cols_b = a.col.to(torch.int64).expand(*batch, nnz).reshape(nb, nnz)
    backend = select_backend("sampled_addmm", mat1.device, mat1.dtype)
    if backend == "cpu" and rows_b.numel() and mat1.shape[-1]:
        values = _cpu_sampled(rows_b, cols_b, Ms, Ns, mat1, mat2, batch, alpha)
    elif backend == "triton":
        from bsrkit.backends.triton import kernels

        M, K = mat1.shape[-2:]
        N = mat2.shape[-1]
        params = tuning.triton_meta("sampled_addmm", mat1.device, mat1.dtype, (M, K, N), (Ms, Ns), None)
        mat1_3 = mat1.expand(*batch, M, K).reshape(nb, M, K)
        mat2_3 = mat2.expand(*batch, K, N).reshape(nb, K, N)
        values = kernels.sampled_blocks(rows_b, cols_b, Ms, Ns, mat1_3, mat2_3, alpha, params)
    else:
        values = torch_ops.sampled_blocks(rows_b, cols_b, Ms, Ns, mat1, mat2, batch, alpha)
    return values.reshape(*batch, *values.shape[1:])


def _cpu_sampled(
    rows: torch.Tensor,
    cols: torch.Tensor,
    Ms: int,
    Ns: int,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    batch: torch.Size,
    alpha: float,
) -> torch.Tensor:
    """The SDDMM on the MKL kernel: one gemm per block straight from the strided operands."""
    from bsrkit.backends.cpu import sampled_kernel

    kernel = sampled_kernel()
    mat1, a_rowmajor, lda = _blas_operand(mat1)
    mat2, b_rowmajor, ldb = _blas_operand(mat2)
    B, nnz = rows.shape
    half = mat1.dtype in (torch.float16, torch.bfloat16)
    out = torch.empty((B, nnz, Ms, Ns), dtype=torch.float32 if half else mat1.dtype)
    isz = mat1.element_size()
    nthreads = max(1, torch.get_num_threads())
    args = (
        _KINDS[mat1.dtype], rows.numpy(), cols.numpy(), nthreads,
        mat1.data_ptr() - mat1.storage_offset() * isz, _batch_offsets(mat1, mat1.ndim - 2, batch),
        mat1.stride(-2), a_rowmajor, lda,
        mat2.data_ptr() - mat2.storage_offset() * isz, _batch_offsets(mat2, mat2.ndim - 2, batch),
        mat2.stride(-1), b_rowmajor, ldb,
        out.data_ptr(), Ms, Ns, mat1.shape[-1], alpha, isz, out.element_size(),
    )  # fmt: skip
    with _KERNEL_LOCK:
        _set_numba_threads(nthreads)
        kernel(*args)
    return out.to(mat1.dtype) if half else out
