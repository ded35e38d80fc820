"""``BSRLinear``: a linear layer whose weight is block-sparse with a fixed pattern.

The block values are the parameter (``values``, shape ``(nnz, bo, bi)``); the pattern lives in two
buffers (``crow_indices``, ``col_indices``), so plans are cached for as long as the layer lives and are
recomputed whenever the pattern changes, whatever writes the buffers (``load_state_dict``, a DDP buffer
broadcast, an in-place pruning step): on CPU every plan hit compares the index data. On CUDA a hit
compares nothing by default (it would synchronise): ``load_state_dict`` gives the buffers new memory and
is seen; a write in place into them is seen under ``BSRKIT_CHECK_PLANS=1`` (see
:mod:`bsrkit.freshness`). Forward and backward run the
``bsrkit::linear`` / ``bsrkit::sampled_mm`` custom ops, which ``torch.compile`` can trace; where no
gradient is needed (``torch.no_grad``, inference, frozen weights) an eager forward calls the product
directly. The output is row-major, as ``nn.Linear``'s. On CPU an eager backward refuses a pattern
written since its forward by a path moving no version counter (numpy, a collective): its gradient would
be another matrix's; a backward ``torch.compile`` traced cannot compare data, and does not.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from bsrkit import custom_ops, dispatch, shortcuts
from bsrkit.eager import refuse_transforms
from bsrkit.validation import (
    ArgumentTypeError,
    CheckpointMismatchError,
    Density,
    autocast_inputs,
    check_blocksize,
    check_density,
    check_floating_dtype,
    check_operand_dtypes,
    check_same_device,
    check_size,
    kept_blocks,
    pattern_defect,
    type_name,
)

__all__ = ["BSRLinear"]

# The key of a layer's (out_features, in_features) in its state_dict's module metadata.
_FEATURES_KEY = "bsrkit_features"


def _rebind(t: torch.Tensor, source: torch.Tensor) -> None:
    """``t`` (the same object) now views ``source``'s memory, as ``t.set_(source)``."""
    t.set_(source.untyped_storage(), source.storage_offset(), source.shape, source.stride())


def _needs_grad(x: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and (
        x.requires_grad or values.requires_grad or (bias is not None and bias.requires_grad)
    )


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal index tensors, whatever their integer dtypes and devices."""
    return a.shape == b.shape and torch.equal(a.to(b.device, torch.int64), b.to(torch.int64))


class _SavedLayer(NamedTuple):
    """A layer as it was before a load (:meth:`BSRLinear._parts`), to put back if the load fails."""

    params: dict[str, Any]  # its registered parameters, the objects (assign=True replaces them)
    buffers: dict[str, Any]  # and buffers
    kept: dict[str, torch.Tensor]  # their memory, by name
    grad: torch.Tensor | None  # the values' gradient


def loaded_pattern(
    state_dict: dict[str, Any], prefix: str, crow_now: torch.Tensor, col_now: torch.Tensor
) -> tuple[Any, Any, tuple[torch.Tensor, torch.Tensor] | None]:
    """The ``crow_indices`` and ``col_indices`` entries a load of ``state_dict`` takes (None where absent),
    and the pattern they make where it can be judged: one index tensor alone with the layer's other one
    (``crow_now``, ``col_now``: together they are what it loads), and only index data that can be read
    (plain tensors with memory: a Parameter in a ``keep_vars=True`` state_dict, or meta, is none), else
    None."""
    crow, col = state_dict.get(prefix + "crow_indices"), state_dict.get(prefix + "col_indices")
    judged = (crow_now if crow is None else crow, col_now if col is None else col)
    readable = (crow is not None or col is not None) and all(
        type(t) is torch.Tensor and t.device.type != "meta" for t in judged
    )
    return crow, col, judged if readable else None


def check_loaded_pattern(
    op: str, prefix: str, pattern: tuple[torch.Tensor, torch.Tensor], blocks: tuple[int, int], nnz: int
) -> None:
    """:class:`~bsrkit.validation.CheckpointMismatchError` naming the defect of a pattern a load would take
    (:func:`loaded_pattern`) for ``blocks`` block rows and columns and ``nnz`` blocks."""
    defect = pattern_defect(*pattern, *blocks, nnz)
    if defect is not None:
        raise CheckpointMismatchError(
            f"{op}(): malformed pattern in {prefix}crow_indices and {prefix}col_indices: {defect}"
        )


def _check_divides(op: str, blocksize: tuple[int, int], features: tuple[int, int]) -> None:
    if features[0] % blocksize[0] or features[1] % blocksize[1]:
        raise ValueError(
            f"{op}: expected blocksize {blocksize} to divide (out_features, in_features) = {features}"
        )


def _check_generator(op: str, generator: Any) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ArgumentTypeError(
            f"{op}: expected generator to be a torch.Generator or None, got {type_name(generator)}"
        )


def _random_mask(grid: tuple[int, int], count: int, generator: torch.Generator | None) -> torch.Tensor:
    """``count`` of the ``grid``'s blocks, drawn at random (on the CPU whatever the default device: under
    ``torch.device("meta")`` the draw could not be read)."""
    chosen = torch.rand(grid, generator=generator, device="cpu").flatten().argsort()
    mask = torch.zeros(grid[0] * grid[1], dtype=torch.bool, device="cpu")
    mask[chosen[:count]] = True
    return mask.reshape(grid)


def _indices_of(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int64 (crow, col) indices of a bool block mask, each in storage of its own."""
    crow = torch.zeros(mask.shape[0] + 1, dtype=torch.int64, device="cpu")
    crow[1:] = mask.sum(1).cumsum(0)
    # A copy into its own storage: nonzero() is column-major, so its column 1 is already "contiguous"
    # at offset nnz of an (nnz, 2) storage, which torch.save would write whole and safetensors refuses.
    col = mask.nonzero()[:, 1].clone(memory_format=torch.contiguous_format)
    return crow, col


