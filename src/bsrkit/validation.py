"""Argument checks shared by every op: one place for the error messages.

Messages follow one form — ``"<op>(): expected <what>, got <what was given>"`` — and the exception type
says the kind of mistake: :class:`ArgumentTypeError` for a wrong type, layout or dtype, ``ValueError`` for
a wrong shape, device or value. ``torch.sparse._triton_ops`` raises ``ValueError`` for all of these, so
:class:`ArgumentTypeError` is both a ``TypeError`` and a ``ValueError``: code written against either
library catches it.
"""

from __future__ import annotations

import builtins
import fractions
import math
import numbers
from typing import Any, TypeGuard

import numpy as np
import torch

__all__ = [
    "SUPPORTED_DTYPES",
    "ArgumentTypeError",
    "CheckpointMismatchError",
    "Density",
    "MixedDtypeError",
    "autocast_inputs",
    "broadcast_batch",
    "byte_span",
    "check_blocksize",
    "check_bsr",
    "check_data_device",
    "check_density",
    "check_dtype",
    "check_max_grid",
    "check_meta",
    "check_operand_dtypes",
    "check_out",
    "check_out_needs_no_grad",
    "check_same_device",
    "check_same_dtype",
    "check_scalar",
    "check_size",
    "check_strided",
    "exact_density",
    "indices_data_defect",
    "is_density",
    "mark_written",
    "may_share_memory",
    "pattern_defect",
    "resolved",
]

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class ArgumentTypeError(TypeError, ValueError):
    """A wrong type, layout or dtype. A ``ValueError`` too, as ``torch.sparse._triton_ops`` raises."""


class CheckpointMismatchError(ValueError, RuntimeError):
    """A state_dict a layer cannot load (a ``ValueError`` naming the entry). A ``RuntimeError`` too, as
    ``nn.Module.load_state_dict``'s errors are, so code written for ``nn.Linear`` catches it."""


class MixedDtypeError(ArgumentTypeError, RuntimeError):
    """Operands of a product in different dtypes. A ``RuntimeError`` too, as ``nn.Linear``'s "mat1 and
    mat2 must have the same dtype" is, so a layer swapped for :class:`bsrkit.nn.BSRLinear` raises alike."""


def type_name(value: Any) -> str:
    """``value``'s type as an error message names it: its bare name, with its module where that name is
    a builtin's and the type is not (``numpy.bool``: "expected a bool, got bool" would contradict itself)."""
    t = type(value)
    if t.__module__ != "builtins" and hasattr(builtins, t.__name__):
        return f"{t.__module__}.{t.__name__}"
    return t.__name__


