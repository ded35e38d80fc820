"""The sparse operand of a product, as the parts every backend consumes, and its transpose."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from bsrkit import plans, shortcuts
from bsrkit.keys import TensorKey
from bsrkit.validation import check_allocated

__all__ = ["Operand"]


class Operand(NamedTuple):
    """A BSR operand as ``(crow, col, values)``, its dense shape ``(M, K)`` and its plan source.

    ``values`` is ``(*Bb, nnz, Ms, Ks)`` (for a transposed operand a strided view of the original's
    blocks); ``source`` is what its plans are cached on (see :mod:`bsrkit.plans`); a transposed operand has
    ``transposed_block_cols`` > 0 and borrows its source's plans.
    """

    crow: torch.Tensor
    col: torch.Tensor
    values: torch.Tensor
    M: int
    K: int
    source: Any
    transposed_block_cols: int = 0
    pattern: plans.Pattern | None = None  # the validated pattern, which keeps plans and prepared calls
    # A kept operand's own prepared calls (keyed without the values' layout, fixed for its wrapper); read
    # and written by bsrkit.shortcuts only. None for operands that are not kept.
    calls: dict[Any, Any] | None = None

    @property
    def batch(self) -> torch.Size:
        return self.values.shape[:-3]

    @property
    def nnz(self) -> int:
        return self.values.shape[-3]

    def kernel_indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(crow, col)`` for a kernel to read. On the CPU, the validated pattern's copy
        (``pattern.indices``, see :class:`bsrkit.plans.Pattern`): a write racing the product cannot steer
        an access. Elsewhere, and for a transposed operand (its indices are its plan's copies already),
        ``crow`` and ``col``: on a device a hit does not compare the index data by default (see
        :mod:`bsrkit.freshness`), so the kernels read the live tensors, which are never stale."""
        pattern = self.pattern
        if pattern is None or self.transposed_block_cols or self.crow.device.type != "cpu":
            return self.crow, self.col
        return pattern.indices

    def plan(self, name: str, *params: Any) -> Any:
        """The plan ``name`` of this operand's pattern: derived from its validated bytes and kept on it
        (:meth:`bsrkit.plans.Pattern.plan`); from the shared cache on ``source`` without a pattern."""
        if self.pattern is not None:
            return self.pattern.plan(name, *params)
        return plans.cached(name, self.source, *params)

    @classmethod
    def of(
        cls, bsr: torch.Tensor, op: str = "bsrkit", name: str = "bsr", members_proven: bool = False
    ) -> Operand:
        """The operand of a BSR tensor, its pattern validated (once per pattern: see
        :func:`bsrkit.plans.check_pattern`); ``op`` and ``name`` word the ``ValueError`` for a malformed
        one. The same object for repeated calls with the same, unchanged tensor (see
        :func:`bsrkit.shortcuts.kept_operand`, and its ``members_proven``)."""
        kept = shortcuts.kept_operand(bsr, members_proven=members_proven)
        if kept is not None:
            return kept
        M, K = bsr.shape[-2:]
        version = None if bsr.is_inference() else bsr._version  # (read first: a change since is a miss)
        try:
            # (values() is a view whose base is bsr: the kept operand holds it detached, or bsr would
            # never die)
            crow, col, values = bsr.crow_indices(), bsr.col_indices(), bsr.values().detach()
        except RuntimeError as exc:
            if "inference tensor" not in str(exc):
                raise
            # (torch's accessors cannot view members made under inference mode from a wrapper made
            # outside it; a BSRLinear's own wrapper is made to match its parts, see kept_weight)
            raise ValueError(
                f"{op}(): expected {name}'s index and value tensors to be inference tensors only if it is "
                "one (torch cannot view them from it): build it inside torch.inference_mode() too, or "
                "from tensors made outside"
            ) from None
        if values.dtype != bsr.dtype:
            # (a member given another dtype: `.data =` or module.half() on the tensor it was built from;
            # the kernels would read its bytes as the tensor's dtype, past their end)
            raise ValueError(
                f"{op}(): malformed {name}: its values are {values.dtype}, the tensor says {bsr.dtype} (its "
                "values were given another dtype after it was built: build it again)"
            )
        check_allocated(values, f"{name}'s values")  # (released or shrunk: the loops read past it)
        if values.is_neg():  # (the kernels read memory: a negative view is read as its negation)
            version, values = None, values.resolve_neg()  # (a copy: not kept, resolved again next call)
        # The plans' cache key, from the members fetched here anyway (each accessor costs ~1 µs).
        key = TensorKey(bsr, members=(crow, col, values))
        if not key.version:  # (inference index tensors: no counter sees a write, a kept operand goes stale)
            version = None
        a = cls.parts(crow, col, values, M, K, key, op, name)
        if version is not None:
            a = a._replace(calls={})
            shortcuts.keep_operand(bsr, version, a)
        return a

    @classmethod
    def after_stale(
        cls, bsr: torch.Tensor, stale: Operand | None, op: str = "bsrkit", name: str = "bsr"
    ) -> Operand:
        """``bsr``'s operand rebuilt after a deferred proof found its index data changed
        (:class:`bsrkit.shortcuts.StalePattern`): ``stale`` and what hangs on its pattern are dropped,
        and the pattern is judged again (a malformed one raises ``ValueError`` here). The one recovery
        of every product that takes the deferred proof; it then computes again."""
        if stale is not None:
            shortcuts.forget_operand(bsr, stale)
        return cls.of(bsr, op, name)

    @classmethod
    def parts(
        cls,
        crow: torch.Tensor,
        col: torch.Tensor,
        values: torch.Tensor,
        M: int,
        K: int,
        source: Any,
        op: str = "bsrkit",
        name: str = "bsr",
    ) -> Operand:
        """The operand of the BSR ``(crow, col, values)`` of shape ``(*, M, K)``, plans cached on
        ``source``; its pattern validated as in :meth:`of`."""
        Ms, Ks, nnz = (*values.shape[-2:], values.shape[-3]) if values.ndim >= 3 else (0, 0, -1)
        if values.shape[:-3] != crow.shape[:-1] or col.shape[-1:] != (nnz,) or not Ms or not Ks:
            raise ValueError(
                f"{op}(): malformed {name}: expected values of shape (*batch, nnz, Ms, Ks) with batch "
                f"{tuple(crow.shape[:-1])} and nnz == {col.shape[-1]} (col_indices), Ms, Ks > 0, got "
                f"{tuple(values.shape)}"
            )
        if M % Ms or K % Ks:
            raise ValueError(f"{op}(): malformed {name}: blocks {(Ms, Ks)} do not tile its shape {(M, K)}")
        try:
            pattern = plans.check_pattern(source, M // Ms, K // Ks, nnz)
        except plans.MalformedPatternError as exc:
            raise ValueError(f"{op}(): malformed {name}: {exc}") from None
        return cls(crow, col, values, M, K, source, 0, pattern)

    def transposed(self) -> Operand:
        """The operand of ``bsr.mT``: the plan maps its blocks to the original's; no dense transpose."""
        Ks = self.values.shape[-1]
        t = self.plan("transpose", self.K // Ks if Ks else 0)
        batch = self.batch
        if self.values.stride(-3) == 0 or self.nnz <= 1:
            # Every block the same (expanded values): any order of them is this view itself; a gather
            # would materialise nnz copies of one block.
            values_t = self.values.mT
        else:
            flat = self.values.reshape(-1, *self.values.shape[-3:])
            rows = torch.arange(flat.shape[0], device=flat.device)[:, None]
            gathered = flat[rows, t.perm]  # (B, nnz, Ms, Ks), a copy
            values_t = gathered.reshape(*batch, *gathered.shape[1:]).mT  # blocks (Ks, Ms), column-major
        crow_t = t.crow.reshape(*batch, t.crow.shape[-1])  # (not -1: ambiguous with no batch)
        col_t = t.col.reshape(*batch, t.col.shape[-1])
        return Operand(
            crow_t, col_t, values_t, self.K, self.M, self.source, self.K // Ks if Ks else 0, self.pattern
        )
