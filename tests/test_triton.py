"""The Triton kernels, run by Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, see conftest). The
product suite runs on this backend too, as the ``triton`` product path (tests/test_products.py)."""

import json

import numpy as np
import pytest
import torch

import bsrkit
from bsrkit import reference, tuning
from helpers import assert_close, random_bsr, run_python

pytest.importorskip("triton")
pytestmark = pytest.mark.triton

# bfloat16 is left out: the interpreter's tl.dot returns garbage for it (measured: error 1e10 on a
# 5x7 @ 7x3 product, triton 3.9); on a GPU it is a supported dtype of the same kernels.
DTYPES = [torch.float32, torch.float64, torch.float16]


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("BSRKIT_BACKEND", "triton")


@pytest.mark.parametrize("fmt", ["bsr_strided_mm_compressed", "bsr_strided_mm", "scatter_mm"])
def test_scatter_mm_formats(fmt):
    bsr = random_bsr((48, 32), (16, 8), 0.5, empty_rows=(1,))
    other = torch.randn(2, 32, 32)
    data = bsrkit.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt, SPLIT_N=2)
    assert_close(bsrkit.bsr_scatter_mm(bsr, other, data), reference.bsr_scatter_mm(bsr, other), k=32)


def test_scatter_mm_accumulates():
    blocks = torch.randn(5, 4, 3)
    others = torch.randn(6, 3, 2)
    data = ("scatter_mm", torch.tensor([0, 2, 2, 5]), torch.tensor([[0, 1], [4, 5], [1, 0], [2, 2], [3, 3]]))
    acc = torch.randn(3, 4, 2)
    expected = reference.scatter_mm(blocks, others, data, acc)
    assert_close(bsrkit.scatter_mm(blocks, others, data, accumulators=acc.clone()), expected, k=3)


def test_integer_blocks_are_refused_by_name():
    # (a raw KeyError from the kernels' accumulator table; on CUDA, chosen automatically, the same)
    data = ("scatter_mm", torch.tensor([0, 1]), torch.tensor([[0, 0]]))
    blocks, others = torch.ones(1, 2, 2, dtype=torch.int32), torch.ones(1, 2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="triton has no torch.int32 kernels"):
        bsrkit.scatter_mm(blocks, others, data)


def test_meta_override_and_tuning_table(tmp_path, monkeypatch):
    bsr = random_bsr((32, 32), (8, 8), 0.5)
    dense = torch.randn(32, 40)
    ref = reference.bsr_dense_mm(bsr, dense)
    assert_close(bsrkit.bsr_dense_mm(bsr, dense, meta={"BLOCK_N": 16, "num_warps": 2}), ref, k=32)
    with pytest.raises(ValueError, match="power of two"):
        bsrkit.bsr_dense_mm(bsr, dense, meta={"BLOCK_N": 24})
    with pytest.raises(ValueError, match="unknown"):
        bsrkit.bsr_dense_mm(bsr, dense, meta={"panel": 64})
    table = tmp_path / "t.json"
    monkeypatch.setenv(tuning.TABLE_ENV, str(table))
    key = tuning.table_key("triton-interpreter", "bsr_dense_mm", torch.float32, (32, 32, 40), (8, 8))
    table.write_text(json.dumps({"format": "bsrkit-tuning", "version": 1, "entries": {key: {"BLOCK_N": 32}}}))
    params = tuning.triton_meta(
        "bsr_dense_mm", torch.device("cpu"), torch.float32, (32, 32, 40), (8, 8), None
    )
    assert params["BLOCK_N"] == 32
    assert_close(bsrkit.bsr_dense_mm(bsr, dense), ref, k=32)


def test_interpreter_required_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    bsr = random_bsr((8, 8), (4, 4), 0.5)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        bsrkit.bsr_dense_mm(bsr, torch.randn(8, 2))


