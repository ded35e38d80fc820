"""weak_lru_cache entries live exactly as long as the memory their keys name (issue 13, part 1).

Not as long as one Python wrapper: a BSR tensor rebuilt every step from the same index tensors, or a view
re-created on each call, finds the entry; the entry (and its value's bytes) goes when the last tensor on
that memory dies, by reference counting alone.
"""

from __future__ import annotations

import gc
import weakref
from collections import OrderedDict

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import bsrkit
from bsrkit import CacheInfo, reference, weak_lru_cache
from helpers import assert_close, random_bsr


def pattern_sum(t: torch.Tensor) -> torch.Tensor:
    """A value derived from a tensor's data (strided) or from its sparsity pattern only (BSR)."""
    if t.layout is torch.strided:
        return t.sum()
    return torch.cat([t.crow_indices(), t.col_indices()]).sum()


def counting(maxsize=128):
    calls = []

    @weak_lru_cache(maxsize=maxsize)
    def f(t):
        calls.append(1)
        return pattern_sum(t)

    return f, calls


def bsr_from(crow, col, step=0):
    values = torch.full((col.shape[0], 2, 2), float(step))
    return torch.sparse_bsr_tensor(crow, col, values, size=(4, 4))


def test_rebuild_per_step_hits_after_one_miss():
    f, calls = counting()
    crow, col = torch.tensor([0, 1, 2]), torch.tensor([1, 0])
    for step in range(5):
        b = bsr_from(crow, col, step)  # new values, same index tensors
        assert f(b) == 4
    assert len(calls) == 1
    value = weakref.ref(f(b))
    assert f.cache_info() == CacheInfo(hits=5, misses=1, maxsize=128, currsize=1, nbytes=8, dead_evictions=0)
    del b  # the last wrapper: the index memory lives on in crow and col
    assert f.cache_info().currsize == 1 and value() is not None
    del col  # no gc.collect(): the entry and its value go at once
    assert value() is None
    assert f.cache_info() == CacheInfo(hits=5, misses=1, maxsize=128, currsize=0, nbytes=0, dead_evictions=1)


def test_rebuild_per_step_hits_the_plan_cache(monkeypatch):
    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")  # the backend that plans
    bsrkit.cache_clear()
    pattern = random_bsr((64, 64), (8, 8), 0.3)
    crow, col = pattern.crow_indices().clone(), pattern.col_indices().clone()
    x = torch.randn(64, 5)
    for _ in range(5):
        weight = torch.sparse_bsr_tensor(crow, col, torch.randn(col.shape[0], 8, 8), size=(64, 64))
        assert_close(bsrkit.bsr_dense_mm(weight, x), reference.bsr_dense_mm(weight, x), k=64)
    info = bsrkit.cache_info()
    # One entry per pattern (its validity verdict, which holds the CPU plan derived from the validated
    # bytes), built once; every later step is one hit.
    assert (info.misses, info.hits, info.currsize, info.dead_evictions) == (1, 4, 1, 0)
    del weight, pattern
    assert bsrkit.cache_info().currsize == 1  # crow and col still hold the index memory
    del crow, col
    info = bsrkit.cache_info()
    assert (info.currsize, info.nbytes, info.dead_evictions) == (0, 0, 1)


def test_views_recreated_per_call_hit():
    f, calls = counting()
    x = torch.arange(12.0).reshape(3, 4)
    for _ in range(3):
        assert f(x[1]) == 22  # a new view object every call
    s = torch.eye(4).to_sparse_bsr((2, 2))
    for _ in range(3):
        assert f(s.crow_indices()) == 3
    assert len(calls) == 2
    assert f.cache_info().hits == 4


def test_entry_lives_with_the_memory_not_the_wrapper():
    f, _ = counting()
    x = torch.ones(100)
    value = weakref.ref(f(x))
    view = x[10:]
    del x  # the wrapper the entry was made from dies; its memory lives in `view`
    assert value() is not None and f.cache_info().currsize == 1
    del view
    assert value() is None
    assert f.cache_info()[3:6] == (0, 0, 1)


