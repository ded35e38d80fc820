"""Kernel parameters: defaults, a persisted per-device tuning table, and ``meta=`` validation.

Tuning stays out of kernels: every op takes ``meta=`` (a dict); without it, the op looks its shape up in
the tuning table that ``bsrkit tune`` writes, and falls back to defaults with a one-time
:class:`TuningWarning` naming the command to run.

The table is JSON: ``{"format": "bsrkit-tuning", "version": 1, "entries": {key: params}}`` with keys
``"<device name>|<op>|<dtype>|M,K,N|Ms x Ks"``. It lives in the user cache directory (platformdirs) unless
``$BSRKIT_TUNING_TABLE`` or ``--table`` names another file. A corrupt or foreign file is reported (one
warning) and ignored, never a crash.

Below the user's table, bsrkit ships tables of its own (``bsrkit/tuned/*.json``, same format) measured on
particular devices (e.g. ``cuda:NVIDIA H200``, by ``benchmarks/gpu_check.py``). Their entries are exact
shapes as above, or shape classes ``"<device>|<op>|<dtype>|*,*,<N class>|Ms x Ks"`` (:func:`shape_class`)
that serve every M and K. Lookup order: the user's exact entry, the shipped exact entry, the shipped
class entry, then the backend's defaults (with the one-time warning).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import stat
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bsrkit.backends import BACKENDS, Backend
from bsrkit.backends.cpu.backend import cpu_device_name
from bsrkit.environment import getenv
from bsrkit.loading import import_module
from bsrkit.validation import is_int

__all__ = [
    "TABLE_ENV",
    "TuningWarning",
    "check_writable",
    "class_key",
    "cpu_device_name",
    "cpu_mm_meta",
    "default_table_path",
    "load_table",
    "lookup",
    "resolve",
    "resolve_state",
    "save_entries",
    "shape_class",
    "shipped_entries",
    "table_key",
    "triton_device_name",
    "triton_meta",
]

TABLE_ENV = "BSRKIT_TUNING_TABLE"
_FORMAT, _VERSION = "bsrkit-tuning", 1


class TuningWarning(UserWarning):
    """No tuned parameters for a shape (defaults used), or an unreadable tuning table."""


_USER_TABLE: list[Any] = []  # [the path, its string], once known


def default_table_path() -> Path:
    """``$BSRKIT_TUNING_TABLE``, else ``tuning.json`` in the user cache directory."""
    env = getenv(TABLE_ENV)
    return Path(env) if env else _user_table()


def _user_table() -> Path:
    if not _USER_TABLE:
        platformdirs = import_module("platformdirs")  # (the first product's: see bsrkit.loading)
        path = Path(platformdirs.user_cache_dir("bsrkit")) / "tuning.json"
        _USER_TABLE.extend((path, str(path)))  # (the string too: every product call looks it up)
    return _USER_TABLE[0]


def _user_table_name() -> str:
    if not _USER_TABLE:
        _user_table()
    return _USER_TABLE[1]


@functools.lru_cache(maxsize=4096)  # looked up on every product call: format each key once
def table_key(
    device: str, op: str, dtype: torch.dtype, shape: tuple[int, int, int], blocksize: tuple[int, int]
) -> str:
    M, K, N = shape
    return f"{device}|{op}|{str(dtype).removeprefix('torch.')}|{M},{K},{N}|{blocksize[0]}x{blocksize[1]}"


def shape_class(N: int) -> str:
    """The N class of a shipped class entry: decode-like products (``N <= 64`` columns: a few tokens)
    want other tiles than wide ones."""
    return "N<=64" if N <= 64 else "N>64"


def class_key(device: str, op: str, dtype: torch.dtype, N: int, blocksize: tuple[int, int]) -> str:
    """The key of a shipped class entry (any M and K; N by :func:`shape_class`)."""
    name = str(dtype).removeprefix("torch.")
    return f"{device}|{op}|{name}|*,*,{shape_class(N)}|{blocksize[0]}x{blocksize[1]}"


_SHIPPED_DIR = Path(__file__).parent / "tuned"


@functools.cache
def shipped_entries() -> dict[str, dict[str, Any]]:
    """The entries of every table shipped in ``bsrkit/tuned/`` (read once per process)."""
    entries: dict[str, dict[str, Any]] = {}
    for path in sorted(_SHIPPED_DIR.glob("*.json")):
        entries.update(load_table(path))
    return entries


_lock = threading.Lock()


def _fresh_lock_in_child() -> None:
    global _lock  # (one held by another thread of the parent at a fork would stay held in the child)
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock_in_child)
# path -> (mtime or None when missing, time.monotonic() of the last stat, entries)
_loaded: dict[str, tuple[float | None, float, dict[str, dict[str, Any]]]] = {}
# A product call looks the table up; the file is stat-ed at most this often (another process's `bsrkit
# tune` is seen within this delay; this process's own writes at once).
_RECHECK_SECONDS = 1.0
_warned: set[str] = set()


def _warn_once(tag: str, message: str) -> None:
    with _lock:
        if tag in _warned:
            return
        _warned.add(tag)
    warnings.warn(message, TuningWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside bsrkit, as seen from :func:`_warn_once`: the warning
    names the user's line, whatever the depth of the call inside the package."""
    frame = sys._getframe(1)  # _warn_once
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("bsrkit"):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def load_table(path: Path | str | None = None) -> dict[str, dict[str, Any]]:
    """The entries of a tuning table ({} when missing, corrupt or foreign; the latter two warn once)."""
    name = str(path) if path is not None else getenv(TABLE_ENV) or _user_table_name()
    now = time.monotonic()
    cached = _loaded.get(name)
    if cached is not None and now - cached[1] < _RECHECK_SECONDS:
        return cached[2]
    try:
        st = os.stat(name)
    except OSError:  # missing: no entries (the same object while it stays missing: results keyed on it hold)
        missing = cached[2] if cached is not None and cached[0] is None else {}
        _loaded[name] = (None, now, missing)
        return missing
    mtime = st.st_mtime
    if not stat.S_ISREG(st.st_mode):  # (a FIFO would block every product's read; a device is no table)
        _warn_once(f"special:{name}", f"bsrkit: ignoring tuning table {name}: not a regular file")
        _loaded[name] = (mtime, now, {})
        return _loaded[name][2]
    if cached is not None and cached[0] == mtime:
        _loaded[name] = (mtime, now, cached[2])
        return cached[2]
    path = Path(name)
    entries: dict[str, dict[str, Any]] = {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ValueError("not a bsrkit tuning table")
        if data.get("version") != _VERSION:
            raise ValueError(f"version {data.get('version')!r}, expected {_VERSION}")
        raw = data.get("entries")
        if not isinstance(raw, dict):
            raise ValueError("'entries' is not a mapping")
        # A malformed entry is ignored on its own (warned once), as a bad value is (see resolve); the
        # rest of the table stays, and a later save keeps it.
        entries = {k: v for k, v in raw.items() if isinstance(v, dict)}
        bad = sorted(k for k, v in raw.items() if not isinstance(v, dict))
        if bad:
            _warn_once(
                f"bad-entries:{path}:{mtime}",
                f"bsrkit: ignoring {len(bad)} entries of tuning table {path} that are not parameter dicts: "
                f"{bad[:3]}{' ...' if len(bad) > 3 else ''}",
            )
    except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; deep nesting
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        _warn_once(f"bad:{path}:{mtime}", f"bsrkit: ignoring tuning table {path}: {reason}")
        entries = {}
    _loaded[name] = (mtime, now, entries)
    return entries


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``<path>.lock`` (POSIX ``flock``; no lock where it is missing), so that
    concurrent ``bsrkit tune`` runs serialise their read-merge-write and lose nothing."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def check_writable(path: Path | None = None) -> Path:
    """Raise ``OSError`` now, before any tuning work, if the table at ``path`` cannot be written."""
    path = Path(path) if path is not None else default_table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=path.parent, prefix=".tuning-", suffix=".probe")
    os.close(fd)
    os.unlink(probe)
    if path.exists() and not os.access(path, os.W_OK):
        raise PermissionError(f"tuning table {path} is not writable")
    _refuse_foreign(path)
    return path


