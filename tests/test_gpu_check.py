"""The prepared GPU run (benchmarks/gpu_check.py) on CPU: its --dry-run exercises every section in Triton's
interpreter on a tiny grid, so the script a device session runs once is known to work before it does."""

import json
from pathlib import Path

import pytest

from helpers import run_python

pytest.importorskip("triton")
pytestmark = pytest.mark.triton

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # (two minutes: the whole prepared GPU run in the interpreter)
def test_dry_run_checks_tunes_and_times(tmp_path):
    run_python(
        [ROOT / "benchmarks" / "gpu_check.py", "--dry-run", "--out", tmp_path],
        env={"BSRKIT_TUNING_TABLE": str(tmp_path / "t.json")},
        timeout=600,
    )
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
