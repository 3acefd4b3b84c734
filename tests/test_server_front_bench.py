"""CPU smoke test of benchmarks/server_front.py: a burst of streamed chat requests through the
ASGI app and the same burst through AsyncOmniLLM.start(), each side's ingestion, first event,
event-loop CPU per request and wall time written, and the server-over-engine ratios."""

from __future__ import annotations

import json
import subprocess
import sys

KEYS = ("ingestion_ms", "first_event_p50_ms", "loop_cpu_ms_per_request", "wall_ms")


def test_both_sides_measured(tmp_path):
    out = tmp_path / "front.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.server_front", "--requests", "4",
                           "--rounds", "2", "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    for side in ("server_app", "fastapi_routes", "engine"):
        assert len(result[side]["rounds"]) == 2
        for key in KEYS:
            assert result[side][key] > 0, (side, key)
        # (a request's first bytes wait for its first token, which follows its start)
        assert result[side]["first_event_p50_ms"] > result[side]["ingestion_ms"] / 4, side
    for ratio in ("server_over_engine", "server_over_fastapi_routes"):
        assert set(result[ratio]) == set(KEYS)
    assert result["config"]["switch_interval_ms"] == 0.5


def test_bad_arguments_are_named():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.server_front", "--requests", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--requests: 1..256" in proc.stderr
