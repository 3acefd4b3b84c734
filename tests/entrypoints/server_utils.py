"""Start a real `omnistage serve` subprocess on 127.0.0.1 (free port) and talk to it."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import soundfile
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

MODEL_NAME = "tiny-omni"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: Path, log_path: Path, *args: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "omnistage.entrypoints.cli", "serve", str(model),
               "--device", "cpu", "--port", str(self.port), "--served-model-name", MODEL_NAME,
               "--max-model-len", "2048", "--num-kv-blocks", "2048",
               "--max-audio-seconds", "30", *args]
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 120.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()[-6000:]

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@contextlib.contextmanager
def running_server(model: Path, log_path: Path, *args: str) -> Iterator[ServerProcess]:
    """A ready server for the block; it must stop cleanly (exit 0) after it."""
    srv = ServerProcess(model, log_path, *args)
    try:
        yield srv.wait_ready()
    finally:
        assert srv.stop() == 0, srv.log()


def openai_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def read_wav(data: bytes) -> tuple[np.ndarray, int]:
    """Encoded audio -> (int16 samples, sample rate)."""
    return soundfile.read(io.BytesIO(data), dtype="int16")


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    text = httpx.get(url + "/metrics", timeout=5.0).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


class ThreadServer:
    """uvicorn serving `app` on a free port from a background thread of this process (tests
    that steer the pipeline with monkeypatch)."""

    def __init__(self, app) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
