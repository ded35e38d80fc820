r"""Tensor parallelism for one large block-sparse weight: :class:`BlockRowParallelBSRLinear`.

The weight :math:`W` (``out_features x in_features``) of a :class:`~bsrkit.nn.BSRLinear` is split into
contiguous ranges of block rows, one per rank of a process group:
:math:`W = [W_0; W_1; \dots; W_{P-1}]`. Rank :math:`r` keeps only :math:`W_r` (its blocks, their column
indices, its rows of the bias). With the input :math:`x` the same on every rank (tensor parallelism, not
data parallelism):

.. math::

    y_r = x W_r^T + b_r \quad\text{(local)}, \qquad y = [y_0, \dots, y_{P-1}] \quad\text{(all-gather)}

and, for a loss computed identically on every rank from the gathered :math:`y`, with
:math:`G = \partial L / \partial y` and :math:`G_r` its columns of rank :math:`r`:

.. math::

    \partial L / \partial W_r = (G_r^T x)|_{P_r}, \quad \partial L / \partial b_r = \textstyle\sum G_r
    \quad\text{(local)}, \qquad \partial L / \partial x = \textstyle\sum_r G_r W_r \quad\text{(all-reduce)}.

This is the convention of Megatron-LM's ``ColumnParallelLinear(gather_output=True)`` and of
``torch.distributed.tensor.parallel.ColwiseParallel(output_layouts=Replicate())``: the backward of the
gather takes the local slice without communication. (``torch.distributed.nn.functional.all_gather``
sums the slices over ranks instead, which suits a loss that differs per rank, not this one.)

Rows are split by stored blocks, not by row count (:func:`split_block_rows`), since the work of a rank is
proportional to its blocks. Splits are therefore uneven in rows, which DTensor's ``Shard`` placement
(``torch.chunk`` sizes) cannot express; the layer takes a 1-D ``DeviceMesh`` or a process group, and
runs its two collectives itself (gloo needs equal sizes, so local outputs are padded to the largest).
"""

from __future__ import annotations

import bisect
import copy
import itertools
import numbers
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bsrkit import custom_ops, shortcuts
from bsrkit.nn import BSRLinear, check_loaded_pattern, loaded_pattern
from bsrkit.places import module_places, put
from bsrkit.validation import (
    ArgumentTypeError,
    CheckpointMismatchError,
    autocast_inputs,
    check_operand_dtypes,
    type_name,
)

__all__ = ["BlockRowParallelBSRLinear", "parallelize", "split_block_rows"]


