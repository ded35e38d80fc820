import os
import sys
import tempfile
from pathlib import Path

# Tests never read or write the user's tuning table.
os.environ["BSRKIT_TUNING_TABLE"] = str(Path(tempfile.mkdtemp(prefix="bsrkit-tests-")) / "tuning.json")
sys.path.insert(0, os.path.dirname(__file__))
