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

Between pattern changes the layers train as masked dense layers: after each optimizer step the removed
blocks' weights are zero again, and their optimizer state (Adam's moments, momentum buffers: every
per-parameter state tensor of the weight's shape) is zeroed, so a removed block keeps no stale moments and
a block kept keeps its own. :meth:`GradualPruner.finalize` swaps each layer for a :class:`~bsrkit.nn.
BSRLinear` holding exactly the final pattern.

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
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bsrkit.nn import BSRLinear
from bsrkit.sparsify import default_filter

__all__ = ["GradualPruner", "cubic_density"]


def cubic_density(step: int, start_step: int, end_step: int, target_density: float) -> float:
    """:math:`d_t` of the module docstring: 1 before ``start_step``, ``target_density`` from ``end_step``."""
    if step <= start_step:
        return 1.0
    if step >= end_step:
        return target_density
    progress = (step - start_step) / (end_step - start_step)
    return target_density + (1 - target_density) * (1 - progress) ** 3


@dataclasses.dataclass
class _Layer:
    fqn: str
    module: nn.Linear
    mask: torch.Tensor  # (out / bo, in / bi) bool: kept blocks
    score: torch.Tensor  # (out / bo, in / bi) float32: accumulated movement (movement criterion)


class GradualPruner:
    """Gradual block pruning of ``model``'s linear layers while ``optimizer`` trains it (module docstring).

    ``filter_fn(module, fqn)`` selects the layers (default: :func:`bsrkit.sparsify.default_filter`, every
    ``nn.Linear`` whose shape the blocksize divides except the output head). Call :meth:`step` after each
    ``optimizer.step()``; the density changes at the steps ``start_step + k * every`` up to ``end_step``
    (and at ``end_step``), and a layer never regains a removed block.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        blocksize: int | tuple[int, int],
        target_density: float,
        start_step: int,
        end_step: int,
        every: int,
        criterion: str = "magnitude",
        filter_fn: Callable[[nn.Module, str], bool] | None = None,
    ) -> None:
        op = "GradualPruner()"
        bo, bi = (blocksize, blocksize) if isinstance(blocksize, int) else tuple(blocksize)
        if not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in (bo, bi)):
            raise ValueError(f"{op}: expected blocksize to be a positive int or pair, got {blocksize!r}")
        if isinstance(target_density, bool) or not isinstance(target_density, (int, float)):
            raise TypeError(
                f"{op}: expected target_density to be a number, got {type(target_density).__name__}"
            )
        if not 0 <= target_density <= 1:
            raise ValueError(f"{op}: expected target_density in [0, 1], got {target_density}")
        if not (0 <= start_step < end_step) or every < 1:
            raise ValueError(
                f"{op}: expected 0 <= start_step < end_step and every >= 1, got start_step={start_step}, "
                f"end_step={end_step}, every={every}"
            )
        if criterion not in ("magnitude", "movement"):
            raise ValueError(f"{op}: expected criterion 'magnitude' or 'movement', got {criterion!r}")
        self.model, self.optimizer = model, optimizer
        self.blocksize = (bo, bi)
        self.target_density, self.criterion = float(target_density), criterion
        self.start_step, self.end_step, self.every = start_step, end_step, every
        self.steps = 0
        selected = filter_fn or default_filter((bo, bi), model)
        self._layers: list[_Layer] = []
        for fqn, module in model.named_modules():
            if not fqn or not selected(module, fqn):
                continue
            if not isinstance(module, nn.Linear):
                raise ValueError(
                    f"{op}: filter_fn selected {fqn!r}, a {type(module).__name__}, not an nn.Linear"
                )
            out_f, in_f = module.out_features, module.in_features
            if out_f % bo or in_f % bi:
                raise ValueError(
                    f"{op}: expected blocksize {(bo, bi)} to divide the (out, in) features of {fqn!r}, got "
                    f"{(out_f, in_f)}"
                )
            grid = (out_f // bo, in_f // bi)
            device = module.weight.device
            self._layers.append(
                _Layer(
                    fqn,
                    module,
                    torch.ones(grid, dtype=torch.bool, device=device),
                    torch.zeros(grid, dtype=torch.float32, device=device),
                )
            )
        if not self._layers:
            raise ValueError(f"{op}: no layer selected (filter_fn, or no nn.Linear the blocksize divides)")

    # -- the schedule ------------------------------------------------------------------------------------

    def density_at(self, step: int) -> float:
        """The scheduled density after ``step`` steps: it changes only at the pruning steps
        ``start_step + k * every`` (and ``end_step``)."""
        if step >= self.end_step:
            return self.target_density
        if step < self.start_step:
            return 1.0
        last = self.start_step + (step - self.start_step) // self.every * self.every
        return cubic_density(last, self.start_step, self.end_step, self.target_density)

    def densities(self) -> dict[str, float]:
        """Each layer's current block density (kept blocks / blocks)."""
        return {layer.fqn: layer.mask.float().mean().item() for layer in self._layers}

    def masks(self) -> dict[str, torch.Tensor]:
        """Each layer's kept blocks, ``(out / bo, in / bi)`` bool (copies)."""
        return {layer.fqn: layer.mask.clone() for layer in self._layers}

    # -- the training loop -------------------------------------------------------------------------------

    def _blocks(self, t: torch.Tensor) -> torch.Tensor:
        """``(out, in)`` -> ``(out / bo, in / bi, bo, bi)`` view of blocks."""
        bo, bi = self.blocksize
        return t.reshape(t.shape[0] // bo, bo, t.shape[1] // bi, bi).transpose(1, 2)

    def _expand(self, mask: torch.Tensor) -> torch.Tensor:
        bo, bi = self.blocksize
        return mask.repeat_interleave(bo, 0).repeat_interleave(bi, 1)

    @torch.no_grad()
    def step(self) -> None:
        """One training step done: accumulate movement scores, prune at the scheduled steps, and zero the
        removed blocks' weights and optimizer state."""
        self.steps += 1
        for layer in self._layers:
            weight = layer.module.weight
            if self.criterion == "movement" and weight.grad is not None:
                layer.score -= self._blocks(weight * weight.grad).sum((-1, -2)).float()
            density = self.density_at(self.steps)
            keep = round(density * layer.mask.numel())
            if keep < int(layer.mask.sum()):
                score = self._score(layer).masked_fill(~layer.mask, -torch.inf)
                order = score.flatten().argsort(descending=True, stable=True)
                mask = torch.zeros_like(layer.mask).flatten()
                mask[order[:keep]] = True
                layer.mask = mask.reshape(layer.mask.shape)
            self._apply_mask(layer)

    def _score(self, layer: _Layer) -> torch.Tensor:
        if self.criterion == "movement":
            return layer.score
        return self._blocks(layer.module.weight.detach().float()).pow(2).sum((-1, -2))

    def _apply_mask(self, layer: _Layer) -> None:
        full = self._expand(layer.mask)
        weight = layer.module.weight
        weight.mul_(full)
        state = self.optimizer.state.get(weight, {})
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.shape == weight.shape:
                value.mul_(full)

    # -- the result --------------------------------------------------------------------------------------

    @torch.no_grad()
    def finalize(self) -> nn.Module:
        """Swap each pruned layer for a :class:`~bsrkit.nn.BSRLinear` with the final pattern (its kept
        blocks' weights, bias unchanged); returns the model (changed in place)."""
        for layer in self._layers:
            self._apply_mask(layer)
            density = layer.mask.float().mean().item()
            # The removed blocks are zero, so the blocks of largest norm are the kept ones (a kept block
            # whose norm is exactly 0 may trade places with a removed one: the layer computes the same).
            sparse = BSRLinear.from_dense(layer.module, self.blocksize, density)
            parent_name, _, name = layer.fqn.rpartition(".")
            parent: Any = self.model.get_submodule(parent_name) if parent_name else self.model
            setattr(parent, name, sparse)
        return self.model

    def state_dict(self) -> dict[str, Any]:
        """The step count, masks and movement scores (for checkpointing a pruning run)."""
        return {
            "steps": self.steps,
            "masks": {layer.fqn: layer.mask.clone() for layer in self._layers},
            "scores": {layer.fqn: layer.score.clone() for layer in self._layers},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = {layer.fqn for layer in self._layers}
        if set(state.get("masks", {})) != names:
            raise ValueError(
                f"GradualPruner.load_state_dict(): expected masks for {sorted(names)}, got "
                f"{sorted(state.get('masks', {}))}"
            )
        for layer in self._layers:
            mask, score = state["masks"][layer.fqn], state["scores"][layer.fqn]
            if mask.shape != layer.mask.shape or score.shape != layer.score.shape:
                raise ValueError(
                    f"GradualPruner.load_state_dict(): expected a {tuple(layer.mask.shape)} mask for "
                    f"{layer.fqn!r}, got {tuple(mask.shape)}"
                )
        self.steps = int(state["steps"])
        for layer in self._layers:
            layer.mask = state["masks"][layer.fqn].to(torch.bool).clone()
            layer.score = state["scores"][layer.fqn].float().clone()
            with torch.no_grad():
                self._apply_mask(layer)