def check_operand_dtypes(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """``t`` and ``ref`` must share one supported floating dtype (both dtypes named when they do not)."""
    if t.dtype != ref.dtype:
        raise MixedDtypeError(
            f"{op}(): expected {name}.dtype == {ref.dtype} ({ref_name}.dtype), got {t.dtype} "
            "(mat1 and mat2 must have the same dtype)"
        )
    if ref.dtype not in SUPPORTED_DTYPES:
        raise ArgumentTypeError(
            f"{op}(): expected {ref_name}.dtype in {_names(SUPPORTED_DTYPES)}, got {ref.dtype}"
        )


def check_bsr(op: str, name: str, t: Any, dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES) -> None:
    """``t`` must be a BSR tensor with no dense dims, of one of ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{op}(): expected {name} to be a torch.Tensor, got {type_name(t)}")
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


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its negative bit materialised (a copy, as ``t.resolve_neg()``), else ``t`` itself.

    A negative view (``torch._neg_view``, the ``.imag`` of a conjugate) shares memory that holds
    ``-t``; torch's ops read the bit, while bsrkit's kernels read the memory: every dense operand passes
    through here first. (Real dtypes carry no conjugate bit.)"""
    return t.resolve_neg() if t.is_neg() else t


def autocast_inputs(tensors: tuple[Any, ...]) -> tuple[Any, ...]:
    """``tensors`` as ``torch.autocast`` hands them to one of its lower-precision ops (``F.linear``,
    ``F.scaled_dot_product_attention``): inside an autocast region enabled for the first one's device,
    each float32/half tensor in the autocast dtype (float64 and non-floating ones, and non-tensors, as they
    are); outside, unchanged. The casts are differentiable: a float32 leaf (a layer's weight) gets a
    float32 gradient, as an ``nn.Linear`` weight does under autocast."""
    # (the cheap test first, before any device is read: a decode step's layers pass here)
    if not torch._C._is_any_autocast_enabled() or not isinstance(tensors[0], torch.Tensor):
        return tensors
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    low = torch.get_autocast_dtype(device_type)
    return tuple(
        _cast(t, low)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not torch.float64
        else t
        for t in tensors
    )


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``; a BSR tensor (a float attention mask) on its own index tensors, whose memory keys
    its cached plans (``Tensor.to`` copies them: every call missed)."""
    if t.layout is torch.sparse_bsr:
        crow, col, values = t.crow_indices(), t.col_indices(), t.values()
        return torch.sparse_bsr_tensor(crow, col, values.to(dtype), size=t.shape, check_invariants=False)
    return t.to(dtype)


def check_strided(op: str, name: str, t: Any, min_ndim: int = 2) -> None:
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{op}(): expected {name} to be a torch.Tensor, got {type_name(t)}")
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


_NO_BATCH = torch.Size()


def broadcast_batch(op: str, names: tuple[str, ...], shapes: tuple[torch.Size, ...]) -> torch.Size:
    """Broadcast batch shapes with an error that names the operands."""
    if len(shapes) == 2 and not shapes[0] and not shapes[1]:  # unbatched: the common case
        return _NO_BATCH
    nonempty = [s for s in shapes if len(s)]
    if not nonempty or all(s == nonempty[0] for s in nonempty):  # common cases, without torch's Python
        return torch.Size(nonempty[0] if nonempty else ())
    try:
        return torch.broadcast_shapes(*shapes)
    except RuntimeError:
        listed = ", ".join(f"{n}: {tuple(s)}" for n, s in zip(names, shapes, strict=True))
        raise ValueError(f"{op}(): expected broadcastable batch dimensions, got {listed}") from None


def check_out(
    op: str,
    out: Any,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    name: str = "out",
    distinct: bool = True,
) -> None:
    """``out`` must be a strided tensor of ``shape``, ``dtype`` and ``device``; with ``distinct``, one
    whose elements are distinct memory (an expanded view would take every write at one place: torch
    refuses it too); under grad mode, one that does not require grad (as torch's ``out=``: a write into it
    is not differentiable)."""
    check_strided(op, name, out, min_ndim=0)
    check_out_needs_no_grad(op, name, out)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{op}(): expected {name}.shape == {tuple(shape)}, got {tuple(out.shape)}")
    if distinct and torch._debug_has_internal_overlap(out) == 1:
        raise ValueError(
            f"{op}(): expected {name} whose elements are distinct memory, got one with overlapping "
            f"elements (strides {out.stride()}, e.g. an expanded view)"
        )
    if out.dtype != dtype:
        raise ArgumentTypeError(f"{op}(): expected {name}.dtype == {dtype}, got {out.dtype}")
    if out.device != device:
        raise ValueError(f"{op}(): expected {name}.device == {device}, got {out.device}")


def check_out_needs_no_grad(op: str, name: str, out: torch.Tensor) -> None:
    """Under grad mode, ``out`` (dense or sparse) must not require grad, as torch's ``out=``: a write into
    it is not differentiable."""
    if out.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{op}(): expected {name} not to require grad (out= is not differentiable; torch refuses it "
            "too), got one that does: pass a tensor without requires_grad, or call under torch.no_grad()"
        )


def mark_written(op: str, name: str, out: torch.Tensor) -> None:
    """``out`` is about to be written in place by a kernel (not by a torch op): refuse an inference tensor
    outside inference mode (torch refuses to write one there), and move its version counter, as torch's
    in-place ops do, so that autograd (a tensor saved for backward, then overwritten) and every cache
    keyed on the counter see the write."""
    if out.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(
            f"{op}(): expected {name} not to be an inference tensor outside torch.inference_mode() (an "
            "in-place write into one is refused there, as torch refuses it), got one: write into a normal "
            "tensor, or call inside torch.inference_mode()"
        )
    torch._C._increment_version((out,))


def _is_real(value: Any) -> bool:
    """A real number, Python's or numpy's (``numbers.Real``), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def check_scalar(op: str, name: str, value: Any) -> float:
    """A real number (Python's or numpy's, not a bool), as a float."""
    if not _is_real(value):
        raise ArgumentTypeError(f"{op}(): expected {name} to be a real number, got {type_name(value)}")
    return float(value)


def check_coefficient(op: str, name: str, value: Any) -> float:
    """``alpha``/``beta`` of a product as ``torch.addmm`` takes them: a real number (Python's or numpy's,
    a bool as 0 or 1) or a 0-d real tensor that does not require grad (its gradient would be dropped), as
    a float."""
    if type(value) is float or type(value) is int:
        return _as_float(op, name, value)
    if isinstance(value, np.bool_):  # (numpy's bool is no numbers.Real; torch.addmm takes it, as Python's)
        return float(value)
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_complex():
        if value.requires_grad:
            raise ValueError(
                f"{op}(): expected {name} not to require grad (it is a coefficient: its gradient is not "
                "computed), got a tensor that does"
            )
        return float(value.item())
    if not isinstance(value, numbers.Real):
        raise ArgumentTypeError(
            f"{op}(): expected {name} to be a real number or a 0-d tensor, got {type_name(value)}"
        )
    return _as_float(op, name, value)


def _as_float(op: str, name: str, value: Any) -> float:
    """``float(value)``; an integer beyond float64's range is a ValueError naming the argument."""
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{op}(): expected {name} within float64's range, got an integer of "
                         f"{int(value).bit_length()} bits") from None  # fmt: skip


