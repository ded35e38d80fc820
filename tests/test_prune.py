"""GradualPruner: the cubic schedule, both criteria, masked-dense training, optimizer state following the
pattern, and finalize() to BSRLinear, against a masked-dense reference run."""

import copy
import fractions
import itertools

import numpy as np
import pytest
import torch
from torch import nn

from bsrkit.nn import BSRLinear
from bsrkit.prune import GradualPruner, cubic_density


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def test_cubic_schedule():
    assert cubic_density(0, 10, 20, 0.25) == 1.0 and cubic_density(10, 10, 20, 0.25) == 1.0
    assert cubic_density(20, 10, 20, 0.25) == 0.25 and cubic_density(99, 10, 20, 0.25) == 0.25
    assert cubic_density(15, 10, 20, 0.25) == pytest.approx(0.25 + 0.75 * 0.5**3)
    values = [cubic_density(t, 10, 20, 0.1) for t in range(10, 21)]
    assert all(a > b for a, b in itertools.pairwise(values))  # strictly decreasing


def _train(model, opt, pruner, steps, first=0):
    for step in range(first, first + steps):
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        pruner.step()


@pytest.mark.parametrize("criterion", ["magnitude", "movement"])
def test_density_follows_the_schedule_and_patterns_only_shrink(criterion):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    pruner = GradualPruner(
        model,
        opt,
        blocksize=8,
        target_density=0.25,
        start_step=2,
        end_step=12,
        every=1,
        criterion=criterion,
        sparse_below=None,  # masked dense throughout (tests/test_prune_sparse.py: block-sparse training)
    )
    assert set(pruner.densities()) == {"0", "2", "4"}  # every nn.Linear the blocksize divides
    history = []
    for step in range(16):
        history.append(pruner.masks())
        _train(model, opt, pruner, 1, first=step)
    history.append(pruner.masks())
    changes = sum(not torch.equal(a["0"], b["0"]) for a, b in itertools.pairwise(history))
    assert changes >= 5
    for a, b in itertools.pairwise(history):
        for name in a:
            assert not (b[name] & ~a[name]).any()  # no block comes back
    for name, density in pruner.densities().items():
        assert density == pytest.approx(0.25), name
    for name, mask in pruner.masks().items():
        weight = model.get_submodule(name).weight
        full = mask.repeat_interleave(8, 0).repeat_interleave(8, 1)
        assert (weight[~full] == 0).all() and (weight[full] != 0).any()


def test_optimizer_state_follows_the_pattern():
    """Adam's moments of a removed block are zero; a kept block keeps the moments an unpruned twin run
    with the same masks has."""
    model = _model(1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    pruner = GradualPruner(
        model, opt, blocksize=8, target_density=0.5, start_step=1, end_step=3, every=1, sparse_below=None
    )
    _train(model, opt, pruner, 4)
    for name, mask in pruner.masks().items():
        weight = model.get_submodule(name).weight
        full = mask.repeat_interleave(8, 0).repeat_interleave(8, 1)
        state = opt.state[weight]
        assert (state["exp_avg"][~full] == 0).all() and (state["exp_avg_sq"][~full] == 0).all()
        per_block = state["exp_avg_sq"].reshape(mask.shape[0], 8, mask.shape[1], 8).sum((1, 3))
        assert (per_block[mask] > 0).all()  # every kept block kept its moments


def test_training_equals_a_masked_dense_reference_run():
    """The same schedule replayed by hand on a twin (masks applied to weights and Adam state after each
    step) gives the same weights and the same losses."""
    model = _model(2)
    twin = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt_twin = torch.optim.Adam(twin.parameters(), lr=1e-2)
    pruner = GradualPruner(
        model, opt, blocksize=8, target_density=0.25, start_step=1, end_step=9, every=2, sparse_below=None
    )
    for step in range(12):
        x, y = _batch(step)
        for m, o in ((model, opt), (twin, opt_twin)):
            loss = nn.functional.mse_loss(m(x), y)
            o.zero_grad()
            loss.backward()
            o.step()
        pruner.step()
        with torch.no_grad():
            for name, mask in pruner.masks().items():
                full = mask.repeat_interleave(8, 0).repeat_interleave(8, 1)
                w = twin.get_submodule(name).weight
                w.mul_(full)
                for v in opt_twin.state[w].values():
                    if v.shape == w.shape:
                        v.mul_(full)
    for (n1, p1), (_, p2) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        torch.testing.assert_close(p1, p2, msg=n1)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p1][key], opt_twin.state[p2][key], msg=f"{n1} {key}")


