"""bsrkit attention inside transformers (attn_implementation="bsrkit") and sparsify_ on a transformers
model: logits against the same model on transformers' own attention. Skipped without transformers."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import bsrkit  # noqa: E402
import bsrkit.integrations.transformers as hf  # noqa: E402
from bsrkit.nn import BSRLinear  # noqa: E402

# float64 throughout; bsrkit's fused CPU attention and transformers' path round differently: the logits
# after two layers differed by up to 6.3e-8 when this was written.
TOL = {"rtol": 1e-6, "atol": 1e-6}


def _llama(attn, sliding_window=None, dtype=torch.float64, seed=0):
    kind = transformers.MistralConfig if sliding_window else transformers.LlamaConfig
    extra = {"sliding_window": sliding_window} if sliding_window else {}
    config = kind(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, **extra,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype).eval()


def _pair(sliding_window=None):
    # (transformers' SDPA path: its eager path turns a left-padded sequence into NaN from the second layer)
    ours, theirs = _llama(hf.NAME, sliding_window), _llama("sdpa", sliding_window)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


@pytest.mark.parametrize("sliding_window", [None, 48])
def test_prefill_logits_match_with_padding_and_gqa(sliding_window):
    ours, theirs = _pair(sliding_window)
    tokens = torch.randint(0, 97, (2, 128), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 128, dtype=torch.long)
    mask[1, :40] = 0  # left padding of the second sequence
    calls = []
    original = bsrkit.scaled_dot_product_attention
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            bsrkit, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or original(*a, **k)
        )
        got = ours(tokens, attention_mask=mask).logits
    want = theirs(tokens, attention_mask=mask).logits
    assert len(calls) == 2  # both layers ran on bsrkit
    keep = mask.bool()  # (padded positions: bsrkit gives their rows 0, SDPA lets them attend everything)
    torch.testing.assert_close(got[keep], want[keep], **TOL)


def test_plain_causal_without_mask():
    ours, theirs = _pair()
    tokens = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens).logits, theirs(tokens).logits, **TOL)


def test_greedy_generation_with_kv_cache_matches():
    """Prefill on bsrkit, then one query row per step (falls back to SDPA); the same tokens."""
    ours, theirs = _pair()
    prompt = torch.randint(0, 97, (1, 32), generator=torch.Generator().manual_seed(3))
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        assert torch.equal(ours.generate(prompt, **kwargs), theirs.generate(prompt, **kwargs))


def test_lengths_no_blocksize_divides_fall_back_to_sdpa():
    ours, theirs = _pair()
    tokens = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens).logits, theirs(tokens).logits, **TOL)


def test_sparsified_model_equals_the_dense_model_with_the_same_pruned_weights():
    ours, theirs = _pair()
    summary = bsrkit.sparsify_(ours, blocksize=16, density=0.25)
    assert summary.swapped == 14 and isinstance(ours.model.layers[0].mlp.up_proj, BSRLinear)
    assert not isinstance(ours.lm_head, BSRLinear)  # the output head stays dense
    with torch.no_grad():
        for fqn, module in ours.named_modules():
            if isinstance(module, BSRLinear):
                theirs.get_submodule(fqn).weight.copy_(module.to_dense())
    tokens = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens).logits, theirs(tokens).logits, **TOL)


def test_the_timed_prefill_asks_for_the_last_logits_only_as_generate_does():
    """benchmarks/transformer.py's prefill is the prompt pass ``generate`` runs (``logits_to_keep=1``):
    one row of logits; ``all_logits`` times the scoring pass (every row)."""
    from bsrkit import model_demo

    model = model_demo.build(model_demo.ModelConfig(64, 176, 1, 2, 2, 100))
    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append(out.logits.shape[1]))
    tokens = torch.randint(0, 100, (1, 12))
    model_demo.prefill_seconds(model, tokens)
    model_demo.prefill_seconds(model, tokens, all_logits=True)
    assert seen == [1, 12]


def test_a_compiled_model_takes_a_padding_mask():
    """A compiled forward given a padding mask (as docs/models.md compiles for serving) crashed inside
    Dynamo, tracing the mask's cache: it now breaks the graph there, and gives the eager logits."""
    model = _llama(hf.NAME, dtype=torch.float32)
    bsrkit.sparsify_(model, blocksize=16, density=0.25, force=True)
    tokens = torch.randint(3, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, :5] = 0  # (the second sequence left-padded)
    with torch.no_grad():
        eager = model(tokens, attention_mask=mask).logits
        compiled = torch.compile(model.forward, backend="eager", dynamic=True)
        torch.testing.assert_close(compiled(tokens, attention_mask=mask).logits, eager, rtol=1e-5, atol=1e-5)


