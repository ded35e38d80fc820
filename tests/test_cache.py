import collections
import contextlib
import functools
import gc
import threading
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bsrkit
from bsrkit import CacheInfo, TensorKey, weak_lru_cache


def counting(maxsize=128, maxbytes=None):
    calls = []

    @weak_lru_cache(maxsize=maxsize, maxbytes=maxbytes)
    def f(t, scale=1):
        calls.append(1)
        return t * scale  # a new tensor: derived, not the argument itself

    return f, calls


def test_hit_for_same_view_miss_for_other():
    f, calls = counting()
    t = torch.arange(4.0)
    a = f(t)
    assert f(t) is a
    assert f(t.view(4)) is a  # another object, same memory and view
    f(t.clone())
    f(t, scale=2)
    assert len(calls) == 3


def test_exact_cache_info_after_scripted_sequence():
    f, _ = counting(maxsize=2)
    x, y, z = torch.ones(2), torch.ones(3), torch.ones(4)
    f(x)  # miss
    f(x)  # hit
    f(y)  # miss
    f(z)  # miss, evicts x (LRU)
    f(y)  # hit
    f(x)  # miss, evicts z
    del y
    gc.collect()  # y's entry dies
    assert f.cache_info() == CacheInfo(
        hits=2, misses=4, maxsize=2, currsize=1, nbytes=x.nbytes, dead_evictions=1
    )
    f.cache_clear()
    assert f.cache_info() == CacheInfo(0, 0, 2, 0, 0, 0)


@pytest.mark.parametrize("how", ["positional", "keyword", "tuple"])
def test_entry_and_value_die_with_the_argument(how):
    @weak_lru_cache()
    def f(*args, **kwargs):
        (t,) = [*args, *kwargs.values()]
        if isinstance(t, tuple):
            t = t[0]
        return (t + 1, {"twice": t * 2})

    t = torch.ones(1000)
    if how == "positional":
        value = f(t)
    elif how == "keyword":
        value = f(t=t)
    else:
        value = f((t, 3))
    refs = [weakref.ref(value[0]), weakref.ref(value[1]["twice"])]
    del value
    assert f.cache_info().currsize == 1
    assert all(r() is not None for r in refs)  # held by the cache while t lives
    del t
    # No gc.collect(): reference counting alone must free the entry and its tensors at once.
    assert all(r() is None for r in refs)
    info = f.cache_info()
    assert (info.currsize, info.nbytes, info.dead_evictions) == (0, 0, 1)


def test_torch_lru_cache_pattern_leaks_but_ours_does_not():
    # functools.lru_cache over TensorKey (PyTorch's pattern) keeps the value after the tensor dies.
    @functools.lru_cache(maxsize=8)
    def plain(key):
        return key.obj + 1

    @weak_lru_cache(maxsize=8)
    def weak(t):
        return t + 1

    t = torch.ones(10)
    leaked = weakref.ref(plain(TensorKey(t)))
    freed = weakref.ref(weak(t))
    del t
    gc.collect()
    assert leaked() is not None  # the known leak
    assert freed() is None


def test_value_referencing_its_argument_is_refused():
    @weak_lru_cache()
    def same(t):
        return t

    @weak_lru_cache()
    def view(t):
        return (t.view(-1), 1)

    @weak_lru_cache()
    def in_dict(t):
        return {"a": [t]}

    for f in (same, view, in_dict):
        with pytest.raises(ValueError, match="keep that memory alive forever"):
            f(torch.ones(2))
        assert f.cache_info().currsize == 0


def test_in_place_change_is_a_miss_never_stale():
    @weak_lru_cache()
    def total(t):
        return t.sum()

    t = torch.ones(4)
    assert total(t) == 4
    t.add_(1)
    assert total(t) == 8
    info = total.cache_info()
    assert (info.misses, info.hits, info.currsize) == (2, 0, 1)


def test_maxsize_lru_order():
    f, calls = counting(maxsize=2)
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    f(a)
    f(b)
    f(a)  # a is now most recent
    f(c)  # evicts b
    n = len(calls)
    f(a)
    assert len(calls) == n
    f(b)
    assert len(calls) == n + 1


def test_maxbytes_bound_and_lru_order():
    f, calls = counting(maxsize=None, maxbytes=100)
    a, b, c = torch.ones(10), torch.ones(10), torch.ones(10)  # 40 bytes each
    f(a)
    f(b)
    f(a)
    f(c)  # 120 > 100: evicts b
    info = f.cache_info()
    assert info.nbytes == 80 and info.currsize == 2
    n = len(calls)
    f(a)
    f(c)
    assert len(calls) == n
    huge = torch.ones(100)  # 400 bytes: returned but never stored
    f(huge)
    assert f.cache_info().currsize == 2


