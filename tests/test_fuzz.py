"""Differential fuzzing of every public op against ``bsrkit.reference``, on every backend.

Random valid BSR tensors (block shapes 1-5, empty rows and nnz == 0 included, batches that broadcast,
int32 and int64 indices), random dense layouts (contiguous, transposed, strided, expanded), dtypes and
scalars; and random malformed patterns, which must raise a ValueError naming the defect. ``out`` starts
as NaN, so an unwritten element is a mismatch. Beyond the outputs: operands of mixed dtypes at every
entry point and custom op (a TypeError naming both dtypes, never a crash), gradients of every
differentiable input and a second-order gradient against the reference's, NaN and Inf in every operand
(propagated as the block-wise math does), and the public ops inside ``torch.compile`` (Dynamo only; the
fresh-process checks with Inductor are in test_compile.py). The default profile is short (CI);
``BSRKIT_FUZZ=long`` runs many more examples.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bsrkit
from bsrkit import reference
from helpers import random_bsr

LONG = os.environ.get("BSRKIT_FUZZ") == "long"


def _settings(backend: str, examples: int = 20) -> settings:
    examples = 400 if LONG else (min(examples, 6) if backend == "triton" else examples)
    return settings(
        max_examples=examples,
        deadline=None,  # timings vary on shared CI machines; a hang fails the CI run's own time limit
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        derandomize=not LONG,  # CI: the same examples every run; long runs explore
    )


@st.composite
def problems(draw, backend: str):
    """(bsr, dense, dtype): bsr (*Bb, M, K), dense (*Bd, K, N) with broadcastable batches."""
    # Triton's interpreter computes bfloat16 dots wrongly (a Triton bug); its other dtypes are fuzzed.
    dtypes = [torch.float32, torch.float64, torch.float16]
    dtype = draw(st.sampled_from([*dtypes, torch.bfloat16] if backend != "triton" else dtypes))
    Ms, Ks = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    MB, KB = draw(st.integers(0, 4)), draw(st.integers(1, 4))
    N = draw(st.integers(0, 7))
    bsr_batch, dense_batch = draw(
        st.sampled_from([((), ()), ((2,), ()), ((), (2,)), ((2,), (2,)), ((1, 2), (3, 1)), ((2,), (3, 2))])
    )
    density = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    bsr = random_bsr((*bsr_batch, MB * Ms, KB * Ks), (Ms, Ks), density, dtype, generator=g)
    if draw(st.booleans()):  # int32 indices (torch's other index dtype) on every op
        bsr = torch.sparse_bsr_tensor(
            bsr.crow_indices().int(), bsr.col_indices().int(), bsr.values(), size=bsr.shape
        )
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided", "expanded"]))
    K = KB * Ks
    if layout == "transposed":
        dense = torch.randn((*dense_batch, N, K), generator=g).to(dtype).mT
    elif layout == "strided":
        dense = torch.randn((*dense_batch, K, 2 * N), generator=g).to(dtype)[..., ::2]
    elif layout == "expanded":
        dense = torch.randn((K, N), generator=g).to(dtype).expand(*dense_batch, K, N)
    else:
        dense = torch.randn((*dense_batch, K, N), generator=g).to(dtype)
    return bsr, dense, dtype


SCALARS = st.sampled_from([0.0, 1.0, -1.5, 0.5, 2])


def _check(got: torch.Tensor, expected: torch.Tensor, k: int) -> None:
    reference.assert_close(got, expected, k=max(k, 1))


def test_bsr_dense_mm_and_addmm(backend):
    @_settings(backend)
    @given(problem=problems(backend), alpha=SCALARS, beta=SCALARS, with_out=st.booleans())
    def run(problem, alpha, beta, with_out):
        bsr, dense, dtype = problem
        K = dense.shape[-2]
        expected = reference.bsr_dense_mm(bsr, dense)
        out = torch.full(expected.shape, float("nan"), dtype=dtype) if with_out else None
        _check(bsrkit.bsr_dense_mm(bsr, dense, out=out), expected, K)
        inp = torch.randn(expected.shape[-1], dtype=torch.float64).to(dtype)  # broadcasts
        expected = reference.bsr_dense_addmm(inp, bsr, dense, beta=beta, alpha=alpha)
        _check(bsrkit.bsr_dense_addmm(inp, bsr, dense, beta=beta, alpha=alpha), expected, K + 1)

    run()


def test_bsr_transposed_dense_mm(backend):
    @_settings(backend)
    @given(problem=problems(backend))
    def run(problem):
        bsr, dense, _ = problem
        # bsr.mT @ x needs x with bsr's row count: reuse dense's batch and columns.
        x = torch.randn((*dense.shape[:-2], bsr.shape[-2], dense.shape[-1]), dtype=torch.float64).to(
            dense.dtype
        )
        expected = reference.bsr_transposed_dense_mm(bsr, x)
        _check(bsrkit.bsr_transposed_dense_mm(bsr, x), expected, bsr.shape[-2])

    run()


def test_sampled_addmm(backend):
    @_settings(backend)
    @given(problem=problems(backend), alpha=SCALARS, beta=SCALARS, inner=st.integers(0, 6))
    def run(problem, alpha, beta, inner):
        bsr, dense, dtype = problem
        M, N = bsr.shape[-2:]
        g = torch.Generator().manual_seed(inner)
        mat1 = torch.randn((*dense.shape[:-2], M, inner), generator=g).to(dtype)
        mat2 = torch.randn((inner, N), generator=g).to(dtype)
        got = bsrkit.sampled_addmm(bsr, mat1, mat2, beta=beta, alpha=alpha)
        expected = reference.sampled_addmm(bsr, mat1, mat2, beta=beta, alpha=alpha)
        _check(reference.bsr_to_dense(got), expected, inner + 1)

    run()


def test_scatter_mm_formats(backend):
    @_settings(backend)
    @given(
        problem=problems(backend),
        fmt=st.sampled_from(["bsr_strided_mm_compressed", "bsr_strided_mm", "scatter_mm"]),
    )
    def run(problem, fmt):
        bsr, dense, dtype = problem
        if bsr.ndim > 2:  # the indices data take a 2-D bsr: its first batch
            first = (0,) * (bsr.ndim - 2)
            crow, col, values = bsr.crow_indices()[first], bsr.col_indices()[first], bsr.values()[first]
            bsr = torch.sparse_bsr_tensor(crow, col, values, size=bsr.shape[-2:])
        Ms = bsr.values().shape[-2]
        other = dense[(0,) * (dense.ndim - 2)] if dense.ndim > 2 else dense
        if fmt == "scatter_mm":  # needs N divisible by the block height
            other = torch.randn(other.shape[-2], Ms * 2, dtype=torch.float64).to(dtype)
        if other.shape[-1] == 0:
            return
        data = bsrkit.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt)
        got = bsrkit.bsr_scatter_mm(bsr, other, data)
        _check(got, reference.bsr_scatter_mm(bsr, other), other.shape[-2])

    run()


MUTATIONS = [
    "crow_longer", "crow_shorter", "crow_end_past_nnz", "crow_decreasing", "crow_start",
    "col_too_large", "col_negative", "col_huge",
]  # fmt: skip


def _malformed(bsr: torch.Tensor, mutation: str) -> torch.Tensor:
    crow, col, values = bsr.crow_indices().clone(), bsr.col_indices().clone(), bsr.values()
    KB = bsr.shape[-1] // values.shape[-1]
    if mutation == "crow_longer":
        crow = torch.cat([crow, crow[..., -1:]], dim=-1)
    elif mutation == "crow_shorter":
        crow = crow[..., :-1]
    elif mutation == "crow_end_past_nnz":
        crow[..., -1] += 2
    elif mutation == "crow_decreasing":
        crow[..., 1] = crow[..., -1] + 1
    elif mutation == "crow_start":
        crow[..., 0] = 1
    elif mutation == "col_too_large":
        col[..., 0] = KB
    elif mutation == "col_negative":
        col[..., 0] = -1
    else:
        col[..., 0] = 10**9
    return torch.sparse_bsr_tensor(crow, col, values, size=bsr.shape, check_invariants=False)


def test_malformed_patterns_raise(backend):
    @_settings(backend)
    @given(problem=problems(backend), mutation=st.sampled_from(MUTATIONS), op=st.integers(0, 3))
    def run(problem, mutation, op):
        bsr, dense, dtype = problem
        if bsr._nnz() == 0 or dense.shape[-1] == 0 or bsr.shape[-2] == 0:
            return  # (mutations of col need a stored block; an empty product computes nothing)
        bad = _malformed(bsr, mutation)
        M, N = bsr.shape[-2:]
        calls = [
            lambda: bsrkit.bsr_dense_mm(bad, dense),
            lambda: bsrkit.bsr_dense_addmm(torch.zeros((), dtype=dtype), bad, dense),
            lambda: bsrkit.bsr_transposed_dense_mm(bad, torch.randn(M, 3).to(dtype)),
            lambda: bsrkit.sampled_addmm(bad, torch.randn(M, 2).to(dtype), torch.randn(2, N).to(dtype)),
        ]
        with pytest.raises(ValueError, match="malformed"):
            calls[op]()

    run()


# -- mixed dtypes, gradients, NaN and Inf, torch.compile (issue 24) -----------------------------------

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
OTHERS = [*FLOATS, torch.int64, torch.int32]


def _first_2d(bsr: torch.Tensor) -> torch.Tensor:
    """A batched BSR's first batch (the custom ops and the scatter paths take 2-D operands)."""
    if bsr.ndim == 2:
        return bsr
    first = (0,) * (bsr.ndim - 2)
    crow, col, values = bsr.crow_indices()[first], bsr.col_indices()[first], bsr.values()[first]
    return torch.sparse_bsr_tensor(crow, col, values, size=bsr.shape[-2:])


