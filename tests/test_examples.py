"""The examples run, at a tiny size, each in a process of its own under a time limit (their figures are
docs/performance.md's, taken at full size)."""

from pathlib import Path

import pytest

from helpers import run_python

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_prune_finetune_runs_every_stage_at_a_tiny_size():
    argv = [
        str(EXAMPLES / "prune_finetune.py"), "--dim", "32", "--layers", "1", "--heads", "2", "--context",
        "32", "--batch", "4", "--blocksize", "16", "--densities", "0.25", "--dense-steps", "3",
        "--finetune-steps", "4", "--data-bytes", "20000", "--threads", "1", "--rigl", "0.3",
        "--compare-masked-dense",
    ]  # fmt: skip
    out = run_python(argv, timeout=600).stdout
    assert "the baseline" in out and "0.25 masked" in out, out


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_train_ddp_runs_as_one_process(wrapper):
    """(Without torchrun: a process group of one on an in-process store; it took a fixed port.)"""
    argv = [
        str(EXAMPLES / "train_ddp.py"), "--wrapper", wrapper, "--steps", "3", "--global-batch", "8",
        "--features", "32", "--hidden", "32", "--print-every", "1",
    ]  # fmt: skip
    out = run_python(argv, timeout=600).stdout
    assert f"{wrapper} on 1 rank(s)" in out and "ms/step" in out, out
