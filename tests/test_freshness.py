"""A cache hit proves that the data it was derived from is unchanged, whatever wrote the memory.

Each write path of issue 23 (numpy, DLPack, ctypes, ``.data``, a storage copy, the original index tensor
with the same or a rebuilt BSR, another process writing file-mapped memory) on every op that caches,
on every backend (Triton in its interpreter); then ``$BSRKIT_CHECK_PLANS``, ``weak_lru_cache``'s
``verify_contents`` and a state machine of builds, products, writes, rebuilds and deletes, all checked
against the masked-dense reference.
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

import bsrkit
from bsrkit import reference, weak_lru_cache
from bsrkit.nn import BSRLinear
from helpers import assert_close, run_python

N_, BS = 64, 16  # a 4 x 4 grid of 16 x 16 blocks, two stored per block row
CROW = [0, 2, 4, 6, 8]
OLD_COL = [0, 1, 1, 2, 2, 3, 0, 3]
NEW_COL = [1, 3, 0, 2, 0, 1, 2, 3]  # another valid pattern with the same crow and nnz


@dataclass
class Weight:
    """A BSR tensor and the index and value tensors it was built from."""

    crow: torch.Tensor
    col: torch.Tensor
    values: torch.Tensor
    bsr: torch.Tensor

    def rebuilt(self) -> torch.Tensor:
        return torch.sparse_bsr_tensor(self.crow, self.col, self.values, size=(N_, N_))


def _weight(values: torch.Tensor, mapped: Path | None = None) -> Weight:
    crow = torch.tensor(CROW)
    if mapped is None:
        col = torch.tensor(OLD_COL)
    else:  # file-mapped memory that another process can write
        mapped.write_bytes(np.array(OLD_COL, dtype=np.int64).tobytes())
        col = torch.from_file(str(mapped), shared=True, size=len(OLD_COL), dtype=torch.int64)
    return Weight(crow, col, values, torch.sparse_bsr_tensor(crow, col, values, size=(N_, N_)))


# -- the write paths: each writes NEW_COL into the pattern and returns the BSR tensor to use next -----


def _numpy(w: Weight, new: torch.Tensor, _: Path | None) -> torch.Tensor:
    w.bsr.col_indices().numpy()[:] = new.numpy()
    return w.bsr


def _dlpack(w: Weight, new: torch.Tensor, _: Path | None) -> torch.Tensor:
    np.from_dlpack(w.bsr.col_indices())[:] = new.numpy()
    return w.bsr


def _ctypes(w: Weight, new: torch.Tensor, _: Path | None) -> torch.Tensor:
    ctypes.memmove(w.bsr.col_indices().data_ptr(), new.data_ptr(), new.nbytes)
    return w.bsr


def _dot_data(w: Weight, new: torch.Tensor, _: Path | None) -> torch.Tensor:
    with torch.no_grad():
        w.bsr.col_indices().data.copy_(new)
    return w.bsr


def _storage_copy(w: Weight, new: torch.Tensor, _: Path | None) -> torch.Tensor:
    w.bsr.col_indices().untyped_storage().copy_(new.clone().untyped_storage())
    return w.bsr


def _original_same_bsr(w: Weight, new: torch.Tensor, _: Path | None) -> torch.Tensor:
    w.col.copy_(new)  # the BSR's member alias has its own version counter
    return w.bsr


def _original_rebuilt_bsr(w: Weight, new: torch.Tensor, _: Path | None) -> torch.Tensor:
    w.col.copy_(new)  # then a new BSR on the same memory (the README's loop): its alias starts at 0
    return w.rebuilt()


def _other_process(w: Weight, new: torch.Tensor, mapped: Path | None) -> torch.Tensor:
    assert mapped is not None
    script = (
        "import sys, numpy as np\n"
        "m = np.memmap(sys.argv[1], dtype=np.int64, mode='r+')\n"
        "m[:] = [int(v) for v in sys.argv[2:]]\n"
        "m.flush()\n"
    )
    run_python(["-c", script, mapped, *new.tolist()], timeout=60)
    return w.bsr


def _original_set_(w: Weight, new: torch.Tensor, _: Path | None) -> torch.Tensor:
    w.col.set_(new.clone())  # the member now views other memory (the old stays alive in views of it)
    return w.bsr


def _original_data_assigned(w: Weight, new: torch.Tensor, _: Path | None) -> torch.Tensor:
    w.col.data = new.clone()  # the same, as Module._apply and `p.data = ...` idioms do
    return w.bsr


# (re-pointing writes: the member views new memory; a rebuilt plan there is a miss, not a refused hit)
REPOINTING = ("original_set_", "original_data_assigned")

WRITES: dict[str, Callable[[Weight, torch.Tensor, Path | None], torch.Tensor]] = {
    "numpy": _numpy,
    "dlpack": _dlpack,
    "ctypes": _ctypes,
    "dot_data": _dot_data,
    "storage_copy": _storage_copy,
    "original_same_bsr": _original_same_bsr,
    "original_rebuilt_bsr": _original_rebuilt_bsr,
    "other_process": _other_process,
    "original_set_": _original_set_,
    "original_data_assigned": _original_data_assigned,
}


# -- the caching ops: each returns (result, expected) for the BSR tensor it is given ------------------


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _mm(b: torch.Tensor) -> tuple[Any, Any]:
    x = torch.randn(N_, 24, generator=_gen())
    return bsrkit.bsr_dense_mm(b, x), reference.bsr_dense_mm(b, x)


def _mm_small_n(b: torch.Tensor) -> tuple[Any, Any]:
    x = torch.randn(N_, 2, generator=_gen())  # the CPU backend's vector loops (N <= 16)
    return bsrkit.bsr_dense_mm(b, x), reference.bsr_dense_mm(b, x)


_OUT = torch.empty(N_, 24)


def _mm_out(b: torch.Tensor) -> tuple[Any, Any]:
    x = torch.randn(N_, 24, generator=_gen())
    return bsrkit.bsr_dense_mm(b, x, out=_OUT).clone(), reference.bsr_dense_mm(b, x)


def _addmm(b: torch.Tensor) -> tuple[Any, Any]:
    g = _gen()
    x, inp = torch.randn(N_, 24, generator=g), torch.randn(N_, 24, generator=g)
    got = bsrkit.bsr_dense_addmm(inp, b, x, beta=0.5, alpha=2.0)
    return got, reference.bsr_dense_addmm(inp, b, x, beta=0.5, alpha=2.0)


def _transposed(b: torch.Tensor) -> tuple[Any, Any]:
    x = torch.randn(N_, 24, generator=_gen())
    return bsrkit.bsr_transposed_dense_mm(b, x), reference.bsr_transposed_dense_mm(b, x)


def _grad(b: torch.Tensor) -> tuple[Any, Any]:
    """The backward of bsr @ x w.r.t. x: the transposed product on the cached transpose plan."""
    x = torch.randn(N_, 24, generator=_gen(), requires_grad=True)
    bsrkit.bsr_dense_mm(b, x).sum().backward()
    return x.grad, reference.bsr_transposed_dense_mm(b, torch.ones(N_, 24))


def _sampled(b: torch.Tensor) -> tuple[Any, Any]:
    g = _gen()
    m1, m2 = torch.randn(N_, 8, generator=g), torch.randn(8, N_, generator=g)
    got = bsrkit.sampled_addmm(b, m1, m2, beta=0.5)
    return reference.bsr_to_dense(got), reference.sampled_addmm(b, m1, m2, beta=0.5)


def _softmax(b: torch.Tensor) -> tuple[Any, Any]:
    return reference.bsr_to_dense(bsrkit.bsr_softmax(b)), reference.bsr_softmax(b).float()


def _scatter(fmt: str) -> Callable[[torch.Tensor], tuple[Any, Any]]:
    def run(b: torch.Tensor) -> tuple[Any, Any]:
        x = torch.randn(N_, 32, generator=_gen())
        data = bsrkit.bsr_scatter_mm_indices_data(b, x, fmt)  # (cached on b's pattern)
        return bsrkit.bsr_scatter_mm(b, x, indices_data=data), reference.bsr_dense_mm(b, x)

    return run


def _attention(b: torch.Tensor) -> tuple[Any, Any]:
    """b's blocks bound the attention (a bool mask: its False entries are excluded)."""
    g = _gen()
    q, k, v = (torch.randn(N_, 8, generator=g) for _ in range(3))
    got = bsrkit.scaled_dot_product_attention(q, k, v, b)
    return got, reference.scaled_dot_product_attention(q, k, v, b)


