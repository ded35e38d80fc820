"""A memoized call's arguments as one key (for :func:`bsrkit.cache.weak_lru_cache`).

Tensors become :class:`~bsrkit.keys.TensorKey` s (memory identity; their version counters are returned
beside the key), scalars are keyed with their type (and a float's sign: ``2``, ``2.0``, ``True``, ``0.0``
and ``-0.0`` are five keys, as they are five calls), other hashable values with their type too (numpy
scalars, complex numbers: with their signs of zero). An inference
tensor (no version counter: an in-place change could not be seen) makes the call uncacheable.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable
from typing import Any

import torch

from bsrkit.cached_values import value_arrays
from bsrkit.keys import TensorKey
from bsrkit.validation import type_name

__all__ = ["UNCACHEABLE", "Uncacheable", "make_key"]


class Uncacheable(Exception):
    """An argument whose in-place changes cannot be seen (no version counter: see :func:`_tensor_key`)."""


UNCACHEABLE: Any = object()


def _given_key(key: TensorKey, name: Any, keys: list[TensorKey], version: list[int]) -> TensorKey:
    """A :class:`TensorKey` the caller passes in its tensor's place, with its tensor's versions as they
    are now (the key's own are those of its creation: an in-place change since would be no miss)."""
    t = key.obj
    current = key.current_version()
    if t is None or current is None:
        raise ValueError(f"weak_lru_cache: argument {_describe(name)} is the TensorKey of a dead tensor")
    if not current:
        raise Uncacheable
    keys.append(key)
    version.extend(current)
    return key


def _key_part(value: Any, name: Any, keys: list[TensorKey], version: list[int]) -> Any:
    """``value`` as a key component. ``name`` (an index or keyword) only serves the error message."""
    if isinstance(value, torch.Tensor):
        k = _tensor_key(value, name)
        keys.append(k)
        version.extend(k.version)
        return k
    if type(value) in _SCALARS:
        return _scalar_part(value)
    if isinstance(value, TensorKey):  # (TensorAsKey too)
        return _given_key(value, name, keys, version)
    if isinstance(value, tuple):
        parts = tuple(_key_part(v, (name, i), keys, version) for i, v in enumerate(value))
        return parts if type(value) is tuple else (type(value), parts)  # (a namedtuple is another call)
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"weak_lru_cache: argument {_describe(name)} must be a tensor or hashable, "
            f"got unhashable {type_name(value)}"
        ) from None
    if not isinstance(value, _PLAIN) and any(not isinstance(a, bytes) for a in value_arrays(value)):
        # (keyed by its hash, its identity for most objects, the tensor inside would be neither keyed nor
        # proven: a write to it was served the old result, and the entry outlived its memory)
        raise TypeError(
            f"weak_lru_cache: argument {_describe(name)} ({type_name(value)}) holds a tensor or array that "
            "its hash does not follow: pass tensors as arguments, or inside tuples"
        )
    return _other_part(value)


# Hashable values that hold no array (value_arrays is not asked).
_PLAIN = (str, bytes, numbers.Number, torch.dtype, torch.device, type)


_SCALARS = frozenset({int, float, str, bool, type(None)})


def _scalar_part(value: Any) -> Any:
    """A scalar as a key component that equals another only for the same call: ``2``, ``2.0`` and
    ``True`` are equal in Python but not to a function (``t * 2.0`` is a float tensor), nor are ``0.0``
    and ``-0.0`` (``1 / -0.0``)."""
    kind = type(value)
    if kind is float:
        return (float, value, math.copysign(1.0, value))
    if kind is int or kind is bool:
        return (kind, value)
    return value


def _other_part(value: Any) -> Any:
    """Any other hashable value with its type, and a non-integral number's signs of zero: ``numpy.int64(2)``
    and ``numpy.float64(2.0)``, or ``numpy.float64(0.0)`` and ``-0.0``, are equal but not the same call."""
    if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Integral):
        z = complex(value)
        return (type(value), value, math.copysign(1.0, z.real), math.copysign(1.0, z.imag))
    return (type(value), value)


def _tensor_key(t: torch.Tensor, name: Any) -> TensorKey:
    """``TensorKey(t)``; a tensor it cannot key (a COO, nested or mkldnn tensor) is a ``TypeError`` naming
    the argument. ``Uncacheable`` where the key records no version counter: an inference tensor, or a
    sparse one on inference index tensors (an in-place change through it could not be seen)."""
    try:
        key = TensorKey(t)
    except (TypeError, RuntimeError) as exc:
        if t.is_inference():
            raise Uncacheable from None  # (computed, not cached, as every inference tensor: a COO one too)
        raise TypeError(f"weak_lru_cache: argument {_describe(name)}: {exc}") from None
    if not key.version:
        raise Uncacheable
    return key


def _describe(name: Any) -> str:
    """'#0', "'scale'", or '#1[2]' for an item inside a tuple argument."""
    path = []
    while isinstance(name, tuple):
        name, index = name
        path.append(f"[{index}]")
    head = f"#{name}" if isinstance(name, int) else repr(name)
    return head + "".join(reversed(path))


_KWARGS_MARK = object()


def make_key(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Hashable, list[TensorKey], tuple[int, ...]]:
    """(key, the TensorKeys in it, their versions); the key is ``UNCACHEABLE`` for tensors without a
    version counter (see :func:`_tensor_key`)."""
    keys: list[TensorKey] = []
    version: list[int] = []
    parts: list[Any] = []
    try:
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):  # common cases first
                k = _tensor_key(a, i)
                keys.append(k)
                version += k.version
                parts.append(k)
            elif type(a) in _SCALARS:
                parts.append(_scalar_part(a))
            elif type(a) is TensorKey:  # built by the caller, who holds its tensor
                parts.append(_given_key(a, i, keys, version))
            else:
                parts.append(_key_part(a, i, keys, version))
        if kwargs:
            parts.append(_KWARGS_MARK)
            for name in sorted(kwargs):
                parts.append(name)
                parts.append(_key_part(kwargs[name], name, keys, version))
    except Uncacheable:
        return UNCACHEABLE, keys, ()
    return tuple(parts), keys, tuple(version)