def test_unhashable_argument_named():
    f, _ = counting()
    with pytest.raises(TypeError, match="argument 'scale'.*unhashable list"):
        f(torch.ones(1), scale=[1])
    with pytest.raises(TypeError, match=r"argument #0"):
        f({"a": 1})


def test_colliding_hashes_do_not_collide(monkeypatch):
    f, calls = counting()
    monkeypatch.setattr(TensorKey, "__hash__", lambda self: 42)
    a, b = torch.ones(2), torch.zeros(2)
    assert torch.equal(f(a), a)
    assert torch.equal(f(b), b)
    assert len(calls) == 2


def test_non_tensor_and_non_weakrefable_arguments_by_value():
    calls = []

    @weak_lru_cache()
    def f(x, y):
        calls.append(1)
        return (x, y)

    f(1, (2, "s"))
    f(1, (2, "s"))
    f(1.0, None)
    assert len(calls) == 2


def test_stampede_computes_once():
    n = 8
    barrier = threading.Barrier(n)
    release = threading.Event()
    calls = []

    @weak_lru_cache()
    def slow(t):
        calls.append(1)
        release.wait(5)
        return t + 1

    t = torch.ones(3)
    results = [None] * n

    def worker(i):
        barrier.wait()
        results[i] = slow(t)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    while not calls:
        pass
    release.set()
    for th in threads:
        th.join()
    assert len(calls) == 1
    assert all(r is results[0] for r in results)
    info = slow.cache_info()
    assert (info.misses, info.hits) == (1, n - 1)


@pytest.mark.parametrize("verify", [False, True])
def test_exception_reaches_every_waiter_and_nothing_is_cached(verify):
    """The function runs once: with verify_contents an error is proven for a waiter as a value is (the
    data unchanged, it is shared)."""
    n = 4
    barrier = threading.Barrier(n)
    release = threading.Event()
    runs = []

    @weak_lru_cache(verify_contents=verify)
    def boom(t):
        runs.append(1)
        release.wait(5)
        raise RuntimeError("no")

    t = torch.ones(1)
    errors = []

    def worker():
        barrier.wait()
        try:
            boom(t)
        except RuntimeError as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for th in threads:
        th.start()
    threading.Timer(0.2, release.set).start()
    for th in threads:
        th.join()
    assert len(errors) == n
    assert len(runs) == 1 and boom.cache_info().hits == n - 1
    assert boom.cache_info().currsize == 0


def test_death_while_lock_held_by_same_thread_releases_the_value_and_queues_the_entry():
    f, _ = counting()
    t = torch.ones(3)
    value = weakref.ref(f(t))
    state = f._cache_state
    with state.lock:  # as if the tensor died inside a cache operation of this thread
        del t  # the weakref callbacks run now, with the lock held: C functions, no lock taken
        assert value() is None  # the value is released at once
        assert len(state.dead) == 1 and len(state.entries) == 1  # the entry waits for the lock
    info = f.cache_info()  # the next lock holder removes it
    assert (info.currsize, info.nbytes, info.dead_evictions) == (0, 0, 1)
    assert not state.dead and not state.entries


def test_reference_cycles_collected_by_gc_evict():
    f, _ = counting()

    class Holder:
        pass

    h = Holder()
    h.self = h
    h.t = torch.ones(5)
    f(h.t)
    del h
    assert f.cache_info().currsize == 1  # only the cycle collector can free it
    gc.collect()
    assert f.cache_info().currsize == 0


def test_wrapped_and_bare_decorator():
    def g(t):
        return t + 1

    wrapped = weak_lru_cache(g)
    assert wrapped.__wrapped__ is g
    assert weak_lru_cache(maxsize=3)(g).cache_info().maxsize == 3
    with pytest.raises(ValueError, match="maxsize"):
        weak_lru_cache(maxsize=-1)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["call", "kill", "mutate"]), st.integers(0, 4)), max_size=40))
