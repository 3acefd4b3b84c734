"""sse(): an audio chunk's base64 spliced into the event's JSON text gives the event json.dumps
would give with the data in place, whatever the other fields hold."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from benchmarks.sse_encode import chunk
from omnistage.entrypoints.openai.serving import sse, to_pcm16


@pytest.mark.parametrize("model", ["bench", 'x"data":""', '"data":"', "d\u00e4t\u00e4 \\ \n"])
def test_spliced_audio_equals_json(model):
    wave = np.sin(np.linspace(0, 40, 4800, dtype=np.float32)) * 0.5
    data = base64.b64encode(to_pcm16(wave).tobytes()).decode()
    spliced = sse(chunk("", model), data)
    assert spliced == sse(chunk(data, model))
    body = json.loads(spliced.removeprefix("data: "))
    assert body["model"] == model
    assert base64.b64decode(body["choices"][0]["delta"]["audio"]["data"]) == \
        to_pcm16(wave).tobytes()


def test_plain_events_unchanged():
    assert sse("[DONE]") == "data: [DONE]\n\n"
    assert sse({"a": 1, "data": ""}) == 'data: {"a":1,"data":""}\n\n'


def test_benchmark_runs(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "sse.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.sse_encode", "--seconds", "0.1,0.5",
                           "--repeats", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["chunk_seconds"] for r in rows] == [0.1, 0.5]
    assert all(r["json_scanned_us"] > 0 and r["spliced_us"] > 0 for r in rows)
