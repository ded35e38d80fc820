"""The one prepared GPU run (issue 28): correctness of every Triton kernel, a quick tuning pass, and timings
against torch's own Triton kernels, cuBLAS and compiled FlexAttention, all in one process, within a time
budget. Everything it prints also goes to ``<out>/gpu_check.log``; the measurements to
``<out>/gpu_check.json`` (rewritten after every section, so a run cut short keeps what finished); the tuned
table to ``<out>/tuned.json`` (the format of ``bsrkit/tuned/*.json``).

    python benchmarks/gpu_check.py --out "$OUT"                 # on a CUDA machine (about 7 minutes)
    python benchmarks/gpu_check.py --dry-run --out /tmp/gc       # on CPU, Triton's interpreter, tiny grid

Sections, in order (each skipped once the budget is spent):

1. ``correctness``: every op on the Triton backend against the float64 reference (``bsrkit.reference``,
   per-dtype tolerances from :func:`bsrkit.reference.tolerances`): float32, float16, bfloat16, float64 and
   int8; square blocks 16-128 and odd ones; batched, non-contiguous, empty block rows; both inner loops of
   ``bsr_dense_mm`` (``FLAT_LOOP`` 0 and 1); gradients of products and attention; offsets past 2**31.
2. ``tune``: ``bsr_dense_mm`` tile candidates per dtype and blocksize, wide (N = n) and decode (N = 16);
   a candidate counts only if its result matches cuBLAS's.
3. ``speed``: bsrkit (tuned) vs ``torch.sparse._triton_ops.bsr_dense_mm`` vs dense cuBLAS, n in {4096,
   8192}, blocksizes 32/64/128, densities 0.05-0.5, bf16/fp16/fp32; decode N = 16; ``sampled_addmm`` vs
   torch's. float32 runs with TF32 allowed (bsrkit and cuBLAS) and without; torch's kernel never uses
   TF32 for float32 (IEEE dots, float64 accumulation, whatever ``allow_tf32`` says), so it is timed on the
   IEEE row only.
4. ``attention``: bsrkit's block-sparse SDPA vs compiled FlexAttention vs dense SDPA, sliding window and
   causal.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:  # before triton is imported anywhere
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["BSRKIT_BACKEND"] = "triton"

import argparse
import functools
import json
import math
import platform
import statistics
import subprocess
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import bsrkit
from bsrkit import reference, tuning
from bsrkit.backends import BACKENDS
from bsrkit.backends.triton.tiles import clamped_tiles
from bsrkit.benchmarking import random_bsr_weight

warnings.filterwarnings("ignore", message="Sparse (BSR|CSR) tensor support is in beta state")
warnings.filterwarnings("ignore", category=tuning.TuningWarning)
warnings.filterwarnings("ignore", message=".*non-optimal triton kernel parameters.*")


class Run:
    """The output folder, the time budget, the log and the results of one run."""

    def __init__(self, out: Path, budget_s: float, device: torch.device, dry: bool) -> None:
        self.out, self.device, self.dry = out, device, dry
        out.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + budget_s
        self.log_file = open(out / "gpu_check.log", "w")  # noqa: SIM115 (closed at exit)
        self.results: dict[str, Any] = {"failures": []}

    def log(self, line: str) -> None:
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=1, default=str))

    def fail(self, what: str) -> None:
        self.results["failures"].append(what)
        self.log(f"FAIL {what}")


def timed(fn: Callable[[], object], device: torch.device, reps: int = 20) -> float:
    """Median seconds of ``fn`` (CUDA events around each call, after two warm-up calls)."""
    fn()
    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------- checks


def close(run: Run, label: str, got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, k: int) -> bool:
    """``got`` (any dtype) against the float64 ``ref`` with ``dtype``'s tolerances for k-term sums; NaN
    must sit where ``ref`` has NaN."""
    reason = reference.mismatch(got, ref, dtype, k)
    if reason is not None:
        run.fail(f"{label}: {reason}")
    return reason is None


def random_bsr(
    shape: tuple[int, ...], bs: tuple[int, int], density: float, dtype: torch.dtype, seed: int
) -> torch.Tensor:
    """A BSR on CPU, block row 1 empty, values ~ N(0, 1) (small ints for int8)."""
    g = torch.Generator().manual_seed(seed)
    M, K = shape[-2:]
    mask = torch.rand((M // bs[0], K // bs[1]), generator=g) < density  # one pattern for every batch
    mask[1, :] = False
    mask[0, 0] = True
    full = mask.repeat_interleave(bs[0], -2).repeat_interleave(bs[1], -1)
    if dtype == torch.int8:
        dense = torch.randint(-4, 5, shape, generator=g).to(torch.int8) * full
    else:
        dense = (torch.randn(shape, generator=g) * full).to(dtype)
    return dense.to_sparse_bsr(bs, dense_dim=0)


def check_products(
    run: Run, dtypes: list[torch.dtype], every_op: list[torch.dtype], blocks: list[tuple[int, int]]
) -> None:
    """``bsr_dense_mm`` (both loops) in every dtype of ``dtypes``; the other ops in those of ``every_op``."""
    dev = run.device
    for dtype in dtypes:
        for bs in blocks:
            if run.left() < 0:
                return
            M, K, N = bs[0] * 6, bs[1] * 5, 70
            tag = f"{str(dtype)[6:]} {bs[0]}x{bs[1]}"
            bsr = random_bsr((2, M, K), bs, 0.5, dtype, seed=bs[0] * 131 + bs[1])
            bsr_d = bsr.to(dev)
            if dtype == torch.int8:
                dense = torch.randint(-4, 5, (2, N, K), dtype=torch.int8)
            else:
                dense = torch.randn(2, N, K).to(dtype)
            dense_d = dense.to(dev).mT  # non-contiguous (2, K, N)
            ref = reference.bsr_dense_mm(bsr.double(), dense.mT.double())
            for flat in (0, 1):
                got = bsrkit.bsr_dense_mm(bsr_d, dense_d, meta={"FLAT_LOOP": flat})
                if dtype == torch.int8:
                    if got.dtype != torch.int32 or not torch.equal(got.cpu().double(), ref):
                        run.fail(f"bsr_dense_mm {tag} int8 flat={flat}: not exact")
                else:
                    close(run, f"bsr_dense_mm {tag} flat={flat}", got, ref, dtype, K)
            if dtype not in every_op:
                continue
            inp = torch.randn(N).to(dtype)
            got = bsrkit.bsr_dense_addmm(inp.to(dev), bsr_d, dense_d, beta=0.5, alpha=-2.0)
            close(run, f"bsr_dense_addmm {tag}", got, 0.5 * inp.double() - 2.0 * ref, dtype, K)
            x = torch.randn(2, M, N).to(dtype)
            got = bsrkit.bsr_transposed_dense_mm(bsr_d, x.to(dev))
            close(
                run,
                f"bsr_transposed_dense_mm {tag}",
                got,
                reference.bsr_transposed_dense_mm(bsr.double(), x.double()),
                dtype,
                M,
            )
            m1, m2 = torch.randn(2, M, 40).to(dtype), torch.randn(2, 40, K).to(dtype)
            got = bsrkit.sampled_addmm(bsr_d, m1.to(dev), m2.to(dev).mT.contiguous().mT, beta=0.0)
            close(
                run,
                f"sampled_addmm {tag}",
                reference.bsr_to_dense(got.cpu()),
                reference.sampled_addmm(bsr.double(), m1.double(), m2.double(), beta=0.0),
                dtype,
                40,
            )
            got = bsrkit.bsr_softmax(bsr_d)
            close(
                run,
                f"bsr_softmax {tag}",
                reference.bsr_to_dense(got.cpu()),
                reference.bsr_softmax(bsr.double()),
                dtype,
                K,
            )
            # gradients of bsr_dense_mm: values (an SDDMM) and dense (the transposed product)
            if dtype in (torch.float32, torch.float64):
                values = bsr_d.values().detach().clone().requires_grad_()
                b = torch.sparse_bsr_tensor(bsr_d.crow_indices(), bsr_d.col_indices(), values, bsr_d.shape)
                xd = dense_d.detach().clone().requires_grad_()
                w = torch.randn(2, M, N, dtype=dtype)
                (bsrkit.bsr_dense_mm(b, xd) * w.to(dev)).sum().backward()
                full = reference.bsr_to_dense(bsr).double().requires_grad_()
                xr = dense.mT.double().requires_grad_()
                ((full @ xr) * w.double()).sum().backward()
                mask = reference.block_mask(bsr)
                assert full.grad is not None
                close(run, f"grad dense {tag}", xd.grad, xr.grad, dtype, M)  # type: ignore[arg-type]
                grad_v = reference.bsr_to_dense(
                    torch.sparse_bsr_tensor(
                        bsr.crow_indices(), bsr.col_indices(), values.grad.cpu(), bsr.shape
                    )  # type: ignore[union-attr]
                )
                close(run, f"grad values {tag}", grad_v, full.grad * mask, dtype, N)
    # scatter_mm, three formats (2-D BSR, batched other)
    for dtype in every_op:
        if run.left() < 0:
            continue
        bsr = random_bsr((96, 64), (32, 16), 0.5, dtype, seed=7)
        other = torch.randn(2, 64, 64).to(dtype)
        for fmt in ("bsr_strided_mm_compressed", "bsr_strided_mm", "scatter_mm"):
            data = bsrkit.bsr_scatter_mm_indices_data(
                bsr.to(run.device), other.to(run.device), indices_format=fmt, SPLIT_N=2
            )
            got = bsrkit.bsr_scatter_mm(bsr.to(run.device), other.to(run.device), data)
            close(
                run,
                f"bsr_scatter_mm {fmt} {str(dtype)[6:]}",
                got,
                reference.bsr_scatter_mm(bsr.double(), other.double()),
                dtype,
                64,
            )


def check_attention(run: Run, dtypes: list[torch.dtype], L: int, bs: int) -> None:
    from bsrkit.attention import causal_mask, sliding_window_mask

    for dtype in dtypes:
        if dtype == torch.int8 or run.left() < 0:
            continue
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(2, 3, L, 64, generator=g).to(dtype) for _ in range(3))
        grad = torch.randn(2, 3, L, 64, generator=g).to(dtype)
        for name, mask, causal in (
            ("sliding", sliding_window_mask(L, L // 5, bs), False),
            ("causal", causal_mask(L, bs), False),
            ("sliding+is_causal", sliding_window_mask(L, L // 5, bs), True),
        ):
            qd, kd, vd = (t.detach().clone().to(run.device).requires_grad_() for t in (q, k, v))
            out = bsrkit.scaled_dot_product_attention(qd, kd, vd, mask.to(run.device), is_causal=causal)
            out.backward(grad.to(run.device))
            q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
            ref = reference.scaled_dot_product_attention(q64, k64, v64, mask, is_causal=causal)
            ref.backward(grad.double())
            close(run, f"attention {name} {str(dtype)[6:]} out", out, ref, dtype, L)
            for t, r, nm in ((qd, q64, "dq"), (kd, k64, "dk"), (vd, v64, "dv")):
                close(run, f"attention {name} {str(dtype)[6:]} {nm}", t.grad, r.grad, dtype, 4 * L)  # type: ignore[arg-type]


def check_large_offsets(run: Run) -> None:
    """Element offsets past 2**31 in a transposed, sliced dense and a column-major out."""
    n = 128 if run.dry else 47104  # 47104**2 > 2**31
    nb = n // 64
    col = (torch.arange(nb) * 7) % nb
    vals = torch.randn(nb, 64, 64)
    bsr = torch.sparse_bsr_tensor(torch.arange(nb + 1), col, vals, size=(n, n), check_invariants=False)
    bsr = bsr.to(run.device)
    dense = torch.randn(n + 8, n, device=run.device).mT[:, 8:]
    out = torch.empty(n, n, device=run.device).mT
    bsrkit.bsr_dense_mm(bsr, dense, out=out)
    for i in sorted({0, nb // 2, nb - 1}):
        c = int(col[i])
        ref = vals[i].double() @ dense[c * 64 : (c + 1) * 64].double().cpu()
        close(run, f"large offsets n={n} block row {i}", out[i * 64 : (i + 1) * 64], ref, torch.float32, 64)


# ---------------------------------------------------------------------------------------------- tuning

# (BLOCK_M, BLOCK_K, BLOCK_N, num_warps, num_stages, FLAT_LOOP); clamped to the block, then deduplicated.
WIDE = [
    (128, 32, 64, 8, 2, 0),
    (128, 64, 64, 4, 3, 1),
    (128, 64, 128, 8, 3, 1),
    (128, 32, 128, 4, 4, 1),
    (64, 64, 128, 4, 3, 1),
    (128, 64, 256, 8, 3, 1),
    (128, 128, 128, 8, 3, 1),
    (128, 64, 128, 4, 4, 1),
]
DECODE = [(128, 32, 16, 4, 2, 0), (64, 64, 16, 4, 3, 1), (16, 128, 16, 4, 3, 1)]
# Seconds of the budget kept for the sections after tuning, and after the product timings.
RESERVE_AFTER_TUNE, RESERVE_AFTER_SPEED = 235.0, 95.0
_KEYS = ("BLOCK_M", "BLOCK_K", "BLOCK_N", "num_warps", "num_stages", "FLAT_LOOP")


def candidates(cands: list[tuple[int, ...]], bs: int, N: int) -> list[dict[str, int]]:
    seen, out = set(), []
    for c in cands:
        meta = dict(zip(_KEYS, c, strict=True))
        tiles = clamped_tiles(meta, bs, bs, N)
        key = (*tiles.values(), *c[3:])
        if key not in seen:
            seen.add(key)
            out.append({**meta, **tiles})
    return out


def tune(
    run: Run, n: int, dtypes: list[torch.dtype], blocksizes: list[int], densities: list[float], decode: bool
) -> None:
    """The fastest correct candidate per (dtype, blocksize, N class), as class entries of a table: wide
    products (N = n) scored by the geometric mean of their times at ``densities``, and (``decode``)
    N = 16 at the first density."""
    device_name = BACKENDS["triton"].tuning_device(run.device)
    entries: dict[str, dict[str, int]] = run.results.setdefault("tuned", {})
    rows = run.results.setdefault("tune", [])
    classes = [(n, WIDE, densities)] + ([(16, DECODE, densities[:1])] if decode else [])
    for N, cands, dens in classes:
        for dtype in dtypes:
            for bs in blocksizes:
                if run.left() < (0 if run.dry else RESERVE_AFTER_TUNE):
                    return
                problems = []
                for d in dens:
                    bsr_cpu, w_cpu = random_bsr_weight(n, bs, d, seed=bs)
                    bsr, w = bsr_cpu.to(dtype).to(run.device), w_cpu.to(dtype).to(run.device)
                    x = torch.randn(n, N, device=run.device, dtype=dtype)
                    problems.append((bsr, x, w.float() @ x.float()))
                best: tuple[float, dict[str, int]] | None = None
                for meta in candidates(cands, bs, N):
                    times = []
                    try:
                        for bsr, x, ref in problems:
                            got = bsrkit.bsr_dense_mm(bsr, x, meta=meta)
                            scale = ref.abs().max().clamp_min(1e-6)
                            err = ((got.float() - ref).abs().max() / scale).item()
                            if not err < {torch.float32: 1e-2}.get(dtype, 3e-2):  # TF32 or half inputs
                                raise RuntimeError(f"relative error {err:.1e}")
                            call = functools.partial(bsrkit.bsr_dense_mm, bsr, x, meta=meta)
                            times.append(timed(call, run.device))
                    except Exception as exc:  # a candidate that fails to compile or launch is skipped
                        why = str(exc).splitlines()[0][:99]
                        run.log(f"  tune skip {str(dtype)[6:]} bs{bs} N={N} {meta}: {why}")
                        continue
                    score = math.exp(sum(math.log(t) for t in times) / len(times))
                    rows.append({"dtype": str(dtype)[6:], "bs": bs, "n": n, "N": N, "densities": dens,
                                 "meta": meta, "ms": [t * 1e3 for t in times]})  # fmt: skip
                    if best is None or score < best[0]:
                        best = (score, meta)
                if best is not None:
                    key = tuning.class_key(device_name, "bsr_dense_mm", dtype, N, (bs, bs))
                    entries[key] = best[1]
                    run.log(f"tune {str(dtype)[6:]:>8} bs{bs:<4} n={n} N={N:<5} d={dens} geomean "
                            f"{best[0] * 1e3:8.3f} ms {best[1]}")  # fmt: skip
                payload = {"format": "bsrkit-tuning", "version": 1, "entries": entries}
                (run.out / "tuned.json").write_text(json.dumps(payload, indent=1, sort_keys=True))
                run.save()


def tuned_meta(run: Run, dtype: torch.dtype, bs: int, N: int) -> dict[str, int] | None:
    """This run's tuned entry, else the shipped table's (bsrkit/tuned/), else None (the defaults)."""
    device_name = BACKENDS["triton"].tuning_device(run.device)
    key = tuning.class_key(device_name, "bsr_dense_mm", dtype, N, (bs, bs))
    return run.results.get("tuned", {}).get(key) or tuning.shipped_entries().get(key)


# ---------------------------------------------------------------------------------------------- speed


def torch_triton_ops() -> Any:
    try:
        from torch.sparse import _triton_ops

        return _triton_ops
    except Exception:
        return None


def speed(
    run: Run,
    ns: list[int],
    dtypes: list[tuple[torch.dtype, bool]],
    blocksizes: list[int],
    densities: list[float],
    decode_n: int,
) -> None:
    ops = torch_triton_ops()
    rows = run.results.setdefault("speed", [])
    run.log(
        f"{'dtype':>10} {'n':>5} {'N':>5} {'bs':>4} {'dens':>5} | {'bsrkit ms':>9} {'torch ms':>9} "
        f"{'cuBLAS ms':>9} | {'x torch':>7} {'x dense':>7} {'TF/s':>6} {'dense TF/s':>10}"
    )
    points = [(n, n, bs, d) for n in ns for bs in blocksizes for d in densities]
    points += [(decode_n, 16, bs, d) for bs in blocksizes for d in (0.1, 0.5)]
    for dtype, tf32 in dtypes:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        label = str(dtype)[6:] + ("/tf32" if tf32 else "")
        for n, N, bs, d in points:
            if run.left() < (0 if run.dry else RESERVE_AFTER_SPEED):
                torch.backends.cuda.matmul.allow_tf32 = False
                return
            bsr_cpu, w_cpu = random_bsr_weight(n, bs, d, seed=bs)
            bsr, w = bsr_cpu.to(dtype).to(run.device), w_cpu.to(dtype).to(run.device)
            x = torch.randn(n, N, device=run.device, dtype=dtype)
            out = torch.empty(n, N, device=run.device, dtype=dtype)
            meta = tuned_meta(run, dtype, bs, N)
            t_ours = timed(lambda: bsrkit.bsr_dense_mm(bsr, x, out=out, meta=meta), run.device)  # noqa: B023
            t_torch = math.nan
            if ops is not None and (dtype != torch.float32 or not tf32):  # (torch's float32: IEEE only)
                try:
                    t_torch = timed(lambda: ops.bsr_dense_mm(bsr, x, out=out), run.device)  # noqa: B023
                except Exception as exc:
                    run.log(f"    torch's bsr_dense_mm failed: {str(exc).splitlines()[0][:100]}")
            t_dense = timed(lambda: torch.mm(w, x, out=out), run.device)  # noqa: B023
            flops = 2 * bsr._nnz() * bs * bs * N
            rate, dense_rate = flops / t_ours / 1e12, 2 * n * n * N / t_dense / 1e12
            row = {
                "dtype": label,
                "n": n,
                "N": N,
                "bs": bs,
                "density": d,
                "bsrkit_ms": t_ours * 1e3,
                "torch_ms": t_torch * 1e3,
                "dense_ms": t_dense * 1e3,
                "bsrkit_tflops": rate,
                "dense_tflops": dense_rate,
                "meta": meta,
            }
            rows.append(row)
            run.log(
                f"{label:>10} {n:>5} {N:>5} {bs:>4} {d:>5} | {t_ours * 1e3:>9.4f} {t_torch * 1e3:>9.4f} "
                f"{t_dense * 1e3:>9.4f} | {t_torch / t_ours:>7.2f} {t_dense / t_ours:>7.2f} {rate:>6.1f} "
                f"{dense_rate:>10.1f}"
            )
        run.save()
    torch.backends.cuda.matmul.allow_tf32 = False


def speed_sampled(
    run: Run, n: int, K: int, blocksizes: list[int], dtype: torch.dtype, density: float
) -> None:
    ops = torch_triton_ops()
    rows = run.results.setdefault("sampled", [])
    for bs in blocksizes:
        if run.left() < 0:
            return
        bsr = random_bsr_weight(n, bs, density, seed=bs)[0].to(dtype).to(run.device)
        m1 = torch.randn(n, K, device=run.device, dtype=dtype)
        m2 = torch.randn(K, n, device=run.device, dtype=dtype)
        t_ours = timed(lambda: bsrkit.sampled_addmm(bsr, m1, m2, beta=0.0), run.device)  # noqa: B023
        t_torch = math.nan
        if ops is not None:
            try:
                t_torch = timed(lambda: ops.sampled_addmm(bsr, m1, m2, beta=0.0), run.device)  # noqa: B023
            except Exception as exc:
                run.log(f"    torch's sampled_addmm failed: {str(exc).splitlines()[0][:100]}")
        t_dense = timed(lambda: m1 @ m2, run.device)  # noqa: B023
        rows.append(
            {
                "n": n,
                "K": K,
                "bs": bs,
                "density": density,
                "bsrkit_ms": t_ours * 1e3,
                "torch_ms": t_torch * 1e3,
                "dense_ms": t_dense * 1e3,
            }
        )
        run.log(
            f"sampled_addmm {str(dtype)[6:]} n={n} K={K} bs{bs} d={density}: bsrkit {t_ours * 1e3:.4f} ms, "
            f"torch {t_torch * 1e3:.4f} ms ({t_torch / t_ours:.2f}x), dense mm {t_dense * 1e3:.4f} ms"
        )
    run.save()


_sdpa = F.scaled_dot_product_attention

# Launch parameters of the fused attention forward to compare (row tile, warps, stages).
ATTENTION_CONFIGS = [
    {"BLOCK_M": 64, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 128, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "num_warps": 4, "num_stages": 3},
]


def attention(run: Run, L: int, H: int, D: int, dtype: torch.dtype, window: int) -> None:
    """Forward times of the fused kernel (each of ATTENTION_CONFIGS), the composed path, compiled
    FlexAttention and dense SDPA (with the dense bool mask; for causal also ``is_causal=True``)."""
    from bsrkit.attention import causal_mask, sliding_window_mask
    from bsrkit.backends.triton import attention_kernels

    rows = run.results.setdefault("attention", [])
    dev = run.device
    q, k, v = (torch.randn(1, H, L, D, device=dev, dtype=dtype) for _ in range(3))
    flex: Any = None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as exc:
        run.log(f"    FlexAttention unavailable: {exc}")
    defaults = dict(attention_kernels.DEFAULT_PARAMS)
    for name, mask, allowed in (
        ("sliding", sliding_window_mask(L, window, 128, device=dev), lambda i, j: (i - j).abs() <= window),
        ("causal", causal_mask(L, 128, device=dev), lambda i, j: j <= i),
    ):
        if run.left() < 0:
            return
        row: dict[str, Any] = {"mask": name, "L": L, "H": H, "D": D, "dtype": str(dtype)[6:]}
        row["block_density"] = mask._nnz() / (L // 128) ** 2

        def ours(mask: torch.Tensor = mask) -> torch.Tensor:
            return bsrkit.scaled_dot_product_attention(q, k, v, mask)

        fused = {}
        for cfg in ATTENTION_CONFIGS:
            attention_kernels.DEFAULT_PARAMS.update(cfg)
            try:
                fused[json.dumps(cfg)] = timed(ours, dev, reps=10) * 1e3
            except Exception as exc:
                run.log(f"    fused attention {cfg} failed: {str(exc).splitlines()[0][:100]}")
        attention_kernels.DEFAULT_PARAMS.clear()
        attention_kernels.DEFAULT_PARAMS.update(defaults)
        row["fused_ms"] = fused
        row["bsrkit_ms"] = min(fused.values(), default=math.nan)
        out_fused = ours()
        os.environ["BSRKIT_FUSED_ATTENTION"] = "0"
        try:
            row["composed_ms"] = timed(ours, dev, reps=10) * 1e3
            err = (ours().float() - out_fused.float()).abs().max().item()
            if not err < 5e-2:
                run.fail(f"attention {name}: fused vs composed max abs err {err:.2e}")
        finally:
            del os.environ["BSRKIT_FUSED_ATTENTION"]
        idx = torch.arange(L, device=dev)
        dense_mask = allowed(idx[:, None], idx[None, :])
        row["sdpa_masked_ms"] = timed(lambda m=dense_mask: _sdpa(q, k, v, attn_mask=m), dev, reps=10) * 1e3
        if name == "causal":
            row["sdpa_causal_ms"] = timed(lambda: _sdpa(q, k, v, is_causal=True), dev, reps=10) * 1e3
        row["flex_ms"] = math.nan
        if flex is not None:
            try:
                t0 = time.perf_counter()
                block_mask = create_block_mask(
                    lambda b, h, i, j, allowed=allowed: allowed(i, j), None, None, L, L, device=str(dev)
                )
                ref = flex(q, k, v, block_mask=block_mask)
                row["flex_compile_s"] = time.perf_counter() - t0
                err = (out_fused.float() - ref.float()).abs().max().item()
                row["max_abs_err_vs_flex"] = err
                if not err < 5e-2:
                    run.fail(f"attention {name}: fused vs FlexAttention max abs err {err:.2e}")
                row["flex_ms"] = timed(lambda: flex(q, k, v, block_mask=block_mask), dev, reps=10) * 1e3  # noqa: B023
            except Exception as exc:
                run.log(f"    FlexAttention failed: {str(exc).splitlines()[0][:120]}")
        rows.append(row)
        run.log(f"attention {json.dumps(row)}")
        run.log(
            f"attention {name} L={L} H={H} D={D} {row['dtype']} density {row['block_density']:.3f}: "
            f"bsrkit fused {row['bsrkit_ms']:.3f} ms, composed {row['composed_ms']:.3f} ms, "
            f"FlexAttention {row['flex_ms']:.3f} ms (x{row['flex_ms'] / row['bsrkit_ms']:.2f}), "
            f"masked SDPA {row['sdpa_masked_ms']:.3f} ms"
        )
        run.save()


# ---------------------------------------------------------------------------------------------- main


def environment(run: Run) -> None:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "bsrkit": bsrkit.__version__,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if run.device.type == "cuda":
        info["device"] = torch.cuda.get_device_name()
        info["capability"] = torch.cuda.get_device_capability()
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    run.results["environment"] = info
    run.log("environment: " + json.dumps(info, default=str))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny grid on CPU, in Triton's interpreter")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-check-out"), help="output folder")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; later sections are skipped after")
    ap.add_argument("--sections", default="correctness,tune,speed,attention")
    ap.add_argument("--tune-n", type=int, default=8192, help="n of the tuning problems (wide: N = n)")
    ap.add_argument("--tune-densities", type=float, nargs="+", default=[0.1, 0.5])
    ap.add_argument("--no-decode-tune", action="store_true", help="keep the shipped N <= 64 entries")
    ap.add_argument("--no-ieee", action="store_true", help="skip the float32 timings without TF32")
    args = ap.parse_args()
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: nothing to do (use --dry-run to check the script on CPU)")
        return 2
    run = Run(Path(args.out), args.budget, torch.device("cpu" if dry else "cuda"), dry)
    if not dry:
        os.environ["BSRKIT_BACKEND"] = "triton"
    sections = args.sections.split(",")
    environment(run)
    floats = (
        [torch.float32, torch.float64, torch.float16]
        if dry
        else [torch.float32, torch.float16, torch.bfloat16, torch.float64]
    )
    steps: list[tuple[str, Callable[[], None]]] = [
        (
            "correctness",
            lambda: check_products(
                run,
                [*floats, torch.int8],
                floats[:3],
                [(16, 16), (3, 5), (24, 8)]
                if dry
                else [(16, 16), (32, 32), (64, 64), (128, 128), (3, 5), (24, 8)],
            ),
        ),
        (
            "correctness",
            lambda: check_attention(
                run, floats[:1] if dry else floats[:3], 128 if dry else 1024, 32 if dry else 64
            ),
        ),
        ("correctness", lambda: check_large_offsets(run)),
        (
            "tune",
            lambda: tune(
                run,
                128 if dry else args.tune_n,
                floats[:1] if dry else [torch.bfloat16, torch.float16, torch.float32],
                [32] if dry else [32, 64, 128],
                [0.25] if dry else args.tune_densities,
                not args.no_decode_tune,
            ),
        ),
        (
            "speed",
            lambda: speed(
                run,
                [128] if dry else [4096, 8192],
                [(torch.float32, False)]
                if dry
                else [
                    (torch.bfloat16, False),
                    (torch.float16, False),
                    (torch.float32, True),
                    *([] if args.no_ieee else [(torch.float32, False)]),
                ],
                [32] if dry else [32, 64, 128],
                [0.25] if dry else [0.05, 0.1, 0.25, 0.5],
                128 if dry else 4096,
            ),
        ),
        (
            "speed",
            lambda: speed_sampled(
                run,
                128 if dry else 4096,
                64,
                [32] if dry else [32, 64, 128],
                torch.float32 if dry else torch.bfloat16,
                0.1,
            ),
        ),
        (
            "attention",
            lambda: attention(
                run,
                256 if dry else 8192,
                2 if dry else 16,
                64,
                torch.float32 if dry else torch.bfloat16,
                64 if dry else 512,
            ),
        ),
    ]
    for name, step in steps:
        if name not in sections:
            continue
        if run.left() < 0:
            run.log(f"budget spent: skipping a {name} step")
            continue
        t0 = time.perf_counter()
        try:
            step()
        except Exception:
            run.fail(f"{name} raised:\n{traceback.format_exc()}")
        run.log(f"[{name} step: {time.perf_counter() - t0:.1f} s, {run.left():.0f} s of budget left]")
        run.save()
    run.log(f"correctness failures: {len(run.results['failures'])}")
    run.save()
    return 1 if run.results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