def test_the_model_comparison_can_compile_every_forward():
    """``compare(compile_backend=...)`` (``benchmarks/transformer.py --compile``) times every model,
    the dense one included, through ``torch.compile``, and the compiled sparsified model gives the
    eager one's logits."""
    from bsrkit import model_demo

    dense = model_demo.build(model_demo.ModelConfig(64, 176, 1, 2, 2, 100))
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    rows, models = model_demo.compare(
        dense, [0.25], blocksize=16, prefill=12, prompt=6, decode=2, repeats=1, compile_backend="eager"
    )
    assert [r.name for r in rows] == ["dense (SDPA)", "density 0.25 (7 layers)"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before
    sparse = models["density 0.25 (7 layers)"]
    assert "forward" in vars(sparse) and "forward" in vars(dense)  # (the compiled ones)
    tokens = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        compiled, eager = sparse(tokens).logits, type(sparse).forward(sparse, tokens).logits
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_a_custom_mask_written_in_place_is_read_again():
    """transformers passes a user's 4-D bool mask through: the BSR mask cached for it is proven against
    the mask's bytes, so a write no version counter sees (numpy, ``.data``) gives the new attention."""
    ours, theirs = _pair()
    tokens = torch.randint(0, 97, (1, 32), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(1, 1, 32, 32, dtype=torch.bool).tril()
    with torch.no_grad():
        ours(tokens, attention_mask=mask)
        mask.numpy()[0, 0, 16:, :16] = False  # the second half no longer sees the first
        torch.testing.assert_close(
            ours(tokens, attention_mask=mask).logits, theirs(tokens, attention_mask=mask).logits, **TOL
        )
        mask.data[0, 0, 16:, :8] = True
        torch.testing.assert_close(
            ours(tokens, attention_mask=mask).logits, theirs(tokens, attention_mask=mask).logits, **TOL
        )


@pytest.mark.parametrize("L, S, causal", [(16, 16, False), (16, 32, True)])
def test_grouped_heads_fall_back_to_sdpa_unrepeated(L, S, causal):
    """The fallbacks take key and value as given: transformers' SDPA path repeats grouped heads itself
    (they were repeated twice: a shape error where it cannot use enable_gqa, e.g. key and value of other
    head dims)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Attention(torch.nn.Module):
        num_key_value_groups = 2
        is_causal = causal

    g = torch.Generator().manual_seed(4)
    q, k, v = (
        torch.randn(1, 4, L, 8, generator=g),
        torch.randn(1, 2, S, 8, generator=g),
        torch.randn(1, 2, S, 4, generator=g),
    )
    want = sdpa_attention_forward(Attention(), q, k, v, None)[0]
    torch.testing.assert_close(hf.attention_forward(Attention(), q, k, v, None)[0], want)


@pytest.mark.parametrize("name", ["softcap", "s_aux", "sinks"])
def test_what_neither_path_applies_is_refused_by_name(name):
    """Soft-capping and attention sinks were dropped silently (GPT-OSS's logits off by 0.25), or refused
    by the SDPA fallback in its own name."""

    class Attention(torch.nn.Module):
        num_key_value_groups = 1

    q = k = v = torch.randn(1, 2, 16, 8)
    extra = torch.full((2,), 1.0) if name != "softcap" else 50.0
    with pytest.raises(ValueError, match=f"{name}= .* attn_implementation='eager'"):
        hf.attention_forward(Attention(), q, k, v, None, **{name: extra})


def test_a_model_on_the_meta_device_runs_as_on_sdpa():
    with torch.device("meta"):
        ours, theirs = _llama(hf.NAME), _llama("sdpa")
    tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
    assert ours(tokens).logits.shape == theirs(tokens).logits.shape == (2, 32, 97)


@pytest.mark.parametrize("bad", [{"repeats": 0}, {"decode": -1}, {"prefill": 2.5}, {"prompt": True}])
def test_the_model_comparison_names_a_count_it_cannot_take(bad):
    """(repeats=0 failed in statistics.median, after building every model.)"""
    from bsrkit import model_demo

    dense = model_demo.build(model_demo.ModelConfig(64, 176, 1, 2, 2, 100))
    name = next(iter(bad))
    with pytest.raises(ValueError, match=f"expected {name} to be a positive int"):
        model_demo.compare(dense, [0.25], blocksize=16, **bad)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_a_rotary_model_under_autocast_runs_as_on_sdpa(low):
    """Under autocast the rotary embedding hands attention float32 query and key with a half value:
    torch's SDPA casts them (a lower-precision op there), bsrkit's refused the mixed dtypes."""
    ours, theirs = (_llama(attn, dtype=torch.float32) for attn in (hf.NAME, "sdpa"))
    tokens = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), torch.autocast("cpu", dtype=low):
        got, want = ours(tokens).logits, theirs(tokens).logits
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("shape", [(2, 1, 1, 32), (2, 1, 32, 1), (1, 1, 1, 32)])
def test_a_mask_broadcasting_over_queries_or_keys_runs_as_on_sdpa(shape):
    """A user's 4-D mask (B, 1, 1, S) reaches the attention as given: mask_from_dense refused it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Attention(torch.nn.Module):
        num_key_value_groups = 1
        is_causal = False

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 32, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(shape, generator=g) > 0.3
    mask.view(-1)[0] = True
    calls = []
    original = bsrkit.scaled_dot_product_attention
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            bsrkit, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or original(*a, **kw)
        )
        got = hf.attention_forward(Attention(), q, k, v, mask)[0]
    want = sdpa_attention_forward(Attention(), q, k, v, mask)[0]
    assert calls == [1]  # (on bsrkit, not the fallback)
    keep = (
        mask.expand(2, 1, 32, 32).any(-1).transpose(1, 2)
    )  # (rows with nothing to attend: 0 here, NaN there)
    torch.testing.assert_close(got[keep.expand_as(got[..., 0])], want[keep.expand_as(want[..., 0])], **TOL)
    with pytest.raises(RuntimeError):  # (a mask that does not broadcast: SDPA's error)
        hf.attention_forward(Attention(), q, k, v, torch.ones(2, 1, 3, 32, dtype=torch.bool))
