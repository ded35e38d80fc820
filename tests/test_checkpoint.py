"""Saving and loading sparsified models: safetensors files through save_sparse / load_sparse (the skeleton
on the meta device, never a dense weight), and a plain state_dict through torch.save. The transformers
cases are skipped without transformers; the memory case runs on Linux only (it reads /proc)."""

import functools
import json
import os
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("safetensors")

import bsrkit
from bsrkit.checkpoint import _tensors_to_write, load_sparse, read_sparse_metadata, save_sparse
from bsrkit.nn import BSRLinear
from bsrkit.sparsify import sparsify_
from helpers import run_python


class MLP(nn.Module):
    def __init__(self, width=64, depth=3):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.register_buffer("scale", torch.full((width,), 0.5))  # persistent: in the file
        self.register_buffer("shift", torch.linspace(-1, 1, width), persistent=False)  # built, not stored
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.norm(torch.relu(self.layers(x))) * self.scale + self.shift)


def _sparse_mlp(seed=0, density=0.5):
    torch.manual_seed(seed)
    model = MLP()
    sparsify_(
        model, blocksize=16, density=density, force=True, filter_fn=lambda m, fqn: fqn.startswith("layers.")
    )
    return model.eval()


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


def test_mlp_round_trip_through_safetensors(tmp_path):
    model = _sparse_mlp()
    path = tmp_path / "mlp.safetensors"
    save_sparse(model, path)
    record = read_sparse_metadata(path)
    assert record["layers"]["layers.1"] == {
        "in_features": 64, "out_features": 64, "blocksize": [16, 16], "nnz": 8, "bias": True,
    }  # fmt: skip
    assert set(record["layers"]) == {"layers.0", "layers.1", "layers.2"} and record["tied"] == {}

    built_on_meta = []

    def factory():
        fresh = MLP()
        built_on_meta.append(all(p.device.type == "meta" for p in fresh.parameters()))
        return fresh

    loaded = bsrkit.load_sparse(factory, path).eval()
    assert built_on_meta == [True]
    assert all(isinstance(loaded.layers[i], BSRLinear) for i in range(3))
    assert not any(t.device.type == "meta" for t in [*loaded.parameters(), *loaded.buffers()])
    assert all(p.requires_grad for p in loaded.parameters())
    _assert_same_state(model, loaded)
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    loaded(x).sum().backward()  # (trainable after loading)
    assert loaded.layers[0].values.grad is not None


def test_mlp_loads_into_a_model_built_on_meta_and_casts_dtype(tmp_path):
    model = _sparse_mlp()
    path = tmp_path / "mlp.safetensors"
    save_sparse(model, path)
    with torch.device("meta"):
        skeleton = MLP()
    with pytest.raises(ValueError, match=r"buffers \['shift'\] are on the meta device"):
        load_sparse(skeleton, path)  # (a non-persistent buffer the file cannot hold)

    loaded = load_sparse(MLP, path, dtype=torch.float64)
    assert loaded.layers[0].values.dtype == torch.float64 and loaded.head.weight.dtype == torch.float64
    assert loaded.layers[0].col_indices.dtype == torch.int64
    x = torch.randn(3, 64, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x), model.double()(x))


@pytest.mark.parametrize("density", [0.5, 0.25], ids=["same-nnz", "other-nnz"])
def test_state_dict_round_trips_through_torch_save(tmp_path, density):
    model = _sparse_mlp(seed=0)
    torch.save(model.state_dict(), tmp_path / "mlp.pt")
    fresh = _sparse_mlp(seed=1, density=density)  # another pattern (and nnz): the checkpoint's replaces it
    fresh.load_state_dict(torch.load(tmp_path / "mlp.pt", weights_only=True))
    _assert_same_state(model, fresh)
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