def test_random_call_sequences_match_a_model(script):
    """Against a model: a dict of live entries with LRU order, versions and deaths."""
    maxsize = 3
    calls = []

    @weak_lru_cache(maxsize=maxsize)
    def f(t):
        calls.append(1)
        return t.sum().clone()

    tensors = {i: torch.full((i + 1,), float(i)) for i in range(5)}
    model = {}  # i -> version at compute time; insertion order = LRU order
    for action, i in script:
        if action == "kill":
            tensors.pop(i, None)
            model.pop(i, None)
            continue
        if i not in tensors:
            tensors[i] = torch.full((i + 1,), float(i))
        t = tensors[i]
        if action == "mutate":
            t.add_(1)
            continue
        n = len(calls)
        value = f(t)
        assert value == t.sum()
        hit = model.get(i) == t._version
        assert (len(calls) == n) == hit
        model.pop(i, None)
        model[i] = t._version
        while len(model) > maxsize:
            model.pop(next(iter(model)))
        assert f.cache_info().currsize == len(model)


def test_waiter_with_a_newer_version_recomputes():
    started, release = threading.Event(), threading.Event()

    @weak_lru_cache()
    def total(t):
        value = t.sum().item()
        started.set()
        release.wait(5)
        return torch.tensor(value)

    x = torch.ones(4)
    results = {}
    th = threading.Thread(target=lambda: results.__setitem__("a", total(x)))
    th.start()
    started.wait(5)
    x.add_(1)  # the running computation is now stale for later callers
    threading.Timer(0.2, release.set).start()
    results["b"] = total(x)
    th.join()
    assert results["a"].item() == 4 and results["b"].item() == 8


def test_prebuilt_key_argument_shares_the_entry_and_its_lifetime():
    @weak_lru_cache()
    def f(t):
        t = t.obj if isinstance(t, TensorKey) else t
        return t * 2

    x = torch.ones(3)
    first = f(x)
    assert f(TensorKey(x)) is first  # a caller's key finds the tensor's entry
    assert f.cache_info().hits == 1
    dead = TensorKey(torch.ones(2))  # its tensor is gone at once
    with pytest.raises(ValueError, match="dead tensor"):
        f(dead)
    with torch.inference_mode():
        y = torch.ones(3)
    f(TensorKey(y))  # inference tensors are computed, never cached
    assert f.cache_info().currsize == 1
    ref = weakref.ref(x)
    del x, first
    assert ref() is None and f.cache_info().currsize == 0


def test_sparse_argument_on_inference_indices_is_computed_never_cached():
    """A BSR built outside inference mode on index tensors made inside it: no counter sees a write through
    its accessors, so a cached value could go stale (it was served, 1 stale hit)."""
    with torch.inference_mode():
        crow, col = torch.tensor([0, 1, 2]), torch.tensor([0, 1])
    b = torch.sparse_bsr_tensor(crow, col, torch.randn(2, 2, 2), size=(4, 4))

    @weak_lru_cache()
    def pattern(t):
        t = t.obj if isinstance(t, TensorKey) else t
        return t.col_indices().tolist()

    assert pattern(b) == [0, 1]
    with torch.inference_mode():
        b.col_indices().copy_(torch.tensor([1, 0]))
    assert pattern(b) == [1, 0]
    assert pattern(TensorKey(b)) == [1, 0]
    assert pattern.cache_info().currsize == 0
    with torch.inference_mode():  # (an inference tensor of a layout no key takes: computed as well)
        coo = torch.eye(3).to_sparse()
    count = weak_lru_cache()(lambda t: t._nnz())
    assert count(coo) == 3 and count.cache_info().currsize == 0


def test_evicted_values_die_outside_the_lock():
    """A value's destructor may run any code, even a call of the same cache: dropping values (eviction,
    cache_clear) must not deadlock."""
    log = []

    class Finalized:
        def __del__(self):
            log.append(f(torch.ones(1)))  # a call of the same cache, from a destructor

    @weak_lru_cache(maxsize=1)
    def f(t):
        return Finalized() if t.numel() == 2 else t.numel()

    def run():
        a, b = torch.ones(2), torch.ones(3)
        f(a)
        f(b)  # evicts a's value; its destructor calls f
        f(a)
        f.cache_clear()  # drops a's value again
        log.append("done")

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(10)
    assert log == [1, 1, "done"]


