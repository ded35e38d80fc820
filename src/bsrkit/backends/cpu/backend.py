"""The CPU backend: marshals validated tensors into the compiled kernels' arguments.

Every operand reaches a kernel as (address of its storage, per-batch element offsets, strides) with a
layout BLAS can read (unit stride along one dimension), copying only when it has none. float16/bfloat16
accumulate in a float32 buffer. Kernel calls are serialised and run on ``params["nthreads"]`` numba threads
(:mod:`.running`, which also makes the prepared calls returned here).
"""

from __future__ import annotations

import functools
import math
import os
import platform
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

import bsrkit.backends.cpu.attention_kernels as attention_kernels
import bsrkit.backends.cpu.kernels as kernels
import bsrkit.backends.cpu.planning as planning
import bsrkit.backends.cpu.running as running
import bsrkit.backends.cpu.softmax_kernels as softmax_kernels
from bsrkit.backends.base import ParamSpec, int_at_least_one
from bsrkit.backends.batching import block_coordinates, bsr_batch_of, host_array, needs_torch_scatter
from bsrkit.backends.torch_ops import TorchBackend
from bsrkit.validation import data_address, storage_address

if TYPE_CHECKING:
    from bsrkit.backends.cpu.compiled.gemm import BsrMMArgs
    from bsrkit.backends.cpu.compiled.sampled import SampledArgs
    from bsrkit.backends.cpu.compiled.scatter import ScatterMMArgs
    from bsrkit.backends.cpu.compiled.small import BsrMMSmallArgs
    from bsrkit.mask_bias import BlockBias
    from bsrkit.operand import Operand

__all__ = ["CpuBackend", "cpu_device_name"]

_run = running.run
Rerun = running.Rerun

_KINDS = {
    torch.float32: kernels.KIND_F32,
    torch.float64: kernels.KIND_F64,
    torch.bfloat16: kernels.KIND_BF16,
    torch.float16: kernels.KIND_F16,
}

# Output panel width (columns) per gemm call. Measured (docs/performance.md): 128-512 are within noise
# of each other at n = 2048-4096; 256 keeps a (K x 256) float32 dense panel of a 32-wide block column
# in L2 and gives each gemm enough columns to amortise its call.
_DEFAULT_PANEL = 256

# Below this many multiply-adds a product runs on the calling thread: starting numba's worker threads
# costs ~0.1-0.2 ms per call (measured with the workqueue layer), about what 2**21 multiply-adds take.
# Only the default thread count obeys it: a count from the tuning table or ``meta`` is the caller's (see
# :func:`_threads`).
_SERIAL_WORK = 2**21


def _threads(params: Mapping[str, Any], work: int) -> int:
    """The worker threads of a product of ``work`` multiply-adds: one below the serial cut-off when
    ``params`` hold the default count (``serial_below``, set by :meth:`CpuBackend.complete_params`), else
    ``params["nthreads"]`` (a tuned or given count was measured or asked for at this shape: kept)."""
    return 1 if work < params.get("serial_below", 0) else params["nthreads"]


# Up to this many columns bsr_dense_mm takes the vector loops (kernels.bsr_mm_small_kernel) instead of
# a gemm per block: measured in docs/performance.md (benchmarks/decode.py). ``meta={"small_n": bool}``
# forces either path (float32/float64; half types always take the gemm path).
_SMALL_N_MAX = 16


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


# gemm's integer arguments are 32-bit (LP64): a larger leading dimension would be truncated.
_LD_MAX = 2**31 - 1


def _layout(t: torch.Tensor) -> tuple[bool, int] | None:
    """(row_major, leading dimension) under which 32-bit BLAS can address ``t``'s matrices, or None."""
    rows, cols = t.shape[-2:]
    layout = kernels.blas_layout(t.stride(-2), t.stride(-1), rows, cols)
    return layout if layout is not None and layout[1] <= _LD_MAX else None


def _blas_operand(t: torch.Tensor, row_major_only: bool = False) -> tuple[torch.Tensor, bool, int]:
    """``t`` (a stack of matrices) with a layout BLAS can read, copying only when it has none (no unit
    stride, or a leading dimension beyond 32 bits)."""
    layout = _layout(t)
    if layout is None or (row_major_only and not layout[0]):
        t = t.contiguous()
        layout = _layout(t)
        if layout is None:
            raise ValueError(
                f"a matrix of {t.shape[-1]} columns exceeds the 32-bit leading dimension of the CPU "
                "backend's BLAS; use BSRKIT_BACKEND=torch"
            )
    return t, layout[0], layout[1]