@pytest.mark.parametrize("backend", ["pread", "mmap"])
def test_a_loaded_model_owns_its_memory_and_saves_over_its_own_file(tmp_path, backend, monkeypatch):
    import safetensors

    if backend == "mmap":  # as before safetensors 0.8 (no backend argument): tensors map the file

        def safe_open(*args, backend=None, **kwargs):
            if backend is not None:
                raise TypeError("unexpected keyword argument 'backend'")
            return original(*args, **kwargs)

        original = safetensors.safe_open
        monkeypatch.setattr(safetensors, "safe_open", safe_open)
    torch.manual_seed(0)
    model = MLP().eval()  # (layers.1 keeps no block at all)
    sparsify_(model, blocksize=16, density=0.0, force=True, filter_fn=lambda m, fqn: fqn == "layers.1")
    path = tmp_path / "mlp.safetensors"
    save_sparse(model, path)
    loaded = load_sparse(MLP, path).eval()
    assert loaded.layers[1].values.shape == (0, 16, 16)
    with open(path, "r+b") as f:  # the file rewritten in place: the loaded model must not see it
        f.seek(8 + int.from_bytes(f.read(8), "little"))
        f.write(bytes(os.path.getsize(path) - f.tell()))
    _assert_same_state(model, loaded)
    save_sparse(loaded, path)
    _assert_same_state(model, load_sparse(MLP, path))
    x = torch.randn(2, 64)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


@pytest.mark.parametrize("density", [0.0, 0.5])
def test_tied_block_sparse_layers_load_tied_even_with_no_stored_block(tmp_path, density):
    """An empty tensor has no address of its own: tied layers with no stored block were saved as two
    entries and loaded untied (a later load with blocks, then a step, trained them apart)."""

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    torch.manual_seed(0)
    model = Pair()
    sparsify_(model, blocksize=32, density=density, force=True)
    save_sparse(model, tmp_path / "pair.safetensors")
    assert read_sparse_metadata(tmp_path / "pair.safetensors")["tied"] == {
        "b.values": "a.values",
        "b.crow_indices": "a.crow_indices",
        "b.col_indices": "a.col_indices",
    }
    loaded = load_sparse(Pair, tmp_path / "pair.safetensors")
    assert loaded.a.values is loaded.b.values and loaded.a.col_indices is loaded.b.col_indices
    # Two empty slices of one buffer are not one tensor: not tied.
    buffer = torch.zeros(8)
    _, tied = _tensors_to_write({"x": buffer[:0], "y": buffer[:0], "z": torch.empty(0)})
    assert tied == {}


class _Tied(nn.Module):
    """An embedding, a linear body and an output head tied to the embedding (``tie``)."""

    def __init__(self, tie: bool = True):
        super().__init__()
        self.embed = nn.Embedding(10, 32)
        self.body = nn.Linear(32, 32)
        self.out = nn.Linear(32, 10, bias=False)
        if tie:
            self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(self.body(self.embed(tokens)))


def test_save_sparse_writes_tied_parameters_once(tmp_path):
    Tied = _Tied
    torch.manual_seed(0)
    model = Tied()
    sparsify_(model, blocksize=8, density=0.5, force=True, filter_fn=lambda m, fqn: fqn == "body")
    save_sparse(model, tmp_path / "tied.safetensors")
    assert read_sparse_metadata(tmp_path / "tied.safetensors")["tied"] == {"out.weight": "embed.weight"}
    loaded = load_sparse(Tied, tmp_path / "tied.safetensors")
    assert loaded.out.weight is loaded.embed.weight  # one Parameter again, as in the model saved
    tokens = torch.tensor([[1, 2, 3]])
    assert torch.equal(loaded(tokens), model(tokens))


