"""What the tests share: random BSR factories, per-dtype tolerances, the backends and product paths the
fixtures of conftest.py run on, and child Pythons under a time limit."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import bsrkit
from bsrkit import reference
from bsrkit.reference import tolerances

__all__ = [
    "BACKEND_NAMES",
    "CPU_PATHS",
    "DTYPES",
    "PRODUCT_PATHS",
    "ProductPath",
    "PythonRun",
    "assert_close",
    "backends",
    "finish_python",
    "product_paths",
    "python_env",
    "random_bsr",
    "run_python",
    "start_python",
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
    """``actual`` against ``expected`` by the library's one rule (:func:`bsrkit.reference.assert_close`):
    elementwise and normwise, in ``expected``'s dtype, for k-term sums."""
    if actual.layout != torch.strided or expected.layout != torch.strided:
        torch.testing.assert_close(actual, expected, **tolerances(expected.dtype, k))
        return
    reference.assert_close(actual, expected, k=k)


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


# -- child Pythons ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PythonRun:
    """A child Python that finished: its command line, exit status and captured output."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        """The tails of stdout and stderr, for an assertion's message."""
        return self.stdout[-3000:] + self.stderr[-3000:]

    @property
    def last_line(self) -> str:
        """The last non-empty line of stdout."""
        lines = self.stdout.strip().splitlines()
        assert lines, f"the child printed nothing:\n{self.output}"
        return lines[-1]

    def json(self) -> Any:
        """The JSON value on the last line of stdout (the scripts print their report there)."""
        return json.loads(self.last_line)


def python_env(env: dict[str, str | None] | None = None) -> dict[str, str]:
    """This process's environment with ``env`` applied (a None value removes the variable) and this tree's
    ``src`` first on ``PYTHONPATH``."""
    full = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    full["PYTHONPATH"] = os.pathsep.join([str(SRC), full.get("PYTHONPATH", "")])
    return full


def start_python(
    code_or_args: str | Sequence[str],
    *,
    env: dict[str, str | None] | None = None,
    cwd: str | Path | None = None,
    stdout: Any = subprocess.PIPE,
    stderr: Any = subprocess.PIPE,
) -> subprocess.Popen:
    """Start a fresh Python on ``code_or_args`` (source code for ``-c``, or the arguments after the
    interpreter: a script and its arguments, ``-m`` and a module, ``-c`` and code and ``sys.argv``), with
    :func:`python_env` and, without ``cwd``, a new temporary working directory. For processes that must
    run side by side; finish each with :func:`finish_python`."""
    args = [sys.executable, "-c", code_or_args] if isinstance(code_or_args, str) else [
        sys.executable, *map(str, code_or_args)
    ]  # fmt: skip
    tmp = None if cwd is not None else tempfile.mkdtemp(prefix="bsrkit-run-")
    cwd = cwd if cwd is not None else tmp
    proc = subprocess.Popen(args, env=python_env(env), cwd=cwd, stdout=stdout, stderr=stderr, text=True)
    proc._bsrkit_tmp = tmp  # type: ignore[attr-defined]  (removed by finish_python)
    return proc


def finish_python(proc: subprocess.Popen, *, timeout: float, check: bool = True) -> PythonRun:
    """Wait for a child of :func:`start_python` at most ``timeout`` seconds. Past the limit it is killed
    and the test fails with its output so far; with ``check`` a non-zero exit fails the test too, with
    the child's output."""
    try:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            run = PythonRun(proc.args, proc.returncode, out or "", err or "")
            pytest.fail(f"{_describe(proc.args)} did not finish in {timeout} s; its output:\n{run.output}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if getattr(proc, "_bsrkit_tmp", None):
            shutil.rmtree(proc._bsrkit_tmp, ignore_errors=True)
    run = PythonRun(proc.args, proc.returncode, out or "", err or "")
    if check and run.returncode != 0:
        pytest.fail(f"{_describe(proc.args)} exited with {run.returncode}; its output:\n{run.output}")
    return run


def run_python(
    code_or_args: str | Sequence[str],
    *,
    env: dict[str, str | None] | None = None,
    timeout: float = 300,
    cwd: str | Path | None = None,
    check: bool = True,
) -> PythonRun:
    """Run a fresh Python to completion (see :func:`start_python` and :func:`finish_python`): a hard time
    limit, this tree's ``src`` first on the path, the test failed with the child's output if it exits
    non-zero (unless ``check=False``) or runs past ``timeout``. ``.json()`` reads the report a script
    prints on its last line."""
    return finish_python(start_python(code_or_args, env=env, cwd=cwd), timeout=timeout, check=check)


def _describe(args: Sequence[str]) -> str:
    shown = [a if len(a) <= 60 else a[:57] + "..." for a in args[1:]]
    return "the child Python " + repr(shown)


class AttentionBlock(torch.nn.Module):
    """nn.MultiheadAttention (whose out_proj no BSRLinear can stand for) and a linear layer after it."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x, x, x)[0])
