"""A whole model, dense against block-sparse, in one run: tokens/s of prefill and greedy decode, and peak
memory, for a LLaMA-style transformers model with random weights.

The dense model runs on transformers' SDPA attention (torch's best CPU attention); the sparse one is the
same model after ``bsrkit.sparsify_`` (every decoder linear layer; the output head stays dense) with
``attn_implementation="bsrkit"``. Both see the same prompt; decode is greedy with a KV cache.

    python benchmarks/transformer.py                                  # the issue-25 model, 2 threads
    python benchmarks/transformer.py --layers 2 --hidden 256 --intermediate 704 --prefill 128  # small

Memory: the bytes of each model's parameters and buffers, and the resident memory one prefill adds at
its peak (Linux). Every figure is a median over ``--repeats`` runs; the methods alternate run by run, so
that a shared machine's load hits both alike.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch

import bsrkit
import bsrkit.integrations.transformers
from bsrkit.benchmarking import peak_rss_mib

warnings.filterwarnings("ignore", message="Sparse (BSR|CSR) tensor support is in beta state")
warnings.filterwarnings("ignore", category=bsrkit.tuning.TuningWarning)


def build(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def prefill_seconds(model: torch.nn.Module, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        t0 = time.perf_counter()
        model(tokens)
        return time.perf_counter() - t0


def decode_seconds(model: torch.nn.Module, prompt: torch.Tensor, new: int) -> float:
    """Seconds for ``new`` greedy tokens after the prompt's prefill (the prefill is timed apart)."""
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(new):
            out = model(token, cache=cache, use_cache=True)
            cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        return time.perf_counter() - t0


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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dense = build(args)
    params = sum(p.numel() for p in dense.parameters())
    print(f"LLaMA-style model: {params / 1e6:.0f} M parameters, {args.layers} layers, hidden {args.hidden}, "
          f"{torch.get_num_threads()} threads, float32, blocksize {args.blocksize}")  # fmt: skip
    g = torch.Generator().manual_seed(1)
    long = torch.randint(0, args.vocab, (1, args.prefill), generator=g)
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=g)
    print(f"{'model':>22} | {'prefill tok/s':>13} {'x dense':>7} | {'decode tok/s':>12} {'x dense':>7} | "
          f"{'weights MiB':>11} {'prefill peak +MiB':>17}")  # fmt: skip
    models = {"dense (SDPA)": dense}
    for d in args.densities:
        sparse = copy.deepcopy(dense)
        summary = bsrkit.sparsify_(sparse, blocksize=args.blocksize, density=d, force=True)
        sparse.config._attn_implementation = "bsrkit"
        models[f"density {d} ({summary.swapped} layers)"] = sparse
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in models}
    for model in models.values():  # warm-up: compiles, plans, caches
        prefill_seconds(model, long)
        decode_seconds(model, prompt, 2)
    for _ in range(args.repeats):
        for name, model in models.items():
            times[name][0].append(prefill_seconds(model, long))
            times[name][1].append(decode_seconds(model, prompt, args.decode))
    base_p, base_d = (statistics.median(t) for t in times["dense (SDPA)"])
    for name, model in models.items():
        tp, td = (statistics.median(t) for t in times[name])
        peak = peak_rss_mib(lambda m=model: prefill_seconds(m, long))
        peak_text = f"{peak:17.0f}" if peak is not None else f"{'n/a':>17}"
        held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 2**20
        print(f"{name:>22} | {args.prefill / tp:>13.1f} {base_p / tp:>7.2f} | {args.decode / td:>12.1f} "
              f"{base_d / td:>7.2f} | {held:>11.0f} {peak_text}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
