"""A whole model, dense against block-sparse, in one run: a LLaMA-style transformers model with random
weights, its decoder linear layers block-sparse by :func:`bsrkit.sparsify_` and its attention on
bsrkit (``attn_implementation="bsrkit"``), against the same dense model on transformers' SDPA attention
(torch's best CPU attention). Shared by ``bsrkit demo --model`` (a small model) and
``benchmarks/transformer.py`` (the models of ``docs/performance.md``). Needs transformers
(``pip install bsrkit[hf]``).

Each model sees the same prompt; prefill is the prompt's forward pass as ``generate`` runs it (the last
position's logits only); decode is greedy with a KV cache. The methods alternate run by run, so
that a shared machine's load hits them alike; every time is a median over the runs. With
``compile_backend``, every model's ``forward`` (the dense one's too) runs under ``torch.compile`` on that
backend (dynamic shapes: the KV cache grows a token a step), compiled in the warm-up run.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from typing import Any

import torch

__all__ = ["ModelConfig", "Row", "build", "check_logits", "compare", "format_rows"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    hidden: int = 1024
    intermediate: int = 2816
    layers: int = 8
    heads: int = 16
    kv_heads: int = 16
    vocab: int = 8000


@dataclasses.dataclass(frozen=True)
class Row:
    """One model's figures: tokens/s of prefill and decode, their ratios to the dense model's, the bytes
    its parameters and buffers hold, and the resident memory a prefill adds at its peak (None: not
    Linux)."""

    name: str
    prefill_tps: float
    prefill_x: float
    decode_tps: float
    decode_x: float
    weights_mib: float
    peak_mib: float | None


def build(config: ModelConfig, seed: int = 0) -> Any:
    """The dense model (random weights, ``seed``), in eval mode, on SDPA attention."""
    import transformers

    llama = transformers.LlamaConfig(
        vocab_size=config.vocab, hidden_size=config.hidden, intermediate_size=config.intermediate,
        num_hidden_layers=config.layers, num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(llama, attn_implementation="sdpa").eval()


def sparsified(dense: Any, blocksize: int, density: float) -> tuple[Any, Any]:
    """A copy of ``dense`` with every decoder linear layer block-sparse (forced: the table shows every
    density) and bsrkit attention; with :func:`bsrkit.sparsify_`'s summary."""
    import bsrkit.integrations.transformers  # noqa: F401  (registers attn_implementation="bsrkit")
    from bsrkit.sparsify import sparsify_

    sparse = copy.deepcopy(dense)
    summary = sparsify_(sparse, blocksize=blocksize, density=density, force=True)
    sparse.config._attn_implementation = "bsrkit"
    return sparse, summary


def _last_logits_only(model: torch.nn.Module) -> dict[str, Any]:
    """The keyword with which ``generate`` asks a prompt's forward pass for the last position's logits
    only (``logits_to_keep=1``, where the model takes it): what a served prefill computes."""
    import inspect

    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def prefill_seconds(model: torch.nn.Module, tokens: torch.Tensor, all_logits: bool = False) -> float:
    """Seconds for the prompt's forward pass as ``generate`` runs it (``all_logits``: every position's
    logits, a scoring pass: the output head then costs ``len(tokens)`` times more)."""
    kwargs = {} if all_logits else _last_logits_only(model)
    with torch.no_grad():
        t0 = time.perf_counter()
        model(tokens, **kwargs)
        return time.perf_counter() - t0


def _cache_of(out: Any) -> Any:
    # (transformers 5.x names the KV cache ``cache``; 4.x ``past_key_values``)
    return out.cache if "cache" in out else out.past_key_values


