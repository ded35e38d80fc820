"""Public functions that ``torch.compile`` runs eagerly (a graph break), without importing Dynamo.

Dynamo cannot trace into numba's dispatcher ("exception table entry start instruction has no offset")
and failed inside ``bsr_softmax``'s sparse arguments, so the functions that reach compiled loops run as
plain Python under ``torch.compile``: :func:`eager_under_compile` marks them as
``torch.compiler.disable`` does (Dynamo skips inlining a function flagged ``_torchdynamo_disable``; the
call is a graph break) and turns the frame evaluation callback off for the call, so that Dynamo does not
compile the frames below either. ``torch.compiler.disable`` itself would import ``torch._dynamo`` (and
with it triton) when ``bsrkit`` is imported; this costs about 0.1 us per eager call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from torch._C._dynamo.eval_frame import set_eval_frame

__all__ = ["eager_under_compile"]

F = TypeVar("F", bound=Callable[..., Any])


def eager_under_compile(fn: F) -> F:
    """``fn``, run eagerly (with Dynamo's frame callback off) wherever ``torch.compile`` meets it."""

    @functools.wraps(fn)
    def eager(*args: Any, **kwargs: Any) -> Any:
        prior = set_eval_frame(None)
        try:
            return fn(*args, **kwargs)
        finally:
            set_eval_frame(prior)

    eager._torchdynamo_disable = True  # type: ignore[attr-defined]
    return eager  # type: ignore[return-value]
