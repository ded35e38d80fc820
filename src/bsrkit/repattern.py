"""Moving a pruned linear layer from one block pattern to another, with its gradient and optimizer state.

A layer :class:`bsrkit.prune.GradualPruner` manages is either *masked dense* (an ``nn.Linear`` whose removed
blocks are zero) or *block-sparse* (a :class:`~bsrkit.nn.BSRLinear` storing the kept blocks only, in
row-major block order). :func:`move` takes it from one pattern (``old``, a ``(out / bo, in / bi)`` bool
mask) to another (``new``), either way of storing it, so that

* a block in both patterns keeps its weights, its gradient and its optimizer state (every per-parameter
  state tensor of the weight's shape: Adam's moments, momentum buffers; scalars such as Adam's ``step``
  stay as they are);
* a block only in ``old`` (removed) is gone: zero in a masked-dense layer, not stored in a sparse one;
* a block only in ``new`` (regrown) starts at zero weight, zero gradient and fresh state: zero, or where
  an optimizer starts a state elsewhere, that start (Rprop's step size at ``lr``, Adagrad's sum at
  ``initial_accumulator_value``: :data:`_FRESH_STATE`).

The weight keeps its ``Parameter`` while its stored shape stays (a sparse layer at constant density: the
data is written in place); a new shape gets a new ``Parameter`` (``nn.Linear.weight`` becoming
``BSRLinear.values``, a sparse layer's nnz changing), which takes the old one's place in the optimizer's
``param_groups`` and its state. (Assigning ``param.data`` of another shape instead would break the next
backward whenever a graph of an earlier step is still alive, e.g. through last step's ``loss``: autograd's
node for the parameter records its shape.) The bias stays the same object. A sparse layer's pattern is
rewritten in place: new ``crow_indices`` and ``col_indices`` buffers (new memory, so the plans of the old
pattern die with it).
"""

from __future__ import annotations

import warnings
from typing import TypeAlias, TypeGuard

import torch
from torch import nn

from bsrkit.nn import BSRLinear

__all__ = ["block_view", "expand", "move", "weight_of"]

Linear: TypeAlias = nn.Linear | BSRLinear