@functools.cache
def _machine_threads() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@functools.cache
def cpu_device_name() -> str:
    """A stable name for this CPU model (the tuning table's device key)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return "cpu:" + name


_TORCH = TorchBackend()


def _tiled_stacks(others: torch.Tensor, accumulators: torch.Tensor) -> bool:
    """Whether ``others (B, KB, NB, Ks, Ns)`` and ``accumulators (B, MB, NB, Ms, Ns)`` are the tiles of
    batched ``(KB * Ks, NB * Ns)`` and ``(MB * Ms, NB * Ns)`` matrices (``bsr_scatter_mm``'s views):
    then side-by-side tiles can be one gemm."""
    if others.ndim != 5 or accumulators.ndim != 5 or others.shape[2] != accumulators.shape[2]:
        return False
    return all(
        t.stride(2) == t.shape[4] * t.stride(4) and t.stride(1) == t.shape[3] * t.stride(3)
        for t in (others, accumulators)
    )


def _untiled(t: torch.Tensor) -> torch.Tensor:
    """The ``(B, R * rows, C * cols)`` matrices whose tiles a :func:`_tiled_stacks` operand views."""
    B, R, C, rows, cols = t.shape
    return t.as_strided((B, R * rows, C * cols), (t.stride(0), t.stride(3), t.stride(4)), t.storage_offset())


def _addmm_small(
    a: Operand,
    dense: torch.Tensor,
    out: torch.Tensor,
    batch: torch.Size,
    alpha: float,
    overwrite: bool,
    params: Mapping[str, Any],
) -> Rerun | None:
    """``addmm`` on the vector loops for few columns (see :func:`kernels.bsr_mm_small_kernel`): dense is
    copied (zero-padded) into the layout they read unless it has it already, into a buffer that the
    prepared call keeps and fills on each rerun; blocks and out are never copied."""
    values = a.values
    kernel = kernels.bsr_mm_small_kernel()
    plan = a.plan("cpu_mm", a.transposed_block_cols)
    N = dense.shape[-1]
    Ms, Ks = values.shape[-2:]
    K = dense.shape[-2]
    lanes = 8 if out.dtype == torch.float32 else 4
    # Dot products along k for one column (or up to four, when that is under a vector's width).
    along_k = (N == 1 or lanes // 2 >= N) and Ks % lanes == 0 and (values.stride(-1) == 1 or Ks == 1)
    fill = None  # (dense into x, when x is a copy: see running.prepared)
    if along_k and N == 2 and dense.stride(-1) == 1 and dense.stride(-2) == 2:
        # Row-major (.., K, 2): the two-column loop reads it as it is (no copy), splitting each load into
        # its two columns.
        dot, width, x, x_ld = kernels.DOT_PAIRS, 2, dense, 2
    elif along_k:
        dot = kernels.DOT_COLUMNS
        width = N if N <= 2 else 4  # (a loop each for 1, 2 and 4 columns)
        x = dense.mT  # (.., Wp, K) rows contiguous along k
        if not (width == N and (x.stride(-1) == 1 or K == 1)):
            x = _kept_buffer(dense, (*dense.shape[:-2], width, K))
            fill = _filler(x[..., :N, :], transposed=True)
        x_ld = x.stride(-2) if width > 1 else K
    else:
        dot = kernels.DOT_NONE
        width = -(-N // lanes) * lanes
        x = dense  # (.., K, Wp) rows contiguous along the columns
        if not (width == N and x.stride(-1) == 1):
            x = _kept_buffer(dense, (*dense.shape[:-2], K, width))
            fill = _filler(x[..., :N], transposed=False)
        x_ld = x.stride(-2)
    nthreads = _threads(params, math.prod(batch) * a.nnz * Ms * Ks * max(N, 4))
    crow_live, col_live, live_wide = running.live_indices(a, plan.crow, plan.col)
    Args: type[BsrMMSmallArgs] = kernel.Args
    args = Args(
        kind=_KINDS[out.dtype], crow=plan.crow, col=plan.col, cum=plan.cost,
        bsr_of=bsr_batch_of(a.batch, batch), nthreads=nthreads,
        a_addr=storage_address(values), a_boff=_batch_offsets(values, values.ndim - 3, a.batch),
        a_gs=values.stride(-3), a_rs=values.stride(-2), a_cs=values.stride(-1),
        x_addr=storage_address(x), x_boff=_batch_offsets(x, x.ndim - 2, batch), x_ld=x_ld, dot=dot,
        c_addr=storage_address(out), c_boff=_batch_offsets(out, out.ndim - 2, batch),
        c_rs=out.stride(-2), c_cs=out.stride(-1),
        Ms=Ms, Ks=Ks, N=N, Wp=width, alpha=alpha, overwrite=overwrite,
        proof=np.zeros(2, np.int64), crow_live=crow_live, col_live=col_live, live_wide=live_wide,
    )  # fmt: skip
    full_args = kernel.prepare(args)
    rerun = running.prepared(kernel, full_args, values, dense, out, fill)
    rerun(values, dense, out)
    if fill is not None and x.numel() * x.element_size() > _KEPT_COPY_MAX_BYTES:
        return None  # (a kept call would keep its copy of dense alive with it: computed afresh next time)
    return rerun


# The largest copy of dense a prepared call of the vector loops keeps (and refills on each rerun): a
# decode step's columns (K floats) are far below; a large batch of few columns is copied per call instead
# of being held, up to 16 times per pattern, for as long as the pattern lives.
_KEPT_COPY_MAX_BYTES = 2**20


def _kept_buffer(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Zeros of ``shape`` in ``like``'s dtype and device that a prepared call keeps and refills on later
    calls: never an inference tensor (made in ``torch.inference_mode()``, a later call outside it could
    not write it)."""
    with torch.inference_mode(False):
        return like.new_zeros(shape)


def _filler(xs: torch.Tensor, transposed: bool) -> Callable[[torch.Tensor], None]:
    """``fill(dense)``: dense (transposed: ``dense.mT``) copied into ``xs``, the columns of a kept X."""

    def fill(dense: torch.Tensor) -> None:
        xs.copy_(dense.mT if transposed else dense)

    return fill


class CpuBackend:
    """Compiled numba loops calling the BLAS gemm that torch links (MKL), one gemm per (block, panel)."""

    name = "cpu"
    display_name = "CPU"
    param_schema: ClassVar[Mapping[str, ParamSpec]] = {
        "panel": int_at_least_one,
        "nthreads": int_at_least_one,
        "small_n": ParamSpec(lambda v: isinstance(v, bool), "a bool"),
    }
    tune_flag = ""
    auto_devices: ClassVar[frozenset[str] | None] = frozenset({"cpu"})
    capabilities: ClassVar[frozenset[str]] = frozenset({"fused_attention"})

    def not_supported_reasons(self, kernel: str, device: torch.device, dtype: torch.dtype) -> list[str]:
        reasons = []
        if device.type != "cpu":
            reasons.append(f"needs CPU tensors, got device {device}")
        if kernel != "softmax":  # (the softmax loops need no BLAS)
            kinds = kernels.supported_kinds()  # finds the BLAS entry points; compiles nothing
            if not kinds:
                reasons.append("needs a BLAS gemm: torch's MKL, or SciPy's (pip install scipy)")
            elif _KINDS.get(dtype) not in kinds:
                reasons.append(f"has no {dtype} gemm in this BLAS (SciPy's has float32 and float64 only)")
        return reasons

    def tuning_device(self, device: torch.device) -> str:
        return cpu_device_name()

    def complete_params(
        self,
        kernel: str,
        dtype: torch.dtype,
        shape: tuple[int, int, int],
        blocksize: tuple[int, int],
        chosen: dict[str, Any],
    ) -> dict[str, Any]:
        params = {"panel": _DEFAULT_PANEL, "nthreads": max(1, torch.get_num_threads()), **chosen}
        if "nthreads" not in chosen:
            params["serial_below"] = _SERIAL_WORK
        if kernel != "scatter_mm":  # (its tiles may join wider than shape[2])
            params["panel"] = min(params["panel"], max(shape[2], 1))
        # More workers than cores only adds scheduling (2**31 of them would never finish starting).
        params["nthreads"] = min(params["nthreads"], _machine_threads())
        return params

    def addmm(
        self,
        a: Operand,
        dense: torch.Tensor,
        out: torch.Tensor,
        batch: torch.Size,
        alpha: float,
        overwrite: bool,
        params: dict[str, Any],
    ) -> Rerun | None:
        """See :meth:`bsrkit.backends.base.Backend.addmm`; returns the call kept for reuse, if any."""
        N = dense.shape[-1]
        if out.dtype in (torch.float32, torch.float64) and params.get("small_n", N <= _SMALL_N_MAX):
            return _addmm_small(a, dense, out, batch, alpha, overwrite, params)
        kernel = kernels.bsr_mm_kernel()
        plan = a.plan("cpu_mm", a.transposed_block_cols)
        values = a.values
        Ms, Ks = values.shape[-2:]
        values, a_rowmajor, lda = _blas_operand(values)
        original_dense = dense
        dense, b_rowmajor, ldb = _blas_operand(dense)

        half = out.dtype in (torch.float16, torch.bfloat16)
        if half:  # accumulate in a float32 buffer, written back once
            target = torch.empty(out.shape, dtype=torch.float32) if overwrite else out.float()
        else:
            target = out
        # (written through a copy when gemm cannot address it; the half gemm writes row-major only)
        target, c_rowmajor, ldc = _blas_operand(target, row_major_only=half)

        nthreads = _threads(params, math.prod(batch) * a.nnz * Ms * Ks * N)
        crow_live, col_live, live_wide = running.live_indices(a, plan.crow, plan.col)
        Args: type[BsrMMArgs] = kernel.Args
        args = Args(
            kind=_KINDS[out.dtype], crow=plan.crow, col=plan.col, cum=plan.cost,
            bsr_of=bsr_batch_of(a.batch, batch), nthreads=nthreads,
            a_addr=storage_address(values), a_boff=_batch_offsets(values, values.ndim - 3, a.batch),
            a_gs=values.stride(-3), a_rowmajor=a_rowmajor, lda=lda,
            b_addr=storage_address(dense), b_boff=_batch_offsets(dense, dense.ndim - 2, batch),
            b_rowmajor=b_rowmajor, b_rs=dense.stride(-2), b_cs=dense.stride(-1), ldb=ldb,
            c_addr=storage_address(target), c_boff=_batch_offsets(target, target.ndim - 2, batch),
            c_rs=target.stride(-2), c_cs=target.stride(-1), c_rowmajor=c_rowmajor, ldc=ldc,
            Ms=Ms, Ks=Ks, N=N, panel=params["panel"], alpha=alpha, overwrite=overwrite,
            isz_ab=values.element_size(), isz_c=target.element_size(),
            proof=np.zeros(2, np.int64), crow_live=crow_live, col_live=col_live, live_wide=live_wide,
        )  # fmt: skip
        full_args = kernel.prepare(args)
        if values is a.values and dense is original_dense and target is out:  # (no copies were needed)
            rerun = running.prepared(kernel, full_args, values, dense, out)
            rerun(values, dense, out)
            return rerun
        _run(kernel.run_prepared, nthreads, full_args)
        if target is not out:
            out.copy_(target)
        return None

    def sampled(
        self,
        a: Operand,
        mat1: torch.Tensor,
        mat2: torch.Tensor,
        batch: torch.Size,
        alpha: float,
        params: dict[str, Any],
    ) -> torch.Tensor:
        """One gemm per block straight from the strided operands (no gathered copies)."""
        rows, cols = block_coordinates(a, batch)
        Ms, Ns = a.values.shape[-2:]
        B, nnz = rows.shape
        if rows.numel() == 0 or mat1.shape[-1] == 0:
            return torch.zeros((B, nnz, Ms, Ns), dtype=mat1.dtype)
        kernel = kernels.sampled_kernel()
        mat1, a_rowmajor, lda = _blas_operand(mat1)
        mat2, b_rowmajor, ldb = _blas_operand(mat2)
        half = mat1.dtype in (torch.float16, torch.bfloat16)
        out = torch.empty((B, nnz, Ms, Ns), dtype=torch.float32 if half else mat1.dtype)
        nthreads = _threads(params, B * nnz * Ms * Ns * mat1.shape[-1])
        Args: type[SampledArgs] = kernel.Args
        args = Args(
            kind=_KINDS[mat1.dtype], rows=rows.numpy(), cols=cols.numpy(), nthreads=nthreads,
            a_addr=storage_address(mat1), a_boff=_batch_offsets(mat1, mat1.ndim - 2, batch),
            a_rs=mat1.stride(-2), a_rowmajor=a_rowmajor, lda=lda,
            b_addr=storage_address(mat2), b_boff=_batch_offsets(mat2, mat2.ndim - 2, batch),
            b_cs=mat2.stride(-1), b_rowmajor=b_rowmajor, ldb=ldb,
            c_addr=data_address(out), Ms=Ms, Ns=Ns, K=mat1.shape[-1], alpha=alpha,
            isz_ab=mat1.element_size(), isz_c=out.element_size(),
        )  # fmt: skip
        _run(kernel, nthreads, args)
        return out.to(mat1.dtype) if half else out

    def scatter_mm(
        self,
        blocks: torch.Tensor,
        others: torch.Tensor,
        indices_data: tuple[Any, ...],
        accumulators: torch.Tensor,
        params: dict[str, Any],
        overwrite: bool = False,
    ) -> None:
        """The compiled tile loop over the indices data's gemm list (:func:`planning.cpu_scatter_plan`)."""
        if needs_torch_scatter(blocks, others, accumulators):
            _TORCH.scatter_mm(blocks, others, indices_data, accumulators, params, overwrite)
            return
        kernel = kernels.scatter_mm_kernel()
        fmt = indices_data[0]
        _, Ms, Ks = blocks.shape
        M, N = accumulators.shape[-2:]
        stacks = fmt == "scatter_mm"  # matrices indexed by the leading dims; else batches of one matrix
        Ns = N if stacks else N // indices_data[-1]["SPLIT_N"]
        panel = params["panel"]
        mnk = kernels.single_thread_mnk()
        if mnk:  # keep each gemm single-threaded in BLAS (the workers are the threads)
            panel = max(1, min(panel, mnk // max(Ms * Ks, 1)))
        blocks, a_rowmajor, lda = _blas_operand(blocks)
        others, b_rowmajor, ldb = _blas_operand(others)
        half = accumulators.dtype in (torch.float16, torch.bfloat16)
        if half:  # accumulate in a float32 buffer (of the same strides), written back once
            target = torch.empty_strided(accumulators.shape, accumulators.stride(), dtype=torch.float32)
            if not overwrite:
                target.copy_(accumulators)
        else:
            target = accumulators
        # (written through a copy when gemm cannot address it; the half gemm writes row-major only)
        target, c_rowmajor, ldc = _blas_operand(target, row_major_only=half)
        grid_rows = 0 if stacks or M % Ms else M // Ms
        tiled = stacks and _tiled_stacks(others, target)
        if tiled:  # joined tiles are wider: the layouts must hold for the whole matrices
            b_layout, c_layout = _layout(_untiled(others)), _layout(_untiled(target))
            tiled = b_layout is not None and c_layout is not None and (c_layout[0] or not half)
            if b_layout is not None and c_layout is not None and tiled:
                (b_rowmajor, ldb), (c_rowmajor, ldc) = b_layout, c_layout
        tiling = (others.shape[1], others.shape[2], target.shape[1], Ks, Ns) if tiled else ()
        plan = planning.cpu_scatter_plan(indices_data, others.shape[-1], Ms, Ns, panel, grid_rows, tiling)
        if overwrite and not plan.covers:  # some elements are in no tile: zero them all first
            target.zero_()
            overwrite = False
        if stacks:  # one "batch"; the element offset of every matrix (tiled: of every batch's matrix)
            batch = torch.Size()
            b_boff = c_boff = np.zeros(1, dtype=np.int64)
            lead = 1 if tiled else others.ndim - 2
            b_moff = _batch_offsets(others, lead, others.shape[:lead])
            c_moff = _batch_offsets(target, lead, target.shape[:lead])
        else:
            batch = others.shape[:-2]
            b_boff = _batch_offsets(others, len(batch), batch)
            c_boff = _batch_offsets(target, len(batch), batch)
            b_moff = c_moff = np.zeros(1, dtype=np.int64)
        nthreads = (
            _threads(params, plan.pairs.shape[0] * Ms * Ks * Ns * math.prod(batch)) if plan.disjoint else 1
        )
        Args: type[ScatterMMArgs] = kernel.Args
        args = Args(
            kind=_KINDS[accumulators.dtype], tiles=plan.tiles, pairs=plan.pairs, tasks=plan.tasks,
            cum=plan.cost, nbatch=math.prod(batch), nthreads=nthreads,
            a_addr=data_address(blocks), a_gs=blocks.stride(0), a_rowmajor=a_rowmajor, lda=lda,
            b_addr=storage_address(others), b_boff=b_boff, b_moff=b_moff, b_rs=others.stride(-2),
            b_cs=others.stride(-1), b_rowmajor=b_rowmajor, ldb=ldb,
            c_addr=storage_address(target), c_boff=c_boff, c_moff=c_moff, c_rs=target.stride(-2),
            c_cs=target.stride(-1), c_rowmajor=c_rowmajor, ldc=ldc,
            Ms=Ms, Ks=Ks, alpha=1.0, overwrite=overwrite,
            isz_ab=blocks.element_size(), isz_c=target.element_size(),
        )  # fmt: skip
        _run(kernel, nthreads, args)
        if target is not accumulators:
            accumulators.copy_(target)

    def softmax(
        self,
        a: Operand,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        zero_empty_rows: bool,
    ) -> torch.Tensor:
        """The compiled loop over (batch, block row) tasks; half types in a float32 copy."""
        if kernels.in_forked_child():  # its parallel loop cannot start threads there: torch primitives
            return _TORCH.softmax(a, x, bias, zero_empty_rows)
        kernel = softmax_kernels.softmax_kernel()
        batch = x.shape[:-3]
        nnz, Ms, Ns = x.shape[-3:]
        compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        x4 = x.to(compute).contiguous().reshape(-1, nnz, Ms, Ns)
        if bias is None:
            bias4 = x4.new_zeros((1, 1, 1, 1))
            bias_of = np.zeros(x4.shape[0], dtype=np.int64)
        else:
            bias4 = bias.to(compute).contiguous().reshape(-1, nnz, Ms, Ns)
            bias_of = bsr_batch_of(bias.shape[:-3], batch)
        out = torch.empty_like(x4)
        crow = a.plan("cpu_mm", 0).crow
        nthreads = max(1, torch.get_num_threads())
        _run(
            kernel, nthreads,
            crow, host_array(x4), host_array(bias4), bias_of, bias is not None, host_array(out),
            zero_empty_rows, compute == torch.float32,
        )  # fmt: skip
        return out.reshape(x.shape).to(x.dtype)

    def softmax_backward(self, a: Operand, y: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        if kernels.in_forked_child():
            return _TORCH.softmax_backward(a, y, grad)
        kernel = softmax_kernels.softmax_backward_kernel()
        nnz, Ms, Ns = y.shape[-3:]
        compute = torch.float32 if y.dtype in (torch.float16, torch.bfloat16) else y.dtype
        y4 = y.to(compute).contiguous().reshape(-1, nnz, Ms, Ns)
        g4 = grad.to(compute).expand(y.shape).contiguous().reshape(y4.shape)
        out = torch.empty_like(y4)
        crow = a.plan("cpu_mm", 0).crow
        nthreads = max(1, torch.get_num_threads())
        _run(kernel, nthreads, crow, host_array(y4), host_array(g4), host_array(out))
        return out.reshape(y.shape).to(y.dtype)

    def attention_forward(
        self,
        a: Operand,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        bias: BlockBias,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Fused attention forward (an optional capability): (output, row log-sum-exp), or None where it
        does not apply (not float32/float64, no MKL, a forked child). See :mod:`.attention_kernels`."""
        if not self._fused_attention(query.dtype):
            return None
        nthreads = min(max(1, torch.get_num_threads()), _machine_threads())
        return attention_kernels.forward(a, query, key, value, bias, scale, nthreads, _run)

    def attention_backward(
        self,
        a: Operand,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        grad: torch.Tensor,
        bias: BlockBias,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Fused backward of :meth:`attention_forward`: (dQ, dK, dV) with the call's batch, or None."""
        if not self._fused_attention(query.dtype):
            return None
        nthreads = min(max(1, torch.get_num_threads()), _machine_threads())
        return attention_kernels.backward(a, query, key, value, out, lse, grad, bias, scale, nthreads, _run)

    @staticmethod
    def _fused_attention(dtype: torch.dtype) -> bool:
        # (a forked child: the fused loops' threads cannot start there)
        return (
            dtype in (torch.float32, torch.float64)
            and not kernels.in_forked_child()
            and attention_kernels.available()
        )
