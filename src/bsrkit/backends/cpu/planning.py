"""The CPU backend's plans: its kernels' int64 index arrays and work splits, derived from a pattern (or from
``scatter_mm`` indices data) once and kept in the shared plan cache (:func:`bsrkit.plans.cached`), so
every hit obeys that cache's freshness rule."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from bsrkit import plans
from bsrkit.plans import Source

__all__ = ["CpuMMPlan", "CpuScatterPlan", "cpu_mm_plan", "cpu_scatter_plan"]

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
    return plans.cached("cpu_scatter", fmt, tensors, split_n, N, Ms, Ns, panel, grid_rows, tiling)


def cpu_mm_plan(source: Source, transposed_block_cols: int = 0) -> CpuMMPlan:
    """Kernel plan for ``source`` (or, with ``transposed_block_cols`` = its block-column count > 0, for
    its transpose), from the shared plan cache. The backend asks its operand instead
    (``a.plan("cpu_mm", ...)``: kept on the operand's validated pattern, see :class:`~bsrkit.operand.
    Operand`)."""
    return plans.cached("cpu_mm", source, transposed_block_cols)


def _build_cpu_mm(source: Source, transposed_block_cols: int) -> CpuMMPlan:
    if transposed_block_cols:
        t = plans.derive("transpose", source, transposed_block_cols)
        crow, col = t.crow, t.col
    else:
        crow, col = plans.indices(source)
    # A row costs its gemms plus a small overhead (an empty row still has its tile zeroed).
    cost = crow.diff(dim=1).to(torch.float64) + _ROW_OVERHEAD_BLOCKS
    cum = torch.cat([cost.new_zeros(cost.shape[0], 1), cost.cumsum(1)], dim=1)
    # Copies (not views) of the indices: a plan must not hold a view of a source tensor.
    return CpuMMPlan(crow.clone().numpy(), col.clone().numpy(), cum.numpy())


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


plans.register("cpu_mm", _build_cpu_mm)
plans.register("cpu_scatter", _build_cpu_scatter)