def test_movement_keeps_the_blocks_the_optimizer_moves_away_from_zero():
    layer = nn.Linear(16, 16, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    model = nn.Sequential(layer)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # (weights stay put; only the scores move)
    pruner = GradualPruner(
        model, opt, blocksize=8, target_density=0.25, start_step=0, end_step=1, every=1, criterion="movement"
    )
    grad = torch.ones(16, 16)
    grad[:8, 8:] = -1.0  # moving block (0, 1) away from zero: -w * g > 0 there only
    layer.weight.grad = grad
    pruner.step()
    assert pruner.masks()["0"].tolist() == [[False, True], [False, False]]


def test_finalize_gives_bsr_layers_computing_the_same():
    model = _model(3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    pruner = GradualPruner(model, opt, blocksize=8, target_density=0.25, start_step=0, end_step=4, every=1)
    _train(model, opt, pruner, 5)
    x = torch.randn(4, 32)
    with torch.no_grad():
        before = model(x)
    masks = pruner.masks()
    pruner.finalize()
    assert isinstance(model[0], BSRLinear) and isinstance(model[2], BSRLinear)
    for name, mask in masks.items():
        dense = model.get_submodule(name).to_dense()
        blocks = dense.reshape(mask.shape[0], 8, mask.shape[1], 8).transpose(1, 2).abs().sum((-1, -2)) > 0
        assert not (blocks & ~mask).any()
    with torch.no_grad():
        torch.testing.assert_close(model(x), before)


def test_state_dict_round_trip_and_bad_arguments():
    model = _model(4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    kwargs = dict(blocksize=8, target_density=0.5, start_step=0, end_step=2, every=1)
    pruner = GradualPruner(model, opt, **kwargs)
    _train(model, opt, pruner, 3)
    other = GradualPruner(_model(5), opt, **kwargs)
    other.load_state_dict(pruner.state_dict())
    assert other.steps == 3 and all(torch.equal(other.masks()[k], v) for k, v in pruner.masks().items())
    state = pruner.state_dict()
    small = {**state["scores"], "0": torch.zeros(2, 2)}
    for broken, match in [
        ({**state, "scores": small}, r"expected a \(8, 4\) scores for '0', got \(2, 2\)"),
        ({k: v for k, v in state.items() if k != "scores"}, r"expected a state with \['scores'\]"),
        ({k: v for k, v in state.items() if k != "steps"}, r"expected a state with \['steps'\]"),
        ({**state, "scores": {}}, "expected scores for"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            other.load_state_dict(broken)
    for bad, error in [
        ({"target_density": 1.5}, ValueError), ({"target_density": "x"}, TypeError),
        ({"start_step": 5, "end_step": 5}, ValueError), ({"every": 0}, ValueError),
        ({"criterion": "random"}, ValueError), ({"blocksize": 0}, ValueError), ({"blocksize": 5}, ValueError),
    ]:  # fmt: skip
        with pytest.raises(error):
            GradualPruner(_model(), opt, **{**kwargs, **bad})


def test_a_frozen_layer_is_named_and_leaves_no_hook():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    model[2].requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'2' is frozen"):
        GradualPruner(model, optimizer, blocksize=4, target_density=0.5, start_step=0, end_step=2, every=1)
    assert not model[0].weight._backward_hooks and not model[2].weight._backward_hooks
    pruner = GradualPruner(
        model, optimizer, blocksize=4, target_density=0.5, start_step=0, end_step=2, every=1,
        filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and m.weight.requires_grad,
    )  # fmt: skip
    assert list(pruner.densities()) == ["0"]


def test_steps_must_be_ints_and_a_loaded_mask_bool():
    model = nn.Sequential(nn.Linear(8, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = {"start_step": 0, "end_step": 4, "every": 1}
    for name in steps:
        with pytest.raises(TypeError, match=f"expected {name} to be an int, got float"):
            GradualPruner(model, optimizer, blocksize=4, target_density=0.5, **{**steps, name: 1.5})
    pruner = GradualPruner(model, optimizer, blocksize=4, target_density=0.5, **steps)
    state = pruner.state_dict()
    state["masks"]["0"] = torch.zeros(2, 2)  # (cast with bool(), every block would be kept)
    with pytest.raises(ValueError, match="expected a bool mask for '0', got torch.float32"):
        pruner.load_state_dict(state)


def test_the_default_filter_s_conv1d_layers_are_skipped_and_named():
    """The default filter selects transformers' Conv1D too (sparsify_ converts them); the pruner refused
    them, naming a filter_fn the caller never passed, so no GPT-2 could be pruned without one."""
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), conv1d(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = {"blocksize": 4, "target_density": 0.5, "start_step": 0, "end_step": 2, "every": 1}
    pruner = GradualPruner(model, opt, **kwargs)
    assert list(pruner.masks()) == ["0"]
    with pytest.raises(ValueError, match="'2', a Conv1D, not an nn.Linear"):
        GradualPruner(model, opt, filter_fn=lambda m, fqn: fqn != "1", **kwargs)
    only_conv1d = nn.Sequential(conv1d(8, 8))
    with pytest.raises(ValueError, match="1 transformers Conv1D layers .* sparsify_ converts them"):
        GradualPruner(only_conv1d, torch.optim.SGD(only_conv1d.parameters(), lr=0.1), **kwargs)


def test_sparse_below_takes_numpy_s_real_numbers():
    kwargs = {"blocksize": 4, "target_density": 0.5, "start_step": 0, "end_step": 2, "every": 1}
    for below in (np.float32(0.3), np.float64(0.3), 0.3, np.True_):
        model = nn.Sequential(nn.Linear(8, 8))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if below is np.True_:
            with pytest.raises(ValueError, match="expected sparse_below to be a number in"):
                GradualPruner(model, opt, sparse_below=below, **kwargs)
        else:
            assert GradualPruner(model, opt, sparse_below=below, **kwargs)._layers[0].sparse_below == below


def test_kept_block_count_rounds_half_up_alike_in_every_pruning():
    """density * blocks rounded half up, in BSRLinear, from_dense, sparsify_ and GradualPruner alike
    (Python's round, half to even, kept none of one block at 0.5, and 2 of 5)."""
    from bsrkit.sparsify import sparsify_
    from bsrkit.validation import check_density, kept_blocks

    assert [kept_blocks(0.5, n) for n in (1, 2, 3, 5)] == [1, 1, 2, 3]
    assert kept_blocks(0.1, 30) == 3 and kept_blocks(0.0, 7) == 0 and kept_blocks(1.0, 7) == 7
    # (of the decimal the density prints as: the float products 14.499999999999998 and 31.499999999999996
    # rounded down, and floor(x + 0.5) took 0.49999999999999994 of one block as one)
    assert (
        kept_blocks(0.29, 50) == 15
        and kept_blocks(0.7, 45) == 32
        and kept_blocks(0.49999999999999994, 1) == 0
    )
    assert kept_blocks(np.float32(0.29), 50) == 15 and kept_blocks(fractions.Fraction(1, 6), 3) == 1
    # (the checks hand the entry points what kept_blocks counts: numpy's long double prints 0.2899...)
    for d in (np.float32(0.29), np.longdouble(0.29), fractions.Fraction(1, 6), 0.29, np.int64(1)):
        assert kept_blocks(check_density("t", d), 50) == kept_blocks(d, 50)
    torch.manual_seed(0)
    linear = nn.Linear(40, 8)  # 5 blocks of 8 x 8
    assert BSRLinear(40, 8, 8, density=0.5).values.shape[0] == 3
    assert BSRLinear.from_dense(linear, 8, density=0.5).values.shape[0] == 3
    assert BSRLinear.from_dense(nn.Linear(8, 8), 8, density=0.5).values.shape[0] == 1
    model = nn.Sequential(nn.Linear(40, 8), nn.ReLU(), nn.Linear(8, 2))
    sparsify_(model, blocksize=8, density=0.5, force=True)
    assert model[0].values.shape[0] == 3
    model = nn.Sequential(nn.Linear(40, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pruner = GradualPruner(
        model, opt, blocksize=8, target_density=0.5, start_step=0, end_step=1, every=1, sparse_below=None
    )
    pruner.step()
    assert pruner.masks()["0"].sum() == 3


@pytest.mark.parametrize(
    "density,features,kept", [(fractions.Fraction(1, 6), (16, 48), 1), (np.float32(0.29), (80, 160), 15)]
)
def test_every_pruning_counts_a_fraction_and_a_numpy_float_exactly(density, features, kept):
    """The entry points counted float(density) (a Fraction of 1/6 of 3 blocks kept none, np.float32(0.29)
    of 50 kept 14); kept_blocks counts them exactly, and so must they."""
    from bsrkit.sparsify import sparsify_

    out_f, in_f = features
    torch.manual_seed(0)
    assert BSRLinear(in_f, out_f, 16, density=density).values.shape[0] == kept
    assert BSRLinear.from_dense(nn.Linear(in_f, out_f), 16, density).values.shape[0] == kept
    model = nn.Sequential(nn.Linear(in_f, out_f))
    sparsify_(model, blocksize=16, density=density, force=True)
    assert model[0].values.shape[0] == kept
    model = nn.Sequential(nn.Linear(in_f, out_f))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pruner = GradualPruner(
        model, opt, blocksize=16, target_density=density, start_step=0, end_step=1, every=1, sparse_below=None
    )
    model(torch.randn(2, in_f)).sum().backward()
    opt.step()
    pruner.step()
    pruner.finalize()
    assert model[0].values.shape[0] == kept
    # (what the schedule reports stays a float: formatting, json and torch.tensor take it)
    assert type(pruner.target_density) is float and type(pruner.density_at(1)) is float
    assert type(pruner.density_at(0)) is float


def test_a_long_schedule_to_a_numpy_float_ends_at_its_count():
    """The schedule ran on float(np.float32(0.29)), below 0.29: its last steps kept 14 of 50 blocks, and
    pruning never regrows, so the final count (15) was never reached."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(80, 40))  # 5 x 10 blocks of 8 x 8
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pruner = GradualPruner(
        model, opt, blocksize=8, target_density=np.float32(0.29), start_step=0, end_step=500, every=1,
        sparse_below=None,
    )  # fmt: skip
    for _ in range(500):
        pruner.step()
    pruner.finalize()
    assert model[0].values.shape[0] == 15


def test_drop_and_grow_counts_a_numpy_half_fraction_as_its_decimal():
    """A float16 fraction was multiplied in float16: one block fewer than 0.7 of 5001, and an overflow
    (OverflowError) at 70000 kept blocks."""
    from bsrkit.regrow import drop_and_grow

    def swapped(fraction, kept, outside):
        mask = torch.zeros(kept + outside, dtype=torch.bool)
        mask[:kept] = True
        score = torch.arange(kept + outside, dtype=torch.float32)
        return int((drop_and_grow(mask, score, score, fraction) & ~mask).sum())

    assert swapped(np.float16(0.7), 5001, 4000) == swapped(0.7, 5001, 4000) == 3501
    assert swapped(np.float16(1.0), 70000, 70000) == 70000


def test_argument_errors_name_the_argument():
    """Bad arguments to the layer, the schedule, drop_and_grow and the pruner's state are errors naming
    them (torch's errors escaped, or the call was taken: a density above 1, a step of 2.5)."""
    from bsrkit.regrow import drop_and_grow

    with pytest.raises(ValueError, match=r"BSRLinear\(\): expected in_features >= 0, got -8"):
        BSRLinear(-8, 8, 4)
    with pytest.raises(TypeError, match=r"BSRLinear\(\): expected in_features to be an int, got float"):
        BSRLinear(8.0, 8, 4)
    with pytest.raises(TypeError, match=r"expected out_features to be an int, got str"):
        BSRLinear(8, "8", 4)
    with pytest.raises(TypeError, match=r"expected generator to be a torch.Generator or None, got int"):
        BSRLinear(8, 8, 4, generator=1)
    with pytest.raises(ValueError, match=r"BSRLinear.from_dense\(\): expected blocksize \(3, 3\) to divide"):
        BSRLinear.from_dense(nn.Linear(8, 8), 3, 0.5)
    with pytest.raises(ValueError, match=r"cubic_density\(\): expected start_step < end_step"):
        cubic_density(5, 10, 2, 0.2)
    with pytest.raises(ValueError, match=r"cubic_density\(\): expected target_density in \[0, 1\], got 2.0"):
        cubic_density(5, 0, 10, 2.0)
    mask = torch.tensor([[True, False, False, False]])
    with pytest.raises(ValueError, match=r"drop_and_grow\(\): expected fraction in \[0, 1\], got 2.0"):
        drop_and_grow(mask, torch.ones(1, 4), torch.ones(1, 4), 2.0)
    with pytest.raises(TypeError, match=r"drop_and_grow\(\): expected magnitude to be a tensor, got list"):
        drop_and_grow(mask, [1.0], torch.ones(1, 4), 0.5)
    with pytest.raises(ValueError, match=r"expected growth of mask's shape \(1, 4\), got \(1, 2\)"):
        drop_and_grow(mask, torch.ones(1, 4), torch.ones(1, 2), 0.5)
    model = _model()
    pruner = GradualPruner(
        model, torch.optim.SGD(model.parameters(), lr=0.1), blocksize=8, target_density=0.5, start_step=0,
        end_step=4, every=1,
    )  # fmt: skip
    with pytest.raises(TypeError, match=r"density_at\(\): expected step to be an int, got float"):
        pruner.density_at(2.5)
    with pytest.raises(TypeError, match=r"load_state_dict\(\): expected a dict .* got NoneType"):
        pruner.load_state_dict(None)
    with pytest.raises(TypeError, match=r"load_state_dict\(\): expected steps to be an int, got str"):
        pruner.load_state_dict({**pruner.state_dict(), "steps": "x"})


def test_densities_are_exact_fractions():
    """kept / blocks in float64 (it was a float32 mean: 2/7 read 0.2857142984867096)."""
    model = nn.Sequential(nn.Linear(56, 8))
    pruner = GradualPruner(
        model, torch.optim.SGD(model.parameters(), lr=0.1), blocksize=8, target_density=2 / 7, start_step=0,
        end_step=1, every=1, filter_fn=lambda m, fqn: True,
    )  # fmt: skip
    pruner.step()
    assert pruner.densities() == {"0": 2 / 7}