def test_tune_triton_parameters_in_the_interpreter(tmp_path, monkeypatch):
    from bsrkit.cli import main

    table = tmp_path / "t.json"
    monkeypatch.setenv(tuning.TABLE_ENV, str(table))
    argv = ["tune", "--backend", "triton", "--shapes", "32x32x40", "--blocksizes", "8", "--block-n", "16,32"]
    argv += ["--block-k", "16,64", "--num-warps", "4", "--num-stages", "1", "--repeats", "1"]
    assert main(argv) == 0
    params = tuning.triton_meta(
        "bsr_dense_mm", torch.device("cpu"), torch.float32, (32, 32, 40), (8, 8), None
    )
    assert params["BLOCK_N"] in (16, 32) and params["num_warps"] == 4 and params["num_stages"] == 1
    assert params["BLOCK_K"] == 16  # 64 clamps to the 8-wide blocks' padded extent, 16: one candidate
    entries = json.loads(table.read_text())["entries"]
    assert all(k.startswith("triton-interpreter|") for k in entries)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_blocks_larger_than_the_tiles(dtype):
    # 40 x 36 blocks with 16-wide tiles: three row tiles per block, three K chunks, ragged edges.
    bsr = random_bsr((2, 80, 108), (40, 36), 0.6, dtype, empty_rows=(1,))
    dense = torch.randn(108, 50).to(dtype)
    meta = {"BLOCK_M": 16, "BLOCK_K": 16, "BLOCK_N": 16}
    got = bsrkit.bsr_dense_addmm(torch.randn(80, 50).to(dtype), bsr, dense, beta=0.0, meta=meta)
    assert_close(got, reference.bsr_dense_mm(bsr, dense), k=108)


def test_scatter_mm_blocks_taller_than_a_tile():
    # 136 rows > the default BLOCK_M (128): a second, mostly masked row tile; 40 > BLOCK_K (16): a K loop.
    blocks = torch.randn(3, 136, 40)
    others = torch.randn(2, 40, 24)
    data = ("scatter_mm", torch.tensor([0, 2, 3]), torch.tensor([[0, 1], [2, 0], [1, 1]]))
    acc = torch.randn(2, 136, 24)
    expected = reference.scatter_mm(blocks, others, data, acc)
    assert_close(bsrkit.scatter_mm(blocks, others, data, accumulators=acc.clone()), expected, k=80)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampled_addmm_long_inner_dimension(dtype):
    inp = random_bsr((2, 40, 36), (20, 12), 0.5, dtype, empty_rows=(0,))
    mat1 = torch.randn(2, 40, 70).to(dtype)
    mat2 = torch.randn(36, 70).to(dtype).mT  # column-major, broadcast over the batch
    got = bsrkit.sampled_addmm(inp, mat1, mat2, beta=0.5, alpha=-1.0)
    expected = reference.sampled_addmm(inp, mat1, mat2.expand(2, 70, 36), beta=0.5, alpha=-1.0)
    assert_close(reference.bsr_to_dense(got), expected, k=70)
    empty_k = bsrkit.sampled_addmm(inp, mat1[..., :0], mat2[:0], beta=2.0)  # K == 0: only beta * input
    assert_close(empty_k.values(), 2 * inp.values())


def test_inner_dimension_offsets_past_int32_are_not_wrapped():
    # A dense operand whose row stride times its last row passes 2**31 elements: an int32 offset wraps to
    # 2**32 elements before the true address. A marker there shows which one was read. (A 8.8 GB buffer,
    # of which only the touched pages are ever committed.)
    stride, base, k, n = 150_000_000, 2**31, 16, 16
    big = torch.empty(base + (k - 1) * stride + n, dtype=torch.float16)
    dense = big.as_strided((k, n), (stride, 1), base)
    dense.copy_(torch.ones(k, n))
    wrapped = base + (k - 1) * stride - 2**32
    big[wrapped : wrapped + n] = 1000.0
    bsr = torch.sparse_bsr_tensor(
        torch.tensor([0, 1]), torch.tensor([0]), torch.ones(1, k, k, dtype=torch.float16), size=(k, k)
    )
    for flat in (0, 1):  # (the nested loop and the flat one)
        assert bsrkit.bsr_dense_mm(bsr, dense, meta={"FLAT_LOOP": flat}).eq(k).all()
    sampled = bsrkit.sampled_addmm(bsr, torch.ones(k, k, dtype=torch.float16), dense, beta=0.0)
    assert sampled.values().eq(k).all()


def test_numpy_integers_reach_the_kernels_as_ints():
    """numpy's integers in meta= and SPLIT_N (torch's indices data may hold one): Triton's launcher and
    tile rules refused them (InterpreterError, AttributeError 'bit_length')."""
    from torch.sparse import _triton_ops

    bsr = random_bsr((64, 64), (16, 16), 0.5)
    x = torch.randn(64, 32)
    ref = reference.bsr_dense_mm(bsr, x)
    assert_close(
        bsrkit.bsr_dense_mm(bsr, x, meta={"BLOCK_M": np.int64(16), "num_warps": np.int64(4)}), ref, k=64
    )
    for made_by in (bsrkit, _triton_ops):
        data = made_by.bsr_scatter_mm_indices_data(bsr, x, "bsr_strided_mm_compressed", SPLIT_N=np.int64(2))
        assert_close(bsrkit.bsr_scatter_mm(bsr, x, data), ref, k=64)


