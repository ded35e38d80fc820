"""Model-level sparsification: swap a model's linear layers for block-sparse ones, in place.

``sparsify_(model, blocksize=..., density=...)`` follows torchao's convention (``sparsify_(model, config,
filter_fn)``, in place, ``filter_fn(module, fqn)``): every selected ``nn.Linear`` (and transformers'
``Conv1D``, the GPT-2 family's transposed linear) becomes a :class:`bsrkit.nn.BSRLinear` holding the
``density * blocks`` (rounded half up) blocks of largest Frobenius norm of its weight, its bias unchanged. The
model then computes exactly what a dense model with those pruned weights computes.

A layer is kept dense, unless ``force=True``, where the block-sparse product would be slower than dense on
this machine: when ``density`` is at or above the break-even density of its device, dtype and blocksize
(:func:`bsrkit.break_even.break_even_density`, kept in the tuning table).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from bsrkit.break_even import break_even_density
from bsrkit.nn import BSRLinear
from bsrkit.places import module_places, put
from bsrkit.validation import Density, check_blocksize, check_density, type_name

__all__ = [
    "LayerReport",
    "SparsifySummary",
    "break_even_density",
    "check_selected",
    "default_filter",
    "foreign_holders",
    "replacement_problem",
    "sparsify_",
]


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D``: ``y = x @ weight + bias`` with ``weight`` ``(in, out)``."""
    return (
        type(module).__name__ == "Conv1D"
        and hasattr(module, "nf")
        and getattr(module, "weight", None) is not None
    )


def _features(module: nn.Module) -> tuple[int, int] | None:
    """(out_features, in_features) of a linear layer this module is, or None."""
    if isinstance(module, nn.Linear):
        return module.out_features, module.in_features
    if _is_conv1d(module):
        weight: torch.Tensor = module.weight  # type: ignore[assignment]
        return int(weight.shape[1]), int(weight.shape[0])
    return None


def foreign_holders(model: nn.Module) -> dict[int, tuple[str, nn.Module]]:
    """Per parameter (by id) held by a module of ``model`` that is not a linear layer (an embedding an
    output head is tied to), the first such holder and its name."""
    holders: dict[int, tuple[str, nn.Module]] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        if _features(module) is None:
            for t in module._parameters.values():
                if t is not None:
                    holders.setdefault(id(t), (fqn, module))
    return holders


# The per-module hooks a swapped layer would lose (torch.nn.Module's _<kind>_hooks tables).
_HOOKS = ("forward_pre", "forward", "backward_pre", "backward")


def replacement_problem(
    model: nn.Module, module: nn.Module, fqn: str, holders: dict[int, tuple[str, nn.Module]] | None = None
) -> str | None:
    """Why ``module`` (a linear layer at ``fqn`` in ``model``) cannot become a ``BSRLinear``, or None.
    The new layer computes ``x W^T + b`` from ``weight`` and ``bias`` alone, and is read as a module
    only, so: no ``nn.Linear`` subclass with its own ``forward`` or more state (a LoRA layer would lose
    its adapter), no parametrized weight (weight_norm, ``torch.nn.utils.parametrize``), and no layer whose
    parent reads its ``weight`` itself (``nn.MultiheadAttention.out_proj``, the linear layers of an
    ``nn.TransformerEncoderLayer``), no layer with forward or backward hooks (they would be lost), and
    no layer sharing its weight or bias with a module that is not a
    linear layer (an output head tied to the embedding: the block-sparse layer would hold its own copy,
    and a pruner's zeroed blocks would zero the embedding's rows). ``holders``: :func:`foreign_holders`
    of ``model`` (found here when None)."""
    if holders is None:
        holders = foreign_holders(model)
    for name in ("weight", "bias"):
        held = holders.get(id(getattr(module, name, None)))
        if held is not None:
            holder = type(held[1]).__name__
            return f"its {name} is shared with {held[0]!r}, a {holder} (tied), which it would stop sharing"
    if isinstance(module, nn.Linear):
        if nn.utils.parametrize.is_parametrized(module) or not isinstance(module.weight, nn.Parameter):
            return "its weight is parametrized or not a Parameter (remove the parametrization first)"
        if type(module).forward is not nn.Linear.forward or "forward" in vars(module):
            return f"a {type_name(module)} with its own forward (a BSRLinear would drop it)"
        extra = [n for n, _ in module.named_parameters() if n not in ("weight", "bias")]
        extra += [n for n, _ in module.named_buffers()] + [n for n, _ in module.named_children()]
        if extra:
            return f"a {type_name(module)} holding more than weight and bias ({', '.join(extra[:3])})"
    hooks = [kind for kind in _HOOKS if getattr(module, f"_{kind}_hooks", None)]
    if hooks:  # (an nn.Linear's or a Conv1D's: the new layer would not run them)
        return (
            f"it has {' and '.join(h.replace('_', ' ') for h in hooks)} hooks (a BSRLinear would not run "
            "them: remove them, and register them on the new layer after sparsify_)"
        )
    parent_name, _, name = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    for kind, names in _READ_BY_PARENT:
        if isinstance(parent, kind) and name in names:
            return f"nn.{kind.__name__} reads its {name}.weight itself"
    parent_class: Any = type(parent)  # (a class: hashable, as functools.cache needs)
    if _forward_reads_weight(parent_class, name):
        return f"{type_name(parent)}.forward reads its {name}.weight itself (a BSRLinear has no weight)"
    return None


