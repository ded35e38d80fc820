"""Index data ("plans") derived from a BSR tensor's indices, computed once and cached.

Every plan is computed with vectorized torch ops (no Python loop over rows or blocks) and stored in one
shared :func:`~bsrkit.cache.weak_lru_cache`, keyed on the BSR tensor by memory identity of its indices:
the entry lives as long as the index memory (a BSR rebuilt every step from the same index tensors finds
it). Every hit proves that the index data is byte-for-byte what the plan was derived from
(``verify_contents``: see :mod:`bsrkit.freshness`), whatever wrote it; a changed pattern is rebuilt and
validated again, never served stale. Every pattern is validated when its first plan is built
(:func:`check_pattern`). Plans never compute products (see ``bsrkit.backends``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from bsrkit.cache import CacheInfo, weak_lru_cache
from bsrkit.freshness import Snapshot
from bsrkit.keys import TensorKey
from bsrkit.validation import indices_data_defect, pattern_defect

__all__ = [
    "CpuMMPlan",
    "CpuScatterPlan",
    "MalformedPatternError",
    "Pattern",
    "TransposePlan",
    "block_rows",
    "cache_clear",
    "cache_info",
    "check_indices_data",
    "check_pattern",
    "cpu_mm_plan",
    "cpu_scatter_plan",
    "scatter_mm_indices",
    "transpose_plan",
]

# Cost of a block row in "multiply-adds", beyond its blocks: loop and panel overhead.
_ROW_OVERHEAD_BLOCKS = 0.05


class CpuMMPlan(NamedTuple):
    """What the CPU kernel needs: int64 indices, and per batch the prefix sums of the block rows' costs
    (the kernel cuts its work into runs of equal cost with them)."""

    crow: np.ndarray  # (batches, block_rows + 1)
    col: np.ndarray  # (batches, nnz)
    cost: np.ndarray  # (batches, block_rows + 1) float64: cost of rows 0..r-1, in blocks


class CpuScatterPlan(NamedTuple):
    """``scatter_mm`` indices data of any format as the gemm list the CPU kernel walks.

    Output tiles are ``(Ms x width)`` at (matrix, row, column) of the accumulators; each sums its pairs
    ``blocks[p] @ others[matrix, row:row+Ks, column:column+width]``. Tiles of the ``bsr_strided_mm*``
    formats that sit side by side with the same blocks and others shifted by the same columns (torch's
    ``SPLIT_N`` panels of one block row) are one wide tile; tasks cut tiles into column panels."""

    tiles: np.ndarray  # (T, 5) int64: matrix, row, column, first pair, end pair
    pairs: np.ndarray  # (G, 4) int64: block p, others matrix, row, column
    tasks: np.ndarray  # (S, 3) int64: tile, column offset inside it, width; panel-major
    cost: np.ndarray  # (S + 1,) float64: prefix sums of the tasks' costs, in (Ms x Ks x panel) gemms
    disjoint: bool  # no two tiles overlap: tasks may run in parallel
    covers: bool  # disjoint, and every accumulator element is in a tile (tiles without pairs included)


class TransposePlan(NamedTuple):
    """The transpose's structure: its block ``g`` is block ``perm[b, g]`` of the original, transposed."""

    perm: torch.Tensor  # (batches, nnz) int64
    crow: torch.Tensor  # (batches, block_cols + 1) int64
    col: torch.Tensor  # (batches, nnz) int64


# A plan's *source* is what its entry lives with: a BSR tensor (public ops) or its TensorKey (built once
# per call by ``Operand.of``), or a (crow_indices, col_indices) pair of long-lived tensors
# (BSRLinear's buffers, the custom ops under torch.compile).
Source = Any

_BUILDERS: dict[str, Callable[..., Any]]  # filled at the end of the module


@weak_lru_cache(maxsize=256, verify_contents=True)
def _plan(kind: str, source: Source, *params: Any) -> Any:
    return _BUILDERS[kind](source, *params)


def cache_info() -> CacheInfo:
    """Statistics of the shared plan cache: (hits, misses, maxsize, currsize, nbytes, dead_evictions,
    stale); ``stale`` counts hits refused because the index data changed since the plan was built."""
    return _plan.cache_info()  # type: ignore[attr-defined]


def cache_clear() -> None:
    """Drop every cached plan (and with the patterns, their prepared calls) and reset the statistics."""
    _plan.cache_clear()  # type: ignore[attr-defined]


