"""Smoke test of an installed bsrkit wheel, run by `./dev wheel` from a folder outside the source tree."""

import pathlib
import sys

import torch

import bsrkit
from bsrkit import reference

here = pathlib.Path(bsrkit.__file__).resolve().parent
assert "site-packages" in here.parts, f"bsrkit imported from {here}, not from the installed wheel"
assert (here / "py.typed").is_file(), "the wheel ships no py.typed"
assert list((here / "tuned").glob("*.json")), "the wheel ships no tuned tables"
mask = (torch.rand(8, 8, generator=torch.Generator().manual_seed(0)) < 0.3).repeat_interleave(16, 0)
dense_w = torch.randn(128, 128) * mask.repeat_interleave(16, 1)
bsr = dense_w.to_sparse_bsr((16, 16))
x = torch.randn(128, 40)
reference.assert_close(bsrkit.bsr_dense_mm(bsr, x), reference.bsr_dense_mm(bsr, x), k=128)
# A sparsified model's checkpoint round trip, with only what the wheel's metadata installs (safetensors).
model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
bsrkit.sparsify_(model, blocksize=16, density=0.25, force=True)
bsrkit.save_sparse(model, "sparse.safetensors")
loaded = bsrkit.load_sparse(
    lambda: torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)),
    "sparse.safetensors",
)
h = torch.randn(4, 128)
reference.assert_close(loaded(h), model(h), k=128)
versions = f"bsrkit {bsrkit.__version__}, torch {torch.__version__}, python {sys.version.split()[0]}"
print(f"wheel smoke test: {versions}, from {here}: OK")