def test_in_place_change_through_a_recreated_view_is_a_miss():
    f, calls = counting()
    x = torch.zeros(2, 3)
    assert f(x[0]) == 0
    x[1].add_(1)  # another view of the same memory: one version counter for all of them
    assert f(x[0]) == 0
    x[0].add_(2)
    assert f(x[0]) == 6
    assert len(calls) == 3 and f.cache_info().currsize == 1


@pytest.mark.parametrize(
    "returns",
    [
        lambda t: t.detach(),  # another tensor object on the same storage
        lambda t: t.untyped_storage(),  # the storage itself
        lambda t: torch.empty(0).set_(t.untyped_storage()),
        lambda t: (1, {"a": [t.numpy()]}),  # a numpy array over it
        lambda t: t.view(2, -1)[1],  # a view of a view
    ],
)
def test_values_sharing_memory_with_an_argument_are_refused(returns):
    @weak_lru_cache()
    def f(t):
        return returns(t)

    x = torch.ones(6)
    storage = weakref.ref(x.untyped_storage())
    with pytest.raises(ValueError, match="shares memory with one of its tensor arguments") as raised:
        f(x[2:])  # the argument is a view: its storage is what would be pinned
    assert f.cache_info().currsize == 0
    del x, raised
    gc.collect()  # the traceback's frames held the value, in a cycle; the cache holds nothing
    assert storage() is None


def test_plan_sharing_the_index_memory_is_refused():
    @weak_lru_cache()
    def plan(bsr):
        return (bsr.col_indices()[1:], 0)  # would keep the index memory alive forever

    s = torch.eye(4).to_sparse_bsr((2, 2))
    with pytest.raises(ValueError, match="keep that memory alive forever"):
        plan(s)


def test_meta_tensors_with_equal_metadata_are_two_entries():
    f, calls = counting()
    a, b = torch.empty(3, device="meta"), torch.empty(3, device="meta")
    f(a)
    f(b)
    f(a[:])
    assert len(calls) == 2
    del a
    assert f.cache_info().currsize == 1


# -- a model test over create / view / rebuild / mutate / delete ----------------------------------------


