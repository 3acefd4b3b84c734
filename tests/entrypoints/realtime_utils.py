"""Shared by the realtime tests: an in-process server on the tiny omni model, espeak-ng clips as
pcm16 24 kHz, and a WebSocket client that checks every server event against the `openai`
SDK's own Realtime event models."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import soundfile
import websockets
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter

from omnistage.entrypoints.async_llm import AsyncOmniLLM
from omnistage.entrypoints.openai.server import build_app
from omnistage.entrypoints.openai.serving import ServerConfig
from omnistage.models.qwen2_5_omni.media import resample
from tests.entrypoints.server_utils import MODEL_NAME, ThreadServer

SERVER_EVENT = TypeAdapter(RealtimeServerEvent)
RATE = 24000
# OpenAI's order of a response's frame events (deltas come between the two halves)
RESPONSE_HEAD = ["response.created", "response.output_item.added", "conversation.item.added",
                 "response.content_part.added"]
AUDIO_TAIL = ["response.output_audio.done", "response.output_audio_transcript.done",
              "response.content_part.done", "response.output_item.done",
              "conversation.item.done", "response.done"]
AUDIO_DELTAS = {"response.output_audio.delta", "response.output_audio_transcript.delta"}


def speak(text: str) -> np.ndarray:
    """espeak-ng's voice for `text` as int16 at 24 kHz."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install -y espeak-ng)")
    wav = subprocess.run(["espeak-ng", "--stdout", text], capture_output=True,
                         check=True).stdout
    x, sr = soundfile.read(io.BytesIO(wav), dtype="float32")
    return np.round(resample(x, sr, RATE) * 32767).astype(np.int16)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), np.int16)


def b64(pcm: np.ndarray) -> str:
    return base64.b64encode(pcm.astype("<i2").tobytes()).decode()


class RealtimeServer(ThreadServer):
    def __init__(self, app, llm: AsyncOmniLLM) -> None:
        super().__init__(app)
        self.app, self.llm = app, llm
        self.ws_url = self.url.replace("http://", "ws://") + f"/v1/realtime?model={MODEL_NAME}"

    def stage_state(self) -> dict[str, tuple[int, int, int]]:
        """Per AR stage: (running, waiting, blocks held) - all 0 when idle."""
        out = {}
        for name, engine in self.llm.pipeline.engines.items():
            s = engine.stats
            out[name] = (s["num_running"], s["num_waiting"],
                         s["num_kv_blocks"] - s["num_free_blocks"])
        return out

    def wait_idle(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        state = self.app.state.omni
        while time.monotonic() < deadline:
            idle = not state.in_flight and not self.llm.runtime.num_active() and all(
                v == (0, 0, 0) for v in self.stage_state().values())
            if idle:
                return
            time.sleep(0.05)
        raise AssertionError(f"not idle: in_flight={state.in_flight} "
                             f"active={self.llm.runtime.num_active()} {self.stage_state()}")


@dataclasses.dataclass
class Client:
    ws: Any
    events: list[dict] = dataclasses.field(default_factory=list)

    async def send(self, event: dict) -> None:
        await self.ws.send(json.dumps(event))

    async def recv(self, timeout: float = 60.0) -> dict:
        ev = json.loads(await asyncio.wait_for(self.ws.recv(), timeout))
        SERVER_EVENT.validate_python(ev)  # the SDK's model of that event type
        self.events.append(ev)
        return ev

    async def until(self, kind: str, timeout: float = 120.0,
                    fail_on: str | None = None) -> list[dict]:
        """Events up to and including the next one of `kind` (an event of `fail_on` first
        fails the test)."""
        got = []
        deadline = time.monotonic() + timeout
        while True:
            ev = await self.recv(max(deadline - time.monotonic(), 0.01))
            got.append(ev)
            assert ev["type"] != fail_on, f"{fail_on} before {kind}: {got}"
            if ev["type"] == kind:
                return got


async def connect(srv: RealtimeServer, **kwargs: Any) -> Client:
    ws = await websockets.connect(srv.ws_url, max_size=None, **kwargs)
    client = Client(ws)
    first = await client.recv()
    assert first["type"] == "session.created", first
    return client


def response_types(events: list[dict]) -> list[str]:
    """A response's event types with its deltas removed (the frame, in order)."""
    return [e["type"] for e in events if e["type"] not in AUDIO_DELTAS]


def pcm_of(events: list[dict]) -> np.ndarray:
    return np.frombuffer(b"".join(base64.b64decode(e["delta"]) for e in events
                                  if e["type"] == "response.output_audio.delta"), "<i2")


def serve_tiny_omni(model_dir, thinker_tokens: int = 12, talker_tokens: int = 40,
                    **config: Any) -> Iterator[RealtimeServer]:
    """A server on the tiny omni model with short default answers."""
    llm = AsyncOmniLLM(str(model_dir), device="cpu", max_model_len=2048)
    thinker, talker = llm.stage_names[:2]
    defaults = llm.pipeline.default_params
    defaults[thinker] = dataclasses.replace(defaults[thinker], max_tokens=thinker_tokens)
    # (at least a few codes: every spoken answer has audio to check)
    defaults[talker] = dataclasses.replace(defaults[talker], min_tokens=8,
                                           max_tokens=talker_tokens)
    cfg = ServerConfig(served_model_names=[MODEL_NAME], max_audio_seconds=30, **config)
    try:
        with RealtimeServer(build_app(llm, cfg), llm) as srv:
            yield srv
    finally:
        llm.shutdown()
