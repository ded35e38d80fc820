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
