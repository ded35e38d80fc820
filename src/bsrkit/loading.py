"""First imports (and first compiles) made off the main thread, so that Ctrl-C cannot wedge them.

Importing the compiled loops (numba, and the loops loaded from the on-disk cache or compiled) takes
seconds on a cold machine. CPython delivers SIGINT to the main thread; when the ``KeyboardInterrupt`` is
raised inside the import machinery itself, a module lock can stay held, and every later import of that
module (another thread's product) then waits for ever; so can numba's compiler lock when the interrupt
lands inside a compile. :func:`off_main_thread` runs such work in a loader thread, to which no signal is
delivered, and the main thread waits for it in a loop that a ``KeyboardInterrupt`` may leave at any
moment: the work finishes regardless, and the next product finds it done. :func:`import_module` is the
same for a first import; every import the first product makes (numba, the compiled loops, platformdirs,
SciPy's BLAS) goes through it.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["import_module", "off_main_thread"]

# How often the waiting main thread looks up (a signal interrupts the wait at once anyway).
_POLL_SECONDS = 0.05


def _loaded(name: str) -> ModuleType | None:
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return None if module is None or getattr(spec, "_initializing", False) else module


def import_module(name: str) -> ModuleType:
    """``importlib.import_module(name)``, a first import from the main thread made in a loader thread."""
    module = _loaded(name)
    if module is not None:
        return module
    return off_main_thread(importlib.import_module, name)


def off_main_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``; called from the main thread, it runs in a loader thread while the main thread waits
    (a ``KeyboardInterrupt`` there leaves the wait; ``fn`` runs to its end). Its exception is re-raised."""
    if threading.current_thread() is not threading.main_thread():
        return fn(*args)
    result: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            result["value"] = fn(*args)
        except BaseException as exc:  # (handed to the waiting thread)
            result["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name=f"bsrkit-loader-{getattr(fn, '__name__', 'work')}", daemon=True).start()
    while not done.wait(_POLL_SECONDS):
        pass
    if "error" in result:
        raise result["error"]
    return result["value"]