def test_load_sparse_names_a_tied_entry_of_another_shape_or_a_tensor_of_another_kind(tmp_path):
    """An edited file tying a name to a tensor of another shape, or storing a float tensor as int64, is a
    ValueError naming the entry (torch's RuntimeError escaped from load_state_dict, or the model loaded
    and its forward failed)."""
    import json

    from safetensors.torch import load_file, save_file

    Tied = functools.partial(_Tied, tie=False)
    torch.manual_seed(0)
    model = Tied()
    sparsify_(model, blocksize=8, density=0.5, force=True, filter_fn=lambda m, fqn: fqn == "body")
    path, crafted = tmp_path / "model.safetensors", tmp_path / "crafted.safetensors"
    save_sparse(model, path)
    record, tensors = read_sparse_metadata(path), load_file(path)
    record["tied"] = {"out.weight": "body.bias"}  # (32,) for (10, 32)
    del tensors["out.weight"]
    save_file(tensors, crafted, metadata={"format": "pt", "bsrkit": json.dumps(record)})
    with pytest.raises(ValueError, match=r"ties 'out.weight' to 'body.bias', of shape \(32,\)"):
        load_sparse(Tied, crafted)
    tensors = load_file(path)
    tensors["embed.weight"] = tensors["embed.weight"].long()
    save_file(tensors, crafted, metadata={"format": "pt", "bsrkit": json.dumps(read_sparse_metadata(path))})
    with pytest.raises(ValueError, match=r"embed.weight: expected .* kind 'floating' .* got torch.int64"):
        load_sparse(Tied, crafted)
    tensors = load_file(path)
    tensors["body.col_indices"] = tensors["body.col_indices"].float()
    save_file(tensors, crafted, metadata={"format": "pt", "bsrkit": json.dumps(read_sparse_metadata(path))})
    with pytest.raises(ValueError, match=r"body.col_indices: expected a tensor of dtype kind 'integer'"):
        load_sparse(Tied, crafted)


def test_sparse_layers_sharing_one_weight_load_sharing_it(tmp_path):
    """Tied linear layers share their blocks after sparsify_; the file holds them once and loading ties
    the layers' blocks and pattern again."""

    class TwoUses(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    model = TwoUses()
    sparsify_(model, blocksize=8, density=0.5, force=True)
    save_sparse(model, tmp_path / "two.safetensors")
    assert read_sparse_metadata(tmp_path / "two.safetensors")["tied"]["b.values"] == "a.values"
    loaded = load_sparse(TwoUses, tmp_path / "two.safetensors")
    assert loaded.a.values is loaded.b.values and loaded.a.bias is not loaded.b.bias
    assert loaded.a.crow_indices is loaded.b.crow_indices and loaded.a.col_indices is loaded.b.col_indices
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    # A new pattern loaded through one layer is the other's too (as for the model sparsify_ made).
    new = BSRLinear(16, 16, 8, density=0.5, generator=torch.Generator().manual_seed(4))
    assert not torch.equal(new.crow_indices, loaded.a.crow_indices)
    loaded.a.load_state_dict(new.state_dict())
    torch.testing.assert_close(loaded.b.to_dense(), new.to_dense(), rtol=0, atol=0)


def test_save_sparse_refuses_a_bare_layer_by_name(tmp_path):
    layer = BSRLinear(64, 32, 16, density=0.5)
    with pytest.raises(ValueError, match="got a BSRLinear itself"):
        save_sparse(layer, tmp_path / "layer.safetensors")
    assert not (tmp_path / "layer.safetensors").exists()


def test_a_module_used_at_two_places_loads_as_one_layer_at_both(tmp_path):
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 16)
            self.b = self.a

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    model = Twice()
    sparsify_(model, blocksize=8, density=0.5, force=True)
    save_sparse(model, tmp_path / "twice.safetensors")
    loaded = load_sparse(Twice, tmp_path / "twice.safetensors")
    assert loaded.a is loaded.b and isinstance(loaded.a, BSRLinear)
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


# -- files that do not match ------------------------------------------------------------------------------