def _attention_batched_mask(b: torch.Tensor) -> tuple[Any, Any]:
    """A 2-D mask broadcast over a batch: the kernels run on cached copies of its indices."""
    g = _gen()
    q, k, v = (torch.randn(2, N_, 8, generator=g) for _ in range(3))
    got = bsrkit.scaled_dot_product_attention(q, k, v, b, is_causal=True)
    return got, reference.scaled_dot_product_attention(q, k, v, b, is_causal=True)


def _float_values() -> torch.Tensor:
    return torch.randn(len(OLD_COL), BS, BS, generator=torch.Generator().manual_seed(1))


def _bool_values() -> torch.Tensor:
    return torch.rand(len(OLD_COL), BS, BS, generator=torch.Generator().manual_seed(1)) < 0.8


OPS: dict[str, tuple[Callable[[torch.Tensor], tuple[Any, Any]], Callable[[], torch.Tensor]]] = {
    "bsr_dense_mm": (_mm, _float_values),
    "bsr_dense_mm_small_n": (_mm_small_n, _float_values),
    "bsr_dense_mm_out": (_mm_out, _float_values),
    "bsr_dense_addmm": (_addmm, _float_values),
    "bsr_transposed_dense_mm": (_transposed, _float_values),
    "bsr_dense_mm_backward": (_grad, _float_values),
    "sampled_addmm": (_sampled, _float_values),
    "bsr_softmax": (_softmax, _float_values),
    "bsr_scatter_mm_compressed": (_scatter("bsr_strided_mm_compressed"), _float_values),
    "bsr_scatter_mm_strided": (_scatter("bsr_strided_mm"), _float_values),
    "bsr_scatter_mm_scatter": (_scatter("scatter_mm"), _float_values),
    "attention": (_attention, _bool_values),
    "attention_batched_mask": (_attention_batched_mask, _bool_values),
}


