"""The compiled CPU kernels' on-disk cache: the first process on a machine compiles, later ones load.

Processes run under a temporary ``NUMBA_CACHE_DIR`` and a hard time limit. "Loaded" is read from numba's
own cache statistics (:func:`bsrkit.backends.cpu.kernels.compile_cache_info`), never from a timing.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch

import bsrkit
from bsrkit.backends.cpu import blas, kernels
from helpers import finish_python, run_python, start_python

SRC = Path(__file__).parents[1] / "src"
JIT_FILE = SRC / "bsrkit" / "backends" / "cpu" / "compiled" / "support.py"

pytestmark = pytest.mark.skipif(blas.blas_provider() is None, reason="no BLAS for the CPU kernels")

PRODUCTS = textwrap.dedent(
    """
    import json, warnings
    warnings.filterwarnings("ignore")
    import torch
    import bsrkit
    from bsrkit.backends.cpu import kernels

    torch.manual_seed(0)
    w = torch.randn(64, 48) * (torch.rand(4, 3) < 0.6).repeat_interleave(16, 0).repeat_interleave(16, 1)
    bsr = w.to_sparse_bsr((16, 16))
    x, mat1, mat2 = torch.randn(48, 24), torch.randn(64, 8), torch.randn(8, 48)
    mask = torch.sparse_bsr_tensor(bsr.crow_indices(), bsr.col_indices(), torch.ones_like(bsr.values()),
                                   size=bsr.shape).to_dense()
    errors = []
    # Small products run the serial twins, large ones the parallel loops: each kernel once.
    for n in (24, 8192):
        x, mat1, mat2 = torch.randn(48, n), torch.randn(64, n), torch.randn(n, 48)
        errors.append(float((bsrkit.bsr_dense_mm(bsr, x) - w @ x).abs().max()))
        sampled = bsrkit.sampled_addmm(bsr, mat1, mat2, beta=0.0)
        errors.append(float((sampled.to_dense() - (mat1 @ mat2) * mask).abs().max() / n))
    print(json.dumps({"errors": errors, "cache": kernels.compile_cache_info()}))
    """
)


def _env(cache_dir: Path, **extra: str) -> dict[str, str]:
    return {"NUMBA_CACHE_DIR": str(cache_dir), **extra}


@pytest.mark.slow  # (about a minute: two processes compile every kernel from an empty cache)
def test_first_processes_compile_concurrently_and_later_ones_load(tmp_path):
    """Two processes start together on an empty cache (both compile, or one loads what the other
    wrote: each entry is renamed into place whole); a third then loads both kernels."""
    cache = tmp_path / "numba-cache"
    first = [start_python(PRODUCTS, env=_env(cache)) for _ in range(2)]
    try:
        reports = [finish_python(p, timeout=400).json() for p in first]
    finally:
        for p in first:
            p.kill()
    for report in reports:
        assert max(report["errors"]) < 1e-3, report
        for name in ("bsr_mm", "sampled", "bsr_mm_serial", "sampled_serial"):
            info = report["cache"][name]
            assert info["path"].startswith(str(cache)), info
            assert info["hits"] + info["misses"] == 1, info
    later = run_python(PRODUCTS, env=_env(cache), timeout=300).json()
    assert max(later["errors"]) < 1e-3, later
    for name in ("bsr_mm", "sampled", "bsr_mm_serial", "sampled_serial"):
        assert later["cache"][name]["hits"] == 1 and later["cache"][name]["misses"] == 0, later


# A module with one cached function, loading compiled/support.py by path (no torch import: quick processes).
PROBE = textwrap.dedent(
    """
    import importlib.util, json, sys
    spec = importlib.util.spec_from_file_location("probe_jit", {jit!r})
    sys.modules["probe_jit"] = jit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(jit)
    sys.path.insert(0, {folder!r})
    import probe_fn
    value = probe_fn.answer(1)
    stats = probe_fn.answer.stats
    print(json.dumps({{"value": value, "hits": sum(stats.cache_hits.values()),
                      "misses": sum(stats.cache_misses.values())}}))
    """
)


def _probe(tmp_path: Path, source: str | None = None) -> dict:
    """Run the probe in a new process; ``source`` rewrites the probe module first."""
    probe = tmp_path / "probe_fn.py"
    if source is not None:
        probe.write_text(source)
    script = PROBE.format(jit=str(JIT_FILE), folder=str(tmp_path))
    env = _env(tmp_path / "cache", PYTHONDONTWRITEBYTECODE="1")
    return run_python(script, env=env, timeout=120).json()


def test_cache_is_never_stale_even_with_the_same_size_and_mtime(tmp_path):
    """An upgrade may keep a file's size and modification time (wheels carry fixed timestamps): the
    cache index is keyed on the source's content."""
    old = "from probe_jit import njit\n\n@njit()\ndef answer(x):\n    return x + 1\n"
    # The same size and bytecode: only a constant differs.
    new = "from probe_jit import njit\n\n@njit()\ndef answer(x):\n    return x + 7\n"
    assert len(old) == len(new)
    assert _probe(tmp_path, old) == {"value": 2, "hits": 0, "misses": 1}
    assert _probe(tmp_path, old) == {"value": 2, "hits": 1, "misses": 0}
    probe = tmp_path / "probe_fn.py"
    stamp = os.stat(probe)
    probe.write_text(new)
    os.utime(probe, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert os.stat(probe).st_mtime_ns == stamp.st_mtime_ns and os.stat(probe).st_size == stamp.st_size
    assert _probe(tmp_path) == {"value": 8, "hits": 0, "misses": 1}


def test_a_truncated_cache_index_is_a_miss_and_is_replaced(tmp_path):
    """An index left empty (a crash, a full disk) made numba's save, after every miss, raise EOFError in
    every later process until the file was deleted by hand."""
    source = "from probe_jit import njit\n\n@njit()\ndef answer(x):\n    return x + 1\n"
    assert _probe(tmp_path, source) == {"value": 2, "hits": 0, "misses": 1}
    indexes = list((tmp_path / "cache").rglob("*.nbi"))
    assert indexes
    for index in indexes:
        index.write_bytes(b"")
    assert _probe(tmp_path) == {"value": 2, "hits": 0, "misses": 1}
    assert _probe(tmp_path) == {"value": 2, "hits": 1, "misses": 0}  # (a fresh index was written)


def test_no_writable_cache_location_compiles_in_memory(tmp_path, monkeypatch):
    """A read-only install with no writable cache directory: the functions compile in memory."""
    import numba

    from bsrkit.backends.cpu.compiled import support

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(blocker / "cache"), raising=False)  # not creatable
    monkeypatch.setattr(numba.config, "CACHE_LOCATOR_CLASSES", "UserProvidedCacheLocator", raising=False)
    probe = tmp_path / "probe_in_memory.py"
    probe.write_text("def answer(x):\n    return x * 3\n")
    namespace: dict = {"__file__": str(probe)}
    exec(compile(probe.read_text(), str(probe), "exec"), namespace)
    dispatcher = support.njit()(namespace["answer"])
    assert dispatcher(2) == 6
    assert dispatcher.stats.cache_path is None
    assert not (blocker.parent / "cache").exists()


