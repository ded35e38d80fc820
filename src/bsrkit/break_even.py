r"""Break-even densities: the block density at or above which a block-sparse linear layer is no faster
than the dense one, per device, dtype and blocksize, kept in the tuning table (:mod:`bsrkit.tuning`).

A layer ``y = x W^T`` with ``W`` ``(M, K)`` stored as blocks of density :math:`d` costs about
:math:`t_s(d) \approx c\,d` against a dense :math:`t_d`, so the layer pays off below
:math:`d^* = t_d / c`. :func:`measure` times both at the densities of a grid, for one token (decode)
and for many (prefill), and takes the lower of the two crossings (linear interpolation between grid
points): a layer swapped below it is faster than dense in both. ``bsrkit tune --break-even`` writes the
result under ``"<device>|break_even|<dtype>|*,*,*|<Ms>x<Ks>"``, with the measured ratios beside it.

:func:`break_even_density` reads, in this order: the user's table, the tables shipped with bsrkit, then
:data:`DEFAULTS` by device type (measured on the machines named there; see ``docs/performance.md``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from bsrkit import tuning
from bsrkit.validation import check_blocksize, is_density

__all__ = ["DEFAULTS", "TABLE_NAME", "break_even_density", "measure", "table_key"]

TABLE_NAME = "break_even"

# By device type and square blocksize, when the tables hold no entry for the device, a little below each
# measured crossing. CPU: float32, 2 threads, `bsrkit tune --break-even --sizes 2048 --blocksizes
# 16,32,64` (AMD EPYC, 2026-12-05, docs/performance.md): crossings 0.451 / 0.658 / 0.843 (the 512-token
# prefill; one token crosses above 0.9). CUDA: H200, bfloat16, n = 8192: bsrkit matched cuBLAS near
# density 0.17 / 0.30 / 0.40 at blocksizes 32 / 64 / 128.
DEFAULTS: dict[str, dict[int, float]] = {
    "cpu": {16: 0.45, 32: 0.6, 64: 0.75},
    "cuda": {32: 0.15, 64: 0.25, 128: 0.35},
}


def _device_name(device: torch.device) -> str:
    return tuning.cpu_device_name() if device.type == "cpu" else tuning.triton_device_name(device)


def table_key(device_name: str, dtype: torch.dtype, blocksize: tuple[int, int]) -> str:
    """The tuning-table key of a break-even entry (any shape: ``*,*,*``)."""
    name = str(dtype).removeprefix("torch.")
    return f"{device_name}|{TABLE_NAME}|{name}|*,*,*|{blocksize[0]}x{blocksize[1]}"


def _default(device_type: str, blocksize: tuple[int, int]) -> float:
    table = DEFAULTS.get(device_type)
    if not table:
        return 0.0
    b = min(blocksize)
    listed = sorted(table)
    if b < listed[0]:
        return table[listed[0]] * b / listed[0]  # (smaller blocks: proportionally less)
    return table[max(s for s in listed if s <= b)]


def break_even_density(
    device: torch.device | str, blocksize: int | tuple[int, int], dtype: torch.dtype = torch.float32
) -> float:
    """The block density at or above which a block-sparse layer is expected to be no faster than dense on
    ``device`` (module docstring): the tuning table's entry for this device, dtype and blocksize; else
    :data:`DEFAULTS`: the entry of the largest listed blocksize <= ``min(blocksize)`` (a smaller one:
    proportionally less than the smallest's); 0.0 for a device type without measurements (every layer
    then stays dense unless forced)."""
    blocksize = check_blocksize("break_even_density", blocksize)  # (an int: square blocks, as sparsify_)
    device = torch.device(device)
    if device.type in ("cpu", "cuda"):
        key = table_key(_device_name(device), dtype, blocksize)
        entry = tuning.load_table().get(key) or tuning.shipped_entries().get(key)
        if entry is not None:
            density = entry.get("density")
            if is_density(density):
                return float(density)
            tuning._warn_once(
                f"break-even:{key}",
                f"bsrkit: ignoring the tuning table's break-even entry {key}: expected a density in "
                f"[0, 1], got {density!r}",
            )
    return _default(device.type, blocksize)


def _seconds(fn: Any, sync: Any, repeats: int) -> float:
    """Median over ``repeats`` rounds of the time per call, each round >= 20 ms of calls (one call of a
    decode-sized layer is tens of microseconds: timed alone, it is mostly timer noise)."""
    fn()
    sync()
    calls, elapsed = 1, 0.0
    while True:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        elapsed = time.perf_counter() - t0
        if elapsed >= 0.02:
            break
        calls *= 2
    rounds = [elapsed / calls]
    for _ in range(repeats - 1):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        rounds.append((time.perf_counter() - t0) / calls)
    return statistics.median(rounds)


def _crossing(densities: list[float], ratios: list[float]) -> float:
    """The density where ``ratios`` (sparse time / dense time, rising with density) reaches 1, by
    linear interpolation; 0.0 when sparse is no faster even at the grid's lowest density, 1.0 when it is
    faster at every one."""
    if ratios[0] >= 1:
        return 0.0
    for i in range(1, len(ratios)):
        if ratios[i] >= 1:
            d0, d1, r0, r1 = densities[i - 1], densities[i], ratios[i - 1], ratios[i]
            return d0 + (d1 - d0) * (1 - r0) / (r1 - r0) if r1 != r0 else d1
    return 1.0


def measure(
    blocksize: tuple[int, int],
    *,
    features: tuple[int, int] = (2048, 2048),
    tokens: tuple[int, ...] = (1, 512),
    densities: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    repeats: int = 5,
) -> dict[str, Any]:
    """Time ``F.linear`` against :class:`bsrkit.nn.BSRLinear` (no grad) on ``features = (out, in)`` for
    each token count and density; return the entry :func:`break_even_density` reads: ``{"density":
    lowest crossing, "ratios": {tokens: [sparse / dense per density]}, "densities": [...]}``."""
    from bsrkit.nn import BSRLinear

    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    out_f, in_f = features
    dense = torch.nn.Linear(in_f, out_f, bias=False).to(device, dtype)
    ratios: dict[str, list[float]] = {}
    crossings = []

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    with torch.no_grad():
        for n in tokens:
            x = torch.randn((n, in_f), generator=g).to(device, dtype)
            t_dense = _seconds(lambda: dense(x), sync, repeats)  # noqa: B023
            row = []
            for d in densities:
                layer = BSRLinear.from_dense(dense, blocksize, d)
                row.append(_seconds(lambda: layer(x), sync, repeats) / t_dense)  # noqa: B023
            ratios[str(n)] = [round(r, 3) for r in row]
            crossings.append(_crossing(list(densities), row))
    return {"density": round(min(crossings), 3), "densities": list(densities), "ratios": ratios}
