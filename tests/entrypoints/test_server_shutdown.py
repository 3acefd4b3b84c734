"""Shutdown with requests that outlive --shutdown-timeout (issue 24, defect 4): a real
`omnistage serve` subprocess whose talker must speak 1500 codes (min_tokens in a pipeline YAML
of the test's own), so every request is still running when the drain ends. On SIGTERM each SSE
stream ends with an error event `shutting_down` and `data: [DONE]`, a raw pcm body ends cleanly,
a request whose response has not started gets a 503, the log names the shutdown (not a client
disconnect), and the process stops in order and exits 0."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from importlib import resources
from pathlib import Path

import httpx
import pytest
import yaml

from tests.entrypoints.server_utils import MODEL_NAME, ServerProcess

SHUTDOWN_TIMEOUT_S = 1.0
EXIT_WITHIN_S = SHUTDOWN_TIMEOUT_S + 8.0  # drain, end the streams, stop the engine
TALKER_CODES = 1500  # 30 s of audio: many seconds of work on CPU, so no request ends by itself
SPEECH = {"model": MODEL_NAME, "input": "Hello there", "voice": "Chelsie", "seed": 0}
CHAT_AUDIO = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
              "max_tokens": 8, "seed": 0, "stream": True, "modalities": ["text", "audio"],
              "audio": {"voice": "Ethan", "format": "pcm16"}}


@pytest.fixture
def slow_pipeline(tmp_path) -> Path:
    """The built-in Qwen2.5-Omni pipeline whose talker never stops before TALKER_CODES."""
    builtin = resources.files("omnistage") / "config" / "pipelines" / "qwen2_5_omni.yaml"
    spec = yaml.safe_load(builtin.read_text())
    talker = next(s for s in spec["stages"] if s["name"] == "talker")
    talker["default_sampling"].update(min_tokens=TALKER_CODES, max_tokens=TALKER_CODES)
    path = tmp_path / "slow_qwen2_5_omni.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


class _Client(threading.Thread):
    """One request, read to its end in a thread: status, X-Request-Id, SSE data lines (or raw
    bytes), and the transport error if the body was cut."""

    def __init__(self, url: str, path: str, body: dict, sse: bool) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.body, self.sse = url + path, path, body, sse
        self.status: int | None = None
        self.rid = ""
        self.events: list[str] = []
        self.raw = b""
        self.error: Exception | None = None
        self.started = threading.Event()  # the status line (and a first body part) came

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=120) as r:
                self.status, self.rid = r.status_code, r.headers.get("x-request-id", "")
                if self.sse:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            self.events.append(line[len("data: "):])
                            self.started.set()
                else:
                    for chunk in r.iter_bytes():
                        self.raw += chunk
                        self.started.set()
        except httpx.HTTPError as e:
            self.error = e
        finally:
            self.started.set()


@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_sigterm_ends_streams_that_outlive_the_drain(tiny_omni_dir, slow_pipeline, tmp_path,
                                                     engine_process):
    srv = ServerProcess(tiny_omni_dir, tmp_path / "server.log", "--pipeline", str(slow_pipeline),
                        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
                        *(["--engine-process"] if engine_process == "on" else []))
    try:
        srv.wait_ready()
        streams = [
            _Client(srv.url, "/v1/chat/completions", CHAT_AUDIO, sse=True),
            _Client(srv.url, "/v1/audio/speech", {**SPEECH, "stream_format": "sse",
                                                  "response_format": "pcm"}, sse=True),
            _Client(srv.url, "/v1/audio/speech", {**SPEECH, "response_format": "pcm"}, sse=False),
        ]
        whole = _Client(srv.url, "/v1/audio/speech", {**SPEECH, "response_format": "wav"},
                        sse=False)  # its response starts only when its audio is done
        for c in [*streams, whole]:
            c.start()
        for c in streams:
            assert c.started.wait(60), srv.log()
            assert c.status == 200 and c.error is None, (c.path, c.status, c.error, srv.log())
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(EXIT_WITHIN_S + 30)
        took = time.monotonic() - t0
        for c in [*streams, whole]:
            c.join(10)
        log = (tmp_path / "server.log").read_text()
    finally:
        srv.stop()

    assert rc == 0, log
    assert took < EXIT_WITHIN_S, f"exited {took:.1f} s after SIGTERM\n{log}"
    for c in streams:
        assert not c.is_alive() and c.error is None, (c.path, c.error)  # bodies ended cleanly
    for c in streams[:2]:  # SSE: ... an error event, then [DONE]
        assert c.events[-1] == "[DONE]", c.events[-3:]
        error = json.loads(c.events[-2])["error"]
        assert error["code"] == "shutting_down" and error["type"] == "server_error", error
        assert "shutting down" in error["message"]
        assert len(c.events) > 2  # audio went out before the shutdown cut it
    assert len(streams[2].raw) > 0 and len(streams[2].raw) % 2 == 0  # whole int16 samples
    assert whole.status == 503 and whole.error is None
    assert json.loads(whole.raw)["error"]["code"] == "shutting_down"

    assert "Event loop is closed" not in log and "Traceback" not in log, log
    assert "client disconnected" not in log, log
    for c in [*streams, whole]:
        lines = [line for line in log.splitlines() if c.rid in line]
        assert any(re.search(r"aborted .*the server is shutting down", line) for line in lines), \
            (c.rid, lines)
    # in order: the drain ends the requests, then the engine stops, then the server
    order = [log.index(s) for s in ("still running after the", "engine stopped",
                                    "Finished server process", "omnistage.server: stopped")]
    assert order == sorted(order), log
