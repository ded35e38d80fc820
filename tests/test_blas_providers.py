"""BLAS providers of the CPU kernels: MKL from torch's library, or SciPy's BLAS (``$BSRKIT_BLAS``).

The product checks run again on the SciPy path in a subprocess (the provider is chosen once per process):
tests/test_products.py and the sampled/transposed tests of tests/test_autograd.py, CPU backend, float32 and
float64 (SciPy has no half gemm). This module is also that subprocess's pytest plugin (``-p``): its
``pytest_collection_modifyitems`` hook deselects what the SciPy path cannot run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from bsrkit.backends.cpu import blas, kernels
from helpers import CPU_PATHS, run_python

HALF = (torch.float16, torch.bfloat16)
TESTS = Path(__file__).parent


def pytest_collection_modifyitems(config, items):  # active only when loaded with -p (the subprocess)
    """Keep the CPU-backend cases whose parameters name no half dtype."""
    provider = blas.blas_provider()
    assert provider is not None and provider.name == "scipy", provider
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        values = list(params.values())
        on_cpu = params.get("backend", "cpu") == "cpu" and params.get("product_path", "cpu-gemm") in CPU_PATHS
        (keep if on_cpu and not any(v in HALF for v in values) else drop).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


def test_unknown_provider_name_is_refused():
    expected = r"expected \$BSRKIT_BLAS in \('mkl', 'scipy'\) or unset, got 'acml'"
    with pytest.raises(ValueError, match=expected):
        blas._provider("acml")


def test_supported_kinds_follow_the_provider(monkeypatch):
    provider = blas.blas_provider()
    if provider is None:
        assert kernels.supported_kinds() == frozenset()
        return
    expected = {kernels.KIND_F32, kernels.KIND_F64}
    if provider.name == "mkl":
        expected |= {kernels.KIND_BF16, kernels.KIND_F16}
    assert kernels.supported_kinds() == expected


def test_compiled_module_repeats_the_kind_values():
    from bsrkit.backends.cpu.compiled import constants  # (one definition, which kernels re-exports)

    for name in ("KIND_F32", "KIND_F64", "KIND_BF16", "KIND_F16", "DOT_NONE", "DOT_COLUMNS", "DOT_PAIRS"):
        assert getattr(constants, name) == getattr(kernels, name)


def test_scipy_provider_has_float_gemm_only():
    pytest.importorskip("scipy.linalg.cython_blas")
    provider = blas.scipy_functions()
    assert provider is not None
    assert provider.name == "scipy"
    assert provider.sgemm and provider.dgemm
    assert not provider.has_half
    assert provider.set_num_threads_local == 0


def test_half_kind_on_a_provider_without_half_gemm_is_refused(monkeypatch):
    """The refusal comes before any BLAS call (the address would be 0)."""
    provider = blas.BLASProvider("nohalf", 1, 1, 0, 0, 0)
    monkeypatch.setattr(kernels, "blas_provider", lambda: provider)
    from bsrkit.backends.cpu.compiled import entries as _jit
    from bsrkit.backends.cpu.compiled.gemm import BsrMMArgs

    run = kernels._bind("bsr_mm_kernel", _jit.bsr_mm, _jit.bsr_mm_serial, BsrMMArgs, provider)
    args = [kernels.KIND_BF16] + [0] * (len(BsrMMArgs._fields) - len(BsrMMArgs._field_defaults) - 1)
    with pytest.raises(ValueError, match=r"expected a kind in \['float32', 'float64'\].*got bfloat16"):
        run(BsrMMArgs(*args))
    with pytest.raises(TypeError, match="expected a BsrMMArgs, got tuple"):
        run((1, 2, 3))


def test_forced_provider_that_is_missing_warns_and_disables(monkeypatch):
    monkeypatch.setattr(blas, "scipy_functions", lambda: None)
    blas._provider.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="BSRKIT_BLAS=scipy: that BLAS is not available"):
            assert blas._provider("scipy") is None
    finally:
        blas._provider.cache_clear()


@pytest.mark.slow  # (about a minute: the product suite again, in a child process on scipy's BLAS)
def test_product_suite_on_the_scipy_blas():
    pytest.importorskip("scipy.linalg.cython_blas")
    env = {"BSRKIT_BLAS": "scipy", "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    args = [
        "-m", "pytest", "-q", "-x", "-p", "test_blas_providers", "-p", "no:cacheprovider",
        TESTS / "test_products.py", TESTS / "test_autograd.py",
        "-k", "not autograd or sampled or transposed",
    ]  # fmt: skip
    done = run_python(args, env=env, timeout=600, cwd=TESTS.parent)
    assert " passed" in done.stdout and "deselected" in done.stdout, done.output


@pytest.mark.parametrize("column_major", [(False, False), (True, False), (False, True)])
def test_sampled_kernel_accumulates_over_chunks_of_k(column_major):
    """A provider that threads large calls (OpenBLAS) gets each block's gemm cut into chunks of K, here
    3 + 3 + 3 + 1, with either operand row- or column-major."""
    provider = blas.blas_provider()
    if provider is None:
        pytest.skip("no BLAS for the CPU kernels")
    from bsrkit.backends.cpu.compiled import entries as _jit
    from bsrkit.backends.cpu.compiled.sampled import SampledArgs

    Ms, Ns, K = 4, 5, 10
    limited = provider._replace(single_thread_mnk=Ms * Ns * 3)
    run = kernels._bind(
        "sampled_kernel",
        _jit.sampled,
        _jit.sampled_serial,
        SampledArgs,
        limited,
        lambda args, mnk: args._replace(k_chunk=max(1, min(args.K, mnk // (args.Ms * args.Ns)))),
    )  # fmt: skip  (the same rule as kernels.sampled_kernel)
    torch.manual_seed(3)
    mat1 = torch.randint(-3, 4, (3 * Ms, K), dtype=torch.float64)
    mat2 = torch.randint(-3, 4, (K, 2 * Ns), dtype=torch.float64)
    if column_major[0]:
        mat1 = mat1.t().contiguous().t()
    if column_major[1]:
        mat2 = mat2.t().contiguous().t()
    rows = torch.tensor([[0, 2, 1]])
    cols = torch.tensor([[1, 0, 1]])
    out = torch.full((1, 3, Ms, Ns), float("nan"), dtype=torch.float64)
    a_layout = kernels.blas_layout(mat1.stride(0), mat1.stride(1), *mat1.shape)
    b_layout = kernels.blas_layout(mat2.stride(0), mat2.stride(1), *mat2.shape)
    assert a_layout is not None and b_layout is not None
    zero = torch.zeros(1, dtype=torch.int64).numpy()
    run(SampledArgs(
        kernels.KIND_F64, rows.numpy(), cols.numpy(), 2,
        mat1.data_ptr(), zero, mat1.stride(0), a_layout[0], a_layout[1],
        mat2.data_ptr(), zero, mat2.stride(1), b_layout[0], b_layout[1],
        out.data_ptr(), Ms, Ns, K, 2, 8, 8,
    ))  # fmt: skip
    product = 2 * mat1 @ mat2
    for g, (r, c) in enumerate(zip(rows[0].tolist(), cols[0].tolist(), strict=True)):
        assert torch.equal(out[0, g], product[r * Ms : (r + 1) * Ms, c * Ns : (c + 1) * Ns]), g


@pytest.mark.parametrize("kind", [0, 1])  # KIND_F32, KIND_F64
def test_gemm_scalars_live_in_the_buffer_the_loop_keeps(kind):
    """Every gemm scalar a worker passes by pointer is inside the one buffer its loops keep alive (numba
    frees an array after its last use, so a separate scalar array could be reused while gemm reads it)."""
    import ctypes

    from bsrkit.backends.cpu.compiled import intrinsics

    ints, p_int, p_real, rsize, p_chr = intrinsics.gemm_scalars(kind, 2.5, True, True, False, 5, 6, 7, 8)
    assert p_int == ints.ctypes.data and p_int < p_real < p_chr < p_int + ints.nbytes
    assert list(ints[:9]) == [0, 0, 8, 6, 5, 7, 0, 1, 1]  # m n k lda ldb ldc 0 threads 1 (swapped lda/ldb)
    real = ctypes.c_double if kind == 1 else ctypes.c_float
    assert rsize == ctypes.sizeof(real)
    assert [real.from_address(p_real + i * rsize).value for i in range(3)] == [2.5, 0.0, 1.0]
    assert bytes((ctypes.c_ubyte * 4).from_address(p_chr)) == b"TNNN"  # B^T A^T: b column-major, a row-major
