"""Index data ("plans") derived from a BSR tensor's indices, computed once and cached.

Every plan is computed with vectorized torch ops (no Python loop over rows or blocks) and stored in one
shared :func:`~bsrkit.cache.weak_lru_cache`, keyed on the BSR tensor by memory identity of its indices:
the entry lives as long as the index memory (a BSR rebuilt every step from the same index tensors finds
it). Every plan is derived from a copy of the index data taken before the derivation, and every hit
proves that the memory still holds those bytes (``verify_contents``: see :mod:`bsrkit.freshness`),
whatever wrote it; a changed pattern is rebuilt and validated again, never served stale. Every pattern is
validated when it is first seen (:func:`check_pattern`), and the plans a product runs on are derived
from the very bytes that were validated: they hang on the :class:`Pattern` (:meth:`Pattern.plan`).
Plans never compute products (see ``bsrkit.backends``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from bsrkit.cache import CacheInfo, library_cache, weak_lru_cache
from bsrkit.freshness import Snapshot
from bsrkit.keys import TensorKey
from bsrkit.validation import indices_data_defect, is_int, pattern_defect

__all__ = [
    "MalformedPatternError",
    "Pattern",
    "TransposePlan",
    "block_rows",
    "cache_clear",
    "cache_info",
    "cached",
    "check_indices_data",
    "check_pattern",
    "derive",
    "indices",
    "register",
    "transpose_plan",
]


class TransposePlan(NamedTuple):
    """The transpose's structure: its block ``g`` is block ``perm[b, g]`` of the original, transposed."""

    perm: torch.Tensor  # (batches, nnz) int64
    crow: torch.Tensor  # (batches, block_cols + 1) int64
    col: torch.Tensor  # (batches, nnz) int64


# A plan's *source* is what its entry lives with: a BSR tensor (public ops) or its TensorKey (built once
# per call by ``Operand.of``), or a (crow_indices, col_indices) pair of long-lived tensors
# (BSRLinear's buffers, the custom ops under torch.compile).
Source = Any

# plan name -> its builder: this module's (at its end), and those a backend or the scatter module
# registers (:func:`register`); all share one cache, so one bound and one freshness rule cover them.
_BUILDERS: dict[str, Callable[..., Any]] = {}


@library_cache
@weak_lru_cache(maxsize=256, verify_contents=True, pass_snapshot=True)
def _plan(name: str, source: Source, *params: Any, snapshot: Snapshot | None = None) -> Any:
    # (source and params: copies of the index data, taken in ``snapshot``, which the cache passes)
    if name == "check":
        if snapshot is None:
            raise TypeError("plans._plan(): expected the snapshot the cache passes")
        return _build_check(source, *params, proof=snapshot)
    return _BUILDERS[name](source, *params)


def register(name: str, builder: Callable[..., Any]) -> None:
    """Add the plan ``name``, built by ``builder(source, *params)`` (a deterministic function of the
    source's index data and ``params``, never holding a view of the source), to the shared cache."""
    if _BUILDERS.get(name, builder) is not builder or name == "check":
        raise ValueError(f"plans.register(): expected a new plan name, got {name!r} (already registered)")
    _BUILDERS[name] = builder


def derive(name: str, source: Source, *params: Any) -> Any:
    """The plan ``name`` of ``source`` computed now, not cached: for a builder deriving one plan from
    another on the copy it was given (a cached lookup there would key on that copy's memory)."""
    return _BUILDERS[name](source, *params)


def cached(name: str, source: Source, *params: Any) -> Any:
    """The plan ``name`` (see :func:`register`) of ``source`` with ``params``: built once, then served
    while the index memory lives and holds the same bytes."""
    return _plan(name, source, *params)


