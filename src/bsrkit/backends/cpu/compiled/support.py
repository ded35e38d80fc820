"""What every compiled CPU loop is built with: ``njit`` and its on-disk cache, and the record field kinds.

**The on-disk cache** is numba's ``cache=True``, with :class:`QuickLoadCache`:

- Where: ``$NUMBA_CACHE_DIR`` if set and writable, else ``__pycache__`` beside the loop's file if writable,
  else numba's per-user cache directory; where none is writable (a read-only install and home), the
  functions compile in memory on each process (:func:`njit`).
- Never stale. numba keys a cached function's index on *its own source file* only (and its own version,
  the CPU and the bytecode), while a loop compiles in code from other files (these intrinsics, the
  constants, the helpers of other modules). So the index is stamped instead with one hash over **every
  source file of the compiled code**: each ``.py`` file of this folder (:data:`COMPILED_SOURCES`), and the
  function's own file. Editing any of them recompiles everything; a new compiled module belongs in this
  folder, where the stamp covers it without further ado. The hash is of the files' *content* (an upgrade
  may keep a file's size and modification time).
- Concurrent writers: each index and data file is written to a temporary name and renamed into place.
  Every function is only ever compiled for one signature (the callers normalise argument types), so two
  processes compiling at once write the same entry with the same content.

Helpers (anything a loop calls) are compiled with ``numba.njit(cache=False)``: their code is linked into
each cached loop, and an uncached helper can never be loaded with a stale or mislabelled signature.

**Records.** Each loop's arguments are one ``NamedTuple`` in the loop's module, whose fields are the
loop's parameters in order (:func:`check_fields`), each annotated with a kind (:data:`Int`,
:data:`Address`, :data:`Ints2`, ...; :func:`field_kinds`): the C entries' packing and unpacking and the
callers' normalisation are derived from it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import typing
from pathlib import Path
from typing import Annotated, Any

import numba
import numpy as np
from numba.core.caching import FunctionCache
from numba.core.runtime import rtsys

__all__ = [
    "COMPILED_SOURCES",
    "Address",
    "Bool",
    "Float",
    "Floats1",
    "Floats2",
    "Int",
    "Ints1",
    "Ints2",
    "QuickLoadCache",
    "check_fields",
    "field_kinds",
    "njit",
    "serial_copy",
]

# The source files of the compiled code, whose hash stamps every cache index: this folder's modules.
COMPILED_SOURCES = Path(__file__).parent
_SOURCE_GLOB = "*.py"


@functools.cache
def _sources_digest() -> Any:
    """sha256 over the content of every compiled-code source file, in name order (read once)."""
    digest = hashlib.sha256()
    for path in sorted(COMPILED_SOURCES.glob(_SOURCE_GLOB)):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest


class QuickLoadCache(FunctionCache):
    """numba's function cache, loading without ``target_context.refresh()``, stamped with the hash of
    every compiled-code source file (see the module's docstring) and of the function's own file.

    The refresh imports every lowering registry numba has (0.5-1.3 s here, SciPy included where it is
    installed), which only *compiling* needs; running loaded code needs the runtime (NRT) alone. A miss
    compiles as usual (the compiler refreshes the context itself). An unreadable or corrupt entry is a
    miss, never an error.
    """

    def __init__(self, py_func: Any) -> None:
        super().__init__(py_func)
        digest = _sources_digest().copy()
        digest.update(Path(inspect.getfile(py_func)).read_bytes())
        self._cache_file._source_stamp = ("sha256", digest.hexdigest())

    def load_overload(self, sig: Any, target_context: Any) -> Any:
        rtsys.initialize(target_context)
        try:
            return self._load_overload(sig, target_context)
        except Exception:
            return None

    def save_overload(self, sig: Any, data: Any) -> None:
        """numba's save, which reads the index first: an index left truncated or empty (a crash, a full
        disk) raised there after every miss, in every process. It is replaced by a fresh one; a save that
        still fails leaves the compiled code in memory only (the next process compiles again)."""
        try:
            super().save_overload(sig, data)
        except Exception:
            with contextlib.suppress(Exception):
                os.unlink(self._cache_file._index_path)
                super().save_overload(sig, data)


def njit(**options: Any) -> Any:
    """``numba.njit(cache=True)`` with :class:`QuickLoadCache`; ``cache=False`` (compile in memory, each
    process) where no cache directory is writable."""

    def decorate(fn: Any) -> Any:
        try:
            dispatcher = numba.njit(cache=True, **options)(fn)
        except RuntimeError:  # numba: "cannot cache function ...: no locator available"
            return numba.njit(cache=False, **options)(fn)
        dispatcher._cache = QuickLoadCache(dispatcher.py_func)
        return dispatcher

    return decorate


def serial_copy(parallel: Any, name: str, cache: bool = True) -> Any:
    """The loop compiled without a parallel region (``prange`` is ``range`` there), run when ``nthreads
    == 1``: launching numba's thread pool costs ~0.1-0.2 ms per call, more than a tiny product takes. A
    copy of the function under its own name, so that its on-disk cache entries are its own; ``cache=False``:
    uncached, for linking into a C entry."""
    import types

    fn = parallel.py_func
    copy = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__qualname__ = name
    return njit(nogil=True)(copy) if cache else numba.njit(nogil=True, cache=False)(copy)


# -- record field kinds: what a packed argument block holds per field (see .entries) -----------------------

Int = Annotated[int, "i"]  # an int (int64)
Bool = Annotated[bool, "b"]
Float = Annotated[float, "f"]  # a float64
Address = Annotated[int, "a"]  # a data address (blocks, dense, out): travels per call beside a packed block
Ints1 = Annotated[np.ndarray, "1"]  # C-contiguous int64 arrays, 1-D and 2-D
Ints2 = Annotated[np.ndarray, "2"]
Floats1 = Annotated[np.ndarray, "G"]  # C-contiguous float64 arrays, 1-D and 2-D
Floats2 = Annotated[np.ndarray, "F"]
ARRAY_KINDS = "12GF"


def field_kinds(record: type[Any]) -> str:
    """One kind character per field of ``record`` (a NamedTuple annotated with the kinds above)."""
    hints = typing.get_type_hints(record, include_extras=True)
    return "".join(typing.get_args(hints[name])[1] for name in record._fields)


def check_fields(record: type[Any], loop: Any) -> None:
    """Refuse a record whose fields are not ``loop``'s parameters, in order (at import: a loop and its
    record are edited together)."""
    code = loop.py_func.__code__ if hasattr(loop, "py_func") else loop.__code__
    params = code.co_varnames[: code.co_argcount]
    if params != record._fields:
        raise TypeError(f"{record.__name__} fields {record._fields} differ from the loop's {params}")
