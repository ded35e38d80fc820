"""First imports of the compiled-loop modules, made off the main thread so that Ctrl-C cannot wedge them.

Importing the compiled loops (numba, and the loops loaded from the on-disk cache or compiled) takes
seconds on a cold machine. CPython delivers SIGINT to the main thread; when the ``KeyboardInterrupt`` is
raised inside the import machinery itself, a module lock can stay held, and every later import of that
module (another thread's product) then waits for ever. So :func:`import_module` runs a first import in a
loader thread, to which no signal is delivered, and the main thread waits for it in a loop that a
``KeyboardInterrupt`` may leave at any moment: the import finishes regardless, and the next product finds
the module loaded.
"""

from __future__ import annotations

import importlib
import sys
import threading
from types import ModuleType

__all__ = ["import_module"]

# How often the waiting main thread looks up (a signal interrupts the wait at once anyway).
_POLL_SECONDS = 0.05


def _loaded(name: str) -> ModuleType | None:
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return None if module is None or getattr(spec, "_initializing", False) else module


def import_module(name: str) -> ModuleType:
    """``importlib.import_module(name)``; from the main thread, a first import runs in a loader thread."""
    module = _loaded(name)
    if module is not None:
        return module
    if threading.current_thread() is not threading.main_thread():
        return importlib.import_module(name)
    result: dict[str, object] = {}
    done = threading.Event()

    def load() -> None:
        try:
            result["module"] = importlib.import_module(name)
        except BaseException as exc:  # (handed to the waiting thread)
            result["error"] = exc
        finally:
            done.set()

    threading.Thread(target=load, name=f"bsrkit-import-{name}", daemon=True).start()
    while not done.wait(_POLL_SECONDS):
        pass
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["module"]  # type: ignore[return-value]
