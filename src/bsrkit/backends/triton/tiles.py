"""Tile rules of the Triton kernels, in plain Python (no triton import), so that parameter defaults and
the tuner can use them without loading Triton."""

from __future__ import annotations

from typing import Any

__all__ = ["clamped_tiles", "tile"]


def tile(n: int) -> int:
    """The padded tile extent for a block extent n: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def clamped_tiles(meta: dict[str, Any], rows: int, inner: int, cols: int) -> dict[str, int]:
    """Tile constexprs for an (rows x inner) @ (inner x cols) block product: meta's caps, clamped to the
    padded extents so a small block is one tile."""
    return {
        "BLOCK_M": min(meta["BLOCK_M"], tile(rows)),
        "BLOCK_K": min(meta["BLOCK_K"], tile(inner)),
        "BLOCK_N": min(meta["BLOCK_N"], tile(cols)),
    }
