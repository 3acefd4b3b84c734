"""/v1/realtime over a real WebSocket (the `websockets` client) on the tiny omni model: a spoken
question with manual commits and with server VAD, OpenAI's event order, audio deltas, a second
turn served from the prefix cache, barge-in and response.cancel, bad events, auth, a closed
socket. Every server event is checked against the `openai` SDK's Realtime event models."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import websockets

from tests.entrypoints.realtime_utils import (AUDIO_TAIL, RESPONSE_HEAD, b64, connect, pcm_of,
                                              response_types, serve_tiny_omni, silence, speak)

QUESTION = "What is the weather like today?"


@pytest.fixture(scope="module")
def srv(tiny_omni_dir):
    yield from serve_tiny_omni(tiny_omni_dir)


def _check_response(events: list[dict], status: str = "completed") -> dict:
    types = response_types(events)
    start = types.index("response.created")
    assert types[start:start + 4] == RESPONSE_HEAD, types
    assert types[-6:] == AUDIO_TAIL, types
    done = events[-1]["response"]
    assert done["status"] == status, done
    return done


async def _manual_turn(client, pcm: np.ndarray) -> list[dict]:
    for chunk in np.array_split(pcm, 8):
        await client.send({"type": "input_audio_buffer.append", "audio": b64(chunk)})
    await client.send({"type": "input_audio_buffer.commit"})
    got = await client.until("conversation.item.done")
    assert [e["type"] for e in got] == ["input_audio_buffer.committed",
                                        "conversation.item.added", "conversation.item.done"]
    assert got[1]["item"]["role"] == "user"
    assert got[1]["item"]["content"][0]["type"] == "input_audio"
    await client.send({"type": "response.create"})
    return await client.until("response.done")


def test_manual_commit_conversation(srv):
    """Two spoken turns with manual commits: OpenAI's order, audio deltas, and the second
    turn's prompt served from the prefix cache for at least the first turn's prompt."""
    clip = speak(QUESTION)

    async def run():
        client = await connect(srv)
        await client.send({"type": "session.update", "session": {
            "audio": {"input": {"turn_detection": None}, "output": {"voice": srv.llm.pipeline
                                                                     .voices and sorted(
                srv.llm.pipeline.voices)[0]}}}})
        updated = await client.until("session.updated")
        assert updated[-1]["session"]["audio"]["input"]["turn_detection"] is None
        first = await _manual_turn(client, clip)
        done = _check_response(first)
        assert len(pcm_of(first)) > 0
        assert any(e["type"] == "response.output_audio_transcript.delta" for e in first)
        transcript = next(e for e in first if e["type"] ==
                          "response.output_audio_transcript.done")["transcript"]
        assert done["output"][0]["content"][0]["transcript"] == transcript
        prompt1 = done["usage"]["input_tokens"]
        second = await _manual_turn(client, speak("And tomorrow?"))
        done2 = _check_response(second)
        cached = done2["usage"]["input_token_details"]["cached_tokens"]
        await client.ws.close()
        return prompt1, cached

    prompt1, cached = asyncio.run(run())
    block = srv.llm.engine.config.block_size
    assert cached >= prompt1 // block * block > 0, (prompt1, cached)
    srv.wait_idle()


def test_server_vad_turn(srv):
    """Server VAD on an espeak clip padded with silence: speech_started / speech_stopped, the
    commit, then a response created by the server (create_response)."""
    pcm = np.concatenate([silence(0.6), speak(QUESTION), silence(1.2)])

    async def run():
        client = await connect(srv)
        await client.send({"type": "session.update", "session": {"audio": {"input": {
            "turn_detection": {"type": "server_vad", "threshold": 0.5,
                               "silence_duration_ms": 400, "prefix_padding_ms": 200}}}}})
        await client.until("session.updated")
        for chunk in np.array_split(pcm, len(pcm) // 2400):  # 100 ms chunks, as a mic sends
            await client.send({"type": "input_audio_buffer.append", "audio": b64(chunk)})
        events = await client.until("response.done")
        await client.ws.close()
        return events

    events = asyncio.run(run())
    types = response_types(events)
    order = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
             "input_audio_buffer.committed", "conversation.item.added",
             "conversation.item.done"] + RESPONSE_HEAD
    assert types[:len(order)] == order, types
    started, stopped = events[0], events[1]
    assert started["item_id"] == stopped["item_id"]
    assert 0 <= started["audio_start_ms"] < stopped["audio_end_ms"] <= len(pcm) * 1000 // 24000
    assert 300 <= started["audio_start_ms"] + 200 <= 900  # speech begins after 0.6 s of silence
    _check_response(events)
    assert len(pcm_of(events)) > 0
    srv.wait_idle()


class _LongAnswers:
    """Within the block the pipeline's default answers are long (the thinker ignores nothing
    but runs at least `tokens` tokens, the talker up to 400 codes), so that a response is
    still speaking when the test interrupts it."""

    def __init__(self, srv, tokens: int = 160) -> None:
        self.defaults, self.tokens = srv.llm.pipeline.default_params, tokens
        self.thinker, self.talker = srv.llm.stage_names[:2]

    def __enter__(self):
        self.saved = dict(self.defaults)
        d = self.defaults
        d[self.thinker] = dataclasses.replace(d[self.thinker], min_tokens=self.tokens,
                                              max_tokens=self.tokens)
        # (and the talker cannot stop at once: a response without audio would not be
        # interrupted mid-speech)
        d[self.talker] = dataclasses.replace(d[self.talker], min_tokens=200, max_tokens=400)
        return self

    def __exit__(self, *exc) -> None:
        self.defaults.update(self.saved)


def _session(srv):
    (session,) = srv.app.state.realtime.sessions
    return session


@pytest.mark.parametrize("how", ["barge_in", "response_cancel"])
def test_interrupt_cancels_in_every_stage_and_truncates(srv, how):
    """A response interrupted by speech (server VAD) or by response.cancel ends with status
    cancelled, every stage frees its state, and conversation.item.truncate cuts the item's
    transcript to the audio played."""
    clip = np.concatenate([speak(QUESTION), silence(0.8)])

    async def run():
        client = await connect(srv)
        clock = srv.app.state.realtime.clock
        if clock.samples_per_code is None:  # one complete spoken answer measures it
            await client.send({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Hi"}]}})
            await client.send({"type": "response.create"})
            await client.until("response.done")
        # Qwen2.5-Omni: a code is 2 mel frames, BigVGAN x240 -> 480 samples at 24 kHz
        assert clock.samples_per_code == 480
        vad = {"type": "server_vad", "silence_duration_ms": 400, "create_response": False}
        await client.send({"type": "session.update", "session": {"audio": {"input": {
            "turn_detection": vad if how == "barge_in" else None}}}})
        await client.until("session.updated")
        await client.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_audio", "audio": b64(clip)}]}})
        await client.until("conversation.item.done")
        await client.send({"type": "response.create"})
        head = await client.until("response.output_audio.delta", fail_on="response.done")
        srv_state = srv.stage_state()
        assert any(v != (0, 0, 0) for v in srv_state.values()), srv_state  # it is running
        if how == "barge_in":
            for chunk in np.array_split(clip, len(clip) // 2400):
                await client.send({"type": "input_audio_buffer.append", "audio": b64(chunk)})
        else:
            await client.send({"type": "response.cancel"})
        rest = await client.until("response.done")
        events = head + rest
        item_id = events[1]["item"]["id"]
        played_ms = len(pcm_of(events)) * 1000 // 24000 // 2
        await client.send({"type": "conversation.item.truncate", "item_id": item_id,
                           "content_index": 0, "audio_end_ms": played_ms})
        truncated = await client.until("conversation.item.truncated")
        item = next(it for it in _session(srv).items if it.id == item_id)
        await client.ws.close()
        return events, truncated[-1], played_ms, item

    with _LongAnswers(srv):
        events, truncated, played_ms, item = asyncio.run(run())
    types = [e["type"] for e in events]
    if how == "barge_in":
        assert types.index("input_audio_buffer.speech_started") < types.index("response.done")
    done = _check_response(events, "cancelled")
    reason = "turn_detected" if how == "barge_in" else "client_cancelled"
    assert done["status_details"] == {"type": "cancelled", "reason": reason}, done
    assert done["output"][0]["status"] == "incomplete"
    assert truncated["audio_end_ms"] == played_ms
    # the transcript keeps the text tokens of the codes played (session.py's note)
    assert item.audio_samples == played_ms * 24
    assert len(item.text_ids) == -(-played_ms * 24 // 480) < 160
    assert item.transcript == srv.llm.tokenizer.decode(
        item.text_ids, skip_special_tokens=True)
    srv.wait_idle()


def test_bad_events_get_errors_and_the_session_lives_on(srv):
    bad = [("{not json", "event"),
           ('{"type": "input_audio_buffer.explode"}', "type"),
           ('{"type": "input_audio_buffer.append"}', "audio"),
           ('{"type": "input_audio_buffer.append", "audio": "@@@"}', "audio"),
           ('{"type": "input_audio_buffer.append", "audio": "AAAA"}', "audio"),
           ('{"type": "input_audio_buffer.commit"}', "input_audio_buffer"),
           ('{"type": "session.update", "session": {"audio": {"input": {"turn_detection": '
            '{"type": "server_vad", "threshold": 2}}}}}',
            "session.audio.input.turn_detection.threshold"),
           ('{"type": "session.update", "session": {"colour": "blue"}}', "session.colour"),
           ('{"type": "session.update", "session": {"audio": {"output": {"voice": "nobody"}}}}',
            "session.audio.output.voice"),
           ('{"type": "session.update", "session": {"sampling": {"temperature": -1}}}',
            "session.sampling.temperature"),
           ('{"type": "conversation.item.create", "item": {"type": "message", "role": "user", '
            '"content": [{"type": "input_text"}]}}', "item.content[0].text"),
           ('{"type": "conversation.item.truncate", "item_id": "item_x", "content_index": 0, '
            '"audio_end_ms": 5}', "item_id"),
           ('{"type": "response.cancel"}', "response_id"),
           ('{"type": "response.create", "extra": 1}', "extra")]

    async def run():
        client = await connect(srv)
        for raw, _ in bad:
            await client.ws.send(raw)
        errors = [await client.recv() for _ in bad]
        await client.send({"type": "session.update", "session": {"output_modalities": ["text"],
                                                                 "sampling": {"temperature": 0}}})
        await client.until("session.updated")
        await client.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Hello there"}]}})
        await client.send({"type": "response.create"})
        events = await client.until("response.done")
        await client.ws.close()
        return errors, events

    errors, events = asyncio.run(run())
    for (raw, param), err in zip(bad, errors):
        assert err["type"] == "error", (raw, err)
        assert err["error"]["param"] == param, (raw, err)
        assert err["error"]["message"].startswith(param), (raw, err)
    types = response_types(events)
    assert types[-5:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "conversation.item.done",
                          "response.done"], types
    assert events[-1]["response"]["status"] == "completed"
    assert any(e["type"] == "response.output_text.delta" for e in events)
    srv.wait_idle()


def test_auth_header_and_subprotocol(srv):
    config = srv.app.state.omni.config
    key = "sekret-key"

    async def run():
        with pytest.raises(websockets.InvalidStatus) as e:
            await websockets.connect(srv.ws_url)
        assert e.value.response.status_code == 403
        with pytest.raises(websockets.InvalidStatus):
            await websockets.connect(srv.ws_url, additional_headers={
                "Authorization": "Bearer wrong"})
        by_header = await connect(srv, additional_headers={"Authorization": f"Bearer {key}"})
        await by_header.ws.close()
        by_protocol = await connect(srv, subprotocols=["realtime",
                                                       f"openai-insecure-api-key.{key}"])
        assert by_protocol.ws.subprotocol == "realtime"
        await by_protocol.ws.close()

    config.api_key = key
    try:
        asyncio.run(run())
    finally:
        config.api_key = None


def test_closed_socket_frees_every_stage(srv):
    async def run():
        client = await connect(srv)
        await client.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_audio", "audio": b64(speak(QUESTION))}]}})
        await client.send({"type": "response.create"})
        await client.until("response.output_audio.delta", fail_on="response.done")
        await client.ws.close()

    with _LongAnswers(srv):
        asyncio.run(run())
        srv.wait_idle()
    assert not srv.app.state.realtime.sessions


def test_sixteen_sessions_at_once_get_their_own_answers(srv):
    """16 sessions ask 16 different questions at once; each answer (greedy) equals the answer
    the same question gets in a session of its own."""
    questions = [f"Question number {i}: what is {i} plus {i}?" for i in range(16)]

    async def ask(question: str) -> tuple[str, int]:
        client = await connect(srv)
        await client.send({"type": "session.update", "session": {
            "audio": {"input": {"turn_detection": None}},
            "sampling": {"temperature": 0, "seed": 5}}})
        await client.until("session.updated")
        await client.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": question}]}})
        await client.send({"type": "response.create"})
        events = await client.until("response.done", timeout=300)
        await client.ws.close()
        _check_response(events)
        done = events[-1]["response"]
        return done["output"][0]["content"][0]["transcript"], len(pcm_of(events))

    async def together():
        return await asyncio.gather(*(ask(q) for q in questions))

    answers = asyncio.run(together())
    alone = [asyncio.run(ask(q)) for q in questions]
    assert all(audio > 0 for _, audio in answers)
    assert [t for t, _ in answers] == [t for t, _ in alone]
    assert len({t for t, _ in answers}) > 1  # (different questions, different answers)
    srv.wait_idle()
