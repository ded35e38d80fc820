"""The codes and flags shared by the compiled loops and their callers; one definition each.

No numba here: :mod:`bsrkit.backends.cpu.kernels` imports these at ``import bsrkit`` time. This file is
in the compiled code's folder, so the on-disk cache stamp covers it (see :mod:`.support`).
"""

from __future__ import annotations

__all__ = [
    "DOT_COLUMNS",
    "DOT_NONE",
    "DOT_PAIRS",
    "EXP_FASTMATH",
    "FASTMATH",
    "KIND_BF16",
    "KIND_F16",
    "KIND_F32",
    "KIND_F64",
]

# The element type of a product's operands (float16/bfloat16 accumulate in float32).
KIND_F32, KIND_F64, KIND_BF16, KIND_F16 = 0, 1, 2, 3
# bsr_mm_small's ``dot``: broadcast loops (X is (K, Wp)), dot products along k (X is (Wp, K)), or the
# two-column dot loop reading a row-major (K, 2) X directly.
DOT_NONE, DOT_COLUMNS, DOT_PAIRS = 0, 1, 2
# Every fast-math flag except 'nnan' and 'ninf': -inf (excluded entries) and NaN must keep their meaning.
FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}
# The float32 exp's own flags: no 'reassoc', which would fold (v + 1.5 * 2**23) - 1.5 * 2**23 into v.
# (Sets, as numba takes them; never modified.)
EXP_FASTMATH = {"nsz", "arcp", "contract", "afn"}
