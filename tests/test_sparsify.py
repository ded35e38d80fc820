"""sparsify_: the model-level swap of linear layers for BSRLinear, checked against the dense model holding
the same pruned weights."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

import bsrkit
from bsrkit.nn import BSRLinear
from bsrkit.sparsify import break_even_density, replacement_problem, sparsify_
from helpers import AttentionBlock


class Conv1D(nn.Module):
    """transformers' Conv1D, as the GPT-2 family uses it: y = x @ weight + bias, weight (in, out)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(nf, dtype=torch.float64))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], self.nf)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 32, dtype=torch.float64)
        self.up = nn.Linear(32, 64, dtype=torch.float64)
        self.gpt2_proj = Conv1D(32, 64)
        self.odd = nn.Linear(32, 20, dtype=torch.float64)  # 20 output features: no 8-block fits
        self.lm_head = nn.Linear(32, 50, bias=False, dtype=torch.float64)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.gpt2_proj(torch.relu(self.up(h)))
        return self.lm_head(h) + self.odd(h).sum(-1, keepdim=True)


def _dense_twin(model, sparse_model):
    """The dense model holding the pruned weights: each swapped layer's BSR weight densified."""
    twin = copy.deepcopy(model)
    for fqn, module in sparse_model.named_modules():
        if isinstance(module, BSRLinear):
            original = twin.get_submodule(fqn)
            with torch.no_grad():
                w = module.to_dense()
                original.weight.copy_(w if isinstance(original, nn.Linear) else w.t())
    return twin


def test_logits_equal_the_dense_model_with_the_same_pruned_weights():
    torch.manual_seed(0)
    model = TinyLM()
    sparse = copy.deepcopy(model)
    summary = sparsify_(sparse, blocksize=16, density=0.25)
    assert isinstance(sparse.up, BSRLinear) and isinstance(sparse.gpt2_proj, BSRLinear)
    assert isinstance(sparse.lm_head, nn.Linear) and isinstance(sparse.odd, nn.Linear)  # head; shape
    assert [r.fqn for r in summary.layers] == ["up", "gpt2_proj"] and summary.swapped == 2
    assert all(r.density == 0.25 for r in summary.layers)
    assert summary.dense_weights == 2 * 32 * 64 and summary.stored_weights == 2 * 32 * 64 // 4
    assert "2 of 2 selected layers block-sparse" in str(summary)
    tokens = torch.randint(0, 50, (3, 7))
    twin = _dense_twin(model, sparse)
    torch.testing.assert_close(sparse(tokens), twin(tokens), rtol=1e-12, atol=1e-12)
    assert not torch.equal(twin(tokens), model(tokens))  # (pruning changed the model)


def test_kept_blocks_are_those_of_largest_norm_and_bias_is_kept():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 16, dtype=torch.float64))
    weight, bias = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    sparsify_(model, blocksize=4, density=0.25, force=True)
    norms = weight.reshape(4, 4, 4, 4).transpose(1, 2).pow(2).sum((-1, -2))
    kept = (model[0].to_dense().reshape(4, 4, 4, 4).transpose(1, 2) != 0).any(-1).any(-1)
    assert kept.sum() == 4 and bool(norms[kept].min() >= norms[~kept].max())
    assert torch.equal(model[0].bias.detach(), bias)


def test_dense_where_the_block_sparse_product_would_be_slower_unless_forced():
    limit = break_even_density("cpu", (8, 8))
    assert 0 < limit < 1 and break_even_density("cpu", (64, 64)) > break_even_density("cpu", (16, 16))
    assert break_even_density("meta", (8, 8)) == 0.0  # no measurements: stays dense
    model = nn.Sequential(nn.Linear(16, 16))
    summary = sparsify_(model, blocksize=8, density=min(1.0, limit + 0.01))
    assert isinstance(model[0], nn.Linear) and summary.swapped == 0
    assert "break-even" in summary.layers[0].reason and "dense (density" in str(summary)
    # (a numpy density is named as the decimal given, not as its float: 0.28999999165534973)
    assert limit <= 0.999
    summary = sparsify_(model, blocksize=8, density=np.float32(0.999))
    assert "dense (density 0.999 >= break-even" in str(summary)
    summary = sparsify_(model, blocksize=8, density=0.9, force=True)
    assert isinstance(model[0], BSRLinear) and summary.swapped == 1


