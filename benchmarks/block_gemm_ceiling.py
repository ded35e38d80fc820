"""The ceiling of one BLAS call per block: MKL gemm on the CPU kernel's block shapes, cache-hot, vs dense mm.

The CPU kernel computes a row-major ``C (+)= A_block @ X`` panel by panel as the column-major
``C^T = X^T A_block^T``: one Fortran ``sgemm`` with ``m = panel`` (output columns), ``n = k = blocksize``.
This times that call alone, repeated on the same L1/L2-resident operands (no cache misses, no Python, one
thread), so no product made of such calls can exceed its rate. Alongside: MKL's packed API
(``sgemm_pack`` once, then ``sgemm_compute`` per call, the packing of the ``panel x blocksize`` operand
removed from the call) and the bytes ``sgemm_pack_get_size`` asks for per packed operand, and dense
``torch.mm`` at n = 2048 on the same thread. Prints GF/s and ratios to the dense rate.

    .venv/bin/python benchmarks/block_gemm_ceiling.py [--blocksizes 16 32 64] [--panels 64 256 1024]
"""

from __future__ import annotations

import argparse
import ctypes
import os

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from bsrkit.benchmarking import min_seconds

_I8P = ir.IntType(8).as_pointer()


def _pointer_call(nargs: int, returns_int: bool = False):
    """An intrinsic ``call(fn, (p1, ..., pn))``: the C function at address ``fn`` with n pointer arguments."""

    @intrinsic
    def call(typingctx, fn, args):
        def codegen(context, builder, signature, llargs):
            address = context.cast(builder, llargs[0], signature.args[0], types.int64)
            pointers = [builder.inttoptr(builder.extract_value(llargs[1], i), _I8P) for i in range(nargs)]
            result = ir.IntType(64) if returns_int else ir.VoidType()
            fnty = ir.FunctionType(result, [_I8P] * nargs)
            value = builder.call(builder.inttoptr(address, fnty.as_pointer()), pointers)
            return value if returns_int else context.get_dummy_value()

        return (types.int64 if returns_int else types.void)(fn, args), codegen

    return call


_call4, _call9, _call12, _call13 = (
    _pointer_call(4, True), _pointer_call(9), _pointer_call(12), _pointer_call(13)
)  # fmt: skip


@numba.njit(nogil=True)
def _gemm_state(m, n, k, lda, ldb, ldc, char0, char1, char2):
    """Fortran gemm's scalars, all passed by address: int32 m, n, k, lda, ldb, ldc at bytes 0-23, float32
    alpha = beta = 1 at 24 and 28, three flag characters at 36-38."""
    state = np.zeros(12, np.int32)
    state[0], state[1], state[2], state[3], state[4], state[5] = m, n, k, lda, ldb, ldc
    reals = state[6:8].view(np.float32)
    reals[0] = 1.0
    reals[1] = 1.0
    chars = state[9:10].view(np.uint8)
    chars[0], chars[1], chars[2] = char0, char1, char2
    return state


@numba.njit(nogil=True)
def _repeat_gemm(gemm, reps, m, n, k, a, lda, b, ldb, c, ldc):
    """``reps`` calls of Fortran sgemm: C (m x n, ldc) += A (m x k, lda) @ B (k x n, ldb), column-major."""
    state = _gemm_state(m, n, k, lda, ldb, ldc, 78, 78, 0)  # 'N', 'N'
    p = state.ctypes.data
    for _ in range(reps):
        _call13(gemm, (p + 36, p + 37, p, p + 4, p + 8, p + 24, a, p + 12, b, p + 16, p + 28, c, p + 20))
    state[0] = 0  # (keeps the buffer alive past the last call: numba frees an array after its last use)


@numba.njit(nogil=True)
def _repeat_packed(pack, compute, reps, m, n, k, a, lda, packed, b, ldb, c, ldc):
    """``sgemm_pack`` of A once, then ``reps`` calls of ``sgemm_compute`` with it (beta = 1)."""
    state = _gemm_state(m, n, k, lda, ldb, ldc, 65, 78, 80)  # 'A' (the packed operand), 'N', 'P' (packed)
    p = state.ctypes.data
    _call9(pack, (p + 36, p + 37, p, p + 4, p + 8, p + 24, a, p + 12, packed))
    for _ in range(reps):
        _call12(compute, (p + 38, p + 37, p, p + 4, p + 8, packed, p + 12, b, p + 16, p + 28, c, p + 20))
    state[0] = 0


@numba.njit(nogil=True)
def _packed_bytes(get_size, m, n, k):
    state = np.zeros(4, np.int32)
    state[0], state[1], state[2] = m, n, k
    chars = np.zeros(4, np.uint8)
    chars[0] = 65
    size = _call4(
        get_size, (chars.ctypes.data, state.ctypes.data, state.ctypes.data + 4, state.ctypes.data + 8)
    )
    state[3] = chars[1]
    return size


def _rate(fn, flops: float, repeats: int = 5) -> float:
    return flops / min_seconds(fn, repeats) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocksizes", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--panels", type=int, nargs="+", default=[64, 256, 1024])
    args = ap.parse_args()
    torch.set_num_threads(1)
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))

    def address(name: str) -> int:
        return int(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0)

    gemm, pack, compute, get_size = (
        address(s) for s in ("sgemm_", "sgemm_pack_", "sgemm_compute_", "sgemm_pack_get_size_")
    )
    x = torch.randn(2048, 2048)
    dense = _rate(lambda: x @ x, 2 * 2048**3, repeats=10)  # (again at the end: the better of the two)
    print(f"torch {torch.__version__}, 1 thread, float32; dense mm 2048^3 at the start: {dense:.0f} GF/s")
    rows = []
    header = (
        f"{'bs':>3} {'panel':>5} | {'gemm GF/s':>9} {'/ dense':>7} | {'packed GF/s':>11} {'/ dense':>7} | "
        "packed bytes"
    )
    ld = 4096
    for bs in args.blocksizes:
        for panel in args.panels:
            dense_rows = torch.randn(bs, ld)  # X's rows of one block column (row-major, ld apart)
            block = torch.randn(bs, bs)
            out = torch.zeros(bs, ld)
            buffer = torch.empty(_packed_bytes(get_size, panel, bs, bs) // 4 + 16)
            flops_per_call = 2.0 * bs * bs * panel
            reps = max(10, int(3e8 / flops_per_call))
            plain = _rate(
                lambda: _repeat_gemm(gemm, reps, panel, bs, bs, dense_rows.data_ptr(), ld,  # noqa: B023
                                     block.data_ptr(), bs, out.data_ptr(), ld),  # noqa: B023
                flops_per_call * reps,
            )  # fmt: skip
            packed = _rate(
                lambda: _repeat_packed(pack, compute, reps, panel, bs, bs, dense_rows.data_ptr(), ld,  # noqa: B023
                                       buffer.data_ptr(), block.data_ptr(), bs, out.data_ptr(), ld),  # noqa: B023
                flops_per_call * reps,
            )  # fmt: skip
            rows.append((bs, panel, plain, packed, buffer.numel() * 4 - 64))
    dense = max(dense, _rate(lambda: x @ x, 2 * 2048**3, repeats=10))
    print(f"dense mm, the better of the start and the end: {dense:.0f} GF/s (the ratios' denominator)")
    print(header)
    print("-" * len(header))
    for bs, panel, plain, packed, nbytes in rows:
        print(
            f"{bs:>3} {panel:>5} | {plain:>9.1f} {plain / dense:>7.2f} | {packed:>11.1f} "
            f"{packed / dense:>7.2f} | {nbytes}"
        )


if __name__ == "__main__":
    main()
