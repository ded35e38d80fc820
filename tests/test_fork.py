"""Products in processes forked after a product: a bare ``os.fork()`` child and a ``multiprocessing`` fork
pool (the default start method on Linux, so ``DataLoader`` workers too). Each scenario runs in its own
interpreter under a hard time limit, since the failure modes are a killed child and a hung pool.

The children run torch single-threaded, as ``DataLoader`` workers do: torch's own GNU OpenMP pool hangs in
a child forked after the parent used it, whatever bsrkit does. bsrkit's compiled loops run their serial
twins in a forked child (GNU OpenMP cannot start threads there); softmax uses torch primitives.
"""

from __future__ import annotations

import os
import textwrap

import pytest

from helpers import run_python

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

SCRIPT = textwrap.dedent(
    """
    import json, multiprocessing, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    import bsrkit
    from bsrkit.backends.cpu import kernels

    torch.manual_seed(0)
    block_mask = torch.rand(6, 4) < 0.5
    block_mask[2] = False  # an empty block row
    pattern = block_mask.repeat_interleave(16, 0).repeat_interleave(16, 1).float()
    dense_w = torch.randn(96, 64) * pattern
    bsr = dense_w.to_sparse_bsr((16, 16))
    x = torch.randn(64, 40)
    mat1, mat2 = torch.randn(96, 8), torch.randn(8, 64)
    ref_mm = dense_w @ x  # references computed before any fork
    # Stored blocks of mat1 @ mat2, in BSR order. No torch op in the children may open a parallel region:
    # torch's own GNU OpenMP pool hangs in a child forked after the parent used it (to_dense would).
    ref_sampled = (mat1 @ mat2).reshape(6, 16, 4, 16).transpose(1, 2)[block_mask]
    ref_softmax = bsrkit.bsr_softmax(bsr).values()  # the parent's compiled loop

    def errors(scale):
        mm = bsrkit.bsr_dense_mm(bsr, x * scale)
        sampled = bsrkit.sampled_addmm(bsr, mat1 * scale, mat2, beta=0.0).values()
        soft = bsrkit.bsr_softmax(bsr).values()
        return [float((mm - ref_mm * scale).abs().max()), float((sampled - ref_sampled * scale).abs().max()),
                float((soft - ref_softmax).abs().max())]

    report = {"parent": errors(1.0), "layer": kernels.threading_layer()}
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        torch.set_num_threads(1)  # as DataLoader workers do: torch's own OpenMP pool hangs in a child
        try:
            message = json.dumps({"child": errors(2.0)})
        except BaseException as e:
            message = json.dumps({"child_error": f"{type(e).__name__}: {e}"})
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    report["child_status"] = status
    report.update(json.loads(b"".join(chunks) or b"{}"))
    if "child" in report:
        with multiprocessing.get_context("fork").Pool(2, torch.set_num_threads, (1,)) as pool:
            report["pool"] = pool.map(errors, [1.0, 3.0, -1.0])
    print(json.dumps(report))
    """
)


def _run(env_extra: dict[str, str], timeout: float = 120) -> dict:
    return run_python(SCRIPT, env={"NUMBA_THREADING_LAYER": None, **env_extra}, timeout=timeout).json()


def _assert_close(errors: list[float]) -> None:
    assert all(e < 1e-3 for e in errors), errors


def test_products_after_fork_in_child_and_fork_pool():
    """numba's default layer (GNU OpenMP here) cannot start threads in a forked child: the kernels run
    their serial twins there (and softmax the torch primitives), instead of the child being killed."""
    report = _run({})
    assert report["layer"] in ("omp", "tbb", "workqueue"), report
    _assert_close(report["parent"])
    assert report["child_status"] == 0, report
    assert "child" in report, report
    _assert_close(report["child"])
    assert len(report["pool"]) == 3
    for errors in report["pool"]:
        _assert_close(errors)


@pytest.mark.parametrize("layer", ["workqueue", "omp"])
def test_a_users_explicit_layer_is_respected_and_children_still_work(layer):
    report = _run({"NUMBA_THREADING_LAYER": layer})
    assert report["layer"] == layer, report
    _assert_close(report["parent"])
    assert report["child_status"] == 0, report
    _assert_close(report["child"])
    for errors in report["pool"]:
        _assert_close(errors)


THREADS_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    import bsrkit
    from bsrkit.benchmarking import random_bsr_weight

    torch.set_num_threads(int(sys.argv[1]))
    seen = [torch.get_num_threads()]
    bsr, w = random_bsr_weight(512, 32, 0.25, seed=0)
    x = torch.randn(512, 512)
    for meta in (None, {"nthreads": 2}, {"nthreads": 1}):  # the serial loop, then a parallel region
        assert torch.allclose(bsrkit.bsr_dense_mm(bsr, x, meta=meta), w @ x, atol=1e-3, rtol=1e-4)
        seen.append(torch.get_num_threads())
    bsrkit.sampled_addmm(bsr, x, x)
    seen.append(torch.get_num_threads())
    print(json.dumps(seen))
    """
)


@pytest.mark.parametrize("threads", [1, 2])
def test_products_keep_torchs_thread_count(threads):
    """numba's OpenMP pool and torch share libgomp, and starting the pool sets the process-wide thread
    count to NUMBA_NUM_THREADS: a user's torch.set_num_threads(1) must survive the first product."""
    env = {"NUMBA_THREADING_LAYER": None, "NUMBA_NUM_THREADS": "2"}
    assert run_python(["-c", THREADS_SCRIPT, threads], env=env, timeout=120).json() == [threads] * 5


FORK_DURING_A_PRODUCT = textwrap.dedent(
    """
    import json, os, threading, time, warnings
    warnings.filterwarnings("ignore")
    import torch
    import bsrkit

    torch.set_num_threads(1)
    b = torch.randn(256, 256, dtype=torch.float64).to_sparse_bsr((32, 32))
    d = torch.randn(256, 16, dtype=torch.float64)
    want = b.to_dense() @ d
    bsrkit.bsr_dense_mm(b, d)
    stop = False

    def spin():  # another thread inside products (and the cache's locks) when the fork comes
        while not stop:
            bsrkit.bsr_dense_mm(b, torch.randn(256, 16, dtype=torch.float64))

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    time.sleep(0.2)
    hung = wrong = 0
    for _ in range(8):
        pid = os.fork()
        if pid == 0:
            ok = bool(torch.allclose(bsrkit.bsr_dense_mm(b, d), want))
            os._exit(0 if ok else 1)
        for _ in range(100):  # (10 s)
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                wrong += status != 0
                break
            time.sleep(0.1)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            hung += 1
    stop = True
    thread.join()
    print(json.dumps({"hung": hung, "wrong": wrong}))
    """
)


def test_a_child_forked_while_another_thread_runs_a_product():
    """The child has only the forking thread: the kernel lock (and the caches' locks) another thread held
    at the fork stayed held, and the child's first product hung (2-4 of 5 children)."""
    report = run_python(FORK_DURING_A_PRODUCT, env={"OMP_NUM_THREADS": "1"}, timeout=180).json()
    assert report == {"hung": 0, "wrong": 0}
