import os
import sys
import tempfile
from pathlib import Path

# Tests never read or write the user's tuning table; the directory goes when pytest exits (its finalizer).
_TUNING_DIR = tempfile.TemporaryDirectory(prefix="bsrkit-tests-")
os.environ["BSRKIT_TUNING_TABLE"] = str(Path(_TUNING_DIR.name) / "tuning.json")
# Triton kernels run on CPU tensors in Triton's interpreter; it must be chosen before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

# Every sparse tensor a test builds is validated (torch otherwise warns that checks are off); the
# library's own constructions opt out explicitly, since their indices come from a validated tensor.
torch.sparse.check_sparse_tensor_invariants.enable()


import pytest  # noqa: E402

from helpers import PRODUCT_PATHS, ProductPath, backends, product_paths  # noqa: E402


@pytest.fixture(params=backends())
def backend(request, monkeypatch) -> str:
    """Every backend in turn, forced through $BSRKIT_BACKEND (Triton in its interpreter; skipped without
    triton). Tests on fewer backends parametrize it indirectly: ``@pytest.mark.parametrize("backend",
    backends("cpu", "torch"), indirect=True)``."""
    if request.param == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("BSRKIT_BACKEND", request.param)
    return request.param


@pytest.fixture(params=product_paths())
def product_path(request, monkeypatch) -> ProductPath:
    """Every product path in turn (helpers.PRODUCT_PATHS: the CPU backend's gemm and vector loops, torch,
    Triton in its interpreter): its backend forced through $BSRKIT_BACKEND, its ``meta`` added by the
    path's ``mm``/``addmm``/``transposed_mm``. Tests on fewer paths parametrize it indirectly with
    ``helpers.product_paths(...)``."""
    path = PRODUCT_PATHS[request.param]
    if path.backend == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("BSRKIT_BACKEND", path.backend)
    return path