def count_hit() -> None:
    """Count a hit of the plan cache served by a shortcut that stands for one (a kept operand:
    :func:`bsrkit.shortcuts.kept_operand`)."""
    state = _plan._cache_state  # type: ignore[attr-defined]
    with state.lock:
        state.hits += 1


class MalformedPatternError(ValueError):
    """Indices that are not a valid BSR pattern; the message names the defect."""


class Pattern:
    """A validated pattern (what :func:`check_pattern` returns), and what hangs on it: the plans fetched
    through it (:func:`cpu_mm_plan` with ``pattern=``, so that a product finds pattern and plan in one
    cache lookup), the prepared kernel calls of :mod:`bsrkit.shortcuts` (``calls``, which that module
    alone reads and writes), and ``proof``, the snapshot of the index data it was judged on (taken before
    the check), for the shortcuts that skip the cache. It lives in the plan cache's entry: with the
    pattern's memory, until the index data changes."""

    __slots__ = ("calls", "plans", "proof")

    def __init__(self, proof: Snapshot) -> None:
        self.plans: dict[tuple[Any, ...], Any] = {}
        self.calls: dict[tuple[Any, ...], Any] = {}
        self.proof = proof


def check_pattern(source: Source, block_rows: int, block_cols: int, nnz: int) -> Pattern:
    """Raise ``ValueError`` naming the defect unless ``source``'s indices are a valid BSR pattern of
    ``block_rows x block_cols`` blocks with ``nnz`` stored per batch (see :func:`pattern_defect`).

    Checked once per pattern: the verdict is cached like a plan (a malformed pattern is not cached, so it
    raises on every call), so hits read no index data."""
    return _plan("check", source, block_rows, block_cols, nnz)


def check_indices_data(
    indices_data: tuple[Any, ...], P: int, Ms: int, Ks: int, others: tuple[int, ...], acc: tuple[int, ...]
) -> None:
    """Raise :class:`MalformedPatternError` unless ``indices_data`` keeps every ``scatter_mm`` access
    inside blocks ``(P, Ms, Ks)``, ``others`` and ``accumulators`` of these shapes (see
    :func:`bsrkit.validation.indices_data_defect`); the verdict is cached on the index tensors."""
    tensors = tuple(t for t in indices_data[1:] if isinstance(t, torch.Tensor))
    if len(tensors) != len(indices_data) - 1 - isinstance(indices_data[-1], dict) or any(
        t.is_inference() for t in tensors
    ):  # not tensors (the checker names what is wrong), or no version counter to key on: check now
        _build_check_indices(indices_data, P, Ms, Ks, others, acc)
        return
    meta = indices_data[-1] if isinstance(indices_data[-1], dict) else {}
    split_n = 0 if indices_data[0] == "scatter_mm" else meta.get("SPLIT_N")
    if not isinstance(split_n, int) or isinstance(split_n, bool):
        _build_check_indices(indices_data, P, Ms, Ks, others, acc)  # raises: a malformed meta
        return
    _plan("check_indices", indices_data[0], tensors, split_n, P, Ms, Ks, tuple(others), tuple(acc))


def cpu_scatter_plan(
    indices_data: tuple[Any, ...],
    N: int,
    Ms: int,
    Ns: int,
    panel: int,
    grid_rows: int = 0,
    tiling: tuple[int, ...] = (),
) -> CpuScatterPlan:
    """The CPU kernel's gemm list for validated ``indices_data`` (see :class:`CpuScatterPlan`), cached on
    the index tensors: ``N`` is ``others.shape[-1]`` and ``Ns`` the tile width (``N // SPLIT_N``, or
    ``others.shape[-1]`` in the ``scatter_mm`` format); tasks are at most ``panel`` columns wide. For the
    strided formats, ``grid_rows`` = ``M // Ms`` (0: unknown) lets the plan cover the accumulators. In
    the ``scatter_mm`` format, ``tiling = (KB, NB, MB, Ks, Ns)`` says that others and accumulators are
    the (Ks x Ns) and (Ms x Ns) tiles of batched matrices, indexed (batch, block row, tile column)."""
    fmt = indices_data[0]
    tensors = tuple(t for t in indices_data[1:] if isinstance(t, torch.Tensor))
    split_n = 0 if fmt == "scatter_mm" else indices_data[-1]["SPLIT_N"]
    if fmt == "scatter_mm":
        N = 0  # (unused: keeps one entry per tile width)
    if any(t.is_inference() for t in tensors):  # no version counter to key on
        return _build_cpu_scatter(fmt, tensors, split_n, N, Ms, Ns, panel, grid_rows, tiling)
    return _plan("cpu_scatter", fmt, tensors, split_n, N, Ms, Ns, panel, grid_rows, tiling)