def test_errors_name_what_does_not_match(tmp_path):
    from safetensors.torch import save_file

    model = _sparse_mlp()
    path = tmp_path / "mlp.safetensors"
    save_sparse(model, path)

    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="expected path to be a safetensors file"):
        load_sparse(MLP, junk)
    plain = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2)}, plain, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"expected a bsrkit checkpoint .* metadata keys \['format'\]"):
        load_sparse(MLP, plain)
    with pytest.raises(ValueError, match=r"block-sparse layer 'layers.2' is not in the model"):
        load_sparse(lambda: MLP(depth=2), path)
    with pytest.raises(
        ValueError, match=r"'layers.0' to have \(out, in\) features \(64, 64\) .* got \(64, 32\)"
    ):
        load_sparse(lambda: _with_layer(MLP(), "layers.0", nn.Linear(32, 64)), path)
    with pytest.raises(ValueError, match=r"'layers.0' to be a linear layer .* got ReLU"):
        load_sparse(lambda: _with_layer(MLP(), "layers.0", nn.ReLU()), path)
    with pytest.raises(ValueError, match=r"head.weight: expected shape \(12, 64\), got \(10, 64\)"):
        load_sparse(lambda: _with_layer(MLP(), "head", nn.Linear(64, 12)), path)
    with pytest.raises(ValueError, match=r"not in the model: \['head.bias'\]"):
        load_sparse(lambda: _with_layer(MLP(), "head", nn.Linear(64, 10, bias=False)), path)
    with pytest.raises(
        ValueError, match=r"in the model, not in the file: \['extra.weight', 'extra.bias'\]; .*: \[\]"
    ):
        load_sparse(lambda: _with_layer(MLP(), "extra", nn.Linear(4, 4)), path)
    with pytest.raises(ValueError, match="reserved"):
        save_sparse(model, tmp_path / "other.safetensors", metadata={"bsrkit": "{}"})
    with pytest.raises(ValueError, match="'format' is reserved"):  # (it was overwritten with 'pt')
        save_sparse(model, tmp_path / "other.safetensors", metadata={"format": "mine"})
    import json

    from safetensors.torch import load_file

    record = read_sparse_metadata(path)
    del record["layers"]["layers.0"]["nnz"]
    crafted = tmp_path / "crafted.safetensors"
    save_file(load_file(path), crafted, metadata={"format": "pt", "bsrkit": json.dumps(record)})
    with pytest.raises(ValueError, match=r"layer 'layers.0' lacks \['nnz'\]"):  # (a raw KeyError)
        load_sparse(MLP, crafted)
    # A recorded buffer dtype that is not floating (an edited file: the buffer became int64 silently), and
    # a dtype the products cannot run (float8 loaded, then every forward failed).
    record = read_sparse_metadata(path)
    record["buffer_dtypes"] = {"scale": "int64"}
    save_file(load_file(path), crafted, metadata={"format": "pt", "bsrkit": json.dumps(record)})
    with pytest.raises(ValueError, match=r"buffer 'scale' has no floating dtype 'int64'"):
        load_sparse(MLP, crafted)
    with pytest.raises(ValueError, match=r"expected dtype in \(torch.float32"):
        load_sparse(MLP, path, dtype=torch.float8_e4m3fn)
    record = read_sparse_metadata(path)
    record["layers"]["layers.0"]["blocksize"] = [48, 16]
    save_file(load_file(path), crafted, metadata={"format": "pt", "bsrkit": json.dumps(record)})
    with pytest.raises(
        ValueError, match=r"layer 'layers.0' records blocksize \(48, 16\), which does not divide"
    ):
        load_sparse(MLP, crafted)
    with pytest.raises(ValueError, match="expected path to be a safetensors file, got the directory"):
        load_sparse(MLP, tmp_path)
    for device in ("cpu:0", torch.device("cpu", 0)):  # (valid torch devices safetensors refused)
        loaded = load_sparse(MLP, path, device=device)
        assert torch.equal(loaded.layers[0].values, model.layers[0].values)


def _with_layer(model, fqn, layer):
    parent, _, name = fqn.rpartition(".")
    setattr(model.get_submodule(parent), name, layer)
    return model


# -- memory ------------------------------------------------------------------------------------------------

_WRITE = """
import sys, torch
from torch import nn
from bsrkit.checkpoint import save_sparse
from bsrkit.sparsify import sparsify_
torch.manual_seed(0)
for width, density, path in ((128, 0.5, sys.argv[2]), (2048, 0.1, sys.argv[1])):
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(12)])
    sparsify_(model, blocksize=64, density=density, force=True)
    save_sparse(model, path)
"""

