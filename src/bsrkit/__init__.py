"""bsrkit: block-sparse (BSR) matrix products for PyTorch, fast on CPU, with leak-free plan caching.

The products mirror ``torch.sparse._triton_ops`` so that switching is a change of import. Plans (index
data derived from a BSR tensor's indices) are cached under memory-identity keys held through weak
references: an entry lives exactly as long as the index memory it was computed from.
"""

from bsrkit.attention import scaled_dot_product_attention
from bsrkit.cache import CacheInfo, weak_lru_cache
from bsrkit.keys import TensorAsKey, TensorKey
from bsrkit.masks import (
    block_local_mask,
    causal_mask,
    mask_from_block_mask,
    mask_from_dense,
    sliding_window_mask,
)
from bsrkit.ops import (
    _int_bsr_dense_addmm,
    bsr_dense_addmm,
    bsr_dense_mm,
    bsr_transposed_dense_mm,
    sampled_addmm,
)
from bsrkit.plans import cache_info
from bsrkit.scatter import bsr_scatter_mm, bsr_scatter_mm_indices_data, scatter_mm, scatter_mm_meta
from bsrkit.shortcuts import ShortcutInfo, cache_clear
from bsrkit.shortcuts import info as shortcut_info
from bsrkit.softmax import bsr_softmax

__version__ = "0.2.0"

# torch.sparse._triton_ops's names for the same things, so that switching stays a change of import (the
# attention's semantics differ where README.md says)
_scaled_dot_product_attention = scaled_dot_product_attention


__all__ = [
    "CacheInfo",
    "ShortcutInfo",
    "TensorAsKey",
    "TensorKey",
    "__version__",
    "_int_bsr_dense_addmm",
    "_scaled_dot_product_attention",
    "block_local_mask",
    "bsr_dense_addmm",
    "bsr_dense_mm",
    "bsr_scatter_mm",
    "bsr_scatter_mm_indices_data",
    "bsr_softmax",
    "bsr_transposed_dense_mm",
    "cache_clear",
    "cache_info",
    "causal_mask",
    "load_sparse",
    "mask_from_block_mask",
    "mask_from_dense",
    "sampled_addmm",
    "save_sparse",
    "scaled_dot_product_attention",
    "scatter_mm",
    "scatter_mm_meta",
    "shortcut_info",
    "sliding_window_mask",
    "sparsify_",
    "weak_lru_cache",
]


_LAZY_SUBMODULES = frozenset({
    "nn", "custom_ops", "reference", "tuning", "autograd", "distributed", "sparsify", "prune", "checkpoint",
    "break_even", "regrow", "repattern", "model_demo", "loading", "places",
})  # fmt: skip


def __getattr__(name: str) -> object:
    # Submodules that import more (torch.library registrations, the reference) load on first use.
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"bsrkit.{name}")
    if name in ("save_sparse", "load_sparse"):
        from bsrkit import checkpoint

        return getattr(checkpoint, name)
    if name == "sparsify_":
        from bsrkit.sparsify import sparsify_

        return sparsify_
    raise AttributeError(f"module 'bsrkit' has no attribute {name!r}")