def cache_info() -> CacheInfo:
    """Statistics of the shared plan cache: (hits, misses, maxsize, currsize, nbytes, dead_evictions,
    stale); ``stale`` counts hits refused because the index data changed since the plan was built.
    ``nbytes`` counts what the entries hold now: the plans stored as entries, and in a pattern's entry
    its validated copy of the indices and the plans built on it since (:meth:`Pattern.plan`), not the
    copies the entries compare hits with (about the size of the indices each)."""
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
    """A validated pattern (what :func:`check_pattern` returns), and what hangs on it.

    ``proof`` is the snapshot of the index data it was judged on, ``source`` the source rebuilt on that
    snapshot's copy, which the check read, and ``indices`` its ``(crow, col)``: the plans a product runs
    on are derived from it (:meth:`plan`), so they are plans of exactly the validated bytes, whatever
    writes the memory meanwhile. ``calls`` holds the prepared kernel calls of :mod:`bsrkit.shortcuts`
    (which that module alone reads and writes); the shortcuts that skip the cache trust all of it only
    while ``proof`` holds.
    It lives in the plan cache's entry: with the pattern's memory, until the index data changes."""

    __slots__ = ("calls", "indices", "plans", "proof", "source")

    def __init__(self, proof: Snapshot, source: Source, indices: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.plans: dict[tuple[Any, ...], Any] = {}
        self.calls: dict[tuple[Any, ...], Any] = {}
        self.proof = proof
        self.source = source  # (on the copy in proof: holds no view of the pattern's memory)
        self.indices = indices

    def plan(self, name: str, *params: Any) -> Any:
        """The plan ``name`` (see :func:`register`) with ``params`` of the validated bytes, built on the
        first request and kept here. For plans with few distinct ``params`` per pattern (the transpose,
        block rows, the CPU kernel plan); the others are cached in the shared cache (:func:`cached`)."""
        key = (name, *params)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = _BUILDERS[name](self.source, *params)
        return plan

    def cache_footprint(self) -> tuple[Any, ...]:
        """What it owns, for the cache's ``nbytes``: the validated copy of the indices and the plans built
        on it (the proof is the cache entry's own copy, which ``maxbytes`` does not count; the prepared
        calls hold arrays of those plans)."""
        return (self.indices, self.plans)

    def forget(self) -> None:
        """Drop the plans and prepared calls hung on it (a deferred proof found its index data changed:
        see :mod:`bsrkit.shortcuts`); they are fetched again through the plan cache."""
        self.plans.clear()
        self.calls.clear()


def check_pattern(source: Source, block_rows: int, block_cols: int, nnz: int) -> Pattern:
    """Raise ``ValueError`` naming the defect unless ``source``'s indices are a valid BSR pattern of
    ``block_rows x block_cols`` blocks with ``nnz`` stored per batch (see :func:`pattern_defect`).

    Checked once per pattern: the verdict is cached like a plan (a malformed pattern is not cached, so it
    raises on every call), so hits read no index data."""
    return _plan("check", source, block_rows, block_cols, nnz)


def check_indices_data(
    indices_data: tuple[Any, ...], P: int, Ms: int, Ks: int, others: tuple[int, ...], acc: tuple[int, ...]
) -> tuple[Any, ...]:
    """Raise :class:`MalformedPatternError` unless ``indices_data`` keeps every ``scatter_mm`` access
    inside blocks ``(P, Ms, Ks)``, ``others`` and ``accumulators`` of these shapes (see
    :func:`bsrkit.validation.indices_data_defect`); the verdict is cached on the index tensors.

    Returns the indices data that was judged: where the verdict is cached, the same items with its index
    tensors replaced by the copies the check read (kept with the verdict, so a kernel that runs on them
    runs on exactly the validated bytes, whatever writes the caller's tensors meanwhile); else
    ``indices_data`` itself."""
    tensors = tuple(t for t in indices_data[1:] if isinstance(t, torch.Tensor))
    if len(tensors) != len(indices_data) - 1 - isinstance(indices_data[-1], dict) or any(
        t.is_inference() for t in tensors
    ):  # not tensors (the checker names what is wrong), or no version counter to key on: check now
        _build_check_indices(indices_data, P, Ms, Ks, others, acc)
        return indices_data
    meta = indices_data[-1] if isinstance(indices_data[-1], dict) else {}
    split_n = 0 if indices_data[0] == "scatter_mm" else meta.get("SPLIT_N")
    if not is_int(split_n):
        _build_check_indices(indices_data, P, Ms, Ks, others, acc)  # raises: a malformed meta
        return indices_data
    split_n = int(split_n)  # (torch's indices data may hold a numpy integer: Triton's tiles refuse one)
    judged = _plan("check_indices", indices_data[0], tensors, split_n, P, Ms, Ks, tuple(others), tuple(acc))
    if indices_data[0] == "scatter_mm":
        return (indices_data[0], *judged, *indices_data[1 + len(tensors) :])
    return (indices_data[0], *judged, {**meta, "SPLIT_N": split_n})


def transpose_plan(source: Source, block_cols: int) -> TransposePlan:
    return _plan("transpose", source, block_cols)


def block_rows(source: Source) -> torch.Tensor:
    """(batches, nnz) int64: the block row of every stored block."""
    return _plan("rows", source)


def source_indices(source: Source) -> tuple[torch.Tensor, torch.Tensor]:
    """The (crow, col) tensors of a source, as they are (see ``Source``)."""
    if isinstance(source, TensorKey):
        source = source.obj
    if isinstance(source, torch.Tensor):
        return source.crow_indices(), source.col_indices()
    return source[0], source[1]


def indices(source: Source) -> tuple[torch.Tensor, torch.Tensor]:
    """(crow, col) of a source, flattened to (batches, -1), int64."""
    crow, col = source_indices(source)
    crow2 = crow.reshape(-1, crow.shape[-1]).to(torch.int64)
    return crow2, col.reshape(crow2.shape[0], col.shape[-1]).to(torch.int64)


def _build_check(source: Source, block_rows: int, block_cols: int, nnz: int, *, proof: Snapshot) -> Pattern:
    # (source: rebuilt on the copy in proof, which the cache took before this runs)
    crow, col = source_indices(source)
    defect = pattern_defect(crow, col, block_rows, block_cols, nnz)
    if defect is not None:
        raise MalformedPatternError(defect)
    return Pattern(proof, source, (crow, col))


def _build_check_indices(indices_data: tuple[Any, ...], *extents: Any) -> bool:
    defect = indices_data_defect(indices_data, *extents)
    if defect is not None:
        raise MalformedPatternError(defect)
    return True


def _check_indices_from_key(
    fmt: str, tensors: tuple[torch.Tensor, ...], split_n: int, *extents: Any
) -> tuple[torch.Tensor, ...]:
    # (tensors: the cache's copies, which the verdict keeps and check_indices_data hands on)
    meta = () if fmt == "scatter_mm" else ({"SPLIT_N": split_n},)
    _build_check_indices((fmt, *tensors, *meta), *extents)
    return tensors


def _build_rows(source: Source) -> torch.Tensor:
    crow, col = indices(source)
    nnz = col.shape[-1]  # (crow[0, -1] is none without batches: a batch of size 0 still has nnz)
    # Block g lies in row r where crow[r] <= g < crow[r + 1].
    return torch.searchsorted(
        crow[:, 1:].contiguous(),
        torch.arange(nnz, device=crow.device).expand(crow.shape[0], nnz).contiguous(),
        right=True,
    )


def _build_transpose(source: Source, block_cols: int) -> TransposePlan:
    crow, col = indices(source)
    B, nnz = col.shape
    block_rows_ = crow.shape[1] - 1
    rows = derive("rows", source)
    batches = torch.arange(B, device=col.device)[:, None]  # (on the indices' device: CUDA plans too)
    # Order the blocks by (column, row): a stable sort of col * rows + row per batch.
    order_key = col * max(block_rows_, 1) + rows + batches * (block_cols * max(block_rows_, 1))
    perm = order_key.reshape(-1).argsort(stable=True).reshape(B, nnz) - batches * nnz
    col_t = rows.gather(1, perm)
    counts = torch.zeros(B, block_cols, dtype=torch.int64, device=col.device)
    counts.scatter_add_(1, col, torch.ones_like(col))
    crow_t = torch.cat([counts.new_zeros(B, 1), counts.cumsum(1)], dim=1)
    return TransposePlan(perm, crow_t, col_t)


_BUILDERS.update(check_indices=_check_indices_from_key, transpose=_build_transpose, rows=_build_rows)