_LOAD = """
import json, sys, torch
from torch import nn
from bsrkit.checkpoint import load_sparse

def status():
    with open("/proc/self/status") as f:
        return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f if l.startswith(("Vm", "RssAnon"))}

def mlp(width):
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(12)])

load_sparse(lambda: mlp(128), sys.argv[2])  # (runs the code paths once: their pages are not the checkpoint)
try:  # reset VmHWM, the peak RSS of this process's memory (not ru_maxrss: it counts the parent's at fork)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
before = status()
model = load_sparse(lambda: mlp(2048), sys.argv[1])
after = status()
print(json.dumps({
    "peak_growth": after["VmHWM"] - before["VmRSS"], "anon_growth": after["RssAnon"] - before["RssAnon"],
    "stored": sum(t.nbytes for t in model.state_dict().values()),
    "on_meta": any(t.is_meta for t in model.state_dict().values()),
}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_loading_never_materialises_the_dense_weights(tmp_path):
    # 12 layers 2048 x 2048 float32: 201 MB dense (16.8 MB the largest layer); at density 0.1 the file is
    # 20 MB. The peak of the loading process's RSS may grow by the file plus one dense layer at most.
    big, small = tmp_path / "big.safetensors", tmp_path / "small.safetensors"
    code = ["-c", _WRITE, big, small]
    run_python(code, timeout=120)
    report = run_python(["-c", _LOAD, big, small], timeout=120).json()
    file_size, largest_dense = os.path.getsize(big), 2048 * 2048 * 4 + 2048 * 4
    assert not report["on_meta"] and report["stored"] <= file_size
    margin = 8 << 20  # (allocator and interpreter noise)
    assert report["peak_growth"] <= file_size + largest_dense + margin, json.dumps(report)
    assert report["anon_growth"] <= file_size + margin, json.dumps(report)


# -- transformers ------------------------------------------------------------------------------------------


def _hf_model(kind, tie):
    transformers = pytest.importorskip("transformers")
    if kind == "llama":
        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=100, tie_word_embeddings=tie,
        )  # fmt: skip
    else:  # GPT-2: Conv1D layers, learned positions
        config = transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=64, tie_word_embeddings=tie
        )
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    ("kind", "tie"), [("llama", True), ("llama", False), ("gpt2", True)], ids=["llama-tied", "llama", "gpt2"]
)
def test_transformers_model_round_trip(tmp_path, kind, tie):
    torch.manual_seed(0)
    model = _hf_model(kind, tie).eval()
    summary = sparsify_(model, blocksize=16, density=0.5, force=True)
    assert summary.swapped == len(summary.layers) > 0
    path = tmp_path / "model.safetensors"
    save_sparse(model, path)
    tied = read_sparse_metadata(path)["tied"]
    assert tied == ({"lm_head.weight": "model.embed_tokens.weight"} if kind == "llama" else {
        "lm_head.weight": "transformer.wte.weight"
    }) if tie else tied == {}  # fmt: skip

    loaded = load_sparse(lambda: _hf_model(kind, tie), path).eval()
    assert isinstance(loaded.lm_head, nn.Linear)  # (the output head stays dense)
    assert (loaded.lm_head.weight is loaded.get_input_embeddings().weight) == tie
    assert sum(isinstance(m, BSRLinear) for m in loaded.modules()) == summary.swapped
    _assert_same_state(model, loaded)
    for (name, a), (_, b) in zip(model.named_buffers(), loaded.named_buffers(), strict=True):
        assert torch.equal(a, b), name  # (non-persistent ones too: rotary inv_freq)
    tokens = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


def test_transformers_model_built_on_meta(tmp_path):
    torch.manual_seed(0)
    model = _hf_model("llama", True).eval()
    sparsify_(model, blocksize=16, density=0.5, force=True)
    save_sparse(model, tmp_path / "model.safetensors")
    with torch.device("meta"):
        skeleton = _hf_model("llama", True)
    # (its rotary buffers are recomputed on load, as transformers' from_pretrained does)
    loaded = load_sparse(skeleton, tmp_path / "model.safetensors").eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    tokens = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, "float32", torch.complex64])
def test_load_sparse_names_a_dtype_that_is_not_floating(tmp_path, dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    sparsify_(model, blocksize=8, density=0.5, force=True)
    save_sparse(model, tmp_path / "m.safetensors")
    with pytest.raises(
        TypeError, match="load_sparse\\(\\): expected dtype to be a floating-point torch.dtype"
    ):
        load_sparse(model, tmp_path / "m.safetensors", dtype=dtype)


class _WithPositions(nn.Module):
    """A model with a computed (non-persistent) floating buffer, as sinusoidal positions are."""

    def __init__(self):
        super().__init__()
        self.register_buffer("pe", torch.linspace(0, 1, 32), persistent=False)
        self.up = nn.Linear(32, 32)

    def forward(self, x):
        return self.up(x + self.pe)


@pytest.mark.parametrize("convert", ["dtype", "saved_half"])
def test_computed_buffers_take_the_loaded_models_dtype(tmp_path, convert):
    model = _WithPositions()
    sparsify_(model, blocksize=8, density=0.5, force=True)
    if convert == "saved_half":
        model.half()
    save_sparse(model, tmp_path / "m.safetensors")
    dtype = torch.bfloat16 if convert == "dtype" else None
    served = load_sparse(_WithPositions, tmp_path / "m.safetensors", dtype=dtype)
    want = dtype or torch.float16
    assert served.pe.dtype == want and served.up.values.dtype == want
    assert served(torch.randn(2, 32, dtype=want)).dtype == want


def test_state_that_is_not_a_tensor_is_refused_by_name(tmp_path):
    class WithExtra(nn.Linear):
        def get_extra_state(self):
            return {"step": 3}

        def set_extra_state(self, state):
            pass

    model = nn.Sequential(WithExtra(8, 8))
    with pytest.raises(ValueError, match=r"expected only tensors.*'0._extra_state'.*dict"):
        save_sparse(model, tmp_path / "m.safetensors")


def test_a_meta_model_whose_init_weights_leaves_a_buffer_unwritten_is_refused(tmp_path):
    class Rotary(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", 10.0 ** -torch.arange(4.0), persistent=False)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.rot, self.up = Rotary(), nn.Linear(8, 8)

        def _init_weights(self, module):  # (initialises the linear layers only, as nanoGPT's)
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight)

    model = Model()
    sparsify_(model, blocksize=4, density=0.5, force=True)
    save_sparse(model, tmp_path / "m.safetensors")
    with torch.device("meta"):
        shell = Model()
    with pytest.raises(ValueError, match=r"\['rot.inv_freq'\].*did not compute them"):
        load_sparse(shell, tmp_path / "m.safetensors")


def test_malformed_records_and_devices_are_refused_by_name(tmp_path):
    model, path = _sparse_mlp(), tmp_path / "m.safetensors"
    save_sparse(model, path)
    with pytest.raises(ValueError, match="expected device to be a device that holds data"):
        load_sparse(_sparse_mlp(), path, device="meta")
    from safetensors.torch import load_file, save_file

    record = read_sparse_metadata(path)
    for change, match in (
        (lambda r: r.pop("tied"), "expected 'tied' to map names to names"),
        (
            lambda r: next(iter(r["layers"].values())).update(blocksize=16),
            "malformed \\['blocksize'\\]: \\[16\\]",
        ),
        (lambda r: next(iter(r["layers"].values())).update(nnz=-1), "malformed \\['nnz'\\]"),
    ):
        bad = json.loads(json.dumps(record))
        change(bad)
        save_file(
            load_file(path),
            tmp_path / "bad.safetensors",
            metadata={"format": "pt", "bsrkit": json.dumps(bad)},
        )
        with pytest.raises(ValueError, match=match):
            load_sparse(_sparse_mlp(), tmp_path / "bad.safetensors")


def test_a_buffer_kept_apart_from_the_models_dtype_keeps_its_own_under_dtype(tmp_path):
    """float32 frequencies in a bfloat16 model (as from_pretrained(dtype=bfloat16) leaves rotary
    inv_freq): load_sparse(dtype=bfloat16) keeps them float32, so the loaded model computes as the saved
    one (they were cast to bfloat16); a buffer that had the model's dtype follows dtype."""
    model = _WithPositions()
    sparsify_(model, blocksize=8, density=0.5, force=True)
    model.to(torch.bfloat16)
    model.pe = _WithPositions().pe  # (computed in float32, as the model computes it)
    save_sparse(model, tmp_path / "m.safetensors")
    served = load_sparse(_WithPositions, tmp_path / "m.safetensors", dtype=torch.bfloat16)
    assert served.pe.dtype == torch.float32 and served.up.values.dtype == torch.bfloat16
    assert torch.equal(served.pe, model.pe)  # (not rounded to bfloat16)
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    assert torch.equal(served.up(x), model.up(x))


