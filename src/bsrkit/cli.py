"""The ``bsrkit`` command.

* ``bsrkit demo``: the README's main job, on built-in random data;
* ``bsrkit bench``: bsrkit vs torch native BSR vs dense over a grid (table, JSON, PNG plot);
* ``bsrkit tune``: search the CPU kernel's parameters and store the best in the tuning table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch

from bsrkit.benchmarking import median_seconds, random_bsr_weight
from bsrkit.environment import flag
from bsrkit.tune_command import tune

__all__ = ["main"]


def _time_products(bsr: torch.Tensor, dense: torch.Tensor, repeats: int) -> tuple[float, float, float]:
    """Median seconds of bsrkit, torch native BSR and dense torch.mm, measured in one run, each allocating
    its result (as the peers must)."""
    import bsrkit

    dense_w = bsr.to_dense()
    return (
        median_seconds(lambda: bsrkit.bsr_dense_mm(bsr, dense), repeats),
        median_seconds(lambda: bsr @ dense, repeats),
        median_seconds(lambda: dense_w @ dense, repeats),
    )


def _seconds_since_process_start() -> float | None:
    """Wall time since this process started (Linux ``/proc``; None elsewhere): imports included."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # (the command name may hold spaces)
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in ticks
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def demo(args: argparse.Namespace) -> int:
    """The main job: one product checked against the reference, timed against torch native BSR and dense
    torch.mm, with the cold start and the plan cache's life. Its own shape is known: it says where the
    kernel parameters come from instead of warning about them."""
    from bsrkit import tuning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tuning.TuningWarning)
        return _demo(args)


