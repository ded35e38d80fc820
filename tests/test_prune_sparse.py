"""GradualPruner training on block-sparse products (BSRLinear layers whose pattern shrinks or changes) and
RigL regrowth, against a masked-dense reference run: same init, same data, same masks, in float64."""

import copy
import gc
import itertools
import os
import resource
import warnings

import pytest
import torch
from torch import nn

import bsrkit
from bsrkit.nn import BSRLinear
from bsrkit.prune import GradualPruner, RigL
from bsrkit.regrow import drop_and_grow
from bsrkit.repattern import block_view, expand
from bsrkit.sparsify import break_even_density
from helpers import AttentionBlock, backends

BS = (8, 8)


class _Wrapped:
    """An optimizer wrapper of accelerate's AcceleratedOptimizer's shape (not a torch.optim.Optimizer)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)

    def step(self):
        self.optimizer.step()


def _model(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    layers = [nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)]
    return nn.Sequential(*layers).to(dtype)


def _batch(step, dtype=torch.float64):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g).to(dtype), torch.randn(8, 8, generator=g).to(dtype)


def _pruner(model, opt, **kwargs):
    settings = dict(blocksize=8, target_density=0.25, start_step=0, end_step=6, every=1, sparse_below=1.0,
                    regrow=RigL(fraction=0.3, every=2, decay="constant"))  # fmt: skip
    return GradualPruner(model, opt, **{**settings, **kwargs})


def _dense(module, mask, stored):
    """What ``stored`` (a layer's weight, gradient or state tensor) holds as a dense (out, in) tensor."""
    if not isinstance(module, BSRLinear):
        return stored
    full = stored.new_zeros((mask.shape[0] * BS[0], mask.shape[1] * BS[1]))
    block_view(full, BS)[mask] = stored
    return full


def _weight(module):
    return module.values if isinstance(module, BSRLinear) else module.weight


def _record_pruned(pruner):
    """A dict that each step's regrowth fills with the masks it starts from (the step's pruning done)."""
    pruned, regrow = {}, pruner._regrow

    def recording(layer, mask, grad):
        pruned[layer.fqn] = mask.clone()
        return regrow(layer, mask, grad)

    pruner._regrow = recording
    return pruned


def _reference_masks(twin, opt_twin, old, new, pruned=None):
    """The masked-dense reference after a step: a block kept through the step's pruning (``pruned``, the
    masks between it and the regrowth) and regrowth keeps its weights and moments, every other block
    (removed, or regrown: it starts at zero, also where the pruning removed it just before) is zero."""
    with torch.no_grad():
        for name in new:
            keep = expand(old[name] & new[name] & (pruned or {}).get(name, new[name]), BS)
            w = twin.get_submodule(name).weight
            w.mul_(keep)
            for v in opt_twin.state[w].values():
                if v.shape == w.shape:
                    v.mul_(keep)


def _compare(model, opt, twin, opt_twin, masks, tol=1e-12):
    for name, mask in masks.items():
        module, ref = model.get_submodule(name), twin.get_submodule(name)
        w = _weight(module)
        assert any(w is p for g in opt.param_groups for p in g["params"]), name  # the optimizer follows
        torch.testing.assert_close(_dense(module, mask, w.detach()), ref.weight.detach(), rtol=0, atol=tol)
        expected = opt_twin.state[ref.weight]
        shaped = [k for k, v in expected.items() if v.shape == ref.weight.shape]
        assert shaped and set(opt.state[w]) == set(expected)
        for key in shaped:  # Adam's moments (and amsgrad's maximum), SGD's momentum
            got = _dense(module, mask, opt.state[w][key])
            torch.testing.assert_close(got, expected[key], rtol=0, atol=tol, msg=key)


OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adamw_amsgrad": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=1e-1, momentum=0.9),
}


RUNS = [
    ("magnitude", "adam"),
    ("movement", "adam"),
    ("magnitude", "adamw_amsgrad"),
    ("magnitude", "sgd_momentum"),
]


@pytest.mark.parametrize("criterion, optimizer", RUNS)
def test_block_sparse_training_equals_the_masked_dense_reference(criterion, optimizer):
    """Weights and optimizer state (Adam's moments, SGD's momentum) of the block-sparse run equal the
    masked-dense reference's after every step: through the swap to BSRLinear, shrinking patterns and
    regrowth (kept blocks keep their state, removed ones lose it, regrown ones start at zero)."""
    model = _model(1)
    twin = copy.deepcopy(model)
    opt = OPTIMIZERS[optimizer](model.parameters())
    opt_twin = OPTIMIZERS[optimizer](twin.parameters())
    pruner = _pruner(model, opt, criterion=criterion, end_step=8)
    pruned = _record_pruned(pruner)
    shrinks = regrowths = 0
    for step in range(16):
        x, y = _batch(step)
        losses = []
        for m, o in ((model, opt), (twin, opt_twin)):
            loss = nn.functional.mse_loss(m(x), y)
            o.zero_grad()
            loss.backward()
            o.step()
            losses.append(loss.item())
        old = pruner.masks()
        pruned.clear()
        pruner.step()
        new = pruner.masks()
        _reference_masks(twin, opt_twin, old, new, pruned)
        assert losses[0] == pytest.approx(losses[1], abs=1e-12)
        _compare(model, opt, twin, opt_twin, new)
        shrinks += any(int(new[n].sum()) < int(old[n].sum()) for n in new)
        grown = {n: new[n] & ~old[n] for n in new}
        regrowths += any(g.any() for g in grown.values())
        for name, g in grown.items():  # a regrown block starts at zero weight and zero moments
            module = model.get_submodule(name)
            stored = g[new[name]]
            assert (module.values[stored] == 0).all()
            state = opt.state[module.values]
            assert all((v[stored] == 0).all() for v in state.values() if v.shape == module.values.shape)
    assert shrinks >= 5 and regrowths >= 3
    assert pruner.sparse_layers() == ["0", "2", "4"]
    assert all(isinstance(model[i], BSRLinear) for i in (0, 2, 4))
    assert all(d == pytest.approx(0.25) for d in pruner.densities().values())