def test_filter_fn_takes_module_and_fqn_and_the_output_head_is_found():
    class WithHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

        def get_output_embeddings(self):
            return self.out

    model = WithHead()
    seen = []
    sparsify_(model, blocksize=8, density=0.2, filter_fn=lambda m, fqn: seen.append(fqn) or fqn == "b")
    assert isinstance(model.b, BSRLinear) and isinstance(model.a, nn.Linear) and "a" in seen
    model = WithHead()
    sparsify_(model, blocksize=8, density=0.2)
    assert isinstance(model.a, BSRLinear) and isinstance(model.out, nn.Linear)  # the head stays dense


@pytest.mark.parametrize(
    "kwargs,error",
    [
        ({"blocksize": 8, "density": 1.5}, ValueError),
        ({"blocksize": 8, "density": True}, ValueError),
        ({"blocksize": 0, "density": 0.1}, ValueError),
        ({"blocksize": (8, 8.0), "density": 0.1}, TypeError),
        ({"blocksize": (8,), "density": 0.1}, TypeError),
        ({"blocksize": 8.0, "density": 0.1}, TypeError),
        ({"blocksize": 8, "density": float("nan")}, ValueError),
        ({"blocksize": 8, "density": "0.1"}, TypeError),
        ({"blocksize": 8, "density": 0.1, "criterion": "movement"}, ValueError),
        ({"blocksize": 8, "density": 0.1, "filter_fn": lambda m, fqn: fqn == "0"}, ValueError),  # 20 % 8
        ({"blocksize": 8, "density": 0.1, "filter_fn": lambda m, fqn: fqn == "1"}, ValueError),  # ReLU
    ],
)
def test_bad_arguments_raise_before_anything_changes(kwargs, error):
    model = nn.Sequential(nn.Linear(16, 20), nn.ReLU(), nn.Linear(20, 16))
    with pytest.raises(error):
        sparsify_(model, **kwargs)
    assert isinstance(model[0], nn.Linear) and isinstance(model[2], nn.Linear)
    with pytest.raises(TypeError):
        sparsify_("not a model", blocksize=8, density=0.1)


def test_a_model_on_the_meta_device_is_refused_by_name():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    with pytest.raises(ValueError, match="meta device"):
        sparsify_(model, blocksize=8, density=0.25, force=True)


def test_public_name():
    assert bsrkit.sparsify_ is sparsify_


# -- break-even densities in the tuning table (issue 25) ------------------------------------------------


def test_break_even_reads_the_tuning_table_before_the_defaults(tmp_path, monkeypatch):
    import json

    from bsrkit import break_even, tuning

    table = tmp_path / "tuning.json"
    monkeypatch.setenv(tuning.TABLE_ENV, str(table))
    default = break_even.break_even_density("cpu", (32, 32))
    assert default == break_even.DEFAULTS["cpu"][32]
    key = break_even.table_key(tuning.cpu_device_name(), torch.float32, (32, 32))
    tuning.save_entries({key: {"density": 0.123}}, table)
    assert break_even.break_even_density("cpu", (32, 32)) == 0.123
    assert break_even.break_even_density("cpu", (32, 32), torch.float64) == default  # (another dtype)
    assert json.loads(table.read_text())["entries"][key]["density"] == 0.123
    # sparsify_ follows the table: a density above the measured break-even stays dense
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    summary = sparsify_(model, blocksize=32, density=0.2, filter_fn=lambda m, f: True)
    assert summary.swapped == 0 and "break-even 0.12" in summary.layers[0].reason


@pytest.mark.parametrize("bad", [float("nan"), -0.5, 7.0, True, "0.5"])
def test_a_break_even_entry_out_of_range_is_ignored_with_a_warning(tmp_path, monkeypatch, bad):
    from bsrkit import break_even, tuning

    table = tmp_path / "tuning.json"
    monkeypatch.setenv(tuning.TABLE_ENV, str(table))
    monkeypatch.setattr(tuning, "_warned", set())
    key = break_even.table_key(tuning.cpu_device_name(), torch.float32, (32, 32))
    tuning.save_entries({key: {"density": bad}}, table)
    with pytest.warns(tuning.TuningWarning, match="break-even entry"):
        assert break_even.break_even_density("cpu", (32, 32)) == break_even.DEFAULTS["cpu"][32]