def test_alpha_keeps_float64_precision():
    bsr = random_bsr((12, 12), (4, 3), 0.6, torch.float64, integers=True)
    dense = torch.randint(-3, 4, (12, 5)).double()
    alpha = 1 / 3  # not a float32 number: rounding it would cost ~1e-8 relative error
    got = bsrkit.bsr_dense_addmm(torch.zeros(12, 5, dtype=torch.float64), bsr, dense, alpha=alpha)
    torch.testing.assert_close(got, alpha * reference.bsr_dense_mm(bsr, dense), rtol=1e-15, atol=0)


def test_kernels_compile_for_sm90_without_spills():
    """Compiles the kernels for an H100/H200 with Triton's own ptxas (no GPU needed) at the default tiles
    and reads the cubins' resources: no register spills, shared memory within the SM's 227 KiB, and the
    float64 ``alpha`` argument (a Python float would be typed float32)."""
    script = (
        "import json, torch\n"
        "from bsrkit.backends.triton.resources import KERNELS, default_resources\n"
        "cases = [('bsr_dense_addmm', d, bs) for d in (torch.float16, torch.float32, torch.float64)"
        " for bs in (16, 64, 128)]\n"
        "cases += [(k, torch.float16, 64) for k in ('scatter_mm', 'bsr_strided_mm', 'sampled_addmm')]\n"
        "cases += [('sampled_addmm', torch.float64, 128)]\n"
        "rows = [(k, str(d), bs, default_resources(k, d, bs).__dict__) for k, d, bs in cases]\n"
        "alpha = {k: [p.annotation_type for p in f.params if p.name == 'alpha']"
        " for k, f in KERNELS.items()}\n"
        "print(json.dumps({'rows': rows, 'alpha': alpha}))\n"
    )
    report = run_python(script, env={"TRITON_INTERPRET": "0"}, timeout=600).json()
    for kernel, dtype, bs, r in report["rows"]:
        assert r["stack_bytes"] == 0 and r["local_bytes"] == 0, (kernel, dtype, bs, r)
        assert r["shared_bytes"] <= 227 * 1024, (kernel, dtype, bs, r)
    assert report["alpha"] == {
        "bsr_dense_addmm": ["fp64"], "scatter_mm": [], "bsr_strided_mm": [], "sampled_addmm": ["fp64"]
    }  # fmt: skip


@pytest.mark.parametrize("flat", [0, 1])
@pytest.mark.parametrize("bs,block_k", [((6, 4), 16), ((16, 48), 32), ((32, 32), 16)])
def test_both_inner_loops(flat, bs, block_k):
    """bsr @ dense with the nested and the flat inner loop (FLAT_LOOP), batched, non-contiguous, with an
    empty block row, and with block_k not dividing the blocks' width (the masked k chunk)."""
    bsr = random_bsr((2, bs[0] * 4, bs[1] * 3), bs, 0.5, torch.float64, empty_rows=(1,))
    dense = torch.randn(2, 19, bs[1] * 3, dtype=torch.float64).mT
    meta = {"BLOCK_M": 16, "BLOCK_K": block_k, "BLOCK_N": 16, "FLAT_LOOP": flat}
    assert_close(bsrkit.bsr_dense_mm(bsr, dense, meta=meta), reference.bsr_dense_mm(bsr, dense), k=bs[1] * 3)


def test_half_type_defaults_take_the_flat_loop():
    """The measured defaults of the bsr @ dense kernel in half types (docs/performance.md, H200)."""
    from bsrkit.backends import BACKENDS

    triton_backend = BACKENDS["triton"]
    got = triton_backend.complete_params("addmm", torch.bfloat16, (64, 64, 64), (64, 64), {})
    assert got == {
        "BLOCK_M": 64,
        "BLOCK_K": 32,
        "BLOCK_N": 128,
        "num_warps": 4,
        "num_stages": 4,
        "FLAT_LOOP": 1,
    }
    sampled = triton_backend.complete_params("sampled", torch.bfloat16, (64, 64, 64), (64, 64), {})
    assert sampled["FLAT_LOOP"] == 0 and sampled["BLOCK_K"] == 32


