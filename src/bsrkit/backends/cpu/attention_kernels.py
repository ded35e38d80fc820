r"""Fused CPU attention (float32 and float64): marshaling for the loops of :mod:`.compiled.attention`.

Forward, per (batch, block row) task: ``S = scale Q_r K^T`` by MKL gemm into a worker-local buffer one
L2-sized chunk of the row's stored blocks at a time, the bias of the *partial* blocks only, an online
(flash-attention style) softmax with a vectorized ``exp``, and ``O_r += P V`` by gemm; it saves the rows'
log-sum-exp instead of the weights. The backward recomputes ``P`` from it per chunk (flash-attention 2):
five gemms per chunk, ``dQ`` per task, ``dK``/``dV`` per head in place (see :mod:`.compiled.attention`).

Why fused: the composed path (SDDMM, softmax, BSR product, and five products back) writes and rereads
the ``nnz * Ms * Ns`` scores several times and keeps the weights for the backward; here they stay in the
worker's cache, and memory is O(L) beyond the inputs. Figures in docs/performance.md.

The loops are compiled once per machine and cached on disk; MKL's gemm and ``mkl_set_num_threads_local``
travel as addresses (each worker runs single-threaded gemm). Without MKL (:func:`available` is False)
attention takes the composed path. Importing this module imports neither numba nor MKL.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import bsrkit.backends.cpu.planning  # noqa: F401  (registers the "cpu_mm" plan its operands derive)
from bsrkit.backends.batching import bsr_batch_of, host_array
from bsrkit.backends.cpu.blas import mkl_functions
from bsrkit.loading import import_module

if TYPE_CHECKING:
    from bsrkit.mask_bias import BlockBias
    from bsrkit.operand import Operand

__all__ = ["available", "backward", "forward", "side_heads", "work_bounds"]

# At most this many bytes of one worker's score buffer (Ms x width), a row's run being cut into equal
# chunks: 3/4 of the 512 KiB L2 per core measured on (128-blocks, float32: 6 blocks, a 9-block row in
# 5 + 4). Widths of 1 to 16 blocks were within 8% of each other (L = 4096, D = 64, one thread).
# The backward has two such buffers (P and dS).
_FORWARD_CHUNK_BYTES = 384 * 1024
_BACKWARD_CHUNK_BYTES = 192 * 1024


@functools.cache
def _addresses() -> tuple[int, int, int] | None:
    fns = mkl_functions()
    return None if fns is None else (fns.sgemm, fns.dgemm, fns.set_num_threads_local)


def available() -> bool:
    """Whether the fused loops can run here (they need MKL's gemm); finds the entry points, compiles
    nothing."""
    return _addresses() is not None


def _loops() -> Any:
    # deferred: imports numba, loads (or compiles) the loops; off the main thread (see bsrkit.loading)
    return import_module("bsrkit.backends.cpu.compiled.attention")


def _width(Ms: int, Ns: int, itemsize: int, nbytes: int) -> int:
    """Chunk width in columns: whole blocks, at least one, the buffer at most ``nbytes`` where possible."""
    return max(Ns, nbytes // (Ms * itemsize) // Ns * Ns)


def work_bounds(cost: np.ndarray, nthreads: int) -> np.ndarray:
    """``(nthreads + 1,)`` int64: worker t runs tasks ``bounds[t]:bounds[t + 1]`` (task = batch * rows +
    row), of about equal cost; ``cost`` ``(batches, rows + 1)`` holds each batch's prefix sums. With at
    least as many batches as workers the cuts fall between batches (no head is shared, so no side
    buffers), at the batch boundary nearest to an equal split."""
    nb, rows = cost.shape[0], cost.shape[1] - 1
    per_batch = cost[:, -1]
    starts = np.concatenate([[0.0], np.cumsum(per_batch)])
    total = starts[-1]
    targets = total * np.arange(nthreads + 1) / nthreads
    if nb >= nthreads:
        cuts = np.abs(starts[None, :] - targets[:, None]).argmin(1) * rows
    else:
        flat = (starts[:-1, None] + cost[:, :-1]).reshape(-1)  # cost before each task
        cuts = np.searchsorted(flat, targets, side="left")
    cuts[0], cuts[-1] = 0, nb * rows
    return np.maximum.accumulate(cuts).astype(np.int64)


def side_heads(bounds: np.ndarray, rows: int) -> np.ndarray:
    """``(nthreads, 2)`` int64: the first and last batch of each worker's run when the run holds only
    part of that batch's tasks (its dK/dV go to side buffers), else -1."""
    nthreads = bounds.shape[0] - 1
    out = np.full((nthreads, 2), -1, dtype=np.int64)
    for t in range(nthreads):
        lo, hi = int(bounds[t]), int(bounds[t + 1])
        if lo == hi or rows == 0:
            continue
        for slot, b in enumerate((lo // rows, (hi - 1) // rows)):
            if not (lo <= b * rows and (b + 1) * rows <= hi) and b not in out[t]:
                out[t, slot] = b
    return out


def _bias_arrays(bias: BlockBias, batch: torch.Size, dtype: torch.dtype) -> tuple[Any, ...]:

    index = bias.block_index.reshape(-1, bias.block_index.shape[-1]).to(torch.int64).contiguous().numpy()
    values = bias.values.to(dtype).contiguous()
    if values.shape[0] == 0:
        values = values.new_zeros((1, *values.shape[1:]))
    return index, host_array(values), bsr_batch_of(bias.batch, batch)


def _flat(t: torch.Tensor, batch: torch.Size, rows: int, cols: int) -> torch.Tensor:
    return t.expand(*batch, rows, cols).reshape(-1, rows, cols).contiguous()


def forward(
    a: Operand,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: BlockBias,
    scale: float,
    nthreads: int,
    run: Callable[..., None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output ``(*batch, L, Ev)``, row log-sum-exp ``(*batch, L)``); ``a``'s indices have the call's
    batch, float32 or float64 (the caller checks :func:`available`). ``run(kernel, nthreads, *args)``
    calls the loop (the backend's lock)."""
    loops = _loops()
    batch = a.batch
    Ms, Ns = a.values.shape[-2:]
    L, S = a.M, a.K
    E, Ev = query.shape[-1], value.shape[-1]
    dtype = query.dtype
    q, k, v = _flat(query, batch, L, E), _flat(key, batch, S, E), _flat(value, batch, S, Ev)
    B = q.shape[0]
    out = torch.empty((B, L, Ev), dtype=dtype)
    lse = torch.empty((B, L), dtype=dtype)
    plan = a.plan("cpu_mm", 0)
    bounds = work_bounds(plan.cost, nthreads)
    sgemm, dgemm, set_threads = _addresses()  # type: ignore[misc]
    run(
        loops.attention_forward, nthreads,
        plan.crow, plan.col, *_bias_arrays(bias, batch, dtype),
        host_array(q), host_array(k), host_array(v), host_array(out), host_array(lse),
        float(scale), Ms, Ns, _width(Ms, Ns, q.element_size(), _FORWARD_CHUNK_BYTES), bounds, nthreads,
        dtype == torch.float64, sgemm, dgemm, set_threads,
    )  # fmt: skip
    return out.reshape(*batch, L, Ev), lse.reshape(*batch, L)


def backward(
    a: Operand,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
    bias: BlockBias,
    scale: float,
    nthreads: int,
    run: Callable[..., None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV), each with the call's batch (``(*batch, L, E)``, ``(*batch, S, E)``,
    ``(*batch, S, Ev)``; the caller sums broadcast dimensions), from :func:`forward`'s ``out`` and
    ``lse``."""
    loops = _loops()
    batch = a.batch
    Ms, Ns = a.values.shape[-2:]
    L, S = a.M, a.K
    E, Ev = query.shape[-1], value.shape[-1]
    dtype = query.dtype
    q, k, v = _flat(query, batch, L, E), _flat(key, batch, S, E), _flat(value, batch, S, Ev)
    o, do = _flat(out, batch, L, Ev), _flat(grad.to(dtype), batch, L, Ev)
    B = q.shape[0]
    lse2 = lse.reshape(B, L).contiguous()
    dq = torch.empty((B, L, E), dtype=dtype)
    dk = torch.empty((B, S, E), dtype=dtype)
    dv = torch.empty((B, S, Ev), dtype=dtype)
    plan = a.plan("cpu_mm", 0)
    bounds = work_bounds(plan.cost, nthreads)
    heads = side_heads(bounds, L // Ms)
    shared = bool((heads >= 0).any())
    side_k = torch.empty((nthreads, 2, S, E) if shared else (1, 2, 1, 1), dtype=dtype)
    side_v = torch.empty((nthreads, 2, S, Ev) if shared else (1, 2, 1, 1), dtype=dtype)
    sgemm, dgemm, set_threads = _addresses()  # type: ignore[misc]
    run(
        loops.attention_backward, nthreads,
        plan.crow, plan.col, *_bias_arrays(bias, batch, dtype),
        host_array(q), host_array(k), host_array(v), host_array(o), host_array(do), host_array(lse2),
        host_array(dq), host_array(dk), host_array(dv), host_array(side_k), host_array(side_v), heads,
        float(scale), Ms, Ns, _width(Ms, Ns, q.element_size(), _BACKWARD_CHUNK_BYTES), bounds, nthreads,
        dtype == torch.float64, sgemm, dgemm, set_threads,
    )  # fmt: skip
    shape = tuple(batch)
    return dq.reshape(*shape, L, E), dk.reshape(*shape, S, E), dv.reshape(*shape, S, Ev)
