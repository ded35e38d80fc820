"""LRU memoization for functions of tensors whose entries die with their tensor arguments.

``functools.lru_cache`` cannot key on tensors by memory identity, and PyTorch's own plan cache (an
``lru_cache`` over ``TensorAsKey``) keeps every cached value alive until the LRU overflows, long after
the tensor it was computed from is gone. :func:`weak_lru_cache` fixes both:

* tensor arguments (positional, keyword, or inside tuples) are replaced by :class:`TensorKey`;
* each entry holds weak references, with callbacks, to its tensor arguments: when any of them is
  garbage-collected the entry is removed and everything it held is released at once;
* an in-place change of a tensor argument (its version counter moved) is a miss, and the entry is
  recomputed and replaced — a stale value is never returned;
* inference tensors have no version counter, so a call with one is computed and not cached.

Weakref callbacks can run at any bytecode, inside the garbage collector, possibly in a thread that holds
the cache lock. The callback therefore never blocks on the lock: it queues the dead key and removes it
only if it can take the lock without waiting; otherwise the lock holder removes it before releasing
(see ``_CacheState._release``), so the removal is never lost and never deadlocks.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch

from bsrkit.keys import TensorKey

__all__ = ["CacheInfo", "weak_lru_cache"]

F = TypeVar("F", bound=Callable[..., Any])


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    maxsize: int | None
    currsize: int
    nbytes: int
    dead_evictions: int


def _value_tensors(value: Any) -> list[Any]:
    """Tensors and numpy arrays held by a value, looking inside tuples, lists and dicts."""
    found: list[Any] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (torch.Tensor, np.ndarray)):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return found


def _nbytes(arrays: list[Any]) -> int:
    total = 0
    for a in arrays:
        if isinstance(a, np.ndarray):
            total += a.nbytes
        elif a.layout is torch.strided:
            total += a.untyped_storage().nbytes() if a.device.type == "meta" else a.nbytes
        else:  # sparse: count its member tensors
            total += sum(m.nbytes for m in _sparse_members(a))
    return total


def _sparse_members(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return (t.crow_indices(), t.col_indices(), t.values())
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return (t.ccol_indices(), t.row_indices(), t.values())
    if t.layout is torch.sparse_coo:
        return (t._indices(), t._values())
    return ()


def _pins(arrays: list[Any], key_tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The key tensor that some value array keeps alive (is, or is a view of), if any."""
    ids = {id(t) for t in key_tensors}
    for a in arrays:
        if id(a) in ids:
            return a
        base = a._base if isinstance(a, torch.Tensor) else a.base
        if base is not None and id(base) in ids:
            return base
    return None


class _Entry:
    __slots__ = ("nbytes", "refs", "value", "version")

    def __init__(self, value: Any, version: tuple[int, ...], nbytes: int, refs: list[Any]) -> None:
        self.value = value
        self.version = version
        self.nbytes = nbytes
        self.refs = refs  # weakrefs with callbacks; they must live as long as the entry


class _InFlight:
    """A computation in progress: other callers with the same key wait for it instead of recomputing."""

    __slots__ = ("done", "error", "value", "version")

    def __init__(self, version: tuple[int, ...]) -> None:
        self.version = version  # the argument versions this computation started from
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


_MISSING = object()


