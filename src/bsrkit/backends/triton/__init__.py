"""GPU backend in Triton (optional).

Nothing here imports triton: :func:`available` only looks for the package, and the kernels
(:mod:`bsrkit.backends.triton.kernels`) are imported on the first product dispatched to this backend.
On CPU tensors the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` set before the first
import), which is how the test suite checks them without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from bsrkit.backends.base import (
    ParamSpec,
    int_at_least_one,
    power_of_two_at_least_16,
    power_of_two_warps,
    zero_or_one,
)
from bsrkit.backends.batching import (
    block_coordinates,
    flatten_addmm,
    flatten_scatter_stacks,
    flatten_strided_scatter,
    needs_torch_scatter,
)
from bsrkit.backends.triton.tiles import clamped_tiles

if TYPE_CHECKING:
    from bsrkit.mask_bias import BlockBias
    from bsrkit.operand import Operand

__all__ = ["TritonBackend", "available", "interpreting"]


@functools.cache
def available() -> bool:
    """True when the ``triton`` package is installed (it is not imported)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _interpreted_language() -> bool:
    """Whether Triton's own language functions were made for the interpreter: ``TRITON_INTERPRET=1`` set
    before triton was first imported (set later, the kernels fail with an opaque InterpreterError)."""
    standard = sys.modules.get("triton.language.standard")
    if standard is None:
        return True  # (triton is imported after this check, with the variable as it is now)
    return type(getattr(standard, "sum", None)).__name__ != "JITFunction"


