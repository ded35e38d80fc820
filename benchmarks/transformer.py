"""A whole model, dense against block-sparse, in one run: tokens/s of prefill and greedy decode, and peak
memory, for a LLaMA-style transformers model with random weights.

The dense model runs on transformers' SDPA attention (torch's best CPU attention); the sparse one is the
same model after ``bsrkit.sparsify_`` (every decoder linear layer; the output head stays dense) with
``attn_implementation="bsrkit"``. Both see the same prompt; prefill is the prompt's forward pass as
``generate`` runs it (``logits_to_keep=1``: the last position's logits; ``--all-logits``: every position's,
a scoring pass); decode is greedy with a KV cache.

    python benchmarks/transformer.py                                  # the issue-25 model, 2 threads
    python benchmarks/transformer.py --layers 2 --hidden 256 --intermediate 704 --prefill 128  # small
    python benchmarks/transformer.py --compile    # every model's forward under torch.compile

Memory: the bytes of each model's parameters and buffers, and the resident memory one prefill adds at
its peak (Linux). Every figure is a median over ``--repeats`` runs; the methods alternate run by run, so
that a shared machine's load hits both alike.
"""

from __future__ import annotations

import argparse
import warnings

import torch

import bsrkit
from bsrkit.model_demo import ModelConfig, build, check_logits, compare, format_rows

warnings.filterwarnings("ignore", message="Sparse (BSR|CSR) tensor support is in beta state")
warnings.filterwarnings("ignore", category=bsrkit.tuning.TuningWarning)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--blocksize", type=int, default=32)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.5, 0.25, 0.1])
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill timing")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens before decoding")
    ap.add_argument("--decode", type=int, default=32, help="greedy tokens decoded")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--check", action="store_true", help="also compare logits with the pruned dense twin")
    ap.add_argument("--compile", action="store_true", help="every model's forward under torch.compile")
    ap.add_argument(
        "--all-logits", action="store_true", help="prefill computes every position's logits (a scoring pass)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    config = ModelConfig(args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads, args.vocab)
    dense = build(config)
    params = sum(p.numel() for p in dense.parameters())
    print(f"LLaMA-style model: {params / 1e6:.0f} M parameters, {args.layers} layers, hidden {args.hidden}, "
          f"{torch.get_num_threads()} threads, float32, blocksize {args.blocksize}"
          f"{', every forward under torch.compile' if args.compile else ''}")  # fmt: skip
    rows, models = compare(
        dense, args.densities, blocksize=args.blocksize, prefill=args.prefill, prompt=args.prompt,
        decode=args.decode, repeats=args.repeats, all_logits=args.all_logits,
        compile_backend="inductor" if args.compile else None,
    )  # fmt: skip
    print(format_rows(rows))
    if args.check:
        tokens = torch.randint(0, args.vocab, (1, 32), generator=torch.Generator().manual_seed(2))
        for name, model in models.items():
            if model is not dense:
                print(f"{name}: logits vs the pruned dense twin, max relative difference "
                      f"{check_logits(dense, model, tokens):.1e} (float64)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