class _Owner:
    """A value that is not a container and lists what it owns (as bsrkit.plans.Pattern does)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.parts = [t, t]  # the same tensor twice: counted once
        self.raw = b"12345"
        self.unowned = torch.ones(100)  # not listed: not counted

    def cache_footprint(self):
        return (self.parts, {"raw": self.raw})


def test_nbytes_counts_what_a_value_lists_once_and_bytes_objects():
    @weak_lru_cache(maxsize=None)
    def f(t):
        return _Owner(t * 2)

    t = torch.ones(10)  # 40 bytes
    f(t)
    assert f.cache_info().nbytes == 40 + 5


def test_maxbytes_weighs_a_listed_footprint():
    @weak_lru_cache(maxsize=None, maxbytes=100)
    def f(t):
        return _Owner(t * 2)

    a, b, c = torch.ones(10), torch.ones(10), torch.ones(10)  # 45 bytes a value
    f(a)
    f(b)
    f(c)  # 135 > 100: evicts a's
    assert (f.cache_info().currsize, f.cache_info().nbytes) == (2, 90)


def test_plan_cache_nbytes_counts_a_patterns_indices_and_the_plans_built_later():
    import bsrkit
    from bsrkit import plans
    from bsrkit.cached_values import nbytes_of, value_arrays

    plans.cache_clear()
    crow, col = torch.tensor([0, 2, 3, 3]), torch.tensor([0, 2, 1])
    values = torch.randn(3, 4, 4)
    b = torch.sparse_bsr_tensor(crow, col, values, size=(12, 12))
    bsrkit.bsr_dense_mm(b, torch.randn(12, 5))
    first = plans.cache_info().nbytes
    assert first >= crow.nbytes + col.nbytes  # (the pattern's validated copy of the indices, at least)
    values.requires_grad_(True)
    bt = torch.sparse_bsr_tensor(crow, col, values, size=(12, 12))
    x = torch.randn(12, 5, requires_grad=True)
    bsrkit.bsr_dense_mm(bt, x).sum().backward()  # (the backward builds the transpose plan of the pattern)
    state = plans._plan._cache_state
    info = plans.cache_info()
    held = [e.cell[0][0] for e in state.entries.values()]  # (value, proof)
    assert info.nbytes == sum(nbytes_of(value_arrays(v)) for v in held) > first
    del b, bt, crow, col, values, x
    gc.collect()
    assert plans.cache_info().nbytes == 0


def test_a_recursive_call_with_the_same_key_completes():
    """The computing thread calling the function again with the same arguments (recursion) must not wait
    on its own in-flight latch (it hung for ever); it computes, uncached, as functools.lru_cache does."""
    depth = []

    @weak_lru_cache()
    def recursive(x, n):
        depth.append(n)
        return recursive(x, n) if len(depth) < 3 else n

    x = torch.ones(2)
    result = []
    worker = threading.Thread(target=lambda: result.append(recursive(x, 5)), daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive() and result == [5] and len(depth) == 3
    assert recursive(x, 5) == 5 and len(depth) == 3  # the outer call's value is cached


def test_a_view_of_an_argument_inside_an_object_is_refused_and_its_bytes_counted():
    """A value that is not a container (a dataclass, an object with slots) holding a view of its tensor
    argument would pin that memory for ever as much as a tuple holding it: refused the same way; what it
    holds of its own counts in nbytes."""
    import dataclasses

    @dataclasses.dataclass
    class Plan:
        head: torch.Tensor

    class Slotted:
        __slots__ = ("part",)

        def __init__(self, part):
            self.part = part

    @weak_lru_cache(maxsize=None)
    def pinning(x, kind):
        return Plan(x[:4]) if kind == "dataclass" else Slotted([x[:4]])

    @weak_lru_cache(maxsize=None)
    def owning(x):
        return Plan(x[:4].clone())

    x = torch.randn(1000)
    for kind in ("dataclass", "slots"):
        with pytest.raises(ValueError, match="shares memory with one of its tensor arguments"):
            pinning(x, kind)
    owning(x)
    assert owning.cache_info().nbytes == 16
    storage = weakref.ref(x.untyped_storage())
    del x
    gc.collect()
    assert storage() is None and owning.cache_info().currsize == 0


def test_a_value_aliasing_its_argument_through_another_storage_or_container_is_refused():
    """An alias with a storage object of its own (from_dlpack, frombuffer, numpy's from_dlpack) and views
    inside a deque, a dict's keys or a memoryview kept the argument's memory alive: 50 such entries of
    1 MiB each outlived their arguments."""
    makers = {
        "from_dlpack": lambda x: torch.from_dlpack(x),
        "frombuffer": lambda x: torch.frombuffer(memoryview(x.numpy()), dtype=torch.float32),
        "numpy from_dlpack": lambda x: np.from_dlpack(x)[1:],
        "deque": lambda x: collections.deque([x[:2]]),
        "dict key": lambda x: {x[:2]: 1},
        "memoryview": lambda x: memoryview(x.numpy()),
    }
    for name, make in makers.items():
        cached = weak_lru_cache(maxsize=None)(make)
        with pytest.raises(ValueError, match="shares memory with one of its tensor arguments"):
            cached(torch.ones(1000))
        assert cached.cache_info().currsize == 0, name
    owning = weak_lru_cache(maxsize=None)(lambda x: collections.deque([x.numpy().copy()]))
    x = torch.ones(1000)
    owning(x)
    storage = weakref.ref(x.untyped_storage())
    del x
    gc.collect()
    assert storage() is None and owning.cache_info().currsize == 0


def test_a_value_capturing_its_argument_in_a_function_is_refused():
    """A closure, a default, a bound method or a functools.partial holding the argument would pin its
    memory: the entry could never die (and the memory never be freed)."""

    class Holder:
        def __init__(self, t):
            self.t = t

        def scale(self, y):
            return y * self.t

    makers = {
        "closure": lambda x: lambda y: y * x.sum(),
        "default": lambda x: lambda y, x=x: y * x,
        "method": lambda x: Holder(x[:2]).scale,
        "partial": lambda x: functools.partial(torch.mul, x),
        "partial keyword": lambda x: functools.partial(torch.add, other=x),
    }
    for name, make in makers.items():
        cached = weak_lru_cache(maxsize=None)(make)
        x = torch.ones(1000)
        with pytest.raises(ValueError, match="shares memory with one of its tensor arguments"):
            cached(x)
        assert cached.cache_info().currsize == 0, name

    @weak_lru_cache(maxsize=None)
    def owning(x):
        total = x.sum()
        return lambda y: y * total  # (captures derived data only: cached, and dies with x)

    x = torch.ones(1000)
    assert owning(x)(2.0) == 2000.0
    storage = weakref.ref(x.untyped_storage())
    del x
    gc.collect()
    assert storage() is None and owning.cache_info().currsize == 0


def test_the_copy_a_verified_entry_holds_dies_with_its_memory():
    """The copy of the arguments' data (as large as the data: a transformers attention mask's) outlived
    the tensor until the cache's next call (16 MiB after a padded 2048-token prefill of batch 4)."""
    from bsrkit.freshness import Snapshot

    def snapshots() -> int:
        gc.collect()
        return sum(isinstance(o, Snapshot) for o in gc.get_objects())

    @weak_lru_cache(maxsize=8, verify_contents=True)
    def total(t):
        return t.sum().clone()

    before = snapshots()
    x = torch.ones(1 << 16)
    assert total(x).item() == 1 << 16 and snapshots() == before + 1
    del x
    assert snapshots() == before  # (no call of total since)

    seen = []

    @weak_lru_cache(maxsize=8, verify_contents=True)
    def counted(t):
        seen.append(snapshots())
        return t.sum().clone()

    x = torch.ones(1 << 16)
    counted(x)
    x.numpy()[:] = 2.0
    assert counted(x).item() == 2 << 16
    assert seen == [before + 1, before + 1]  # (the stale entry's copy is gone before the recompute)