_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class TritonBackend:
    """Triton kernels: one program per (batch, block row, row tile, column tile) of the output."""

    name = "triton"
    display_name = "Triton"
    param_schema: ClassVar[Mapping[str, ParamSpec]] = {
        "BLOCK_M": power_of_two_at_least_16,
        "BLOCK_K": power_of_two_at_least_16,
        "BLOCK_N": power_of_two_at_least_16,
        "num_warps": power_of_two_warps,
        "num_stages": int_at_least_one,
        # bsr @ dense only: one software-pipelined loop over (block, k-chunk) pairs instead of a loop over
        # k-chunks nested in a loop over blocks (see kernels._row_product_flat).
        "FLAT_LOOP": zero_or_one,
    }
    tune_flag = "--backend triton "
    auto_devices: ClassVar[frozenset[str] | None] = frozenset(
        {"cuda"}
    )  # CPU tensors only when forced, in the interpreter
    capabilities: ClassVar[frozenset[str]] = frozenset({"fused_attention"})

    def not_supported_reasons(self, kernel: str, device: torch.device, dtype: torch.dtype) -> list[str]:
        if not available():
            return ["needs the triton package (bsrkit[triton])"]
        if device.type == "cpu" and not interpreting():
            return ["on CPU tensors needs TRITON_INTERPRET=1 (Triton's interpreter)"]
        if device.type == "cpu" and not _interpreted_language():
            return ["on CPU tensors needs TRITON_INTERPRET=1 set before triton is first imported"]
        if device.type == "cpu" and dtype is torch.bfloat16 and kernel != "softmax":
            return ["has no bfloat16 on CPU tensors (Triton's interpreter computes bfloat16 dots wrongly)"]
        if device.type not in ("cpu", "cuda"):
            return [f"needs CUDA tensors, got device {device}"]
        if dtype not in _FLOATING:  # (int8 products run on the float kernels: ops.checked_addmm)
            return [f"has no {dtype} kernels (float16, bfloat16, float32, float64)"]
        return []

    def tuning_device(self, device: torch.device) -> str:
        if device.type == "cuda":
            return f"cuda:{torch.cuda.get_device_name(device)}"
        return "triton-interpreter"

    def complete_params(
        self,
        kernel: str,
        dtype: torch.dtype,
        shape: tuple[int, int, int],
        blocksize: tuple[int, int],
        chosen: dict[str, Any],
    ) -> dict[str, Any]:
        """The tile caps ``BLOCK_M`` (rows of a block per program), ``BLOCK_K`` (inner-dimension chunk),
        ``BLOCK_N`` (output columns per program), which the kernels clamp to the padded extent;
        ``num_warps``; ``num_stages``.

        ``FLAT_LOOP`` (``bsr_dense_mm``'s kernel: one pipelined loop over (block, k-chunk) pairs).

        Defaults. The ``bsr @ dense`` kernel in half types: the flat loop, 64 x 32 x 128 tiles, 4 warps, 4
        stages. On an H200 (docs/performance.md; n = 8192, densities 0.1 and 0.5, geometric mean) that
        took 0.44x the time of the nested loop with 128 x 32 x 64 / 8 warps / 2 stages at blocksize 32 (the
        best of 7 candidates), 0.66-0.80x at 64 and 0.62-0.67x at 128 (where the shipped entry is faster
        still). It compiles for sm_90 without spills at every blocksize (the best bs-128
        tiles there, 128 x 64 x 128, spill under Triton 3.9) in 32 KB of shared memory, so it launches on
        sm_80 to sm_90. Elsewhere (float32, float64, SDDMM, scatter): the largest tiles whose kernels
        compile for sm_90 without register spills in every dtype (``bsrkit.backends.triton.resources``):
        128 x 32 x 64 for half types, 128 x 16 x 64 for float32 and float64 (their IEEE ``tl.dot`` holds
        its operands in registers), 8 warps for tiles of 128 x 64 outputs and more, else 4. Per-device
        tables (``bsrkit/tuned/``) refine these."""
        half = dtype in (torch.float16, torch.bfloat16)
        if half and kernel == "addmm":  # the bsr @ dense kernel
            params = {"BLOCK_M": 64, "BLOCK_K": 32, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4}
            return {**params, "FLAT_LOOP": 1, **chosen}
        params = {
            "BLOCK_M": 128,
            "BLOCK_K": 32 if half else 16,
            "BLOCK_N": 64,
            "num_warps": 4,
            "num_stages": 2,
            "FLAT_LOOP": 0,
        }
        params.update(chosen)
        if "num_warps" not in chosen:
            # The output tile one program computes: rows of a block by columns of N (of a block for SDDMM).
            cols = blocksize[1] if kernel == "sampled" else shape[2]
            tiles = clamped_tiles(params, blocksize[0], blocksize[1], cols)
            params["num_warps"] = 8 if tiles["BLOCK_M"] * tiles["BLOCK_N"] >= 128 * 64 else 4
        return params

    def addmm(
        self,
        a: Operand,
        dense: torch.Tensor,
        out: torch.Tensor,
        batch: torch.Size,
        alpha: float,
        overwrite: bool,
        params: dict[str, Any],
    ) -> None:
        from bsrkit.backends.triton import kernels

        crow, col, values, dense3, out3, copied = flatten_addmm(a, dense, out, batch)
        kernels.bsr_dense_addmm(crow, col, values, dense3, out3, alpha, overwrite, params)
        if copied:
            out.copy_(out3.view(out.shape))

    def sampled(
        self,
        a: Operand,
        mat1: torch.Tensor,
        mat2: torch.Tensor,
        batch: torch.Size,
        alpha: float,
        params: dict[str, Any],
    ) -> torch.Tensor:
        from bsrkit.backends.triton import kernels

        rows, cols = block_coordinates(a, batch)
        Ms, Ns = a.values.shape[-2:]
        B = rows.shape[0]
        M, K = mat1.shape[-2:]
        N = mat2.shape[-1]
        mat1_3 = mat1.expand(*batch, M, K).reshape(B, M, K)
        mat2_3 = mat2.expand(*batch, K, N).reshape(B, K, N)
        return kernels.sampled_blocks(rows, cols, Ms, Ns, mat1_3, mat2_3, alpha, params)

    def scatter_mm(
        self,
        blocks: torch.Tensor,
        others: torch.Tensor,
        indices_data: tuple[Any, ...],
        accumulators: torch.Tensor,
        params: dict[str, Any],
        overwrite: bool = False,
    ) -> None:
        from bsrkit.backends.torch_ops import TorchBackend
        from bsrkit.backends.triton import kernels

        if needs_torch_scatter(blocks, others, accumulators):
            TorchBackend().scatter_mm(blocks, others, indices_data, accumulators, params, overwrite)
            return
        # (the kernels index the 1-D index tensors by position: unit strides)
        indices_data = tuple(
            t.contiguous() if isinstance(t, torch.Tensor) and t.ndim == 1 else t for t in indices_data
        )
        if overwrite:
            accumulators.zero_()
        if indices_data[0] == "scatter_mm":
            others3, acc3, copied = flatten_scatter_stacks(others, accumulators)
        else:
            others3, acc3, copied = flatten_strided_scatter(others, accumulators)
        kernels.scatter_mm_into(blocks, others3, indices_data, acc3, params)
        if copied:
            accumulators.copy_(acc3.view(accumulators.shape))

    def softmax(
        self,
        a: Operand,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        zero_empty_rows: bool,
    ) -> torch.Tensor:
        from bsrkit.backends.triton import softmax_kernels

        nnz, Ms, Ns = x.shape[-3:]
        x4 = x.reshape(-1, nnz, Ms, Ns)
        bias4 = None if bias is None else bias.expand(x.shape).reshape(x4.shape)
        crow = a.kernel_indices()[0].reshape(x4.shape[0], -1)
        return softmax_kernels.softmax_blocks(crow, x4, bias4, zero_empty_rows).reshape(x.shape)

    def softmax_backward(self, a: Operand, y: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        from bsrkit.backends.triton import softmax_kernels

        nnz, Ms, Ns = y.shape[-3:]
        y4 = y.reshape(-1, nnz, Ms, Ns)
        g4 = grad.expand(y.shape).reshape(y4.shape)
        crow = a.kernel_indices()[0].reshape(y4.shape[0], -1)
        return softmax_kernels.softmax_backward_blocks(crow, y4, g4).reshape(y.shape)

    def attention_forward(
        self,
        a: Operand,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        bias: BlockBias,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Fused attention forward (an optional capability): (output, row log-sum-exp), or None where it
        does not apply (float64, blocks or head sizes over 128). See :mod:`.attention_kernels`."""
        from bsrkit.backends.triton import attention_kernels

        if not attention_kernels.supported(a, query, value):
            return None
        return attention_kernels.forward(a, query, key, value, bias, scale)

    def attention_backward(
        self,
        a: Operand,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        grad: torch.Tensor,
        bias: BlockBias,
        scale: float,
    ) -> None:
        """Not fused on Triton: None, so the backward recomputes the weights on the composed path."""
        return None
