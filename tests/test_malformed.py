"""Malformed BSR patterns (torch's constructor does not check them by default) raise a ValueError naming
the defect, on every backend and every public op, and never touch memory outside the operands.

The cases run in a subprocess, so that a regression that crashes the process fails this test instead of
killing the test run."""

import json
import textwrap

import pytest
import torch

from bsrkit.validation import pattern_defect
from helpers import run_python

# (name, crow, col): blocks 2x2 of an 8x8 matrix (4 x 4 blocks), 4 values.
CASES = [
    ("crow one entry too long", [0, 1, 2, 3, 3, 4], [0, 1, 2, 3]),
    ("crow short", [0, 1, 2, 4], [0, 1, 2, 3]),
    ("crow[-1] > nnz", [0, 1, 2, 3, 6], [0, 1, 2, 3]),
    ("crow[0] != 0", [1, 1, 2, 3, 4], [0, 1, 2, 3]),
    ("crow decreasing", [0, 2, 1, 3, 4], [0, 1, 2, 3]),
    ("col of 10**9", [0, 1, 2, 3, 4], [0, 1, 10**9, 3]),
    ("col == block columns", [0, 1, 2, 3, 4], [0, 1, 4, 3]),
    ("col negative", [0, 1, 2, 3, 4], [0, -1, 2, 3]),
    ("col shorter than nnz", [0, 1, 2, 3, 4], [0, 1, 2]),
]

_WORKER = textwrap.dedent(
    """
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, bsrkit
    cases = json.loads(sys.argv[1])
    results = []
    x, q = torch.randn(8, 3), torch.randn(8, 4)
    for name, crow, col in cases:
        bsr = torch.sparse_bsr_tensor(torch.tensor(crow), torch.tensor(col), torch.randn(4, 2, 2),
                                      size=(8, 8), check_invariants=False)
        buf = torch.zeros(12, 3)
        calls = {
            "bsr_dense_mm": lambda: bsrkit.bsr_dense_mm(bsr, x, out=buf[:8]),
            "bsr_dense_addmm": lambda: bsrkit.bsr_dense_addmm(torch.randn(8, 3), bsr, x),
            "bsr_transposed_dense_mm": lambda: bsrkit.bsr_transposed_dense_mm(bsr, x),
            "sampled_addmm": lambda: bsrkit.sampled_addmm(bsr, torch.randn(8, 5), torch.randn(5, 8)),
            "bsr_scatter_mm": lambda: bsrkit.bsr_scatter_mm(bsr, x),
            "bsr_scatter_mm_indices_data": lambda: bsrkit.bsr_scatter_mm_indices_data(bsr, x),
            "bsr_softmax": lambda: bsrkit.bsr_softmax(bsr),
            "scaled_dot_product_attention": lambda: bsrkit.scaled_dot_product_attention(q, q, q, bsr),
        }
        for op, call in calls.items():
            try:
                call()
                got = "no error"
            except ValueError as exc:
                got = "ValueError: " + str(exc)
            except Exception as exc:
                got = type(exc).__name__ + ": " + str(exc)
            results.append([name, op, got, bool(buf[8:].any())])
    print(json.dumps(results))
    """
)


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_malformed_patterns_raise_on_every_op(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    env = {"BSRKIT_BACKEND": backend, "TRITON_INTERPRET": "1"}
    results = run_python(["-c", _WORKER, json.dumps(CASES)], env=env, timeout=300).json()  # (a crash fails)
    assert len(results) == len(CASES) * 8
    names = {"sampled_addmm": "input", "bsr_softmax": "input", "scaled_dot_product_attention": "attn_mask"}
    for name, op, got, wrote_past_out in results:
        arg = names.get(op, "bsr")
        assert got.startswith(f"ValueError: {op}(): malformed {arg}"), (name, op, got)
        assert not wrote_past_out, (name, op)


@pytest.mark.parametrize("name,crow,col", CASES[:-1], ids=[c[0] for c in CASES[:-1]])
def test_pattern_defect_names_the_defect(name, crow, col):
    defect = pattern_defect(torch.tensor(crow), torch.tensor(col), 4, 4, 4)
    assert defect is not None and defect.startswith("expected")


def test_valid_patterns_pass_including_batches_and_empty():
    crow = torch.tensor([[0, 1, 1, 3], [0, 0, 2, 3]])
    col = torch.tensor([[2, 0, 1], [1, 2, 0]])
    assert pattern_defect(crow, col, 3, 3, 3) is None
    assert (
        pattern_defect(torch.zeros(4, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 3, 3, 0) is None
    )
    assert "one dtype" in pattern_defect(crow.int(), col, 3, 3, 3)


def test_corrupted_checkpoint_is_refused_at_load():
    from bsrkit.nn import BSRLinear

    layer = BSRLinear(16, 16, 4, density=0.5, generator=torch.Generator().manual_seed(0))
    for corrupt in ("col", "crow"):
        state = {k: v.clone() for k, v in layer.state_dict().items()}
        if corrupt == "col":
            state["col_indices"][0] = 10**9
        else:
            state["crow_indices"][-1] += 3
        fresh = BSRLinear(16, 16, 4, density=0.5, generator=torch.Generator().manual_seed(0))
        with pytest.raises(ValueError, match="malformed pattern"):
            fresh.load_state_dict(state)
        torch.testing.assert_close(fresh(torch.ones(2, 16)), layer(torch.ones(2, 16)))  # left intact


def test_pattern_corrupted_in_place_is_caught_at_the_next_forward():
    from bsrkit.nn import BSRLinear

    layer = BSRLinear(16, 16, 4, density=0.5, generator=torch.Generator().manual_seed(1))
    layer(torch.ones(1, 16))  # plans built for the good pattern
    with torch.no_grad():
        layer.col_indices[0] = 10**9  # the version counter moves: the cached verdict is stale
    with pytest.raises(ValueError, match="malformed weight"):
        layer(torch.ones(1, 16))


_INDICES_WORKER = textwrap.dedent(
    """
    import json, warnings
    warnings.filterwarnings("ignore")
    import torch, bsrkit
    results = []

    def run(name, blocks, others, data, acc=None):
        try:
            bsrkit.scatter_mm(blocks, others, data, accumulators=acc)
            got = "no error"
        except ValueError as exc:
            got = "ValueError: " + str(exc)
        except Exception as exc:
            got = type(exc).__name__ + ": " + str(exc)
        results.append([name, got])

    # "scatter_mm": blocks (3, 2, 2), others (4, 2, 3), 2 output tiles.
    blocks, others = torch.randn(3, 2, 2), torch.randn(4, 2, 3)
    good_c, good_pq = torch.tensor([0, 2, 3]), torch.tensor([[0, 1], [2, 3], [1, 0]])
    fmt = "scatter_mm"
    for name, c, pq in [
        ("p out of range", good_c, torch.tensor([[3, 1], [2, 3], [1, 0]])),
        ("p negative", good_c, torch.tensor([[-1, 1], [2, 3], [1, 0]])),
        ("q out of range", good_c, torch.tensor([[0, 4], [2, 3], [1, 0]])),
        ("q negative", good_c, torch.tensor([[0, -2], [2, 3], [1, 0]])),
        ("c_offsets decreasing", torch.tensor([0, 3, 2]), good_pq),
        ("c_offsets beyond pq", torch.tensor([0, 2, 9]), good_pq),
        ("pq not (G, 2)", good_c, good_pq.reshape(-1)),
    ]:
        run("scatter_mm: " + name, blocks, others, (fmt, c, pq))

    # strided formats from a valid 8 x 8 BSR (2 x 2 blocks), others (8, 4), then corrupted.
    bsr = torch.eye(8).to_sparse_bsr(2)
    other = torch.randn(8, 4)
    for fmt in ("bsr_strided_mm", "bsr_strided_mm_compressed"):
        data = bsrkit.bsr_scatter_mm_indices_data(bsr, other, indices_format=fmt, SPLIT_N=2)
        acc = torch.zeros(8, 4)
        r_i, q_i = 2, len(data) - 2
        def corrupt(i, fn):
            d = list(data)
            d[i] = fn(d[i].clone())
            return tuple(d)
        cases = [
            ("r negative", corrupt(r_i, lambda t: t.sub_(100))),
            ("r beyond the rows", corrupt(r_i, lambda t: t.add_(8 * 4))),
            ("q negative", corrupt(q_i, lambda t: t.sub_(100))),
            ("q beyond others", corrupt(q_i, lambda t: t.add_(8 * 4))),
            ("SPLIT_N not dividing N", (*data[:-1], {**data[-1], "SPLIT_N": 3})),
            ("c_indices too long", corrupt(1, lambda t: torch.cat([t, t[-1:] + 5]))),
        ]
        if fmt == "bsr_strided_mm":
            cases.append(("p out of range", corrupt(3, lambda t: t.add_(50))))
        else:
            cases.append(("q_offsets too short", corrupt(q_i, lambda t: t[:2])))
        for name, bad in cases:
            run(fmt + ": " + name, bsr.values(), other, bad, acc.clone())
    print(json.dumps(results))
    """
)


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_malformed_indices_data_raise(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    env = {"BSRKIT_BACKEND": backend, "TRITON_INTERPRET": "1"}
    results = run_python(_INDICES_WORKER, env=env, timeout=300).json()  # (a crash fails)
    assert len(results) == 7 + 2 * 7
    for name, got in results:
        assert got.startswith("ValueError: scatter_mm(): malformed indices_data: expected"), (name, got)
