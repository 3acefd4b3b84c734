"""CPU smoke test of benchmarks/serving.py, the headline benchmark: the server over HTTP and
the engine in-process on the embedded tiny model, every request of each level completed on
both sides, the per-level numbers and the server-over-engine ratios written."""

from __future__ import annotations

import json
import subprocess
import sys


def run(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.serving", "--concurrency", "1,2",
                           "--max-tokens", "4", "--codes", "16", "--warmup-rounds", "0",
                           "--server-log", str(tmp_path / "server.log"), *extra],
                          capture_output=True, text=True, timeout=300)


def test_both_sides_serve_every_request(tmp_path):
    out = tmp_path / "serving.json"
    proc = run(tmp_path, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    for side in ("server", "engine"):
        for level, n in (("c1", 1), ("c2", 2)):
            row = result[side][level]
            assert row["completed"] == n and row["errors"] == 0, (side, level, row)
            assert row["audio_seconds"] > 0 and row["ttfa_p50"] > 0, (side, level, row)
            assert row["runtime_ttft_mean"] is not None, (side, level, row)
        assert result[side]["first_request"]["audio_s"] > 0
    assert result["server"]["startup_to_health_s"] > 0
    assert result["server"]["c2"]["server_ttfa_mean"] is not None  # from the server's /metrics
    assert set(result["server_over_engine"]["c2"]) >= {"ttfa_p50", "audio_seconds_per_second"}


def test_a_missing_py_spy_is_named(tmp_path):
    proc = run(tmp_path, "--py-spy", str(tmp_path / "stacks"), "--py-spy-exe",
               str(tmp_path / "no-such-py-spy"))
    assert proc.returncode == 2
    assert "--py-spy-exe" in proc.stderr