@functools.cache
def _forward_reads_weight(parent: Any, name: str) -> bool:
    """Whether ``parent``'s forward reads ``self.<name>.weight`` (transformers' T5 feed-forward reads its
    output layer's weight dtype: the swapped layer would fail at the first forward). Read from its source
    (none: a builtin or a generated class, taken as not reading it)."""
    try:
        source = inspect.getsource(parent.forward)
    except (OSError, TypeError):
        return False
    return re.search(rf"\bself\.{re.escape(name)}\.weight\b", source) is not None


def check_selected(
    where: str,
    model: nn.Module,
    module: nn.Module,
    fqn: str,
    blocksize: tuple[int, int],
    holders: dict[int, tuple[str, nn.Module]] | None = None,
) -> tuple[int, int]:
    """The ``(out, in)`` features of the layer ``filter_fn`` selected at ``fqn``, or a ``ValueError`` (from
    ``where``) naming why it cannot become block-sparse: not a linear layer, features the blocksize does
    not divide, or a :func:`replacement_problem` (``holders`` as there)."""
    features = _features(module)
    if features is None:
        raise ValueError(f"{where}: filter_fn selected {fqn!r}, a {type_name(module)}, not a linear layer")
    if features[0] % blocksize[0] or features[1] % blocksize[1]:
        raise ValueError(
            f"{where}: expected blocksize {blocksize} to divide the (out, in) features of {fqn!r}, got "
            f"{features}"
        )
    problem = replacement_problem(model, module, fqn, holders)
    if problem is not None:
        raise ValueError(f"{where}: filter_fn selected {fqn!r}, which cannot be block-sparse: {problem}")
    return features


# Modules that read a child linear layer's weight themselves (not through its forward): MultiheadAttention
# always, TransformerEncoderLayer on its inference fast path.
_READ_BY_PARENT = (
    (nn.MultiheadAttention, ("out_proj",)),
    (nn.TransformerEncoderLayer, ("linear1", "linear2")),
)


