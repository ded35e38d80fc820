import gc

import pytest
import torch

from bsrkit import TensorKey


def test_same_memory_same_view_is_equal():
    t = torch.arange(12.0).reshape(3, 4)
    assert TensorKey(t) == TensorKey(t)
    assert TensorKey(t) == TensorKey(t.view(3, 4))  # a different Python object, same view
    assert hash(TensorKey(t)) == hash(TensorKey(t[:]))


@pytest.mark.parametrize(
    "other",
    [
        lambda t: t.t(),  # strides
        lambda t: t[1:],  # offset and shape
        lambda t: t.view(4, 3),  # shape
        lambda t: t.view(torch.int32),  # dtype
        lambda t: t.reshape(-1),
        lambda t: t.clone(),  # other memory
        lambda t: t.to("meta"),  # device
    ],
)
def test_different_views_differ(other):
    t = torch.arange(12.0).reshape(3, 4)
    assert TensorKey(t) != TensorKey(other(t))


def test_conj_and_neg_bits_are_part_of_the_key():
    z = torch.randn(4, dtype=torch.complex64)
    assert TensorKey(z) != TensorKey(z.conj())
    assert TensorKey(z) != TensorKey(z._neg_view())
    assert TensorKey(z.conj()) == TensorKey(z.conj())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.bool])
def test_any_dtype(dtype):
    t = torch.zeros(5, dtype=dtype)
    assert TensorKey(t) == TensorKey(t)


@pytest.mark.parametrize("layout", ["csr", "csc", "bsr", "bsc"])
def test_sparse_compressed_keys_follow_indices(layout):
    d = torch.eye(4)
    convert = {
        "csr": lambda x: x.to_sparse_csr(),
        "csc": lambda x: x.to_sparse_csc(),
        "bsr": lambda x: x.to_sparse_bsr((2, 2)),
        "bsc": lambda x: x.to_sparse_bsc((2, 2)),
    }[layout]
    s = convert(d)
    assert TensorKey(s) == TensorKey(s)
    # Another tensor with the same pattern but its own index memory: different key.
    assert TensorKey(s) != TensorKey(convert(d))
    # Same indices, other values: same key (a plan depends on the indices only).
    if layout in ("csr", "bsr"):
        twin = torch.sparse_compressed_tensor(
            s.crow_indices(), s.col_indices(), s.values() * 2, size=s.shape, layout=s.layout
        )
    else:
        twin = torch.sparse_compressed_tensor(
            s.ccol_indices(), s.row_indices(), s.values() * 2, size=s.shape, layout=s.layout
        )
    assert TensorKey(s) == TensorKey(twin)
    assert TensorKey(s) != TensorKey(d)


def test_bsr_blocksize_is_part_of_the_key():
    d = torch.ones(4, 4)
    a = d.to_sparse_bsr((2, 2))
    b = torch.sparse_bsr_tensor(a.crow_indices(), a.col_indices(), torch.ones(4, 2, 2), size=(4, 4))
    c = torch.sparse_bsr_tensor(a.crow_indices(), a.col_indices(), torch.ones(4, 1, 4), size=(2, 8))
    assert TensorKey(a) == TensorKey(b)
    assert TensorKey(a) != TensorKey(c)


def test_dead_key_equals_only_itself():
    t = torch.arange(6.0)
    k1, k2 = TensorKey(t), TensorKey(t)
    assert k1 == k2
    del t
    gc.collect()
    assert k1.obj is None
    assert k1 == k1
    assert k1 != k2
    # A new tensor at the same address must not match the dead key.
    fresh = torch.arange(6.0)
    assert TensorKey(fresh) != k1


def test_obj_and_weakness():
    t = torch.ones(3)
    k = TensorKey(t)
    assert k.obj is t
    del t
    gc.collect()
    assert k.obj is None


def test_version_records_in_place_changes():
    t = torch.zeros(3)
    v0 = TensorKey(t).version
    t.add_(1)
    assert TensorKey(t).version != v0
    assert TensorKey(t) == TensorKey(t)  # the version is not part of equality

    s = torch.eye(4).to_sparse_bsr((2, 2))
    v0 = TensorKey(s).version
    s.col_indices().copy_(s.col_indices().flip(0))
    assert TensorKey(s).version != v0


def test_rejects_non_tensors_and_other_layouts():
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        TensorKey([1, 2])
    with pytest.raises(TypeError, match="layout"):
        TensorKey(torch.eye(3).to_sparse())


def test_key_from_members_equals_key_from_tensor():
    s = torch.eye(6).to_sparse_bsr((3, 2))
    members = (s.crow_indices(), s.col_indices(), s.values())
    k = TensorKey(s, members=members)
    assert k == TensorKey(s) and hash(k) == hash(TensorKey(s))
    assert k.version == TensorKey(s).version
    assert k != TensorKey(torch.eye(6).to_sparse_bsr((3, 2)))


# -- lifetime = the memory's, not one Python wrapper's ---------------------------------------------------