def test_verify_contents_hands_the_function_its_arguments_negative_and_conjugate_bits():
    """With verify_contents the function runs on the kept copy of its argument's bytes: it must read it
    as the argument reads (a negative or conjugate view holds the memory of another value)."""

    @weak_lru_cache(maxsize=8, verify_contents=True)
    def total(t):
        return t.sum().clone()

    x = torch.arange(6.0)
    assert total(torch._neg_view(x)).item() == -15.0
    z = torch.tensor([1 + 2j, 3 - 1j])
    assert total(z.conj()).item() == (4 - 1j)
    assert total(z.conj().imag).item() == -1.0


def test_a_value_carrying_an_autograd_graph_is_refused():
    """Its saved tensors (the argument among them) would keep the entry alive forever."""

    @weak_lru_cache(maxsize=8)
    def gram(w):
        return w @ w.T

    w = torch.randn(16, 16, requires_grad=True)
    with pytest.raises(ValueError, match=r"gram\(\): the returned value carries an autograd graph"):
        gram(w)
    assert gram.cache_info().currsize == 0
    with torch.no_grad():
        torch.testing.assert_close(gram(w), w.detach() @ w.detach().T)
    assert gram.cache_info().currsize == 1


def test_scalars_equal_in_python_but_not_to_the_function_are_distinct_keys():
    @weak_lru_cache(maxsize=8)
    def scale(t, s):
        return t * s

    t = torch.tensor([1, 2, 3])
    assert scale(t, 2).dtype == torch.int64
    assert scale(t, 2.0).dtype == torch.float32
    assert scale(t, True).dtype == torch.int64 and scale(t, True).tolist() == [1, 2, 3]
    f = torch.ones(2)
    assert torch.equal(1 / scale(f, 0.0), torch.full((2,), torch.inf))
    assert torch.equal(1 / scale(f, -0.0), torch.full((2,), -torch.inf))
    assert scale.cache_info().misses == 5 and scale(t, 2).dtype == torch.int64


