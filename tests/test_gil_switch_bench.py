"""benchmarks/gil_switch.py runs (a short smoke run: its output's shape, no timing claims)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_gil_switch_benchmark_smoke(tmp_path):
    out = tmp_path / "gil.json"
    subprocess.run([sys.executable, "-m", "benchmarks.gil_switch", "--steps", "10",
                    "--gpu-ms", "1", "--burst-ms", "2", "--period-ms", "4", "--repeats", "1",
                    "--out", str(out)], check=True, capture_output=True, timeout=120)
    result = json.loads(out.read_text())
    assert result["ideal_step_ms"] > 1.0  # the step's GIL-free wait alone is 1 ms
    assert set(result["intervals"]) == {"5ms", "0.5ms"}
    assert all(r["step_ms"] > 0 and r["steps_per_s"] > 0 for r in result["intervals"].values())
