"""What a repeated call may skip, in one place: checked calls, kept operands and prepared kernel calls.

A weight or mask is usually multiplied many times with operands of the same shapes. Four tables let
such a call skip work an earlier call did:

1. **Checked calls** (:func:`checked_call`): a call's *signature* (the metadata of its arguments: types,
   layouts, dtypes, devices, shapes, scalars, grad mode and the forced backend; built by
   :mod:`bsrkit.ops`) maps to its :class:`CheckedCall`, the outcome of its argument checks. A call with
   the same signature skips the checks; they read no data, so the signature decides them.
2. **Kept operands** (:func:`kept_operand`): a product with the same BSR tensor *object* (the *wrapper*)
   as before reuses its :class:`~bsrkit.operand.Operand` (index and values aliases, plan key and the
   validated :class:`~bsrkit.plans.Pattern`), skipping the key build and the plan cache's lock.
3. **Prepared calls** (:func:`prepared_call`): a backend's marshaled kernel call (``rerun(values, dense,
   out)``, see :meth:`bsrkit.backends.base.Backend.addmm`), kept under a key of everything it depends on
   but the data addresses: for a call with a checked call, on the kept operand (``Operand.calls``: its
   values' layout is fixed, so the key is the checked call's identity and the dense operand's and
   output's strides and offsets); for any other, on the operand's ``Pattern`` (shared by every wrapper of
   the pattern, so the key holds every layout, scalar and parameter). Backends return prepared calls;
   they never keep them.
4. **Kept weights** (:func:`kept_weight`): a layer's weight given as parts (``crow``, ``col``,
   ``values``: :class:`bsrkit.nn.BSRLinear`, the custom ops) maps to one BSR wrapper of them, so that its
   products take the three shortcuts above instead of building a wrapper and a plan key per call. Its
   products are kept by the input's whole layout (:class:`WeightCall`): the checked call, and the
   prepared call last run with the kept operand, which a call of the same layout and tuning state reruns
   by data addresses (:func:`bsrkit.dispatch.rerun_weight_call_directly`).

**The one rule every hit obeys**: a hit is served only when everything the skipped work read is provably
what it was when the entry was made:

- metadata, by equality of the whole key (a table never matches a prefix or a hash alone);
- index data, by the content proof of :mod:`bsrkit.freshness`: a kept operand is served only while its
  pattern's :class:`~bsrkit.freshness.Snapshot` is unchanged (and the wrapper has the same TensorImpl and
  version counter, so the snapshot is of its members), and every other way to an operand goes through the
  plan cache, whose hits compare the same proof. Prepared calls hang on the ``Pattern`` that proof
  belongs to: a changed pattern gets a new ``Pattern`` and so no old prepared call;
- the one deferred proof: a product that can rerun a prepared call whose loop compares the index data
  itself (``rerun.proves``: the CPU loops of bsr @ dense) takes the kept operand with only the cheap half
  of the proof (:meth:`~bsrkit.freshness.Snapshot.intact`: storages alive, unmoved, large enough), and
  trusts nothing derived from the index data until that loop's verdict (or, on any other way, the full
  proof in :func:`bsrkit.dispatch.addmm`); a loop that finds a difference raises :class:`StalePattern`,
  and the product is recomputed on the rebuilt pattern (:func:`forget_operand`, see
  :func:`bsrkit.ops.checked_addmm`);
- tuning state, by identity of the table and warnings that chose the parameters;
- a weight call's direct rerun, by the kept weight it was found on (its key holds every layout the
  prepared call's own key is made of) and identity of the tuning state; only a call whose loop proves the
  index data is rerun so (the deferred proof above), and it needs no kept operand: the part objects hold
  the index storages, at the addresses and extents the loop compares (the cheap half of the proof);
- a kept weight, by identity of the three part objects and equality of their data addresses, shapes,
  strides, dtypes and devices (what ``.data =``, ``set_`` or ``resize_`` would change); their contents are
  the wrapper's members' and so proven as above (values are data, never part of a plan).

**Bounds.** A table that reaches its bound is cleared whole (hits stay O(1); a workload that cycles
through more signatures than the bound only pays the checks again): :data:`CHECKED_CALLS_MAX` signatures,
:data:`CALLS_PER_PATTERN` prepared calls per pattern and per kept operand, one kept operand per live
wrapper and one kept weight per live ``values`` tensor (each entry goes when its object dies, by a
C-function weakref callback). None of them holds a tensor alive beyond its
owner: kept operands hold aliases of the wrapper's own members, prepared calls hold addresses and index
arrays, not operands (a vector loop's call on a copy of dense also keeps that scratch copy, refilled each
call, at most 1 MiB: up to 16 MiB a pattern or operand, which ``cache_info().nbytes`` does not count).

:func:`info` counts hits and misses (plain counters: exact in one thread, approximate under
concurrent calls); :func:`clear` empties every table.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, NamedTuple

import torch

from bsrkit import cache, plans

# (Operands and backends are typed Any here: this module sits below both, which use it.)
Operand = Any

__all__ = [
    "CALLS_PER_PATTERN",
    "CHECKED_CALLS_MAX",
    "CheckedCall",
    "ShortcutInfo",
    "StalePattern",
    "WeightCall",
    "cache_clear",
    "checked_call",
    "clear",
    "forget_operand",
    "info",
    "keep_checked_call",
    "keep_operand",
    "keep_prepared_call",
    "keep_weight_call",
    "kept_operand",
    "kept_weight",
    "prepared_call",
    "proven_in_loop",
]

CHECKED_CALLS_MAX = 1024
CALLS_PER_PATTERN = 16


class CheckedCall(NamedTuple):
    """The outcome of a product's argument checks (:func:`bsrkit.ops.checked_addmm`): what the call
    computes, decided by its signature alone. Each is a distinct object per signature (prepared calls
    are keyed by its identity)."""

    differentiable: bool
    backend: Any  # the bsrkit.backends.base.Backend that runs it
    batch: torch.Size
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    K: int
    out_numel: int
    like_dense: int  # 0: out is allocated on its own; else like dense (see bsrkit.ops)


class WeightCall:
    """A kept weight's product with inputs of one layout (the key in :func:`kept_weight`'s table): its
    checked call and, once a prepared call that proves in its loop ran it, ``remembered``: that call's
    ``(operand, rerun, tuning state)``, set and read as one tuple (two threads calling one layer never see
    a call with another's tuning state). Holds no tensor: the operand holds aliases of the kept wrapper's
    members, which the same table entry holds anyway."""

    __slots__ = ("checked", "remembered")

    def __init__(self, checked: CheckedCall) -> None:
        self.checked = checked
        self.remembered: tuple[Operand, Any, tuple[Any, Any]] | None = None


class ShortcutInfo(NamedTuple):
    """Counters of the three tables (see the module's docstring)."""

    checked_hits: int
    checked_misses: int
    checked_calls: int  # signatures held
    operand_hits: int
    kept_operands: int  # wrappers held
    call_hits: int
    call_misses: int  # products that prepared (and returned) a call to keep
    loop_proofs: int  # prepared calls whose loop compared the kept operand's index data (a deferred proof)
    loop_stale: int  # ... and found it changed: recomputed on the rebuilt pattern
    weight_hits: int
    kept_weights: int  # weights (values tensors) held


class StalePattern(Exception):
    """A kept operand's index data changed since its pattern was judged, found by a deferred proof (see
    the module's docstring): nothing derived from it may be used; the product is computed again."""


# checked_hits, checked_misses, operand_hits, call_hits, call_misses, loop_proofs, loop_stale, weight_hits
_counts = [0, 0, 0, 0, 0, 0, 0, 0]

_checked: dict[tuple[Any, ...], CheckedCall] = {}


def checked_call(signature: tuple[Any, ...]) -> CheckedCall | None:
    """The checked call of an earlier call with this signature, or None."""
    found = _checked.get(signature)
    _counts[found is None] += 1
    return found


def keep_checked_call(signature: tuple[Any, ...], checked: CheckedCall) -> None:
    if len(_checked) >= CHECKED_CALLS_MAX:
        _checked.clear()
    _checked[signature] = checked


# -- kept operands ----------------------------------------------------------------------------------------
#
# Valid while the wrapper has the same TensorImpl (``_cdata``), the same version counter value
# (``_version``) and its index data is unchanged (the pattern's snapshot). The first two say that it still
# has the members it had, so that the snapshot is of their memory:
# - the version counter of a sparse compressed tensor is shared by the aliases its accessors return
#   (``crow_indices()``, ``col_indices()``, ``values()``), so an in-place change through any of them bumps
#   it, and so does every op that gives it new members (``copy_``, ``resize_as_sparse_``, ``zero_``), in
#   inference mode too (tests/test_cache_lifetime.py checks these facts of torch);
# - ``torch.utils.swap_tensors`` refuses a tensor with weak references (the entry holds one), and the
#   TensorImpl comparison catches any other swap.
# Inference tensors (no version counter) are never kept.

# - neither says which memory the members view: ``member.data = t``, ``member.set_(...)`` (on the tensors a
#   wrapper was built from, which *are* its members) re-point a member without any counter the wrapper
#   or its aliases share, and the operand's aliases keep the old memory alive (and unchanged: the snapshot
#   would pass). So a hit also compares the members' addresses and layouts, read through the accessors
#   (~8 µs of a tiny call: the price of the promise); a kept weight's wrapper skips it
#   (``members_proven``: its parts, which are its members, were compared by kept_weight in the same call).
# - nor that the wrapper has its shape: ``bsr.data = <a BSR of the same members, another size>`` keeps its
#   TensorImpl, version and members, so a hit compares its (M, K) with the operand's as well.

# id(wrapper) -> (ref to it, its TensorImpl address, its version, the operand, its pattern's snapshot,
#                 its members' layout, its shape)
_operands: dict[int, tuple[Any, ...]] = {}


def _member_layout(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor) -> tuple[Any, ...]:
    """Which memory a wrapper's members view, and how (one flat tuple: this runs on every kept hit)."""
    return (
        crow.data_ptr(), crow.shape, crow.stride(), crow.dtype, crow.is_neg(),
        col.data_ptr(), col.shape, col.stride(), col.dtype, col.is_neg(),
        values.data_ptr(), values.shape, values.stride(), values.dtype, values.is_neg(),
    )  # fmt: skip


def kept_operand(
    bsr: torch.Tensor, compare: bool | None = None, members_proven: bool = False
) -> Operand | None:
    """The operand kept for this very ``bsr`` (:func:`keep_operand`), or None when it may have changed
    since. A hit counts as a hit of the plan cache too (it stands for one).

    ``compare``: None, the whole proof (:meth:`~bsrkit.freshness.Snapshot.unchanged`, under
    ``$BSRKIT_CHECK_PLANS``); True, its cheap half only (``intact``: None where that cannot stand for it,
    a snapshot of device memory), the caller comparing the index data before it trusts anything derived
    from it (a deferred proof: see the module's docstring); False, nothing (the caller read
    ``$BSRKIT_CHECK_PLANS=0``). ``members_proven``: the caller has proven that ``bsr``'s members view
    what they viewed (a kept weight's wrapper), else they are compared here."""
    seen = _operands.get(id(bsr))
    if seen is None or seen[0]() is not bsr or seen[1] != bsr._cdata or seen[2] != bsr._version:
        return None
    if not members_proven and (
        seen[5] != _member_layout(bsr.crow_indices(), bsr.col_indices(), bsr.values()) or bsr.shape != seen[6]
    ):
        return None  # a member re-pointed (.data =, set_), or the wrapper resized (bsr.data = another)
    if compare is None:
        if not seen[4].unchanged():
            return None  # its pattern was written since: the caller rebuilds (and revalidates) it
    elif compare and not seen[4].intact():
        return None
    _counts[2] += 1
    plans.count_hit()
    return seen[3]


def keep_operand(bsr: torch.Tensor, version: int, operand: Operand) -> None:
    """Keep ``bsr``'s validated operand (built from its members when its version was ``version``) for
    :func:`kept_operand`. ``operand`` must not hold ``bsr`` itself (the entry would never die)."""
    if bsr.is_inference() or operand.pattern is None:
        return
    # The entry goes when the object dies, by a C function (no Python code runs in a weakref callback:
    # see bsrkit.cache); its id cannot be reused before that, as the callback runs while it is freed.
    forget = functools.partial(_operands.pop, id(bsr))  # called as pop(id, ref)
    proof = operand.pattern.proof  # (of the memory of bsr's members: the pattern's key names it)
    members = _member_layout(operand.crow, operand.col, operand.values)
    shape = torch.Size((*operand.batch, operand.M, operand.K))  # (the wrapper's, as the operand saw it)
    _operands[id(bsr)] = (weakref.ref(bsr, forget), bsr._cdata, version, operand, proof, members, shape)


def forget_operand(bsr: torch.Tensor, a: Operand) -> None:
    """Drop what a deferred proof found stale (:class:`StalePattern`): ``bsr``'s kept operand ``a`` and
    what hangs on its pattern (plans and prepared calls). The next product rebuilds them through the plan
    cache, which compares the index data again (and revalidates a changed pattern)."""
    seen = _operands.get(id(bsr))
    if seen is not None and seen[3] is a:
        _operands.pop(id(bsr), None)
    if a.pattern is not None:
        a.pattern.forget()


def proven_in_loop(differ: int) -> None:
    """Count a deferred proof made by a prepared call's loop (``differ``: the entries it found changed);
    raise :class:`StalePattern` if any."""
    if differ:
        _counts[6] += 1
        raise StalePattern
    _counts[5] += 1


# -- kept weights -----------------------------------------------------------------------------------------

# id(values) -> (ref to values, {(id(crow), id(col)): (crow, col, the three parts' layouts, the wrapper,
#                                                     its checked calls)})
_weights: dict[int, tuple[Any, ...]] = {}
# Index tensors a values tensor keeps a wrapper for: the layer's own and its eager backward's copy.
WEIGHT_SLOTS = 2


def _layouts(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor) -> tuple[Any, ...]:
    """What a wrapper of the parts depends on besides their identity and contents (one flat tuple: this
    runs on every layer call). The negative bit too: a view carrying it reads the same memory as another
    value (``torch._neg_view``)."""
    return (
        crow.data_ptr(), crow.shape, crow.stride(), crow.dtype, crow.device, crow.is_neg(),
        col.data_ptr(), col.shape, col.stride(), col.dtype, col.is_neg(),
        values.data_ptr(), values.shape, values.stride(), values.dtype, values.device, values.is_neg(),
    )  # fmt: skip


def kept_weight(
    crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, size: tuple[int, int]
) -> tuple[Any, dict[Any, WeightCall]]:
    """The BSR tensor of shape ``size`` made of these parts (``values`` detached), kept while the three
    are the same objects with the same layouts (see the module's docstring); a new one otherwise. It is
    not validated here: its products validate its pattern (once per pattern). With it, a table of its
    products (:class:`WeightCall`) for the caller to fill, keyed by the other operands' layouts (the
    weight's is fixed while it is kept), at most :data:`CALLS_PER_PATTERN` (:func:`keep_weight_call`).
    A values tensor keeps at most :data:`WEIGHT_SLOTS` of them, by index tensors: a layer's buffers for
    its forward, and the validated copy its eager backward computes with."""
    layouts = _layouts(crow, col, values)
    held = _weights.get(id(values))
    slot = (id(crow), id(col))
    if held is not None and held[0]() is values:
        seen = held[1].get(slot)
        if (
            seen is not None
            and seen[0] is crow
            and seen[1] is col
            and seen[2] == layouts
            and seen[3].shape == size
        ):
            _counts[7] += 1
            return seen[3], seen[4]
    # (parts made under inference mode, e.g. a layer loaded there: a wrapper made outside it could not
    # view them, so it is an inference tensor too, whose accessors work anywhere)
    inference = crow.is_inference() or col.is_inference() or values.is_inference()
    # (and of plain parts a plain one, also under the caller's inference mode: an inference wrapper is
    # never cached or kept, so a layer first called there stayed uncached in every mode and thread)
    with torch.inference_mode(inference):
        bsr = torch.sparse_bsr_tensor(crow, col, values.detach(), size=size, check_invariants=False)
    calls: dict[Any, WeightCall] = {}
    if not values.is_inference():  # (an inference tensor takes no weak reference)
        if held is None or held[0]() is not values:
            forget = functools.partial(_weights.pop, id(values))  # called as pop(id, ref): see keep_operand
            held = (weakref.ref(values, forget), {})
            _weights[id(values)] = held
        slots = held[1]
        slots.pop(slot, None)
        while len(slots) >= WEIGHT_SLOTS:  # (the oldest goes; another thread may have emptied it)
            try:
                slots.pop(next(iter(slots)), None)
            except (StopIteration, RuntimeError):
                break
        # (crow and col held as objects: the layer's buffers, alive as long as it is, or the copies)
        slots[slot] = (crow, col, layouts, bsr, calls)
    return bsr, calls


def forget_weight(values: torch.Tensor) -> None:
    """Drop the kept weight of ``values`` (and its weak reference: ``torch.utils.swap_tensors``, which a
    module conversion may use, refuses a tensor that has one)."""
    _weights.pop(id(values), None)


def keep_weight_call(calls: dict[Any, WeightCall], key: tuple[Any, ...], checked: CheckedCall) -> None:
    """Keep ``checked`` in a kept weight's table (:func:`kept_weight`)."""
    if len(calls) >= CALLS_PER_PATTERN:
        calls.clear()
    calls[key] = WeightCall(checked)


# -- prepared calls ---------------------------------------------------------------------------------------


def prepared_call(
    a: Operand, key: tuple[Any, ...], checked: CheckedCall | None, tuning_state: tuple[Any, Any]
) -> Any:
    """The prepared call kept for ``key`` (on the kept operand ``a`` for a call with ``checked``; else on
    its pattern), made for the same checked call (by identity) and the same tuning state
    (:func:`bsrkit.tuning.resolve_state`, by identity); None when there is none."""
    table = _table(a, checked)
    if table is None:
        return None
    kept = table.get(key)
    if (
        kept is None
        or kept[0] is not checked
        or kept[1] is not tuning_state[0]
        or kept[2] is not tuning_state[1]
    ):
        return None
    _counts[3] += 1
    return kept[3]


def keep_prepared_call(
    a: Operand, key: tuple[Any, ...], checked: CheckedCall | None, tuning_state: tuple[Any, Any], rerun: Any
) -> None:
    """Keep ``rerun`` (a backend's prepared call) for :func:`prepared_call`."""
    table = _table(a, checked)
    _counts[4] += 1
    if table is None:
        return
    if len(table) >= CALLS_PER_PATTERN:
        table.clear()
    table[key] = (checked, tuning_state[0], tuning_state[1], rerun)


def _table(a: Operand, checked: CheckedCall | None) -> dict[Any, Any] | None:
    """Where ``a``'s prepared calls for calls with (``checked``) or without a checked call are kept."""
    if checked is not None:
        return a.calls
    return a.pattern.calls if a.pattern is not None else None


def info() -> ShortcutInfo:
    """Hits, misses and sizes of the shortcut tables."""
    (
        checked_hits,
        checked_misses,
        operand_hits,
        call_hits,
        call_misses,
        loop_proofs,
        loop_stale,
        weight_hits,
    ) = _counts
    return ShortcutInfo(
        checked_hits, checked_misses, len(_checked), operand_hits, len(_operands), call_hits, call_misses,
        loop_proofs, loop_stale, weight_hits, len(_weights),
    )  # fmt: skip


def clear() -> None:
    """Forget every checked call, kept operand and kept weight and reset the counters (prepared calls live
    on their patterns: :func:`cache_clear` drops those too)."""
    _checked.clear()
    _operands.clear()
    _weights.clear()
    _counts[:] = [0] * len(_counts)


def cache_clear() -> None:
    """Drop every cached plan, every shortcut and everything else bsrkit memoizes (the attention's block
    biases and broadcast patterns, the transformers integration's masks), and reset all statistics
    (``bsrkit.cache_clear``)."""
    clear()
    cache.clear_library_caches()  # (the plans among them)
