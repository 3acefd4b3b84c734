"""Server VAD with several sessions at once over real WebSockets (the VAD worker thread runs
every session's windows): each session's speech_started / speech_stopped carry the ms values
its audio gives a TurnDetector alone, and a barge-in sends no audio delta after
speech_started, ends the response cancelled and frees every stage."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from omnistage.entrypoints.openai.realtime.vad import TurnDetector
from tests.entrypoints.realtime_utils import (b64, connect, response_types, serve_tiny_omni,
                                              silence, speak)
from tests.entrypoints.test_realtime import _LongAnswers

PHRASES = ["What is the weather like today?", "Tell me a joke.", "How far away is the moon?"]
VAD = {"type": "server_vad", "threshold": 0.5, "silence_duration_ms": 400,
       "prefix_padding_ms": 200}


@pytest.fixture(scope="module")
def srv(tiny_omni_dir):
    yield from serve_tiny_omni(tiny_omni_dir)


def _chunks(pcm: np.ndarray) -> list[np.ndarray]:
    return [pcm[i:i + 2400] for i in range(0, len(pcm), 2400)]  # 100 ms, as a mic sends


def _alone(pcm: np.ndarray) -> list[tuple[str, int]]:
    det = TurnDetector(VAD["threshold"], VAD["silence_duration_ms"], VAD["prefix_padding_ms"])
    return [(e.kind, e.ms) for c in _chunks(pcm) for e in det.feed(c)]


def test_concurrent_sessions_get_the_vad_events_they_get_alone(srv):
    clips = [np.concatenate([silence(0.2 + 0.3 * k), speak(p), silence(0.9), speak(p),
                             silence(0.9)]) for k, p in enumerate(PHRASES)]

    async def session(pcm: np.ndarray) -> list[tuple[str, int]]:
        client = await connect(srv)
        await client.send({"type": "session.update", "session": {"audio": {"input": {
            "turn_detection": {**VAD, "create_response": False}}}}})
        await client.until("session.updated")
        for chunk in _chunks(pcm):
            await client.send({"type": "input_audio_buffer.append", "audio": b64(chunk)})
            await asyncio.sleep(0)  # (the sessions' appends interleave)
        got: list[tuple[str, int]] = []
        while len(got) < 4:
            ev = await client.recv(60.0)
            if ev["type"] == "input_audio_buffer.speech_started":
                got.append(("start", ev["audio_start_ms"]))
            elif ev["type"] == "input_audio_buffer.speech_stopped":
                got.append(("stop", ev["audio_end_ms"]))
        await client.ws.close()
        return got

    async def main() -> list[list[tuple[str, int]]]:
        return list(await asyncio.gather(*(session(c) for c in clips)))

    expected = [_alone(c) for c in clips]
    assert all([k for k, _ in e] == ["start", "stop", "start", "stop"] for e in expected)
    assert asyncio.run(main()) == expected
    srv.wait_idle()


def test_barge_in_sends_no_audio_after_speech_started(srv):
    clip = np.concatenate([speak(PHRASES[0]), silence(0.8)])

    async def run() -> list[dict]:
        client = await connect(srv)
        await client.send({"type": "session.update", "session": {"audio": {"input": {
            "turn_detection": {**VAD, "create_response": False}}}}})
        await client.until("session.updated")
        await client.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Tell me a long story."}]}})
        await client.until("conversation.item.done")
        await client.send({"type": "response.create"})
        events = await client.until("response.output_audio.delta", fail_on="response.done")
        for chunk in _chunks(clip):
            await client.send({"type": "input_audio_buffer.append", "audio": b64(chunk)})
        events += await client.until("response.done")
        await client.ws.close()
        return events

    with _LongAnswers(srv):
        events = asyncio.run(run())
    types = [e["type"] for e in events]
    started = types.index("input_audio_buffer.speech_started")
    assert "response.output_audio.delta" not in types[started:], types[started:]
    assert response_types(events)[-1] == "response.done"
    assert events[-1]["response"]["status_details"] == {"type": "cancelled",
                                                        "reason": "turn_detected"}
    srv.wait_idle()
