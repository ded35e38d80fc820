import os
import sys
import tempfile
from pathlib import Path

# Tests never read or write the user's tuning table.
os.environ["BSRKIT_TUNING_TABLE"] = str(Path(tempfile.mkdtemp(prefix="bsrkit-tests-")) / "tuning.json")
# Triton kernels run on CPU tensors in Triton's interpreter; it must be chosen before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))

import torch

# Every sparse tensor a test builds is validated (torch otherwise warns that checks are off); the
# library's own constructions opt out explicitly, since their indices come from a validated tensor.
torch.sparse.check_sparse_tensor_invariants.enable()


import pytest  # noqa: E402


@pytest.fixture(params=["cpu", "torch", pytest.param("triton", marks=pytest.mark.triton)])
def backend(request, monkeypatch):
    """Every backend in turn, forced through $BSRKIT_BACKEND (Triton in its interpreter; skipped without
    triton). Modules that test fewer backends define their own ``backend``."""
    if request.param == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("BSRKIT_BACKEND", request.param)
    return request.param