def test_one_compiled_signature_per_kernel():
    """Every call reaches the kernels with the same argument types (a second signature would mean a
    second compile and a second cache entry), whatever the operands' layouts."""
    from bsrkit.backends.cpu.compiled import entries as _jit

    torch.manual_seed(1)
    bsr = torch.randn(2, 32, 32).to_sparse_bsr((8, 8))
    dense = torch.randn(32, 20)
    bsrkit.bsr_dense_mm(bsr, dense)  # batched bsr, broadcast dense, alpha a float
    bsrkit.bsr_dense_addmm(torch.zeros(32, 20), bsr[0], dense.t().contiguous().t(), alpha=2)  # int alpha
    mat1 = torch.randn(32, 4).expand(2, 32, 4)  # a stride-0 batch: rows/cols come in non-contiguous
    bsrkit.sampled_addmm(bsr, mat1, torch.randn(4, 32), alpha=3)
    bsrkit.sampled_addmm(bsr[0], torch.randn(32, 4), torch.randn(4, 32))
    for fmt in ("bsr_strided_mm_compressed", "bsr_strided_mm", "scatter_mm"):  # 2-D, batched, tiled views
        for other in (dense[:, :16], torch.randn(2, 16, 32).mT):
            data = bsrkit.bsr_scatter_mm_indices_data(bsr[0], other, indices_format=fmt)
            bsrkit.bsr_scatter_mm(bsr[0], other, data)
    pq = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    bsrkit.scatter_mm(
        torch.randn(2, 4, 4), torch.randn(2, 4, 3).mT.mT, ("scatter_mm", torch.tensor([0, 2]), pq)
    )
    bsrkit.bsr_dense_mm(bsr, dense[:, :8])  # the vector loops (few columns)
    # (products this small run the serial twins, bsr @ dense's behind their C entries; the parallel loops
    # share their argument lists)
    serial = (_jit.bsr_mm_serial, _jit.bsr_mm_small_serial, _jit.sampled_serial, _jit.scatter_mm_serial)
    for kernel in serial:
        assert len(kernel.signatures) == 1, kernel.signatures
    assert max(len(k.signatures) for k in (_jit.bsr_mm, _jit.sampled, _jit.scatter_mm)) <= 1
    info = kernels.compile_cache_info()
    for name in ("bsr_mm_serial", "bsr_mm_small_serial"):
        assert info[name]["hits"] + info[name]["misses"] == 1, info[name]