def is_int(v: Any) -> TypeGuard[int]:
    """An integer that is not a bool: Python's, or numpy's (``numbers.Integral``; typed as ``int``, whose
    arithmetic numpy's integers share)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_blocksize(op: str, blocksize: Any) -> tuple[int, int]:
    """``b`` or ``(bo, bi)`` (a tuple or list), each an int >= 1, as ``(bo, bi)``."""
    pair = (blocksize, blocksize) if is_int(blocksize) else blocksize
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(is_int(b) for b in pair):
        raise ArgumentTypeError(
            f"{op}(): expected blocksize to be an int or a pair of ints, got {blocksize!r}"
        )
    if pair[0] < 1 or pair[1] < 1:
        raise ValueError(f"{op}(): expected blocksize to be >= 1, got {blocksize!r}")
    return int(pair[0]), int(pair[1])


def check_data_device(op: str, device: Any) -> torch.device:
    """``device`` (None: torch's default device) as a ``torch.device`` this process can put data on, else a
    ``ValueError`` naming it: not ``meta`` (its tensors hold no data: a pattern is data), nor a device
    absent here. ``cpu:0`` is ``cpu``, the one CPU."""
    given = device
    try:
        device = torch.get_default_device() if device is None else torch.device(device)
        if device.type == "meta":
            raise ValueError("meta tensors hold no data")
        if device.type == "cpu":
            device = torch.device("cpu")
        else:
            torch.empty(0, device=device)  # (CUDA present, index in range)
    except (RuntimeError, ValueError, TypeError, AssertionError) as exc:
        raise ValueError(
            f"{op}(): expected device to be a device that holds data, got {given!r}: {exc}"
        ) from None
    return device


def check_size(op: str, name: str, value: Any) -> int:
    """A length or count: an int >= 0 (not a bool)."""
    if not is_int(value):
        raise ArgumentTypeError(f"{op}(): expected {name} to be an int, got {type_name(value)}")
    if value < 0:
        raise ValueError(f"{op}(): expected {name} >= 0, got {value}")
    return int(value)


def check_floating_dtype(op: str, dtype: Any) -> torch.dtype | None:
    """None, or a floating dtype as torch's factories take one (a ``torch.dtype``, or Python's ``float``:
    float64), as a ``torch.dtype``; else the error naming ``dtype``."""
    if dtype is None:
        return None
    try:
        resolved = torch.empty(0, dtype=dtype, device="meta").dtype
    except TypeError:
        resolved = None
    if resolved is None or not resolved.is_floating_point:
        raise ArgumentTypeError(
            f"{op}(): expected dtype to be a floating-point torch.dtype or None, got {dtype!r}"
        )
    return resolved


def is_density(value: Any) -> TypeGuard[float]:
    """A fraction of blocks: a real number (Python's or numpy's, not a bool) in [0, 1]; NaN is not one."""
    return _is_real(value) and 0 <= value <= 1


# A density or fraction as the checks return it: a Fraction or numpy float kept as given (check_density).
Density = float | fractions.Fraction | np.floating[Any]


def kept_blocks(density: Density, blocks: int) -> int:
    """How many of ``blocks`` a pruning to ``density`` keeps: ``density * blocks`` rounded half up, the one
    count ``BSRLinear``, ``sparsify_``, ``GradualPruner`` and ``bsrkit tune`` share. The product is taken
    of the decimal the density prints as (:func:`exact_density`: 0.29 of 50 blocks is 14.5, 15 kept, where
    the float product 14.499999999999998 rounds to 14); Python's ``round`` rounds half to even (0.5 of one
    block kept none)."""
    return math.floor(exact_density(density) * blocks + fractions.Fraction(1, 2))


def exact_density(density: Density) -> fractions.Fraction:
    """``density`` as the decimal it prints as: a ``Fraction`` or an int exactly, numpy's floats by their
    shortest decimal in their own precision (``np.float32(0.29)`` prints 0.29), others by ``repr``."""
    if isinstance(density, numbers.Rational):
        return fractions.Fraction(density)
    return fractions.Fraction(str(density) if isinstance(density, np.floating) else repr(float(density)))


def check_density(op: str, density: Any, name: str = "density") -> Density:
    """:func:`is_density`, or the error naming ``name``: a wrong type, or a value outside [0, 1]. Returns
    what :func:`kept_blocks` counts exactly: a ``Fraction`` or a numpy float as given (``float`` would
    change the count: ``np.float32(0.29)`` of 50 blocks is 15, its float 0.28999999165534973 14), any
    other number as a float."""
    check_scalar(op, name, density)
    if not is_density(density):
        raise ValueError(f"{op}(): expected {name} in [0, 1], got {density!r}")
    if isinstance(density, np.floating):
        return density
    if isinstance(density, numbers.Rational) and not isinstance(density, numbers.Integral):
        return fractions.Fraction(density)
    return float(density)


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """(first byte, number of bytes) of the storage range ``t`` views, from its first element to its last
    (torch strides are never negative); ``(0, 0)`` for no element."""
    if t.numel() == 0:
        return 0, 0
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    size = t.element_size()
    return int(t.storage_offset()) * size, int(extent) * size


def unallocated(what: str) -> RuntimeError:
    """The error for an operand whose storage does not hold the memory it views (released, as FSDP and
    offloading do with ``untyped_storage().resize_(0)``, or shrunk): a loop would read or write outside
    any allocation. torch's ops say as much of a released storage."""
    return RuntimeError(
        f"bsrkit: the {what} has a non-zero number of elements, but its data is not allocated (its storage "
        "was released or shrunk, e.g. by untyped_storage().resize_())"
    )


def storage_address(t: torch.Tensor) -> int:
    """Address of element 0 of ``t``'s storage; :func:`unallocated` when it is 0 (released) and ``t`` has
    elements to read: a loop given it would read or write address 0. (A shrunk storage is read as torch's
    ops read it; a BSR's values are checked whole by :func:`check_allocated`, once per operand.)"""
    return _addresses(t)[0]


def data_address(t: torch.Tensor) -> int:
    """Address of ``t``'s element 0, with :func:`storage_address`'s check."""
    return _addresses(t)[1]


def _addresses(t: torch.Tensor) -> tuple[int, int]:
    data = t.data_ptr()
    base = data - int(t.storage_offset()) * t.element_size()
    if not base and t.numel():
        raise unallocated("operand")
    return base, data


def check_allocated(t: torch.Tensor, what: str = "operand") -> None:
    """:func:`unallocated` unless ``t``'s storage holds every byte ``t`` views (none: nothing to hold)."""
    start, nbytes = byte_span(t)
    if nbytes and t.untyped_storage().nbytes() < start + nbytes:
        raise unallocated(what)


def may_share_memory(a: torch.Tensor, *others: torch.Tensor | None) -> int:
    """How many of ``others`` (None: none) the tensor ``a`` may share memory with, by the absolute byte
    ranges they span (bounds only, like ``numpy.may_share_memory``: interleaved views that touch no
    common element count as sharing). Tensors on different storage objects that alias one memory
    (``torch.from_numpy``, ``from_dlpack`` or ``frombuffer`` views of one buffer) count too. A first test
    on the storages' ranges keeps the common case (apart) to a few reads: a product's out, every call."""
    if not a.numel():
        return 0
    storage = a.untyped_storage()
    low = storage.data_ptr()
    high, span = low + storage.nbytes(), None
    shared = 0
    for b in others:
        if b is None or not b.numel():
            continue
        other = b.untyped_storage()
        start = other.data_ptr()
        if start >= high or low >= start + other.nbytes() or b.device != a.device:
            continue
        a_start, a_bytes = span = span or _absolute_span(a)
        b_start, b_bytes = _absolute_span(b)
        shared += a_start < b_start + b_bytes and b_start < a_start + a_bytes
    return shared


