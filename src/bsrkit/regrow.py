r"""RigL-style regrowth for :class:`bsrkit.prune.GradualPruner`: drop the weakest kept blocks and grow as many
removed blocks where the dense gradient is largest (Evci et al. 2020, "Rigging the Lottery", per block).

At each update step :math:`t` (every ``every`` steps, up to ``until``), each pruned layer drops the
:math:`k = \mathrm{round}(f_t \cdot \mathrm{kept})` kept blocks of smallest Frobenius norm and grows the
:math:`k` blocks, among those not kept before the update, of largest dense-gradient norm
:math:`\|(\partial L / \partial W)_b\|_F`; a grown block starts at zero weight and zero optimizer state.
The density does not change. :math:`f_t` decays as in the paper,
:math:`f_t = \tfrac{f}{2}(1 + \cos(\pi t / T_{\mathrm{end}}))` with :math:`T_{\mathrm{end}}` = ``until``,
or stays ``f`` (``decay="constant"``, or no ``until``).

The dense gradient of a block-sparse layer's weight is not computed by its backward (only the kept
blocks' is): :class:`DenseGradient` records :math:`G^T X` for the steps that end in an update (a forward
hook keeps the layer's input, a hook on its output's gradient adds :math:`G^T X`), summed over the
micro-batches of a step. A masked-dense layer's ``weight.grad`` is that gradient already.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any

import torch
from torch import nn

from bsrkit.validation import ArgumentTypeError, Density, check_density, exact_density, type_name

__all__ = ["DenseGradient", "GradientRecord", "RigL", "drop_and_grow"]


def _is_count(n: Any) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(n, numbers.Integral) and not isinstance(n, bool)


@dataclasses.dataclass(frozen=True)
class RigL:
    """The regrowth schedule (module docstring): ``fraction`` of the kept blocks swapped at steps
    ``every``, ``2 * every``, ... up to ``until`` (None: for as long as training runs), the fraction
    decaying to 0 at ``until`` (``decay="cosine"``) or constant (``"constant"``).

    ``replicas``: the process group whose ranks hold replicas of the model (DDP's), over which the
    recorded dense gradients are averaged before blocks are grown, so that every replica grows the same
    blocks; ``"default"``: torch.distributed's default group where it runs more than one rank; None: no
    averaging (each rank trains a model of its own, or pipeline and tensor-parallel ranks). Every rank of
    the group must step its pruner at the same steps, as under DDP."""

    fraction: float = 0.3
    every: int = 100
    until: int | None = None
    decay: str = "cosine"
    replicas: Any = "default"

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, numbers.Real):
            raise TypeError(f"RigL(): expected fraction to be a number, got {type_name(self.fraction)}")
        if not 0 <= self.fraction <= 1:
            raise ValueError(f"RigL(): expected fraction in [0, 1], got {self.fraction}")
        if not _is_count(self.every) or self.every < 1:
            raise ValueError(f"RigL(): expected every to be an int >= 1, got {self.every!r}")
        if self.until is not None and (not _is_count(self.until) or self.until < 1):
            raise ValueError(f"RigL(): expected until to be None or an int >= 1, got {self.until!r}")
        # (numpy numbers as Python's: the schedule's arithmetic and its printed form stay plain)
        object.__setattr__(self, "fraction", float(self.fraction))
        object.__setattr__(self, "every", int(self.every))
        if self.until is not None:
            object.__setattr__(self, "until", int(self.until))
        if self.decay not in ("cosine", "constant"):
            raise ValueError(f"RigL(): expected decay 'cosine' or 'constant', got {self.decay!r}")
        if isinstance(self.replicas, str) and self.replicas != "default":
            raise ValueError(
                f"RigL(): expected replicas 'default', None or a process group, got {self.replicas!r}"
            )

    def group(self) -> Any:
        """The process group to average over, or None: no averaging (see ``replicas``)."""
        if self.replicas is None or not torch.distributed.is_available():
            return None
        if self.replicas == "default":
            if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
                return None
            return torch.distributed.group.WORLD
        return None if torch.distributed.get_world_size(self.replicas) == 1 else self.replicas

    def due(self, step: int) -> bool:
        """Whether ``step`` (steps done) ends with an update."""
        return step > 0 and step % self.every == 0 and (self.until is None or step <= self.until)

    def fraction_at(self, step: int) -> float:
        """:math:`f_t`: the fraction of kept blocks swapped at ``step``."""
        if self.until is None or self.decay == "constant":
            return float(self.fraction)
        return self.fraction / 2 * (1 + math.cos(math.pi * min(step, self.until) / self.until))


def drop_and_grow(
    mask: torch.Tensor, magnitude: torch.Tensor, growth: torch.Tensor, fraction: Density
) -> torch.Tensor:
    """The pattern after one update of ``mask`` (bool, kept blocks): the ``round(fraction * kept)`` kept
    blocks of smallest ``magnitude`` dropped, as many blocks outside ``mask`` of largest ``growth`` grown
    (fewer when fewer are outside). Ties go to the lower block index (row-major)."""
    # (above 1 it grew more than it dropped; a float of the decimal given: a numpy half overflowed)
    fraction = float(exact_density(check_density("drop_and_grow", fraction, "fraction")))
    for name, t in (("mask", mask), ("magnitude", magnitude), ("growth", growth)):
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(f"drop_and_grow(): expected {name} to be a tensor, got {type_name(t)}")
    if mask.dtype is not torch.bool:
        raise ValueError(f"drop_and_grow(): expected mask to be a bool tensor, got {mask.dtype}")
    for name, t in (("magnitude", magnitude), ("growth", growth)):
        if t.shape != mask.shape:
            got = tuple(t.shape)
            raise ValueError(
                f"drop_and_grow(): expected {name} of mask's shape {tuple(mask.shape)}, got {got}"
            )
    k = min(round(fraction * int(mask.sum())), int((~mask).sum()))
    if k <= 0:
        return mask
    flat = mask.flatten()
    dropped = magnitude.flatten().masked_fill(~flat, torch.inf).argsort(stable=True)[:k]
    grown = growth.flatten().masked_fill(flat, -torch.inf).argsort(descending=True, stable=True)[:k]
    new = flat.clone()
    new[dropped] = False
    new[grown] = True
    return new.reshape(mask.shape)


class GradientRecord:
    """A layer's weight gradient summed over the backward passes run while :attr:`armed`, recorded by a
    hook (``_handle``, registered by the subclass): :meth:`take` it, :meth:`remove` the hook."""

    def __init__(self, handle: Any) -> None:
        self.armed = False
        self.total: torch.Tensor | None = None
        self._handle = handle

    def _add(self, part: torch.Tensor) -> None:
        self.total = part if self.total is None else self.total.add_(part)

    def take(self) -> torch.Tensor | None:
        """The gradient recorded since the last call (None: no backward ran while armed), and forget it."""
        total, self.total = self.total, None
        return total

    def remove(self) -> None:
        self._handle.remove()
        self.armed, self.total = False, None


class DenseGradient(GradientRecord):
    r"""The dense gradient :math:`\partial L / \partial W = G^T X` of a linear layer (``y = x W^T + b``)
    over the backward passes run while :attr:`armed` (module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module.register_forward_hook(self._forward, with_kwargs=True))

    def _forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor
    ) -> None:
        x = args[0] if args else kwargs.get("input")  # (nn.Linear's argument, by position or keyword)
        values = getattr(module, "values", None)
        if (
            self.armed
            and isinstance(x, torch.Tensor)
            and isinstance(output, torch.Tensor)
            and output.requires_grad
            and isinstance(values, torch.Tensor)
            and values.requires_grad  # (a frozen weight has no gradient: a masked-dense one records none)
        ):
            x = x.detach()
            # The node that accumulates the weight's gradient: a backward that does not run it
            # (torch.autograd.grad with respect to the input, backward(inputs=...) without the weight)
            # computes no weight gradient, and records none, as a masked-dense layer's weight hook.
            view = values.view_as(values).grad_fn  # (grad mode is on: the output requires grad)
            accumulate = view.next_functions[0][0] if view is not None else None
            output.register_hook(functools.partial(self._backward, x.reshape(-1, x.shape[-1]), accumulate))

    def _backward(self, x: torch.Tensor, accumulate: Any, grad: torch.Tensor) -> None:
        if accumulate is not None and not _will_run(accumulate):
            return
        g = grad.detach().reshape(-1, grad.shape[-1])
        self._add(g.mT @ x.to(g.dtype))


def _will_run(node: Any) -> bool:
    """Whether the running backward pass runs ``node``, the weight's gradient accumulator (torch's private
    test, which ``torch.utils.checkpoint`` uses too; where it is missing, every node is taken to run)."""
    test = getattr(torch._C, "_will_engine_execute_node", None)
    if test is None:
        return True
    try:
        return bool(test(node))
    except RuntimeError:  # (torch does not answer for a leaf torch.autograd.grad returns: its gradient is
        return True  # computed, as a masked-dense layer's weight hook sees it)