class _CacheState:
    def __init__(self, func: Callable[..., Any], maxsize: int | None, maxbytes: int | None) -> None:
        self.func = func
        self.maxsize = maxsize
        self.maxbytes = maxbytes
        self.entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.inflight: dict[Hashable, _InFlight] = {}
        self.lock = threading.Lock()
        self.dead: deque[Hashable] = deque()  # keys whose tensors died; removed under the lock
        self.hits = 0
        self.misses = 0
        self.nbytes = 0
        self.dead_evictions = 0

    # -- locking that cooperates with weakref callbacks -------------------------------------------
    def _release(self) -> None:
        while True:
            self._remove_dead()
            self.lock.release()
            # A callback may have queued a key after _remove_dead and failed to take the lock; take it
            # back and finish its work, so no dead entry outlives this call.
            if not self.dead or not self.lock.acquire(blocking=False):
                return

    def _remove_dead(self) -> None:
        while self.dead:
            key = self.dead.popleft()
            entry = self.entries.pop(key, None)
            if entry is not None:
                self.nbytes -= entry.nbytes
                self.dead_evictions += 1

    def on_dead(self, key: Hashable) -> None:
        self.dead.append(key)
        if self.lock.acquire(blocking=False):
            self._release()

    # -- the memoized call ------------------------------------------------------------------------
    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        key, tensors, version = _make_key(args, kwargs)
        if key is _UNCACHEABLE:
            return self.func(*args, **kwargs)
        lock = self.lock
        lock.acquire()
        entry = self.entries.get(key)
        if entry is not None and entry.version == version:  # the hot path, inlined
            self.entries.move_to_end(key)
            self.hits += 1
            if self.dead:
                self._release()
            else:
                lock.release()
                if self.dead and lock.acquire(blocking=False):  # a callback raced the release
                    self._release()
            return entry.value
        try:
            pending = self.inflight.get(key)
            if pending is None:
                pending = self.inflight[key] = _InFlight(version)
                owner = True
                self.misses += 1
            else:
                owner = False
                if pending.version == version:
                    self.hits += 1
        finally:
            self._release()

        if not owner and pending.version != version:
            # The running computation started before an in-place change: its value is stale for us.
            pending.done.wait()
            return self.call(args, kwargs)
        if not owner:
            pending.done.wait()
            if pending.error is not None:
                raise pending.error
            return pending.value

        try:
            value = self.func(*args, **kwargs)
            self._insert(key, value, version, tensors)
        except BaseException as exc:
            pending.error = exc
            raise
        else:
            pending.value = value
            return value
        finally:
            self.lock.acquire()
            try:
                del self.inflight[key]
            finally:
                self._release()  # applies removals queued by callbacks meanwhile
            pending.done.set()

    def _insert(
        self, key: Hashable, value: Any, version: tuple[int, ...], tensors: list[torch.Tensor]
    ) -> None:
        arrays = _value_tensors(value)
        pinned = _pins(arrays, tensors)
        if pinned is not None:
            raise ValueError(
                f"{self.func.__qualname__}(): the returned value references one of its own tensor "
                f"arguments (shape {tuple(pinned.shape)}, dtype {pinned.dtype}) or a view of it; "
                "caching it would keep that tensor alive forever, so the entry could never die. "
                "Return data derived from the argument (e.g. a clone) instead."
            )
        nbytes = _nbytes(arrays)
        if self.maxbytes is not None and nbytes > self.maxbytes:
            return  # larger than the whole budget: returned, never stored

        def callback(_ref: Any) -> None:
            self.on_dead(key)

        refs = [weakref.ref(t, callback) for t in tensors]
        self.lock.acquire()
        try:
            old = self.entries.pop(key, None)
            if old is not None:  # stale (version moved): replaced
                self.nbytes -= old.nbytes
            self.entries[key] = _Entry(value, version, nbytes, refs)
            self.nbytes += nbytes
            while self.entries and (
                (self.maxsize is not None and len(self.entries) > self.maxsize)
                or (self.maxbytes is not None and self.nbytes > self.maxbytes)
            ):
                _, evicted = self.entries.popitem(last=False)
                self.nbytes -= evicted.nbytes
        finally:
            self._release()

    def info(self) -> CacheInfo:
        self.lock.acquire()
        try:
            self._remove_dead()
            return CacheInfo(
                self.hits,
                self.misses,
                self.maxsize,
                len(self.entries),
                self.nbytes,
                self.dead_evictions,
            )
        finally:
            self._release()

    def clear(self) -> None:
        self.lock.acquire()
        try:
            self.entries.clear()
            self.dead.clear()
            self.hits = self.misses = self.nbytes = self.dead_evictions = 0
        finally:
            self._release()


class _Uncacheable(Exception):
    """An argument whose in-place changes cannot be seen (an inference tensor: no version counter)."""


_UNCACHEABLE: Any = object()