def _model_demo(args: argparse.Namespace) -> int:
    """``bsrkit demo --model``: a small LLaMA-style model, dense against sparsify_ + bsrkit attention."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bsrkit demo --model: needs transformers (pip install 'bsrkit[hf]')", file=sys.stderr)
        return 2
    import bsrkit
    from bsrkit import model_demo

    config = model_demo.ModelConfig(
        hidden=args.hidden, intermediate=args.hidden * 11 // 4 // 32 * 32, layers=args.layers,
        heads=max(1, args.hidden // 64), kv_heads=max(1, args.hidden // 64), vocab=4000,
    )  # fmt: skip
    dense = model_demo.build(config)
    params = sum(p.numel() for p in dense.parameters())
    print(f"bsrkit {bsrkit.__version__} demo --model: LLaMA-style model, {params / 1e6:.0f} M parameters "
          f"({args.layers} layers, hidden {args.hidden}, random weights), {torch.get_num_threads()} threads, "
          f"float32; decoder linear layers block-sparse at blocksize {args.blocksize} (sparsify_), "
          f"attention on bsrkit; dense model on SDPA")  # fmt: skip
    rows, models = model_demo.compare(
        dense, args.density, blocksize=args.blocksize, prefill=256, prompt=32, decode=16,
        repeats=args.repeats,
    )  # fmt: skip
    print(model_demo.format_rows(rows))
    # (32 tokens: a length the attention's blocksizes divide, so the check runs bsrkit's attention too)
    tokens = torch.randint(0, config.vocab, (1, 32), generator=torch.Generator().manual_seed(2))
    worst = max(model_demo.check_logits(dense, m, tokens) for m in models.values() if m is not dense)
    ok = worst < 1e-10
    print(f"logits vs the dense model holding the same pruned weights (float64): max relative difference "
          f"{worst:.1e} {'OK' if ok else 'FAIL'}")  # fmt: skip
    return 0 if ok else 1


def _demo(args: argparse.Namespace) -> int:
    if args.model:
        return _model_demo(args)
    import bsrkit
    from bsrkit import reference, tuning

    n, bs, density = args.size, args.blocksize, args.density
    print(f"bsrkit {bsrkit.__version__} demo: {n}x{n} BSR weight (blocksize {bs}, block density "
          f"{density}) @ {n}x{n} dense, float32, {torch.get_num_threads()} threads")  # fmt: skip
    bsr, _ = random_bsr_weight(n, bs, density)
    dense = torch.randn(n, n, generator=torch.Generator().manual_seed(1))
    tuned = tuning.lookup("bsr_dense_mm", torch.float32, (n, n, n), (bs, bs))
    how_to = f" (`bsrkit tune --shapes {n}x{n}x{n} --blocksizes {bs}` tunes them)"
    print(f"  kernel parameters: {'the tuning table' if tuned else 'defaults' + how_to}")
    t0 = time.perf_counter()
    out = bsrkit.bsr_dense_mm(bsr, dense)
    first = time.perf_counter() - t0
    from bsrkit.backends.cpu import kernels

    loops = kernels.compile_cache_info()
    # (the loop that ran: the parallel one, or its serial twin on one thread)
    ran = [v for k, v in loops.items() if k.startswith("bsr_mm") and (v["hits"] or v["misses"])]
    compiled = ran[0] if ran else loops.get("bsr_mm", {})
    how = (
        "loaded from the on-disk kernel cache"
        if ran and not any(v["misses"] for v in ran)
        else "compiled (later processes load it from the on-disk cache)"
        if compiled.get("path")
        else "compiled in memory (no writable cache directory)"
        if compiled
        else "no compiled kernel on this platform"
    )
    since = _seconds_since_process_start()
    total = f"; {since:.2f} s since the process started" if since is not None else ""
    print(f"  cold start: first call {first:.2f} s, kernel {how}{total}")
    sub = slice(0, min(n, 256))
    check = reference.bsr_dense_mm(bsr, dense[:, sub])
    err = ((out[:, sub] - check).abs().max() / check.abs().max().clamp_min(1e-30)).item()
    print(f"  result check vs masked-dense reference (first {sub.stop} columns): "
          f"max relative error {err:.2e} {'OK' if err < 1e-5 else 'FAIL'}")  # fmt: skip
    t_ours, t_native, t_dense = _time_products(bsr, dense, args.repeats)
    gflop = 2 * bsr._nnz() * bs * bs * n / 1e9
    print(f"  median of {args.repeats}: bsrkit {t_ours * 1e3:.1f} ms ({gflop / t_ours:.0f} GFLOP/s), "
          f"torch native BSR {t_native * 1e3:.1f} ms, dense torch.mm {t_dense * 1e3:.1f} ms")  # fmt: skip
    print(f"  speedup: {t_native / t_ours:.2f}x vs torch native BSR, {t_dense / t_ours:.2f}x vs dense")
    info = bsrkit.cache_info()
    print(f"  plan cache: hits={info.hits} misses={info.misses} entries={info.currsize} "
          f"bytes={info.nbytes} dead_evictions={info.dead_evictions}")  # fmt: skip
    del bsr
    info = bsrkit.cache_info()
    print(f"  after `del bsr`: entries={info.currsize} bytes={info.nbytes} "
          f"dead_evictions={info.dead_evictions} (the plan died with its tensor)")  # fmt: skip
    return 0 if err < 1e-5 else 1


def _parse_list(kind: type, positive: bool = True) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            values = [kind(v) for v in text.replace(",", " ").split()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {kind.__name__}, got {text!r}"
            ) from None
        if not values or (positive and not all(0 < v < math.inf for v in values)):  # (NaN: refused)
            raise argparse.ArgumentTypeError(f"expected positive {kind.__name__} values, got {text!r}")
        return values

    return parse


def _count(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an int >= {least}, got {text!r}")
        return value

    return parse


def _check_grid(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for n in args.sizes:
        for bs in args.blocksizes:
            if n % bs:
                parser.error(
                    f"every size must be a multiple of every blocksize, got size {n} and blocksize {bs}"
                )
    if any(d > 1 for d in getattr(args, "densities", [])):
        parser.error(f"densities must be in (0, 1], got {args.densities}")
    for option in ("json", "plot"):  # (checked now, not after the whole grid has run)
        path = getattr(args, option, None)
        if not path:
            continue
        if os.path.isdir(path):
            parser.error(f"--{option}: expected a file, got the directory {path!r}")
        if not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
            parser.error(f"--{option}: cannot write {path!r} (its directory is missing or not writable)")
    if args.plot:
        # (matplotlib picks the format by the extension and adds .png to a name without one)
        suffix = os.path.splitext(args.plot)[1].lower().lstrip(".")
        if suffix not in _PLOT_FORMATS:
            parser.error(
                f"--plot: expected a file name ending in one of {sorted(_PLOT_FORMATS)}, got {args.plot!r}"
            )
        if args.json and os.path.abspath(args.json) == os.path.abspath(args.plot):
            parser.error(f"--json and --plot: expected two files, got {args.plot!r} for both")
        try:
            import matplotlib  # noqa: F401  (the plot's, checked before the grid runs)
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'bsrkit[plot]'")


# Image formats matplotlib's Agg canvas writes (without importing matplotlib to ask).
_PLOT_FORMATS = frozenset(
    {
        "avif",
        "eps",
        "gif",
        "jpeg",
        "jpg",
        "pdf",
        "png",
        "ps",
        "raw",
        "rgba",
        "svg",
        "svgz",
        "tif",
        "tiff",
        "webp",
    }
)


def bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from bsrkit.benchmarking import DTYPES, format_table, run_point

    grid = [
        (op, n, bs, d)
        for op in args.ops
        for n in args.sizes
        for bs in args.blocksizes
        for d in args.densities
    ]
    rows: list[dict[str, Any]] = []
    interrupted = False
    shown = warnings.showwarning  # (one printed on its own cuts the progress bar's line: tqdm writes it)
    warnings.showwarning = lambda msg, kind, *_, **__: tqdm.write(f"{kind.__name__}: {msg}", file=sys.stderr)
    try:
        for op, n, bs, d in tqdm(grid, desc="bsrkit bench", unit="point", file=sys.stderr):
            repeats = args.repeats or (9 if n <= 1024 else 5 if n <= 2048 else 3)
            rows.append(run_point(op, n, bs, d, DTYPES[args.dtype], repeats))
    except KeyboardInterrupt:
        interrupted = True
        print(f"\ninterrupted: {len(rows)} of {len(grid)} points finished", file=sys.stderr)
    finally:
        warnings.showwarning = shown
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians, ratios from one run")
    print(format_table(rows))
    if args.json:
        payload = {
            "schema": "bsrkit-bench/1",
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "complete": not interrupted,
            "results": rows,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot and rows:
        plot_speedups(rows, args.plot)
        print(f"wrote {args.plot}")
    return 130 if interrupted else 0


def plot_speedups(rows: list[dict[str, Any]], path: str) -> None:
    """Speedup over dense vs density, a line per (op, n, blocksize); torch native dashed, same colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["n"], r["blocksize"]), []).append(r)
    for i, ((op, n, bs), rs) in enumerate(sorted(groups.items())):
        rs = sorted(rs, key=lambda r: r["density"])
        dens = [r["density"] for r in rs]
        color = f"C{i % 10}"
        ax.plot(dens, [r["x_dense"] for r in rs], "o-", color=color, label=f"bsrkit {op} n={n} bs={bs}")
        ax.plot(
            dens,
            [r["dense_s"] / r["native_s"] if r["native_s"] else float("nan") for r in rs],
            "x--",
            color=color,
            alpha=0.6,
            label=f"torch native {op} n={n} bs={bs}",
        )
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_xlabel("block density")
    ax.set_ylabel("speedup over dense torch.mm")
    ax.set_yscale("log")
    ax.set_title("Block-sparse vs dense: above 1 the sparse product wins")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in text.replace(",", " ").split():
        parts = item.lower().split("x")
        try:
            M, K, N = (int(v) for v in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected shapes like 4096x4096x256 (MxKxN), got {item!r}"
            ) from None
        if min(M, K, N) <= 0:
            raise argparse.ArgumentTypeError(f"expected positive M, K, N, got {item!r}")
        shapes.append((M, K, N))
    if not shapes:
        raise argparse.ArgumentTypeError(f"expected shapes like 4096x4096x256 (MxKxN), got {text!r}")
    return shapes