class BSRLinear(nn.Module):
    r""":math:`y = x W^T + b` with :math:`W` (``out_features x in_features``) block-sparse.

    ``blocksize`` is ``bo`` or ``(bo, bi)``: blocks of ``bo`` output by ``bi`` input features; both must
    divide the corresponding feature count. ``density`` is the fraction of blocks stored, chosen at random
    (``generator``); use :meth:`from_dense` to prune a trained ``nn.Linear`` instead. Initialisation
    matches ``nn.Linear`` (uniform in :math:`\pm 1/\sqrt{\mathrm{in\_features}}`) on the stored blocks.
    """

    crow_indices: torch.Tensor
    col_indices: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        blocksize: int | tuple[int, int],
        bias: bool = True,
        *,
        density: Density = 1.0,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        in_features = check_size("BSRLinear", "in_features", in_features)
        out_features = check_size("BSRLinear", "out_features", out_features)
        bo, bi = check_blocksize("BSRLinear", blocksize)
        density = check_density("BSRLinear", density)
        dtype = check_floating_dtype("BSRLinear", dtype)
        _check_generator("BSRLinear()", generator)
        _check_divides("BSRLinear()", (bo, bi), (out_features, in_features))
        self.in_features, self.out_features, self.blocksize = in_features, out_features, (bo, bi)
        # The pattern is drawn on the CPU whatever the default device (under ``torch.device("meta")`` its
        # size could not be read); only the values and the buffers go to ``device``.
        # (kept_blocks(density, blocks) of them, at random: the count from_dense and sparsify_ keep)
        grid = (out_features // bo, in_features // bi)
        mask = _random_mask(grid, kept_blocks(density, grid[0] * grid[1]), generator)
        bound = 1 / math.sqrt(in_features) if in_features else 0.0
        values = torch.empty((int(mask.sum()), bo, bi), device=device, dtype=dtype).uniform_(
            -bound, bound, generator=generator
        )
        self._set_pattern(mask, values)
        if bias:
            self.bias = nn.Parameter(
                torch.empty(out_features, device=device, dtype=dtype).uniform_(
                    -bound, bound, generator=generator
                )
            )
        else:
            self.register_parameter("bias", None)

    def _set_pattern(self, mask: torch.Tensor, values: torch.Tensor) -> None:
        device = values.device
        crow, col = _indices_of(mask)
        self.register_buffer("crow_indices", crow.to(device))
        self.register_buffer("col_indices", col.to(device))
        self.values = nn.Parameter(values)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        r"""A new random pattern of as many blocks as the layer stores, and the blocks and the bias drawn as
        ``nn.Linear`` draws them (uniform in :math:`\pm 1/\sqrt{\mathrm{in\_features}}`), written in place:
        the parameters and buffers stay the same tensors (an optimizer holding them still trains them).
        The step after ``to_empty()`` in a meta-device initialisation, whose buffers hold uninitialised
        memory until then."""
        _check_generator("BSRLinear.reset_parameters()", generator)
        bo, bi = self.blocksize
        grid = (self.out_features // bo, self.in_features // bi)
        crow, col = _indices_of(_random_mask(grid, self.values.shape[0], generator))
        bound = 1 / math.sqrt(self.in_features) if self.in_features else 0.0
        with torch.no_grad():
            self.crow_indices.copy_(crow)
            self.col_indices.copy_(col)
            self.values.uniform_(-bound, bound, generator=generator)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound, generator=generator)

    @classmethod
    def from_dense(cls, linear: nn.Linear, blocksize: int | tuple[int, int], density: Density) -> BSRLinear:
        """Prune ``linear`` to the ``kept_blocks(density, blocks)`` blocks of largest Frobenius norm (the
        count rounded half up)."""
        if not isinstance(linear, nn.Linear):  # (a Conv1D's weight is (in, out): it would be read transposed)
            conv1d = " (transformers' Conv1D stores its weight transposed: sparsify_ converts it)"
            raise TypeError(
                f"BSRLinear.from_dense(): expected linear to be an nn.Linear, got {type_name(linear)}"
                + (conv1d if type(linear).__name__ == "Conv1D" else "")
            )
        bo, bi = check_blocksize("BSRLinear.from_dense", blocksize)
        density = check_density("BSRLinear.from_dense", density)
        w = linear.weight.detach()
        if w.is_meta:
            raise ValueError(
                "BSRLinear.from_dense(): expected linear.weight to hold values (to rank its blocks), got a "
                "tensor on the meta device; load the dense weights first (a sparse checkpoint loads with "
                "bsrkit.load_sparse)"
            )
        out_f, in_f = w.shape
        _check_divides("BSRLinear.from_dense()", (bo, bi), (out_f, in_f))
        layer = cls(
            in_f, out_f, (bo, bi), bias=linear.bias is not None, density=0.0, device=w.device, dtype=w.dtype
        )
        blocks = w.reshape(out_f // bo, bo, in_f // bi, bi).transpose(1, 2)  # (MB, KB, bo, bi)
        # (in float32 at least: half norms overflow to inf, and tie, or round; as GradualPruner ranks them)
        norms = blocks.to(torch.promote_types(w.dtype, torch.float32)).pow(2).sum((-1, -2)).flatten()
        # (ties to the lower index, as GradualPruner breaks them: topk's order among equals is arbitrary)
        keep = norms.argsort(descending=True, stable=True)[: kept_blocks(density, norms.numel())]
        mask = torch.zeros(norms.numel(), dtype=torch.bool, device=w.device)
        mask[keep] = True
        mask = mask.reshape(blocks.shape[:2]).cpu()
        layer._set_pattern(mask, blocks[mask.to(w.device)].clone())
        if linear.bias is not None:
            assert layer.bias is not None
            layer.bias.data.copy_(linear.bias.detach())
            layer.bias.requires_grad_(linear.bias.requires_grad)
        layer.values.requires_grad_(linear.weight.requires_grad)  # (a frozen layer stays frozen)
        return layer.train(linear.training)  # (and one in eval mode in eval mode, as the model around it)

    def to_bsr(self) -> torch.Tensor:
        """The weight as a BSR tensor (sharing this layer's indices and values)."""
        return torch.sparse_bsr_tensor(
            self.crow_indices,
            self.col_indices,
            self.values,
            size=(self.out_features, self.in_features),
            check_invariants=False,
        )

    def _apply(self, fn: Any, recurse: bool = True) -> BSRLinear:
        # (a conversion may swap the values Parameter in place, torch.utils.swap_tensors, which refuses a
        # tensor with weak references: the kept weight's goes first; the next forward keeps a new one)
        values = self._parameters.get("values")
        if values is not None:
            shortcuts.forget_weight(values)
        return super()._apply(fn, recurse)

    def to_dense(self) -> torch.Tensor:
        """The weight as a dense ``(out_features, in_features)`` tensor."""
        return self.to_bsr().detach().to_dense()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = input  # (nn.Linear's argument name: a call by keyword, proj(input=h), works on the swap)
        try:
            bad = not x.ndim or x.shape[-1] != self.in_features or x.layout is not torch.strided
        except AttributeError:  # (not a tensor: checked below)
            bad = True
        if bad:
            self._refuse(x)
        refuse_transforms("nn.BSRLinear")
        # (the tables Module.__getattr__ would search: 0.1 µs a read instead of 0.8, on every decode step;
        # the attribute where torch.nn.utils.prune or parametrize moved one out of them)
        params, buffers = self._parameters, self._buffers
        values: torch.Tensor | None = params.get("values")
        bias: torch.Tensor | None = params.get("bias")
        if values is None:
            values = self.values
        if bias is None and "bias" not in params:
            bias = self.bias
        assert values is not None
        x, values, bias = autocast_inputs((x, values, bias))  # (as nn.Linear under torch.autocast)
        if x.dtype is not values.dtype or (bias is not None and bias.dtype is not values.dtype):
            check_operand_dtypes("BSRLinear.forward", "input", x, "values", values)
            if bias is not None:  # (as F.linear: one dtype for the three)
                check_operand_dtypes("BSRLinear.forward", "bias", bias, "values", values)
        crow, col = buffers.get("crow_indices"), buffers.get("col_indices")
        if crow is None or col is None:
            crow, col = self.crow_indices, self.col_indices
        assert crow is not None and col is not None
        M, K = self.out_features, self.in_features
        if x.device != values.device:  # (before anything reads the pattern: a layer on meta has none)
            check_same_device("BSRLinear.forward", "input", x, "values", values)
        if _needs_grad(x, values, bias):
            y = custom_ops.differentiable_linear(crow, col, values, dispatch.rows(x), bias, M, K, False)
            return y if x.ndim == 2 else y.reshape(*x.shape[:-1], M)
        if torch.compiler.is_compiling() or x.is_meta:  # (the plain op: traceable, and shapes on meta)
            return custom_ops.linear_product_op(crow, col, values, x, bias, M, K, False)
        # (no gradient to record: the product itself, on x as it is, without the dispatcher's ~30 µs)
        return custom_ops.linear_product(crow, col, values, x, bias, M, K, False)

    def _refuse(self, x: Any) -> None:
        """Raise the error that names what is wrong with ``x`` (not a tensor, not strided, a shape that
        does not end in ``in_features``)."""
        op = "BSRLinear.forward()"
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: expected input to be a torch.Tensor, got {type_name(x)}")
        if x.layout is not torch.strided:
            raise TypeError(f"{op}: expected input to be a strided (dense) tensor, got layout {x.layout}")
        raise ValueError(f"{op}: expected input of shape (*, {self.in_features}), got {tuple(x.shape)}")

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # The feature counts, which no tensor of the checkpoint holds (a layer of fewer in_features has
        # the same tensors' shapes), go with the module's metadata, as its version does: torch.save keeps
        # them and load_state_dict hands them back (a checkpoint without them loads as before).
        metadata = getattr(destination, "_metadata", None)
        if metadata is not None and prefix[:-1] in metadata:
            metadata[prefix[:-1]][_FEATURES_KEY] = (self.out_features, self.in_features)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # A checkpoint must load whole or fail here, naming the defect, before anything changes (not in a
        # later forward); one of another nnz resizes the values and col_indices first.
        values_now = self._parameters.get("values")
        if values_now is not None:  # (as in _apply: a swapping load refuses a weakly referenced tensor)
            shortcuts.forget_weight(values_now)
        crow, col, pattern = loaded_pattern(state_dict, prefix, self.crow_indices, self.col_indices)
        values = state_dict.get(prefix + "values")
        features = local_metadata.get(_FEATURES_KEY)
        if features is not None and tuple(features) != (self.out_features, self.in_features):
            raise CheckpointMismatchError(
                f"BSRLinear.load_state_dict(): {prefix or 'the checkpoint'} is of a BSRLinear with "
                f"(out_features, in_features) = {tuple(features)}, this layer has "
                f"{(self.out_features, self.in_features)}"
            )
        nnz = self._check_checkpoint(state_dict, prefix, crow, col, values, pattern)
        # (col_indices too: a tied layer, see sparsify_, finds the values its twin resized already)
        resize = nnz is not None and (nnz != self.values.shape[0] or nnz != self.col_indices.shape[0])
        # torch loads each entry on its own and goes on past a failed one: the layer as it was, to put
        # back (a new pattern with the old values, or the new nnz's uninitialised ones, is no layer)
        before = self._parts(copy_values=not resize)
        if resize:
            assert nnz is not None
            self._resize(nnz)
        errors = len(error_msgs)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if len(error_msgs) > errors:
            self._restore(before)
            return
        if pattern is not None:
            # New memory for the loaded pattern (the plans would see an in-place copy too: they compare
            # the index data on every hit; fresh storage drops the old plans at once instead). In place
            # (set_), so that layers sharing the buffers (tied by sparsify_) keep sharing them; assigned
            # buffers are the checkpoint's own tensors: replaced by copies instead.
            assign = local_metadata.get("assign_to_params_buffers", False)
            with torch.no_grad():
                for name in ("crow_indices", "col_indices"):
                    t = self._buffers[name]
                    assert t is not None
                    if assign:
                        setattr(self, name, t.clone())
                    else:
                        _rebind(t, t.clone())
            values = self._parameters.get("values")  # (None where torch's prune or weight norm moved it)
            if not resize and values is not None and values.grad is not None:
                old_pattern = (before.kept["crow_indices"], before.kept["col_indices"])
                new_pattern = (self.crow_indices, self.col_indices)
                if not all(_equal(a, b) for a, b in zip(old_pattern, new_pattern, strict=True)):
                    values.grad = None  # (its rows were the old pattern's blocks: dropped, as on a resize)

    def _check_checkpoint(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        crow: Any,
        col: Any,
        values: Any,
        pattern: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> int | None:
        """Raise :class:`~bsrkit.validation.CheckpointMismatchError` for a checkpoint this layer cannot
        take; return its nnz (None when it holds neither values nor col_indices). ``pattern``: the ``(crow,
        col)`` it would load, where they can be read (judged here), else None."""
        where = f"BSRLinear.load_state_dict(): {prefix}"
        bo, bi = self.blocksize
        blocks = (self.out_features // bo, self.in_features // bi)
        if isinstance(values, torch.Tensor) and (values.ndim != 3 or tuple(values.shape[1:]) != (bo, bi)):
            raise CheckpointMismatchError(
                f"{where}values: expected shape (nnz, {bo}, {bi}), got {tuple(values.shape)}"
            )
        if isinstance(crow, torch.Tensor) and tuple(crow.shape) != (blocks[0] + 1,):
            raise CheckpointMismatchError(
                f"{where}crow_indices: expected shape ({blocks[0] + 1},), got {tuple(crow.shape)}"
            )
        if isinstance(col, torch.Tensor) and col.ndim != 1:
            raise CheckpointMismatchError(
                f"{where}col_indices: expected shape (nnz,), got {tuple(col.shape)}"
            )
        bias = state_dict.get(prefix + "bias")
        if self.bias is not None and isinstance(bias, torch.Tensor) and bias.shape != self.bias.shape:
            raise CheckpointMismatchError(
                f"{where}bias: expected shape {tuple(self.bias.shape)}, got {tuple(bias.shape)}"
            )
        parts = {"crow_indices": crow, "col_indices": col, "values": values}
        sizes = {
            n: t.shape[0] for n, t in parts.items() if n != "crow_indices" and isinstance(t, torch.Tensor)
        }
        if not sizes:
            if pattern is not None:  # (a crow_indices alone, with this layer's col_indices)
                check_loaded_pattern(
                    "BSRLinear.load_state_dict", prefix, pattern, blocks, pattern[1].shape[0]
                )
            return None
        if len(set(sizes.values())) > 1:
            raise CheckpointMismatchError(
                f"{where}col_indices: expected as many entries as {prefix}values has blocks "
                f"({sizes['values']}), got {sizes['col_indices']}"
            )
        nnz = next(iter(sizes.values()))
        if nnz != self.values.shape[0] and not all(isinstance(t, torch.Tensor) for t in parts.values()):
            raise CheckpointMismatchError(
                f"BSRLinear.load_state_dict(): a checkpoint with nnz == {nnz} (this layer has "
                f"{self.values.shape[0]}) must hold crow_indices, col_indices and values together as "
                f"tensors, got {[prefix + n for n, t in parts.items() if isinstance(t, torch.Tensor)]}"
            )
        if pattern is not None:
            check_loaded_pattern("BSRLinear.load_state_dict", prefix, pattern, blocks, nnz)
        return nnz

    def _resize(self, nnz: int) -> None:
        """Make room for ``nnz`` blocks (the loader then copies or assigns the checkpoint's tensors). The
        ``values`` Parameter stays the same object, as ``nn.Linear``'s weight does through a load: an
        optimizer built before the load keeps training it (its state for the old shape must be replaced,
        as the usual ``optimizer.load_state_dict`` after the model's does). Its old gradient is dropped.
        ``col_indices`` stays the same object too (new memory, ``set_``): layers that share it stay tied."""
        values, col = self.values, self.col_indices
        # (under inference mode too, the new memory is of the layer's own kind: an inference tensor there
        # made the layer untrainable afterwards)
        with torch.no_grad(), torch.inference_mode(values.is_inference()):
            if values.shape[0] != nnz:
                # A graph of an earlier forward may hold values' gradient accumulator, made for the old
                # shape, which autograd reuses while it lives (the next backward failed on its shape):
                # set_data drops it only on a change of type, so the data passes through another dtype.
                shape, dtype = (nnz, *values.shape[1:]), values.dtype
                values.data = values.new_empty(
                    0, dtype=torch.float64 if dtype is torch.float32 else torch.float32
                )
                values.data = values.new_empty(shape, dtype=dtype)
                values.grad = None
            if col.shape[0] != nnz:
                _rebind(col, col.new_empty(nnz))

    def _parts(self, copy_values: bool) -> _SavedLayer:
        """What :meth:`_restore` needs to put the layer back as it is now (after a failed load): its
        registered parameters and buffers (the objects: ``assign=True`` replaces them; torch's prune and
        weight norm keep the real ones under names of their own, and the attributes they compute are no
        parameters), a copy of each one's memory (a load writes it in place; the values' memory itself
        unless ``copy_values``: a resize gives them new memory first, so the old stays as it is), and the
        values' gradient."""
        values = self._parameters.get("values")
        kept: dict[str, torch.Tensor] = {}
        tensors: dict[str, torch.Tensor | None] = {**self._parameters, **self._buffers}
        for name, t in tensors.items():
            if t is not None:
                # (a copy of the tensor's own kind: one made under the caller's inference mode, put back,
                # left a trainable layer holding inference tensors)
                with torch.inference_mode(t.is_inference()):
                    kept[name] = t.detach().clone() if copy_values or name != "values" else t.data
        grad = None if values is None else values.grad
        return _SavedLayer(dict(self._parameters), dict(self._buffers), kept, grad)

    def _restore(self, parts: _SavedLayer) -> None:
        params, buffers, kept, grad = parts
        self._parameters.update(params)
        self._buffers.update(buffers)
        with torch.no_grad():
            for name, t in (*params.items(), *buffers.items()):
                if t is not None:
                    t.data = kept[name]  # (the same objects: layers sharing them, tied, stay tied)
        values = params.get("values")
        if values is not None:
            values.grad = grad

    def extra_repr(self) -> str:
        nnz = self.values.shape[0]
        total = (self.out_features // self.blocksize[0]) * (self.in_features // self.blocksize[1])
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"blocksize={self.blocksize}, blocks={nnz}/{total}, bias={self.bias is not None}"
        )