def _entry_points(bsr: torch.Tensor, t1: torch.dtype, t2: torch.dtype) -> list:
    """Calls whose two operands have dtypes ``t1`` (the sparse one) and ``t2`` (given t1 != t2)."""
    from bsrkit import custom_ops
    from bsrkit.nn import BSRLinear

    M, K = bsr.shape[-2:]
    b = torch.sparse_bsr_tensor(bsr.crow_indices(), bsr.col_indices(), bsr.values().to(t1), size=bsr.shape)
    crow, col, values = b.crow_indices(), b.col_indices(), b.values()
    Ms, Ks = values.shape[-2:]
    ones = lambda *shape: torch.ones(shape, dtype=t2)  # noqa: E731
    layer = BSRLinear(K, M, (Ms, Ks), density=0.5).to(t1)
    mask = torch.sparse_bsr_tensor(crow, col, torch.ones_like(values, dtype=torch.bool), size=b.shape)
    return [
        lambda: bsrkit.bsr_dense_mm(b, ones(K, 3)),
        lambda: bsrkit.bsr_dense_addmm(ones(M, 3), b, ones(K, 3).to(t1)),
        lambda: bsrkit.bsr_dense_addmm(torch.ones(M, 3, dtype=t1), b, ones(K, 3)),
        lambda: bsrkit.bsr_transposed_dense_mm(b, ones(M, 3)),
        lambda: bsrkit.sampled_addmm(b, ones(M, 2), ones(2, K)),
        lambda: bsrkit.sampled_addmm(mask, torch.ones(M, 2, dtype=t1), ones(2, K), beta=0),
        lambda: bsrkit.bsr_scatter_mm(b, ones(K, 3)),
        lambda: bsrkit.scatter_mm(values, ones(K, 3), ("bsr_strided_mm", crow, crow, crow, crow, {})),
        lambda: bsrkit.scaled_dot_product_attention(
            torch.ones(M, 4, dtype=t1), ones(K, 4), torch.ones(K, 4, dtype=t1), mask
        ),
        lambda: custom_ops.bsr_mm(crow, col, values, ones(K, 3), M, K, False),
        lambda: custom_ops.sampled_mm(crow, col, torch.ones(M, 2, dtype=t1), ones(2, K), Ms, Ks),
        lambda: layer(ones(3, K)),
    ]