def split_block_rows(crow_indices: torch.Tensor, parts: int) -> list[int]:
    """Boundaries ``b`` (``parts + 1`` block-row indices, ``b[0] = 0``, ``b[-1]`` = block rows) that split
    the block rows into ``parts`` contiguous ranges ``[b[i], b[i+1])`` minimising the largest number of
    stored blocks in a range.

    Among the optimal splits the greedy one is taken (each range takes as many rows as fit), so trailing
    ranges may be lighter or empty. A pattern without stored blocks is split evenly by rows.
    """
    if not isinstance(parts, numbers.Integral) or isinstance(parts, bool) or parts < 1:
        raise ValueError(f"split_block_rows(): expected parts to be an int >= 1, got {parts!r}")
    parts = int(parts)
    if crow_indices.dim() != 1 or crow_indices.numel() < 1 or crow_indices.is_floating_point():
        raise ValueError(
            "split_block_rows(): expected 1-D integer crow_indices, got "
            f"{crow_indices.dtype} of shape {tuple(crow_indices.shape)}"
        )
    crow = [int(c) for c in crow_indices.tolist()]
    if crow[0] != 0:  # (nnz is read as crow[-1])
        raise ValueError(f"split_block_rows(): expected crow_indices to start at 0, got {crow[0]}")
    rows, nnz = len(crow) - 1, crow[-1]
    if nnz == 0:
        return [rows * i // parts for i in range(parts + 1)]

    def greedy(cap: int) -> list[int] | None:
        bounds, start = [0], 0
        for _ in range(parts):
            # The furthest stop with crow[stop] - crow[start] <= cap.
            start = bisect.bisect_right(crow, crow[start] + cap, lo=start) - 1
            bounds.append(start)
        return bounds if start == rows else None

    lo = max(-(-nnz // parts), max(b - a for a, b in itertools.pairwise(crow)))
    hi = nnz
    while lo < hi:  # the smallest feasible cap; greedy(nnz) always succeeds
        mid = (lo + hi) // 2
        if greedy(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    bounds = greedy(lo)
    assert bounds is not None
    return bounds


def _resolve_group(group: Any) -> dist.ProcessGroup:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "BlockRowParallelBSRLinear(): expected an initialised default process group "
            "(call torch.distributed.init_process_group first)"
        )
    if group is None:
        return dist.group.WORLD  # type: ignore[return-value]
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"BlockRowParallelBSRLinear(): expected a 1-D DeviceMesh, got {group.ndim}-D")
        return group.get_group()
    if isinstance(group, dist.ProcessGroup):
        return group
    raise TypeError(
        f"BlockRowParallelBSRLinear(): expected a ProcessGroup, a 1-D DeviceMesh or None, got "
        f"{type_name(group)}"
    )


class _ReplicatedInput(torch.autograd.Function):
    """Identity forward; backward sums the partial input gradients of all ranks (``sum_r G_r W_r``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _AllReduce.apply(grad, ctx.group), None


class _AllReduce(torch.autograd.Function):
    """The sum over the ranks, differentiable (its own adjoint): a second derivative through the input
    gradient runs it again, with no in-place collective on the graph (torch warns that those have no
    autograd kernel)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = t.clone(memory_format=torch.contiguous_format)  # all_reduce writes in place
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _AllReduce.apply(grad, ctx.group), None


def _pairs(bounds: tuple[int, ...]) -> list[tuple[int, int]]:
    return list(itertools.pairwise(bounds))


# The key of a parallel layer's part (see BlockRowParallelBSRLinear._part) in its state_dict metadata.
_PART_KEY = "bsrkit_tensor_parallel_part"


def _gather_int(n: int, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    everyone = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
    dist.all_gather_single(everyone, torch.tensor([n], dtype=torch.int64, device=device), group=group)
    return everyone.tolist()


def _gather_rows(
    local: torch.Tensor, counts: list[int] | tuple[int, ...], group: dist.ProcessGroup
) -> torch.Tensor:
    """Concatenate the ranks' ``local`` tensors (``counts[r]`` rows on rank ``r``) on every rank; gloo
    gathers equal sizes only, so each rank sends its rows padded to the largest count."""
    pad = max(counts)
    if local.shape[0] == pad:
        send = local.contiguous()
    else:
        send = local.new_zeros((pad, *local.shape[1:]))
        send[: local.shape[0]] = local
    gathered = local.new_empty((len(counts) * pad, *local.shape[1:]))
    dist.all_gather_single(gathered, send, group=group)
    if all(c == pad for c in counts):
        return gathered
    return torch.cat([gathered[i * pad : i * pad + c] for i, c in enumerate(counts)])


class _GatherRows(torch.autograd.Function):
    """All-gather of row blocks of uneven sizes ``counts``; backward takes this rank's rows, no
    communication (the loss is the same on every rank)."""

    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, group: dist.ProcessGroup, counts: tuple[int, ...], rank: int
    ) -> torch.Tensor:
        ctx.rows = (sum(counts[:rank]), counts[rank])
        return _gather_rows(local, counts, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        start, count = ctx.rows
        return grad[start : start + count], None, None, None


class BlockRowParallelBSRLinear(nn.Module):
    r"""A :class:`~bsrkit.nn.BSRLinear` whose block rows are split over the ranks of ``group``.

    Built from a full ``layer`` that is identical on every rank (same seed, or loaded from one
    checkpoint); it copies out this rank's rows, so ``layer`` can be freed afterwards. ``group`` is a
    process group, a 1-D ``DeviceMesh``, or ``None`` for the default group. The forward takes the same
    ``x`` on every rank and returns the full output on every rank (see :mod:`bsrkit.distributed` for the
    formulas). Parameters and buffers hold this rank's part only:

    - ``values``: ``(local nnz, bo, bi)``; ``bias``: ``(local rows * bo,)``
    - ``crow_indices`` (rebased to start at 0), ``col_indices``: this rank's pattern.
    - ``row_splits``: the block-row boundaries of all ranks (:func:`split_block_rows`).

    The construction checks with two small all-gathers that every rank has the same layer: shape,
    blocksize, dtype, bias and pattern. The ``state_dict`` holds this rank's part under the names of
    ``BSRLinear``'s, so it differs per rank: checkpoint the layer from :meth:`to_bsr_linear` (or the
    unsharded layer) instead. ``torch.distributed.checkpoint`` takes such plain tensors for replicated
    and keeps one rank's part: do not save this layer with it. A deep copy shares the process group.
    """

    crow_indices: torch.Tensor
    col_indices: torch.Tensor

    def __init__(self, layer: BSRLinear, group: Any = None) -> None:
        super().__init__()
        if not isinstance(layer, BSRLinear):
            raise TypeError(f"BlockRowParallelBSRLinear(): expected a BSRLinear, got {type_name(layer)}")
        self.group = _resolve_group(group)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.blocksize = layer.blocksize
        crow, col = layer.crow_indices, layer.col_indices
        _check_same_pattern(crow, col, layer, self.group)
        self.row_splits = tuple(split_block_rows(crow, self.world_size))
        start, stop = self.row_splits[self.rank], self.row_splits[self.rank + 1]
        first, last = int(crow[start]), int(crow[stop])
        self.register_buffer("crow_indices", (crow[start : stop + 1] - first).clone())
        self.register_buffer("col_indices", col[first:last].clone())
        self.values = nn.Parameter(layer.values.detach()[first:last].clone(), layer.values.requires_grad)
        bo = self.blocksize[0]
        if layer.bias is not None:
            bias = layer.bias.detach()[start * bo : stop * bo].clone()
            self.bias: nn.Parameter | None = nn.Parameter(bias, layer.bias.requires_grad)
        else:
            self.register_parameter("bias", None)
        self.train(layer.training)

    @property
    def local_out_features(self) -> int:
        return (self.row_splits[self.rank + 1] - self.row_splits[self.rank]) * self.blocksize[0]

    def _apply(self, fn: Any, recurse: bool = True) -> BlockRowParallelBSRLinear:
        shortcuts.forget_weight(self.values)  # (as BSRLinear's: swap_tensors refuses a weakly referenced one)
        return super()._apply(fn, recurse)

    def _part(self) -> tuple[Any, ...]:
        """Which part of which layer this rank holds: what its tensors' shapes do not say."""
        return (self.out_features, self.in_features, self.rank, self.world_size, tuple(self.row_splits))

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        metadata = getattr(destination, "_metadata", None)  # (kept by torch.save, handed back on load)
        if metadata is not None and prefix[:-1] in metadata:
            metadata[prefix[:-1]][_PART_KEY] = self._part()

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                              *args: Any, **kwargs: Any) -> None:  # fmt: skip
        part = local_metadata.get(_PART_KEY)  # (absent from older checkpoints: loaded as before)
        if part is not None and tuple(tuple(p) if isinstance(p, list) else p for p in part) != self._part():
            raise CheckpointMismatchError(
                f"BlockRowParallelBSRLinear.load_state_dict(): {prefix or 'the checkpoint'} holds the part "
                f"(out, in, rank, world size, block-row splits) = {tuple(part)}, this rank's is "
                f"{self._part()} (another rank's part, or another split: load to_bsr_linear()'s whole layer "
                "into a BSRLinear and parallelize it)"
            )
        # (as BSRLinear's: a malformed pattern is refused here, naming it, not at the next forward)
        pattern = loaded_pattern(state_dict, prefix, self.crow_indices, self.col_indices)[2]
        if pattern is not None:
            blocks = (self.local_out_features // self.blocksize[0], self.in_features // self.blocksize[1])
            # (this layer keeps its nnz: a checkpoint of another is refused here, before torch's load
            # wrote crow_indices and failed on the values, leaving the two apart)
            nnz, values = self.values.shape[0], state_dict.get(prefix + "values")
            sizes = {pattern[1].shape[-1] if pattern[1].ndim else None}
            sizes |= {values.shape[0] if values.ndim else None} if isinstance(values, torch.Tensor) else set()
            if sizes != {nnz}:
                raise CheckpointMismatchError(
                    f"BlockRowParallelBSRLinear.load_state_dict(): {prefix or 'the checkpoint'} holds "
                    f"{sorted(sizes, key=str)} blocks, this rank's part {nnz}: the parallel layer keeps its "
                    "nnz (load the whole layer into a BSRLinear and parallelize it)"
                )
            check_loaded_pattern("BlockRowParallelBSRLinear.load_state_dict", prefix, pattern, blocks, nnz)
        shortcuts.forget_weight(self.values)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> BlockRowParallelBSRLinear:
        memo[id(self.group)] = self.group  # (a process group is shared, never copied)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = input  # (nn.Linear's argument name, as BSRLinear's)
        op = "BlockRowParallelBSRLinear.forward"
        if not isinstance(x, torch.Tensor) or x.layout is not torch.strided:
            got = x.layout if isinstance(x, torch.Tensor) else type_name(x)
            raise ArgumentTypeError(f"{op}(): expected input to be a strided (dense) torch.Tensor, got {got}")
        if not x.ndim or x.shape[-1] != self.in_features:
            raise ValueError(
                f"BlockRowParallelBSRLinear.forward(): expected input of shape (*, {self.in_features}), "
                f"got {tuple(x.shape)}"
            )
        lead = x.shape[:-1]
        x, values, bias = autocast_inputs((x, self.values, self.bias))  # (as BSRLinear's)
        if x.dtype is not values.dtype or (bias is not None and bias.dtype is not values.dtype):
            check_operand_dtypes(op, "input", x, "values", values)
            if bias is not None:  # (as BSRLinear's, as F.linear: one dtype for the three)
                check_operand_dtypes(op, "bias", bias, "values", values)
        x2 = _ReplicatedInput.apply(x.reshape(-1, self.in_features), self.group)
        # y_r = x W_r^T (row-major, as BSRLinear's): its transpose's rows are this rank's output features,
        # gathered along the first dimension.
        y_r = custom_ops.differentiable_linear(
            self.crow_indices,
            self.col_indices,
            values,
            x2,
            bias,  # (this rank's part: added before the gather)
            self.local_out_features,
            self.in_features,
            False,
        )
        bo = self.blocksize[0]
        counts = tuple((b - a) * bo for a, b in _pairs(self.row_splits))
        # (row-major, as BSRLinear's output: the ops after it then compute what they compute after it)
        y = _GatherRows.apply(y_r.mT, self.group, counts, self.rank).mT.contiguous()
        return y.reshape(*lead, self.out_features)

    def to_bsr_linear(self) -> BSRLinear:
        """The whole layer, gathered from all ranks (a collective: every rank of the group calls it and
        gets the same :class:`~bsrkit.nn.BSRLinear`); for checkpoints and inspection."""
        nnz = _gather_int(self.values.shape[0], self.group, self.values.device)
        values = _gather_rows(self.values.detach(), nnz, self.group)
        col = _gather_rows(self.col_indices, nnz, self.group)
        row_nnz = _gather_rows(
            self.crow_indices.diff(), [b - a for a, b in _pairs(self.row_splits)], self.group
        )
        bo, bi = self.blocksize
        layer = BSRLinear(
            self.in_features,
            self.out_features,
            (bo, bi),
            bias=self.bias is not None,
            density=0.0,
            device=values.device,
            dtype=values.dtype,
        )
        # (cumsum promotes int32 to int64: the indices keep their one dtype)
        layer.crow_indices = torch.cat([row_nnz.new_zeros(1), row_nnz.cumsum(0, dtype=row_nnz.dtype)])
        layer.col_indices = col
        layer.values = nn.Parameter(values, requires_grad=self.values.requires_grad)  # (frozen stays so)
        if self.bias is not None:
            counts = [(b - a) * bo for a, b in _pairs(self.row_splits)]
            bias = _gather_rows(self.bias.detach(), counts, self.group)
            layer.bias = nn.Parameter(bias, requires_grad=self.bias.requires_grad)
        return layer.train(self.training)

    def extra_repr(self) -> str:
        start, stop = self.row_splits[self.rank], self.row_splits[self.rank + 1]
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"blocksize={self.blocksize}, rank={self.rank}/{self.world_size}, block_rows=[{start}, {stop}), "
            f"local_blocks={self.values.shape[0]}, bias={self.bias is not None}"
        )


def _check_same_pattern(
    crow: torch.Tensor, col: torch.Tensor, layer: BSRLinear, group: dist.ProcessGroup
) -> None:
    # A rank built with another seed would compute a silently wrong slice, one of another dtype or bias
    # would garble or hang the gathers: compare what every rank's collectives rely on, then the pattern
    # itself (of one length everywhere once the first comparison holds).
    device = layer.values.device  # a device the group's backend serves (gloo: cpu, nccl: cuda)
    dtypes = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    layout = torch.tensor(
        [layer.out_features, layer.in_features, *layer.blocksize, col.numel(), layer.bias is not None,
         dtypes.index(layer.values.dtype) if layer.values.dtype in dtypes else -1,
         crow.dtype is torch.int32, col.dtype is torch.int32],  # (indices' too: to_bsr_linear gathers them)
        dtype=torch.int64, device=device,
    )  # fmt: skip
    pattern = torch.cat([crow.to(device, torch.int64), col.to(device, torch.int64)])
    # (the same pattern with other values: a layer drawn at density 1, or another bias, on one rank)
    content = torch.cat([_fingerprint(layer.values), _fingerprint(layer.bias)]).to(device)
    for what, mine in (
        ("layer shape, dtypes and bias", layout),
        ("pattern", pattern),
        ("values and bias", content),
    ):
        everyone = mine.new_empty(dist.get_world_size(group) * mine.numel())
        dist.all_gather_single(everyone, mine, group=group)
        if not torch.equal(everyone.view(-1, mine.numel()), mine.expand(dist.get_world_size(group), -1)):
            raise ValueError(
                f"BlockRowParallelBSRLinear(): expected the same {what} on every rank, got "
                f"{everyone.view(-1, mine.numel()).tolist()[:8]} (build the layer with the same seed on "
                "every rank)"
            )


def _fingerprint(t: torch.Tensor | None) -> torch.Tensor:
    """Two int64 sums of ``t``'s bytes (as 16-bit words, plain and weighted by position): equal for equal
    tensors whatever order a rank sums in (integer sums are exact), and unequal for tensors that differ,
    short of a collision. None: zeros."""
    if t is None or t.numel() == 0:
        return torch.zeros(2, dtype=torch.int64)
    words = t.detach().contiguous().flatten().view(torch.int16).to(torch.int64)
    weights = torch.arange(words.numel(), device=words.device) % 65521 + 1  # (each product < 2**31)
    return torch.stack([words.sum(), (words * weights).sum()]).cpu()


def parallelize(module: nn.Module, group: Any = None) -> nn.Module:
    """Replace ``module`` (if a :class:`~bsrkit.nn.BSRLinear`) or each ``BSRLinear`` inside it by a
    :class:`BlockRowParallelBSRLinear` over ``group``; returns the (new) module."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize(): expected an nn.Module, got {type_name(module)}")
    if isinstance(module, BSRLinear):
        return BlockRowParallelBSRLinear(module, group)
    # One parallel layer at every place of a layer used at several; layers tied by sparsify_ (one values
    # Parameter) stay tied: they share this rank's part (each keeps its own bias).
    built: dict[int, BlockRowParallelBSRLinear] = {}
    for layer, fqns in module_places(module).values():
        if not isinstance(layer, BSRLinear):
            continue
        parallel = BlockRowParallelBSRLinear(layer, group)
        tied = built.setdefault(id(layer.values), parallel)
        if tied is not parallel:
            parallel.values, parallel.crow_indices = tied.values, tied.crow_indices
            parallel.col_indices = tied.col_indices
        put(module, fqns, parallel)
    return module
