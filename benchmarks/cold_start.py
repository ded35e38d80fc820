"""Cold start: time from ``import bsrkit`` to the end of the first two products, in fresh processes.

Runs ``--processes`` interpreters one after another on one numba cache directory (a new temporary one by
default, so the first process compiles and the later ones load the compiled kernels), each doing one
``bsr_dense_mm`` and one ``sampled_addmm`` (float32, 512 x 512, blocksize 32, density 0.25). Prints, per
process: the import time (torch included), each first product, the total, and whether each kernel was
compiled or loaded from the cache (numba's cache statistics).

    .venv/bin/python benchmarks/cold_start.py [--processes 3] [--cache-dir DIR] [--src DIR]

``--src`` puts another checkout's ``src`` first on the path (to compare with an older version).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import time
t0 = time.perf_counter()
import bsrkit
t1 = time.perf_counter()
import json, warnings
import torch
warnings.filterwarnings("ignore")
torch.manual_seed(0)
w = torch.randn(512, 512) * (torch.rand(16, 16) < 0.25).repeat_interleave(32, 0).repeat_interleave(32, 1)
bsr = w.to_sparse_bsr((32, 32))
x, mat1, mat2 = torch.randn(512, 256), torch.randn(512, 64), torch.randn(64, 512)
t2 = time.perf_counter()
bsrkit.bsr_dense_mm(bsr, x)
t3 = time.perf_counter()
bsrkit.sampled_addmm(bsr, mat1, mat2)
t4 = time.perf_counter()
try:
    from bsrkit.backends.cpu import kernels
    cache = kernels.compile_cache_info()
    layer = kernels.threading_layer()
except (ImportError, AttributeError):
    cache, layer = {}, None
print(json.dumps({"import": t1 - t0, "mm": t3 - t2, "sampled": t4 - t3, "total": t4 - t0 - (t2 - t1),
                  "cache": cache, "layer": layer}))
"""


def _state(counts: dict) -> str:
    """A kernel's cache counts as what happened to it in that process (hits=misses=0: it was not used)."""
    if counts["hits"]:
        return "loaded"
    return "compiled" if counts["misses"] else "not used"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--cache-dir", help="numba cache directory (default: a new temporary one)")
    ap.add_argument("--src", help="a checkout's src directory to import bsrkit from")
    args = ap.parse_args()
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="bsrkit-cold-start-")
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    src = args.src or str(Path(__file__).parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    print(f"numba cache: {cache_dir}; bsrkit from {src}")
    print("import = `import bsrkit` (torch included); products = first bsr_dense_mm + first sampled_addmm")
    header = f"{'process':>7} | {'import s':>8} {'mm s':>6} {'sampled s':>9} | {'total s':>7} | kernels"
    print(header)
    print("-" * len(header))
    for i in range(args.processes):
        done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(done.stderr)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        how = ", ".join(
            f"{name} {_state(c)}{'' if c['path'] else ' (in memory)'}" for name, c in r["cache"].items()
        )
        print(
            f"{i + 1:>7} | {r['import']:>8.2f} {r['mm']:>6.2f} {r['sampled']:>9.2f} | {r['total']:>7.2f} | "
            f"{how or 'n/a'} [{r['layer']}]",
            flush=True,
        )


if __name__ == "__main__":
    main()