def test_numpy_and_complex_scalars_are_keyed_with_their_type_and_signs():
    @weak_lru_cache(maxsize=16)
    def scale(t, s):
        return t * s

    t, f = torch.tensor([1, 2, 3]), torch.ones(2)
    assert scale(t, np.int64(2)).dtype == torch.int64
    assert scale(t, np.float64(2.0)).dtype == torch.float32  # (equal to np.int64(2), and hashed alike)
    assert torch.equal(1 / scale(f, np.float64(0.0)), torch.full((2,), torch.inf))
    assert torch.equal(1 / scale(f, np.float64(-0.0)), torch.full((2,), -torch.inf))
    assert scale(f, 1 + 0j).dtype == torch.complex64 and scale(f, 1).dtype == torch.float32
    assert scale.cache_info().misses == 6 and scale(t, np.int64(2)).dtype == torch.int64

    @weak_lru_cache(maxsize=4)
    def imaginary(t, s):
        return torch.full_like(t, s.imag)

    assert torch.equal(1 / imaginary(f, complex(0.0, -0.0)), torch.full((2,), -torch.inf))
    assert torch.equal(1 / imaginary(f, complex(0.0, 0.0)), torch.full((2,), torch.inf))


@pytest.mark.parametrize(
    "make",
    [lambda: torch.eye(3).to_sparse(), lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])],
    ids=["coo", "nested"],
)
def test_a_tensor_that_cannot_be_keyed_is_named(make):
    @weak_lru_cache(maxsize=8)
    def f(x, y=None):
        return 1

    with pytest.raises(TypeError, match="weak_lru_cache: argument #0"):
        f(make())
    with pytest.raises(TypeError, match="weak_lru_cache: argument 'y'"):
        f(torch.ones(2), y=make())


def test_a_caller_waiting_for_another_threads_computation_gets_a_proven_value():
    """The owner's snapshot may predate a write no version counter saw (numpy): the waiter, which started
    after it, must not take the value derived from the old data (it did, unproven)."""
    started, release = threading.Event(), threading.Event()

    @weak_lru_cache(verify_contents=True)
    def total(t):
        s = float(t.sum())  # (the snapshot's copy, taken before this runs)
        started.set()
        release.wait(10)
        return torch.tensor(s)

    t = torch.zeros(4)
    owner = threading.Thread(target=lambda: total(t))
    owner.start()
    assert started.wait(10)
    t.numpy()[:] = 1.0  # (after the owner's snapshot; no version counter moves)
    threading.Timer(0.3, release.set).start()
    got = total(t)  # (waits for the owner)
    owner.join(10)
    assert float(got) == 4.0
    assert float(total(t)) == 4.0 and total.cache_info().stale == 1


def test_a_caller_waiting_for_another_threads_failing_computation_gets_its_own_verdict():
    """An owner's error was handed to a waiter unproven: a waiter that started after a write no version
    counter saw got the error of the old data (bsrkit: "malformed pattern" for a repaired one)."""
    started, release = threading.Event(), threading.Event()

    @weak_lru_cache(verify_contents=True)
    def positive_total(t):
        started.set()
        release.wait(10)
        if (t < 0).any():
            raise ValueError(f"negative entry in {t.tolist()}")
        return t.sum().clone()

    t = torch.tensor([-1.0, 2.0])
    owner_error = []

    def owner():
        try:
            positive_total(t)
        except ValueError as e:
            owner_error.append(str(e))

    thread = threading.Thread(target=owner)
    thread.start()
    assert started.wait(10)
    t.numpy()[0] = 1.0  # (after the owner's snapshot; no version counter moves)
    threading.Timer(0.3, release.set).start()
    got = positive_total(t)  # (waits for the owner, then computes on its own data)
    thread.join(10)
    assert owner_error == ["negative entry in [-1.0, 2.0]"] and float(got) == 3.0


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("waiters", [0, 2])
def test_a_raising_call_frees_its_arguments_without_the_cycle_collector(waiters, verify):
    """The error held the call's frame, which held the computation the error was stored in: a cycle that
    kept the arguments (a failed product's operands) alive until the cycle collector ran."""
    release = threading.Event()

    @weak_lru_cache(verify_contents=verify)
    def boom(t):
        release.wait(5)
        raise RuntimeError("no")

    box = [torch.ones(1000)]
    alive = weakref.ref(box[0])

    def call():
        with contextlib.suppress(RuntimeError):
            boom(box[0])

    gc.collect()
    gc.disable()
    try:
        threads = [threading.Thread(target=call) for _ in range(waiters)]
        for th in threads:
            th.start()
        threading.Timer(0.2, release.set).start()
        call()
        for th in threads:
            th.join(10)
        box.clear()
        del threads
        assert alive() is None
        crow, col = torch.tensor([0, 2, 1]), torch.tensor([0, 1])  # (crow decreases: malformed)
        values, x = torch.randn(2, 2, 2), torch.randn(4, 3)
        bsr = torch.sparse_bsr_tensor(crow, col, values, size=(4, 4), check_invariants=False)
        refs = weakref.ref(values), weakref.ref(x)
        with pytest.raises(ValueError, match="malformed bsr"):
            bsrkit.bsr_dense_mm(bsr, x)
        del bsr, crow, col, values, x
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()