def test_break_even_defaults_by_device_type_and_blocksize():
    from bsrkit import break_even

    assert break_even.break_even_density("cpu", (64, 32)) == break_even.DEFAULTS["cpu"][16 * 2]
    assert break_even.break_even_density("cpu", (8, 8)) == break_even.DEFAULTS["cpu"][16] / 2
    assert break_even.break_even_density("meta", (32, 32)) == 0.0


@pytest.mark.parametrize(
    "ratios, expected",
    [([1.2, 1.5, 2.0], 0.0), ([0.2, 0.6, 1.4], 0.25), ([0.2, 0.5, 0.8], 1.0), ([0.5, 1.0, 1.2], 0.2)],
)
def test_break_even_crossing_interpolates(ratios, expected):
    from bsrkit.break_even import _crossing

    assert _crossing([0.1, 0.2, 0.3], ratios) == pytest.approx(expected)


def test_tune_break_even_writes_an_entry_sparsify_reads(tmp_path, monkeypatch):
    from bsrkit import break_even, cli, tuning

    table = tmp_path / "t.json"
    monkeypatch.setenv(tuning.TABLE_ENV, str(table))
    assert cli.main(["tune", "--break-even", "--sizes", "64", "--blocksizes", "16", "--repeats", "1"]) == 0
    entry = tuning.load_table(table)[break_even.table_key(tuning.cpu_device_name(), torch.float32, (16, 16))]
    assert 0.0 <= entry["density"] <= 1.0 and set(entry["ratios"]) == {"1", "512"}
    assert break_even.break_even_density("cpu", (16, 16)) == entry["density"]


def test_a_module_used_twice_becomes_one_sparse_layer_at_both_places():
    lin = nn.Linear(8, 8)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    bsrkit.sparsify_(model, blocksize=4, density=0.5, force=True)
    assert model[0] is model[2] and type(model[0]).__name__ == "BSRLinear"
    W, b = model[0].to_dense(), model[0].bias
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), torch.relu(x @ W.T + b) @ W.T + b)


def test_layers_tied_to_one_weight_stay_tied():
    """Two modules holding one weight (each with its own bias) share the pruned blocks and pattern: a
    training step moves both, and the summary counts the weight once."""
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    b.weight = a.weight
    model = nn.Sequential(a, nn.ReLU(), b)
    summary = bsrkit.sparsify_(model, blocksize=4, density=0.5, force=True)
    first, second = model[0], model[2]
    assert first is not second and first.values is second.values
    assert first.col_indices is second.col_indices and first.crow_indices is second.crow_indices
    assert first.bias is not second.bias and summary.dense_weights == 64 and summary.stored_weights == 32
    x = torch.randn(3, 8)
    model(x).square().sum().backward()
    W = first.to_dense()
    Wd = W.clone().requires_grad_()
    (torch.relu(x @ Wd.T + first.bias) @ Wd.T + second.bias).square().sum().backward()
    # both uses' gradients, in the one parameter: the dense twin's gradient on the stored blocks
    grad = torch.sparse_bsr_tensor(first.crow_indices, first.col_indices, first.values.grad, size=(8, 8))
    torch.testing.assert_close(grad.to_dense(), Wd.grad * (W != 0))
    assert len(list(model.parameters())) == 3  # values once, two biases


def test_the_default_filter_leaves_layers_a_bsr_linear_cannot_stand_for():
    """nn.MultiheadAttention reads out_proj.weight itself; an nn.Linear subclass with its own forward or
    more state (LoRA) would lose it; a parametrized weight would lose its parametrization. The default
    filter skips them; selecting one explicitly is a ValueError naming it; the model still runs."""

    class LoRALinear(nn.Linear):
        def __init__(self, i, o):
            super().__init__(i, o)
            self.lora_A = nn.Parameter(torch.randn(4, i) * 0.1)

        def forward(self, x):
            return super().forward(x) + (x @ self.lora_A.T).sum(-1, keepdim=True)

    torch.manual_seed(0)
    encoder = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, batch_first=True)
    parts = [
        AttentionBlock(),
        LoRALinear(64, 64),
        nn.utils.parametrizations.weight_norm(nn.Linear(64, 64)),
        encoder,
    ]
    model = nn.Sequential(*parts).eval()
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        before = model(x)
    summary = sparsify_(model, blocksize=16, density=1.0, force=True)
    assert [r.fqn for r in summary.layers] == ["0.mlp"]
    with torch.no_grad():  # (the encoder layer's inference fast path reads linear1.weight itself)
        torch.testing.assert_close(model(x), before)
    for fqn, why in (("0.attn.out_proj", "reads its out_proj.weight"), ("1", "its own forward"),
                     ("2", "parametrized"), ("3.linear1", "TransformerEncoderLayer reads")):  # fmt: skip
        with pytest.raises(ValueError, match=f"selected '{fqn}', which cannot be block-sparse: .*{why}"):
            sparsify_(model, blocksize=16, density=0.5, filter_fn=lambda m, name, fqn=fqn: name == fqn)