def test_mixed_dtypes_raise_at_every_entry_point(backend):
    @_settings(backend, examples=12)
    @given(
        problem=problems(backend),
        t1=st.sampled_from(FLOATS),
        t2=st.sampled_from(OTHERS),
        call=st.integers(0, 11),
    )
    def run(problem, t1, t2, call):
        bsr = _first_2d(problem[0])
        if t1 == t2 or 0 in bsr.shape:
            return
        with pytest.raises(TypeError) as info:  # (an ArgumentTypeError: a ValueError too)
            _entry_points(bsr, t1, t2)[call]()
        assert isinstance(info.value, ValueError)
        assert str(t2).removeprefix("torch.") in str(info.value)

    run()


def _leaf_bsr(bsr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = bsr.values().detach().double().clone().requires_grad_()
    b = torch.sparse_bsr_tensor(bsr.crow_indices(), bsr.col_indices(), values, size=bsr.shape)
    return values, b


def test_gradients_first_and_second_order_match_the_reference(backend):
    @_settings(backend, examples=10)
    @given(problem=problems(backend), op=st.sampled_from(["addmm", "transposed", "sampled"]))
    def run(problem, op):
        bsr, dense, _ = problem
        if bsr.shape[-2] == 0 or dense.shape[-1] == 0 or (op == "sampled" and bsr._nnz() == 0):
            return  # (the masked-dense reference of an empty sampled product has no graph)
        M, K = bsr.shape[-2:]
        N = dense.shape[-1]
        g = torch.Generator().manual_seed(M * 31 + K)
        batch = dense.shape[:-2]
        inner = {"addmm": K, "transposed": M, "sampled": 3}[op]
        x = torch.randn((*batch, inner, N if op != "sampled" else K), generator=g, dtype=torch.float64)
        m1 = torch.randn((*batch, M, 3), generator=g, dtype=torch.float64)
        left = torch.rand((*batch, M), generator=g, dtype=torch.float64) + 0.5
        results = []
        for fast in (True, False):
            values, b = _leaf_bsr(bsr)
            xs, ls, m1s = (t.clone().requires_grad_() for t in (x, left, m1))
            dense_b = reference.bsr_to_dense(b)
            if op == "addmm":
                y = (
                    bsrkit.bsr_dense_addmm(xs[..., :1, :], b, xs, beta=0.5, alpha=-1.5, left_alpha=ls)
                    if fast
                    else 0.5 * xs[..., :1, :] + ls[..., None] * (-1.5 * dense_b @ xs)
                )
                inputs = (values, xs, ls)
            elif op == "transposed":
                y = bsrkit.bsr_transposed_dense_mm(b, xs) if fast else dense_b.mT @ xs
                inputs = (values, xs)
            else:
                y = (
                    reference.bsr_to_dense(bsrkit.sampled_addmm(b, m1s, xs, beta=0.5))
                    if fast
                    else reference.sampled_addmm(b, m1s, xs, beta=0.5)
                )
                inputs = (values, m1s, xs)
            w = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
            with warnings.catch_warnings():  # (a loss linear in sampled_addmm's values: its warning's case
                warnings.filterwarnings("ignore", message="sampled_addmm.*linear")  # where it is exact)
                grads = torch.autograd.grad((y * w).sum(), inputs, create_graph=True, allow_unused=True)
            grads = [torch.zeros_like(t) if d is None else d for d, t in zip(grads, inputs, strict=True)]
            # Second order: a penalty on the dense operand's gradient, differentiated w.r.t. the values.
            penalty = grads[1].pow(2).sum()
            second = None
            if penalty.requires_grad:  # (not where nothing is stored)
                (second,) = torch.autograd.grad(penalty, (values,), allow_unused=True)
            second = torch.zeros_like(values) if second is None else second
            results.append([*(t.detach() for t in grads), second])
        for got, want in zip(*results, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-8)

    run()


def _blockwise_mm(bsr: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """2-D ``bsr @ dense`` summed over the stored blocks only (the sparse math: an unstored zero is not
    multiplied, so an Inf elsewhere in ``dense`` does not reach its row), in float64."""
    crow, col, values = bsr.crow_indices().tolist(), bsr.col_indices().tolist(), bsr.values().double()
    Ms, Ks = values.shape[-2:]
    out = torch.zeros(bsr.shape[-2], dense.shape[-1], dtype=torch.float64)
    d = dense.double()
    for r in range(len(crow) - 1):
        for g in range(crow[r], crow[r + 1]):
            out[r * Ms : (r + 1) * Ms] += values[g] @ d[col[g] * Ks : (col[g] + 1) * Ks]
    return out.to(dense.dtype)


def test_nan_and_inf_in_every_operand(backend):
    @_settings(backend, examples=12)
    @given(
        problem=problems(backend),
        special=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
        where=st.sampled_from(["values", "dense", "mat1", "mat2"]),
        position=st.integers(0, 10**6),
    )
    def run(problem, special, where, position):
        bsr, dense, dtype = _first_2d(problem[0]), problem[1], problem[2]
        dense = dense[(0,) * (dense.ndim - 2)]
        if 0 in (*bsr.shape, dense.shape[-1]) or bsr._nnz() == 0:
            return
        values, dense = bsr.values().clone(), dense.clone()
        mat1, mat2 = torch.randn(bsr.shape[-2], 3).to(dtype), torch.randn(3, bsr.shape[-1]).to(dtype)
        target = {"values": values, "dense": dense, "mat1": mat1, "mat2": mat2}[where]
        target[torch.unravel_index(torch.tensor(position % target.numel()), target.shape)] = special
        b = torch.sparse_bsr_tensor(bsr.crow_indices(), bsr.col_indices(), values, size=bsr.shape)

        def close(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
            reference.assert_close(got, want, dtype, k)

        close(bsrkit.bsr_dense_mm(b, dense), _blockwise_mm(b, dense), dense.shape[-2])
        # sampled: each stored entry is its own dot product of a row of mat1 and a column of mat2
        got = bsrkit.sampled_addmm(b, mat1, mat2, beta=0)
        close(reference.bsr_to_dense(got), reference.sampled_addmm(b, mat1, mat2, beta=0), 3)
        close(reference.bsr_to_dense(bsrkit.bsr_softmax(b)).double(), reference.bsr_softmax(b), 8)

    run()


COMPILED = {
    "bsr_dense_mm": lambda b, x, xt, m1, m2: bsrkit.bsr_dense_mm(b, x),
    "bsr_dense_addmm": lambda b, x, xt, m1, m2: bsrkit.bsr_dense_addmm(xt, b, x, beta=0.5),
    "bsr_transposed_dense_mm": lambda b, x, xt, m1, m2: bsrkit.bsr_transposed_dense_mm(b, xt),
    "sampled_addmm": lambda b, x, xt, m1, m2: bsrkit.sampled_addmm(b, m1, m2).values(),
    "bsr_softmax": lambda b, x, xt, m1, m2: bsrkit.bsr_softmax(b).values(),
    "bsr_scatter_mm": lambda b, x, xt, m1, m2: bsrkit.bsr_scatter_mm(
        b, x, bsrkit.bsr_scatter_mm_indices_data(b, x)
    ),
}


def test_public_ops_inside_torch_compile(backend):
    @_settings(backend, examples=8)
    @given(problem=problems(backend), name=st.sampled_from(sorted(COMPILED)))
    def run(problem, name):
        bsr, dense, dtype = _first_2d(problem[0]), problem[1], problem[2]
        dense = dense[(0,) * (dense.ndim - 2)]
        if 0 in (*bsr.shape, dense.shape[-1]):
            return
        M, K = bsr.shape
        g = torch.Generator().manual_seed(M + K)
        args = [bsr, dense] + [
            torch.randn(shape, generator=g).to(dtype) for shape in ((M, dense.shape[-1]), (M, 3), (3, K))
        ]
        fn = COMPILED[name]
        torch._dynamo.reset()
        got = torch.compile(fn, backend="eager")(*args)
        torch.testing.assert_close(got, fn(*args), rtol=0, atol=0, equal_nan=True)

    run()