def _output_head(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except (NotImplementedError, AttributeError):
            return None
        return head if isinstance(head, nn.Module) else None
    return None


def default_filter(blocksize: tuple[int, int], model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """Every ``nn.Linear`` or ``Conv1D`` of ``model`` whose shape the blocksize divides, except the output
    head (the module ``model.get_output_embeddings()`` returns, or one named ``lm_head``), the layers
    sharing a weight or bias with it (tied: the head stays dense, so they do too), and the layers a
    ``BSRLinear`` cannot stand for (:func:`replacement_problem`)."""
    head, holders = _output_head(model), foreign_holders(model)
    heads = [m for fqn, m in model.named_modules() if m is head or fqn.rsplit(".", 1)[-1] == "lm_head"]
    head_tensors = {id(t) for m in heads for t in m._parameters.values() if t is not None}

    def selected(module: nn.Module, fqn: str) -> bool:
        features = _features(module)
        if features is None or module is head or fqn.rsplit(".", 1)[-1] == "lm_head":
            return False
        if any(id(t) in head_tensors for t in module._parameters.values() if t is not None):
            return False
        if features[0] % blocksize[0] or features[1] % blocksize[1]:
            return False
        return replacement_problem(model, module, fqn, holders) is None

    return selected


@dataclasses.dataclass(frozen=True)
class LayerReport:
    """One selected layer: its name, ``(out, in)`` features, and the density stored (None: kept dense,
    with the reason)."""

    fqn: str
    features: tuple[int, int]
    density: float | None
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class SparsifySummary:
    """What :func:`sparsify_` did: a report per selected layer, and the parameter counts of the swapped
    layers' weights before (dense) and after (stored blocks)."""

    layers: tuple[LayerReport, ...]
    dense_weights: int
    stored_weights: int

    @property
    def swapped(self) -> int:
        return sum(r.density is not None for r in self.layers)

    def __str__(self) -> str:
        head = f"sparsify_: {self.swapped} of {len(self.layers)} selected layers block-sparse"
        lines = [f"{head}; their weights {self.dense_weights:,} -> {self.stored_weights:,} stored values"]
        for r in self.layers:
            what = f"density {r.density:.3f}" if r.density is not None else f"dense ({r.reason})"
            lines.append(f"  {r.fqn}: {r.features[0]}x{r.features[1]} {what}")
        return "\n".join(lines)


def check_ties_whole(
    where: str,
    by: str,
    chosen: list[tuple[str, nn.Module, list[str]]],
    places: Iterable[tuple[nn.Module, list[str]]],
    advice: str = "select both (they stay tied, block-sparse) or neither",
    attrs: tuple[str, ...] = ("weight", "bias"),
) -> None:
    """Refuse a selection holding one of two linear layers that share a weight or a bias (tied): the one
    made block-sparse would no longer share it with the other, silently (and a pruner's zeroed blocks would
    zero the other's weight). ``where``/``by``: the error's caller and what selected (the filter).
    (One a non-linear module holds is :func:`foreign_holders`' concern: it names that module.)"""
    picked = {id(m) for _, m, _ in chosen}
    places = list(places)
    for attr in attrs:
        holders: dict[int, list[tuple[str, nn.Module]]] = {}
        for module, fqns in places:
            if not (isinstance(module, nn.Linear) or _is_conv1d(module)):
                continue
            held = module._parameters.get(attr)
            if isinstance(held, torch.Tensor):
                holders.setdefault(id(held), []).append((fqns[0], module))
        for fqn, module, _ in chosen:
            held = module._parameters.get(attr)
            if held is None:
                continue
            for other_fqn, other in holders.get(id(held), []):
                if id(other) not in picked:
                    raise ValueError(
                        f"{where}: {by} selected {fqn!r} but not {other_fqn!r}, which shares its {attr} "
                        f"(tied): {advice}"
                    )


def selector(filter_fn: Any, blocksize: tuple[int, int]) -> str:
    """What selected the layers, as an error names it."""
    return (
        "filter_fn"
        if filter_fn is not None
        else f"the default filter (blocksize {blocksize[0]}x{blocksize[1]})"
    )


def _as_linear(module: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` view of a Conv1D's weight (transposed copy), bias and mode, for the pruning."""
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    bias: torch.Tensor | None = module.bias  # type: ignore[assignment]
    in_f, out_f = weight.shape
    linear = nn.Linear(in_f, out_f, bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight.t())
        if bias is not None:
            linear.bias.copy_(bias)
    linear.weight.requires_grad_(weight.requires_grad)
    if bias is not None:
        linear.bias.requires_grad_(bias.requires_grad)
    return linear.train(module.training)


def sparsify_(
    model: nn.Module,
    *,
    blocksize: int | tuple[int, int],
    density: Density,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    criterion: str = "block_norm",
    force: bool = False,
) -> SparsifySummary:
    r"""Replace, in place, each linear layer of ``model`` that ``filter_fn(module, fqn)`` selects by a
    :class:`~bsrkit.nn.BSRLinear` keeping the ``density * blocks`` (rounded half up) blocks of largest
    :math:`\|W_{ij}\|_F` (``criterion="block_norm"``, the only one), bias unchanged; returns a
    :class:`SparsifySummary`.

    ``blocksize`` is ``b`` or ``(bo, bi)`` (output x input features per block). ``filter_fn`` defaults to
    :func:`default_filter`. A selected layer whose shape the blocksize does not divide raises
    ``ValueError``. Unless ``force``, a layer stays dense where ``density`` is at or above
    :func:`break_even_density` for its device (the block-sparse product would be slower there). Layers
    that share one weight (tied) share their stored blocks and pattern (each keeps its own bias); the
    summary counts a shared weight once.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"sparsify_(): expected model to be an nn.Module, got {type_name(model)}")
    bo, bi = check_blocksize("sparsify_", blocksize)
    density = check_density("sparsify_", density)
    if criterion != "block_norm":
        raise ValueError(f"sparsify_(): expected criterion 'block_norm', got {criterion!r}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"sparsify_(): expected filter_fn to be callable or None, got {type_name(filter_fn)}")
    if isinstance(model, nn.Linear) or _is_conv1d(model):
        raise ValueError(
            f"sparsify_(): expected a model holding linear layers, got a {type_name(model)} itself (it "
            "cannot be replaced in place): use BSRLinear.from_dense, or wrap it in a module"
        )
    selected = filter_fn or default_filter((bo, bi), model)
    # Every place of each module (one used at several places gets the one sparse layer at all of them),
    # judged by the filter under its first name, as named_modules() lists it.
    places = module_places(model).values()
    chosen = [(fqns[0], m, fqns) for m, fqns in places if selected(m, fqns[0])]
    if not chosen:  # (a silent no-op would serve the dense model as if it were sparse)
        linears = sum(isinstance(m, nn.Linear) or _is_conv1d(m) for m, _ in places)
        which = selector(filter_fn, (bo, bi))
        warnings.warn(
            f"sparsify_(): {which} selected none of the model's {linears} linear layers; nothing changed",
            UserWarning,
            stacklevel=2,
        )
    check_ties_whole("sparsify_()", selector(filter_fn, (bo, bi)), chosen, places)
    reports: list[LayerReport] = []
    dense_weights = stored_weights = 0
    # The first sparse layer built from each weight, by orientation: a later module holding the same
    # weight (tied, as an encoder's and a decoder's projections can be) shares its blocks and pattern, so
    # the tie holds through fine-tuning and the blocks are stored once.
    built_from: dict[tuple[bool, int], BSRLinear] = {}
    biases: dict[int, nn.Parameter] = {}  # (a bias two layers share stays shared: id -> the new one)
    holders = foreign_holders(model)
    # Every layer is checked and built before any is put in place: a layer that cannot be converted
    # raises with the model unchanged (as load_sparse), never half block-sparse.
    replacements: list[tuple[list[str], BSRLinear]] = []
    for fqn, module, fqns in chosen:
        features = check_selected("sparsify_()", model, module, fqn, (bo, bi), holders)
        weight: torch.Tensor = module.weight  # type: ignore[assignment]
        limit = break_even_density(weight.device, (bo, bi), weight.dtype)
        if not force and density >= limit:
            reason = f"density {density!s} >= break-even {limit:.2f} on {module.weight.device.type}"
            reports.append(LayerReport(fqn, features, None, reason))
            continue
        linear = module if isinstance(module, nn.Linear) else _as_linear(module)
        sparse = BSRLinear.from_dense(linear, (bo, bi), density)
        tied = built_from.setdefault((isinstance(module, nn.Linear), id(weight)), sparse)
        if tied is not sparse:  # (the same weight pruned the same way: the same blocks)
            sparse.values, sparse.crow_indices = tied.values, tied.crow_indices
            sparse.col_indices = tied.col_indices
        else:
            dense_weights += features[0] * features[1]
            stored_weights += sparse.values.numel()
        if module.bias is not None and sparse.bias is not None:
            sparse.bias = biases.setdefault(id(module.bias), sparse.bias)
        replacements.append((fqns, sparse))
        blocks = (features[0] // bo) * (features[1] // bi)
        reports.append(LayerReport(fqn, features, sparse.values.shape[-3] / blocks if blocks else 0.0))
    for fqns, sparse in replacements:
        put(model, fqns, sparse)
    return SparsifySummary(tuple(reports), dense_weights, stored_weights)