def _absolute_span(t: torch.Tensor) -> tuple[int, int]:
    """(address of the first byte, number of bytes) that ``t``'s elements span."""
    return t.data_ptr(), byte_span(t)[1]


def check_meta(op: str, meta: Any) -> None:
    if meta is not None and not isinstance(meta, dict):
        raise ArgumentTypeError(f"{op}(): expected meta to be a dict or None, got {type_name(meta)}")


def check_max_grid(op: str, max_grid: Any) -> None:
    """torch's ``max_grid=``: None or a tuple or list of ints or Nones (torch reads its first three, pads
    it with Nones and clamps each to at least 1; bsrkit's grids need no cap, so it is only checked)."""
    if max_grid is None:
        return
    if not isinstance(max_grid, (tuple, list)) or not all(v is None or is_int(v) for v in max_grid):
        raise ValueError(
            f"{op}(): expected max_grid to be None or a tuple of ints or Nones, got {max_grid!r}"
        )


def pattern_defect(
    crow: torch.Tensor, col: torch.Tensor, block_rows: int, block_cols: int, nnz: int
) -> str | None:
    """What is wrong with ``(crow, col)`` as the indices of a BSR tensor of ``block_rows x block_cols``
    blocks and ``nnz`` stored blocks per batch, or None when nothing is.

    A valid pattern has integer (int32 or int64) indices with equal batch shapes; ``crow`` has
    ``block_rows + 1`` entries, starts at 0, never decreases and ends at ``nnz``; ``col`` has ``nnz``
    entries, each in ``[0, block_cols)``. (Columns need not be sorted within a row: every kernel sums
    what is stored.)"""
    if crow.dtype not in (torch.int32, torch.int64) or col.dtype != crow.dtype:
        return (
            f"expected crow_indices and col_indices of one dtype, int32 or int64, got {crow.dtype} and "
            f"{col.dtype}"
        )
    if crow.ndim < 1 or col.ndim != crow.ndim or crow.shape[:-1] != col.shape[:-1]:
        return (
            f"expected crow_indices and col_indices with equal batch dimensions, got shapes "
            f"{tuple(crow.shape)} and {tuple(col.shape)}"
        )
    if crow.shape[-1] != block_rows + 1:
        return f"expected crow_indices.shape[-1] == {block_rows + 1} (block rows + 1), got {crow.shape[-1]}"
    if col.shape[-1] != nnz:
        return f"expected col_indices.shape[-1] == {nnz} (nnz), got {col.shape[-1]}"
    if crow.numel() == 0:
        return None
    crow2 = crow.reshape(-1, block_rows + 1)
    if bool((crow2[:, 0] != 0).any()):
        return f"expected crow_indices[..., 0] == 0, got {crow2[:, 0].tolist()[:8]}"
    if bool((crow2[:, -1] != nnz).any()):
        return f"expected crow_indices[..., -1] == {nnz} (nnz), got {crow2[:, -1].tolist()[:8]}"
    if block_rows and bool((crow2.diff(dim=1) < 0).any()):
        row = int((crow2.diff(dim=1) < 0).nonzero()[0, 1])
        return f"expected non-decreasing crow_indices, got a decrease after block row {row}"
    if nnz and col.numel():
        lo, hi = int(col.min()), int(col.max())
        if lo < 0 or hi >= block_cols:
            bad = lo if lo < 0 else hi
            return f"expected col_indices in [0, {block_cols}) (block columns), got {bad}"
    return None


