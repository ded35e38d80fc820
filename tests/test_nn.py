import copy

import numpy as np
import pytest
import torch

import bsrkit
from bsrkit import reference
from bsrkit.nn import BSRLinear
from helpers import assert_close, backends


def _dense_twin(layer: BSRLinear) -> torch.nn.Linear:
    lin = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    with torch.no_grad():
        lin.weight.copy_(layer.to_dense())
        if layer.bias is not None:
            lin.bias.copy_(layer.bias)
    return lin


@pytest.mark.parametrize("lead", [(), (5,), (2, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_backward_match_dense(lead, bias):
    layer = BSRLinear(24, 18, (6, 4), bias=bias, density=0.5, generator=torch.Generator().manual_seed(0))
    lin = _dense_twin(layer)
    x = torch.randn(*lead, 24, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y = layer(x)
    assert y.shape == (*lead, 18)
    assert_close(y, lin(x2), k=24)
    g = torch.randn_like(y)
    y.backward(g)
    lin(x2).backward(g)
    assert_close(x.grad, x2.grad, k=18)
    # values.grad is the dense weight gradient at the stored blocks
    wg = lin.weight.grad.reshape(3, 6, 6, 4).transpose(1, 2)
    rows = torch.repeat_interleave(torch.arange(3), layer.crow_indices.diff())
    assert_close(layer.values.grad, wg[rows, layer.col_indices], k=max(1, x.numel() // 24))
    if bias:
        assert_close(layer.bias.grad, lin.bias.grad)


def test_from_dense_keeps_the_largest_blocks():
    lin = torch.nn.Linear(8, 8)
    with torch.no_grad():
        lin.weight.fill_(0.01)
        lin.weight[0:4, 4:8] = 5.0  # block (0, 1)
        lin.weight[4:8, 0:4] = -3.0  # block (1, 0)
    layer = BSRLinear.from_dense(lin, 4, density=0.5)
    assert layer.values.shape == (2, 4, 4)
    expected = torch.zeros(8, 8)
    expected[0:4, 4:8] = 5.0
    expected[4:8, 0:4] = -3.0
    assert torch.equal(layer.to_dense(), expected)
    assert torch.equal(layer.bias, lin.bias)
    full = BSRLinear.from_dense(lin, (2, 4), density=1.0)
    assert torch.equal(full.to_dense(), lin.weight.detach())


def test_trains_with_an_optimizer_and_keeps_its_pattern():
    import copy

    torch.manual_seed(0)
    target = BSRLinear(32, 16, 8, density=0.5)
    layer = copy.deepcopy(target)  # same pattern,
    with torch.no_grad():
        layer.values.normal_()  # other values
    crow, col = layer.crow_indices.clone(), layer.col_indices.clone()
    opt = torch.optim.Adam(layer.parameters(), lr=0.05)
    x = torch.randn(64, 32)
    y = target(x).detach()
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = (layer(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.05 * losses[0]
    assert torch.equal(layer.crow_indices, crow) and torch.equal(layer.col_indices, col)


def test_state_dict_round_trip_replans_in_place():
    torch.manual_seed(3)
    a = BSRLinear.from_dense(torch.nn.Linear(16, 16), 4, density=0.5)  # 8 of 16 blocks each
    b = BSRLinear.from_dense(torch.nn.Linear(16, 16), 4, density=0.5)
    assert not torch.equal(a.col_indices, b.col_indices)  # different patterns, same sizes
    x = torch.randn(3, 16)
    b(x)  # b's plan is cached now
    b.load_state_dict(a.state_dict())  # indices copied in place: the plan must not be stale
    assert_close(b(x), a(x))
    assert torch.equal(b.to_dense(), a.to_dense())
    sd = a.state_dict()
    assert set(sd) == {"crow_indices", "col_indices", "values", "bias"}


def test_no_grad_and_inference_mode():
    layer = BSRLinear(16, 8, 4, density=0.5)
    x = torch.randn(2, 16)
    expected = _dense_twin(layer)(x)
    with torch.no_grad():
        assert_close(layer(x), expected, k=16)
    with torch.inference_mode():
        xi = torch.randn(2, 16)
        assert_close(layer(xi), _dense_twin(layer)(xi), k=16)


def test_plan_lives_with_the_layer():
    bsrkit.cache_clear()
    layer = BSRLinear(16, 16, 4, density=0.5)
    x = torch.randn(4, 16)
    layer(x)
    layer(x)
    info = bsrkit.cache_info()
    # One entry per pattern: the validity verdict (every backend), which holds the CPU kernel's plan
    # derived from the validated bytes; the second call finds both in one hit.
    assert info.misses == 1 and info.hits == 1 and info.currsize == 1
    del layer
    import gc

    gc.collect()
    assert bsrkit.cache_info().currsize == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="to divide"):
        BSRLinear(10, 8, 4)
    with pytest.raises(ValueError, match="density"):
        BSRLinear(8, 8, 4, density=2)
    with pytest.raises(ValueError, match=r"expected input of shape \(\*, 8\), got \(2, 7\)"):
        BSRLinear(8, 8, 4)(torch.randn(2, 7))


@pytest.mark.parametrize("blocksize", [(4,), (4, 2, 1), 4.0, (4, 2.0), True, "4"])
def test_a_blocksize_not_an_int_or_pair_is_named(blocksize):
    with pytest.raises(TypeError, match=r"BSRLinear\(\): expected blocksize to be an int or a pair"):
        BSRLinear(8, 8, blocksize)
    with pytest.raises(TypeError, match=r"from_dense\(\): expected blocksize"):
        BSRLinear.from_dense(torch.nn.Linear(8, 8), blocksize, 0.5)


def test_a_blocksize_list_is_a_pair():
    assert BSRLinear(8, 8, [4, 2]).blocksize == (4, 2)
    with pytest.raises(ValueError, match="blocksize to be >= 1"):
        BSRLinear(8, 8, (0, 2))


@pytest.mark.parametrize("density", [1.5, -0.5, float("nan"), True, "0.5"])
def test_from_dense_names_a_bad_density(density):
    with pytest.raises(ValueError, match=r"BSRLinear.from_dense\(\): expected density"):
        BSRLinear.from_dense(torch.nn.Linear(8, 8), 4, density)


@pytest.mark.parametrize("dtype", [torch.int32, "float32", 3])
def test_a_dtype_that_is_not_floating_is_refused_by_name(dtype):
    with pytest.raises(
        TypeError,
        match=f"BSRLinear\\(\\): expected dtype to be a floating-point torch.dtype or None, got {dtype!r}",
    ):
        BSRLinear(8, 8, 4, dtype=dtype)


def test_python_float_as_dtype_is_float64_as_for_nn_linear():
    assert BSRLinear(8, 8, 4, dtype=float).values.dtype == torch.nn.Linear(8, 8, dtype=float).weight.dtype


def test_a_zero_dim_input_is_a_shape_error():
    with pytest.raises(ValueError, match=r"expected input of shape \(\*, 8\), got \(\)"):
        BSRLinear(8, 8, 4)(torch.tensor(1.0))


def test_from_dense_of_a_meta_weight_says_why():
    with torch.device("meta"):
        linear = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="meta device"):
        BSRLinear.from_dense(linear, 4, 0.5)


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(BSRLinear(32, 32, 8, density=0.5), torch.nn.ReLU(), BSRLinear(32, 8, (4, 8)))
    x = torch.randn(6, 32)
    eager = model(x)
    eager.sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    assert_close(out, eager)
    out.sum().backward()
    for p, g in zip(model.parameters(), eager_grads, strict=True):
        assert_close(p.grad, g)


@pytest.mark.parametrize("shape", [(6, 32), (2, 3, 32)], ids=["2d", "3d"])
def test_torch_compile_without_grad_traces_the_plain_product_op(shape):
    """Under torch.compile a call that needs no gradient traces ``bsrkit::linear_product`` (a plain
    torch.library op: none of custom_op's autograd layers), one that needs one the differentiable
    ``bsrkit::linear``; both give eager's result."""
    torch.manual_seed(1)
    layer = BSRLinear(32, 16, 8, density=0.5)
    graphs = []

    def backend(gm, inputs):
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        graphs.append({str(n.target).removesuffix(".default") for n in calls})
        return gm.forward

    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    x = torch.randn(shape)
    with torch.no_grad():
        assert_close(compiled(x), layer(x))
    assert "bsrkit.linear_product" in graphs[-1] and "bsrkit.linear" not in graphs[-1]
    xg = x.clone().requires_grad_()
    out = compiled(xg)
    assert "bsrkit.linear" in graphs[-1] and "bsrkit.linear_product" not in graphs[-1]
    assert_close(out, layer(x))
    out.sum().backward()
    assert xg.grad is not None and layer.values.grad is not None


def test_plans_follow_a_loaded_pattern_also_through_to_bsr():
    """load_state_dict gives the pattern new memory, so a BSR built by to_bsr() after the load cannot be
    served a plan of the old pattern (torch gives a BSR's index tensors their own version counters, so
    an in-place copy into the old buffers would be invisible to keys on them)."""
    a = BSRLinear(16, 16, 4, density=0.5, generator=torch.Generator().manual_seed(0))
    b = BSRLinear(16, 16, 4, density=0.5, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the same nnz, another pattern: b's weight transposed block-wise
        mask = torch.zeros(4, 4, dtype=torch.bool)
        rows = torch.repeat_interleave(torch.arange(4), a.crow_indices.diff())
        mask[a.col_indices, rows] = True
        b._set_pattern(mask, torch.randn(int(mask.sum()), 4, 4))
    assert not torch.equal(a.col_indices, b.col_indices) or not torch.equal(a.crow_indices, b.crow_indices)
    x = torch.randn(16, 3)
    before = a.to_bsr()
    bsrkit.bsr_dense_mm(before.detach(), x)  # plans for a's pattern
    a.load_state_dict(b.state_dict())
    got = bsrkit.bsr_dense_mm(a.to_bsr().detach(), x)
    torch.testing.assert_close(got, b.to_dense() @ x)


# -- operands of different dtypes raise as nn.Linear does (they used to crash or give garbage) ---------


@pytest.mark.parametrize(
    ("layer_dtype", "x_dtype"),
    [
        (torch.float16, torch.float32),
        (torch.float32, torch.float64),
        (torch.float32, torch.float16),
        (torch.float32, torch.int64),
        (torch.bfloat16, torch.float32),
    ],
)
@pytest.mark.parametrize("n", [1, 16, 32])
def test_mixed_dtypes_raise_like_nn_linear(backend, layer_dtype, x_dtype, n):
    layer = BSRLinear(64, 32, 16, density=1.0, generator=torch.Generator().manual_seed(0)).to(layer_dtype)
    x = torch.randn(n, 64).to(x_dtype)
    with pytest.raises(RuntimeError, match="mat1 and mat2 must have the same dtype") as linear:
        torch.nn.Linear(64, 32).to(layer_dtype)(x)
    with pytest.raises(RuntimeError, match="same dtype") as ours:
        layer(x)
    assert isinstance(ours.value, TypeError) and isinstance(ours.value, ValueError)
    assert str(layer_dtype) in str(ours.value) and str(x_dtype) in str(ours.value), linear.value


def test_custom_op_checks_dtypes_and_shapes_itself(backend):
    from bsrkit import custom_ops

    layer = BSRLinear(32, 32, 8, density=0.5, generator=torch.Generator().manual_seed(0))
    crow, col, values = layer.crow_indices, layer.col_indices, layer.values.detach()
    for dense in (torch.randn(32, 4, dtype=torch.float64), torch.randn(32, 4).half()):
        with pytest.raises(TypeError, match="values.dtype"):
            custom_ops.bsr_mm(crow, col, values, dense, 32, 32, False)
    with pytest.raises(TypeError, match="int64"):
        custom_ops.bsr_mm(crow, col, values.long(), torch.ones(32, 4, dtype=torch.long), 32, 32, False)
    with pytest.raises(ValueError, match="dense of shape"):
        custom_ops.bsr_mm(crow, col, values, torch.randn(16, 4), 32, 32, False)
    with pytest.raises(TypeError, match="mat1.dtype"):
        custom_ops.sampled_mm(crow, col, torch.randn(32, 4), torch.randn(4, 32).double(), 8, 8)


def test_load_state_dict_assign_with_another_dtype_raises_on_forward(backend):
    layer = BSRLinear(64, 32, 16, density=0.5, generator=torch.Generator().manual_seed(0))
    state = {k: v.double() if v.is_floating_point() else v for k, v in layer.state_dict().items()}
    layer.load_state_dict(state, assign=True)
    assert layer.values.dtype == torch.float64
    with pytest.raises(RuntimeError, match="same dtype"):
        layer(torch.randn(8, 64))
    y = layer(torch.ones(8, 64, dtype=torch.float64))
    assert y.dtype == torch.float64
    assert_close(y, torch.ones(8, 64, dtype=torch.float64) @ layer.to_dense().mT + layer.bias.detach(), k=64)


# -- serialization: compact col_indices, checkpoints of another nnz, meta-device initialisation --------


def _layer(density: float, seed: int, **kw) -> BSRLinear:
    return BSRLinear(64, 48, (16, 8), density=density, generator=torch.Generator().manual_seed(seed), **kw)


def test_col_indices_own_compact_storage_and_safetensors_round_trip(tmp_path):
    layer = _layer(0.5, 0)
    for name in ("crow_indices", "col_indices"):
        t = getattr(layer, name)
        assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    path = tmp_path / "w.pt"
    torch.save(layer.state_dict(), path)
    payload = sum(t.numel() * t.element_size() for t in layer.state_dict().values())
    assert path.stat().st_size < payload + 4096  # no tensor written with a storage twice its size
    st = pytest.importorskip("safetensors.torch")
    st.save_model(layer, str(tmp_path / "w.safetensors"))
    other = _layer(0.5, 1)
    st.load_model(other, str(tmp_path / "w.safetensors"))
    x = torch.randn(5, 64)
    assert torch.equal(other(x), layer(x))


@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("strict", [True, False])
def test_loads_a_checkpoint_of_another_nnz(backend, assign, strict):
    source, layer = _layer(0.3, 0), _layer(0.8, 1)
    assert source.values.shape[0] != layer.values.shape[0]
    x = torch.randn(7, 64)
    layer(x)  # plans cached for the old pattern
    result = layer.load_state_dict(source.state_dict(), strict=strict, assign=assign)
    assert not result.missing_keys and not result.unexpected_keys
    assert layer.values.shape == source.values.shape and layer.values.requires_grad
    assert isinstance(layer.values, torch.nn.Parameter)
    assert torch.equal(layer.to_dense(), source.to_dense())
    assert_close(layer(x), source(x), k=64)
    layer(x).sum().backward()
    assert layer.values.grad is not None and layer.values.grad.shape == source.values.shape


@pytest.mark.parametrize("assign", [False, True])
def test_a_load_of_another_pattern_of_the_same_nnz_drops_the_values_gradient(assign):
    """Its rows were the old pattern's blocks (read as the new ones' afterwards); another nnz dropped it
    already. A load of the same pattern keeps it, as nn.Linear's keeps its weight's."""
    a, b = (BSRLinear(32, 32, 8, density=0.25, generator=torch.Generator().manual_seed(s)) for s in (0, 1))
    assert not torch.equal(a.col_indices, b.col_indices) and a.values.shape == b.values.shape
    a(torch.randn(4, 32)).sum().backward()
    a.load_state_dict(a.state_dict(), assign=assign)
    assert a.values.grad is not None or assign  # (assign: the checkpoint's Parameter, its own gradient)
    if assign:
        a(torch.randn(4, 32)).sum().backward()
    a.load_state_dict(b.state_dict(), assign=assign)
    assert a.values.grad is None


def test_resuming_from_a_checkpoint_of_another_nnz_keeps_training_the_values():
    """Build, make the optimizer, load the model's then the optimizer's state: the usual resume. The
    values Parameter stays the object the optimizer holds (as nn.Linear's weight does), so the resumed
    steps train it, and they take the steps the uninterrupted run takes."""
    x, y = torch.randn(16, 64, dtype=torch.float64), torch.randn(16, 48, dtype=torch.float64)

    def steps(layer, opt, n):
        for _ in range(n):
            opt.zero_grad()
            (layer(x) - y).square().mean().backward()
            opt.step()

    trained = _layer(0.3, 0).double()
    opt = torch.optim.Adam(trained.parameters(), lr=1e-2)
    steps(trained, opt, 2)
    checkpoint = ({k: v.clone() for k, v in trained.state_dict().items()}, copy.deepcopy(opt.state_dict()))
    resumed = _layer(0.8, 1).double()
    assert resumed.values.shape != trained.values.shape
    opt2 = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    values = resumed.values
    resumed.load_state_dict(checkpoint[0])
    opt2.load_state_dict(checkpoint[1])
    assert resumed.values is values  # the optimizer's parameter
    steps(trained, opt, 2)
    steps(resumed, opt2, 2)
    torch.testing.assert_close(resumed.values, trained.values, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_load_of_another_nnz_trains_while_an_earlier_graph_lives(dtype):
    """A graph of an earlier step (its loss still referenced, as in any loop) holds the values'
    gradient accumulator, made for the old shape: the next backward after a load of another nnz failed
    on it ("invalid gradient ... expected shape compatible with")."""
    layer, other = _layer(0.5, 0).to(dtype), _layer(0.25, 1).to(dtype)
    x = torch.randn(3, 64, dtype=dtype)
    loss = layer(x).square().sum()
    loss.backward()
    layer.load_state_dict(other.state_dict())
    layer.values.grad = None
    loss = layer(x).square().sum()
    loss.backward()
    other(x).square().sum().backward()
    torch.testing.assert_close(layer.values.grad, other.values.grad)


@pytest.mark.parametrize(
    "corrupt",
    ["drop_col", "drop_values", "col_length", "bias_shape", "block_shape", "crow_shape", "col_range"],
)
def test_a_checkpoint_it_cannot_take_changes_nothing(corrupt):
    source, layer = _layer(0.3, 0), _layer(0.8, 1)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    state = dict(source.state_dict())
    if corrupt == "drop_col":
        del state["col_indices"]
    elif corrupt == "drop_values":
        del state["values"]
    elif corrupt == "col_length":
        state["col_indices"] = state["col_indices"][:-1]
    elif corrupt == "bias_shape":
        state["bias"] = torch.zeros(47)
    elif corrupt == "block_shape":
        state["values"] = state["values"].reshape(-1, 8, 16)
    elif corrupt == "crow_shape":
        state["crow_indices"] = torch.cat([state["crow_indices"], state["crow_indices"][-1:]])
    else:
        state["col_indices"] = state["col_indices"] + 100
    for strict in (True, False):
        with pytest.raises(ValueError, match="BSRLinear.load_state_dict"):
            layer.load_state_dict(state, strict=strict)
        # (a RuntimeError too, as nn.Linear's load errors: code catching those catches it)
        with pytest.raises(RuntimeError, match="BSRLinear.load_state_dict"):
            layer.load_state_dict(state, strict=strict)
    after = layer.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    layer(torch.randn(2, 64))  # still usable


def test_meta_device_init_then_assign_load(backend):
    source = _layer(0.4, 2)
    with torch.device("meta"):
        layer = _layer(0.9, 3)
    assert layer.values.device.type == "meta" and layer.crow_indices.device.type == "meta"
    layer.load_state_dict(source.state_dict(), assign=True)
    assert layer.values.device.type == "cpu" and isinstance(layer.values, torch.nn.Parameter)
    x = torch.randn(3, 64)
    assert_close(layer(x), source(x), k=64)
    explicit = _layer(0.5, 0, device="meta")
    assert explicit.values.is_meta and explicit.bias is not None and explicit.bias.is_meta


def test_meta_device_init_then_to_empty_and_reset_parameters(backend):
    """to_empty() leaves uninitialised buffers (a garbage pattern); reset_parameters() draws a pattern of
    the layer's block count and nn.Linear's initialisation in place, as nn.Linear's does."""
    with torch.device("meta"):
        layer = BSRLinear(64, 48, (16, 8), density=0.4)
    nnz = layer.values.shape[0]
    layer.to_empty(device="cpu")
    values, bias, crow, col = layer.values, layer.bias, layer.crow_indices, layer.col_indices
    layer.reset_parameters(generator=torch.Generator().manual_seed(1))
    assert layer.values is values and layer.bias is bias and layer.crow_indices is crow
    assert layer.col_indices is col and layer.values.shape[0] == nnz and int(crow[-1]) == nnz
    assert values.abs().max() <= 1 / 8 and bias.abs().max() <= 1 / 8 and values.abs().min() > 0
    x = torch.randn(5, 64)
    dense = layer.to_dense()
    assert_close(layer(x), x @ dense.T + bias, k=64)
    blocks = (dense.reshape(3, 16, 8, 8).abs().sum((1, 3)) > 0).sum()
    assert blocks == nnz  # (valid, distinct block columns: to_dense built them)
    # A second reset draws another pattern (the plans follow the rewritten buffers) of the same count.
    before = layer.to_dense()
    layer.reset_parameters(generator=torch.Generator().manual_seed(2))
    assert not torch.equal(layer.to_dense(), before)
    assert_close(layer(x), x @ layer.to_dense().T + bias, k=64)


# -- the custom ops: opcheck on each, second order (issue 24, item 4) ----------------------------------


def _opcheck_samples():
    from bsrkit import custom_ops

    layer = BSRLinear(16, 12, (4, 2), density=0.6, generator=torch.Generator().manual_seed(0))
    crow, col = layer.crow_indices, layer.col_indices
    values = layer.values.detach().double().requires_grad_()
    yield custom_ops.bsr_mm, (crow, col, values, torch.randn(16, 3, dtype=torch.float64), 12, 16, False)
    yield custom_ops.bsr_mm, (crow, col, values, torch.randn(12, 3, dtype=torch.float64), 12, 16, True)
    x = torch.randn(16, 3, dtype=torch.float64, requires_grad=True)
    yield custom_ops.bsr_mm, (crow, col, values, x, 12, 16, False)
    m1 = torch.randn(12, 5, dtype=torch.float64, requires_grad=True)
    m2 = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    yield custom_ops.sampled_mm, (crow, col, m1, m2, 4, 2)
    yield custom_ops.sampled_mm, (crow, col, m1.detach(), m2.detach(), 4, 2)
    bias = torch.randn(12, dtype=torch.float64, requires_grad=True)
    xl = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    yield custom_ops.linear, (crow, col, values, xl, bias, 12, 16, False)
    yield custom_ops.linear, (crow, col, values, xl[:, :12].detach(), None, 12, 16, True)
    yield custom_ops.linear, (crow, col, values.detach(), xl.detach().mT.contiguous().mT, None, 12, 16, False)
    product = torch.ops.bsrkit.linear_product.default  # (no autograd: inputs that need no gradient)
    plain, b = values.detach(), bias.detach()
    yield product, (crow, col, plain, xl.detach(), b, 12, 16, False)
    yield product, (crow, col, plain, xl.detach().reshape(5, 1, 16), None, 12, 16, False)
    yield product, (crow, col, plain, xl[:, :12].detach(), None, 12, 16, True)


def test_opcheck_every_custom_op(backend):
    if backend == "triton":
        pytest.skip("interpreter time: the registration is backend-free")
    assert set(torch.ops.bsrkit) == {"bsr_mm", "linear", "linear_product", "sampled_mm"}  # (each op here)
    for op, args in _opcheck_samples():
        torch.library.opcheck(op, args)


def test_the_ops_name_values_of_the_wrong_rank_as_their_fake_kernels_do():
    """Called directly (torch.ops.bsrkit), the product op raised a bare IndexError for 2-D values where its
    fake kernel, run under torch.compile, names them: both are ValueErrors naming the values' shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    bsr = torch.randn(32, 48, dtype=torch.float64).to_sparse_bsr((16, 16))
    parts = (bsr.crow_indices(), bsr.col_indices(), bsr.values().reshape(-1, 16), torch.randn(5, 48).double())
    args = [t.clone() for t in parts]  # (plain tensors: a fake mode cannot take views of a sparse one)
    with pytest.raises(ValueError, match=r"values of shape \(\*batch, nnz, Ms, Ks\).*got \(96, 16\)"):
        torch.ops.bsrkit.linear_product(*args, None, 32, 48, False)
    mode = FakeTensorMode()
    fakes = [mode.from_tensor(t) for t in args]
    with mode, pytest.raises(ValueError, match=r"values of shape \(nnz, Ms, Ks\), got \(96, 16\)"):
        torch.ops.bsrkit.linear_product(*fakes, None, 32, 48, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_product_op_computes_no_gradient_whatever_requires_one(dtype):
    """bsrkit::linear_product is the no-grad op: a half-type call whose bias requires grad raised "expected
    out=None when an argument requires grad" (the bias went to a product with an input)."""
    layer = BSRLinear(64, 32, 16, density=0.5, generator=torch.Generator().manual_seed(0)).to(dtype)
    layer.values.requires_grad_(False)
    x = torch.randn(5, 64).to(dtype)
    with torch.no_grad():
        expected = layer(x)
    got = torch.ops.bsrkit.linear_product(
        layer.crow_indices, layer.col_indices, layer.values, x, layer.bias, 32, 64, False
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_gradgradcheck_bsrlinear_values_and_input(backend):
    if backend == "triton":
        pytest.skip(
            "interpreter time (minutes): the formulas are backend-free; Triton's products are checked"
        )
    layer = BSRLinear(8, 8, (4, 2), density=0.6, generator=torch.Generator().manual_seed(0)).double()
    x = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)

    def f(values, x):
        return torch.func.functional_call(layer, {"values": values}, (x,))

    values = layer.values.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(f, (values, x))
    assert torch.autograd.gradgradcheck(f, (values, x))


# -- the layer's output layout and its no-grad path (issue 25) ------------------------------------------


@pytest.mark.parametrize("lead", [(1,), (7,), (2, 5)])
@pytest.mark.parametrize("grad", [False, True])
def test_output_is_row_major_like_nn_linear(lead, grad):
    layer = BSRLinear(32, 24, 8, density=0.5, generator=torch.Generator().manual_seed(1))
    x = torch.randn(*lead, 32)
    with torch.set_grad_enabled(grad):
        y = layer(x)
    assert y.is_contiguous() and y.shape == (*lead, 24)
    assert y.requires_grad == grad
    assert_close(y, _dense_twin(layer)(x), k=32)


def test_column_major_input_and_a_view_of_a_larger_tensor():
    layer = BSRLinear(16, 8, 4, density=0.5, generator=torch.Generator().manual_seed(2))
    base = torch.randn(16, 9)
    for x in (base.mT[:, :16].contiguous().mT.mT, base[:, 1:].mT.contiguous(), base.mT[2:5]):
        with torch.no_grad():
            assert_close(layer(x), _dense_twin(layer)(x), k=16)


def _write_another_pattern_in_place(layer: BSRLinear) -> None:
    """Move each block to the next free column of its row (if any), writing ``col_indices`` through numpy:
    no version counter sees it."""
    rows, cols = layer.out_features // layer.blocksize[0], layer.in_features // layer.blocksize[1]
    col = layer.col_indices.numpy()
    row_of = torch.repeat_interleave(torch.arange(rows), layer.crow_indices.diff()).numpy()
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    mask[row_of, col] = True
    kept = [(r, c) for r in range(rows) for c in range(cols) if mask[r, c]]
    moved = sorted((r, (c + 1) % cols) if not mask[r, (c + 1) % cols] else (r, c) for r, c in kept)
    before = col.copy()
    col[:] = [c for _, c in moved]
    assert (col != before).any()


def test_no_grad_path_follows_every_change_of_the_layer():
    """The no-grad forward keeps one wrapper per weight: a new pattern written in place (numpy, unseen by
    version counters), new buffers, a resized values tensor (``.data =``) and a loaded checkpoint of
    another nnz are all seen by the next call."""
    gen = torch.Generator().manual_seed(3)
    layer = BSRLinear(16, 16, 4, density=0.5, generator=gen)
    x = torch.randn(3, 16)
    with torch.no_grad():
        for _ in range(2):
            assert_close(layer(x), _dense_twin(layer)(x), k=16)
        _write_another_pattern_in_place(layer)  # (a new pattern, unseen by any version counter)
        assert_close(layer(x), _dense_twin(layer)(x), k=16)
        other = BSRLinear(16, 16, 4, density=0.25, generator=gen)
        layer.load_state_dict(other.state_dict())
        assert layer.values.shape[0] == other.values.shape[0]
        assert_close(layer(x), _dense_twin(other)(x), k=16)
        layer.values.data = layer.values.data * 2
        assert_close(layer(x), 2 * (_dense_twin(other)(x) - other.bias) + other.bias, k=16)


@pytest.mark.parametrize("bias", [True, False])
def test_a_repeated_no_grad_call_reruns_its_prepared_call_directly_and_stays_right(monkeypatch, bias):
    """From the third call of one input layout on, the no-grad forward reruns the prepared call by data
    addresses (dispatch.rerun_weight_call_directly), not through rerun_prepared, and its loop proves the
    pattern;
    a pattern written in place, an input of another layout or thread count, and new tuning state each
    leave that path and stay right."""
    from bsrkit import dispatch, tuning

    layer = BSRLinear(64, 32, 8, bias=bias, density=0.5, generator=torch.Generator().manual_seed(5))
    through = []
    real = dispatch.rerun_prepared
    monkeypatch.setattr(dispatch, "rerun_prepared", lambda *a: through.append(1) or real(*a))

    def right(x):
        assert_close(layer(x), _dense_twin(layer)(x), k=64)

    x = torch.randn(1, 64)
    with torch.no_grad():
        for _ in range(3):  # (checks, prepares, finds the prepared call)
            right(torch.randn(1, 64))
        calls, proofs = len(through), bsrkit.shortcut_info().loop_proofs
        for _ in range(3):
            right(torch.randn(1, 64))
        assert len(through) == calls  # (rerun directly)
        assert bsrkit.shortcut_info().loop_proofs == proofs + 3  # (each proving the pattern in its loop)
        _write_another_pattern_in_place(layer)
        stale = bsrkit.shortcut_info().loop_stale
        right(x)
        assert bsrkit.shortcut_info().loop_stale == stale + 1  # (the direct rerun's loop found it)
        for _ in range(3):
            right(torch.randn(1, 64))
        wide = torch.randn(2, 65)
        for _ in range(3):
            right(wide[1:, 1:])  # (another layout: an offset view)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1 if threads > 1 else 2)
            for _ in range(3):
                right(x)
        finally:
            torch.set_num_threads(threads)
        calls = len(through)
        monkeypatch.setattr(tuning, "resolve_state", lambda: ({}, set()))
        right(x)
        assert len(through) > calls  # (new tuning state: not rerun directly)


def _direct_reruns(monkeypatch) -> list[bool]:
    """Whether each call of dispatch.rerun_weight_call_directly reran (it returned the operand it ran on),
    from now on."""
    from bsrkit import dispatch

    direct: list[bool] = []
    real = dispatch.rerun_weight_call_directly

    def counted(*args):
        operand = real(*args)
        direct.append(operand is not None)
        return operand

    monkeypatch.setattr(dispatch, "rerun_weight_call_directly", counted)
    return direct


def test_a_direct_rerun_needs_no_kept_operand_and_finds_a_pattern_another_path_rebuilt(monkeypatch):
    """The direct rerun holds no kept operand: after a pattern written in place was found and rebuilt by
    the differentiable forward, the no-grad call's remembered prepared call runs its loop on its own
    (old) plan, finds the change, and the product is recomputed on the new pattern; later calls rerun
    directly again, each proving the new pattern."""
    layer = BSRLinear(64, 32, 8, density=0.5, generator=torch.Generator().manual_seed(6))
    direct = _direct_reruns(monkeypatch)

    def right(x):
        assert_close(layer(x).detach(), _dense_twin(layer)(x.detach()), k=64)

    x = torch.randn(1, 64)
    with torch.no_grad():
        for _ in range(4):
            right(x)
    assert direct[-1] is True  # (the direct path is taken)
    _write_another_pattern_in_place(layer)
    right(torch.randn(1, 64, requires_grad=True))  # (the differentiable path: a full proof, rebuilt)
    stale = bsrkit.shortcut_info().loop_stale
    with torch.no_grad():
        right(x)
        assert bsrkit.shortcut_info().loop_stale == stale + 1  # (its old plan's loop found the change)
        del direct[:]
        for _ in range(4):
            right(x)
        assert direct[-1] is True  # (rerun directly again, on the new pattern's prepared call)
        assert bsrkit.shortcut_info().loop_stale == stale + 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(2, 3, 64),  # (rows one stride apart: a view, rerun directly)
        lambda: torch.randn(3, 2, 64).transpose(0, 1),  # (rows not: copied each call, never rerun so)
        lambda: torch.randn(64),
        lambda: torch.randn(4, 1, 1, 64)[1:3],
    ],
    ids=["3d", "3d-transposed", "1d", "4d-offset"],
)
def test_the_no_grad_product_takes_any_leading_dims_and_reruns_directly_only_on_a_view(monkeypatch, make):
    """The no-grad forward hands the input as it is to linear_product (no reshape on the direct rerun):
    every leading layout gives the dense twin's result and shape, and the direct rerun is taken exactly
    where the input's rows are a view of its memory (its addresses are the prepared call's operand)."""
    layer = BSRLinear(64, 32, 8, bias=True, density=0.5, generator=torch.Generator().manual_seed(7))
    direct = _direct_reruns(monkeypatch)
    viewable = None
    with torch.no_grad():
        for _ in range(5):
            x = make()
            got = layer(x)
            assert got.shape == (*x.shape[:-1], 32) and got.is_contiguous()
            assert_close(got, _dense_twin(layer)(x), k=64)
            viewable = x.reshape(-1, 64).data_ptr() == x.data_ptr()
    assert direct and direct[-1] is viewable


def test_frozen_weights_take_the_no_grad_path_and_input_grads_still_flow():
    layer = BSRLinear(16, 8, 4, density=0.5, generator=torch.Generator().manual_seed(4)).requires_grad_(False)
    before = bsrkit.shortcut_info().weight_hits
    x = torch.randn(2, 16)
    layer(x)
    layer(x)
    assert bsrkit.shortcut_info().weight_hits > before
    xg = torch.randn(2, 16, requires_grad=True)
    layer(xg).sum().backward()
    assert_close(xg.grad, _dense_twin(layer).weight.sum(0).expand(2, 16), k=8)


def test_a_load_that_fails_after_resizing_leaves_the_layer_as_it_was():
    """A checkpoint of another nnz whose values cannot be copied (torch reports the failure after the
    layer made room for the new nnz): the layer keeps its pattern and values, not uninitialised memory."""
    source, layer = _layer(0.3, 0), _layer(0.8, 1)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(2, 64)
    with torch.no_grad():
        y = layer(x)
    state = dict(source.state_dict())
    state["values"] = state["values"].to("meta")  # passes the checks, fails in torch's copy
    with pytest.raises(RuntimeError):
        layer.load_state_dict(state)
    after = layer.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    with torch.no_grad():
        assert torch.equal(layer(x), y)


@pytest.mark.parametrize("density", [0.25, 0.5])  # another nnz, then the same
def test_tied_layers_load_a_checkpoint_and_stay_tied(density):
    def tied(density):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
        model[2].weight = model[0].weight
        bsrkit.sparsify_(model, blocksize=4, density=density, force=True)
        return model

    source, model = tied(0.25), tied(0.5)
    model.load_state_dict(tied(density).state_dict() if density == 0.5 else source.state_dict())
    expected = source if density == 0.25 else tied(0.5)
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected(x))
    first, second = model[0], model[2]
    assert first.values is second.values
    assert first.crow_indices is second.crow_indices and first.col_indices is second.col_indices


@pytest.mark.parametrize(
    "x, error, match",
    [
        ([[1.0] * 64], TypeError, "expected input to be a torch.Tensor, got list"),
        (None, TypeError, "expected input to be a torch.Tensor, got NoneType"),
        (np.ones((2, 64), np.float32), TypeError, "expected input to be a torch.Tensor, got ndarray"),
        (torch.eye(64)[:2].to_sparse_csr(), TypeError, "expected input to be a strided"),
        (torch.eye(64)[:2].to_sparse(), TypeError, "expected input to be a strided"),
    ],
)
def test_forward_names_an_input_that_is_not_a_dense_tensor(x, error, match):
    with pytest.raises(error, match=match):
        _layer(0.5, 0)(x)


def test_a_bias_of_another_dtype_raises_like_f_linear():
    layer = _layer(0.5, 0)
    layer.bias = torch.nn.Parameter(layer.bias.detach().double())
    with pytest.raises(RuntimeError, match=r"bias\.dtype == torch\.float32"):
        layer(torch.randn(2, 64))
    with pytest.raises(RuntimeError):  # (torch's own)
        torch.nn.functional.linear(torch.randn(2, 64), layer.to_dense(), layer.bias)


def test_a_checkpoint_of_other_features_is_refused_like_nn_linear(tmp_path):
    """No tensor of a checkpoint holds in_features (a layer of fewer has the same shapes): the module
    metadata carries it, through torch.save and a weights_only load."""
    small = BSRLinear(48, 32, (8, 16), density=1.0, generator=torch.Generator().manual_seed(0))
    big = BSRLinear(64, 32, (8, 16), density=0.5, generator=torch.Generator().manual_seed(1))
    torch.save(small.state_dict(), tmp_path / "small.pt")
    state = torch.load(tmp_path / "small.pt", weights_only=True)
    before = big.to_dense()
    with pytest.raises(
        ValueError, match=r"\(out_features, in_features\) = \(32, 48\), this layer has \(32, 64\)"
    ):
        big.load_state_dict(state)
    assert torch.equal(big.to_dense(), before)
    model = torch.nn.Sequential(BSRLinear(48, 32, (8, 16), density=0.5))
    model.load_state_dict(torch.nn.Sequential(small).state_dict())  # (under a prefix, same features)
    assert torch.equal(model[0].to_dense(), small.to_dense())
    with pytest.raises(ValueError, match="0. is of a BSRLinear"):
        torch.nn.Sequential(big).load_state_dict(torch.nn.Sequential(small).state_dict())
    big.load_state_dict(dict(small.state_dict()), strict=False)  # (no metadata: as before, the weak check)


def test_a_keep_vars_state_dict_has_its_pattern_checked_too():
    source = BSRLinear(64, 32, (8, 16), density=0.5, generator=torch.Generator().manual_seed(1))
    for keep_vars in (False, True):
        state = dict(source.state_dict(keep_vars=keep_vars))
        state["col_indices"] = state["col_indices"].clone()
        state["col_indices"][0] = 99
        layer = BSRLinear(64, 32, (8, 16), density=0.5, generator=torch.Generator().manual_seed(1))
        with pytest.raises(ValueError, match="malformed pattern"):
            layer.load_state_dict(state)
        assert torch.equal(layer.to_dense(), source.to_dense())


def test_prune_and_parametrize_on_a_layers_tensors_are_honoured():
    """torch.nn.utils.prune and parametrize move a tensor out of _parameters (forward read it there:
    a raw KeyError)."""
    import torch.nn.utils.parametrize as parametrize
    import torch.nn.utils.prune as prune

    x = torch.randn(3, 64, dtype=torch.float64)
    for name, apply in (
        ("values", lambda m: prune.random_unstructured(m, "values", amount=0.3)),
        ("bias", lambda m: prune.random_unstructured(m, "bias", amount=0.5)),
        ("bias", lambda m: parametrize.register_parametrization(m, "bias", _Doubled())),
    ):
        layer = BSRLinear(64, 32, 16, density=0.5, dtype=torch.float64)
        apply(layer)
        want = x @ layer.to_dense().mT + layer.bias
        torch.testing.assert_close(layer(x), want, msg=name)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), want, msg=name)


class _Doubled(torch.nn.Module):
    def forward(self, t):
        return 2 * t


def test_a_layer_made_under_inference_mode_runs_outside_it():
    with torch.inference_mode():
        layer = BSRLinear(64, 32, 16, density=0.5)
    x = torch.randn(2, 64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), x @ layer.to_dense().mT + layer.bias)


def test_a_bsr_whose_values_were_given_another_dtype_is_refused_not_misread():
    """`.data =` or module.half() on the values a BSR was built from leaves the tensor saying one dtype
    and its values another (torch refuses it; the kernels read the bytes as the tensor's dtype, past
    their end: a segfault at 4096²)."""
    crow, col = torch.tensor([0, 1, 2]), torch.tensor([0, 1])
    values = torch.randn(2, 16, 16, dtype=torch.float64)
    bsr = torch.sparse_bsr_tensor(crow, col, values, size=(32, 32))
    x = torch.randn(32, 4, dtype=torch.float64)
    bsrkit.bsr_dense_mm(bsr, x)
    values.data = values.data.float()
    for call in (lambda: bsrkit.bsr_dense_mm(bsr, x), lambda: bsrkit.bsr_transposed_dense_mm(bsr, x)):
        with pytest.raises(ValueError, match="its values are torch.float32, the tensor says torch.float64"):
            call()


def test_a_negative_view_given_as_values_is_read_as_its_value():
    crow, col = torch.tensor([0, 1, 2]), torch.tensor([0, 1])
    values = torch.randn(2, 16, 16)
    bsr = torch.sparse_bsr_tensor(crow, col, values, size=(32, 32))
    x = torch.randn(32, 4)
    bsrkit.bsr_dense_mm(bsr, x)
    values.data = torch._neg_view(torch.randn(2, 16, 16))
    for _ in range(2):
        torch.testing.assert_close(bsrkit.bsr_dense_mm(bsr, x), bsr.to_dense() @ x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_from_dense_ranks_half_blocks_by_their_true_norms(dtype):
    """Norms in float32 at least: in float16 blocks of 64s and 128s both overflow to inf (and tie); in
    bfloat16 close norms round together."""
    w = torch.full((4, 8), 64.0)  # (a block's squared norm 16 * 64**2 > 65504: inf in float16)
    w[:, 4:] = 128.0
    linear = torch.nn.Linear(8, 4, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(w.to(dtype))
    layer = BSRLinear.from_dense(linear, 4, 0.5)
    assert layer.col_indices.tolist() == [1]
    big = torch.nn.Linear(256, 256, dtype=dtype)
    layer = BSRLinear.from_dense(big, 16, 0.25)
    norms = big.weight.detach().double().reshape(16, 16, 16, 16).transpose(1, 2).square().sum((-1, -2))
    kept = torch.zeros(256, dtype=torch.bool)
    kept[norms.flatten().topk(64).indices] = True
    assert torch.equal(
        layer.to_dense().reshape(16, 16, 16, 16).transpose(1, 2).ne(0).any(-1).any(-1).flatten(), kept
    )


def test_from_dense_names_a_module_that_is_not_a_linear():
    class Conv1D(torch.nn.Module):  # (transformers' layout: weight (in, out))
        def __init__(self):
            super().__init__()
            self.nf, self.weight, self.bias = (
                4,
                torch.nn.Parameter(torch.randn(8, 4)),
                torch.nn.Parameter(torch.zeros(4)),
            )

    with pytest.raises(TypeError, match="expected linear to be an nn.Linear, got Conv1D .*sparsify_"):
        BSRLinear.from_dense(Conv1D(), 4, 1.0)
    with pytest.raises(TypeError, match="expected linear to be an nn.Linear, got Embedding"):
        BSRLinear.from_dense(torch.nn.Embedding(4, 4), 4, 1.0)


@pytest.mark.parametrize("shape", [(5, 0), (2, 3, 0), (0,)])
def test_no_input_features_as_nn_linear(shape):
    layer = BSRLinear(0, 4, (4, 1), density=0.0)
    dense = torch.nn.Linear(0, 4)
    with torch.no_grad():
        dense.bias.copy_(layer.bias)
    x = torch.randn(shape)
    torch.testing.assert_close(layer(x), dense(x))
    x.requires_grad_()
    layer(x).sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
def test_a_half_type_bias_is_added_before_the_one_rounding_as_by_nn_linear(dtype, grad):
    """The bias joins the float32 sums and the output is rounded once, as F.linear rounds it: added to
    the product already rounded, 16-18% of these outputs were one rounding off (now a few, in the sums'
    order), with errors up to 1.25x F.linear's."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 64).to(dtype)
    with torch.no_grad():
        linear.bias.mul_(50)  # (a bias the size of the products: the second rounding matters)
    layer = BSRLinear.from_dense(linear, 16, 1.0)
    x = torch.randn(256, 256).to(dtype).requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        got = layer(x)
    expected = torch.nn.functional.linear(x.detach(), linear.weight, linear.bias)
    assert (got != expected).float().mean() < 0.01
    exact = x.detach().double() @ linear.weight.double().T + linear.bias.double()
    assert (got.double() - exact).abs().max() <= (expected.double() - exact).abs().max() * 1.01


@pytest.mark.parametrize("backend", backends("cpu", "torch"), indirect=True)
@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_under_autocast_as_nn_linear(low, backend):
    """The product runs in the autocast dtype (as F.linear's), gradients reach the float32 values; a
    float64 layer is left as it is (autocast leaves float64). On the torch backend too, whose bmm
    autocast turned to the half type (its float32 accumulator then refused the products)."""
    torch.manual_seed(0)
    layer = BSRLinear(64, 32, 16, density=0.5)
    dense = torch.nn.Linear(64, 32)
    with torch.no_grad():
        dense.weight.copy_(layer.to_dense())
        dense.bias.copy_(layer.bias)
    x = torch.randn(5, 64)
    with torch.autocast("cpu", low):
        got, want = layer(x), dense(x)
        assert got.dtype == want.dtype == low
        with torch.no_grad():
            assert layer(x).dtype == low
        got.float().square().sum().backward()
        want.float().square().sum().backward()
    assert layer.values.grad.dtype == torch.float32
    # (both against the exact product of the operands autocast hands over)
    exact = torch.nn.functional.linear(*(t.detach().to(low).double() for t in (x, dense.weight, dense.bias)))
    for result in (got, want):
        reference.assert_close(result, exact, low, 64)
    rows = torch.repeat_interleave(torch.arange(2), layer.crow_indices.diff())
    blocks = dense.weight.grad.reshape(2, 16, 4, 16).transpose(1, 2)[rows, layer.col_indices]
    torch.testing.assert_close(layer.values.grad, blocks, rtol=2e-2, atol=2e-2 * 8)
    torch.testing.assert_close(layer.bias.grad, dense.bias.grad, rtol=2e-2, atol=2e-2 * 8)
    wide = BSRLinear(64, 32, 16, density=0.5, dtype=torch.float64)
    with torch.autocast("cpu", low):
        assert wide(x.double()).dtype == torch.float64


def test_conversion_that_swaps_parameters_in_place():
    """torch.__future__.set_swap_module_params_on_conversion(True): .double() swaps the values Parameter
    in place (torch.utils.swap_tensors), which refuses a tensor with weak references: the kept weight's
    held one, so every conversion of a used layer failed."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        layer = BSRLinear(16, 16, 4, density=0.5)
        x = torch.randn(2, 16)
        y = layer(x).detach()
        values = layer.values
        layer.double()
        assert layer.values is values and values.dtype == torch.float64  # (swapped in place)
        torch.testing.assert_close(layer(x.double()), y.double())
        layer.float()
        torch.testing.assert_close(layer(x), y)
        # load_state_dict swaps too: after a forward it failed the same way
        other = BSRLinear(16, 16, 4, density=0.5)
        layer.load_state_dict(other.state_dict())
        torch.testing.assert_close(layer(x), other(x))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def test_parts_given_the_negative_bit_in_place_are_seen():
    """torch._neg_view reads the same memory as other values: a values view swapped in by .data after a
    forward gave the product of the old sign (the kept weight compared addresses and strides); an index
    view, negative columns, computed the old pattern instead of being refused."""
    torch.manual_seed(0)
    layer = BSRLinear(16, 12, 4, density=0.5)
    x = torch.randn(3, 16)
    with torch.no_grad():
        layer(x)
        layer.values.data = torch._neg_view(layer.values.detach())
        torch.testing.assert_close(layer(x), x @ layer.to_dense().T + layer.bias)
        layer.col_indices.data = torch._neg_view(layer.col_indices)
        with pytest.raises(ValueError, match="malformed weight: expected col_indices in"):
            layer(x)


def test_a_layer_first_called_under_inference_mode_caches_its_plans(monkeypatch):
    """Its kept wrapper was built in the caller's inference mode: an inference tensor is never cached, so
    every later call, in any mode, validated the pattern and built its plans again."""
    from bsrkit import plans

    checks = []
    original = plans.pattern_defect
    monkeypatch.setattr(plans, "pattern_defect", lambda *a, **k: checks.append(1) or original(*a, **k))
    layer = BSRLinear(64, 64, 8, density=0.5).eval()
    x = torch.randn(4, 64)
    with torch.inference_mode():
        for _ in range(5):
            y = layer(x)
    with torch.no_grad():
        for _ in range(5):
            torch.testing.assert_close(layer(x), y)
    assert len(checks) == 1


@pytest.mark.parametrize("grad", [False, True])
def test_a_layer_on_another_device_than_its_input_is_refused_by_name(grad):
    layer = BSRLinear(16, 16, 4, density=0.5, device="meta")
    x = torch.randn(2, 16, requires_grad=grad)
    with pytest.raises(ValueError, match=r"BSRLinear.forward\(\): expected input.device == meta"):
        layer(x)


def test_one_index_tensor_alone_is_judged_with_the_layers_other():
    layer = BSRLinear(16, 16, 4, density=0.5, generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    crow = before["crow_indices"].clone()
    crow[1] = 99
    col = torch.full_like(before["col_indices"], 7)
    for partial in ({"crow_indices": crow}, {"col_indices": col}, {"crow_indices": crow.float()}):
        with pytest.raises(ValueError, match="malformed pattern|expected"):
            layer.load_state_dict(partial, strict=False)
        with pytest.raises(ValueError, match="malformed pattern|expected"):  # (strict: all keys there)
            layer.load_state_dict({**before, **partial}, strict=True)
        assert all(torch.equal(layer.state_dict()[k], v) for k, v in before.items())


def test_a_failed_load_of_the_same_nnz_leaves_the_layer_as_it_was():
    layer = BSRLinear(16, 16, 4, density=0.5, generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    other = BSRLinear(16, 16, 4, density=0.5, generator=torch.Generator().manual_seed(5)).state_dict()
    assert other["values"].shape == before["values"].shape
    assert not torch.equal(other["col_indices"], before["col_indices"])
    other["values"] = other["values"].to("meta")  # (cannot be copied from: the load fails there)
    with pytest.raises(RuntimeError):
        layer.load_state_dict(other)
    assert all(torch.equal(layer.state_dict()[k], v) for k, v in before.items())
    x = torch.randn(3, 16)
    assert_close(layer(x), x @ layer.to_dense().T + layer.bias)


@pytest.mark.parametrize("wrap", ["parametrized_bias", "pruned_values"])
def test_a_failed_load_leaves_a_parametrized_or_pruned_layer_as_it_was(wrap):
    """The restore put the computed attribute (a plain tensor) into _parameters: a parametrized bias was
    then read stale (outputs off by 2.2), a pruned layer's every forward raised."""
    import torch.nn.utils.parametrize as parametrize
    import torch.nn.utils.prune as prune

    class Twice(torch.nn.Module):
        def forward(self, b):
            return b * 2

    layer = BSRLinear(
        64, 48, 16, density=0.5, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    if wrap == "parametrized_bias":
        parametrize.register_parametrization(layer, "bias", Twice())
    else:
        prune.l1_unstructured(layer, "values", amount=0.3)
    names = [(n, type(p)) for n, p in layer.named_parameters()]
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    broken = "values" if wrap == "parametrized_bias" else "bias"  # (an entry BSRLinear's own load copies)
    state[broken] = state[broken].to("meta")  # (cannot be copied from: the load fails there)
    with pytest.raises(RuntimeError):
        layer.load_state_dict(state)
    assert [(n, type(p)) for n, p in layer.named_parameters()] == names
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(1.0)  # (the layer reads its parameters as they are now)
    x = torch.randn(4, 64, dtype=torch.float64)
    assert_close(layer(x), x @ layer.to_dense().T + layer.bias)


@pytest.mark.parametrize("wrap", ["prune", "weight_norm"])
def test_a_pruned_or_weight_normed_layer_loads_its_state_and_a_failed_load_restores_it(wrap):
    """A successful load raised KeyError 'values' (the gradient check read the moved parameter by name);
    a failed one restored values and bias only, leaving prune's values_orig the checkpoint's: silently
    other outputs."""
    import torch.nn.utils.prune as prune

    def make(seed):
        layer = BSRLinear(
            32, 32, 8, density=0.5, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
        )
        if wrap == "prune":
            prune.l1_unstructured(layer, "values", amount=0.2)
        else:
            torch.nn.utils.weight_norm(layer, name="values", dim=0)
        return layer

    layer, other = make(0), make(1)
    x = torch.randn(4, 32, dtype=torch.float64)
    before = layer(x).detach()
    layer.load_state_dict({k: v.clone() for k, v in layer.state_dict().items()})
    assert_close(layer(x), before)
    state = other.state_dict()
    broken = "values_mask" if wrap == "prune" else "values_g"
    state[broken] = state[broken][:-1]  # (the wrong shape: torch's load fails there, after the others)
    with pytest.raises(RuntimeError, match="size mismatch"):
        layer.load_state_dict(state)
    assert_close(layer(x), before)


def test_a_load_of_another_nnz_under_inference_mode_leaves_the_layer_trainable():
    """Its new memory was made there: inference tensors, which backward cannot save (nn.Linear's load
    copies into its own)."""
    layer = BSRLinear(64, 48, 16, density=0.4, generator=torch.Generator().manual_seed(0))
    other = BSRLinear(64, 48, 16, density=0.75, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        layer.load_state_dict(other.state_dict())
    assert not layer.values.is_inference() and not layer.col_indices.is_inference()
    x = torch.randn(4, 64)
    layer(x).sum().backward()
    assert layer.values.grad.shape == other.values.shape
    assert_close(layer(x), other(x))


@pytest.mark.parametrize("density", [0.4, 0.75])
def test_a_failed_load_under_inference_mode_leaves_the_layer_trainable(density):
    """The restore's copies were made under the caller's inference mode and put back into the layer."""
    layer = BSRLinear(64, 48, 16, density=0.4, generator=torch.Generator().manual_seed(0))
    state = dict(
        BSRLinear(64, 48, 16, density=density, generator=torch.Generator().manual_seed(1)).state_dict()
    )
    state["bias"] = [0.0] * 48  # (torch's load refuses it: the layer is put back)
    with torch.inference_mode(), pytest.raises(RuntimeError):
        layer.load_state_dict(state)
    assert not any(t.is_inference() for t in (*layer.parameters(), *layer.buffers()))
    layer(torch.randn(4, 64)).sum().backward()


def test_a_load_of_another_nnz_names_the_entries_that_are_tensors():
    layer = BSRLinear(64, 48, 16, density=0.4, generator=torch.Generator().manual_seed(0))
    state = dict(BSRLinear(64, 48, 16, density=0.75, generator=torch.Generator().manual_seed(1)).state_dict())
    state["values"] = state["values"].tolist()
    with pytest.raises(ValueError, match=r"together as tensors, got \['crow_indices', 'col_indices'\]"):
        layer.load_state_dict(state)


def test_density_is_the_fraction_of_blocks_stored():
    for seed in range(20):
        layer = BSRLinear(16, 16, 4, density=0.25, generator=torch.Generator().manual_seed(seed))
        assert layer.values.shape[0] == 4


def test_pattern_written_between_forward_and_backward_is_refused():
    """A numpy write of the layer's pattern after its forward moves no counter torch's saved tensors see;
    the backward would differentiate another matrix, so it raises (as the products do). Rewriting the same
    pattern is no change."""
    torch.manual_seed(0)
    layer = BSRLinear(12, 8, blocksize=(2, 4), density=0.5, dtype=torch.float64)
    col = layer.col_indices.clone()
    x = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    for write, refused in ((col.clone(), False), ((col + 1) % 3, True)):
        y = layer(x)
        layer.col_indices.numpy()[:] = write.numpy()
        if refused:
            with pytest.raises(RuntimeError, match="written in place between the forward and the backward"):
                y.square().sum().backward()
        else:
            y.square().sum().backward()
        layer.col_indices.numpy()[:] = col.numpy()


def test_forward_takes_nn_linear_s_argument_name_and_the_dense_gradient_sees_it():
    """A model calling ``self.proj(input=h)`` broke on the swap (``forward(x)``), and RigL's dense
    gradient record read positional arguments only."""
    from bsrkit.regrow import DenseGradient

    layer = BSRLinear(16, 8, 4, density=0.5, dtype=torch.float64)
    x = torch.randn(3, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(input=x), layer(x))
    record = DenseGradient(layer)
    record.armed = True
    grad = torch.randn(3, 8, dtype=torch.float64)
    layer(input=x).backward(grad)
    total = record.take()
    assert total is not None
    torch.testing.assert_close(total, grad.mT @ x)
    record.remove()


def test_a_numpy_density_is_taken_as_a_number():
    """np.float32(0.5) was refused by BSRLinear while RigL and sparse_below took numpy numbers; a bool is
    still no density."""
    a = BSRLinear(16, 16, 4, density=np.float32(0.5), generator=torch.Generator().manual_seed(0))
    b = BSRLinear(16, 16, 4, density=0.5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.col_indices, b.col_indices)
    for bad in (True, np.True_):
        with pytest.raises(TypeError, match="expected density to be a real number"):
            BSRLinear(16, 16, 4, density=bad)


@pytest.mark.parametrize("shape", [(8, 16), (3, 2, 16)])
def test_a_first_call_in_inference_mode_leaves_later_calls_working(shape):
    """The prepared call kept by a first product in inference mode held an inference tensor (its copy of
    x), which every later call outside inference mode had to write: they all raised."""
    layer = BSRLinear(16, 32, 4, density=0.5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = torch.randn(*shape, dtype=torch.float64)
    expected = x @ layer.to_dense().T + layer.bias.detach()
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), expected)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected)
    torch.testing.assert_close(layer(x), expected)  # (values require grad: the differentiable call)


def test_one_call_s_output_and_gradients_come_from_one_pattern(monkeypatch):
    """A thread writing the pattern in place could land between the forward's record of the pattern and
    its product, then write the old pattern back before the backward: the output came from one pattern,
    the gradients from the other, silently. The forward now records the (validated) pattern its product
    ran on, and the backward computes with that one, or refuses a live pattern that differs from it."""
    from bsrkit import custom_ops

    layer = BSRLinear(64, 32, 8, density=0.5, generator=torch.Generator().manual_seed(6))
    x = torch.randn(3, 64, requires_grad=True)
    layer(x).sum().backward()  # (the pattern's plans and prepared calls exist)
    before = layer.col_indices.clone()
    real = custom_ops.linear_product

    def written_first(*args, **kwargs):  # (the other thread's write, just before the product)
        _write_another_pattern_in_place(layer)
        return real(*args, **kwargs)

    monkeypatch.setattr(custom_ops, "linear_product", written_first)
    y = layer(x)
    monkeypatch.setattr(custom_ops, "linear_product", real)
    assert_close(y.detach(), _dense_twin(layer)(x.detach()), k=64)  # (the product ran on the new pattern)
    layer.col_indices.numpy()[:] = before.numpy()  # (written back before the backward)
    with pytest.raises(RuntimeError, match="written in place between the forward and the backward"):
        y.sum().backward()


def test_a_layer_keeps_two_wrappers_at_most_as_its_pattern_changes():
    """The eager backward computes on the forward's validated copy of the pattern, a second set of index
    tensors: a values tensor keeps a wrapper for each (no rebuild every step), never more."""
    from bsrkit import shortcuts

    layer = BSRLinear(64, 32, 8, density=0.5, generator=torch.Generator().manual_seed(6))
    x = torch.randn(3, 64, requires_grad=True)
    for _ in range(6):
        layer(x).sum().backward()
        _write_another_pattern_in_place(layer)
        slots = shortcuts._weights[id(layer.values)][1]
        assert 1 <= len(slots) <= shortcuts.WEIGHT_SLOTS
    for _ in range(2):  # (the first steps on the new pattern prepare its calls)
        layer(x).sum().backward()
    weight_hits = bsrkit.shortcut_info().weight_hits
    layer(x).sum().backward()
    assert bsrkit.shortcut_info().weight_hits == weight_hits + 2  # (forward and backward: kept wrappers)


def test_the_linear_op_names_a_wrong_x():
    from bsrkit import custom_ops

    layer = BSRLinear(16, 12, 4, density=0.5)
    args = (layer.crow_indices, layer.col_indices, layer.values.detach())
    with pytest.raises(ValueError, match=r"linear\(\): expected x of shape \(N, 16\), got \(2, 3, 16\)"):
        custom_ops.linear(*args, torch.randn(2, 3, 16), None, 12, 16, False)
    with pytest.raises(TypeError, match=r"linear\(\): expected x.dtype == torch.float32"):
        custom_ops.linear(*args, torch.randn(2, 16, dtype=torch.float64), None, 12, 16, False)
