r"""Gradual block pruning with fine-tuning: from a trained dense model to a block-sparse one.

:class:`GradualPruner` lowers the block density of the selected linear layers along the cubic schedule of
Zhu & Gupta (2017) while the model trains: at step :math:`t` in :math:`[t_0, t_1]` the density is

.. math::
    d_t = d_f + (1 - d_f)\,\Bigl(1 - \frac{t - t_0}{t_1 - t_0}\Bigr)^3,

reached every ``every`` steps by removing, among each layer's kept blocks, those of lowest score:

* ``"magnitude"``: the block's Frobenius norm :math:`\|W_b\|_F` (block pruning by magnitude);
* ``"movement"``: the block's accumulated movement :math:`S_b = \sum_t -\sum_{ij \in b} W_{ij} G_{ij}`
  (Sanh et al. 2020, per block as in Lagunas et al. 2021): blocks the optimizer moves away from zero
  score high.

With ``regrow=RigL(...)`` (:mod:`bsrkit.regrow`) the pattern also changes at constant density: every
``RigL.every`` steps each pruned layer drops its weakest kept blocks and grows as many where the dense
gradient is largest (Evci et al. 2020). ``start_step=0, end_step=1`` trains sparse almost from scratch:
the target density after the first step, then only regrowth.

While a layer is denser than ``sparse_below`` (default: the break-even density of its device and
blocksize, :func:`bsrkit.sparsify.break_even_density`) it trains as a masked dense ``nn.Linear``: after
each optimizer step the removed blocks' weights are zero again, and their optimizer state fresh (every
per-parameter state tensor of the weight's shape: see :mod:`bsrkit.repattern`). From the first pattern
change that takes it below, it trains on block-sparse products: it becomes a :class:`~bsrkit.nn.BSRLinear`
storing the kept blocks, and each later pattern change rewrites that layer's pattern in place
(:func:`bsrkit.repattern.move`). Either way a kept block keeps its weights and optimizer state, a removed
block's are dropped and a regrown block starts at zero, and each step computes the gradients the masked
dense model computes (a masked-dense layer's removed blocks get a zero gradient, as block-sparse storage
has none: a clipped gradient norm is the same either way). When the stored shape changes
(``nn.Linear.weight`` becoming ``BSRLinear.values``, the number of kept blocks changing) the weight is a
new ``Parameter``, which takes the old one's place in the optimizer's ``param_groups`` and state; anything
else holding the old one (a second optimizer, a list of parameters kept aside, a wrapper that records
modules or shapes such as DDP or ``torch.compile``) must be told. At constant density (regrowth) the
``Parameter`` stays. :meth:`GradualPruner.finalize` makes every pruned layer a ``BSRLinear`` holding
exactly the final pattern.

Use::

    pruner = GradualPruner(model, opt, blocksize=32, target_density=0.25, start_step=100, end_step=1100,
                           every=100)
    for step in range(steps):
        loss = loss_fn(model(x), y); opt.zero_grad(); loss.backward(); opt.step()
        pruner.step()
    pruner.finalize()
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bsrkit import repattern
from bsrkit.nn import BSRLinear
from bsrkit.places import module_places, put
from bsrkit.regrow import DenseGradient, GradientRecord, RigL, drop_and_grow
from bsrkit.sparsify import (
    break_even_density,
    check_selected,
    check_ties_whole,
    default_filter,
    foreign_holders,
    selector,
)
from bsrkit.validation import (
    Density,
    check_blocksize,
    check_density,
    check_size,
    exact_density,
    is_density,
    kept_blocks,
    type_name,
)

__all__ = ["GradualPruner", "RigL", "cubic_density"]


def cubic_density(step: int, start_step: int, end_step: int, target_density: Density) -> Density:
    """:math:`d_t` of the module docstring: 1 before ``start_step``, ``target_density`` from ``end_step``."""
    for name, value in (("step", step), ("start_step", start_step), ("end_step", end_step)):
        check_size("cubic_density", name, value)
    check_density("cubic_density", target_density, "target_density")
    if start_step >= end_step:
        raise ValueError(f"cubic_density(): expected start_step < end_step, got {start_step} and {end_step}")
    if step <= start_step:
        return 1.0
    if step >= end_step:
        return target_density
    progress = (step - start_step) / (end_step - start_step)
    target = float(target_density)
    return target + (1 - target) * (1 - progress) ** 3


def _score_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype a layer's blocks are scored in: float64 for float64 weights (as ``BSRLinear.from_dense``
    ranks them), else float32 (half squares and products underflow)."""
    return torch.float64 if weight.dtype == torch.float64 else torch.float32


