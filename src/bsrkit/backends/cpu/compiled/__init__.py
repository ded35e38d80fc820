"""The CPU backend's compiled code (numba): every loop, and what they share.

Nothing here is imported by ``import bsrkit``; :mod:`bsrkit.backends.cpu.kernels` imports the loops at the
first product (off the main thread, see :mod:`bsrkit.loading`). Importing this package itself imports
nothing. Its modules, downward:

- :mod:`.constants`: the ``KIND_*`` and ``DOT_*`` codes, the fast-math flags (no numba: the marshaling
  modules import them too);
- :mod:`.support`: ``njit`` with the on-disk cache, the record field kinds; :mod:`.intrinsics` (BLAS calls,
  pointers, the float32 ``exp``, the work split) and :mod:`.vector` (the SIMD type);
- one module per loop family: :mod:`.gemm`, :mod:`.small`, :mod:`.sampled`, :mod:`.scatter`,
  :mod:`.attention`, :mod:`.softmax`, each with the record of its loops' arguments;
- :mod:`.entries`: the serial twins, C entries of the packed records, and ``DISPATCHERS``.

The cache stamp covers every ``.py`` file of this folder (see :mod:`.support`).
"""
