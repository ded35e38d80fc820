"""Argument checks shared by every op: one place for the error messages.

Messages follow one form — ``"<op>(): expected <what>, got <what was given>"`` — and the exception type
says the kind of mistake: :class:`ArgumentTypeError` for a wrong type, layout or dtype, ``ValueError`` for
a wrong shape, device or value. ``torch.sparse._triton_ops`` raises ``ValueError`` for all of these, so
:class:`ArgumentTypeError` is both a ``TypeError`` and a ``ValueError``: code written against either
library catches it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "SUPPORTED_DTYPES",
    "ArgumentTypeError",
    "broadcast_batch",
    "check_bsr",
    "check_dtype",
    "check_max_grid",
    "check_meta",
    "check_out",
    "check_same_device",
    "check_same_dtype",
    "check_scalar",
    "check_strided",
]

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class ArgumentTypeError(TypeError, ValueError):
    """A wrong type, layout or dtype. A ``ValueError`` too, as ``torch.sparse._triton_ops`` raises."""


def check_bsr(op: str, name: str, t: Any, dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES) -> None:
    """``t`` must be a BSR tensor with no dense dims, of one of ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{op}(): expected {name} to be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.sparse_bsr:
        raise ArgumentTypeError(f"{op}(): expected {name} to have layout torch.sparse_bsr, got {t.layout}")
    if t.dense_dim() != 0:
        raise ValueError(f"{op}(): expected {name}.dense_dim() == 0 (scalar blocks), got {t.dense_dim()}")
    check_dtype(op, name, t, dtypes)


def check_dtype(
    op: str, name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES
) -> None:
    if t.dtype not in dtypes:
        raise ArgumentTypeError(f"{op}(): expected {name}.dtype in {_names(dtypes)}, got {t.dtype}")


def check_strided(op: str, name: str, t: Any, min_ndim: int = 2) -> None:
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{op}(): expected {name} to be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided:
        raise ArgumentTypeError(f"{op}(): expected {name} to be a strided tensor, got layout {t.layout}")
    if t.ndim < min_ndim:
        raise ValueError(
            f"{op}(): expected {name} to have at least {min_ndim} dimensions, got {t.ndim} "
            f"(shape {tuple(t.shape)})"
        )


def check_same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise ArgumentTypeError(
            f"{op}(): expected {name}.dtype == {ref.dtype} ({ref_name}.dtype), got {t.dtype}"
        )


def check_same_device(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(
            f"{op}(): expected {name}.device == {ref.device} ({ref_name}.device), got {t.device}"
        )


def broadcast_batch(op: str, names: tuple[str, ...], shapes: tuple[torch.Size, ...]) -> torch.Size:
    """Broadcast batch shapes with an error that names the operands."""
    nonempty = [s for s in shapes if len(s)]
    if not nonempty or all(s == nonempty[0] for s in nonempty):  # common cases, without torch's Python
        return torch.Size(nonempty[0] if nonempty else ())
    try:
        return torch.broadcast_shapes(*shapes)
    except RuntimeError:
        listed = ", ".join(f"{n}: {tuple(s)}" for n, s in zip(names, shapes, strict=True))
        raise ValueError(f"{op}(): expected broadcastable batch dimensions, got {listed}") from None


def check_out(op: str, out: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    check_strided(op, "out", out, min_ndim=0)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{op}(): expected out.shape == {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise ArgumentTypeError(f"{op}(): expected out.dtype == {dtype}, got {out.dtype}")
    if out.device != device:
        raise ValueError(f"{op}(): expected out.device == {device}, got {out.device}")


def check_scalar(op: str, name: str, value: Any) -> float:
    """A real number (a Python int or float, not a bool), as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{op}(): expected {name} to be a real number, got {type(value).__name__}")
    return float(value)


def check_meta(op: str, meta: Any) -> None:
    if meta is not None and not isinstance(meta, dict):
        raise ArgumentTypeError(f"{op}(): expected meta to be a dict or None, got {type(meta).__name__}")


def check_max_grid(op: str, max_grid: Any) -> None:
    """torch's ``max_grid=``: None or a tuple of three ints or Nones."""
    if max_grid is None:
        return
    if (
        not isinstance(max_grid, tuple)
        or len(max_grid) != 3
        or not all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0) for v in max_grid)
    ):
        raise ValueError(
            f"{op}(): expected max_grid to be None or a tuple of three positive ints or Nones, "
            f"got {max_grid!r}"
        )


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return "{" + ", ".join(str(d).removeprefix("torch.") for d in dtypes) + "}"