def test_a_layer_with_hooks_or_an_instance_forward_stays_dense_and_is_named_when_selected():
    """The swap dropped a layer's forward hooks and pre-hooks (and an instance-level forward, as
    accelerate's hooks set): the model computed something else, silently."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
    )
    model[0].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    model[2].register_forward_hook(lambda m, args, out: out + 1)
    plain = model[3].forward
    model[3].forward = lambda x: plain(x) * 3
    x = torch.randn(4, 32)
    with torch.no_grad():
        before = model(x)
    summary = sparsify_(model, blocksize=8, density=1.0, force=True)
    assert [r.fqn for r in summary.layers] == ["4"]
    with torch.no_grad():
        torch.testing.assert_close(model(x), before)
    scaled = nn.Linear(32, 32)
    scaled.register_buffer("scale", torch.ones(32))  # (extra state, no forward of its own: still refused)
    assert "holding more than weight and bias (scale)" in replacement_problem(scaled, scaled, "")
    for fqn, why in (("0", "forward pre hooks"), ("2", "forward hooks"), ("3", "its own forward")):
        with pytest.raises(ValueError, match=f"selected '{fqn}', which cannot be block-sparse: .*{why}"):
            sparsify_(model, blocksize=8, density=0.5, filter_fn=lambda m, name, fqn=fqn: name == fqn)


def test_a_layer_whose_parent_reads_its_weight_stays_dense():
    """transformers' T5 feed-forward reads ``self.wo.weight.dtype`` in its forward: the swapped layer (no
    weight) failed at the first forward, after sparsify_ had reported success."""

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.wi, self.wo = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x):
            h = torch.relu(self.wi(x))
            return self.wo(h.to(self.wo.weight.dtype))

    torch.manual_seed(0)
    model = FeedForward()
    x = torch.randn(3, 32)
    summary = sparsify_(model, blocksize=16, density=1.0, force=True)
    assert [r.fqn for r in summary.layers] == ["wi"]
    assert model(x).shape == (3, 32)
    with pytest.raises(ValueError, match=r"selected 'wo', .*FeedForward.forward reads its wo.weight itself"):
        sparsify_(model, blocksize=16, density=0.5, filter_fn=lambda m, name: name == "wo")


def test_frozen_layers_stay_frozen():
    """A frozen base model (adapters or a head trained alone): each swapped layer keeps its weight's and
    bias's requires_grad (they became trainable again), nn.Linear and Conv1D alike."""
    torch.manual_seed(0)
    model = TinyLM()
    model.requires_grad_(False)
    model.up.bias.requires_grad_(True)  # (flags taken one by one: a trainable bias stays trainable)
    sparsify_(model, blocksize=8, density=0.5, force=True)
    assert isinstance(model.up, BSRLinear) and isinstance(model.gpt2_proj, BSRLinear)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["up.bias"]


def test_the_swapped_layers_keep_the_models_mode():
    """A model in eval mode (served) gets layers in eval mode, nn.Linear and Conv1D alike (they were in
    training mode); one in training mode gets them in training mode."""
    for training in (False, True):
        torch.manual_seed(0)
        model = TinyLM().train(training)
        sparsify_(model, blocksize=8, density=0.5, force=True)
        assert isinstance(model.up, BSRLinear) and isinstance(model.gpt2_proj, BSRLinear)
        assert {m.training for m in model.modules()} == {training}