@pytest.mark.parametrize("backend", backends("cpu", "torch", "triton"), indirect=True)
def test_every_steps_gradients_equal_the_masked_dense_models(backend):
    """The gradients of the values, the biases and the input x equal the masked-dense model's at the kept
    blocks, at every step of a schedule with more than 5 pattern changes (shrinking, then regrowth)."""
    model = _model(2)
    twin = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt_twin = torch.optim.Adam(twin.parameters(), lr=1e-2)
    pruner = _pruner(model, opt, end_step=4, regrow=RigL(fraction=0.5, every=1, decay="constant"))
    pruned = _record_pruned(pruner)
    changes = 0
    for step in range(9):
        x, y = _batch(step)
        grads = []
        for m, o in ((model, opt), (twin, opt_twin)):
            xg = x.clone().requires_grad_()
            loss = nn.functional.mse_loss(m(xg), y)
            o.zero_grad()
            loss.backward()
            grads.append(xg.grad)
        torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)
        for name, mask in pruner.masks().items():
            module, ref = model.get_submodule(name), twin.get_submodule(name)
            ref_grad = ref.weight.grad * expand(mask, BS)  # the masked model's gradient
            got = _dense(module, mask, _weight(module).grad)
            torch.testing.assert_close(got, ref_grad, rtol=0, atol=1e-12, msg=name)
            torch.testing.assert_close(module.bias.grad, ref.bias.grad, rtol=0, atol=1e-12)
        opt.step()
        opt_twin.step()
        old = pruner.masks()
        pruned.clear()
        pruner.step()
        new = pruner.masks()
        _reference_masks(twin, opt_twin, old, new, pruned)
        changes += not torch.equal(old["2"], new["2"])
    assert changes >= 5
    assert pruner.sparse_layers() == ["0", "2", "4"]


@pytest.mark.parametrize("criterion", ["magnitude", "movement"])
def test_sparse_and_masked_dense_runs_choose_the_same_patterns(criterion):
    """The pruner's own masked-dense mode (sparse_below=None) and its block-sparse mode make the same
    choices: the movement scores and the dense gradient RigL grows by (summed over two micro-batches)
    are the same either way."""
    runs = []
    for sparse_below in (1.0, None):
        model = _model(3)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        pruner = _pruner(model, opt, criterion=criterion, sparse_below=sparse_below,
                         regrow=RigL(fraction=0.4, every=3, until=15))  # fmt: skip
        history = []
        for step in range(18):
            x, y = _batch(step)
            opt.zero_grad()
            for half in (slice(0, 4), slice(4, 8)):
                nn.functional.mse_loss(model(x[half]), y[half]).backward()
            opt.step()
            pruner.step()
            history.append(pruner.masks())
        runs.append((model, history, pruner))
    (sparse, h1, p1), (dense, h2, p2) = runs
    assert p1.sparse_layers() == ["0", "2", "4"] and p2.sparse_layers() == []
    for a, b in zip(h1, h2, strict=True):
        assert all(torch.equal(a[n], b[n]) for n in a)
    grown = sum(bool((b[n] & ~a[n]).any()) for a, b in itertools.pairwise(h1) for n in a)
    assert grown >= 3
    for name, mask in h1[-1].items():
        got = _dense(sparse.get_submodule(name), mask, _weight(sparse.get_submodule(name)).detach())
        torch.testing.assert_close(got, dense.get_submodule(name).weight.detach(), rtol=0, atol=1e-12)