class _Positions(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("position_ids", torch.arange(8), persistent=False)
        self.register_buffer("valid", torch.ones(8, dtype=torch.bool), persistent=False)


def _saved_and_built_on_meta(tmp_path, make):
    """A model of ``make()`` sparsified and saved to ``tmp_path / "m.safetensors"``, and a second one built
    on meta to load it into."""
    torch.manual_seed(0)
    model = make()
    sparsify_(model, blocksize=4, density=0.5, force=True)
    save_sparse(model, tmp_path / "m.safetensors")
    with torch.device("meta"):
        shell = make()
    return model, shell


class _PositionsModel(nn.Module):  # (the tests give it an _init_weights of their own)
    def __init__(self):
        super().__init__()
        self.pos, self.up = _Positions(), nn.Linear(8, 8)

    def forward(self, x):
        return self.up(x + self.pos.position_ids * self.pos.valid)


@pytest.mark.parametrize("computes", [True, False])
def test_a_meta_model_computing_integer_buffers_in_init_weights_loads(tmp_path, computes):
    """transformers computes integer buffers (BERT's position_ids) in _init_weights: a model built on meta
    loads with them (a regression refused every model holding one); an _init_weights leaving one
    unwritten is refused by name, never uninitialised memory."""

    class Model(_PositionsModel):
        def _init_weights(self, module):
            if isinstance(module, _Positions):
                module.position_ids.copy_(torch.arange(8))
                if computes:
                    module.valid.fill_(True)

    model, shell = _saved_and_built_on_meta(tmp_path, Model)
    if not computes:
        with pytest.raises(ValueError, match=r"\['pos.valid'\].*did not compute them"):
            load_sparse(shell, tmp_path / "m.safetensors")
        return
    loaded = load_sparse(shell, tmp_path / "m.safetensors")
    assert torch.equal(loaded.pos.position_ids, torch.arange(8)) and bool(loaded.pos.valid.all())
    x = torch.randn(3, 8)
    assert torch.equal(loaded(x), model(x))


class _ScaledEmbedding(nn.Embedding):  # (Gemma's: a weight of its own, and a computed scale)
    def __init__(self):
        super().__init__(10, 8)
        self.register_buffer("scale", torch.tensor(8**0.5), persistent=False)


def test_a_meta_model_whose_init_weights_computes_a_buffer_beside_a_weight_loads(tmp_path):
    """Gemma's embedding holds its weight and a non-persistent scale its _init_weights computes: a model
    built on meta loads (it was refused, saying _init_weights did not compute the scale), with the weight
    from the file, not _init_weights' draw."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.up = _ScaledEmbedding(), nn.Linear(8, 8)

        def _init_weights(self, module):
            if isinstance(module, _ScaledEmbedding):
                module.weight.normal_()
                module.scale.fill_(8**0.5)

        def forward(self, ids):
            return self.up(self.embed(ids) * self.embed.scale)

    model, shell = _saved_and_built_on_meta(tmp_path, Model)
    loaded = load_sparse(shell, tmp_path / "m.safetensors")
    assert torch.equal(loaded.embed.weight, model.embed.weight)
    ids = torch.arange(10)
    assert torch.equal(loaded(ids), model(ids))


def test_an_init_weights_that_raises_is_named_as_the_cause(tmp_path):
    """An _init_weights failing on meta (a bug in it, or weights it cannot write there) is the refusal's
    named cause: it was swallowed, and the refusal said it computed nothing."""

    class Model(_PositionsModel):
        def _init_weights(self, module):
            if isinstance(module, _Positions):
                raise AttributeError("'Model' object has no attribute 'config'")

    _, shell = _saved_and_built_on_meta(tmp_path, Model)
    with pytest.raises(
        ValueError, match=r"_init_weights \(if any\) raised AttributeError: 'Model' object"
    ) as info:
        load_sparse(shell, tmp_path / "m.safetensors")
    assert isinstance(info.value.__cause__, AttributeError)


@pytest.mark.parametrize("on_meta", [False, True])
def test_a_model_in_eval_mode_loads_in_eval_mode(tmp_path, on_meta):
    """The swapped-in layers take the mode of the layers they replace (they came back in training mode
    beside the model's other modules in eval mode)."""

    def make():
        return nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1), nn.Linear(16, 16)).eval()

    _, shell = _saved_and_built_on_meta(tmp_path, make)
    loaded = load_sparse(shell if on_meta else make, tmp_path / "m.safetensors")
    assert isinstance(loaded[0], BSRLinear) and {m.training for m in loaded.modules()} == {False}


