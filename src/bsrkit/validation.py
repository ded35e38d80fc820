"""Argument checks shared by every op: one place for the error messages.

Messages follow one form — ``"<op>(): expected <what>, got <what was given>"`` — and the exception type
says the kind of mistake: ``TypeError`` for a wrong type, layout or dtype, ``ValueError`` for a wrong
shape, device or value.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "SUPPORTED_DTYPES",
    "broadcast_batch",
    "check_bsr",
    "check_out",
    "check_same_device",
    "check_same_dtype",
    "check_strided",
]

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_bsr(op: str, name: str, t: Any) -> None:
    """``t`` must be a BSR tensor with no dense dims, of a supported dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}(): expected {name} to be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.sparse_bsr:
        raise TypeError(f"{op}(): expected {name} to have layout torch.sparse_bsr, got {t.layout}")
    if t.dense_dim() != 0:
        raise ValueError(f"{op}(): expected {name}.dense_dim() == 0 (scalar blocks), got {t.dense_dim()}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}(): expected {name}.dtype in {_names(SUPPORTED_DTYPES)}, got {t.dtype}")


def check_strided(op: str, name: str, t: Any, min_ndim: int = 2) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}(): expected {name} to be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided:
        raise TypeError(f"{op}(): expected {name} to be a strided tensor, got layout {t.layout}")
    if t.ndim < min_ndim:
        raise ValueError(
            f"{op}(): expected {name} to have at least {min_ndim} dimensions, got {t.ndim} "
            f"(shape {tuple(t.shape)})"
        )


def check_same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{op}(): expected {name}.dtype == {ref.dtype} ({ref_name}.dtype), got {t.dtype}")


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
        raise TypeError(f"{op}(): expected out.dtype == {dtype}, got {out.dtype}")
    if out.device != device:
        raise ValueError(f"{op}(): expected out.device == {device}, got {out.device}")


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return "{" + ", ".join(str(d).removeprefix("torch.") for d in dtypes) + "}"
