"""Every public op under ``torch.compile`` (no fullgraph: graph breaks are fine), each in a fresh process
(issue 24, item 6): Dynamo used to trace into numba's dispatcher on a first call ("exception table entry
start instruction has no offset") and to fail inside ``bsr_softmax``. Outputs and gradients must equal
eager's. (``BSRLinear`` with ``fullgraph=True`` is tested in test_nn.py.)"""

import textwrap

import pytest

from helpers import run_python

# Inputs for every case; the compiled call runs first, so each op's first call is a compiled one.
SETUP = textwrap.dedent(
    """
    import json, warnings
    warnings.filterwarnings("ignore")
    import torch, bsrkit
    from bsrkit.nn import BSRLinear
    torch.manual_seed(0)
    w = torch.randn(64, 48, dtype=torch.float64)
    w = w * (torch.rand(4, 3) < 0.6).repeat_interleave(16, 0).repeat_interleave(16, 1)
    b = w.to_sparse_bsr((16, 16))
    values = b.values().clone().requires_grad_()
    def bsr(v=None):
        return torch.sparse_bsr_tensor(b.crow_indices(), b.col_indices(), values if v is None else v,
                                       size=b.shape)
    x, xt = torch.randn(48, 8, dtype=torch.float64), torch.randn(64, 8, dtype=torch.float64)
    a1, a2 = torch.randn(64, 5, dtype=torch.float64), torch.randn(5, 48, dtype=torch.float64)
    qkv = [torch.randn(1, 2, 64, 8, dtype=torch.float64) for _ in range(3)]
    mask = bsrkit.sliding_window_mask(64, 8, 16)
    i8 = torch.sparse_bsr_tensor(
        b.crow_indices(), b.col_indices(), b.values().round().clamp(-3, 3).to(torch.int8), size=b.shape)
    """
)

CASES = {
    "bsr_dense_mm": ("lambda v, x: bsrkit.bsr_dense_mm(bsr(v), x)", "[values, x]"),
    "bsr_dense_addmm": (
        "lambda v, x, l, r: bsrkit.bsr_dense_addmm(xt, bsr(v), x, beta=0.5, left_alpha=l, right_alpha=r)",
        "[values, x, torch.rand(64, dtype=torch.float64), torch.rand(8, dtype=torch.float64)]",
    ),
    "_int_bsr_dense_addmm": (
        "lambda c, d: bsrkit._int_bsr_dense_addmm(c, i8, d)",
        "[torch.zeros(64, 8, dtype=torch.int32), torch.randint(-3, 4, (48, 8), dtype=torch.int8)]",
    ),
    "bsr_transposed_dense_mm": ("lambda v, xt: bsrkit.bsr_transposed_dense_mm(bsr(v), xt)", "[values, xt]"),
    "sampled_addmm": ("lambda v, a1, a2: bsrkit.sampled_addmm(bsr(v), a1, a2).values()", "[values, a1, a2]"),
    "bsr_softmax": ("lambda v: bsrkit.bsr_softmax(bsr(v)).values()", "[values]"),
    "scaled_dot_product_attention": (
        "lambda q, k, v: bsrkit.scaled_dot_product_attention(q, k, v, mask)",
        "qkv",
    ),
    "scatter_mm": (
        "lambda x: bsrkit.scatter_mm(b.values().detach(), x, bsrkit.bsr_scatter_mm_indices_data(b, x))",
        "[x]",
    ),
    "bsr_scatter_mm": (
        "lambda x: bsrkit.bsr_scatter_mm(b.detach(), x, bsrkit.bsr_scatter_mm_indices_data(b.detach(), x))",
        "[x]",
    ),
    "bsr_scatter_mm_indices_data": (
        "lambda x: torch.cat([t.flatten().double() for t in "
        "bsrkit.bsr_scatter_mm_indices_data(b.detach(), x, indices_format='bsr_strided_mm')[1:-1]])",
        "[x]",
    ),
    "masks": (
        "lambda m: torch.cat([t.to_dense().flatten().double() for t in ("
        "bsrkit.sliding_window_mask(64, 8, 16), bsrkit.causal_mask(64, 16), "
        "bsrkit.block_local_mask(64, 16, neighbours=1, global_tokens=2), bsrkit.mask_from_dense(m, 16))])",
        "[torch.rand(64, 64) < 0.3]",
    ),
    "BSRLinear": (
        "lambda x: layer(x)",
        "[torch.randn(5, 48, dtype=torch.float64)]",
    ),
}

# (scatter_mm and bsr_scatter_mm with indices data refuse arguments that require grad, as torch's cannot
# differentiate them either; test_scatter_mm.py checks the refusal.)
NOT_DIFFERENTIABLE = {
    "_int_bsr_dense_addmm",
    "scatter_mm",
    "bsr_scatter_mm",
    "bsr_scatter_mm_indices_data",
    "masks",
}

CHECK = textwrap.dedent(
    """
    layer = BSRLinear(48, 64, 16, density=0.5).double()
    fn, args = {fn}, {args}
    grad = {grad}
    args = [a.detach().clone().requires_grad_(grad and a.is_floating_point()) for a in args]
    compiled = torch.compile(fn)(*args)
    eager_args = [a.detach().clone().requires_grad_(grad and a.is_floating_point()) for a in args]
    eager = fn(*eager_args)
    result = {{"equal": bool(torch.allclose(compiled, eager, rtol=1e-12, atol=1e-12, equal_nan=True))}}
    if compiled.requires_grad:
        g = torch.randn_like(compiled)
        got = torch.autograd.grad(compiled, [a for a in args if a.requires_grad], g)
        want = torch.autograd.grad(eager, [a for a in eager_args if a.requires_grad], g)
        result["grads"] = [bool(torch.allclose(p, q, rtol=1e-12, atol=1e-12)) for p, q in zip(got, want)]
    print(json.dumps(result))
    """
)


@pytest.mark.parametrize("op", sorted(CASES))
def test_public_op_under_torch_compile_in_a_fresh_process(op):
    fn, args = CASES[op]
    differentiable = op not in NOT_DIFFERENTIABLE
    result = run_python(SETUP + CHECK.format(fn=fn, args=args, grad=differentiable), timeout=300).json()
    assert result["equal"], result
    assert all(result.get("grads", [])), result
    assert bool(result.get("grads")) == differentiable, result
