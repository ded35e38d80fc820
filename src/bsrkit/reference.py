"""Plain PyTorch oracles (masked dense) for every op; used by tests, never by fast paths.

They are written for obviousness, not speed: the dense matrix is rebuilt block by block from the BSR
indices (independently of torch's sparse kernels), and half types are computed in float64.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = [
    "assert_close",
    "block_mask",
    "bsr_dense_addmm",
    "bsr_dense_mm",
    "bsr_scatter_mm",
    "bsr_softmax",
    "bsr_to_dense",
    "bsr_transposed_dense_mm",
    "mismatch",
    "sampled_addmm",
    "scaled_dot_product_attention",
    "scatter_mm",
    "tolerances",
]


# (rtol, atol) per dtype, for products whose reference is computed in float64 and rounded once. The one
# table of tolerances: the tests and benchmarks/gpu_check.py judge every fast path by it.
_TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}


def tolerances(dtype: torch.dtype, k: int = 1) -> dict[str, float]:
    """Elementwise ``rtol``/``atol`` for a result in ``dtype`` that sums k products of terms ~ 1.

    Rounding the result costs ``rtol`` relative, whatever k; summing k terms in ``dtype`` costs an
    absolute error growing like sqrt(k) (a half kernel may add partial sums in half), so only ``atol``
    grows with k. Elementwise closeness alone passes a result far from small expected entries (an
    all-zero attention output passes bfloat16's atol); :func:`mismatch` adds a normwise bound."""
    rtol, atol = _TOLERANCES[dtype]
    return {"rtol": rtol, "atol": atol * max(1.0, k**0.5)}


def mismatch(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, k: int = 1
) -> str | None:
    """Why ``actual`` is not ``expected`` within ``dtype``'s tolerances for k-term sums, or None.

    Two bounds, both needed: elementwise ``|a - e| <= atol + rtol |e|`` (:func:`tolerances`), with NaN
    only where ``expected`` has NaN and infinities equal; and normwise over the finite entries,
    ``||a - e||_F <= rtol * sqrt(k) * ||e||_F + atol``, which no result far from a small
    ``expected`` passes (the relative error of a k-term sum grows at most like sqrt(k) times the unit
    roundoff). ``dtype`` defaults to ``expected``'s; the comparison is made in float64."""
    dtype = expected.dtype if dtype is None else dtype
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    if dtype is expected.dtype and actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != expected {expected.dtype}"
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    tol = tolerances(dtype if dtype.is_floating_point else torch.float64, k)
    if not torch.allclose(a, e, equal_nan=True, **tol):
        far = ~torch.isclose(a, e, equal_nan=True, **tol)
        worst = int(far.flatten().nonzero()[0])
        return (
            f"{int(far.sum())} of {a.numel()} entries differ beyond rtol {tol['rtol']:.1e}, atol "
            f"{tol['atol']:.1e}: at flat index {worst} got {a.flatten()[worst].item()}, expected "
            f"{e.flatten()[worst].item()}"
        )
    finite = torch.isfinite(e)
    error = torch.linalg.vector_norm(torch.where(finite, a - e, 0.0)).item()
    size = torch.linalg.vector_norm(torch.where(finite, e, 0.0)).item()
    rtol, atol = _TOLERANCES[dtype if dtype.is_floating_point else torch.float64]
    bound = rtol * max(1.0, k**0.5) * size + atol
    if error > bound:
        return f"normwise error {error:.3e} > {bound:.3e} (rtol {rtol:.1e} x sqrt({k}) x {size:.3e} + atol)"
    return None


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, k: int = 1
) -> None:
    """Raise AssertionError with :func:`mismatch`'s reason where ``actual`` is not ``expected``."""
    reason = mismatch(actual, expected, dtype, k)
    if reason is not None:
        raise AssertionError(reason)


