"""benchmarks/step_order.py --quick end to end: every configuration timed after each
predecessor, one table row each with a ratio that is the two medians' quotient; a second
run appends to the record rather than overwriting it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "step_order.py"


def test_each_configuration_is_timed_after_both_predecessors_and_runs_append(
        tmp_path: Path) -> None:
    out = tmp_path / "so.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text.count("# A step's time after the step before it") == 1
    assert text.count("## Run of") == 2
    rows = re.findall(r"^\| (none|per-layer|sel-nothing|sel-matmuls) \| ([\d.]+) \| ([\d.]+) "
                      r"\| ([\d.]+) \|$", text, flags=re.M)
    assert sorted(r[0] for r in rows) == sorted(
        ["none", "per-layer", "sel-nothing", "sel-matmuls"] * 2)
    for _, after_none, after_nothing, ratio in rows:
        assert float(after_none) > 0 and float(after_nothing) > 0
        # printed to 3 places: the quotient of the printed medians within rounding
        assert float(ratio) == pytest.approx(float(after_nothing) / float(after_none),
                                             abs=0.07)