def cpu_mm_plan(source: Source, transposed_block_cols: int = 0, pattern: Pattern | None = None) -> CpuMMPlan:
    """Kernel plan for ``source`` (or, with ``transposed_block_cols`` = its block-column count > 0, for
    its transpose). ``pattern``: the source's verdict (:func:`check_pattern`), which keeps the plan once
    fetched, so that later products skip a second cache lookup."""
    if pattern is None:
        return _plan("cpu_mm", source, transposed_block_cols)
    plan = pattern.plans.get(("cpu_mm", transposed_block_cols))
    if plan is None:
        plan = _plan("cpu_mm", source, transposed_block_cols)
        pattern.plans[("cpu_mm", transposed_block_cols)] = plan
    return plan


def transpose_plan(source: Source, block_cols: int) -> TransposePlan:
    return _plan("transpose", source, block_cols)


def block_rows(source: Source) -> torch.Tensor:
    """(batches, nnz) int64: the block row of every stored block."""
    return _plan("rows", source)


def scatter_mm_indices(
    bsr: torch.Tensor, indices_format: str, N: int, nbatches: int, split_n: int
) -> tuple[Any, ...]:
    return _plan("scatter_mm", bsr, indices_format, N, nbatches, split_n)


def _indices(source: Source) -> tuple[torch.Tensor, torch.Tensor]:
    """(crow, col) of a source, flattened to (batches, -1), int64."""
    if isinstance(source, TensorKey):
        source = source.obj
    crow, col = (source.crow_indices(), source.col_indices()) if isinstance(source, torch.Tensor) else source
    crow2 = crow.reshape(-1, crow.shape[-1]).to(torch.int64)
    return crow2, col.reshape(crow2.shape[0], col.shape[-1]).to(torch.int64)


def _build_check(source: Source, block_rows: int, block_cols: int, nnz: int) -> Pattern:
    if isinstance(source, TensorKey):
        source = source.obj
    crow, col = (source.crow_indices(), source.col_indices()) if isinstance(source, torch.Tensor) else source
    proof = Snapshot((crow, col))  # (first: the verdict is on at most these bytes)
    defect = pattern_defect(crow, col, block_rows, block_cols, nnz)
    if defect is not None:
        raise MalformedPatternError(defect)
    return Pattern(proof)


def _build_check_indices(indices_data: tuple[Any, ...], *extents: Any) -> bool:
    defect = indices_data_defect(indices_data, *extents)
    if defect is not None:
        raise MalformedPatternError(defect)
    return True


def _check_indices_from_key(fmt: str, tensors: tuple[torch.Tensor, ...], split_n: int, *extents: Any) -> bool:
    meta = () if fmt == "scatter_mm" else ({"SPLIT_N": split_n},)
    return _build_check_indices((fmt, *tensors, *meta), *extents)


def _build_cpu_mm(source: Source, transposed_block_cols: int) -> CpuMMPlan:
    if transposed_block_cols:
        t = transpose_plan(source, transposed_block_cols)
        crow, col = t.crow, t.col
    else:
        crow, col = _indices(source)
    # A row costs its gemms plus a small overhead (an empty row still has its tile zeroed).
    cost = crow.diff(dim=1).to(torch.float64) + _ROW_OVERHEAD_BLOCKS
    cum = torch.cat([cost.new_zeros(cost.shape[0], 1), cost.cumsum(1)], dim=1)
    # Copies (not views) of the indices: a plan must not hold a view of a source tensor.
    return CpuMMPlan(crow.clone().numpy(), col.clone().numpy(), cum.numpy())


def _build_rows(source: Source) -> torch.Tensor:
    crow, _ = _indices(source)
    nnz = int(crow[0, -1]) if crow.numel() else 0
    # Block g lies in row r where crow[r] <= g < crow[r + 1].
    return torch.searchsorted(
        crow[:, 1:].contiguous(),
        torch.arange(nnz, device=crow.device).expand(crow.shape[0], nnz).contiguous(),
        right=True,
    )