def _refuse_foreign(path: Path) -> None:
    """Raise ``FileExistsError`` if ``path`` holds something other than a bsrkit tuning table (of any
    version) or nothing: a mistyped ``--table`` must not replace a user's file (nor a device such as
    ``/dev/null``, which reads as empty, nor block on a FIFO's read)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise FileExistsError(
                f"{path} exists and is not a regular file: not replacing it with a tuning table (choose "
                "another table path)"
            )
    except FileNotFoundError:
        return
    try:
        text = path.read_text()
    except FileNotFoundError:
        return
    except (OSError, UnicodeDecodeError) as exc:
        raise FileExistsError(f"{path} exists and cannot be read as a bsrkit tuning table ({exc})") from None
    if not text.strip():
        return  # (an empty file: nothing to lose)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        data = None
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise FileExistsError(
            f"{path} exists and is not a bsrkit tuning table: not replacing it (remove it, or choose "
            "another table path)"
        )


def _new_file_mode(path: Path) -> int:
    """The permission bits the table gets: the replaced file's, else those ``open`` gives a new file."""
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def save_entries(new: dict[str, dict[str, Any]], path: Path | None = None) -> Path:
    """Merge ``new`` into the table at ``path`` (a table of another version is replaced; a file that is
    not a bsrkit tuning table raises ``FileExistsError`` and stays) and write it atomically, under a file
    lock, keeping the file's permissions: concurrent writers lose no entries, and a failed write leaves
    no temporary file."""
    path = Path(path) if path is not None else default_table_path()
    # (through a symbolic link: the file it names is updated, the link stays)
    path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    _refuse_foreign(path)  # (also before the lock file is made beside it: /dev/null.lock)
    with _locked(path):
        _refuse_foreign(path)
        _loaded.pop(str(path), None)  # read what is on disk now, not a copy up to a second old
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TuningWarning)
            entries = dict(load_table(path))
        entries.update(new)
        payload = {"format": _FORMAT, "version": _VERSION, "entries": entries}
        mode = _new_file_mode(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tuning-", suffix=".json")
        try:
            os.fchmod(fd, mode)  # (mkstemp's 0600 would replace the file's own permissions)
            with os.fdopen(fd, "w") as f:
                json.dump(payload, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    _loaded.clear()  # this process sees its own write at once, under every name (a link's too)
    return path


def lookup(
    op: str,
    dtype: torch.dtype,
    shape: tuple[int, int, int],
    blocksize: tuple[int, int],
    device_name: str | None = None,
    tune_flag: str = "",
) -> dict[str, Any] | None:
    """Tuned parameters for this shape on ``device_name`` (default: this CPU), or None after a one-time
    warning naming the ``bsrkit tune`` command (with ``tune_flag``, e.g. ``"--backend triton "``)."""
    device = device_name or cpu_device_name()
    key = table_key(device, op, dtype, shape, blocksize)
    found = load_table().get(key)
    if found is None:
        shipped = shipped_entries()
        found = shipped.get(key) or shipped.get(class_key(device, op, dtype, shape[2], blocksize))
    if found is None and "fallback" not in _warned:  # (checked first: the message costs ~2 µs to format)
        M, K, N = shape
        name = str(dtype).removeprefix("torch.")
        # (bsrkit tune times bsr @ dense and stores its parameters for both orientations; other ops keep
        # their defaults)
        advice = (
            f"Run `bsrkit tune {tune_flag}--shapes {M}x{K}x{N} --blocksizes {blocksize[0]}x{blocksize[1]}"
            f"{'' if name == 'float32' else ' --dtype ' + name}` to tune"
            if op in _TUNABLE
            else "`bsrkit tune` tunes the products only"
        )
        _warn_once(
            "fallback",
            f"bsrkit: no tuned parameters for {op} {name} M,K,N={M},{K},{N} blocksize "
            f"{blocksize[0]}x{blocksize[1]} on {device_name or 'this CPU'}; using defaults. {advice} (this "
            "warning is shown once per process).",
        )
    return found


# The tuning table's name of each kernel variant (one place: table keys, the tuner and the lookups use it).
# Public ops that run the same kernel share its name: bsr_dense_addmm, the custom op bsr_mm and the
# attention's products use "bsr_dense_mm"; bsr_scatter_mm uses "scatter_mm".
TABLE_NAMES = {
    ("addmm", ""): "bsr_dense_mm",
    ("addmm", "transposed"): "bsr_transposed_dense_mm",
    ("sampled", ""): "sampled_addmm",
    ("scatter_mm", ""): "scatter_mm",
}
_KERNEL_OF = {name: kernel for (kernel, _), name in TABLE_NAMES.items()}
_TUNABLE = (TABLE_NAMES["addmm", ""], TABLE_NAMES["addmm", "transposed"])  # (what bsrkit tune writes)


def resolve(
    backend: Backend,
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    shape: tuple[int, int, int],
    blocksize: tuple[int, int],
    meta: dict[str, Any] | None,
    op: str | None = None,
) -> dict[str, Any]:
    """The launch parameters of the kernel variant ``name`` (a value of :data:`TABLE_NAMES`) on
    ``backend`` at ``shape = (M, K, N)``: ``meta`` wins (``{}`` means the defaults); without it, the
    tuning table's entry for this shape and device (its thread count at most torch's, the user's limit);
    then the backend's defaults
    (:meth:`~bsrkit.backends.base.Backend.complete_params`). ``meta`` is checked against the backend's
    :attr:`~bsrkit.backends.base.Backend.param_schema` (errors name the public ``op``, default
    ``name``); a backend without parameters ignores it."""
    if name not in _KERNEL_OF:
        raise ValueError(f"tuning.resolve(): expected a name in {sorted(_KERNEL_OF)}, got {name!r}")
    schema = backend.param_schema
    if not schema:
        return {}
    if meta is None:
        # Memoized per call shape: valid while the table (re-read when its file changes) and the set of
        # given warnings are the same objects, and torch's thread count (the CPU default) is unchanged.
        memo = (backend.name, name, device, dtype, shape, blocksize, torch.get_num_threads())
        entries = load_table()
        hit = _resolved.get(memo)
        if hit is not None and hit[0] is entries and hit[1] is _warned:
            return dict(hit[2])
        params = _resolve_unmemoized(backend, name, device, dtype, shape, blocksize, meta, name)
        if len(_resolved) >= _RESOLVED_MAX:
            _resolved.clear()
        _resolved[memo] = (entries, _warned, params)
        return dict(params)
    return _resolve_unmemoized(backend, name, device, dtype, shape, blocksize, meta, op or name)


def resolve_state() -> tuple[dict[str, Any], set[str]]:
    """What :func:`resolve` (without ``meta``) depends on beyond its arguments and torch's thread count:
    the table's entries and the set of warnings given, as objects (a result is valid while both are the
    same objects)."""
    return load_table(), _warned


# (backend, op, device, dtype, shape, blocksize, threads) -> (table, warnings given, params)
_resolved: dict[tuple[Any, ...], tuple[dict[str, Any], set[str], dict[str, Any]]] = {}
_RESOLVED_MAX = 4096


def _resolve_unmemoized(
    backend: Backend,
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    shape: tuple[int, int, int],
    blocksize: tuple[int, int],
    meta: dict[str, Any] | None,
    op: str,
) -> dict[str, Any]:
    schema = backend.param_schema
    if meta is None:
        device_name = backend.tuning_device(device)
        tuned = lookup(name, dtype, shape, blocksize, device_name, backend.tune_flag) or {}
        chosen = {k: v for k, v in tuned.items() if k in schema}
        bad = [(k, v) for k, v in chosen.items() if not schema[k].check(v)]
        if bad:  # a hand-edited or corrupt entry: warned about once, then ignored
            key = table_key(device_name, name, dtype, shape, blocksize)
            k, v = bad[0]
            _warn_once(
                f"entry:{key}",
                f"bsrkit: ignoring entry {key!r} of tuning table {default_table_path()}: expected {k!r} "
                f"to be {schema[k].expected}, got {v!r}",
            )
            chosen = {}
        if "nthreads" in chosen:  # (measured with every core; torch.set_num_threads, the user's limit, holds)
            chosen["nthreads"] = min(chosen["nthreads"], max(1, torch.get_num_threads()))
    else:
        check_meta(backend, meta, op)
        # (numpy's integers as ints: a narrow one overflows in the work estimates, Triton refuses them)
        chosen = {k: int(v) if is_int(v) else v for k, v in meta.items()}
    return backend.complete_params(_KERNEL_OF[name], dtype, shape, blocksize, chosen)


def check_meta(backend: Backend, meta: dict[str, Any], op: str) -> None:
    """Refuse (``ValueError`` naming ``op``) a ``meta`` with keys outside ``backend``'s parameter schema or
    values it does not take; a backend without parameters ignores ``meta``. Whether a product reaches a
    kernel does not matter: an empty product checks it too."""
    schema = backend.param_schema
    if not schema:
        return
    unknown = set(meta) - set(schema)
    if unknown:
        raise ValueError(
            f"{op}(): expected meta keys among {sorted(schema)} for the {backend.display_name} backend, "
            f"got unknown {sorted(unknown)}"
        )
    for k, v in meta.items():
        if not schema[k].check(v):
            raise ValueError(f"{op}(): expected meta[{k!r}] to be {schema[k].expected}, got {v!r}")


def cpu_mm_meta(
    op: str,
    dtype: torch.dtype,
    shape: tuple[int, int, int],
    blocksize: tuple[int, int],
    meta: dict[str, Any] | None,
) -> dict[str, Any]:
    """:func:`resolve` for the CPU backend: ``panel`` (columns per gemm) and ``nthreads``."""
    return resolve(BACKENDS["cpu"], op, torch.device("cpu"), dtype, shape, blocksize, meta)


def triton_device_name(device: torch.device) -> str:
    return BACKENDS["triton"].tuning_device(device)


def triton_meta(
    op: str,
    device: torch.device,
    dtype: torch.dtype,
    shape: tuple[int, int, int],
    blocksize: tuple[int, int],
    meta: dict[str, Any] | None,
) -> dict[str, Any]:
    """:func:`resolve` for the Triton backend (tiles, warps and stages; see
    :meth:`bsrkit.backends.triton.TritonBackend.complete_params`)."""
    return resolve(BACKENDS["triton"], op, device, dtype, shape, blocksize, meta)