def test_an_init_weights_writing_a_childs_weights_never_overwrites_loaded_ones(tmp_path):
    """GPT-2's attention module (transformers 4.x) holds no parameters of its own, non-persistent bool and
    float buffers, and an _init_weights that re-draws a child's weight: it ran after the file's tensors
    were assigned, so the loaded model had a random c_proj (outputs off by 0.6). It runs while the
    parameters are still on meta."""

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn, self.c_proj = nn.Linear(16, 16), nn.Linear(16, 16)
            self.register_buffer("bias", torch.tril(torch.ones(4, 4, dtype=torch.bool)), persistent=False)
            self.register_buffer("masked_bias", torch.tensor(-1e4), persistent=False)

        def forward(self, x):
            return self.c_proj(torch.relu(self.c_attn(x))) + self.masked_bias * 0 + self.bias.sum()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attn()

        def _init_weights(self, module):
            if isinstance(module, Attn):
                module.bias = torch.tril(torch.ones(4, 4, dtype=torch.bool))
                module.masked_bias = torch.tensor(-1e4)
            for name, p in module.named_parameters():
                if name == "c_proj.weight":
                    p.data.normal_(0, 0.02)

        def forward(self, x):
            return self.attn(x)

    torch.manual_seed(0)
    model = Model()
    sparsify_(model, blocksize=4, density=0.5, force=True, filter_fn=lambda m, fqn: fqn == "attn.c_attn")
    save_sparse(model, tmp_path / "m.safetensors")
    with torch.device("meta"):
        shell = Model()
    loaded = load_sparse(shell, tmp_path / "m.safetensors")
    assert torch.equal(loaded.attn.c_proj.weight, model.attn.c_proj.weight)
    x = torch.randn(3, 16)
    assert torch.equal(loaded(x), model(x))


def test_load_sparse_of_a_path_naming_nothing_is_file_not_found(tmp_path):
    """As ``open`` and ``torch.load`` (it was a ValueError)."""
    model = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(
        FileNotFoundError, match=r"load_sparse\(\): expected path to name a file, got .*absent"
    ):
        load_sparse(model, tmp_path / "absent.safetensors")
    # (read_sparse_metadata's own errors name it: they said load_sparse())
    with pytest.raises(FileNotFoundError, match=r"^read_sparse_metadata\(\): .*absent"):
        read_sparse_metadata(tmp_path / "absent.safetensors")
    with pytest.raises(ValueError, match=r"^read_sparse_metadata\(\): .* got the directory"):
        read_sparse_metadata(tmp_path)


def test_save_sparse_to_a_directory_names_it(tmp_path):
    model = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(ValueError, match=r"save_sparse\(\): expected path to name a file, got the dir"):
        save_sparse(model, tmp_path)  # (safetensors' own error, naming no path, escaped)