def _bsr_from(crow, col, seed=0):
    values = torch.randn(col.shape[0], 2, 2, generator=torch.Generator().manual_seed(seed))
    return torch.sparse_bsr_tensor(crow, col, values, size=(4, 4))


def test_rebuilt_bsr_has_the_key_of_its_index_memory():
    crow, col = torch.tensor([0, 1, 2]), torch.tensor([0, 1])
    first = _bsr_from(crow, col)
    k = TensorKey(first)
    del first  # the wrapper dies; the index memory lives on in crow and col
    assert k.obj is None and k.alive
    for step in range(3):  # a new BSR object with new values every step
        b = _bsr_from(crow, col, seed=step)
        assert TensorKey(b) == k and hash(TensorKey(b)) == hash(k)
    # Other index memory with equal contents is another key.
    assert TensorKey(_bsr_from(crow.clone(), col)) != k
    assert TensorKey(_bsr_from(crow, col.clone())) != k


def test_views_recreated_per_call_have_one_key():
    x = torch.arange(12.0).reshape(3, 4)
    k = TensorKey(x[0])  # the view object dies at once
    assert k.obj is None and k.alive
    assert TensorKey(x[0]) == k
    assert TensorKey(x[1]) != k
    s = torch.eye(4).to_sparse_bsr((2, 2))
    kc = TensorKey(s.crow_indices())
    assert TensorKey(s.crow_indices()) == kc


def test_key_dies_with_the_last_tensor_on_its_memory_not_the_first():
    x = torch.arange(6.0)
    k = TensorKey(x)
    tail = x[2:]
    del x
    assert k.alive  # the storage lives in the view
    assert TensorKey(tail.view(-1).as_strided((6,), (1,), 0)) == k  # same memory, viewed as x was
    del tail  # no gc.collect(): reference counting alone ends the key
    assert not k.alive and k != TensorKey(torch.arange(6.0))


def test_sparse_key_dies_with_either_index_storage():
    crow, col = torch.tensor([0, 1, 2]), torch.tensor([0, 1])
    k = TensorKey(_bsr_from(crow, col))
    keep = k  # a dead key equals only itself
    del col
    assert not k.alive and k == keep
    assert k != TensorKey(_bsr_from(crow, torch.tensor([0, 1])))
    assert "dead" in repr(k)


def test_dead_keys_of_one_memory_differ():
    x = torch.ones(4)
    k1, k2 = TensorKey(x), TensorKey(x[:])
    assert k1 == k2
    del x
    assert k1 != k2 and k1 == k1 and k2 == k2


@pytest.mark.parametrize("device", ["meta", "fake"])
def test_live_meta_and_fake_tensors_with_equal_metadata_differ(device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    def make():
        if device == "meta":
            return torch.empty(4, 4, device="meta")
        with FakeTensorMode():
            return torch.empty(4, 4)

    a, b = make(), make()
    if device == "meta":  # (FakeTensor warns on data_ptr(); it is 0 as well)
        assert a.data_ptr() == b.data_ptr() == 0  # what the storage identity has to make up for
    assert TensorKey(a) != TensorKey(b)
    assert TensorKey(a) == TensorKey(a.view(16).view(4, 4))  # same storage, same view
    assert TensorKey(a) != TensorKey(a[1:])
    k = TensorKey(a)
    del a
    assert not k.alive


def test_version_is_shared_by_views_recreated_per_call():
    x = torch.zeros(3, 4)
    v0 = TensorKey(x[0]).version
    x[2].add_(1)  # through another view: one counter for the whole view family
    assert TensorKey(x[0]).version != v0


def test_change_through_another_version_counter_is_invisible():
    """Documented limitation (torch's): the sparse constructor gives the indices a fresh counter."""
    crow, col = torch.tensor([0, 1, 2]), torch.tensor([0, 1])
    b = _bsr_from(crow, col)
    v0 = TensorKey(b).version
    col.add_(0)  # col's counter moves; b's copy of the counter does not
    assert TensorKey(b).version == v0
    b.col_indices().add_(0)  # through the sparse tensor's own accessor: seen
    assert TensorKey(b).version != v0


def test_tensor_without_storage_falls_back_to_its_own_lifetime():
    class NoStorage(torch.Tensor):
        def untyped_storage(self):
            raise RuntimeError("no storage")

    t = torch.ones(3).as_subclass(NoStorage)
    k = TensorKey(t)
    assert k == TensorKey(t) and k.alive
    assert k != TensorKey(t.view(3))  # another object: nothing says it is the same memory
    del t
    assert not k.alive


def test_anchors_are_the_storages():
    x = torch.ones(3)
    assert TensorKey(x[1:]).anchors() == (x.untyped_storage(),)
    s = torch.eye(4).to_sparse_bsr((2, 2))
    anchors = TensorKey(s).anchors()
    assert anchors is not None and len(anchors) == 2
    assert anchors[0] is s.crow_indices().untyped_storage()
    assert anchors[1] is s.col_indices().untyped_storage()
    k = TensorKey(torch.ones(2))
    assert k.anchors() is None