def test_a_value_holding_its_argument_through_a_tensor_attribute_is_refused():
    """A tensor's Python attributes were not looked into: the entry pinned the argument for ever."""

    @weak_lru_cache(maxsize=None)
    def summary(t):
        s = t.sum().clone()
        s.source = t
        return s

    with pytest.raises(ValueError, match="shares memory with one of its tensor arguments"):
        summary(torch.randn(8))
    assert summary.cache_info().currsize == 0


def test_a_refused_stale_hit_is_never_counted_even_with_a_clear_inside_the_proof(monkeypatch):
    """A hit was counted before its proof and taken back after it: a clear() in between left hits at -1."""
    from bsrkit import freshness

    @weak_lru_cache(verify_contents=True)
    def total(t):
        return t.sum().clone()

    t = torch.zeros(4)
    total(t)
    t.numpy()[0] = 1.0
    real = freshness.Snapshot.unchanged

    def clear_then_compare(self):
        total.cache_clear()
        return real(self)

    monkeypatch.setattr(freshness.Snapshot, "unchanged", clear_then_compare)
    assert float(total(t)) == 1.0
    info = total.cache_info()
    assert info.hits >= 0 and info.misses >= 0, info


def test_a_given_tensor_key_reads_its_tensors_versions_now():
    """A TensorKey passed in its tensor's place: an in-place change through the tensor since the key was
    made is a miss (its recorded versions are those of its creation), strided and BSR, also inside a
    tuple argument."""

    @weak_lru_cache(maxsize=None)
    def total(k):
        return (k[0] if isinstance(k, tuple) else k).obj.sum()  # (the function gets the key itself)

    x = torch.ones(4)
    key = TensorKey(x)
    assert float(total(key)) == 4.0
    x.add_(1)
    assert float(total(key)) == 8.0 and float(total((key,))) == 8.0
    x.add_(1)
    assert float(total((key,))) == 12.0

    @weak_lru_cache(maxsize=None)
    def columns(k):
        return k.obj.col_indices().clone()

    bsr = torch.eye(4).to_sparse_bsr((2, 2))
    key = TensorKey(bsr)
    assert columns(key).tolist() == [0, 1]
    bsr.col_indices().copy_(torch.tensor([1, 0]))
    assert columns(key).tolist() == [1, 0]


def test_cache_clear_empties_the_attention_caches_too():
    import bsrkit
    from bsrkit import attention, mask_bias, plans

    mask = bsrkit.sliding_window_mask(32, 8, 8)
    float_mask = torch.sparse_bsr_tensor(
        mask.crow_indices(), mask.col_indices(), torch.randn(mask.values().shape), size=mask.shape
    )
    q = torch.randn(2, 1, 32, 8)
    bsrkit.scaled_dot_product_attention(q, q, q, float_mask)
    assert mask_bias._cached.cache_info().currsize
    bsrkit.cache_clear()
    for fn in (mask_bias._cached, attention._expanded_pattern, plans._plan):
        assert fn.cache_info().currsize == 0 and fn.cache_info().misses == 0


