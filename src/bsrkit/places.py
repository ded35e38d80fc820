"""Where a model's modules sit: one module may be used at several places (``nn.Sequential(lin, act,
lin)``), and ``named_modules()`` lists it once, under its first name. Every model surgery of bsrkit
(``sparsify_``, ``GradualPruner``, ``load_sparse``) finds and replaces modules through this module, so that
a module swapped at one place is swapped at all of them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["module_places", "put"]


def module_places(model: nn.Module) -> dict[int, tuple[nn.Module, list[str]]]:
    """Each submodule of ``model`` (not ``model`` itself), by ``id``: the module and every name it is
    reachable under, first the name ``named_modules()`` gives it; in ``named_modules()`` order."""
    places: dict[int, tuple[nn.Module, list[str]]] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        if fqn:
            places.setdefault(id(module), (module, []))[1].append(fqn)
    return places


def put(model: nn.Module, fqns: list[str] | tuple[str, ...], new: nn.Module) -> None:
    """Set ``new`` at each of the places ``fqns`` of ``model``."""
    for fqn in fqns:
        parent_name, _, name = fqn.rpartition(".")
        parent: Any = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, name, new)