def _averaged_over(
    group: Any, grad: torch.Tensor | None, shape: tuple[int, int], device: Any
) -> torch.Tensor | None:
    """The dense gradient averaged over the ranks of ``group`` (:attr:`RigL.replicas`), a rank that recorded
    none counting zeros, as DDP counts an unused parameter's gradient; None where no rank recorded one.
    Each rank recorded the gradient of its own batch: ranks growing blocks by their own chose different
    patterns, and their replicas diverged. One collective for every rank, record or not."""
    buffer = torch.zeros(shape[0] * shape[1] + 1, dtype=torch.float32, device=device)
    if grad is not None:
        buffer[:-1] = grad.reshape(-1)
        buffer[-1] = 1.0
    torch.distributed.all_reduce(buffer, group=group)
    if not buffer[-1]:
        return None
    return buffer[:-1].div_(torch.distributed.get_world_size(group)).view(shape)


@dataclasses.dataclass
class _Layer:
    fqn: str
    places: list[str]  # every name of the module (fqn first): a module used twice is swapped at both
    module: nn.Linear | BSRLinear
    mask: torch.Tensor  # (out / bo, in / bi) bool: kept blocks
    score: torch.Tensor  # (out / bo, in / bi) in _score_dtype: accumulated movement (movement criterion)
    sparse_below: float  # the density below which it trains block-sparse
    kept: int  # mask.sum(), kept on the host (a step that changes no pattern synchronises no device)
    # The gradient hook: a sparse layer's dense gradient for regrowth, or a masked-dense layer's masking
    capture: GradientRecord | None = None

    @property
    def sparse(self) -> bool:
        return isinstance(self.module, BSRLinear)


class MaskedGradient(GradientRecord):
    r"""A masked-dense layer's gradient: the masked dense model's :math:`\partial L / \partial W = G
    \odot M` (its removed blocks' gradient zero, so that a clipped norm or any other reader of the
    gradient sees what it sees once the layer is stored block-sparse), recording :math:`G` itself over the
    backward passes run while :attr:`armed` (regrowth grows where it is largest), as
    :class:`~bsrkit.regrow.DenseGradient` records a block-sparse layer's."""

    def __init__(self, layer: _Layer, blocksize: tuple[int, int]) -> None:
        self._layer, self._blocksize = layer, blocksize
        self._expanded: tuple[torch.Tensor, torch.Tensor] | None = None  # (mask, its element mask)
        super().__init__(repattern.weight_of(layer.module).register_hook(self._backward))

    def _backward(self, grad: torch.Tensor) -> torch.Tensor | None:
        if self.armed:  # (a copy: autograd may accumulate into the gradient it hands on)
            self._add(grad.detach().clone())
        layer = self._layer
        if layer.kept == layer.mask.numel():
            return None  # (nothing removed yet: the gradient as it is)
        if self._expanded is None or self._expanded[0] is not layer.mask:
            self._expanded = (layer.mask, ~repattern.expand(layer.mask, self._blocksize))
        return grad.masked_fill(self._expanded[1], 0)