class MemoryLifetimeModel(RuleBasedStateMachine):
    """The cache against a model of live entries keyed by (memory, view); memories are strided buffers
    or BSR index pairs, each kept alive by a list of Python objects (the buffer, views, BSR wrappers)."""

    MAXSIZE = 4
    VIEWS = ("whole", "tail", "matrix")  # how a call views a strided memory

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []
        calls = self.calls

        @weak_lru_cache(maxsize=self.MAXSIZE)
        def f(t):
            calls.append(1)
            return pattern_sum(t)

        self.f = f
        self.holders: dict[int, list] = {}  # memory -> the objects keeping it alive
        self.kind: dict[int, str] = {}
        self.model: OrderedDict = OrderedDict()  # (memory, view) -> (version, value weakref); LRU order
        self.hits = self.misses = self.dead_evictions = 0
        self.next_memory = 0

    def _new_memory(self, kind: str, holder) -> None:
        self.holders[self.next_memory] = [holder]
        self.kind[self.next_memory] = kind
        self.next_memory += 1

    @rule()
    def create_strided(self) -> None:
        self._new_memory("strided", torch.arange(6.0))

    @rule()
    def create_bsr(self) -> None:
        self._new_memory("bsr", (torch.tensor([0, 1, 2]), torch.tensor([1, 0])))

    def _any_alive(self, kind: str, data) -> int:
        return data.draw(st.sampled_from(sorted(m for m in self.holders if self.kind[m] == kind)))

    def _view(self, memory: int, view: str):
        """A fresh Python object on ``memory``: a view of the buffer, a BSR tensor rebuilt from the
        indices, or (``held``) a BSR wrapper the test keeps, if there is one."""
        objects = self.holders[memory]
        if self.kind[memory] == "strided":
            whole = objects[0].as_strided((6,), (1,), 0)  # any holder views the whole storage so
            return {"whole": whole, "tail": whole[2:], "matrix": whole.view(2, 3)}[view]
        wrappers = [o for o in objects if not isinstance(o, tuple)]
        if view == "held" and wrappers:
            return wrappers[0]  # its index counters may have moved (see mutate)
        o = objects[0]
        crow, col = o if isinstance(o, tuple) else (o.crow_indices(), o.col_indices())
        return bsr_from(crow, col)

    @precondition(lambda self: any(k == "strided" for m, k in self.kind.items() if m in self.holders))
    @rule(data=st.data(), view=st.sampled_from(VIEWS))
    def call_strided(self, data, view) -> None:
        memory = self._any_alive("strided", data)
        self._call(memory, view, self._view(memory, view))

    @precondition(lambda self: any(k == "bsr" for m, k in self.kind.items() if m in self.holders))
    @rule(data=st.data(), held=st.booleans())
    def call_bsr(self, data, held) -> None:
        memory = self._any_alive("bsr", data)
        self._call(memory, "pattern", self._view(memory, "held" if held else "rebuild"))

    def _call(self, memory: int, view: str, t: torch.Tensor) -> None:
        version = bsrkit.TensorKey(t).version
        expected_hit = (memory, view) in self.model and self.model[(memory, view)][0] == version
        n = len(self.calls)
        value = self.f(t)
        assert (len(self.calls) == n) == expected_hit
        assert value == pattern_sum(t)  # never stale
        if expected_hit:
            self.hits += 1
        else:
            self.misses += 1
        self.model.pop((memory, view), None)
        self.model[(memory, view)] = (version, weakref.ref(value))
        while len(self.model) > self.MAXSIZE:
            self.model.popitem(last=False)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def keep_another_object(self, data) -> None:
        """A view (strided) or a BSR wrapper rebuilt from the indices, kept alive by the test."""
        memory = data.draw(st.sampled_from(sorted(self.holders)))
        view = "tail" if self.kind[memory] == "strided" else "rebuild"
        self.holders[memory].append(self._view(memory, view))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def mutate(self, data) -> None:
        memory = data.draw(st.sampled_from(sorted(self.holders)))
        objects = self.holders[memory]  # (indices, not objects, are drawn: Hypothesis keeps draws)
        holder = objects[data.draw(st.integers(0, len(objects) - 1))]
        if isinstance(holder, tuple):
            return  # changes through the index tensors a BSR was built from are invisible (documented)
        if holder.layout is torch.strided:
            holder.add_(1)  # every view shares the counter
        else:
            holder.col_indices().add_(0)  # this wrapper's counter moves, not a rebuilt one's

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def drop_object(self, data) -> None:
        memory = data.draw(st.sampled_from(sorted(self.holders)))
        objects = self.holders[memory]
        objects.pop(data.draw(st.integers(0, len(objects) - 1)))
        if objects:
            return
        del self.holders[memory]  # the last object on that memory: its entries die now
        for key in [k for k in self.model if k[0] == memory]:
            _, value = self.model.pop(key)
            assert value() is None  # released at once, no gc.collect()
            self.dead_evictions += 1

    @invariant()
    def cache_info_matches(self) -> None:
        info = self.f.cache_info()
        nbytes = sum(ref().nbytes for _, ref in self.model.values())
        assert info == CacheInfo(
            self.hits, self.misses, self.MAXSIZE, len(self.model), nbytes, self.dead_evictions
        )


TestMemoryLifetimeModel = MemoryLifetimeModel.TestCase
TestMemoryLifetimeModel.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)


def test_kept_operand_is_never_stale_and_dies_with_the_tensor(monkeypatch):
    """The shortcut for a product with the same BSR tensor object as before: counted as a cache hit,
    refused after an in-place index change or new index memory, and gone (by a weakref callback, at once)
    when the tensor dies."""
    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    bsrkit.cache_clear()
    dense = torch.zeros(8, 8)
    dense[:4, :4] = 1.0
    bsr = dense.to_sparse_bsr((4, 4))
    x = torch.randn(8, 3)
    for _ in range(3):
        assert_close(bsrkit.bsr_dense_mm(bsr, x), reference.bsr_dense_mm(bsr, x))
    kept = bsrkit.shortcut_info()
    assert (kept.kept_operands, kept.operand_hits) == (1, 2)
    info = bsrkit.cache_info()
    assert (info.misses, info.hits) == (1, 2)  # verdict (holding the CPU plan) built once; two shortcut hits
    bsr.col_indices()[0] = 1  # in place, through the tensor's own accessor
    assert_close(bsrkit.bsr_dense_mm(bsr, x), reference.bsr_dense_mm(bsr, x))
    other = torch.eye(8).to_sparse_bsr((4, 4))
    bsr.resize_as_sparse_(other)  # new index tensors in the same wrapper
    bsr.copy_(other)
    assert_close(bsrkit.bsr_dense_mm(bsr, x), reference.bsr_dense_mm(bsr, x))
    assert bsrkit.shortcut_info().kept_operands == 1
    del bsr
    assert bsrkit.shortcut_info().kept_operands == 0  # at once, by reference counting
    bsrkit.bsr_dense_mm(other, x)
    assert bsrkit.shortcut_info().kept_operands == 1
    bsrkit.cache_clear()
    assert bsrkit.shortcut_info().kept_operands == 0