def _parse_blocks(text: str) -> list[tuple[int, int]]:
    blocks = []
    for item in text.replace(",", " ").split():
        parts = item.lower().split("x")
        try:
            values = [int(v) for v in parts]
        except ValueError:
            values = []
        if len(values) not in (1, 2) or min(values) <= 0:
            raise argparse.ArgumentTypeError(f"expected blocksizes like 32 or 32x16, got {item!r}")
        blocks.append((values[0], values[-1]))
    if not blocks:
        raise argparse.ArgumentTypeError(f"expected blocksizes like 32 or 32x16, got {text!r}")
    return blocks


class _OneLineErrors(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta state")
    from bsrkit import __version__

    parser = _OneLineErrors(prog="bsrkit", description="Block-sparse products for PyTorch.")
    parser.add_argument("--version", action="version", version=f"bsrkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineErrors)

    p = sub.add_parser("demo", help="multiply a random BSR weight by a dense matrix and compare")
    commands = {"demo": p}
    p.add_argument("--size", type=_parse_list(int), default=[2048], help="matrix size n (default 2048)")
    p.add_argument("--blocksize", type=_parse_list(int), default=[32], help="block size (default 32)")
    p.add_argument(
        "--density", type=_parse_list(float), default=None, help="block density (0.1; --model: 0.5,0.25,0.1)"
    )
    p.add_argument("--repeats", type=_parse_list(int), default=[5], help="timed repeats (default 5)")
    p.add_argument(
        "--model", action="store_true", help="a small transformer instead: dense vs sparsify_ (needs [hf])"
    )
    p.add_argument("--hidden", type=int, default=None, help="--model: hidden size (512)")
    p.add_argument("--layers", type=int, default=None, help="--model: decoder layers (4)")
    p.set_defaults(run=demo)

    p = commands["bench"] = sub.add_parser(
        "bench", help="time bsrkit vs torch native BSR vs dense over a grid"
    )
    p.add_argument("--sizes", type=_parse_list(int), default=[1024, 2048], help="n values (1024,2048)")
    p.add_argument("--blocksizes", type=_parse_list(int), default=[16, 32, 64], help="(16,32,64)")
    p.add_argument("--densities", type=_parse_list(float), default=[0.05, 0.1, 0.25, 0.5])
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"], default="float32")
    p.add_argument(
        "--ops", type=_parse_ops, default=["mm"], help="comma list of mm,addmm,sampled (default mm)"
    )
    p.add_argument("--repeats", type=_count(0), default=0, help="timed repeats per point (0: by size)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write speedup-over-dense vs density (PNG)")
    p.set_defaults(run=bench)

    p = commands["tune"] = sub.add_parser("tune", help="search the CPU kernel's parameters and store them")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--sizes", type=_parse_list(int), default=[2048], help="square n values (default 2048)"
    )
    which.add_argument("--shapes", type=_parse_shapes, default=None, help="MxKxN list (instead of --sizes)")
    p.add_argument("--blocksizes", type=_parse_blocks, default=[(32, 32)], help="e.g. 32 or 32x16 (32)")
    p.add_argument("--density", type=float, default=0.1, help="block density to tune at (0.1)")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"], default="float32")
    p.add_argument("--panels", type=_parse_list(int), default=[64, 128, 256, 512, 1024])
    p.add_argument("--threads", type=_parse_list(int), default=None, help="thread counts to try")
    p.add_argument(
        "--backend",
        choices=["cpu", "triton"],
        default="cpu",
        help="cpu (default), or triton: the GPU kernels (on CPU tensors only under TRITON_INTERPRET=1)",
    )
    p.add_argument("--block-n", type=_parse_list(int), default=[32, 64, 128], help="Triton BLOCK_N values")
    p.add_argument("--block-k", type=_parse_list(int), default=[16, 32], help="Triton BLOCK_K values")
    p.add_argument("--num-warps", type=_parse_list(int), default=[2, 4, 8], help="Triton num_warps values")
    p.add_argument("--num-stages", type=_parse_list(int), default=[1, 2, 3], help="Triton num_stages values")
    p.add_argument("--repeats", type=_count(1), default=3)
    p.add_argument("--table", metavar="FILE", default=None, help="tuning table (default: user cache)")
    p.add_argument(
        "--streamed",
        action="store_true",
        help="time each candidate round-robin over copies of the weight spanning 4x the last-level cache, "
        "so that it is read from memory as in a model's decode step (default: one weight, in cache)",
    )
    p.add_argument(
        "--break-even",
        action="store_true",
        help="measure each blocksize's break-even density against dense (a layer of the first size or "
        "shape, 1 and 512 tokens) instead; sparsify_ reads it",
    )
    p.set_defaults(run=tune)

    args = parser.parse_args(argv)
    error = commands[args.command].error  # (names the subcommand: 'bsrkit tune: error: ...')
    if args.command == "demo":
        if args.density is None:
            args.density = [0.5, 0.25, 0.1] if args.model else [0.1]
        if max(args.density) > 1:
            error(f"--density must be in (0, 1], got {max(args.density)}")
        for name in (
            ("size", "blocksize", "repeats") if args.model else ("size", "blocksize", "density", "repeats")
        ):
            values = getattr(args, name)
            if len(values) > 1:  # (parsed as lists, as bench's; demo runs one point)
                error(f"--{name} takes one value in demo, got {values}")
            setattr(args, name, values[0])
        if not args.model and (args.hidden is not None or args.layers is not None):
            error("--hidden and --layers size the --model demo: add --model")
        args.hidden = 512 if args.hidden is None else args.hidden
        args.layers = 4 if args.layers is None else args.layers
        if args.model:
            if args.hidden < 64 or args.hidden % 64 or args.hidden % args.blocksize or args.layers < 1:
                error(
                    f"--hidden must be a positive multiple of 64 and of --blocksize, --layers >= 1, got "
                    f"{args.hidden}, {args.blocksize}, {args.layers}"
                )
        elif args.size % args.blocksize:
            error(f"--size must be a multiple of --blocksize, got {args.size} and {args.blocksize}")
    elif args.command == "bench":
        _check_grid(commands["bench"], args)
    else:
        if not 0 < args.density <= 1:
            error(f"--density must be in (0, 1], got {args.density}")
        if args.threads and max(args.threads) > (os.cpu_count() or 1):
            error(f"--threads must be at most the {os.cpu_count()} CPUs here, got {max(args.threads)}")
        if args.backend == "triton":
            from bsrkit.backends import triton as triton_backend

            if not triton_backend.available():
                error("--backend triton needs the triton package (pip install bsrkit[triton])")
            if not torch.cuda.is_available() and not triton_backend.interpreting():
                error("--backend triton needs a CUDA device, or TRITON_INTERPRET=1 to tune on CPU")
            if any(w < 16 or w & (w - 1) for w in args.block_n):
                error(f"--block-n values must be powers of two >= 16, got {args.block_n}")
        for M, K, _ in args.shapes or [(n, n, n) for n in args.sizes]:
            for Ms, Ks in args.blocksizes:
                if M % Ms or K % Ks:
                    error(f"blocks {Ms}x{Ks} must divide M x K = {M} x {K}")
    try:
        show_traceback = flag("BSRKIT_TRACEBACK", False)  # (read first: a bad value is its own error)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        print(f"bsrkit {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # one line, no traceback (BSRKIT_TRACEBACK=1 shows it)
        if show_traceback:
            raise
        print(f"bsrkit {args.command}: error: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        return 1


def _parse_ops(text: str) -> list[str]:
    ops = [o.strip() for o in text.split(",") if o.strip()]
    known = ("mm", "addmm", "sampled")
    bad = [o for o in ops if o not in known]
    if bad or not ops:
        raise argparse.ArgumentTypeError(f"expected ops among {known}, got {text!r}")
    return ops


if __name__ == "__main__":
    sys.exit(main())