def block_view(t: torch.Tensor, blocksize: tuple[int, int]) -> torch.Tensor:
    """``(out, in)`` -> the ``(out / bo, in / bi, bo, bi)`` view of its blocks."""
    bo, bi = blocksize
    return t.reshape(t.shape[0] // bo, bo, t.shape[1] // bi, bi).transpose(1, 2)


def expand(mask: torch.Tensor, blocksize: tuple[int, int]) -> torch.Tensor:
    """A block mask as an element mask of the weight's shape."""
    bo, bi = blocksize
    return mask.repeat_interleave(bo, 0).repeat_interleave(bi, 1)


def weight_of(module: Linear) -> nn.Parameter:
    """The weight ``Parameter``: ``weight`` of an ``nn.Linear``, ``values`` of a ``BSRLinear``."""
    weight = module.values if isinstance(module, BSRLinear) else module.weight
    assert isinstance(weight, nn.Parameter)
    return weight


def _remap(
    t: torch.Tensor, old: torch.Tensor, new: torch.Tensor, sparse_before: bool, sparse_after: bool,
    blocksize: tuple[int, int], fresh: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """``t`` (the weight, its gradient or a state tensor, stored as before) stored as after: ``new``'s
    blocks, those ``old`` lacks ``fresh`` (and, stored dense, the blocks ``new`` lacks)."""
    bo, bi = blocksize
    if sparse_before:
        position = torch.full(old.shape, -1, dtype=torch.int64, device=t.device)
        position[old] = torch.arange(t.shape[0], device=t.device)
        index = position[new]
        found = index >= 0
        blocks = t.new_full((index.shape[0], bo, bi), fresh)
        blocks[found] = t[index[found]]
    else:
        blocks = block_view(t, blocksize)[new]
        blocks[~old[new]] = fresh
    if sparse_after:
        return blocks
    full = t.new_full((old.shape[0] * bo, old.shape[1] * bi), fresh)
    block_view(full, blocksize)[new] = blocks
    return full


# Per-element optimizer state whose fresh value is not zero: (optimizer class, state key) -> the
# parameter group's setting it starts from. A block that joins the pattern starts from it, as a new
# parameter would (zero would freeze an Rprop block: its step size is clamped to step_sizes[0]).
_FRESH_STATE = {
    (torch.optim.Rprop, "step_size"): "lr",
    (torch.optim.Adagrad, "sum"): "initial_accumulator_value",
}


def _fresh(optimizer: torch.optim.Optimizer | None, param: nn.Parameter, key: str) -> float:
    """The value a new block's state ``key`` starts at (:data:`_FRESH_STATE`; else zero)."""
    if optimizer is None:
        return 0.0
    for (kind, name), setting in _FRESH_STATE.items():
        if key == name and isinstance(optimizer, kind):
            for group in optimizer.param_groups:
                if any(p is param for p in group["params"]):
                    return float(group[setting])
    return 0.0


def _write_pattern(layer: BSRLinear, mask: torch.Tensor) -> None:
    device = layer.values.device
    mask = mask.cpu()
    crow = torch.zeros(mask.shape[0] + 1, dtype=torch.int64)
    crow[1:] = mask.sum(1).cumsum(0)
    col = mask.nonzero()[:, 1].clone(memory_format=torch.contiguous_format)
    layer.crow_indices = crow.to(device)
    layer.col_indices = col.to(device)


def _new_module(old: Linear, sparse: bool, blocksize: tuple[int, int]) -> Linear:
    """An empty layer of the other kind (on the meta device: the caller gives it its tensors), the same
    features and dtype, in the same train mode. (BSRLinear's random pattern is drawn from a generator of
    its own: the global random state, which dropout or data order may follow, is not touched.)"""
    dtype = weight_of(old).dtype
    out_f, in_f = old.out_features, old.in_features
    module: Linear
    if sparse:
        module = BSRLinear(in_f, out_f, blocksize, bias=False, density=0.0, generator=torch.Generator(),
                           device="meta", dtype=dtype)  # fmt: skip
    else:
        module = nn.Linear(in_f, out_f, bias=False, device="meta", dtype=dtype)
    module.train(old.training)
    return module


def _flat_history(optimizer: torch.optim.Optimizer | None) -> TypeGuard[torch.optim.LBFGS]:
    """Whether ``optimizer`` keeps one history over all its parameters flattened (LBFGS, on its first
    parameter) rather than state per parameter."""
    return isinstance(optimizer, torch.optim.LBFGS)


def _replace(
    optimizer: torch.optim.Optimizer | None, old: nn.Parameter, new: nn.Parameter, leaf: str
) -> nn.Parameter:
    """``new`` in ``old``'s place in the optimizer's parameter groups, with its state; where the groups
    name their parameters (``param_names``: an optimizer built from ``named_parameters()``), ``new`` is
    named as its module's ``leaf`` attribute (``values`` or ``weight``)."""
    if optimizer is not None:
        for group in optimizer.param_groups:
            params, names = group["params"], group.get("param_names")
            for i, p in enumerate(params):
                if p is old:
                    params[i] = new  # (in place: LBFGS, for one, holds the group's list itself)
                    if names is not None and i < len(names):
                        prefix, dot, _ = names[i].rpartition(".")
                        names[i] = prefix + dot + leaf
        if _flat_history(optimizer) and new.shape != old.shape:
            # Its state is one history over all parameters flattened, kept on the first: a parameter of
            # another size makes that history meaningless (and its vectors the wrong length). Start again,
            # its cached parameter count too (torch 2.11-2.13 name it _numel_cache).
            optimizer.state.clear()
            optimizer._numel_cache = None
        elif old in optimizer.state:
            optimizer.state[new] = optimizer.state.pop(old)
    return new


@torch.no_grad()
def move(
    module: Linear,
    old: torch.Tensor,
    new: torch.Tensor,
    sparse: bool,
    blocksize: tuple[int, int],
    optimizer: torch.optim.Optimizer | None,
) -> Linear:
    """Take ``module`` (holding the pattern ``old``) to the pattern ``new``, stored block-sparse if
    ``sparse``, with its gradient and its state in ``optimizer`` (module docstring); returns the module
    now holding it: ``module`` itself unless the way of storing changed, in which case the caller puts the
    returned one in its place."""
    param = weight_of(module)
    sparse_before = isinstance(module, BSRLinear)
    state = optimizer.state.get(param, {}) if optimizer is not None else {}
    shaped = [key for key, v in state.items() if isinstance(v, torch.Tensor) and v.shape == param.shape]
    if not sparse_before and not sparse:
        removed = ~expand(old & new, blocksize)  # in place, as the optimizer step left them
        param.masked_fill_(removed, 0)
        if param.grad is not None:  # (dropped, as a block-sparse layer's is)
            param.grad.masked_fill_(removed, 0)
        for key in shaped:
            state[key].masked_fill_(removed, _fresh(optimizer, param, key))
        return module
    if sparse_before and sparse and torch.equal(old, new):
        return module
    # State of another shape (Adafactor's row and column factors) has no blocks to follow the pattern:
    # the parameter's state restarts (the optimizer initialises an empty state at its next step).
    # (a flat history is restarted by _replace)
    other = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.ndim and k not in shaped]
    if other and not _flat_history(optimizer):
        warnings.warn(
            f"{type(optimizer).__name__} state {other} of shapes {[tuple(state[k].shape) for k in other]} "
            f"cannot follow a new block pattern (only state of the weight's shape {tuple(param.shape)} can): "
            "this layer's optimizer state restarts",
            RuntimeWarning,
            stacklevel=3,
        )
        state.clear()
        shaped = []
    for key in shaped:
        state[key] = _remap(
            state[key], old, new, sparse_before, sparse, blocksize, _fresh(optimizer, param, key)
        )
    grad = param.grad
    if grad is not None:
        grad = _remap(grad, old, new, sparse_before, sparse, blocksize)
    data = _remap(param.detach(), old, new, sparse_before, sparse, blocksize)
    if data.shape == param.shape:
        param.copy_(data)
    else:
        fresh = nn.Parameter(data, requires_grad=param.requires_grad)
        param = _replace(optimizer, param, fresh, "values" if sparse else "weight")
    param.grad = grad
    target = module if sparse_before == sparse else _new_module(module, sparse, blocksize)
    if isinstance(target, BSRLinear):
        target.values = param
        _write_pattern(target, new)  # (on the values' device)
    else:
        target.weight = param
    if target is not module:
        target.bias = module.bias
    return target