def decode_seconds(model: torch.nn.Module, prompt: torch.Tensor, new: int) -> float:
    """Seconds for ``new`` greedy tokens after the prompt's prefill (the prefill is not timed)."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(prompt, use_cache=True, **_last_logits_only(model))
        cache, token = _cache_of(out), out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(new):
            out = model(token, use_cache=True, **{name: cache})
            cache, token = _cache_of(out), out.logits[:, -1:].argmax(-1)
        return time.perf_counter() - t0


def check_logits(dense: Any, sparse: Any, tokens: torch.Tensor) -> float:
    """Max relative difference of the sparse model's logits from those of the dense model holding the
    same pruned weights (each BSRLinear's dense twin) on SDPA attention, in float64."""
    from bsrkit.nn import BSRLinear

    twin = copy.deepcopy(sparse).double()
    for fqn, module in list(twin.named_modules()):
        if isinstance(module, BSRLinear):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            with torch.no_grad():
                linear.weight = torch.nn.Parameter(module.to_dense())
                if module.bias is not None:
                    linear.bias = torch.nn.Parameter(module.bias.detach().clone())
            parent, _, name = fqn.rpartition(".")
            setattr(twin.get_submodule(parent) if parent else twin, name, linear.double())
    twin.config._attn_implementation = dense.config._attn_implementation
    sparse64 = copy.deepcopy(sparse).double()
    with torch.no_grad():
        expected = twin(tokens).logits
        got = sparse64(tokens).logits
    return float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def compare(
    dense: Any,
    densities: list[float],
    *,
    blocksize: int = 32,
    prefill: int = 512,
    prompt: int = 64,
    decode: int = 32,
    repeats: int = 3,
    all_logits: bool = False,
    compile_backend: str | None = None,
) -> tuple[list[Row], dict[str, Any]]:
    """Time the dense model and its sparsified copies at ``densities`` (module docstring; ``all_logits``
    as :func:`prefill_seconds`); return the rows and the copies (by row name). ``compile_backend``: each
    model's ``forward`` (``dense``'s included) is replaced by its ``torch.compile`` on that backend."""
    from bsrkit.benchmarking import peak_rss_mib

    for name, value in (("repeats", repeats), ("prefill", prefill), ("prompt", prompt), ("decode", decode)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"compare(): expected {name} to be a positive int, got {value!r}")
    vocab = dense.config.vocab_size
    g = torch.Generator().manual_seed(1)
    long = torch.randint(0, vocab, (1, prefill), generator=g)
    start = torch.randint(0, vocab, (1, prompt), generator=g)
    models: dict[str, torch.nn.Module] = {"dense (SDPA)": dense}
    for d in dict.fromkeys(densities):  # (a density given twice is one row: rows are named by density)
        sparse, summary = sparsified(dense, blocksize, d)
        models[f"density {d} ({summary.swapped} layers)"] = sparse
    if compile_backend is not None:  # (after the copies: each compiles its own forward)
        for model in models.values():
            model.forward = torch.compile(model.forward, dynamic=True, backend=compile_backend)
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in models}
    # The models share their forwards' code (transformers wraps each in one decorator's function), and
    # Dynamo's limit of 8 compiled variants a code object counts them all (6-8 a model here).
    with torch._dynamo.config.patch(recompile_limit=16 * len(models)):
        for model in models.values():  # warm-up: compiles, plans, caches
            prefill_seconds(model, long, all_logits)
            decode_seconds(model, start, 2)
        for _ in range(repeats):
            for name, model in models.items():
                times[name][0].append(prefill_seconds(model, long, all_logits))
                times[name][1].append(decode_seconds(model, start, decode))
    base_p, base_d = (statistics.median(t) for t in times["dense (SDPA)"])
    rows = []
    for name, model in models.items():
        tp, td = (statistics.median(t) for t in times[name])
        peak = peak_rss_mib(lambda m=model: prefill_seconds(m, long, all_logits))  # type: ignore[misc]
        held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 2**20
        rows.append(Row(name, prefill / tp, base_p / tp, decode / td, base_d / td, held, peak))
    return rows, models


def format_rows(rows: list[Row]) -> str:
    lines = [
        f"{'model':>24} | {'prefill tok/s':>13} {'x dense':>7} | {'decode tok/s':>12} {'x dense':>7} | "
        f"{'weights MiB':>11} {'prefill peak +MiB':>17}"
    ]
    for r in rows:
        peak = f"{r.peak_mib:17.0f}" if r.peak_mib is not None else f"{'n/a':>17}"
        lines.append(
            f"{r.name:>24} | {r.prefill_tps:>13.1f} {r.prefill_x:>7.2f} | {r.decode_tps:>12.1f} "
            f"{r.decode_x:>7.2f} | {r.weights_mib:>11.0f} {peak}"
        )
    return "\n".join(lines)