def bsr_to_dense(bsr: torch.Tensor) -> torch.Tensor:
    """The dense matrix of a (batched) BSR tensor, assembled from crow/col/values with loops."""
    M, K = bsr.shape[-2:]
    values = bsr.values()
    Ms, Ks = values.shape[-2:]
    batch = bsr.shape[:-2]
    nb = math.prod(batch)  # (explicit sizes: -1 cannot be inferred for a batch of size 0)
    crow = bsr.crow_indices().reshape(nb, M // Ms + 1 if Ms else 1)
    col = bsr.col_indices().reshape(nb, bsr.col_indices().shape[-1])
    vals = values.reshape(nb, values.shape[-3], Ms, Ks)
    dense = torch.zeros((crow.shape[0], M, K), dtype=bsr.dtype, device=bsr.device)
    for b in range(crow.shape[0]):
        for i in range(crow.shape[1] - 1):
            for g in range(int(crow[b, i]), int(crow[b, i + 1])):
                j = int(col[b, g])
                dense[b, i * Ms : (i + 1) * Ms, j * Ks : (j + 1) * Ks] += vals[b, g]
    return dense.reshape(*batch, M, K)


def _stored_product(bsr: torch.Tensor, dense: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """``bsr @ dense`` (``bsr.mT @ dense``) in float64 over the stored blocks only: a non-finite entry of
    ``dense`` meets no unstored block (a masked dense product would give 0 * inf = NaN there, where the
    products, as torch's BSR product, give what the stored blocks give)."""
    a = bsr_to_dense(bsr).double()
    a = a.mT if transposed else a
    d = dense.double()
    if bool(torch.isfinite(d).all()):
        return torch.matmul(a, d)
    stored = block_mask(bsr)
    stored = stored.mT if transposed else stored
    terms = a.unsqueeze(-1) * d.unsqueeze(-3)  # (..., M, K, N)
    return torch.where(stored.unsqueeze(-1), terms, 0.0).sum(-2)


def _to_result(product: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float64 product in the result's dtype: int8 operands give int32, exact and wrapping around
    as torch's int32 arithmetic does (through int64)."""
    if dtype is torch.int8:
        return product.round().to(torch.int64).to(torch.int32)
    return product.to(dtype)


def _not_formed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The zero float64 result of ``a @ b`` scaled by ``alpha == 0``: the product is never formed."""
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return torch.zeros((*batch, a.shape[-2], b.shape[-1]), dtype=torch.float64)


def bsr_dense_mm(bsr: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """``bsr @ dense`` from the stored blocks, computed in float64, as :func:`bsrkit.bsr_dense_mm`."""
    return _to_result(_stored_product(bsr, dense), dense.dtype)


def bsr_dense_addmm(
    input: torch.Tensor,
    bsr: torch.Tensor,
    dense: torch.Tensor,
    *,
    beta: float = 1,
    alpha: float = 1,
    left_alpha: torch.Tensor | None = None,
    right_alpha: torch.Tensor | None = None,
) -> torch.Tensor:
    """``beta * input + left_alpha[..., :, None] * (alpha * bsr @ dense) * right_alpha[..., None, :]``,
    in float64; int8 operands give int32 (exact). With ``alpha == 0`` the product is not formed (NaN and
    Inf in ``bsr`` or ``dense`` do not reach the result), as ``torch.addmm`` and torch's Triton
    kernels; ``beta == 0`` ignores ``input`` the same way."""
    prod = _not_formed(bsr, dense) if alpha == 0 else alpha * _stored_product(bsr, dense)
    if left_alpha is not None:
        prod = prod * left_alpha.double().unsqueeze(-1)
    if right_alpha is not None:
        prod = prod * right_alpha.double().unsqueeze(-2)
    if beta != 0:
        prod = prod + beta * input.double()
    return _to_result(prod, dense.dtype)


def bsr_scatter_mm(bsr: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``bsr @ other``: what :func:`bsrkit.bsr_scatter_mm` computes, whatever its indices data."""
    return bsr_dense_mm(bsr, other)


def scatter_mm(
    blocks: torch.Tensor,
    others: torch.Tensor,
    indices_data: tuple[Any, ...],
    accumulators: torch.Tensor,
) -> torch.Tensor:
    """The loops of torch's ``scatter_mm`` docstring, verbatim in meaning, and as torch's code runs them:
    the ``"bsr_strided_mm"`` format starts from zero accumulators (its CPU loop zeroes them, its Triton
    kernel stores the tiles); the others add into them. Returns a new tensor."""
    fmt = indices_data[0]
    acc = accumulators.double().clone()
    if fmt == "bsr_strided_mm":
        acc.zero_()
    blocks = blocks.double()
    others = others.double()
    Ms, Ks = blocks.shape[-2:]
    if fmt == "scatter_mm":
        c_offsets, pq = indices_data[1:]
        for r in range(c_offsets.shape[0] - 1):
            for g in range(int(c_offsets[r]), int(c_offsets[r + 1])):
                p, q = (int(x) for x in pq[g])
                acc[r] += blocks[p] @ others[q]
        return acc.to(accumulators.dtype)
    shape = acc.shape
    acc = acc.reshape(-1, *shape[-2:])
    others = others.reshape(-1, *others.shape[-2:])
    N = others.shape[-1]
    meta = indices_data[-1]
    split_n = meta["SPLIT_N"]
    Ns = N // split_n
    for b in range(others.shape[0]):
        if fmt == "bsr_strided_mm":
            c_indices, r_offsets, p_offsets, q_offsets = indices_data[1:5]
            for i, r in enumerate(r_offsets.tolist()):
                r0, r1 = divmod(r, N)
                for g in range(int(c_indices[i]), int(c_indices[i + 1])):
                    q0, q1 = divmod(int(q_offsets[g]), N)
                    p = int(p_offsets[g])
                    acc[b, r0 : r0 + Ms, r1 : r1 + Ns] += blocks[p] @ others[b, q0 : q0 + Ks, q1 : q1 + Ns]
        else:
            c_indices, r_offsets, q_offsets = indices_data[1:4]
            for r in r_offsets.tolist():
                r0, r1 = divmod(r, N)
                m, n = r0 // Ms, r1 // Ns
                c0, c1 = int(c_indices[m]), int(c_indices[m + 1])
                for i, p in enumerate(range(c0, c1)):
                    q0, q1 = divmod(int(q_offsets[n * c1 + (split_n - n) * c0 + i]), N)
                    acc[b, r0 : r0 + Ms, r1 : r1 + Ns] += blocks[p] @ others[b, q0 : q0 + Ks, q1 : q1 + Ns]
    return acc.reshape(shape).to(accumulators.dtype)


def bsr_transposed_dense_mm(bsr: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """``bsr.mT @ dense`` from the stored blocks, as :func:`bsrkit.bsr_transposed_dense_mm`."""
    return _to_result(_stored_product(bsr, dense, transposed=True), dense.dtype)


def block_mask(bsr: torch.Tensor) -> torch.Tensor:
    """Boolean dense mask of the stored blocks (True inside every stored block, zeros included)."""
    return _block_counts(bsr) != 0


def _block_counts(bsr: torch.Tensor) -> torch.Tensor:
    """How many stored blocks cover each entry (float64): 2 where a block row stores a column twice."""
    return bsr_to_dense(_with_values(bsr, torch.ones_like(bsr.values(), dtype=torch.float64)))


def _with_values(bsr: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    # (the indices come from a BSR tensor torch already accepted)
    crow, col = bsr.crow_indices(), bsr.col_indices()
    return torch.sparse_bsr_tensor(crow, col, values, size=bsr.shape, check_invariants=False)


def sampled_addmm(
    input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta: float = 1, alpha: float = 1
) -> torch.Tensor:
    """Dense result: ``beta * input + alpha * mat1 @ mat2`` inside input's stored blocks, 0 elsewhere
    (summed over the stored blocks: a block column stored twice holds the product twice, as the BSR
    result, densified, does). ``alpha == 0`` forms no product and ``beta == 0`` ignores ``input`` (their
    NaN and Inf do not reach the result), as torch's Triton ``sampled_addmm``."""
    mats = mat1.double(), mat2.double()
    counts = _block_counts(input)
    full = _not_formed(*mats) if alpha == 0 else alpha * torch.matmul(*mats)
    full = full * counts  # (once per stored block; unstored entries, NaN or not, are masked below)
    if beta != 0:
        full = full + beta * bsr_to_dense(input).double()
    return torch.where(counts != 0, full, torch.zeros((), dtype=torch.float64)).to(mat1.dtype)


def bsr_softmax(input: torch.Tensor) -> torch.Tensor:
    """Dense result (float64): softmax over each row's stored entries (unstored = -inf), each stored
    entry one term (a block column stored twice: two, summed where the result is densified); rows with
    no stored entry are 0. Entries outside the stored blocks are 0. A row holding NaN, +inf, or only
    -inf is NaN at its stored entries."""
    *batch, L, _ = input.shape
    values = input.values().double()
    bm, bn = values.shape[-2:]
    nb = math.prod(batch)
    crow = input.crow_indices().reshape(nb, -1)
    vals = values.reshape(nb, values.shape[-3], bm, bn)
    out = torch.zeros_like(vals)
    for b in range(nb):
        block_rows = torch.repeat_interleave(torch.arange(crow.shape[1] - 1), crow[b].diff())
        rows = (block_rows[:, None] * bm + torch.arange(bm))[:, :, None].expand(-1, bm, bn).reshape(-1)
        s = vals[b].reshape(-1)
        top = torch.full((L,), -torch.inf, dtype=torch.float64).scatter_reduce(0, rows, s, "amax")
        e = torch.exp(s - top[rows])
        total = torch.zeros(L, dtype=torch.float64).index_add_(0, rows, e)
        out[b] = (e / total[rows]).reshape(vals.shape[1:])
    return bsr_to_dense(_with_values(input, out.reshape(values.shape)))


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor,
    dropout_keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Masked dense attention, in the inputs' dtype and differentiable (float64 inputs for gradients).

    Only the stored blocks of the BSR ``attn_mask`` take part; within them a bool mask's False entries
    are excluded and a float mask's values are added to the scores (``-inf`` excludes); ``is_causal``
    further excludes ``j > i``. Rows with nothing left give 0. ``dropout_keep`` (bool, ``(..., L, S)``) is
    the kept set of a dropout of rate ``dropout_p``.
    """
    L, S = query.shape[-2], key.shape[-2]
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    allowed = block_mask(attn_mask)
    values = bsr_to_dense(attn_mask)
    bias = torch.zeros(values.shape, dtype=query.dtype)
    if attn_mask.dtype == torch.bool:
        allowed = allowed & values
    else:
        bias = values.to(query.dtype)
        allowed = allowed & (bias != -torch.inf)  # (a row of -inf only has nothing allowed: 0, as torch's)
    if is_causal:
        allowed = allowed & torch.ones(L, S, dtype=torch.bool).tril()
    scores = ((query @ key.mT) * scale + bias).masked_fill(~allowed, -torch.inf)
    # Rows with nothing allowed, or whose allowed scores are all -inf (an infinite query or key entry),
    # give 0, as torch's safe softmax: finite scores before the softmax and weight 0 after it (a NaN in
    # the unselected branch of a where would still poison the gradient).
    nonempty = (scores != -torch.inf).any(-1, keepdim=True)
    scores = scores.masked_fill(~nonempty, 0.0)
    weights = torch.softmax(scores, dim=-1) * nonempty
    if dropout_keep is not None:
        weights = torch.where(dropout_keep, weights / (1 - dropout_p), 0.0)
    if bool(torch.isfinite(value).all()):
        return weights @ value
    # (a non-finite value reaches the rows whose stored blocks hold its key, weighed by an exact 0 where
    # excluded, and no other row: a dense product would spread 0 * inf = NaN to every row)
    stored = block_mask(attn_mask)
    terms = weights.unsqueeze(-1) * value.unsqueeze(-3)  # (..., L, S, Ev)
    return torch.where(stored.unsqueeze(-1), terms, torch.zeros((), dtype=terms.dtype)).sum(-2)