def _same_rigl_patterns(seed, steps, train):
    """Run RigL block-sparse and masked dense, each step's training done by ``train(model, opt, x, y)``;
    assert both chose the same patterns, some of them grown."""
    runs = []
    for sparse_below in (1.0, None):
        model = _model(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pruner = _pruner(
            model, opt, sparse_below=sparse_below, regrow=RigL(fraction=0.5, every=2, until=steps)
        )
        history = []
        for step in range(steps):
            train(model, opt, *_batch(step))
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                pruner.step()
            history.append(pruner.masks())
        runs.append(history)
    for a, b in zip(*runs, strict=True):
        assert all(torch.equal(a[n], b[n]) for n in a)
    assert sum(bool((b[n] & ~a[n]).any()) for a, b in itertools.pairwise(runs[0]) for n in a) >= 2


def test_rigl_grows_by_the_training_gradient_only_whatever_else_runs_backward():
    """A gradient with respect to the input (adversarial training, saliency) computes no weight gradient:
    a masked-dense layer's weight hook saw none, while a block-sparse layer's output hook added it to the
    gradient it grows by (norm ~1e4 against ~0.5), and the two runs chose other patterns."""

    def train(model, opt, x, y):
        x.requires_grad_()
        torch.autograd.grad(model(x).sum() * 1000, x)
        model(x).sum().backward(inputs=[x])  # (the same, through backward's inputs)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    _same_rigl_patterns(5, 12, train)


def test_rigl_warns_when_a_sparse_layers_dense_gradient_was_not_recorded():
    """A torch.compile'd graph traced without the layer's hooks left its pattern as it was, silently."""
    model = _model(6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pruner = _pruner(
        model, opt, regrow=RigL(fraction=0.5, every=2, decay="constant"), start_step=0, end_step=1
    )
    x, y = _batch(0)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    pruner.step()  # (sparse now; the next step ends in an update)
    layer = next(layer for layer in pruner._layers if layer.fqn == "2")
    layer.capture._handle.remove()  # (as a graph traced without the forward hook)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    before = pruner.masks()["2"]
    with pytest.warns(
        RuntimeWarning, match="layer '2' recorded no dense gradient .*skip_nnmodule_hook_guards"
    ):
        pruner.step()
    assert torch.equal(pruner.masks()["2"], before)


def test_rigl_takes_gradients_returned_by_autograd_grad_and_warns_about_no_skipped_layer():
    """torch.autograd.grad with respect to the parameters (then assigned as .grad): torch's test of the
    weight's gradient node raised for a leaf it returns. A layer the update step skipped (zero_grad with
    set_to_none=False) was warned about as if its hook had not run."""

    def train(model, opt, x, y):
        params = [p for p in model.parameters() if p.requires_grad]
        opt.zero_grad(set_to_none=False)
        grads = torch.autograd.grad(nn.functional.mse_loss(model(x), y), params)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()

    _same_rigl_patterns(8, 8, train)
    model = _model(9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pruner = _pruner(
        model, opt, regrow=RigL(fraction=0.5, every=2, decay="constant"), start_step=0, end_step=1
    )
    for step in range(4):  # (step 1, an update step, skips layer 2)
        x, y = _batch(step)
        opt.zero_grad(set_to_none=False)
        h = model[1](model[0](x))
        if step != 1:
            h = model[3](model[2](h))
        nn.functional.mse_loss(model[4](h), y).backward()
        opt.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            pruner.step()


def test_an_optimizer_naming_its_parameters_names_the_swapped_ones():
    model = _model(7)
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-2)
    pruner = _pruner(model, opt, start_step=0, end_step=1)
    x, y = _batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    pruner.step()
    group = opt.param_groups[0]
    names = {id(p): n for n, p in model.named_parameters()}
    assert group["param_names"] == [names[id(p)] for p in group["params"]]
    assert "0.values" in group["param_names"] and "0.weight" not in group["param_names"]
    pruner.finalize()
    names = {id(p): n for n, p in model.named_parameters()}
    assert group["param_names"] == [names[id(p)] for p in group["params"]]


def test_layers_turn_block_sparse_below_the_break_even_density():
    limit = break_even_density("cpu", BS)
    model = _model(4, torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    pruner = GradualPruner(model, opt, blocksize=8, target_density=0.125, start_step=0, end_step=10, every=1)
    for step in range(12):
        x, y = _batch(step, torch.float32)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        rng = torch.get_rng_state()
        pruner.step()
        assert torch.equal(torch.get_rng_state(), rng)  # (dropout and data order see the same stream)
        for name, density in pruner.densities().items():
            assert isinstance(model.get_submodule(name), BSRLinear) == (density < limit), (step, name)
    # (the last layer's 4 blocks at 0.125 keep one, rounded half up, at density 0.25, above the limit)
    assert pruner.sparse_layers() == ["0", "2"] and pruner.densities()["4"] == 0.25


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_break_even_density_is_the_layer_dtypes(tmp_path, monkeypatch, dtype):
    """A tuning-table entry for float64 at this blocksize (0.99) turns a float64 layer block-sparse at
    density 0.5; a float32 layer reads its own (default) entry and stays masked dense there."""
    from bsrkit import break_even, tuning

    table = tmp_path / "tuning.json"
    monkeypatch.setenv(tuning.TABLE_ENV, str(table))
    key = break_even.table_key(tuning.cpu_device_name(), torch.float64, BS)
    tuning.save_entries({key: {"density": 0.99}}, table)
    assert break_even_density("cpu", BS, torch.float32) < 0.5
    model = _model(4, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    pruner = GradualPruner(model, opt, blocksize=8, target_density=0.5, start_step=0, end_step=1, every=1)
    x, y = _batch(0, dtype)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    pruner.step()
    assert set(pruner.densities().values()) == {0.5}
    assert pruner.sparse_layers() == (["0", "2", "4"] if dtype is torch.float64 else [])


def test_rigl_averages_over_the_replicas_it_is_given():
    """Which ranks' gradients RigL averages (tests/test_distributed.py runs it on 2 ranks): none without a
    process group of more than one rank, or with replicas=None; a string other than "default" is refused."""
    assert torch.distributed.is_initialized() or RigL().group() is None
    assert RigL(replicas=None).group() is None
    with pytest.raises(ValueError, match=r"RigL\(\): expected replicas 'default', None or a process group"):
        RigL(replicas="world")


def test_drop_and_grow_and_the_rigl_schedule():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    magnitude = torch.tensor([[3.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    growth = torch.tensor([[9.0, 9.0, 1.0], [9.0, 5.0, 4.0]])
    # 0.67 * 3 kept -> 2 swapped: drop (0, 1) and (1, 0), grow (1, 1) and (1, 2) (never (0, 0), kept)
    new = drop_and_grow(mask, magnitude, growth, 0.67)
    assert new.tolist() == [[True, False, False], [False, True, True]]
    assert torch.equal(drop_and_grow(mask, magnitude, growth, 0.0), mask)
    full = torch.ones(2, 3, dtype=torch.bool)
    assert torch.equal(drop_and_grow(full, magnitude, growth, 0.5), full)  # nothing to grow
    rigl = RigL(fraction=0.4, every=10, until=100)
    assert [s for s in range(0, 121) if rigl.due(s)] == list(range(10, 101, 10))
    assert rigl.fraction_at(0) == pytest.approx(0.4) and rigl.fraction_at(50) == pytest.approx(0.2)
    assert rigl.fraction_at(100) == pytest.approx(0.0)
    assert RigL(0.4, 10, 100, decay="constant").fraction_at(50) == 0.4
    for bad, error in [
        ({"fraction": 2.0}, ValueError), ({"fraction": "x"}, TypeError), ({"every": 0}, ValueError),
        ({"until": 0}, ValueError), ({"decay": "x"}, ValueError),
    ]:  # fmt: skip
        with pytest.raises(error):
            RigL(**bad)
    with pytest.raises(TypeError):
        GradualPruner(_model(), None, blocksize=8, target_density=0.5, start_step=0, end_step=2, every=1,
                      regrow=0.3)  # fmt: skip
    with pytest.raises(ValueError):
        GradualPruner(_model(), None, blocksize=8, target_density=0.5, start_step=0, end_step=2, every=1,
                      sparse_below="never")  # fmt: skip


def test_a_checkpoint_of_a_block_sparse_run_resumes_exactly():
    """pruner.state_dict() first, then the model's and the optimizer's: the resumed run continues as the
    uninterrupted one does."""
    model = _model(5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    pruner = _pruner(model, opt, end_step=8)
    for step in range(5):
        x, y = _batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        pruner.step()
    saved = copy.deepcopy((pruner.state_dict(), model.state_dict(), opt.state_dict()))
    resumed = _model(6)
    opt2 = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    pruner2 = _pruner(resumed, opt2, end_step=8)
    pruner2.load_state_dict(saved[0])
    resumed.load_state_dict(saved[1])
    opt2.load_state_dict(saved[2])
    assert pruner2.sparse_layers() == pruner.sparse_layers() == ["0", "2", "4"]
    for step in range(5, 12):
        x, y = _batch(step)
        for m, o, p in ((model, opt, pruner), (resumed, opt2, pruner2)):
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
            p.step()
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert all(torch.equal(v, pruner2.masks()[k]) for k, v in pruner.masks().items())


def test_finalize_after_block_sparse_training_keeps_the_optimizer():
    model = _model(7)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    pruner = _pruner(model, opt, sparse_below=0.5, target_density=0.5, regrow=None)
    for step in range(3):  # 0.5 after 3 steps of the cubic schedule: '0', '2', '4' still dense
        x, y = _batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        pruner.step()
    assert pruner.sparse_layers() == []
    x, _ = _batch(99)
    with torch.no_grad():
        before = model(x)
    masks = pruner.masks()
    assert pruner.finalize() is model and pruner.sparse_layers() == ["0", "2", "4"]
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=0, atol=1e-12)
    for name, mask in masks.items():
        module = model.get_submodule(name)
        assert module.values.shape[0] == int(mask.sum())
        assert opt.state[module.values]["exp_avg"].shape == module.values.shape
    nn.functional.mse_loss(model(x), torch.zeros(8, 8, dtype=torch.float64)).backward()
    opt.step()  # the optimizer trains the finalized model


def _rss_mb():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # (not Linux: the peak, which only ever grows)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_no_leak_over_2000_steps_of_changing_patterns():
    """2,000 training steps, the pattern changing every few steps (shrinking, then RigL at constant
    density): the plan cache and the shortcut tables stay far below their bounds and flat after the
    warm-up, the optimizer holds state for the live parameters only, and Python objects and memory stay
    flat. (One thread: the test measures counts, not speed.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    bsrkit.cache_clear()  # (the tables are process-wide: count only this test's entries)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        pruner = _pruner(model, opt, end_step=20, every=2, regrow=RigL(0.3, every=3, decay="constant"))
        x, y = torch.randn(8, 16), torch.randn(8, 16)
        samples, changes, previous = [], 0, pruner.masks()
        for step in range(1, 2001):
            loss = nn.functional.mse_loss(model(x), y)  # (kept alive into the next step, as in most loops)
            opt.zero_grad()
            loss.backward()
            opt.step()
            pruner.step()
            masks = pruner.masks()
            changes += any(not torch.equal(masks[n], previous[n]) for n in masks)
            previous = masks
            if step % 250 == 0:
                gc.collect()
                shortcuts = bsrkit.shortcut_info()
                samples.append((step, bsrkit.cache_info().currsize, shortcuts.checked_calls,
                                shortcuts.kept_operands, len(gc.get_objects()), _rss_mb()))  # fmt: skip
                assert len(opt.state) == len(list(model.parameters()))
    finally:
        torch.set_num_threads(threads)
    assert changes >= 600 and pruner.sparse_layers() == ["0", "2"]
    early = [s for s in samples if s[0] <= 1000]
    late = [s for s in samples if s[0] > 1000]
    for column, name in ((1, "plans"), (2, "checked calls"), (3, "kept operands")):
        assert max(s[column] for s in late) <= max(s[column] for s in early), name
        assert max(s[column] for s in samples) <= 32, name  # (far below the bounds: 256, 1024)
    assert max(s[4] for s in late) - max(s[4] for s in early) < 500  # Python objects
    assert late[-1][5] - early[-1][5] < 16  # MB of resident memory


@pytest.mark.parametrize("sparse_below", [0.5, None])
def test_a_module_used_at_two_places_is_pruned_and_swapped_at_both(sparse_below):
    """One nn.Linear used twice: both places train on the one pruned layer (its parameters in the
    optimizer), block-sparse below ``sparse_below`` and after ``finalize``."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 32).double()
    model = nn.Sequential(lin, nn.ReLU(), lin)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pruner = GradualPruner(
        model, opt, blocksize=8, target_density=0.25, start_step=0, end_step=1, every=1,
        sparse_below=sparse_below,
    )  # fmt: skip
    x, y = torch.randn(16, 32, dtype=torch.float64), torch.randn(16, 32, dtype=torch.float64)
    for _ in range(3):
        loss = (model(x) - y).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        pruner.step()
    pruner.finalize()
    assert model[0] is model[2] and isinstance(model[0], BSRLinear)
    trained = {id(p) for group in opt.param_groups for p in group["params"]}
    assert all(id(p) in trained for p in model.parameters())
    W, b = model[0].to_dense(), model[0].bias
    assert (block_view(W, (8, 8)).abs().sum((-1, -2)) > 0).double().mean() == 0.25
    with torch.no_grad():
        torch.testing.assert_close(model(x), torch.relu(x @ W.T + b) @ W.T + b)


def test_tied_layers_are_refused_by_name():
    a, b = nn.Linear(16, 16), nn.Linear(16, 16)
    b.weight = a.weight
    model = nn.Sequential(a, nn.ReLU(), b)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'0' and '2' share one weight"):
        GradualPruner(model, opt, blocksize=8, target_density=0.5, start_step=0, end_step=2, every=1)
    # One of them selected: refused too (the pruner zeroed the other's weight through the shared one, then
    # put the selected layer's blocks in its place in the optimizer: the other layer trained no more).
    with pytest.raises(ValueError, match="filter_fn selected '0' but not '2', which shares its weight"):
        GradualPruner(
            model, opt, blocksize=8, target_density=0.5, start_step=0, end_step=2, every=1,
            filter_fn=lambda m, fqn: fqn == "0",
        )  # fmt: skip
    assert not model[0]._forward_pre_hooks and not model[0].weight._backward_hooks
    # A shared bias is no tie for the pruner (it never replaces a bias): the bias stays shared.
    c, d = nn.Linear(16, 16), nn.Linear(16, 16)
    d.bias = c.bias
    model = nn.Sequential(c, nn.ReLU(), d)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pruner = GradualPruner(
        model, opt, blocksize=8, target_density=0.5, start_step=0, end_step=1, every=1, sparse_below=1.0,
        filter_fn=lambda m, fqn: fqn == "0",
    )  # fmt: skip
    pruner.step()
    assert isinstance(model[0], BSRLinear) and model[0].bias is model[2].bias


def test_the_default_filter_leaves_a_layer_tied_to_the_output_head_dense():
    """A linear layer sharing its weight with the (dense) output head is left out by the default filter,
    of the pruner and sparsify_ alike: pruning it pruned the head through the shared weight."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.mid, self.lm_head = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
            self.lm_head.weight = self.inp.weight

        def forward(self, x):
            return self.lm_head(torch.tanh(self.mid(torch.tanh(self.inp(x)))))

    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    pruner = GradualPruner(
        model, opt, blocksize=8, target_density=0.25, start_step=0, end_step=2, every=1, sparse_below=0.3
    )
    assert list(pruner.densities()) == ["mid"]
    x, y = torch.randn(8, 32), torch.randint(0, 32, (8,))
    for _ in range(3):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        pruner.step()
        opt.zero_grad()
    assert isinstance(model.mid, BSRLinear) and model.lm_head.weight is model.inp.weight
    assert (model.lm_head.weight != 0).all()
    other = Tied()
    summary = bsrkit.sparsify_(other, blocksize=8, density=0.25, force=True)
    assert [r.fqn for r in summary.layers] == ["mid"] and other.lm_head.weight is other.inp.weight


def test_the_pruner_skips_multihead_attentions_out_proj_and_refuses_it_by_name():
    torch.manual_seed(0)
    model = AttentionBlock()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pruner = GradualPruner(model, opt, blocksize=16, target_density=0.25, start_step=0, end_step=2, every=1)
    assert list(pruner.densities()) == ["mlp"]
    x = torch.randn(2, 5, 64)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        pruner.step()
    assert pruner.sparse_layers() == ["mlp"]
    with pytest.raises(ValueError, match="'attn.out_proj', which cannot be block-sparse"):
        GradualPruner(model, opt, blocksize=16, target_density=0.25, start_step=0, end_step=2, every=1,
                      filter_fn=lambda m, fqn: fqn == "attn.out_proj")  # fmt: skip


def test_a_skipped_scaler_step_moves_no_movement_score():
    """A step a GradScaler skips leaves inf gradients: the movement scores stay finite (they became NaN
    for the rest of the run, and every later choice was made on NaN)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pruner = GradualPruner(model, opt, blocksize=16, target_density=0.5, start_step=3, end_step=6, every=1,
                           criterion="movement", sparse_below=None)  # fmt: skip
    scaler = torch.amp.GradScaler("cpu")
    for step in range(6):
        loss = (model(torch.randn(8, 32)) - torch.randn(8, 4)).square().mean() * (1e34 if step == 0 else 1)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        pruner.step()
        assert all(bool(layer.score.isfinite().all()) for layer in pruner._layers)
    assert pruner.densities()["0"] == 0.5


def test_lbfgs_trains_the_layers_the_pruner_swaps():
    """LBFGS holds its group's parameter list and a flat history over all parameters: the swapped
    parameter goes into that list, and the history starts again (it kept updating the old parameter)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    pruner = GradualPruner(model, opt, blocksize=16, target_density=0.5, start_step=0, end_step=1, every=1,
                           sparse_below=1.0)  # fmt: skip
    x, y = torch.randn(64, 32), torch.randn(64, 4)

    def closure():
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        return loss

    opt.step(closure)
    pruner.step()
    values = model[0].values
    before = values.detach().clone()
    for _ in range(2):
        opt.step(closure)
        pruner.step()
    assert any(p is values for p in opt.param_groups[0]["params"])
    assert not torch.equal(before, values.detach())


def test_after_finalize_a_resumed_run_continues_as_the_original():
    """finalize() ends regrowth, and says so in the state dict: a run resumed from it does not regrow
    either (it did, and the same checkpoint gave two runs)."""
    import io

    def setup():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        pruner = GradualPruner(model, opt, blocksize=16, target_density=0.5, start_step=0, end_step=1,
                               every=1, regrow=RigL(0.5, every=2, decay="constant"))  # fmt: skip
        return model, opt, pruner

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)) for _ in range(8)]

    def train(model, opt, pruner, part):
        for x, y in part:
            opt.zero_grad()
            (model(x) - y).square().mean().backward()
            opt.step()
            pruner.step()

    m1, o1, p1 = setup()
    train(m1, o1, p1, batches[:3])
    p1.finalize()
    buf = io.BytesIO()
    torch.save({"pruner": p1.state_dict(), "model": m1.state_dict(), "opt": o1.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    m2, o2, p2 = setup()
    p2.load_state_dict(saved["pruner"])
    m2.load_state_dict(saved["model"])
    o2.load_state_dict(saved["opt"])
    assert p2.finalized
    train(m1, o1, p1, batches[3:])
    train(m2, o2, p2, batches[3:])
    assert torch.equal(p1.masks()["0"], p2.masks()["0"])
    assert torch.equal(m1[0].to_dense(), m2[0].to_dense())


def test_rolling_back_past_finalize_regrows_as_the_uninterrupted_run():
    """A state from before finalize(), loaded after it: regrowth goes on (the layers were block-sparse
    already, so the dense-gradient capture that finalize() removed was never started again, and every
    later regrowth step silently left the pattern as it was)."""

    def setup():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).double()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        pruner = GradualPruner(model, opt, blocksize=4, target_density=0.25, start_step=1, end_step=2,
                               every=1, filter_fn=lambda m, fqn: fqn == "0", sparse_below=1.0,
                               regrow=RigL(0.5, 2, decay="constant"))  # fmt: skip
        return model, opt, pruner

    def train(model, opt, pruner, steps):
        for t in steps:
            g = torch.Generator().manual_seed(t)
            x, y = (
                torch.randn(8, 16, generator=g, dtype=torch.float64),
                torch.randn(8, 4, generator=g, dtype=torch.float64),
            )
            opt.zero_grad()
            (model(x) - y).square().mean().backward()
            opt.step()
            pruner.step()

    model, opt, pruner = setup()
    train(model, opt, pruner, range(1, 11))
    expected = pruner.masks()["0"]
    model, opt, pruner = setup()
    train(model, opt, pruner, range(1, 4))
    saved = copy.deepcopy((pruner.state_dict(), model.state_dict(), opt.state_dict()))
    train(model, opt, pruner, range(4, 6))
    pruner.finalize()
    pruner.load_state_dict(saved[0])
    model.load_state_dict(saved[1])
    opt.load_state_dict(saved[2])
    train(model, opt, pruner, range(4, 11))
    assert torch.equal(pruner.masks()["0"], expected)


def test_an_optimizer_state_that_cannot_follow_the_blocks_restarts_with_a_warning():
    """Adafactor's factored state (row and column statistics) has no blocks to remap: when the layer turns
    block-sparse its state restarts, said once (optimizer.step() failed with a shape error)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    pruner = GradualPruner(model, opt, blocksize=4, target_density=0.5, start_step=1, end_step=2, every=1,
                           filter_fn=lambda m, fqn: fqn == "0", sparse_below=1.0)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    with pytest.warns(RuntimeWarning, match="Adafactor state .* cannot follow a new block pattern"):
        for _ in range(5):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            opt.zero_grad()
            loss = (model(x) - y).square().mean()
            loss.backward()
            opt.step()
            pruner.step()
    assert isinstance(model[0], BSRLinear) and torch.isfinite(loss)
    state = opt.state[model[0].values]
    assert all(v.ndim == 0 or v.shape[0] == model[0].values.shape[0] for v in state.values())


def test_a_clipped_gradient_norm_is_the_same_masked_dense_or_block_sparse():
    """A masked-dense layer's removed blocks get no gradient (the masked dense model's G * M), so the
    global norm clip_grad_norm_ takes, and so the run, is the same whichever way a layer is stored."""

    def run(sparse_below):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        pruner = _pruner(model, opt, sparse_below=sparse_below, end_step=4, regrow=None)
        removed = []
        for step in range(10):
            x, y = _batch(step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if not pruner.sparse_layers() and step > 1:
                mask = pruner.masks()["2"]
                removed.append(block_view(model[2].weight.grad, BS)[~mask].abs().max().item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            pruner.step()
        masks = pruner.masks()
        return [_dense(model[i], masks[str(i)], _weight(model[i])).detach() for i in (0, 2, 4)], removed

    dense, removed = run(None)  # masked dense to the end
    sparse, _ = run(1.0)  # block-sparse from the first pruning step
    assert removed and max(removed) == 0.0
    for a, b in zip(dense, sparse, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _step_then_prune(model, opt, pruner, step):
    """One training step on batch ``step``, then the pruner's; returns the masks before the pruner's."""
    x, y = _batch(step)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    before = pruner.masks()
    pruner.step()
    return before


def test_regrowth_of_a_masked_dense_layer_grows_by_its_dense_gradient():
    """The removed blocks' gradient is zero once masked, but regrowth reads the dense gradient: recorded
    before the mask, the layer grows where it is largest (as a block-sparse layer does)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pruner = _pruner(model, opt, sparse_below=None, regrow=RigL(fraction=0.5, every=2, decay="constant"))
    grown = 0
    for step in range(8):
        before = _step_then_prune(model, opt, pruner, step)
        grown += sum(int((pruner.masks()[k] & ~before[k]).sum()) for k in before)
    assert not pruner.sparse_layers() and grown > 0


@pytest.mark.parametrize("sparse_below", [None, 1.0])
def test_a_regrown_block_starts_from_the_optimizers_own_fresh_state(sparse_below):
    """Rprop starts a step size at lr and Adagrad a sum at initial_accumulator_value: a regrown block
    starts there too (zero froze an Rprop block at the minimum step size)."""
    for make, key, fresh in (
        (lambda p: torch.optim.Rprop(p, lr=0.01), "step_size", 0.01),
        (lambda p: torch.optim.Adagrad(p, lr=0.01, initial_accumulator_value=0.5), "sum", 0.5),
    ):
        model = _model()
        opt = make(model.parameters())
        pruner = _pruner(model, opt, sparse_below=sparse_below, target_density=0.5, end_step=2,
                         regrow=RigL(fraction=0.5, every=3, until=3, decay="constant"))  # fmt: skip
        for step in range(3):
            before = _step_then_prune(model, opt, pruner, step)
        after = pruner.masks()
        grown = {k: after[k] & ~before[k] for k in after}
        assert any(g.any() for g in grown.values())
        for name, g in grown.items():
            module = model[int(name)]
            state = _dense(module, after[name], opt.state[_weight(module)][key])
            assert bool((block_view(state, BS)[g] == fresh).all()), (key, name)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is newer than this torch")
def test_muon_is_refused_where_a_layer_would_train_block_sparse():
    """Muon trains 2-D parameters only: its first step after a layer turned block-sparse failed."""
    model = _model()
    opt = torch.optim.Muon([model[2].weight], lr=0.01)
    with pytest.raises(ValueError, match="torch.optim.Muon trains 2-D parameters only"):
        _pruner(model, opt, filter_fn=lambda module, fqn: fqn == "2", regrow=None)
    _pruner(model, opt, filter_fn=lambda module, fqn: fqn == "2", regrow=None, sparse_below=None)


@pytest.mark.parametrize("sparse_below", [None, 1.0])
def test_a_block_pruned_and_regrown_in_one_step_starts_at_zero(sparse_below):
    # The schedule removes block (0, 1) (the smaller norm) and the update of the same step grows it back
    # (the larger gradient): it is a grown block, at zero weight and momentum, not a kept one.
    lin = nn.Linear(8, 4, bias=False)
    with torch.no_grad():
        lin.weight[:, :4], lin.weight[:, 4:] = 1.0, 0.1
    model = nn.Sequential(lin)
    opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    rigl = RigL(fraction=1.0, every=1, decay="constant")
    pruner = GradualPruner(model, opt, blocksize=4, target_density=0.5, start_step=0, end_step=1, every=1,
                           sparse_below=sparse_below, regrow=rigl)  # fmt: skip
    x = torch.zeros(1, 8)
    x[0, 4:] = 1.0
    (model(x) * 5.0).sum().backward()
    opt.step()
    pruner.step()
    assert pruner.masks()["0"].tolist() == [[False, True]]
    weight = _weight(model[0])
    assert not weight.detach().any()
    assert not opt.state[weight]["momentum_buffer"].any()


def test_a_masked_dense_layers_removed_blocks_lose_their_gradient_when_pruned():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    pruner = _pruner(model, opt, sparse_below=None, target_density=0.25, end_step=1)
    x, y = _batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    pruner.step()
    for name, mask in pruner.masks().items():
        grad = model[int(name)].weight.grad
        assert not grad[~expand(mask, BS)].any(), name


def test_half_movement_scores_do_not_underflow():
    # Per-element movements of 6e-8 and 3e-8 underflow to 0 in float16: scored in float32, the block
    # that moved at all its weights wins over the one that moved at one.
    lin = nn.Linear(8, 8, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1e-3)
    model = nn.Sequential(lin).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    pruner = GradualPruner(model, opt, blocksize=4, target_density=0.25, start_step=0, end_step=2, every=1,
                           criterion="movement", sparse_below=None)  # fmt: skip
    grad = torch.zeros(8, 8)
    grad[:4, :4], grad[4, 4] = -2.5e-5, -6e-5
    for _ in range(2):
        model[0].weight.grad = grad.half()
        pruner.step()
    assert pruner.masks()["0"].nonzero().tolist() == [[0, 0]]


@pytest.mark.parametrize("a, b", [(1.0, 1.0 + 1e-9), (1e-24, 3e-24), (0.0, 0.0)])
def test_float64_blocks_rank_alike_in_the_pruner_and_from_dense(a, b):
    # Norms apart by less than float32 resolution (or squares below its range) rank in float64 in both;
    # equal norms keep the lower index in both.
    lin = nn.Linear(8, 4, bias=False).double()
    with torch.no_grad():
        lin.weight[:, :4], lin.weight[:, 4:] = a, b
    kept = [1] if b > a else [0]
    assert BSRLinear.from_dense(lin, 4, 0.5).col_indices.tolist() == kept
    model = nn.Sequential(lin)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    pruner = GradualPruner(model, opt, blocksize=4, target_density=0.5, start_step=0, end_step=1, every=1,
                           sparse_below=None)  # fmt: skip
    pruner.step()
    assert pruner.masks()["0"].nonzero()[:, 1].tolist() == kept


def test_the_pruners_arguments_are_checked_by_name():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = dict(blocksize=BS, target_density=0.5, start_step=0, end_step=2, every=1)
    with pytest.raises(TypeError, match="expected model to be an nn.Module, got str"):
        GradualPruner("x", opt, **kw)
    with pytest.raises(
        TypeError, match=r"expected optimizer to be a torch.optim.Optimizer \(or a wrapper holding"
    ):
        GradualPruner(model, model.parameters(), **kw)
    with pytest.raises(TypeError, match="expected filter_fn to be callable or None, got int"):
        GradualPruner(model, opt, filter_fn=3, **kw)
    with pytest.raises(ValueError, match="expected every to be an int >= 1, got True"):
        RigL(every=True)
    numpy = pytest.importorskip("numpy")
    rigl = RigL(fraction=numpy.float32(0.25), every=numpy.int64(2), until=numpy.int64(6))
    assert (rigl.fraction, rigl.every, rigl.until) == (0.25, 2, 6) and type(rigl.every) is int


def test_a_layer_tied_to_an_embedding_is_skipped_by_default_and_refused_when_selected():
    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.hidden, self.decoder = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16)
            self.decoder.weight = self.encoder.weight

        def forward(self, tokens):
            return self.decoder(self.hidden(self.encoder(tokens)))

    model = TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = dict(blocksize=4, target_density=0.5, start_step=0, end_step=2, every=1)
    pruner = GradualPruner(model, opt, **kw)
    assert list(pruner.masks()) == ["hidden"]
    with pytest.raises(ValueError, match=r"'decoder'.*weight is shared with 'encoder', a Embedding"):
        GradualPruner(model, opt, filter_fn=lambda m, fqn: fqn == "decoder", **kw)
    with pytest.raises(ValueError, match=r"'decoder'.*weight is shared with 'encoder', a Embedding"):
        bsrkit.sparsify_(
            model, blocksize=4, density=0.5, force=True, filter_fn=lambda m, fqn: fqn == "decoder"
        )
    summary = bsrkit.sparsify_(model, blocksize=4, density=0.5, force=True)
    assert [r.fqn for r in summary.layers] == ["hidden"] and model.decoder.weight is model.encoder.weight


def test_finalize_before_the_schedule_ends_keeps_the_patterns_final():
    """finalize() says its patterns are final: steps after it, with the schedule still running, prune no
    further (they kept pruning to the scheduled density)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    pruner = GradualPruner(model, opt, blocksize=4, target_density=0.25, start_step=0, end_step=8, every=1,
                           filter_fn=lambda m, fqn: fqn == "0")  # fmt: skip
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    for t in range(10):
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()
        pruner.step()
        if t == 2:
            pruner.finalize()
            final = pruner.masks()["0"].clone()
            assert final.float().mean() > 0.25  # (the schedule had further to go)
    assert pruner.steps == 10
    assert torch.equal(pruner.masks()["0"], final)
    assert torch.equal(model[0].to_dense() != 0, final.repeat_interleave(4, 0).repeat_interleave(4, 1))


def test_a_wrapped_optimizer_and_float64_movement_scores():
    """An optimizer wrapper holding param_groups and state (as ZeRO's and other wrappers do) is taken, its
    state following the pattern; float64 layers accumulate movement in float64 (float32 sums ranked
    them)."""

    with pytest.raises(TypeError, match="or a wrapper holding one as .optimizer"):
        GradualPruner(nn.Sequential(nn.Linear(16, 16)), _Wrapped([]), blocksize=4, target_density=0.5,
                      start_step=0, end_step=1, every=1)  # fmt: skip
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).double()
    opt = _Wrapped(torch.optim.Adam(model.parameters(), lr=1e-2))
    pruner = GradualPruner(model, opt, blocksize=4, target_density=0.25, start_step=0, end_step=3, every=1,
                           criterion="movement", filter_fn=lambda m, fqn: fqn == "0",
                           sparse_below=1.0)  # fmt: skip
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    for _ in range(4):
        for p in model.parameters():
            p.grad = None
        (model(x) - y).square().mean().backward()
        opt.step()
        pruner.step()
    assert pruner.state_dict()["scores"]["0"].dtype == torch.float64
    assert pruner.densities()["0"] == 0.25 and isinstance(model[0], BSRLinear)
    values = model[0].values
    assert opt.state[values]["exp_avg"].shape == values.shape


def test_a_wrapped_adagrad_keeps_its_start_value_for_new_blocks():
    """The per-optimizer rules test the wrapped optimizer's class: a wrapped Adagrad's pruned-and-grown
    state starts at initial_accumulator_value, as the bare one's (it started at 0)."""

    sums = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        inner = torch.optim.Adagrad(model.parameters(), lr=1e-2, initial_accumulator_value=0.5)
        opt = _Wrapped(inner) if wrap else inner
        pruner = GradualPruner(model, opt, blocksize=4, target_density=0.5, start_step=0, end_step=1,
                               every=1, filter_fn=lambda m, fqn: fqn == "0", sparse_below=None,
                               regrow=RigL(0.5, every=1, decay="constant"))  # fmt: skip
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        for _ in range(3):
            inner.zero_grad()
            (model(x) - y).square().mean().backward()
            inner.step()
            pruner.step()
        sums.append(inner.state[model[0].weight]["sum"].clone())
    torch.testing.assert_close(sums[0], sums[1])