def _check(op: Callable[[torch.Tensor], tuple[Any, Any]], b: torch.Tensor) -> None:
    got, expected = op(b)
    assert_close(got, expected, k=N_)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("write", WRITES)
def test_a_write_to_the_pattern_is_never_served_stale(backend, op, write, tmp_path):
    """Products, kept operand and kept calls first (the second call takes every shortcut), then a write
    that moves no version counter the cache sees, then the product on the new pattern."""
    run, values = OPS[op]
    mapped = tmp_path / "col.bin" if write == "other_process" else None
    w = _weight(values(), mapped)
    for _ in range(2):
        _check(run, w.bsr)
    stale_before = bsrkit.cache_info().stale
    b = WRITES[write](w, torch.tensor(NEW_COL), mapped)
    assert b.col_indices().tolist() == NEW_COL
    _check(run, b)
    _check(run, b)  # (and the plans rebuilt for the new pattern are hits again)
    if not op.startswith("attention") and write not in REPOINTING:
        # (attention refuses its copy of a broadcast mask's indices)
        assert bsrkit.cache_info().stale > stale_before  # a plan was refused, not missed by luck


@pytest.mark.parametrize("op", [name for name, (_, values) in OPS.items() if values is _float_values])
@pytest.mark.parametrize("how", ["data_assigned", "set_", "transpose_"])
def test_values_re_pointed_after_a_product_are_the_ones_used(backend, op, how):
    """A member given other memory (``.data =``, ``set_``) or another layout in place (``transpose_``)
    moves no counter the wrapper shares; the kept operand's aliases still view the old memory."""
    run, values = OPS[op]
    w = _weight(values())
    for _ in range(2):
        _check(run, w.bsr)
    new = torch.randn(w.values.shape, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        if how == "data_assigned":
            w.values.data = new
        elif how == "set_":
            w.values.set_(new)
        else:
            w.values.transpose_(-2, -1)
    assert torch.equal(w.bsr.values(), w.values)  # (torch's wrapper sees it)
    _check(run, w.bsr)


@pytest.mark.parametrize("product", ["mm", "transposed", "sampled"])
def test_a_wrapper_given_another_shape_is_not_served_its_old_operand(backend, product):
    """``bsr.data = <a BSR of the same members and another size>`` keeps the wrapper's TensorImpl, version
    and members: only its shape says that the kept operand (its M, K, plans) no longer fits (a widened
    wrapper's transposed product returned uninitialised rows; a narrowed one read past its operand and
    corrupted the heap)."""
    g = torch.Generator().manual_seed(3)
    crow, col = torch.tensor([0, 2, 4, 6, 8]), torch.tensor([0, 1] * 4)
    vals = torch.randn(8, 4, 4, generator=g)
    b = torch.sparse_bsr_tensor(crow, col, vals, size=(16, 16))

    def run(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        M, K = b.shape
        if product == "mm":
            x = torch.randn(K, 3, generator=g)
            return bsrkit.bsr_dense_mm(b, x), reference.bsr_dense_mm(b, x)
        if product == "transposed":
            x = torch.randn(M, 3, generator=g)
            return bsrkit.bsr_transposed_dense_mm(b, x), reference.bsr_transposed_dense_mm(b, x)
        m1, m2 = torch.randn(M, 5, generator=g), torch.randn(5, K, generator=g)
        got = bsrkit.sampled_addmm(b, m1, m2, beta=0.0)
        return got.to_dense(), reference.sampled_addmm(b, m1, m2, beta=0.0).to_dense()

    for _ in range(2):  # (the second call is a kept hit)
        assert_close(*run(b))
    b.data = torch.sparse_bsr_tensor(crow, col, vals, size=(16, 24))  # valid: block columns 0 and 1 of 6
    got, expected = run(b)
    assert got.shape == expected.shape
    assert_close(got, expected)
    # block column 1 out of range now (torch's invariant checks would refuse to build it)
    b.data = torch.sparse_bsr_tensor(crow, col, vals, size=(16, 4), check_invariants=False)
    with pytest.raises(ValueError, match="col_indices"):
        run(b)


def test_index_members_re_pointed_to_another_dtype_are_read_as_they_are(backend):
    """``crow.data = crow.view(torch.int32)[:5]`` re-points a member at the same address, shape and
    stride: only its dtype differs, and the pattern it now holds is another."""
    crow, col = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([2])  # the one block in block row 1
    b = torch.sparse_bsr_tensor(crow, col, torch.randn(1, 4, 4), size=(16, 16))
    x = torch.randn(16, 3)
    for _ in range(2):
        assert_close(bsrkit.bsr_dense_mm(b, x), reference.bsr_dense_mm(b, x))
    crow.data = crow.view(torch.int32)[:5]  # [0, 0, 0, 0, 1]: the block in block row 3
    col.data = col.view(torch.int32)[:1]
    assert b.crow_indices().dtype == torch.int32  # (torch's wrapper sees it)
    assert_close(bsrkit.bsr_dense_mm(b, x), reference.bsr_dense_mm(b, x))


@pytest.mark.parametrize("op", OPS)
def test_a_write_undone_during_a_derivation_leaves_no_stale_plan(backend, op, monkeypatch):
    """The race of a writer with a plan's derivation, made deterministic: every derivation (the pattern's
    check, every plan builder, the block bias) finds another pattern in the memory, which is put back
    before the derivation ends (A -> B -> A). Snapshot and derivation must see the same bytes: the
    products, first and repeated, are those of the pattern the memory holds."""
    from bsrkit import mask_bias, plans

    run, values = OPS[op]
    w = _weight(values())
    live = w.col.numpy()
    depth = [0]

    def during_a_write(derive: Callable[..., Any]) -> Callable[..., Any]:
        def derive_while_written(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            live[:] = NEW_COL
            try:
                return derive(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    live[:] = OLD_COL

        return derive_while_written

    for name, builder in list(plans._BUILDERS.items()):
        monkeypatch.setitem(plans._BUILDERS, name, during_a_write(builder))
    monkeypatch.setattr(plans, "pattern_defect", during_a_write(plans.pattern_defect))
    monkeypatch.setattr(mask_bias, "block_bias", during_a_write(mask_bias.block_bias))
    bsrkit.cache_clear()
    for _ in range(3):  # built, then the cache's hits and the shortcuts
        _check(run, w.bsr)
        assert w.col.tolist() == OLD_COL


def test_verify_contents_derives_from_the_copy_it_compares():
    """A write that lands while the function runs and is undone before the next call (A -> B -> A): the
    function read the snapshot's copy (A), so the hit that the unchanged memory allows serves A's value."""
    x = torch.tensor([1, 2, 3])

    @weak_lru_cache(verify_contents=True)
    def total(t: torch.Tensor) -> int:
        x.numpy()[0] = 100  # (another thread's write, in real use)
        seen = int(t.sum())
        x.numpy()[0] = 1
        return seen

    assert total(x) == 6
    assert total(x) == 6 and total.cache_info().hits == 1


@pytest.mark.parametrize("fmt", ["bsr_strided_mm_compressed", "bsr_strided_mm", "scatter_mm"])
def test_indices_data_written_in_place_are_never_served_stale(backend, fmt):
    """scatter_mm's own plans (the indices data's check and the CPU gemm list) are keyed on the indices
    data tensors: numpy writes the other pattern's indices data into them (the two patterns share their
    values; each product is given the bsr its indices data describe)."""
    values = _float_values()
    old = _weight(values).bsr
    new = torch.sparse_bsr_tensor(torch.tensor(CROW), torch.tensor(NEW_COL), values, size=(N_, N_))
    x = torch.randn(N_, 32, generator=_gen())

    def owned(data: tuple[Any, ...]) -> tuple[Any, ...]:  # (not the cached tuple's own tensors)
        return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in data)

    data = owned(bsrkit.bsr_scatter_mm_indices_data(old, x, fmt))
    other = owned(bsrkit.bsr_scatter_mm_indices_data(new, x, fmt))
    for _ in range(2):
        assert_close(bsrkit.bsr_scatter_mm(old, x, indices_data=data), reference.bsr_dense_mm(old, x), k=N_)
    for mine, theirs in zip(data[1:], other[1:], strict=True):
        if isinstance(mine, torch.Tensor):
            assert mine.shape == theirs.shape
            mine.numpy()[...] = theirs.numpy()
    assert_close(bsrkit.bsr_scatter_mm(new, x, indices_data=data), reference.bsr_dense_mm(new, x), k=N_)


@pytest.mark.parametrize("fmt", ["bsr_strided_mm_compressed", "bsr_strided_mm", "scatter_mm"])
def test_indices_data_written_between_the_check_and_the_kernel_plan_are_not_run(fmt, monkeypatch):
    """A write racing one scatter_mm call, made deterministic: after the indices data was judged and
    before the CPU kernel's plan is fetched, the caller's tensors hold another pattern's indices data,
    put back afterwards. The kernel runs on the bytes that were judged (the verdict's copies), so the
    product is the judged pattern's."""
    from bsrkit.backends.cpu import planning

    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    values = _float_values()
    old = _weight(values).bsr
    new = torch.sparse_bsr_tensor(torch.tensor(CROW), torch.tensor(NEW_COL), values, size=(N_, N_))
    x = torch.randn(N_, 32, generator=_gen())
    data = tuple(
        t.clone() if isinstance(t, torch.Tensor) else t
        for t in bsrkit.bsr_scatter_mm_indices_data(old, x, fmt)
    )
    other = bsrkit.bsr_scatter_mm_indices_data(new, x, fmt)
    pairs = [(m, t) for m, t in zip(data[1:], other[1:], strict=True) if isinstance(m, torch.Tensor)]
    real = planning.cpu_scatter_plan

    def plan_while_written(*args: Any, **kwargs: Any) -> Any:
        kept = [m.clone() for m, _ in pairs]
        for mine, theirs in pairs:
            mine.copy_(theirs)
        try:
            return real(*args, **kwargs)
        finally:
            for (mine, _), k in zip(pairs, kept, strict=True):
                mine.copy_(k)

    monkeypatch.setattr(planning, "cpu_scatter_plan", plan_while_written)
    bsrkit.cache_clear()
    for _ in range(2):
        assert_close(bsrkit.bsr_scatter_mm(old, x, indices_data=data), reference.bsr_dense_mm(old, x), k=N_)


@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
def test_a_write_racing_a_product_on_the_cpu_does_not_steer_its_kernel(backend, monkeypatch):
    """The torch backend and Triton (in its interpreter) read the pattern's indices in the kernel. On the
    CPU they read the validated copy: another pattern written into the live memory after the check and
    put back after the kernel changes nothing (before, the kernel ran on the other pattern)."""
    import importlib

    module = importlib.import_module(
        "bsrkit.backends.torch_ops" if backend == "torch" else "bsrkit.backends.triton"
    )
    w = _weight(_float_values())
    x = torch.randn(N_, 24, generator=_gen())
    real = module.flatten_addmm

    def flatten_while_written(*args: Any, **kwargs: Any) -> Any:
        w.col.numpy()[:] = NEW_COL
        try:
            flat = real(*args, **kwargs)
            return (*flat[:1], flat[1].clone(), *flat[2:])  # (the col the kernel reads, as it was now)
        finally:
            w.col.numpy()[:] = OLD_COL

    monkeypatch.setattr(module, "flatten_addmm", flatten_while_written)
    for _ in range(2):
        assert_close(bsrkit.bsr_dense_mm(w.bsr, x), reference.bsr_dense_mm(w.bsr, x), k=N_)


@pytest.mark.parametrize("write", ["numpy", "original_rebuilt_bsr"])
def test_the_pattern_written_back_is_right_again(backend, write):
    w = _weight(_float_values())
    for new in (NEW_COL, OLD_COL, NEW_COL):
        b = WRITES[write](w, torch.tensor(new), None)
        _check(_mm, b)
        _check(_transposed, b)


def test_a_malformed_write_is_caught_by_the_revalidation():
    w = _weight(_float_values())
    _check(_mm, w.bsr)
    w.bsr.col_indices().numpy()[3] = 7  # block column 7 of 4
    x = torch.randn(N_, 24)
    with pytest.raises(ValueError, match=r"col_indices in \[0, 4\)"):
        bsrkit.bsr_dense_mm(w.bsr, x)
    w.bsr.col_indices().numpy()[3] = 2  # fixed again
    _check(_mm, w.bsr)


def test_a_crow_write_moves_blocks_between_rows():
    w = _weight(_float_values())
    _check(_mm, w.bsr)
    _check(_transposed, w.bsr)
    w.crow.numpy()[:] = [0, 1, 4, 5, 8]
    w.col.numpy()[:] = [2, 0, 1, 3, 1, 0, 2, 3]
    _check(_mm, w.bsr)
    _check(_transposed, w.bsr)
    _check(_softmax, w.bsr)


# -- values that a cached result depends on: the fused attention's block bias ---------------------------


def _values_numpy(w: Weight, new: torch.Tensor) -> torch.Tensor:
    w.bsr.values().detach().numpy()[:] = new.numpy()
    return w.bsr


def _values_original_rebuilt(w: Weight, new: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        w.values.copy_(new)  # a learned bias after opt.step(), the mask rebuilt from it
    return w.rebuilt()


def _values_dot_data(w: Weight, new: torch.Tensor) -> torch.Tensor:
    w.bsr.values().data.copy_(new)
    return w.bsr


@pytest.mark.parametrize("fused", ["1", "0"])
@pytest.mark.parametrize("write", [_values_numpy, _values_original_rebuilt, _values_dot_data])
def test_a_float_mask_changed_in_place_gives_the_new_attention(backend, fused, write, monkeypatch):
    monkeypatch.setenv("BSRKIT_FUSED_ATTENTION", fused)
    w = _weight(_float_values())
    for _ in range(2):
        _check(_attention, w.bsr)
    mask = write(w, torch.randn(len(OLD_COL), BS, BS, generator=torch.Generator().manual_seed(5)) * 3)
    _check(_attention, mask)


def test_a_bool_mask_changed_in_place_gives_the_new_attention(backend):
    w = _weight(_bool_values())
    _check(_attention, w.bsr)
    w.bsr.values().numpy()[:] = ~w.bsr.values().numpy()
    _check(_attention, w.bsr)


# -- BSRLinear: its index buffers written without a version counter --------------------------------------


@pytest.mark.parametrize("how", ["numpy", "dot_data", "storage_alias"])
@pytest.mark.parametrize("transposed_too", [False, True])
def test_bsr_linear_after_an_unseen_buffer_write(backend, how, transposed_too):
    torch.manual_seed(0)
    layer = BSRLinear(N_, N_, BS, density=0.5)
    x = torch.randn(5, N_, requires_grad=transposed_too)

    def check() -> None:
        y = layer(x)
        torch.testing.assert_close(y, x @ layer.to_dense().T + layer.bias, rtol=1e-5, atol=1e-5)
        if transposed_too:  # the backward's A^T G on the cached transpose plan
            (grad,) = torch.autograd.grad(y.sum(), x)
            assert_close(grad, torch.ones(5, N_) @ layer.to_dense(), k=N_)

    check()
    check()
    col = layer.col_indices
    new = (col + 1) % (N_ // BS)  # every block one column to the right: valid, same nnz
    if how == "numpy":
        col.numpy()[:] = new.numpy()
    elif how == "dot_data":
        col.data.copy_(new)
    else:  # a new tensor on the buffer's storage (its own version counter), as a collective might write
        alias = torch.empty(0, dtype=col.dtype).set_(col.untyped_storage(), col.storage_offset(), col.shape)
        alias.copy_(new)
    check()


# -- $BSRKIT_CHECK_PLANS -----------------------------------------------------------------------------------


def test_check_mode_0_compares_nothing_and_shows_what_the_proof_prevents(backend, monkeypatch):
    """Without the comparison (memory identity and version counters only, as on CUDA by default), the
    numpy write of the repro gives the old pattern's product: the test above can fail."""
    monkeypatch.setenv("BSRKIT_CHECK_PLANS", "0")
    w = _weight(_float_values())
    _check(_transposed, w.bsr)
    w.bsr.col_indices().numpy()[:] = NEW_COL
    got, expected = _transposed(w.bsr)
    assert not torch.allclose(got, expected, atol=1e-3)
    monkeypatch.setenv("BSRKIT_CHECK_PLANS", "1")
    _check(_transposed, w.bsr)


@pytest.mark.parametrize("op", [_transposed, _mm])
def test_check_mode_0_keeps_nothing_for_inference_index_tensors(op, monkeypatch):
    """Index tensors made under inference mode have no version counter, even in a BSR made outside it:
    with nothing compared (mode 0, CUDA's default), nothing derived from them may be kept (the old
    transposed plan was served: errors of 24)."""
    monkeypatch.setenv("BSRKIT_BACKEND", "cpu")
    monkeypatch.setenv("BSRKIT_CHECK_PLANS", "0")
    w = _weight(_float_values())
    with torch.inference_mode():
        crow, col = w.bsr.crow_indices().clone(), w.bsr.col_indices().clone()
    bsr = torch.sparse_bsr_tensor(crow, col, w.bsr.values(), size=w.bsr.shape)
    _check(op, bsr)
    _check(op, bsr)
    with torch.inference_mode():
        bsr.col_indices().copy_(torch.tensor(NEW_COL, dtype=col.dtype))
    _check(op, bsr)


@pytest.mark.triton
def test_checked_mode_in_the_triton_interpreter(monkeypatch):
    """The Triton path with ``BSRKIT_CHECK_PLANS=1`` (what CUDA needs for the proof): the derived plans
    (block rows of the SDDMM, the transpose) are refused after a write and rebuilt."""
    pytest.importorskip("triton")
    monkeypatch.setenv("BSRKIT_BACKEND", "triton")
    monkeypatch.setenv("BSRKIT_CHECK_PLANS", "1")
    w = _weight(_float_values())
    for op in (_transposed, _sampled, _mm):
        _check(op, w.bsr)
    stale = bsrkit.cache_info().stale
    np.from_dlpack(w.bsr.col_indices())[:] = np.array(NEW_COL)
    for op in (_transposed, _sampled, _mm):
        _check(op, w.bsr)
    assert bsrkit.cache_info().stale > stale


def test_check_mode_rejects_an_unknown_value_at_the_first_call(monkeypatch):
    """A plan's miss reads the mode as its hits do: the first call of every cached path raises (the
    transposed product and the layer ran their first call, and raised at the second)."""
    from bsrkit.nn import BSRLinear

    monkeypatch.setenv("BSRKIT_CHECK_PLANS", "yes")
    calls = [
        lambda: bsrkit.bsr_dense_mm(_weight(_float_values()).bsr, torch.randn(N_, 4)),
        lambda: bsrkit.bsr_transposed_dense_mm(_weight(_float_values()).bsr, torch.randn(N_, 4)),
        lambda: BSRLinear(16, 16, 4, density=0.5)(torch.randn(2, 16)),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"BSRKIT_CHECK_PLANS in \('auto', '0', '1'\)"):
            call()


def test_device_copies_are_compared_in_the_checked_mode_only(monkeypatch):
    """The comparison used for accelerator memory (a copy on the device, ``torch.equal``), exercised on a
    CPU storage: CI has no GPU."""
    from bsrkit.freshness import _DeviceRegion

    t = torch.arange(10)
    monkeypatch.setenv("BSRKIT_CHECK_PLANS", "1")
    region = _DeviceRegion(t.untyped_storage(), 8, 16, copy=True)
    assert region.unchanged()
    t[5] = 0  # outside bytes 8..24
    assert region.unchanged()
    t[2] = 0
    assert not region.unchanged()
    assert not _DeviceRegion(t.untyped_storage(), 8, 16, copy=False).unchanged()  # unproven


# -- weak_lru_cache(verify_contents=True) ------------------------------------------------------------------


def test_verify_contents_recomputes_after_an_unseen_write():
    calls = []

    @weak_lru_cache(verify_contents=True)
    def total(t: torch.Tensor) -> float:
        calls.append(1)
        return float(t.sum())

    @weak_lru_cache()
    def trusting_total(t: torch.Tensor) -> float:
        return float(t.sum())

    x = torch.arange(6.0)
    assert total(x) == trusting_total(x) == 15
    assert total(x) == 15 and len(calls) == 1
    x.numpy()[0] = 100  # no version counter moves
    assert trusting_total(x) == 15  # documented: only identity and version counters
    assert total(x) == 115 and len(calls) == 2
    info = total.cache_info()
    assert (info.hits, info.misses, info.currsize, info.stale) == (1, 2, 1, 1)
    assert total(x) == 115 and total.cache_info().hits == 2


@pytest.mark.parametrize("n", [10, 5000, 100_000])  # bytes compared as a copy, and by memcmp
def test_verify_contents_sees_a_write_at_either_end(n):
    @weak_lru_cache(verify_contents=True)
    def last(t: torch.Tensor) -> tuple[int, int]:
        return int(t[0]), int(t[-1])

    x = torch.arange(n)
    assert last(x) == (0, n - 1)
    x.numpy()[-1] = -5
    assert last(x) == (0, -5)
    x.numpy()[0] = 7
    assert last(x) == (7, -5)
    assert last(x) == (7, -5)
    assert last.cache_info()[:2] == (1, 3) and last.cache_info().stale == 2


def test_verify_contents_compares_the_span_of_a_view():
    x = torch.arange(12.0).reshape(3, 4)
    calls = []

    @weak_lru_cache(verify_contents=True)
    def f(t: torch.Tensor) -> float:
        calls.append(1)
        return float(t.sum())

    column = x[:, 1]  # elements 1, 5, 9 of the storage
    assert f(column) == 15
    x.numpy()[2, 3] = -1  # element 11: outside the view's span, not read
    assert f(x[:, 1]) == 15 and len(calls) == 1
    x.numpy()[1, 0] = -1  # element 4: between the view's elements: a needless recompute, never stale
    assert f(x[:, 1]) == 15 and len(calls) == 2
    x.numpy()[1, 1] = 0  # element 5: read by the view
    assert f(x[:, 1]) == 10 and len(calls) == 3


def test_verify_contents_of_a_sparse_argument_covers_its_indices():
    w = _weight(_float_values())

    @weak_lru_cache(verify_contents=True)
    def pattern(b: torch.Tensor) -> list[int]:
        return b.col_indices().tolist()

    assert pattern(w.bsr) == OLD_COL
    w.bsr.values().detach().numpy()[:] = 0  # values are not part of a sparse tensor's key
    assert pattern(w.rebuilt()) == OLD_COL and pattern.cache_info().hits == 1
    w.col.numpy()[:] = NEW_COL
    assert pattern(w.rebuilt()) == NEW_COL and pattern.cache_info().stale == 1


def test_pass_snapshot_hands_the_function_its_proof():
    from bsrkit.freshness import Snapshot

    seen: list[Snapshot] = []

    @weak_lru_cache(verify_contents=True, pass_snapshot=True)
    def first(t: torch.Tensor, *, snapshot: Snapshot) -> int:
        seen.append(snapshot)
        return int(t[0])

    x = torch.arange(5)
    assert first(x) == 0 and first(x) == 0 and len(seen) == 1
    assert seen[0].unchanged()
    x.numpy()[3] = 9  # inside the span the snapshot copied
    assert not seen[0].unchanged()
    assert first(x) == 0 and len(seen) == 2
    with pytest.raises(ValueError, match="pass_snapshot to be a bool, True only with verify_contents=True"):
        weak_lru_cache(pass_snapshot=True)


def test_verify_contents_takes_a_bool():
    with pytest.raises(TypeError, match="verify_contents to be a bool, got int"):
        weak_lru_cache(verify_contents=1)  # type: ignore[arg-type]
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match="verify_contents to be a bool, got numpy.bool"):  # (not "got bool")
        weak_lru_cache(verify_contents=np.True_)  # type: ignore[arg-type]


def test_verify_contents_entries_still_die_with_their_memory():
    @weak_lru_cache(verify_contents=True)
    def double(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    x = torch.arange(4.0)
    double(x)
    assert double.cache_info().currsize == 1
    del x
    gc.collect()
    assert double.cache_info().currsize == 0


# -- a state machine of builds, products, writes, rebuilds and deletes --------------------------------------

_PATTERNS = (  # (crow, col) with nnz = 8 on the 4 x 4 grid
    ([0, 2, 4, 6, 8], OLD_COL),
    ([0, 2, 4, 6, 8], NEW_COL),
    ([0, 1, 4, 5, 8], [2, 0, 1, 3, 1, 0, 2, 3]),
    ([0, 0, 4, 4, 8], [0, 1, 2, 3, 0, 1, 2, 3]),
)
_PRODUCTS = {"mm": _mm, "small_n": _mm_small_n, "transposed": _transposed, "sampled": _sampled}


class PatternWrites(RuleBasedStateMachine):
    """Weights built from index tensors, used, written through every path, rebuilt and dropped; every
    product is checked against the masked-dense reference of the pattern the memory holds then."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[Weight] = []
        self.bsrs: list[torch.Tensor] = []  # BSR objects in use (kept operands live on them)

    @rule(pattern=st.sampled_from(_PATTERNS))
    def build(self, pattern: tuple[list[int], list[int]]) -> None:
        crow, col = torch.tensor(pattern[0]), torch.tensor(pattern[1])
        values = torch.randn(len(col), BS, BS)
        w = Weight(crow, col, values, torch.sparse_bsr_tensor(crow, col, values, size=(N_, N_)))
        self.weights.append(w)
        self.bsrs.append(w.bsr)

    @precondition(lambda self: self.bsrs)
    @rule(data=st.data(), product=st.sampled_from(sorted(_PRODUCTS)))
    def product(self, data: st.DataObject, product: str) -> None:
        b = data.draw(st.sampled_from(self.bsrs))
        _check(_PRODUCTS[product], b)

    @precondition(lambda self: self.weights)
    @rule(
        data=st.data(),
        pattern=st.sampled_from(_PATTERNS),
        path=st.sampled_from(["numpy", "dlpack", "ctypes", "dot_data", "storage_copy", "original"]),
    )
    def write(self, data: st.DataObject, pattern: tuple[list[int], list[int]], path: str) -> None:
        w = data.draw(st.sampled_from(self.weights))
        for alias, new in ((w.bsr.crow_indices(), pattern[0]), (w.bsr.col_indices(), pattern[1])):
            src = torch.tensor(new)
            if path == "numpy":
                alias.numpy()[:] = src.numpy()
            elif path == "dlpack":
                np.from_dlpack(alias)[:] = src.numpy()
            elif path == "ctypes":
                ctypes.memmove(alias.data_ptr(), src.data_ptr(), src.nbytes)
            elif path == "dot_data":
                alias.data.copy_(src)
            elif path == "storage_copy":
                alias.untyped_storage().copy_(src.untyped_storage())
        if path == "original":
            w.crow.copy_(torch.tensor(pattern[0]))
            w.col.copy_(torch.tensor(pattern[1]))

    @precondition(lambda self: self.weights)
    @rule(data=st.data())
    def rebuild(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from(self.weights))
        self.bsrs.append(w.rebuilt())

    @precondition(lambda self: self.bsrs)
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.bsrs) - 1))
        del self.bsrs[i]
        gc.collect()


PatternWrites.TestCase.settings = settings(max_examples=40, stateful_step_count=12, deadline=None)
test_pattern_writes_state_machine = PatternWrites.TestCase
