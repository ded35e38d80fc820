"""LRU memoization for functions of tensors whose entries die with the memory of their tensor arguments.

``functools.lru_cache`` cannot key on tensors by memory identity, and PyTorch's own plan cache (an
``lru_cache`` over ``TensorAsKey``) keeps every cached value alive until the LRU overflows, long after
the tensor it was computed from is gone. :func:`weak_lru_cache` fixes both:

* tensor arguments (positional, keyword, or inside tuples) are replaced by :class:`TensorKey`, so any
  tensor object viewing the same memory the same way finds the entry (``x[0]`` re-created per call, a BSR
  tensor rebuilt every step from the same index tensors);
* an entry lives as long as the memory its keys name (the storages, see :mod:`bsrkit.keys`), not as long
  as one Python wrapper: when the last tensor on that memory dies, the entry's value is released at once,
  by reference counting alone; the entry itself (its key, which holds the call's other arguments) leaves
  the table at the next call of the function or of its ``cache_info()``, ``cache_clear()``;
* an in-place change of a tensor argument through it (its version counter moved) is a miss, and the
  entry is recomputed and replaced; with ``verify_contents=True`` so is any change of the data, whatever
  wrote it (a hit compares a copy: see :mod:`bsrkit.freshness` and :func:`weak_lru_cache`);
* inference tensors have no version counter, so a call with one (or with a sparse tensor built on inference
  index tensors) is computed and not cached.

Interrupts. A ``KeyboardInterrupt`` (or any exception a signal handler raises) can arrive between any two
bytecodes of the main thread, and weakref callbacks run wherever a reference count reaches zero, inside
cache operations too. Neither may leave the lock held or the table inconsistent:

* the lock is only taken by ``with self.lock:``: ``threading.Lock.__enter__`` either acquires or raises,
  and the protected region starts at the next instruction, so the lock is released however the block ends;
* the weakref callbacks are C functions (``functools.partial(dict.pop, 0)`` drops the value,
  ``deque.append`` queues the dead key): they run no Python bytecode, so they can neither be interrupted
  nor block, and they never take the lock; the next lock holder removes queued entries from the table;
* under the lock, state changes are ordered so that an interrupt between any two of them leaves a
  consistent table: the byte count is derived from the entries (never a running total), and a dead key
  leaves the queue only after its entry has left the table;
* a computation in progress is announced by a latch (a lock its owner holds) that the owner releases as
  the first statement of a ``finally``; a waiter that finds it released with no result (the owner was
  interrupted) computes the value itself.

Only the statistics can lose one count to an interrupt (``dead_evictions``, between removing an entry and
counting it).
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, TypeVar

import torch

from bsrkit.cached_values import nbytes_of, pinning_array, value_arrays
from bsrkit.call_keys import UNCACHEABLE, make_key
from bsrkit.freshness import Snapshot, content_tensors, with_data
from bsrkit.keys import TensorKey
from bsrkit.validation import type_name

__all__ = ["CacheInfo", "weak_lru_cache"]

F = TypeVar("F", bound=Callable[..., Any])


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    maxsize: int | None
    currsize: int
    nbytes: int
    dead_evictions: int
    # Hits refused because the data the entry was derived from changed (see verify_contents); each is
    # also counted as a miss.
    stale: int = 0


class _DeathNotice(weakref.ref):
    """A weak reference whose callback (``deque.append``, a C function) queues it; ``key`` names the entry."""

    __slots__ = ("key",)
    key: Hashable


class _Entry:
    __slots__ = ("cell", "nbytes", "refs", "version")

    def __init__(self, cell: dict[int, Any], version: tuple[int, ...], nbytes: int, refs: list[Any]) -> None:
        # {0: (value, proof)}: the proof is the copy of the arguments' data the value was derived from
        # (verify_contents; else None). A weakref callback pops both the moment a storage dies (the copy
        # can be as large as the data: an attention mask's).
        self.cell = cell
        self.version = version
        self.nbytes = nbytes
        self.refs = refs  # weakrefs with callbacks; they must live as long as the entry


class _InFlight:
    """A computation in progress: other callers with the same key wait for it instead of recomputing."""

    __slots__ = ("error", "latch", "ok", "owner", "proof", "value", "version")

    def __init__(self, version: tuple[int, ...]) -> None:
        self.version = version  # the argument versions this computation started from
        self.owner = threading.get_ident()  # (its own recursive calls must not wait for it)
        # Held by the owner until it is done; waiters pass through it. A lock, not an Event: releasing
        # it is one C call, which an interrupt cannot cut in half.
        self.latch = threading.Lock()
        self.latch.acquire()
        self.ok = False
        self.value: Any = None
        self.proof: Snapshot | None = None  # (what the value was derived from: a waiter proves it too)
        self.error: BaseException | None = None


_MISSING = object()


def _fresh_locks_in_child() -> None:
    """A forked child has only the forking thread: a cache lock another thread of the parent held at the
    fork, or a computation it had in flight (whose latch no thread of the child will release), would
    stay so for ever. New locks, and no computation in flight (a caller computes again)."""
    for state in list(_STATES):
        state.lock = threading.Lock()
        state.inflight = {}


class _CacheState:
    def __init__(
        self,
        func: Callable[..., Any],
        maxsize: int | None,
        maxbytes: int | None,
        verify_contents: bool,
        pass_snapshot: bool,
    ) -> None:
        self.func = func
        self.maxsize = maxsize
        self.maxbytes = maxbytes
        self.verify_contents = verify_contents
        self.pass_snapshot = pass_snapshot
        self.entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.inflight: dict[Hashable, _InFlight] = {}
        self.lock = threading.Lock()
        _STATES.add(self)
        # Death notices of entries' storages, appended by weakref callbacks (without the lock); the
        # lock holder removes their entries (see _sweep).
        self.dead: deque[_DeathNotice] = deque()
        self.hits = 0
        self.misses = 0
        self.dead_evictions = 0
        self.stale = 0

    # -- under the lock ---------------------------------------------------------------------------
    def _sweep(self) -> None:
        """Remove the entries whose memory died (their values are gone already). Lock held."""
        dead, entries = self.dead, self.entries
        while dead:
            # The notice leaves the queue last: an interrupt before that repeats a harmless pop.
            if entries.pop(dead[0].key, None) is not None:
                self.dead_evictions += 1
            dead.popleft()

    def _evict(self) -> list[_Entry]:
        """Enforce maxsize and maxbytes, least recently used first. Lock held. Returns the evicted
        entries, for the caller to drop after releasing the lock (a value's destructor may run any code,
        even code that calls this cache)."""
        entries = self.entries
        evicted = []
        if self.maxsize is not None:
            while len(entries) > self.maxsize:
                evicted.append(entries.popitem(last=False)[1])
        if self.maxbytes is not None:
            total = sum(e.nbytes for e in entries.values())
            while entries and total > self.maxbytes:
                evicted.append(entries.popitem(last=False)[1])
                total -= evicted[-1].nbytes
        return evicted

    # -- the memoized call ------------------------------------------------------------------------
    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        key, keys, version = make_key(args, kwargs)
        if key is UNCACHEABLE:
            return self._compute(args, kwargs)[0]
        mine: _InFlight | None = None
        reentrant = False
        try:
            while True:
                unproven: _Entry | None = None
                pending: _InFlight | None = None
                with self.lock:
                    if self.dead:
                        self._sweep()
                    entry = self.entries.get(key)
                    if entry is not None and entry.version == version:  # the hot path
                        held = entry.cell.get(0)
                        if held is not None:
                            value, proof = held
                            self.entries.move_to_end(key)
                            if proof is None:
                                self.hits += 1
                                return value
                            unproven = entry  # (the data is compared outside the lock; a hit once proven)
                    if unproven is None:
                        pending = self.inflight.get(key)
                        if pending is None or not pending.latch.locked():
                            # Nobody computes it (a released latch left here is an interrupted owner's).
                            mine = _InFlight(version)
                            self.inflight[key] = mine
                            self.misses += 1
                            break
                        if pending.owner == threading.get_ident():
                            # The computing thread calls it again (recursion): waiting for its own
                            # latch would never end. A plain call, uncached, as functools.lru_cache's.
                            self.misses += 1
                            reentrant = True
                            break
                # (hits proven outside the lock are counted without it: plain counters, see info)
                if unproven is not None:
                    if proof.unchanged():
                        self.hits += 1
                        return value
                    # Derived from data that has changed since: not a hit. Drop the entry and look again.
                    with self.lock:
                        self.stale += 1
                        if self.entries.get(key) is unproven:
                            del self.entries[key]
                    del unproven, value, held, proof  # (the stale value and copy die here, outside the lock)
                    continue
                if pending is None:  # (not reached: the lock's block returned, broke or set one)
                    continue
                # Another caller computes this key: wait outside the cache lock.
                with pending.latch:
                    pass
                if pending.version == version:
                    if pending.ok:
                        # (the owner's snapshot may predate a write no counter saw: proven as a hit is;
                        # if not, the entry it left is found stale next)
                        if pending.proof is None or pending.proof.unchanged():
                            self.hits += 1
                            return pending.value
                        continue
                    error = pending.error
                    # (as a value: computed from the data this call passed, or it computes its own)
                    if isinstance(error, Exception) and (pending.proof is None or pending.proof.unchanged()):
                        self.hits += 1
                        pending = None  # (no cycle: error -> its traceback -> this frame -> error)
                        try:
                            raise error
                        finally:
                            error = None
                # The computation started before an in-place change (stale for us), its owner was
                # interrupted, or its error was computed from data written since: look again.
            if reentrant:
                return self._compute(args, kwargs)[0]
            assert mine is not None
            value, proof = self._compute(args, kwargs, mine)
            self._insert(key, keys, value, version, proof)
            mine.value, mine.proof = value, proof
            mine.ok = True
            return value
        except Exception as exc:
            if mine is not None:
                mine.error = exc
            raise
        finally:
            if mine is not None:
                mine.latch.release()  # first, so no interrupt can keep the waiters waiting
                with self.lock:
                    if self.inflight.get(key) is mine:
                        del self.inflight[key]
                mine = None  # (no cycle: its error -> the traceback -> this frame -> mine -> its error)

    def _compute(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], inflight: _InFlight | None = None
    ) -> tuple[Any, Snapshot | None]:
        """``(func's value, the snapshot it was derived from)``. With ``verify_contents``, func reads the
        snapshot's copy of its tensor arguments' data, never their memory (see :mod:`bsrkit.freshness`):
        each tensor argument (or the tensor of a :class:`TensorKey`) is replaced by one of the same
        metadata on that copy."""
        if not self.verify_contents:
            inflight = None  # (its frame, in an error's traceback, must not hold the computation: a cycle)
            return self.func(*args, **kwargs), None
        found: list[torch.Tensor] = []

        def collect(t: torch.Tensor) -> torch.Tensor:
            found.append(t)
            return t

        _map_tensors((args, kwargs), collect)
        data = [content_tensors(t) for t in found]
        flat = [d for parts in data for d in parts]
        proof = Snapshot(flat)
        if inflight is not None:  # (before the call: waiters prove an error against it too)
            inflight.proof = proof
            inflight = None
        copies = iter(proof.copies(flat))
        pairs = zip(found, data, strict=True)
        twins = iter([with_data(t, tuple(next(copies) for _ in parts)) for t, parts in pairs])
        args, kwargs = _map_tensors((args, kwargs), lambda _: next(twins))
        if self.pass_snapshot:
            kwargs = {**kwargs, "snapshot": proof}
        return self.func(*args, **kwargs), proof

    def _insert(
        self,
        key: Hashable,
        keys: list[TensorKey],
        value: Any,
        version: tuple[int, ...],
        proof: Snapshot | None,
    ) -> None:
        anchors: list[Any] = []
        for k in keys:
            objs = k.anchors()
            if objs is None:
                return  # its memory is gone already: nothing could ever hit the entry
            anchors.extend(objs)
        arrays = value_arrays(value)
        graphed = next((a for a in arrays if isinstance(a, torch.Tensor) and a.grad_fn is not None), None)
        if graphed is not None:
            raise ValueError(
                f"{self.func.__qualname__}(): the returned value carries an autograd graph (a tensor of "
                f"shape {tuple(graphed.shape)} with grad_fn {type(graphed.grad_fn).__name__}): caching it "
                "would keep the graph, and the tensors it saved (the arguments among them), alive forever, "
                "and a second backward through it would fail. Compute it under torch.no_grad() or return "
                ".detach()ed tensors."
            )
        pinned = pinning_array(arrays, anchors)
        if pinned is not None:
            what = (
                f"a storage of {pinned.nbytes()} bytes"
                if isinstance(pinned, torch.UntypedStorage)
                else f"shape {tuple(pinned.shape)}, dtype {pinned.dtype}"
            )
            raise ValueError(
                f"{self.func.__qualname__}(): the returned value shares memory with one of its tensor "
                f"arguments ({what}): a view of it, the tensor itself, its storage, or an alias of its "
                "memory. Cached, it would change with every in-place write to the argument, and could "
                "keep that memory alive forever (the entry would never die). Return data derived from "
                "the argument (e.g. a clone) instead."
            )
        nbytes = nbytes_of(arrays)
        if self.maxbytes is not None and nbytes > self.maxbytes:
            return  # larger than the whole budget: returned, never stored

        cell = {0: (value, proof)}
        drop = functools.partial(cell.pop, 0)  # called with the dead weakref: cell.pop(0, ref)
        refs: list[Any] = []
        seen: set[int] = set()
        for a in anchors:
            if id(a) not in seen:
                seen.add(id(a))
                refs.append(weakref.ref(a, drop))
                notice = _DeathNotice(a, self.dead.append)
                notice.key = key
                refs.append(notice)
        entry = _Entry(cell, version, nbytes, refs)
        with self.lock:
            if self.dead:
                self._sweep()
            # Pop first: assigning over an equal key would keep the old key object, not the notices'.
            stale = self.entries.pop(key, None)  # a stale entry (its version moved) is replaced
            self.entries[key] = entry
            evicted = self._evict()
        del stale, evicted  # their values die here, outside the lock

    def info(self) -> CacheInfo:
        with self.lock:
            if self.dead:
                self._sweep()
            entries = self.entries
            for e in entries.values():  # (a value may have grown since: a pattern's plans are built later)
                held = e.cell.get(0)
                if held is not None:
                    e.nbytes = nbytes_of(value_arrays(held[0]))
            return CacheInfo(
                self.hits,
                self.misses,
                self.maxsize,
                len(entries),
                sum(e.nbytes for e in entries.values()),
                self.dead_evictions,
                self.stale,
            )

    def clear(self) -> None:
        with self.lock:
            dropped, self.entries = self.entries, OrderedDict()
            self.dead.clear()
            self.hits = self.misses = self.dead_evictions = self.stale = 0
        del dropped  # the values die here, outside the lock


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with every tensor (and the tensor of every :class:`TensorKey`) replaced by ``fn`` of it,
    looking inside tuples and dicts (the arguments' tuple and keywords), in a fixed order."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, TensorKey):  # (TensorAsKey too)
        obj = value.obj
        if obj is None:  # (not reached: the caller holds the tensor)
            raise ValueError("weak_lru_cache: a TensorKey argument of a dead tensor")
        return fn(obj)
    if isinstance(value, tuple):
        items = [_map_tensors(v, fn) for v in value]
        kind = type(value)
        if kind is tuple:
            return tuple(items)
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value  # (a tuple subclass holding no tensor reaches the function as itself)
        make = getattr(kind, "_make", None)  # (a namedtuple reaches the function as one)
        if make is not None:
            return make(items)
        if hasattr(kind, "n_sequence_fields"):  # (torch.return_types: a structseq, built from a sequence)
            return kind(items)
        # (another subclass: its own __new__ may take other arguments than an iterable; what it set on the
        # object goes along)
        rebuilt = tuple.__new__(kind, items)
        if hasattr(value, "__dict__"):
            rebuilt.__dict__.update(value.__dict__)
        return rebuilt
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


# The cache_clear of each of bsrkit's own memoized functions (the plans, the attention's block biases and
# broadcast patterns, the transformers integration's masks): bsrkit.cache_clear() empties them all.
_library_caches: list[Callable[[], None]] = []


# Every cache's state, for _fresh_locks_in_child.
_STATES: weakref.WeakSet[_CacheState] = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_locks_in_child)


def library_cache(fn: F) -> F:
    """Mark a :func:`weak_lru_cache` function as one of bsrkit's own (see :func:`clear_library_caches`)."""
    _library_caches.append(fn.cache_clear)  # type: ignore[attr-defined]
    return fn


def clear_library_caches() -> None:
    """Empty every cache marked with :func:`library_cache` and reset its statistics."""
    for clear in _library_caches:
        clear()


def weak_lru_cache(
    maxsize: int | None = 128,
    maxbytes: int | None = None,
    *,
    verify_contents: bool = False,
    pass_snapshot: bool = False,
) -> Callable[[F], F]:
    """Decorator: memoize a function of tensors; entries die with the memory of their tensor arguments.

    Parameters
    ----------
    maxsize:
        Most entries kept (LRU order); ``None`` for no bound.
    maxbytes:
        Bound on the sum of ``nbytes`` of the tensors (and numpy arrays, storages, ``bytes``) held in
        cached values, looking inside tuples, lists, dicts and objects whose class lists what they own
        (a method ``cache_footprint(self)``); ``None`` for no bound. A single value larger than the bound
        is returned but not stored. A value is weighed when stored; ``cache_info().nbytes`` weighs every
        value as it is then (a value that grows, like a pattern's plans, counts what it holds now).
    verify_contents:
        Keep a copy of the tensor arguments' data with each entry (for a sparse compressed tensor, of its
        indices, which is what its key names) and compare it on every hit (see
        :mod:`bsrkit.freshness`). The copy's bytes are not counted in ``maxbytes``. The function then
        reads that copy, never the arguments' memory: it receives, for each tensor argument (or
        :class:`TensorKey`), a tensor of the same shape, strides, dtype, device and values whose data
        is the copy (its storage offset and storage size are the copy's own: 0 and the copied span; a
        sparse compressed tensor: its indices; its values hold no memory and must not be read). The
        copies do not require grad (a cached value cannot carry a graph: see below).
    pass_snapshot:
        With ``verify_contents``: also pass the :class:`~bsrkit.freshness.Snapshot` the value is derived
        from, as the keyword ``snapshot`` (for a value that proves itself later, like a ``Pattern``).

    **What a hit guarantees.** Without ``verify_contents``: the tensor arguments view the same memory in
    the same way as when the value was computed (live storages, offsets, shapes, strides, dtypes), and
    their version counters have not moved: no torch op changed the data *through the tensors passed*.
    Writes that move no counter the key sees are not detected: numpy, DLPack or ctypes views, ``.data``,
    storage copies, other processes, collectives, and an in-place op through another alias of the memory
    with its own counter (the index tensors a sparse tensor was built from). With
    ``verify_contents=True``: the data is also byte-for-byte what the value was computed from, whatever
    wrote it, on CPU; on CUDA only under ``BSRKIT_CHECK_PLANS=1`` (the comparison synchronises). The
    trade-off is the user's: a hit then reads every byte of its tensor arguments (a memcmp: about
    0.2 µs for a few hundred bytes, ~20 GB/s beyond). A hit refused because the data changed counts in
    ``stale`` and as a miss, and the value is recomputed and replaced.

    A tensor argument is keyed by :class:`TensorKey` (memory identity: storage, offset, shape, strides,
    dtype; for a sparse compressed tensor, those of its indices). Its entry lives while that memory is in
    use by any tensor, so views re-created on each call and sparse tensors rebuilt from the same indices
    hit; its value is released as soon as the last tensor on that memory dies, and the entry (with its
    key, which holds the other arguments: a method's ``self``) leaves the table at the next call of the
    function, ``cache_info()`` or ``cache_clear()`` (a weakref callback cannot take the table's lock).

    A caller that has built the :class:`TensorKey` of a live tensor may pass the key in the tensor's
    place (the function then receives the key, ``key.obj`` the tensor; with ``verify_contents`` the copy).
    Tensors may also come inside tuples (a namedtuple reaches the function as itself, and is not the
    call of a plain tuple); any other argument is keyed by its hash and type, so one holding a tensor or
    array (a frozen dataclass, a frozenset, a module) is a ``TypeError``: its hash would not follow the
    tensor's data.

    The wrapper has ``cache_info()`` -> :class:`CacheInfo` ``(hits, misses, maxsize, currsize, nbytes,
    dead_evictions, stale)``, ``cache_clear()`` and ``__wrapped__``. Concurrent calls with the same key
    run the function once; the others wait and count as hits; an ``Exception`` reaches every waiter (with
    ``verify_contents``, every waiter whose data is still what the call read: another computes its own)
    and nothing is cached (after a ``KeyboardInterrupt`` in the running call, a waiter computes the value
    itself). A value that shares memory with one of its tensor arguments (the tensor, a view of it, its
    storage, an alias of its memory such as ``torch.from_dlpack``'s; inside tuples, lists, deques,
    dicts, sets and objects' attributes) is refused with a ``ValueError``: it would keep that memory,
    hence the entry, alive forever; so is one that carries an autograd graph (a tensor with a
    ``grad_fn``), whose saved tensors would.
    Scalar arguments are keyed with their type (``2``, ``2.0`` and ``True`` are three keys; so are
    ``0.0`` and ``-0.0``).
    """
    if callable(maxsize) and maxbytes is None:  # used bare: @weak_lru_cache
        return weak_lru_cache()(maxsize)
    if maxsize is not None and (not isinstance(maxsize, int) or maxsize < 0):
        raise ValueError(f"weak_lru_cache(): expected maxsize to be None or an int >= 0, got {maxsize!r}")
    if maxbytes is not None and (not isinstance(maxbytes, int) or maxbytes < 0):
        raise ValueError(f"weak_lru_cache(): expected maxbytes to be None or an int >= 0, got {maxbytes!r}")
    if not isinstance(verify_contents, bool):
        raise TypeError(
            f"weak_lru_cache(): expected verify_contents to be a bool, got {type_name(verify_contents)}"
        )
    if not isinstance(pass_snapshot, bool) or (pass_snapshot and not verify_contents):
        raise ValueError(
            f"weak_lru_cache(): expected pass_snapshot to be a bool, True only with verify_contents=True, "
            f"got {pass_snapshot!r} with verify_contents={verify_contents!r}"
        )

    def decorate(func: F) -> F:
        state = _CacheState(func, maxsize, maxbytes, verify_contents, pass_snapshot)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return state.call(args, kwargs)

        wrapper.cache_info = state.info  # type: ignore[attr-defined]
        wrapper.cache_clear = state.clear  # type: ignore[attr-defined]
        wrapper._cache_state = state  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate
