"""Block-sparse attention: bsrkit vs compiled FlexAttention vs dense masked SDPA, measured in one run.

Sliding-window attention (query i attends to keys |i - j| <= w, w = density * L / 2) at each L and
window density, with 128-blocks, B=1, H=8, D=64, float32. For each method: median seconds of the forward
and of forward+backward, and the peak memory one forward+backward adds (the process's peak RSS, reset
before each measurement through /proc/self/clear_refs; Linux only, else blank). FlexAttention's compile
time and ``create_block_mask`` time, and bsrkit's mask-building time, are printed separately (paid once
per shape and mask).

    python benchmarks/attention.py                      # the grid of docs/performance.md
    python benchmarks/attention.py --L 4096 --densities 0.25 --repeats 5

The machine may be shared: every figure is a median, and the methods are interleaved call by call, so
that the ratios compare methods under the same load.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import bsrkit
from bsrkit.attention import sliding_window_mask
from bsrkit.benchmarking import peak_rss_mib


def run_point(L: int, density: float, repeats: int, methods: list[str]) -> list[dict[str, object]]:
    H, D, bs = 8, 64, 128
    w = round(density * L / 2)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn((1, H, L, D), generator=g) for _ in range(3))
    grad = torch.randn((1, H, L, D), generator=g)
    rows: list[dict[str, object]] = []
    for method in methods:
        info: dict[str, object] = {}
        if method == "bsrkit":
            t0 = time.perf_counter()
            mask = sliding_window_mask(L, w, bs)
            info["setup_s"] = time.perf_counter() - t0
            info["block_density"] = mask._nnz() / (L // bs) ** 2

            def attn(
                q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor = mask
            ) -> torch.Tensor:
                return bsrkit.scaled_dot_product_attention(q, k, v, mask)

        elif method == "flex":
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            def window(
                b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor, w: int = w
            ) -> torch.Tensor:
                return (i - j).abs() <= w

            # A fresh compile per point: otherwise a later point's new mask_mod (another window) recompiles
            # with dynamic shapes or hits the recompile limit and runs eagerly (seconds, O(L^2) memory).
            torch._dynamo.reset()
            t0 = time.perf_counter()
            block_mask = create_block_mask(window, 1, 1, L, L, device="cpu", BLOCK_SIZE=bs)
            info["setup_s"] = time.perf_counter() - t0
            compiled = torch.compile(flex_attention)

            def attn(
                q: torch.Tensor,
                k: torch.Tensor,
                v: torch.Tensor,
                bm: object = block_mask,
                f: object = compiled,
            ) -> torch.Tensor:
                return f(q, k, v, block_mask=bm)  # type: ignore[operator]

            t0 = time.perf_counter()
            attn(q, k, v)
            info["compile_s"] = time.perf_counter() - t0
        else:  # dense masked SDPA
            i = torch.arange(L)
            dense_mask = (i[:, None] - i[None, :]).abs() <= w

            def attn(
                q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor = dense_mask
            ) -> torch.Tensor:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

        def fwd(attn: Callable[..., torch.Tensor] = attn) -> object:
            with torch.no_grad():
                return attn(q, k, v)

        def fwd_bwd(
            attn: Callable[..., torch.Tensor] = attn, inputs: tuple[torch.Tensor, ...] = (qg, kg, vg)
        ) -> object:
            attn(*inputs).backward(grad)
            for t in inputs:
                t.grad = None
            return None

        info["_fwd"], info["_fwd_bwd"] = fwd, fwd_bwd
        rows.append({"L": L, "density": density, "window": w, "method": method, **info})
    # Interleaved: every repeat times each method once, so that load from other processes falls on all.
    for mode in ("fwd", "fwd_bwd"):
        live = [r for r in rows if f"_{mode}" in r]
        for r in list(live):
            try:
                r[f"_{mode}"]()  # warm-up (compiles, caches)
            except Exception as e:  # FlexAttention has no CPU backward in torch 2.13 (NotImplementedError)
                r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
                live.remove(r)
        times: dict[int, list[float]] = {id(r): [] for r in live}
        for _ in range(repeats):
            for r in live:
                t0 = time.perf_counter()
                r[f"_{mode}"]()
                times[id(r)].append(time.perf_counter() - t0)
        for r in live:
            r[f"{mode}_s"] = statistics.median(times[id(r)])
            r["fwd_peak_mib" if mode == "fwd" else "peak_mib"] = peak_rss_mib(r[f"_{mode}"])
    for r in rows:
        r.pop("_fwd")
        r.pop("_fwd_bwd")
    return rows


def _mib(v: object) -> str:
    return f"{float(v):5.0f}" if v is not None else "    ?"  # type: ignore[arg-type]


def format_table(rows: list[dict[str, object]]) -> str:
    base = {(r["L"], r["density"]): r for r in rows if r["method"] == "bsrkit"}
    header = (
        f"{'L':>5} {'dens':>5} {'blk':>5} {'method':>7} | {'fwd ms':>8} {'x':>5} {'MiB':>5} | "
        f"{'fwd+bwd ms':>10} {'x':>5} {'MiB':>5} | setup"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        b = base.get((r["L"], r["density"]))
        fwd, fb = r.get("fwd_s"), r.get("fwd_bwd_s")
        x_fwd = f"{fwd / b['fwd_s']:5.2f}" if b and fwd and "fwd_s" in b else "     "  # type: ignore[operator]
        x_fb = f"{fb / b['fwd_bwd_s']:5.2f}" if b and fb and "fwd_bwd_s" in b else "     "  # type: ignore[operator]
        setup = f"{float(r.get('setup_s', 0.0)):.2f} s"  # type: ignore[arg-type]
        if "compile_s" in r:
            setup += f" + compile {float(r['compile_s']):.1f} s"  # type: ignore[arg-type]
        blk = f"{float(b['block_density']):.3f}" if b else "     "  # type: ignore[arg-type]
        # (a method whose forward failed has no time: its error stands in the table)
        fwd_part = (
            f"{float(fwd) * 1e3:8.1f} {x_fwd} {_mib(r.get('fwd_peak_mib'))}"  # type: ignore[arg-type]
            if fwd is not None
            else f"{'-':>8} {'':5} {'':>6}"
        )
        if "error" in r:
            fb_part = f"{r['error']}"
        else:
            fb_part = f"{float(fb) * 1e3:10.1f} {x_fb} {_mib(r.get('peak_mib'))}"  # type: ignore[arg-type]
        lines.append(
            f"{r['L']:>5} {r['density']:>5} {blk:>5} {r['method']:>7} | {fwd_part} | {fb_part} | {setup}"
        )
    lines.append("x: the method's time / bsrkit's (above 1: bsrkit is faster); MiB: peak RSS the call adds")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--L", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--densities", type=float, nargs="+", default=[0.05, 0.1, 0.25])
    p.add_argument(
        "--methods", nargs="+", default=["bsrkit", "flex", "dense"], choices=["bsrkit", "flex", "dense"]
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for L in args.L:
        for density in args.densities:
            rows += run_point(L, density, args.repeats, args.methods)
            print(format_table(rows), flush=True)
            print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                rows, f, indent=1, default=lambda o: None if isinstance(o, float) and math.isnan(o) else o
            )


if __name__ == "__main__":
    main()
