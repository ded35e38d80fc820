"""The contract every backend implements, and the parameter schema it declares.

A backend is an object with the attributes and methods of :class:`Backend`. It receives arguments that
``bsrkit.ops`` has already validated, batch-broadcast and allocated (never user input), and owns all of
its own marshaling: strides and offsets, batch flattening, locks, thread counts, launch grids. It never
validates user input and never caches; index data derived from the pattern comes from
:mod:`bsrkit.plans` (which validates and caches it once per pattern).

Shapes, for every method: the sparse operand ``a`` is an :class:`~bsrkit.operand.Operand` of shape
``(*Bb, M, K)`` with blocks ``(Ms, Ks)``; ``batch`` is the broadcast batch shape of the call; ``dense`` is
``(*Bd, K, N)`` and ``out`` ``(*batch, M, N)``, both with arbitrary strides; all on the backend's device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

import torch

from bsrkit.validation import is_int

if TYPE_CHECKING:
    from bsrkit.mask_bias import BlockBias
    from bsrkit.operand import Operand

__all__ = [
    "CAPABILITIES",
    "KERNELS",
    "Backend",
    "FusedAttention",
    "ParamSpec",
    "fused_attention",
    "int_at_least_one",
    "power_of_two_at_least_16",
    "power_of_two_warps",
    "zero_or_one",
]

# What a backend may be asked to run (``not_supported_reasons`` names one of these). int8 products will
# be added here, each as a method of the contract below. "softmax" covers both of its methods.
KERNELS = ("addmm", "sampled", "scatter_mm", "softmax")

# Optional capabilities a backend may declare in ``Backend.capabilities``, each a protocol below that
# the backend then implements: "fused_attention" (:class:`FusedAttention`).
CAPABILITIES = ("fused_attention",)


class ParamSpec(NamedTuple):
    """One tunable parameter: a predicate on its value and the words for an error message."""

    check: Callable[[Any], bool]
    expected: str


int_at_least_one = ParamSpec(lambda v: is_int(v) and v >= 1, "an int >= 1")
zero_or_one = ParamSpec(lambda v: is_int(v) and v in (0, 1), "0 or 1")
power_of_two_warps = ParamSpec(
    lambda v: is_int(v) and 1 <= v <= 32 and not v & (v - 1), "a power of two in [1, 32] (Triton's warps)"
)
power_of_two_at_least_16 = ParamSpec(
    lambda v: is_int(v) and v >= 16 and not v & (v - 1), "a power of two >= 16"
)


class Backend(Protocol):
    """A product backend. Instances are stateless singletons registered in :mod:`bsrkit.dispatch`."""

    name: str  # "cpu", "torch", "triton": the values of $BSRKIT_BACKEND
    display_name: str  # for messages: "CPU", "torch", "Triton"
    # Parameters ``meta=`` may set (empty: the backend has none, and ``meta`` is ignored).
    param_schema: ClassVar[Mapping[str, ParamSpec]]
    # Extra flag of ``bsrkit tune`` for this backend ("" or "--backend triton "), for messages.
    tune_flag: str
    # Device types for which the dispatcher picks this backend on its own (None: any); a backend may
    # run elsewhere when forced (Triton's interpreter on CPU tensors).
    auto_devices: ClassVar[frozenset[str] | None]
    # Which of :data:`CAPABILITIES` it implements (see :func:`fused_attention`).
    capabilities: ClassVar[frozenset[str]]

    def not_supported_reasons(self, kernel: str, device: torch.device, dtype: torch.dtype) -> list[str]:
        """Why this backend cannot run ``kernel`` (one of :data:`KERNELS`) here; empty when it can."""
        ...

    def tuning_device(self, device: torch.device) -> str:
        """The device name under which the tuning table keys this backend's entries."""
        ...

    def complete_params(
        self,
        kernel: str,
        dtype: torch.dtype,
        shape: tuple[int, int, int],
        blocksize: tuple[int, int],
        chosen: dict[str, Any],
    ) -> dict[str, Any]:
        """Every parameter of a launch: ``chosen`` (valid per :attr:`param_schema`, from ``meta=`` or
        the tuning table) completed with this backend's defaults for ``kernel`` (one of
        :data:`KERNELS`) at ``shape = (M, K, N)``."""
        ...

    def addmm(
        self,
        a: Operand,
        dense: torch.Tensor,
        out: torch.Tensor,
        batch: torch.Size,
        alpha: float,
        overwrite: bool,
        params: dict[str, Any],
    ) -> Callable[..., Any] | None:
        """``out = alpha * a @ dense`` (``overwrite``) or ``out += alpha * a @ dense``, for every batch
        index. Called only with ``nnz > 0``, ``K > 0`` and a non-empty ``out``. May return a prepared
        call ``rerun(values, dense, out)`` that repeats this product for operands of the same layouts
        (shapes, strides, offsets, dtypes) at other data addresses, with the same ``a`` indices,
        ``batch``, ``alpha``, ``overwrite`` and ``params`` (see :func:`bsrkit.dispatch.addmm`).

        A prepared call has a bool attribute ``proves``. When True, ``rerun(values, dense, out, True)``
        also compares, inside the work it does anyway, every index entry of ``a`` (every byte that
        ``a.pattern.proof`` covers) with the plan it runs on, addressing memory through that plan only,
        and returns how many differ (0: proven unchanged; else ``out`` is to be recomputed). Its caller
        checks first that the proof's storages are intact (:meth:`bsrkit.freshness.Snapshot.intact`, or
        a kept weight's parts, which hold them: see :mod:`bsrkit.shortcuts`).

        It may also have an attribute ``at``: None, or ``at(values_ptr, dense_ptr, out_ptr, prove=False)``,
        the same call given the operands' data addresses instead of the tensors (for a caller that holds
        the layouts fixed: :func:`bsrkit.dispatch.rerun_weight_call_directly`)."""
        ...

    def sampled(
        self,
        a: Operand,
        mat1: torch.Tensor,
        mat2: torch.Tensor,
        batch: torch.Size,
        alpha: float,
        params: dict[str, Any],
    ) -> torch.Tensor:
        """SDDMM: ``V[b, g] = alpha * mat1[b, rows(g)] @ mat2[b, :, cols(g)]`` at ``a``'s stored blocks
        (``a.values`` gives only the block shape ``(Ms, Ns)``). ``mat1`` is ``(*B1, M, K)``, ``mat2``
        ``(*B2, K, N)``; returns ``(prod(batch), nnz, Ms, Ns)`` in ``mat1``'s dtype."""
        ...

    def scatter_mm(
        self,
        blocks: torch.Tensor,
        others: torch.Tensor,
        indices_data: tuple[Any, ...],
        accumulators: torch.Tensor,
        params: dict[str, Any],
        overwrite: bool = False,
    ) -> None:
        """``accumulators += scatter_mm(blocks, others, indices_data)`` (``overwrite``: ``=``, every
        element the indices data do not reach set to 0) in one of the three indices formats (semantics
        in :func:`bsrkit.scatter.scatter_mm`). In the ``scatter_mm`` format ``others`` is ``(*Q, Ks, Ns)``
        and ``accumulators`` ``(*R, Ms, Ns)``, indexed by their flattened leading dimensions (views
        with any strides); for the ``bsr_strided_mm*`` formats ``others`` is ``(*B, K, N)`` and
        ``accumulators`` ``(*B, M, N)``."""
        ...

    def softmax(
        self,
        a: Operand,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        zero_empty_rows: bool,
    ) -> torch.Tensor:
        r"""Row softmax over the stored entries: ``Y[b, g, i, j] = exp(Z[b, g, i, j] - m) / s`` with
        :math:`Z = x + \mathrm{bias}`, ``m`` the maximum and ``s`` the sum of ``exp(Z - m)`` over the
        row's stored entries (every block ``g'`` of the block row of ``g``, row ``i``, all ``j``).

        ``x`` is ``(*batch, nnz, Ms, Ns)`` and ``a``'s indices have that batch (``a.crow`` is
        ``(*batch, MB + 1)``); ``bias`` is None or ``(*Bm, nnz, Ms, Ns)`` broadcasting to ``x``, may hold
        ``-inf`` (entry excluded: ``Z = -inf`` there even where ``x`` is NaN) and has ``x``'s dtype
        (float32 for half ``x``). A row whose entries are all ``-inf`` gives 0 with ``zero_empty_rows``,
        else NaN (as ``torch.softmax``); a NaN in ``Z`` makes its whole row NaN. Half types are
        computed in float32. Returns a new tensor of ``x``'s shape and dtype; never called with
        ``x.numel() == 0``."""
        ...

    def softmax_backward(self, a: Operand, y: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The softmax's vector-Jacobian product on the stored entries: ``dX = Y * (dY - r)`` with
        ``r = sum over the row of dY * Y``. ``y`` (the softmax's result) and ``grad`` are
        ``(*batch, nnz, Ms, Ns)`` with ``a``'s indices batched as in :meth:`softmax`; returns a new
        tensor in ``y``'s dtype."""
        ...


class FusedAttention(Protocol):
    r"""The optional capability "fused_attention": attention over a BSR mask in one pass of fused loops
    (scores, online softmax and the product per block row), never materialising the weights.

    ``a`` is the mask's pattern broadcast to the call's batch (``(*batch, L, S)``, blocks ``(Ms, Ns)``);
    ``query`` ``(*B, L, E)``, ``key`` ``(*B, S, E)``, ``value`` ``(*B, S, Ev)`` broadcast to it; ``bias`` is
    the mask per stored block (:class:`~bsrkit.mask_bias.BlockBias`, in the softmax's dtype); ``scale``
    multiplies the scores. Either method may decline a call (a dtype or size its loops do not take) by
    returning None: the caller then composes SDDMM, softmax and products."""

    def attention_forward(
        self,
        a: Operand,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        bias: BlockBias,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        r"""``(out, lse)``: :math:`\mathrm{out} = \mathrm{softmax}(s\,QK^T + \mathrm{bias})\,V` over the
        stored entries ``(*batch, L, Ev)`` in ``query``'s dtype, and each row's log-sum-exp
        ``(*batch, L)`` (float32 or float64), which the backward reuses; a row with no allowed entry
        gives zeros."""
        ...

    def attention_backward(
        self,
        a: Operand,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        grad: torch.Tensor,
        bias: BlockBias,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(dQ, dK, dV)`` of :meth:`attention_forward` with the call's batch, given its ``out`` and
        ``lse`` and the output gradient ``grad``."""
        ...


def fused_attention(backend: Backend) -> FusedAttention | None:
    """``backend`` as a :class:`FusedAttention`, when it declares that capability; else None."""
    if "fused_attention" in backend.capabilities:
        return backend  # type: ignore[return-value]  # (declared: it implements the protocol)
    return None