def test_packed_entry_checks_what_it_packs():
    """The C entries read arrays by address: pack() refuses what they could not read."""
    import numpy as np

    from bsrkit.backends.cpu.compiled import entries

    entry = entries.bsr_mm_small_serial
    made = {"1": np.zeros(1, np.int64), "2": np.zeros((1, 2), np.int64), "F": np.zeros((1, 2))}
    args = [made.get(kind, 1) for kind in entry.kinds]
    assert entry.pack(args).shape == (29 * entries.SLOTS,)
    with pytest.raises(TypeError, match="expected 29 arguments"):
        entry.pack(args[:-1])
    strided, single = np.zeros((2, 2), np.int64)[:, :1], np.zeros((1, 2), np.float32)
    for i, bad in ((1, strided), (3, single), (4, np.zeros(1)), (7, 5)):
        with pytest.raises(TypeError, match=f"argument {i}"):
            entry.pack([*args[:i], bad, *args[i + 1 :]])


STORM = textwrap.dedent(
    """
    import json, os, random, signal, sys, threading, time, warnings
    warnings.filterwarnings("ignore")
    import torch
    import bsrkit

    rng = random.Random(int(sys.argv[1]))
    torch.manual_seed(0)
    w = torch.randn(64, 48) * (torch.rand(4, 3) < 0.6).repeat_interleave(16, 0).repeat_interleave(16, 1)
    bsr = w.to_sparse_bsr((16, 16))
    x, mat1, mat2 = torch.randn(48, 24), torch.randn(64, 8), torch.randn(8, 48)

    def products():
        bsrkit.bsr_dense_mm(bsr, x)
        bsrkit.sampled_addmm(bsr, mat1, mat2)
        bsrkit.bsr_softmax(bsr)

    end = time.monotonic() + float(sys.argv[2])
    in_loop = threading.Event()

    def storm():  # Ctrl-C every 0.2-3 ms while the main thread runs its first (cold) products
        in_loop.wait()
        while time.monotonic() < end - 0.5:  # (the last signal lands well before the main loop ends)
            time.sleep(rng.uniform(0.0002, 0.003))
            os.kill(os.getpid(), signal.SIGINT)

    def worker():  # another thread's products during the storm (signals never land there)
        while time.monotonic() < end:
            products()

    # Ctrl-C raises KeyboardInterrupt wherever the main thread is inside the loop below, as Python's own
    # handler does; outside it (this script's own bookkeeping) it is ignored, so the script survives.
    guarded = [False]

    def on_sigint(signum, frame):
        if guarded[0]:
            guarded[0] = False
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    threading.Thread(target=worker, daemon=True).start()
    threading.Thread(target=storm, daemon=True).start()
    interrupts = 0
    while True:
        try:
            guarded[0] = True
            in_loop.set()
            while time.monotonic() < end:
                products()
            guarded[0] = False
            break
        except KeyboardInterrupt:
            interrupts += 1
    # After the storm a product on a fresh thread must finish: a module lock left held would hang it.
    result = {}
    check = lambda: result.setdefault("err", float((bsrkit.bsr_dense_mm(bsr, x) - w @ x).abs().max()))
    t = threading.Thread(target=check)
    t.start()
    t.join(60)
    print(json.dumps({"interrupts": interrupts, "hung": t.is_alive(), "err": result.get("err")}))
    sys.stdout.flush()
    os._exit(0)
    """
)


@pytest.mark.parametrize("seed", [1, 2])
def test_ctrl_c_storm_during_the_cold_first_products_leaves_nothing_hung(tmp_path, seed):
    """SIGINTs every 0.2-3 ms while the first products import and load (or compile) the loops from an
    empty cache, another thread multiplying too: afterwards a product on a new thread finishes and is
    right. Before bsrkit.loading (first imports and compiles off the main thread), 3 of 6 such storms
    hung for ever (a module lock, then llvmlite's lock, left held); after it, 12 of 12 finished."""
    report = run_python(["-c", STORM, seed, "6"], env=_env(tmp_path / "numba-cache"), timeout=240).json()
    assert report["interrupts"] > 10 and not report["hung"] and report["err"] < 1e-4, report