def _bsr_4x4() -> torch.Tensor:
    dense = torch.zeros(8, 8)
    dense[:4, :4] = torch.randn(4, 4)
    dense[4:, 4:] = torch.randn(4, 4)
    return dense.to_sparse_bsr((4, 4))


@pytest.mark.parametrize(
    "change",
    [
        lambda b: b.crow_indices().add_(0),
        lambda b: b.col_indices().add_(0),
        lambda b: b.values().mul_(2),
        lambda b: b.copy_(_bsr_4x4()),
        lambda b: b.resize_as_sparse_(_bsr_4x4()),
        lambda b: b.zero_(),
    ],
    ids=["crow", "col", "values", "copy_", "resize_as_sparse_", "zero_"],
)
@pytest.mark.parametrize("mode", ["grad", "inference"])
def test_every_change_torch_makes_to_a_bsr_bumps_its_version(change, mode):
    """What the kept operand relies on (bsrkit.shortcuts.kept_operand): a BSR tensor shares one version
    counter with the aliases its accessors return, and every change to its members bumps it, in
    inference mode too; swap_tensors refuses a tensor that has a weak reference. (Facts of torch: a
    torch upgrade that changes them fails here.)"""
    bsr = _bsr_4x4()
    version = bsr._version
    with torch.inference_mode(mode == "inference"):
        change(bsr)
    assert bsr._version > version
    ref = weakref.ref(bsr)  # the kept operand's entry holds one
    with pytest.raises(RuntimeError, match="weakref"):
        torch.utils.swap_tensors(bsr, _bsr_4x4())
    assert ref() is bsr


def test_kept_operand_is_reused_until_the_tensor_changes(monkeypatch):
    """Operand.of returns the same operand for the same unchanged BSR object; any change (in place through
    its accessors, new members) gives a new one, and products follow; inference tensors (no version
    counter) are never kept; the kept operand holds neither the tensor nor autograd history."""
    from bsrkit.operand import Operand

    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    bsr = _bsr_4x4()
    x = torch.randn(8, 24)
    a = Operand.of(bsr)
    assert Operand.of(bsr) is a
    for change in (
        lambda b: b.values().mul_(-3),
        lambda b: b.col_indices().copy_(torch.tensor([1, 0])),  # (still a valid pattern)
        lambda b: b.copy_(_bsr_4x4()),
        lambda b: b.zero_(),
    ):
        assert_close(bsrkit.bsr_dense_mm(bsr, x), reference.bsr_dense_mm(bsr, x), k=8)
        kept = Operand.of(bsr)
        change(bsr)
        assert Operand.of(bsr) is not kept
        assert_close(bsrkit.bsr_dense_mm(bsr, x), reference.bsr_dense_mm(bsr, x), k=8)
    with torch.inference_mode():
        frozen = _bsr_4x4()
    kept_before = bsrkit.shortcut_info().kept_operands
    assert Operand.of(frozen) is not Operand.of(frozen)
    assert bsrkit.shortcut_info().kept_operands == kept_before
    pattern = _bsr_4x4()
    values = torch.randn(2, 4, 4, requires_grad=True)
    weight = torch.sparse_bsr_tensor(pattern.crow_indices(), pattern.col_indices(), values, size=(8, 8))
    kept = Operand.of(weight)
    assert kept.values.grad_fn is None and not kept.values.requires_grad
    bsrkit.bsr_dense_mm(weight, x).sum().backward()
    assert values.grad is not None
    ref = weakref.ref(weight)
    del weight, kept
    assert ref() is None  # no gc.collect(): the kept operand does not hold it