def _index_vector(name: str, t: Any) -> str | None:
    if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
        return f"expected {name} to be a strided tensor, got {type_name(t)}"
    if t.dtype not in (torch.int32, torch.int64):
        return f"expected {name} of dtype int32 or int64, got {t.dtype}"
    return None


def _offsets_defect(name: str, offsets: torch.Tensor, count: int, limit: int) -> str | None:
    """``offsets`` (compressed, like crow): ``count + 1`` entries, non-negative, non-decreasing, <= limit."""
    if offsets.ndim != 1 or offsets.numel() != count + 1:
        return f"expected {name} of shape ({count + 1},), got {tuple(offsets.shape)}"
    if count >= 0 and offsets.numel():
        if int(offsets[0]) < 0 or bool((offsets.diff() < 0).any()):
            return f"expected non-negative, non-decreasing {name}"
        if int(offsets[-1]) > limit:
            return f"expected {name}[-1] <= {limit}, got {int(offsets[-1])}"
    return None


def _range_defect(name: str, values: torch.Tensor, limit: int) -> str | None:
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= limit):
        bad = int(values.min()) if int(values.min()) < 0 else int(values.max())
        return f"expected {name} in [0, {limit}), got {bad}"
    return None


def _tile_defect(name: str, offsets: torch.Tensor, N: int, rows: int, cols: int, R: int) -> str | None:
    """Offsets ``o`` of (rows x cols) tiles at (o // N, o % N) inside an (R x N) matrix."""
    if not offsets.numel():
        return None
    o = offsets.long()
    if int(o.min()) < 0:
        hint = " (an int32 offset that overflowed? build the indices data from int64 indices)"
        return f"expected non-negative {name}, got {int(o.min())}" + (
            hint if offsets.dtype == torch.int32 else ""
        )
    if int((o // N).max()) + rows > R or int((o % N).max()) + cols > N:
        return f"expected {name} of ({rows} x {cols}) tiles inside a ({R} x {N}) matrix"
    return None


def indices_data_defect(
    indices_data: tuple[Any, ...], P: int, Ms: int, Ks: int, others: tuple[int, ...], acc: tuple[int, ...]
) -> str | None:
    """What is wrong with ``indices_data`` of ``scatter_mm`` for ``P`` blocks ``(Ms, Ks)``, ``others`` and
    ``accumulators`` of the given shapes, or None: every offset must stay inside its operand, so that no
    kernel reads or writes outside them (semantics in :func:`bsrkit.scatter.scatter_mm`)."""
    fmt = indices_data[0]
    if fmt == "scatter_mm":
        if len(indices_data) != 3:
            return f"expected (format, c_offsets, pq), got {len(indices_data)} items"
        c_offsets, pq = indices_data[1:]
        for name, t in (("c_offsets", c_offsets), ("pq", pq)):
            defect = _index_vector(name, t)
            if defect:
                return defect
        if pq.ndim != 2 or pq.shape[-1] != 2:
            return f"expected pq of shape (G, 2), got {tuple(pq.shape)}"
        defect = _offsets_defect("c_offsets", c_offsets, acc[0], pq.shape[0])
        if defect or not c_offsets.numel():
            return defect
        used = pq[int(c_offsets[0]) : int(c_offsets[-1])]
        return _range_defect("pq[:, 0] (blocks)", used[:, 0], P) or _range_defect(
            "pq[:, 1] (others)", used[:, 1], others[0]
        )
    compressed = fmt == "bsr_strided_mm_compressed"
    expected_len = 5 if compressed else 6
    if len(indices_data) != expected_len or not isinstance(indices_data[-1], dict):
        return f"expected {expected_len} items ending with the meta dict, got {len(indices_data)}"
    meta = indices_data[-1]
    split_n = meta.get("SPLIT_N")
    K, N = others[-2:]
    M = acc[-2]
    # (a bool is refused, as bsr_scatter_mm_indices_data refuses it)
    if not is_int(split_n) or split_n < 1 or (N and N % split_n):
        return f"expected meta['SPLIT_N'] to be a positive divisor of N == {N}, got {split_n!r}"
    Ns = N // split_n
    names = (
        ("c_indices", "r_offsets", "q_offsets")
        if compressed
        else ("c_indices", "r_offsets", "p_offsets", "q_offsets")
    )
    tensors = indices_data[1:-1]
    for name, t in zip(names, tensors, strict=True):
        defect = _index_vector(name, t) or (None if t.ndim == 1 else f"expected {name} to be 1-D")
        if defect:
            return defect
    c_indices, r_offsets, q_offsets = tensors[0], tensors[1], tensors[-1]
    defect = _tile_defect("r_offsets", r_offsets, N, Ms, Ns, M) or _tile_defect(
        "q_offsets", q_offsets, N, Ks, Ns, K
    )
    if defect:
        return defect
    if not compressed:
        p_offsets = tensors[2]
        limit = min(p_offsets.numel(), q_offsets.numel())
        return _offsets_defect("c_indices", c_indices, r_offsets.numel(), limit) or _range_defect(
            "p_offsets",
            p_offsets[int(c_indices[0]) : int(c_indices[-1])] if c_indices.numel() else p_offsets,
            P,
        )
    defect = _offsets_defect("c_indices", c_indices, c_indices.numel() - 1, P)
    if defect or not r_offsets.numel():
        return defect
    r = r_offsets.long()
    m = (r // N) // Ms
    if int(m.max()) >= c_indices.numel() - 1:
        return f"expected r_offsets within the {c_indices.numel() - 1} block rows of c_indices"
    n = (r % N) // Ns
    c = c_indices.long()
    c0, c1 = c[m], c[m + 1]
    last = n * c1 + (split_n - n) * c0 + (c1 - c0) - 1  # the last q_offsets item a tile reads
    if bool(((c1 > c0) & (last >= q_offsets.numel())).any()):
        return f"expected q_offsets with at least {int(last.max()) + 1} items, got {q_offsets.numel()}"
    return None


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return "{" + ", ".join(str(d).removeprefix("torch.") for d in dtypes) + "}"