def test_a_dead_entry_s_key_leaves_the_table_at_the_next_call_as_documented():
    """The value goes with the tensor's memory at once; the key, which holds the call's other arguments
    (a method's ``self``), at the next call, ``cache_info()`` or ``cache_clear()``."""

    class Model:
        @weak_lru_cache(maxsize=None)
        def scaled(self, x):
            return x * 2

    model, x = Model(), torch.randn(5)
    value = weakref.ref(model.scaled(x))
    owner = weakref.ref(model)
    del model, x
    gc.collect()
    assert value() is None and owner() is not None  # (the key still holds self)
    assert Model.scaled.cache_info().currsize == 0
    gc.collect()
    assert owner() is None


def test_a_sparse_value_aliasing_its_argument_is_refused_and_a_storage_less_argument_is_taken():
    """The alias check skipped a sparse value's members (a BSR whose values are a from_dlpack alias
    pinned the argument), and read the storage of an argument that has none (a wrapper subclass, as
    DTensor's: the call raised where it was cached before)."""
    from torch.utils._pytree import tree_map

    @weak_lru_cache(maxsize=None)
    def as_bsr(t):
        values = torch.from_dlpack(t).view(1, 4, 4)
        return torch.sparse_bsr_tensor(torch.tensor([0, 1]), torch.tensor([0]), values, size=(4, 4))

    with pytest.raises(ValueError, match="shares memory with one of its tensor arguments"):
        as_bsr(torch.randn(16))

    class Wrapper(torch.Tensor):
        @staticmethod
        def __new__(cls, elem):
            return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

        def __init__(self, elem):
            self.elem = elem

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            unwrap = lambda a: a.elem if isinstance(a, Wrapper) else a  # noqa: E731
            out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
            return tree_map(lambda o: Wrapper(o) if isinstance(o, torch.Tensor) else o, out)

    table = weak_lru_cache(maxsize=None)(lambda t: torch.zeros(3))
    argument = Wrapper(torch.randn(4))
    assert torch.equal(table(argument), torch.zeros(3)) and torch.equal(table(argument), torch.zeros(3))


@pytest.mark.parametrize("verify", [False, True])
def test_a_namedtuple_argument_reaches_the_function_as_one_and_is_another_call(verify):
    Pair = collections.namedtuple("Pair", "a b")
    calls = []

    @weak_lru_cache(maxsize=8, verify_contents=verify)
    def f(p):
        calls.append(type(p))
        return p.a * 2 if isinstance(p, Pair) else p[0] * 3

    x = torch.ones(2)
    assert torch.equal(f(Pair(x, 1)), 2 * x)  # (verify_contents rebuilt it as a plain tuple: p.a failed)
    assert torch.equal(f((x, 1)), 3 * x)  # (equal to Pair(x, 1) as a key: the namedtuple's result served)
    assert calls == [Pair, tuple]


def test_a_tuple_subclass_with_its_own_constructor_reaches_the_function_as_itself():
    class Dims(tuple):
        def __new__(cls, *dims):
            return super().__new__(cls, dims)

    @weak_lru_cache(maxsize=8, verify_contents=True)
    def f(x, dims):
        return (type(dims), tuple(dims), type(x))

    x = torch.ones(2)
    assert f(x, Dims(2, 3)) == (Dims, (2, 3), torch.Tensor)  # (it became Dims([2, 3]): ([2, 3],))
    assert f(x, (Dims(2, 3), x))[1][0] == Dims(2, 3)

    class Tagged(tuple):
        def __new__(cls, items, tag):
            obj = super().__new__(cls, items)
            obj.tag = tag
            return obj

    @weak_lru_cache(maxsize=8, verify_contents=True)
    def g(v):
        return type(v).__name__, float(v[0].sum()), getattr(v, "tag", "-")

    t = torch.ones(3)
    assert g(torch.max(torch.stack([t, t]), 0)) == (
        "max",
        3.0,
        "-",
    )  # (a structseq: tuple.__new__ refused it)
    assert g(Tagged((t,), "mine")) == ("Tagged", 3.0, "mine")  # (its attribute goes along)


def test_a_hashable_argument_holding_a_tensor_is_refused():
    """Keyed by its hash (its identity), the tensor inside was neither keyed nor proven: a write to it was
    served the old result (and a frozenset's entry kept its tensor alive)."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Box:
        t: torch.Tensor

    @weak_lru_cache(maxsize=8)
    def f(v):
        return 1

    t = torch.ones(2)
    for value in (Box(t), frozenset([t]), torch.nn.Linear(2, 2)):
        with pytest.raises(TypeError, match=r"argument #0 \(\w+\) holds a tensor or array that its hash"):
            f(value)
    assert f(torch.float32) == f("x") == f(np.float64(2.0)) == f(Box) == 1  # (hashables without arrays)
