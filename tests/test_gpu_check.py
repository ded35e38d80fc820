"""The prepared GPU run (benchmarks/gpu_check.py) on CPU: its --dry-run exercises every section in Triton's
interpreter on a tiny grid, so the script a device session runs once is known to work before it does."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.triton

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_checks_tunes_and_times(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "BSRKIT_TUNING_TABLE": str(tmp_path / "t.json")}
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["failures"] == []
    assert results["environment"]["torch"]
    assert results["tune"] and results["speed"] and results["attention"]
    table = json.loads((tmp_path / "tuned.json").read_text())
    assert table["format"] == "bsrkit-tuning" and table["entries"]
    assert all(
        row["max_abs_err_vs_flex"] < 1e-4 for row in results["attention"] if "max_abs_err_vs_flex" in row
    )
    assert "correctness failures: 0" in (tmp_path / "gpu_check.log").read_text()