def _build_transpose(source: Source, block_cols: int) -> TransposePlan:
    crow, col = _indices(source)
    B, nnz = col.shape
    block_rows_ = crow.shape[1] - 1
    rows = block_rows(source)
    batches = torch.arange(B, device=col.device)[:, None]  # (on the indices' device: CUDA plans too)
    # Order the blocks by (column, row): a stable sort of col * rows + row per batch.
    order_key = col * max(block_rows_, 1) + rows + batches * (block_cols * max(block_rows_, 1))
    perm = order_key.reshape(-1).argsort(stable=True).reshape(B, nnz) - batches * nnz
    col_t = rows.gather(1, perm)
    counts = torch.zeros(B, block_cols, dtype=torch.int64, device=col.device)
    counts.scatter_add_(1, col, torch.ones_like(col))
    crow_t = torch.cat([counts.new_zeros(B, 1), counts.cumsum(1)], dim=1)
    return TransposePlan(perm, crow_t, col_t)


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
_TILE_OVERHEAD = 0.05


def _scatter_tiles_and_pairs(
    fmt: str, tensors: tuple[torch.Tensor, ...], split_n: int, N: int, Ms: int, tiling: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tiles (T, 3): matrix, row, column; counts (T,); pairs (G, 4): p, matrix, row, column), the pairs
    of tile ``i`` following those of tiles ``0..i-1``: every format's loops written out."""
    if fmt == "scatter_mm":
        c_offsets, pq = (t.long() for t in tensors)
        R = c_offsets.numel() - 1
        counts = c_offsets.diff()
        used = pq.reshape(-1, 2)[int(c_offsets[0]) : int(c_offsets[-1])] if R > 0 else pq.new_zeros(0, 2)
        p, q, r = used[:, 0], used[:, 1], torch.arange(R)
        if not tiling:  # matrix q of others, matrix r of the accumulators
            zeros = torch.zeros_like(q)
            pairs = torch.stack((p, q, zeros, zeros), dim=1)
            tiles = torch.stack((r, torch.zeros_like(r), torch.zeros_like(r)), 1)
            return tiles, counts, pairs
        # Tiled stacks: q = (batch, block row, tile column) of an (*, KB * Ks, NB * Ns) matrix, r likewise
        # of an (*, MB * Ms, NB * Ns) one: in (batch, row, column) coordinates side-by-side tiles join.
        KB, NB, MB, Ks, Ns = tiling
        pairs = torch.stack((p, q // (KB * NB), (q // NB) % KB * Ks, q % NB * Ns), dim=1)
        tiles = torch.stack((r // (MB * NB), (r // NB) % MB * Ms, r % NB * Ns), dim=1)
        return tiles, counts, pairs
    c_indices, r_offsets, q_offsets = (t.long() for t in (tensors[0], tensors[1], tensors[-1]))
    T = r_offsets.numel()
    if fmt == "bsr_strided_mm":
        counts = c_indices.diff()
        g0, g1 = (int(c_indices[0]), int(c_indices[-1])) if T else (0, 0)
        p = tensors[2].long()[g0:g1]
        q = q_offsets[g0:g1]
    else:  # "bsr_strided_mm_compressed"
        Ns = N // split_n
        m = (r_offsets // N) // Ms
        n = (r_offsets % N) // Ns
        c0, c1 = c_indices[m], c_indices[m + 1]
        counts = c1 - c0
        j = torch.repeat_interleave(torch.arange(T), counts)
        i = torch.arange(j.numel()) - (torch.cumsum(counts, 0) - counts)[j]
        p = c0[j] + i
        q = q_offsets[n[j] * c1[j] + (split_n - n[j]) * c0[j] + i]
    tiles = torch.stack((torch.zeros(T, dtype=torch.int64), r_offsets // N, r_offsets % N), dim=1)
    pairs = torch.stack((p, torch.zeros_like(p), q // N, q % N), dim=1)
    return tiles, counts, pairs


def _build_cpu_scatter(
    fmt: str,
    tensors: tuple[torch.Tensor, ...],
    split_n: int,
    N: int,
    Ms: int,
    Ns: int,
    panel: int,
    grid_rows: int,
    tiling: tuple[int, ...],
) -> CpuScatterPlan:
    tiles, counts, pairs = _scatter_tiles_and_pairs(fmt, tensors, split_n, N, Ms, tiling)
    starts = torch.cumsum(counts, 0) - counts

    def in_output_order() -> torch.Tensor:  # by (matrix, row, column)
        if not tiles.shape[0]:
            return torch.zeros(0, dtype=torch.int64)
        span = tiles.max(0).values + 1
        return ((tiles[:, 0] * span[1] + tiles[:, 1]) * span[2] + tiles[:, 2]).argsort(stable=True)

    order = in_output_order()
    tiles, counts, starts = tiles[order], counts[order], starts[order]
    # Disjoint tiles: on the (Ms x Ns) grid, each position once (the scatter_mm format: one per matrix).
    disjoint = bool(((tiles[:, 1] % Ms == 0) & (tiles[:, 2] % Ns == 0)).all()) and not bool(
        (tiles[1:] == tiles[:-1]).all(1).any()
    )
    covers = disjoint and fmt == "scatter_mm"  # (every accumulator matrix is a tile: R of them)
    if disjoint and grid_rows and fmt != "scatter_mm":  # the cells no tile writes, as empty tiles
        present = torch.zeros(grid_rows * split_n, dtype=torch.bool)
        present[(tiles[:, 1] // Ms) * split_n + tiles[:, 2] // Ns] = True
        missing = (~present).nonzero().view(-1)
        zeros = torch.zeros_like(missing)
        tiles = torch.cat((tiles, torch.stack((zeros, missing // split_n * Ms, missing % split_n * Ns), 1)))
        counts = torch.cat((counts, zeros))
        starts = torch.cat((starts, zeros))
        order = in_output_order()
        tiles, counts, starts = tiles[order], counts[order], starts[order]
        covers = True
    T = tiles.shape[0]
    # Tile i joins tile i - 1 when it sits Ns columns right of it, with the same count, the same blocks,
    # and each pair's others Ns columns right of the other's.
    joins = torch.zeros(T, dtype=torch.bool)
    if T > 1:
        cand = (
            (tiles[1:, 0] == tiles[:-1, 0])
            & (tiles[1:, 1] == tiles[:-1, 1])
            & (tiles[1:, 2] == tiles[:-1, 2] + Ns)
            & (counts[1:] == counts[:-1])
        )
        ci = cand.nonzero().view(-1) + 1  # candidate tiles
        if ci.numel():
            cc = counts[ci]
            owner = torch.repeat_interleave(torch.arange(ci.numel()), cc)
            k = torch.arange(owner.numel()) - (torch.cumsum(cc, 0) - cc)[owner]
            here = pairs[starts[ci][owner] + k]
            prev = pairs[starts[ci - 1][owner] + k]
            prev[:, 3] += Ns
            bad = torch.zeros(ci.numel(), dtype=torch.int64)
            bad.index_add_(0, owner, (here != prev).any(1).long())
            joins[ci] = bad == 0
    group = torch.cumsum(~joins, 0) - 1  # group of each tile
    first = (~joins).nonzero().view(-1)
    widths = torch.zeros(first.numel(), dtype=torch.int64).index_add_(0, group, torch.full((T,), Ns))
    gcounts = counts[first]
    # Only the pairs of the groups' first tiles are read: keep those, in tile order.
    owner = torch.repeat_interleave(torch.arange(first.numel()), gcounts)
    gstarts = torch.cumsum(gcounts, 0) - gcounts
    pairs = pairs[starts[first][owner] + torch.arange(owner.numel()) - gstarts[owner]]
    out_tiles = torch.cat((tiles[first], gstarts[:, None], (gstarts + gcounts)[:, None]), dim=1)
    # Tasks: each group cut into panels, panel-major (a worker's run reads few column panels of others).
    npanels = (widths + panel - 1) // panel
    tile_of = torch.repeat_interleave(torch.arange(first.numel()), npanels)
    k = torch.arange(tile_of.numel()) - (torch.cumsum(npanels, 0) - npanels)[tile_of]
    j0 = k * panel
    w = torch.minimum(widths[tile_of] - j0, torch.tensor(panel))
    order = (k * max(first.numel(), 1) + tile_of).argsort()
    tasks = torch.stack((tile_of, j0, w), dim=1)[order]
    cost = gcounts[tasks[:, 0]].to(torch.float64) * tasks[:, 2] / panel + _TILE_OVERHEAD
    cum = torch.cat((cost.new_zeros(1), cost.cumsum(0)))
    # Fresh arrays (never views of the index tensors: a plan must not pin its key).
    return CpuScatterPlan(
        np.array(out_tiles.numpy()), np.array(pairs.numpy()), np.array(tasks.numpy()), np.array(cum.numpy()),
        disjoint, covers,
    )  # fmt: skip


_BUILDERS = {
    "check": _build_check,
    "check_indices": _check_indices_from_key,
    "cpu_mm": _build_cpu_mm,
    "cpu_scatter": _build_cpu_scatter,
    "scatter_mm": _build_scatter_mm,
    "transpose": _build_transpose,
    "rows": _build_rows,
}