def test_scatter_mm_index_tensors_with_strides_are_read_by_position():
    """The kernels index the 1-D index tensors by position: a strided one (validated by its values) was
    read as if contiguous (wrong results, out-of-bounds reads)."""
    blocks, others = torch.randn(5, 4, 3), torch.randn(6, 3, 2)
    c = torch.tensor([0, 2, 2, 5])
    pq = torch.tensor([[0, 1], [4, 5], [1, 0], [2, 2], [3, 3]])
    acc = torch.zeros(3, 4, 2)
    expected = reference.scatter_mm(blocks, others, ("scatter_mm", c, pq), acc)
    strided = torch.stack([c, torch.full_like(c, 10**9)], 1)[:, 0]  # the same values, stride (2,)
    got = bsrkit.scatter_mm(blocks, others, ("scatter_mm", strided, pq), accumulators=acc.clone())
    assert_close(got, expected, k=3)
    bsr, other = random_bsr((32, 32), (8, 8), 0.5), torch.randn(32, 16)
    data = bsrkit.bsr_scatter_mm_indices_data(bsr, other, "bsr_strided_mm_compressed")
    spread = tuple(torch.stack([t, t], -1)[..., 0] if isinstance(t, torch.Tensor) else t for t in data)
    assert_close(bsrkit.bsr_scatter_mm(bsr, other, spread), reference.bsr_scatter_mm(bsr, other), k=32)


def test_scatter_mm_accumulators_aliasing_an_input_take_the_torch_primitives():
    """accumulators = others (an in-place update): a kernel would read tiles it already wrote; as on
    the CPU backend, the torch primitives form every product before adding. Self-overlapping
    accumulators get every sum, as there."""
    blocks, x0 = torch.randn(4, 4, 4), torch.randn(3, 4, 4)
    data = ("scatter_mm", torch.tensor([0, 2, 3, 5]), torch.tensor([[0, 1], [1, 2], [2, 0], [3, 1], [0, 0]]))
    expected = reference.scatter_mm(blocks, x0, data, x0)
    x = x0.clone()
    bsrkit.scatter_mm(blocks, x, data, accumulators=x)
    assert_close(x, expected, k=4)
    shared = torch.zeros(1, 4, 4)
    bsrkit.scatter_mm(blocks, x0, data, accumulators=shared.expand(3, 4, 4))
    assert_close(shared[0], reference.scatter_mm(blocks, x0, data, torch.zeros(3, 4, 4)).sum(0), k=20)


def test_float32_products_follow_torchs_new_tf32_setting(monkeypatch):
    """torch >= 2.9 raises on reading the legacy allow_tf32 once fp32_precision was set (transformers'
    enable_tf32 sets it): every float32 Triton product failed."""
    from bsrkit.backends.triton import kernels

    if getattr(torch.backends.cuda.matmul, "fp32_precision", None) is None:
        pytest.skip("no fp32_precision in this torch")
    before = (torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision)
    try:
        torch.backends.fp32_precision = "tf32"
        assert kernels.dot_precision(torch.float32) == "tf32"
        bsr, x = random_bsr((32, 32), (16, 16), 0.5), torch.randn(32, 8)
        bsrkit.bsr_dense_mm(bsr, x)  # (no RuntimeError; the interpreter's dot is exact either way)
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        assert kernels.dot_precision(torch.float32) == "ieee"
    finally:
        torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision = before
    assert kernels.dot_precision(torch.float64) == "ieee"


def test_num_warps_must_be_a_power_of_two_and_bfloat16_is_refused_on_cpu():
    bsr, x = torch.ones(32, 32).to_sparse_bsr((16, 16)), torch.randn(32, 8)  # (blocks stored: a product runs)
    with pytest.raises(ValueError, match=r"expected meta\['num_warps'\] to be a power of two in \[1, 32\]"):
        bsrkit.bsr_dense_mm(bsr, x, meta={"num_warps": 3})
    with pytest.raises(ValueError, match="has no bfloat16 on CPU tensors"):
        bsrkit.bsr_dense_mm(bsr.to(torch.bfloat16), x.to(torch.bfloat16))


def test_the_interpreter_set_after_triton_was_imported_is_named():
    """TRITON_INTERPRET=1 set after `import triton` (another library imported it first): Triton's own
    language functions are compiled functions then, and the kernels failed with an opaque InterpreterError;
    the backend names the cause instead."""
    pytest.importorskip("triton")
    script = (
        "import os, json, warnings\n"
        "warnings.filterwarnings('ignore')\n"
        "import triton, torch\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "os.environ['BSRKIT_BACKEND'] = 'triton'\n"
        "import bsrkit\n"
        "try:\n"
        "    bsrkit.bsr_dense_mm(torch.ones(32, 32).to_sparse_bsr(16), torch.randn(32, 4))\n"
        "    print(json.dumps('ran'))\n"
        "except Exception as e:\n"
        "    print(json.dumps(type(e).__name__ + ': ' + str(e)))\n"
    )
    got = run_python(script, env={"TRITON_INTERPRET": None, "BSRKIT_BACKEND": None}, timeout=300).json()
    assert got.startswith("ValueError") and "set before triton is first imported" in got, got