def test_a_model_on_meta_runs_without_grad_too():
    """Shapes only, as the dense model on meta gives (it called the CPU product on meta tensors)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    sparsify_(model, blocksize=8, density=0.5, force=True)
    model = model.to("meta")
    x = torch.randn(3, 32, device="meta")
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            y = model(x)
        assert y.shape == (3, 16) and y.is_meta


def test_a_bare_linear_layer_or_a_filter_that_is_not_callable_is_named():
    with pytest.raises(ValueError, match="got a Linear itself"):
        sparsify_(nn.Linear(64, 64), blocksize=16, density=0.25, force=True)
    with pytest.raises(TypeError, match="expected filter_fn to be callable"):
        sparsify_(nn.Sequential(nn.Linear(64, 64)), blocksize=16, density=0.25, filter_fn=3)


def test_a_layer_that_cannot_be_converted_leaves_the_model_unchanged():
    """Every layer is checked and built before any is put in place (as load_sparse)."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 10))
    before = [type(m) for m in model]
    with pytest.raises(ValueError, match="to divide the"):
        sparsify_(
            model, blocksize=4, density=0.25, force=True, filter_fn=lambda m, fqn: isinstance(m, nn.Linear)
        )
    assert [type(m) for m in model] == before
    model[2].weight = nn.Parameter(torch.empty(16, 16, device="meta"))
    with pytest.raises(ValueError, match="meta device"):
        sparsify_(model, blocksize=4, density=0.25, force=True)
    assert [type(m) for m in model] == before


def test_a_selection_holding_one_of_two_tied_layers_is_refused():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    model[2].weight = model[0].weight
    with pytest.raises(ValueError, match="selected '2' but not '0', which shares its weight"):
        sparsify_(model, blocksize=4, density=0.5, force=True, filter_fn=lambda m, fqn: fqn == "2")
    assert isinstance(model[0], nn.Linear) and isinstance(model[2], nn.Linear)
    sparsify_(model, blocksize=4, density=0.5, force=True)
    assert model[0].values is model[2].values


def test_a_selection_holding_one_of_two_layers_sharing_a_bias_is_refused():
    # (the layer made block-sparse got a copy of the bias: the two drifted apart in training, silently)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    model[2].bias = model[0].bias
    with pytest.raises(ValueError, match="selected '0' but not '2', which shares its bias"):
        sparsify_(model, blocksize=4, density=0.5, force=True, filter_fn=lambda m, fqn: fqn == "0")
    assert isinstance(model[0], nn.Linear) and model[0].bias is model[2].bias
    sparsify_(model, blocksize=4, density=0.5, force=True)
    assert model[0].bias is model[2].bias
    # One shared with a non-linear module is named as such (selecting both cannot work there)
    ln = nn.LayerNorm(16)
    linear = nn.Linear(16, 16)
    ln.bias = linear.bias
    with pytest.raises(ValueError, match="its bias is shared with 'ln', a LayerNorm"):
        sparsify_(nn.ModuleDict({"a": linear, "ln": ln}), blocksize=4, density=0.5, force=True,
                  filter_fn=lambda m, fqn: fqn == "a")  # fmt: skip


def test_tied_layers_sharing_their_bias_keep_sharing_it():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    model[2].weight, model[2].bias = model[0].weight, model[0].bias
    sparsify_(model, blocksize=4, density=0.5, force=True)
    assert model[0].values is model[2].values and model[0].bias is model[2].bias


def test_break_even_density_takes_an_int_blocksize_as_sparsify_does():
    assert bsrkit.sparsify.break_even_density("cpu", 32) == bsrkit.sparsify.break_even_density(
        "cpu", (32, 32)
    )
    with pytest.raises(ValueError, match="break_even_density"):
        bsrkit.sparsify.break_even_density("cpu", 0)


def test_every_documented_submodule_is_reachable_from_the_package():
    for name in ("checkpoint", "break_even", "regrow", "repattern", "model_demo", "places", "loading"):
        assert getattr(bsrkit, name).__name__ == f"bsrkit.{name}"


def test_selecting_no_layer_warns_and_changes_nothing():
    """A blocksize dividing no layer (or a filter matching none) left the model dense without a word; it
    warns, naming the filter and the count of linear layers seen."""
    model = nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 12), nn.Linear(12, 4))
    before = copy.deepcopy(model.state_dict())
    with pytest.warns(UserWarning, match=r"default filter \(blocksize 8x8\) selected none of the model's 3"):
        summary = sparsify_(model, blocksize=8, density=0.25, force=True)
    with pytest.warns(UserWarning, match="filter_fn selected none"):
        sparsify_(model, blocksize=4, density=0.25, filter_fn=lambda m, fqn: False)
    assert summary.swapped == 0 and not summary.layers
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
