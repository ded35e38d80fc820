"""Compile the Triton kernels for a GPU architecture without a GPU, and read their resource usage.

Triton's wheel ships ptxas and cuobjdump, so ``triton.compile`` produces a real cubin on a machine with
no CUDA device. Registers, spills (local memory) and shared memory per program are what decide whether a
tile configuration launches at all and how many programs share an SM; checking them here catches a
kernel that would fail to compile or spill on the GPU long before one is available.

    report = kernel_resources("bsr_dense_addmm", torch.float16, BLOCK_M=64, BLOCK_K=64, BLOCK_N=64)
    report.registers, report.local_bytes, report.shared_bytes
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bsrkit.backends.triton import kernels
from bsrkit.backends.triton.tiles import clamped_tiles

__all__ = ["KERNELS", "Resources", "default_resources", "kernel_resources"]

KERNELS = {
    "bsr_dense_addmm": kernels._bsr_dense_addmm_kernel,
    "scatter_mm": kernels._scatter_mm_batches_kernel,
    "bsr_strided_mm": kernels._scatter_mm_strided_kernel,
    "sampled_addmm": kernels._sampled_kernel,
}

# Pointer arguments that hold indices; every other pointer holds values of the product's dtype.
_INDEX_POINTERS = {
    "crow_ptr", "col_ptr", "c_offsets_ptr", "pq_ptr", "c_indices_ptr", "r_offsets_ptr", "p_offsets_ptr",
    "q_offsets_ptr", "rows_ptr", "cols_ptr",
}  # fmt: skip
# Strides that are 1 for contiguous operands: Triton specializes an int argument equal to 1 to a constant
# at launch, so these are compiled as such (it is what makes the row-major loads vectorize).
_UNIT_STRIDES = {
    "stride_crow_m", "stride_col_g", "stride_values_k", "stride_dense_n", "stride_out_n",
    "stride_blocks_k", "stride_others_n", "stride_acc_n", "stride_pq_i", "stride_rows_g", "stride_cols_g",
    "stride_mat1_k", "stride_mat2_n",
}  # fmt: skip
_TRITON_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
_INDEX_DTYPE = {torch.int32: "i32", torch.int64: "i64"}


@dataclasses.dataclass(frozen=True)
class Resources:
    """Per-program resources of one compiled kernel."""

    registers: int  # per thread; 255 is the hardware maximum
    local_bytes: int  # per thread; > 0 means registers spilled to local memory
    stack_bytes: int
    shared_bytes: int  # per program (Triton's static allocation)
    tiles: tuple[int, int, int]  # BLOCK_M, BLOCK_K, BLOCK_N
    num_warps: int


def kernel_resources(
    kernel: str,
    dtype: torch.dtype,
    *,
    BLOCK_M: int,
    BLOCK_K: int,
    BLOCK_N: int,
    num_warps: int = 4,
    num_stages: int = 2,
    arch: int = 90,
    index_dtype: torch.dtype = torch.int64,
    contiguous: bool = True,
    **constexprs: Any,
) -> Resources:
    """Compile ``kernel`` (a key of :data:`KERNELS`) for ``sm_<arch>`` and read the cubin's resources.

    ``contiguous`` compiles the unit strides of row-major operands as constants, as a launch on
    contiguous tensors does; False keeps every stride a runtime value (the non-contiguous case).
    ``constexprs`` sets the kernel's remaining constexpr flags (defaults: ``OVERWRITE=True``,
    ``IS_COMPRESSED=True``, ``FLAT_LOOP=False``, ``EVEN_K=True``)."""
    fn = KERNELS[kernel]
    values: dict[str, Any] = {
        "ACC_DTYPE": kernels._ACC[dtype],
        "PRECISION": kernels.dot_precision(dtype),
        "BLOCK_M": BLOCK_M,
        "BLOCK_K": BLOCK_K,
        "BLOCK_N": BLOCK_N,
        "OVERWRITE": True,
        "IS_COMPRESSED": True,
        "FLAT_LOOP": False,
        "EVEN_K": True,
        **constexprs,
    }
    signature: dict[str, str] = {}
    fixed: dict[tuple[int, ...], Any] = {}
    for i, param in enumerate(fn.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
            fixed[(i,)] = values[name]
        elif name.endswith("_ptr"):
            signature[name] = "*" + (
                _INDEX_DTYPE[index_dtype] if name in _INDEX_POINTERS else _TRITON_DTYPE[dtype]
            )
        elif contiguous and name in _UNIT_STRIDES:
            signature[name] = "constexpr"
            fixed[(i,)] = 1
        else:
            signature[name] = param.annotation_type or "i32"
    source = ASTSource(fn=fn, signature=signature, constexprs=fixed)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    usage = _resource_usage(compiled.asm["cubin"])
    return Resources(
        registers=usage["REG"],
        local_bytes=usage["LOCAL"],
        stack_bytes=usage["STACK"],
        shared_bytes=max(usage["SHARED"], compiled.metadata.shared),
        tiles=(BLOCK_M, BLOCK_K, BLOCK_N),
        num_warps=num_warps,
    )


def default_resources(
    kernel: str, dtype: torch.dtype, blocksize: int, n: int = 4096, arch: int = 90
) -> Resources:
    """Resources of ``kernel`` as a product with square ``blocksize`` blocks on n x n operands launches it
    by default (no tuning table): the tiles and warps of :func:`bsrkit.tuning.triton_meta`, clamped to the
    block as the launchers clamp them."""
    from bsrkit import tuning

    op = {"bsr_dense_addmm": "bsr_dense_mm", "bsr_strided_mm": "scatter_mm"}.get(kernel, kernel)
    meta = tuning.triton_meta(op, torch.device("cpu"), dtype, (n, n, n), (blocksize, blocksize), {})
    inner = n if kernel == "sampled_addmm" else blocksize
    cols = blocksize if kernel == "sampled_addmm" else n
    tiles = clamped_tiles(meta, blocksize, inner, cols)
    return kernel_resources(
        kernel,
        dtype,
        BLOCK_M=tiles["BLOCK_M"],
        BLOCK_K=tiles["BLOCK_K"],
        BLOCK_N=tiles["BLOCK_N"],
        num_warps=meta["num_warps"],
        num_stages=meta["num_stages"],
        arch=arch,
        FLAT_LOOP=bool(meta.get("FLAT_LOOP", 0)),
        EVEN_K=inner % tiles["BLOCK_K"] == 0,
    )


def _resource_usage(cubin: bytes) -> dict[str, int]:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run(
            [tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {name: int(fields.get(name, 0)) for name in ("REG", "STACK", "SHARED", "LOCAL")}