def _key_part(value: Any, name: Any, tensors: list[torch.Tensor], version: list[int]) -> Any:
    """``value`` as a key component. ``name`` (an index or keyword) only serves the error message."""
    if isinstance(value, torch.Tensor):
        if value.is_inference():
            raise _Uncacheable
        k = TensorKey(value)
        tensors.append(value)
        version.extend(k.version)
        return k
    if type(value) in _SCALARS:
        return value
    if isinstance(value, tuple):
        return tuple(_key_part(v, (name, i), tensors, version) for i, v in enumerate(value))
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"weak_lru_cache: argument {_describe(name)} must be a tensor or hashable, "
            f"got unhashable {type(value).__name__}"
        ) from None
    return value


_SCALARS = frozenset({int, float, str, bool, type(None)})


def _describe(name: Any) -> str:
    """'#0', "'scale'", or '#1[2]' for an item inside a tuple argument."""
    path = []
    while isinstance(name, tuple):
        name, index = name
        path.append(f"[{index}]")
    head = f"#{name}" if isinstance(name, int) else repr(name)
    return head + "".join(reversed(path))


_KWARGS_MARK = object()


def _make_key(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Hashable, list[torch.Tensor], tuple[int, ...]]:
    """(key, tensor arguments, their versions); the key is ``_UNCACHEABLE`` for inference tensors."""
    tensors: list[torch.Tensor] = []
    version: list[int] = []
    parts: list[Any] = []
    try:
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and not a.is_inference():  # common cases first, no call
                k = TensorKey(a)
                tensors.append(a)
                version += k.version
                parts.append(k)
            elif type(a) in _SCALARS:
                parts.append(a)
            elif type(a) is TensorKey:  # built by the caller, who holds its tensor
                t = a.obj
                if t is None:
                    raise ValueError(f"weak_lru_cache: argument #{i} is the TensorKey of a dead tensor")
                if t.is_inference():
                    raise _Uncacheable
                tensors.append(t)
                version += a.version
                parts.append(a)
            else:
                parts.append(_key_part(a, i, tensors, version))
        if kwargs:
            parts.append(_KWARGS_MARK)
            for name in sorted(kwargs):
                parts.append(name)
                parts.append(_key_part(kwargs[name], name, tensors, version))
    except _Uncacheable:
        return _UNCACHEABLE, tensors, ()
    return tuple(parts), tensors, tuple(version)


def weak_lru_cache(maxsize: int | None = 128, maxbytes: int | None = None) -> Callable[[F], F]:
    """Decorator: memoize a function of tensors; entries die with their tensor arguments.

    Parameters
    ----------
    maxsize:
        Most entries kept (LRU order); ``None`` for no bound.
    maxbytes:
        Bound on the sum of ``nbytes`` of the tensors (and numpy arrays) held in cached values, looking
        inside tuples, lists and dicts; ``None`` for no bound. A single value larger than the bound is
        returned but not stored.

    A caller that has built the :class:`TensorKey` of a live tensor may pass the key in the tensor's
    place (the function then receives the key; ``key.obj`` is the tensor).

    The wrapper has ``cache_info()`` -> :class:`CacheInfo` ``(hits, misses, maxsize, currsize, nbytes,
    dead_evictions)``, ``cache_clear()`` and ``__wrapped__``. Concurrent calls with the same key run the
    function once; the others wait and count as hits; an exception reaches every waiter and nothing is
    cached. A value that is (or is a view of) one of its own tensor arguments is refused with a
    ``ValueError``: it would keep the tensor, hence the entry, alive forever.
    """
    if callable(maxsize) and maxbytes is None:  # used bare: @weak_lru_cache
        return weak_lru_cache()(maxsize)
    if maxsize is not None and (not isinstance(maxsize, int) or maxsize < 0):
        raise ValueError(f"weak_lru_cache(): expected maxsize to be None or an int >= 0, got {maxsize!r}")
    if maxbytes is not None and (not isinstance(maxbytes, int) or maxbytes < 0):
        raise ValueError(f"weak_lru_cache(): expected maxbytes to be None or an int >= 0, got {maxbytes!r}")

    def decorate(func: F) -> F:
        state = _CacheState(func, maxsize, maxbytes)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return state.call(args, kwargs)

        wrapper.cache_info = state.info  # type: ignore[attr-defined]
        wrapper.cache_clear = state.clear  # type: ignore[attr-defined]
        wrapper._cache_state = state  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate
