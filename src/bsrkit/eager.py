"""The entry of bsrkit's public functions: run eagerly under ``torch.compile`` (a graph break), without
importing Dynamo, and refused under ``torch.func``'s transforms.

Dynamo cannot trace into numba's dispatcher ("exception table entry start instruction has no offset")
and failed inside ``bsr_softmax``'s sparse arguments, so the functions that reach compiled loops run as
plain Python under ``torch.compile``: :func:`eager_under_compile` marks them as
``torch.compiler.disable`` does (Dynamo skips inlining a function flagged ``_torchdynamo_disable``; the
call is a graph break) and turns the frame evaluation callback off for the call, so that Dynamo does not
compile the frames below either. ``torch.compiler.disable`` itself would import ``torch._dynamo`` (and
with it triton) when ``bsrkit`` is imported; this costs about 0.1 us per eager call.

``torch.func``'s transforms (``grad``, ``vmap``, ``jvp``, ``jacrev``, ...) cannot take torch's sparse
tensors at all (even a BSR built inside one fails: "Sparse BSR tensors do not have strides"), so a call
under one raises :func:`refuse_transforms`'s ``NotImplementedError`` naming the function, not whichever
error torch reaches first (~30 ns a call).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from torch._C import _are_functorch_transforms_active as _transforms_active
from torch._C._dynamo.eval_frame import set_eval_frame

__all__ = ["eager_under_compile", "refuse_transforms"]

F = TypeVar("F", bound=Callable[..., Any])


def eager_under_compile(fn: F) -> F:
    """``fn``, run eagerly (with Dynamo's frame callback off) wherever ``torch.compile`` meets it."""

    @functools.wraps(fn)
    def eager(*args: Any, **kwargs: Any) -> Any:
        if _transforms_active():
            refuse_transforms(fn.__name__)
        prior = set_eval_frame(None)
        try:
            return fn(*args, **kwargs)
        finally:
            set_eval_frame(prior)

    eager._torchdynamo_disable = True  # type: ignore[attr-defined]
    return eager  # type: ignore[return-value]


def refuse_transforms(op: str) -> None:
    """Raise where a ``torch.func`` transform is active (see the module's docstring)."""
    if _transforms_active():
        raise NotImplementedError(
            f"bsrkit.{op}(): torch.func transforms (grad, vmap, jvp, jacrev, ...) are not supported: torch's "
            "sparse tensors cannot enter them. Use torch.autograd (backward, torch.autograd.grad) instead"
        )