class GradualPruner:
    """Gradual block pruning of ``model``'s linear layers while ``optimizer`` trains it (module docstring).

    ``filter_fn(module, fqn)`` selects the layers (default: :func:`bsrkit.sparsify.default_filter`'s
    ``nn.Linear`` layers, every one whose shape the blocksize divides except the output head; its
    transformers ``Conv1D`` layers are skipped, and refused when a ``filter_fn`` selects them); a module
    used at several places is swapped at all of them, and two selected layers holding one weight (tied)
    raise ``ValueError``. Call :meth:`step` after each
    ``optimizer.step()``, before the gradients are cleared (the movement criterion and RigL read them);
    the density changes at the steps ``start_step + k * every`` up to ``end_step`` (and at
    ``end_step``). Without ``regrow`` a layer never regains a removed block; with
    ``regrow=RigL(fraction, every, until)`` blocks are also swapped at constant density.

    ``sparse_below``: a layer trains on block-sparse products once its density is below this (a number in
    [0, 1]; ``"break_even"``, the default: :func:`~bsrkit.sparsify.break_even_density` of its device,
    dtype and blocksize; None: masked dense until :meth:`finalize`).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        blocksize: int | tuple[int, int],
        target_density: Density,
        start_step: int,
        end_step: int,
        every: int,
        criterion: str = "magnitude",
        filter_fn: Callable[[nn.Module, str], bool] | None = None,
        sparse_below: float | str | None = "break_even",
        regrow: RigL | None = None,
    ) -> None:
        op = "GradualPruner()"
        if not isinstance(model, nn.Module):
            raise TypeError(f"{op}: expected model to be an nn.Module, got {type_name(model)}")
        # A wrapper holding the optimizer as .optimizer (accelerate's, and others) is unwrapped: the state
        # moved is the inner one's, and the per-optimizer rules (Adagrad's start value, LBFGS, Muon) test
        # its class.
        inner = optimizer
        while (
            inner is not None and not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer")
        ):
            inner = inner.optimizer
        if inner is not None and not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(  # (its state follows each new pattern: a list of parameters has none)
                f"{op}: expected optimizer to be a torch.optim.Optimizer (or a wrapper holding one as "
                f".optimizer) or None, got {type_name(optimizer)}"
            )
        optimizer = inner
        if filter_fn is not None and not callable(filter_fn):
            raise TypeError(f"{op}: expected filter_fn to be callable or None, got {type_name(filter_fn)}")
        bo, bi = check_blocksize("GradualPruner", blocksize)
        target_density = check_density("GradualPruner", target_density, "target_density")
        for name, value in (("start_step", start_step), ("end_step", end_step), ("every", every)):
            check_size(op[:-2], name, value)  # (an int: 1.5 steps would never be reached)
        if not (0 <= start_step < end_step) or every < 1:
            raise ValueError(
                f"{op}: expected 0 <= start_step < end_step and every >= 1, got start_step={start_step}, "
                f"end_step={end_step}, every={every}"
            )
        if criterion not in ("magnitude", "movement"):
            raise ValueError(f"{op}: expected criterion 'magnitude' or 'movement', got {criterion!r}")
        if not (sparse_below is None or sparse_below == "break_even" or is_density(sparse_below)):
            raise ValueError(
                f"{op}: expected sparse_below to be a number in [0, 1], 'break_even' or None, got "
                f"{sparse_below!r}"
            )
        if regrow is not None and not isinstance(regrow, RigL):
            raise TypeError(f"{op}: expected regrow to be a bsrkit.regrow.RigL or None, got {regrow!r}")
        self.model, self.optimizer = model, optimizer
        self.blocksize = (bo, bi)
        # (the schedule, in floats, reaches the float of the decimal given: np.float32(0.29)'s own float
        # is below 0.29, and its last steps kept 14 of 50 blocks, never regrown; the final count takes the
        # density as given, a Fraction exactly: see validation.kept_blocks)
        self.target_density, self.criterion = float(exact_density(target_density)), criterion
        self._exact_target = target_density
        self.start_step, self.end_step, self.every = start_step, end_step, every
        self.regrow = regrow
        self.steps = 0
        self.finalized = False  # (after finalize: no more regrowth, in this run and a resumed one)
        selected = filter_fn or default_filter((bo, bi), model)
        holders = foreign_holders(model)
        self._layers: list[_Layer] = []
        weights: dict[int, str] = {}
        skipped: list[str] = []
        chosen: list[tuple[str, nn.Module, list[str]]] = []
        places = module_places(model).values()
        for module, fqns in places:
            fqn = fqns[0]
            if not selected(module, fqn):
                continue
            if not isinstance(module, nn.Linear):  # (no Conv1D either: the pruner moves nn.Linear weights)
                if filter_fn is None:  # (the default's Conv1D, which sparsify_ converts: skipped here)
                    skipped.append(fqn)
                    continue
                raise ValueError(f"{op}: filter_fn selected {fqn!r}, a {type_name(module)}, not an nn.Linear")
            out_f, in_f = check_selected(op, model, module, fqn, (bo, bi), holders)
            if not module.weight.requires_grad:  # (before any hook: nothing is left on the model)
                raise ValueError(
                    f"{op}: {fqn!r} is frozen (its weight does not require grad), and a gradual pruner "
                    "trains the layers it prunes: leave it out with filter_fn, or prune it once with "
                    "sparsify_ (frozen layers stay frozen there)"
                )
            tied = weights.setdefault(id(module.weight), fqn)
            if tied != fqn:
                raise ValueError(
                    f"{op}: {tied!r} and {fqn!r} share one weight (tied), and each layer is pruned on its "
                    "own: untie them, or leave both out with filter_fn"
                )
            chosen.append((fqn, module, fqns))
            grid = (out_f // bo, in_f // bi)
            device = module.weight.device
            if sparse_below is None:
                below = 0.0
            elif sparse_below == "break_even":
                below = break_even_density(device, (bo, bi), module.weight.dtype)
            else:
                below = float(sparse_below)
            self._layers.append(
                _Layer(
                    fqn,
                    fqns,
                    module,
                    torch.ones(grid, dtype=torch.bool, device=device),
                    torch.zeros(grid, dtype=_score_dtype(module.weight), device=device),
                    below,
                    grid[0] * grid[1],
                )
            )
        # (a selected layer tied to one left out would prune the other's weight, then hold it alone)
        check_ties_whole(  # (weights only: the pruner never replaces a bias, so a shared one stays shared)
            op, selector(filter_fn, (bo, bi)), chosen, places, "untie them, or leave both out with filter_fn",
            attrs=("weight",),
        )  # fmt: skip
        if not self._layers:
            conv = (
                f"; {len(skipped)} transformers Conv1D layers (GPT-2's, e.g. {skipped[0]!r}) are not pruned "
                "gradually: sparsify_ converts them once"
                if skipped
                else ""
            )
            raise ValueError(
                f"{op}: no layer selected (filter_fn, or no nn.Linear the blocksize divides){conv}"
            )
        muon = getattr(torch.optim, "Muon", None)
        if muon is not None and isinstance(optimizer, muon) and any(x.sparse_below > 0 for x in self._layers):
            raise ValueError(
                f"{op}: torch.optim.Muon trains 2-D parameters only, and a layer trained block-sparse "
                "stores its blocks as a 3-D Parameter: pass sparse_below=None (masked dense until "
                "finalize()), or another optimizer"
            )
        for layer in self._layers:
            self._start_capture(layer)
        self._arm()

    # -- the schedule ------------------------------------------------------------------------------------

    def density_at(self, step: int) -> float:
        """The scheduled density after ``step`` steps: it changes only at the pruning steps
        ``start_step + k * every`` (and ``end_step``)."""
        check_size("GradualPruner.density_at", "step", step)
        if step >= self.end_step:
            return self.target_density
        if step < self.start_step:
            return 1.0
        last = self.start_step + (step - self.start_step) // self.every * self.every
        return float(cubic_density(last, self.start_step, self.end_step, self.target_density))

    def densities(self) -> dict[str, float]:
        """Each layer's current block density (kept blocks / blocks)."""
        return {layer.fqn: layer.kept / layer.mask.numel() for layer in self._layers}

    def masks(self) -> dict[str, torch.Tensor]:
        """Each layer's kept blocks, ``(out / bo, in / bi)`` bool (copies)."""
        return {layer.fqn: layer.mask.clone() for layer in self._layers}

    def sparse_layers(self) -> list[str]:
        """The layers training on block-sparse products now (``BSRLinear``)."""
        return [layer.fqn for layer in self._layers if layer.sparse]

    # -- the training loop -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """One training step done: accumulate movement scores, prune at the scheduled steps, regrow at the
        regrowth steps, and bring each layer, its gradient and its optimizer state to its new pattern.
        After :meth:`finalize` it only counts the step: the patterns are final (a schedule not yet ended
        prunes no further)."""
        self.steps += 1
        if self.finalized:
            return
        density = self._exact_target if self.steps >= self.end_step else self.density_at(self.steps)
        update = self.regrow is not None and self.regrow.due(self.steps)
        for layer in self._layers:
            weight = repattern.weight_of(layer.module)
            if self.criterion == "movement" and weight.grad is not None:
                wide = _score_dtype(weight)  # (in half, products of small steps underflow to 0)
                moved = self._per_block(layer, -(weight.to(wide) * weight.grad.to(wide)))
                # A step a GradScaler skipped leaves inf gradients and moves nothing: its blocks add nothing
                # (a where, not a check: no device synchronisation).
                layer.score += torch.where(moved.isfinite(), moved, 0.0)
            new = layer.mask
            keep = kept_blocks(density, new.numel())
            if keep < layer.kept:
                score = self._score(layer).masked_fill(~new, -torch.inf)
                order = score.flatten().argsort(descending=True, stable=True)
                new = torch.zeros_like(new).flatten()
                new[order[:keep]] = True
                new = new.reshape(layer.mask.shape)
            if update:
                # The pruning first: a block it removes and the update grows back is a grown block (zero
                # weight and optimizer state), not a kept one. (The gradient to grow by is taken before:
                # a move to block-sparse storage starts a new record.)
                grad = layer.capture.take() if layer.capture is not None else None
                self._move(layer, new)
                new = self._regrow(layer, layer.mask, grad)
            self._move(layer, new)
        self._arm()

    def _per_block(self, layer: _Layer, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Per-block sums of ``t`` (stored as the layer stores its weight) as an ``(out / bo, in / bi)``
        grid, zero at the blocks not stored; added to ``out`` when given."""
        grid = torch.zeros(layer.score.shape, dtype=t.dtype, device=t.device) if out is None else out
        if layer.sparse:
            grid[layer.mask] += t.sum((-1, -2)).to(grid.dtype)
        else:
            grid += repattern.block_view(t, self.blocksize).sum((-1, -2)).to(grid.dtype)
        return grid

    def _magnitude(self, layer: _Layer) -> torch.Tensor:
        weight = repattern.weight_of(layer.module).detach()
        return self._per_block(layer, weight.to(_score_dtype(weight)).pow(2))

    def _score(self, layer: _Layer) -> torch.Tensor:
        return layer.score if self.criterion == "movement" else self._magnitude(layer)

    def _regrow(self, layer: _Layer, mask: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
        """``mask`` after a drop-and-grow update by the dense gradient ``grad`` (unchanged without one)."""
        assert self.regrow is not None
        weight = repattern.weight_of(layer.module)
        group = self.regrow.group()
        if group is not None:
            module = layer.module
            grad = _averaged_over(group, grad, (module.out_features, module.in_features), weight.device)
        if grad is None:
            trained = getattr(weight, "grad", None)  # (zeros: not this step)
            if layer.sparse and trained is not None and bool(trained.any()):
                warnings.warn(
                    f"GradualPruner: layer {layer.fqn!r} recorded no dense gradient in a step that "
                    "trained its weight, so RigL leaves its pattern as it is: its forward hook did not run "
                    "(a torch.compile'd graph traced without it ran instead: set "
                    "torch._dynamo.config.skip_nnmodule_hook_guards = False; see docs/pruning.md)",
                    RuntimeWarning,
                    stacklevel=4,  # (the caller of step, past torch.no_grad's wrapper)
                )
            return mask
        growth = repattern.block_view(grad.float(), self.blocksize).pow(2).sum((-1, -2))
        if not bool(growth.isfinite().all()):  # (a step a GradScaler skipped: no gradient to grow by)
            return mask
        return drop_and_grow(mask, self._magnitude(layer), growth, self.regrow.fraction_at(self.steps))

    def _move(self, layer: _Layer, new: torch.Tensor, sparse: bool | None = None) -> None:
        """Bring ``layer`` to the pattern ``new``: stored block-sparse if ``sparse`` (None: if it is already,
        or if ``new`` is below its ``sparse_below``)."""
        old = layer.mask
        if new is old and sparse is None and (layer.sparse or layer.kept == new.numel()):
            return  # (a masked-dense layer's removed blocks are zeroed again after every step)
        kept = layer.kept if new is old else int(new.sum())
        if sparse is None:
            sparse = layer.sparse or kept / new.numel() < layer.sparse_below
        module = repattern.move(layer.module, old, new, sparse, self.blocksize, self.optimizer)
        layer.mask, layer.kept = new, kept
        if new is not old:
            layer.score.masked_fill_(new & ~old, 0.0)  # a regrown block's movement starts again
        if module is layer.module:
            return
        put(self.model, layer.places, module)
        layer.module = module
        self._stop_capture(layer)
        self._start_capture(layer)

    def _start_capture(self, layer: _Layer) -> None:
        """A masked-dense layer's gradient hook (:class:`MaskedGradient`); a block-sparse layer's dense
        gradient while regrowth may still move its pattern."""
        if layer.capture is not None:
            return
        if not layer.sparse:
            layer.capture = MaskedGradient(layer, self.blocksize)
        elif self.regrow is not None and not self.finalized:
            layer.capture = DenseGradient(layer.module)

    def _arm(self) -> None:
        """Record the dense gradient of the sparse layers in the coming step if it ends in an update."""
        armed = self.regrow is not None and self.regrow.due(self.steps + 1)
        for layer in self._layers:
            if layer.capture is not None:
                layer.capture.armed = armed
                layer.capture.take()

    # -- the result --------------------------------------------------------------------------------------

    @torch.no_grad()
    def finalize(self) -> nn.Module:
        """Make each pruned layer a :class:`~bsrkit.nn.BSRLinear` holding exactly its final pattern (its
        kept blocks' weights and optimizer state; bias unchanged); returns the model (changed in place).
        The optimizer can go on training it; pruning and regrowth end (in a run resumed from
        :meth:`state_dict` too): :meth:`step` only counts steps from here.
        """
        self.finalized = True
        for layer in self._layers:
            self._move(layer, layer.mask, sparse=True)
            self._stop_capture(layer)
        return self.model

    @staticmethod
    def _stop_capture(layer: _Layer) -> None:
        if layer.capture is not None:
            layer.capture.remove()
            layer.capture = None

    def state_dict(self) -> dict[str, Any]:
        """The step count, masks, movement scores and which layers are block-sparse (for checkpointing a
        pruning run: load it before the model's and the optimizer's state, so that the layers have the
        checkpoint's kinds and shapes)."""
        return {
            "steps": self.steps,
            "masks": {layer.fqn: layer.mask.clone() for layer in self._layers},
            "scores": {layer.fqn: layer.score.clone() for layer in self._layers},
            "sparse": {layer.fqn: layer.sparse for layer in self._layers},
            "finalized": self.finalized,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = {layer.fqn for layer in self._layers}
        if not isinstance(state, dict):
            raise TypeError(
                f"GradualPruner.load_state_dict(): expected a dict (GradualPruner.state_dict()), got "
                f"{type_name(state)}"
            )
        if set(state.get("masks", {})) != names:
            raise ValueError(
                f"GradualPruner.load_state_dict(): expected masks for {sorted(names)}, got "
                f"{sorted(state.get('masks', {}))}"
            )
        op = "GradualPruner.load_state_dict()"
        lacking = [k for k in ("steps", "scores") if k not in state]
        if lacking:
            raise ValueError(f"{op}: expected a state with {lacking} (from GradualPruner.state_dict())")
        if set(state["scores"]) != names:
            raise ValueError(f"{op}: expected scores for {sorted(names)}, got {sorted(state['scores'])}")
        for layer in self._layers:
            for what, t, like in (
                ("mask", state["masks"][layer.fqn], layer.mask),
                ("scores", state["scores"][layer.fqn], layer.score),
            ):
                if not isinstance(t, torch.Tensor) or t.shape != like.shape:
                    got = tuple(t.shape) if isinstance(t, torch.Tensor) else type_name(t)
                    raise ValueError(
                        f"{op}: expected a {tuple(like.shape)} {what} for {layer.fqn!r}, got {got}"
                    )
                if what == "mask" and t.dtype is not torch.bool:  # (a float mask would cast to all True)
                    raise ValueError(f"{op}: expected a bool mask for {layer.fqn!r}, got {t.dtype}")
        check_size("GradualPruner.load_state_dict", "steps", state["steps"])
        self.steps = int(state["steps"])
        self.finalized = bool(state.get("finalized", False))
        sparse = state.get("sparse", {})  # (absent from checkpoints before block-sparse training)
        for layer in self._layers:
            mask = state["masks"][layer.fqn].to(torch.bool).to(layer.mask.device)
            self._move(layer, mask.clone(), sparse=bool(sparse.get(layer.fqn, False)))
            layer.score = state["scores"][layer.fqn].to(layer.score.device, layer.score.dtype).clone()
            if self.finalized:
                self._stop_capture(layer)
            else:  # (a state from before finalize(): regrowth goes on, so does the capture)
                self._start_capture(layer)
        self._arm()
