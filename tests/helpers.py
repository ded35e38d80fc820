"""Random BSR factories and per-dtype tolerances shared by the tests."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import bsrkit
from bsrkit.reference import tolerances

__all__ = [
    "BACKEND_NAMES",
    "CPU_PATHS",
    "DTYPES",
    "PRODUCT_PATHS",
    "ProductPath",
    "assert_close",
    "backends",
    "product_paths",
    "random_bsr",
    "run_python",
    "tolerances",
]

SRC = Path(__file__).parents[1] / "src"

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


# -- the backends and product paths the tests run on ------------------------------------------------------

BACKEND_NAMES = ("cpu", "torch", "triton")  # the values of $BSRKIT_BACKEND


def backends(*names: str) -> list:
    """``pytest.param``s for the ``backend`` fixture (tests/conftest.py): every backend, or the ones named
    (for ``@pytest.mark.parametrize("backend", backends("cpu", "torch"), indirect=True)``)."""
    return [pytest.param(n, marks=pytest.mark.triton) if n == "triton" else n for n in names or BACKEND_NAMES]


@dataclass(frozen=True)
class ProductPath:
    """One way a product runs: the backend forced through $BSRKIT_BACKEND and, on the CPU backend, the
    ``meta`` that picks its loops (``small_n``: the vector loops, or a gemm per block). ``mm``, ``addmm``
    and ``transposed_mm`` are the public ops with that ``meta`` merged into the call's own."""

    name: str
    backend: str
    meta: dict[str, Any] = field(default_factory=dict)
    # Triton's interpreter computes tl.dot wrongly in bfloat16 (measured: error 1e10 on a 5x7 @ 7x3
    # product, triton 3.9); on a GPU it is a supported dtype of the same kernels.
    skip_dtypes: tuple[torch.dtype, ...] = ()

    def _meta(self, meta: dict[str, Any] | None) -> dict[str, Any] | None:
        merged = {**self.meta, **(meta or {})}
        return merged or None

    def mm(self, bsr: torch.Tensor, dense: torch.Tensor, *, meta=None, **kwargs) -> torch.Tensor:
        return bsrkit.bsr_dense_mm(bsr, dense, meta=self._meta(meta), **kwargs)

    def addmm(self, input, bsr, dense, *, meta=None, **kwargs) -> torch.Tensor:
        return bsrkit.bsr_dense_addmm(input, bsr, dense, meta=self._meta(meta), **kwargs)

    def transposed_mm(self, bsr: torch.Tensor, dense: torch.Tensor, *, meta=None, **kwargs) -> torch.Tensor:
        return bsrkit.bsr_transposed_dense_mm(bsr, dense, meta=self._meta(meta), **kwargs)

    def skip_unsupported(self, dtype: torch.dtype) -> None:
        if dtype in self.skip_dtypes:
            pytest.skip(f"{self.name}: no correct {dtype} products here")


PRODUCT_PATHS = {
    p.name: p
    for p in (
        ProductPath("cpu-gemm", "cpu", {"small_n": False}),
        ProductPath("cpu-small-n", "cpu", {"small_n": True}),
        ProductPath("torch", "torch"),
        ProductPath("triton", "triton", skip_dtypes=(torch.bfloat16,)),
    )
}
CPU_PATHS = ("cpu-gemm", "cpu-small-n")


def product_paths(*names: str) -> list:
    """``pytest.param``s for the ``product_path`` fixture (tests/conftest.py): every path, or the ones
    named (for ``@pytest.mark.parametrize("product_path", product_paths(*CPU_PATHS), indirect=True)``)."""
    return [
        pytest.param(n, marks=pytest.mark.triton) if PRODUCT_PATHS[n].backend == "triton" else n
        for n in names or PRODUCT_PATHS
    ]


# -- inputs and tolerances ---------------------------------------------------------------------------------


def assert_close(actual: torch.Tensor, expected: torch.Tensor, k: int = 1) -> None:
    torch.testing.assert_close(actual, expected, **tolerances(expected.dtype, k))


def random_bsr(
    shape: tuple[int, ...],
    blocksize: tuple[int, int],
    density: float,
    dtype: torch.dtype = torch.float32,
    *,
    empty_rows: tuple[int, ...] = (),
    empty_cols: tuple[int, ...] = (),
    integers: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """A (batched) BSR tensor with about ``density`` of its blocks stored.

    Listed block rows/columns are forced empty. With ``integers``, values are small integers so that
    float products are exact and any indexing error shows as a wrong integer.
    """
    *batch, M, K = shape
    Ms, Ks = blocksize
    mask = torch.rand((*batch, M // Ms, K // Ks), generator=generator) < density
    for r in empty_rows:
        mask[..., r, :] = False
    for c in empty_cols:
        mask[..., :, c] = False
    if batch:  # batched BSR needs the same nnz in every batch: use the first pattern everywhere
        mask = mask.reshape(math.prod(batch), *mask.shape[-2:])[:1].expand(*batch, -1, -1)
    if integers:
        vals = torch.randint(-3, 4, (*batch, M, K), generator=generator).to(dtype)
    else:
        vals = torch.randn((*batch, M, K), generator=generator).to(dtype)
    full_mask = mask.repeat_interleave(Ms, -2).repeat_interleave(Ks, -1)
    dense = torch.where(full_mask, vals, torch.zeros((), dtype=dtype))
    # Mark stored blocks with a nonzero so that to_sparse_bsr keeps exactly the masked blocks.
    return _to_bsr(dense, mask, blocksize)


def _to_bsr(dense: torch.Tensor, mask: torch.Tensor, blocksize: tuple[int, int]) -> torch.Tensor:
    """BSR with exactly the blocks in ``mask`` stored (zeros inside stored blocks are kept)."""
    *batch, MB, KB = mask.shape
    Ms, Ks = blocksize
    nb = math.prod(batch)  # (explicit: -1 is ambiguous for zero block rows)
    flat_mask = mask.reshape(nb, MB, KB)[0]
    crow = torch.zeros(MB + 1, dtype=torch.int64)
    crow[1:] = flat_mask.sum(1).cumsum(0)
    rows, cols = flat_mask.nonzero(as_tuple=True)
    blocks = dense.reshape(nb, MB, Ms, KB, Ks).transpose(-3, -2)  # (B, MB, KB, Ms, Ks)
    values = blocks[:, rows, cols]  # (B, nnz, Ms, Ks)
    nb = values.shape[0]
    if batch:
        crow = crow.expand(nb, -1).reshape(*batch, -1)
        col = cols.expand(nb, -1).reshape(*batch, -1)
        values = values.reshape(*batch, *values.shape[1:])
    else:
        col = cols
        values = values[0]
    return torch.sparse_bsr_tensor(
        crow.contiguous(),
        col.contiguous(),
        values.contiguous(),
        size=dense.shape,
        check_invariants=True,
    )


def run_python(code: str, timeout: float = 300, env: dict[str, str] | None = None) -> dict:
    """Run ``code`` in a fresh Python process (this tree's ``src`` first on the path, a temporary working
    directory, a hard time limit) and return the JSON object its last line of stdout prints."""
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join([str(SRC), full_env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="bsrkit-run-") as cwd:
        done = subprocess.run(
            [sys.executable, "-c", code],
            env=full_env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
