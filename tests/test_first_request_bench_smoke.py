"""CPU smoke test of benchmarks/first_request.py on the embedded tiny model: the warm-up and
every planned request ran with audio, each with its stall counts, and the ratios written."""

from __future__ import annotations

import json
import subprocess
import sys


def test_every_request_measured(tmp_path):
    out = tmp_path / "first.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.first_request", "--max-tokens",
                           "4", "--codes", "16", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["warmup_s"] > 0
    phases = ["same_0", "same_1", "same_2", "other_0", "other_0_again", "other_1",
              "other_1_again"]
    for phase in phases:
        row = result[phase]
        assert row["audio_s"] > 0 and row["text_tokens"] == 4, (phase, row)
        assert row["ttfa"] > row["ttft"] > 0, (phase, row)
        assert isinstance(row["events"], dict) and isinstance(row["dynamo"], dict)
    assert result["first_over_warm_ttfa"] > 0
    # on the CPU nothing is captured or JIT-compiled after the load
    assert result["events_after_load"] == []


def test_bad_lengths_are_named():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.first_request", "--codes", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--codes" in proc.stderr
