"""/v1/realtime's input transcription and function tools on the tiny omni model, over a real
WebSocket; every server event is checked against the `openai` SDK's Realtime event models.

- Input transcription: a committed espeak-ng clip gets input_audio_transcription deltas and a
  completed event whose transcript equals what /v1/audio/transcriptions (the official openai
  client) returns for the same clip; null turns it off.
- Tools: a forced call (a named function, "required") is a function_call item whose arguments
  validate against the function's schema (`jsonschema`), with the events in OpenAI's order and
  the arguments streamed as they are generated (several deltas that add up to .done's); a
  function_call_output then response.create is answered with the tool result in the prompt;
  the conversation renders as Qwen2.5's tool template renders it; bad tool definitions give
  `error` naming the field and the session lives on."""

from __future__ import annotations

import asyncio
import io
import json

import jsonschema
import numpy as np
import openai
import pytest
import soundfile

from omnistage.entrypoints.openai.realtime.items import CallItem, CallOutputItem, Item
from omnistage.entrypoints.openai.realtime.protocol import SessionConfig
from omnistage.entrypoints.openai.realtime.tools import render_conversation, tools_text
from omnistage.testing.chat_templates import QWEN2_5_TOOLS_TEMPLATE
from tests.entrypoints.realtime_utils import (AUDIO_TAIL, RATE, RESPONSE_HEAD, b64, connect,
                                              response_types, serve_tiny_omni, speak)
from tests.entrypoints.server_utils import MODEL_NAME
from tests.entrypoints.test_openai_tools import PARAMS, TIME
from tests.entrypoints.test_openai_tools import TOOLS as CHAT_TOOLS

# chat's tools (tests/entrypoints/test_openai_tools.py) in the Realtime API's flat layout
TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
CALL_TYPES = ["response.created", "response.output_item.added", "conversation.item.added",
              "response.function_call_arguments.delta", "response.function_call_arguments.done",
              "response.output_item.done", "conversation.item.done", "response.done"]
ARGS_DELTA = "response.function_call_arguments.delta"
TRSC = "conversation.item.input_audio_transcription."


@pytest.fixture(scope="module")
def srv(tiny_omni_dir):
    yield from serve_tiny_omni(tiny_omni_dir)


def call_frame(events: list[dict]) -> list[str]:
    """The event types with each run of argument deltas as one (the frame, in order)."""
    types = [e["type"] for e in events]
    return [t for i, t in enumerate(types) if t != ARGS_DELTA or types[i - 1] != ARGS_DELTA]


def check_streamed_call(events: list[dict], call: dict) -> None:
    """A call's events: added with its name and call_id and no arguments yet, more than one
    argument delta (a multi-token object streams), the deltas add up to .done's arguments."""
    added = next(e for e in events if e["type"] == "response.output_item.added")["item"]
    assert added["type"] == "function_call" and added["status"] == "in_progress"
    assert (added["name"], added["call_id"], added["arguments"]) == \
        (call["name"], call["call_id"], ""), added
    deltas = [e for e in events if e["type"] == ARGS_DELTA]
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert len(deltas) > 1, deltas
    assert "".join(e["delta"] for e in deltas) == done["arguments"] == call["arguments"]
    assert done["name"] == call["name"] and done["call_id"] == call["call_id"]
    assert all(e["item_id"] == call["id"] and e["call_id"] == call["call_id"]
               and e["output_index"] == 0 for e in deltas + [done])


async def _commit(client, pcm: np.ndarray) -> str:
    for chunk in np.array_split(pcm, 4):
        await client.send({"type": "input_audio_buffer.append", "audio": b64(chunk)})
    await client.send({"type": "input_audio_buffer.commit"})
    got = await client.until("conversation.item.done")
    assert [e["type"] for e in got] == ["input_audio_buffer.committed",
                                        "conversation.item.added", "conversation.item.done"]
    return got[0]["item_id"]


async def _until_both(client, kinds: set[str]) -> list[dict]:
    """Events until one of each of `kinds` has come (in any order)."""
    got: list[dict] = []
    while kinds - {e["type"] for e in got}:
        got.append(await client.recv(120))
    return got


# ------------------------------------------------------------------ input transcription
def test_input_transcription_equals_the_transcriptions_endpoint(srv):
    clip = speak("Please book a table for two.")

    async def run():
        client = await connect(srv)
        await client.send({"type": "session.update", "session": {"audio": {"input": {
            "turn_detection": None,
            "transcription": {"model": MODEL_NAME, "language": "en"}}}}})
        updated = (await client.until("session.updated"))[-1]
        assert updated["session"]["audio"]["input"]["transcription"]["language"] == "en"
        item_id = await _commit(client, clip)
        await client.send({"type": "response.create"})
        events = await _until_both(client, {TRSC + "completed", "response.done"})
        # null turns it off: the next commit gets no transcription
        await client.send({"type": "session.update", "session": {"audio": {"input": {
            "transcription": None}}}})
        await client.until("session.updated")
        await _commit(client, clip)
        await client.send({"type": "response.create"})
        off = await client.until("response.done")
        await client.ws.close()
        return item_id, events, off

    item_id, events, off = asyncio.run(run())
    trsc = [e for e in events if e["type"].startswith(TRSC)]
    assert [e["type"] for e in trsc][-1] == TRSC + "completed"
    assert all(e["type"] == TRSC + "delta" for e in trsc[:-1]) and trsc[:-1], trsc
    assert all(e["item_id"] == item_id and e["content_index"] == 0 for e in trsc)
    completed = trsc[-1]
    assert "".join(e["delta"] for e in trsc[:-1]) == completed["transcript"]
    assert completed["usage"]["output_tokens"] >= 1
    # the response ran beside it, in its own order
    types = response_types([e for e in events if not e["type"].startswith(TRSC)])
    assert types[:4] == RESPONSE_HEAD and types[-6:] == AUDIO_TAIL, types
    assert not any(e["type"].startswith(TRSC) for e in off)

    # the same clip through /v1/audio/transcriptions (the openai client), as a 24 kHz wav
    wav = io.BytesIO()
    soundfile.write(wav, clip, RATE, subtype="PCM_16", format="WAV")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    ref = client.audio.transcriptions.create(model=MODEL_NAME, language="en",
                                             file=("clip.wav", wav.getvalue(), "audio/wav"))
    assert completed["transcript"] == ref.text and ref.text
    srv.wait_idle()


# ------------------------------------------------------------------ tools
async def _tool_session(srv, choice) -> object:
    client = await connect(srv)
    await client.send({"type": "session.update", "session": {
        "tools": TOOLS, "tool_choice": choice, "max_output_tokens": 160,
        "audio": {"input": {"turn_detection": None}}}})
    updated = (await client.until("session.updated", fail_on="error"))[-1]
    assert [t["name"] for t in updated["session"]["tools"]] == ["get_weather", "get_time"]
    await client.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]}})
    await client.until("conversation.item.done")
    return client


@pytest.mark.parametrize("choice,answer_in", [({"type": "function", "name": "get_weather"}, "text"),
                                              ("required", "audio")])
def test_forced_call_validates_and_round_trips(srv, choice, answer_in):
    """A forced call is generated as text (a call is not said); the answer after the tool's
    result is text or speech."""

    async def run():
        client = await _tool_session(srv, choice)
        await client.send({"type": "response.create"})
        call_events = await client.until("response.done")
        call = call_events[-1]["response"]["output"][0]
        # the tool's result, then a free answer (tool_choice auto)
        await client.send({"type": "conversation.item.create", "item": {
            "type": "function_call_output", "call_id": call["call_id"],
            "output": json.dumps({"forecast": "sunny", "celsius": 21})}})
        added = await client.until("conversation.item.done")
        await client.send({"type": "session.update", "session": {"tool_choice": "auto",
                                                             "output_modalities": [answer_in]}})
        await client.until("session.updated")
        await client.send({"type": "response.create"})
        answer = await client.until("response.done")
        await client.ws.close()
        return call_events, added, answer

    call_events, added, answer = asyncio.run(run())
    assert call_frame(call_events) == CALL_TYPES
    done = call_events[-1]["response"]
    assert done["status"] == "completed" and len(done["output"]) == 1, done
    call = done["output"][0]
    assert call["type"] == "function_call" and call["status"] == "completed"
    if isinstance(choice, dict):
        assert call["name"] == choice["name"]
    jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
    check_streamed_call(call_events, call)
    assert added[-1]["item"]["type"] == "function_call_output"
    # the answer: a response with output, its prompt longer by the call and the tool result
    final = answer[-1]["response"]
    assert final["status"] == "completed" and final["output"], final
    first_prompt = done["usage"]["input_tokens"]
    assert final["usage"]["input_tokens"] > first_prompt + len(call["arguments"]) // 8
    if answer_in == "audio":  # (the model may also answer with a call: a text-free output)
        if final["output"][0]["type"] == "message":
            assert response_types(answer)[-6:] == AUDIO_TAIL
            assert any(e["type"] == "response.output_audio.delta" for e in answer)
    else:  # the first turn (system + tools + user) came back from the prefix cache
        block = srv.llm.engine.config.block_size
        assert final["usage"]["input_token_details"]["cached_tokens"] >= \
            first_prompt // block * block > 0
    srv.wait_idle()


def test_a_call_cut_inside_its_arguments_is_incomplete(srv):
    """max_output_tokens that ends a forced call inside its arguments (found by shortening the
    seeded answer from its end): the call's deltas are the start of the whole call's
    arguments, and the call and the response are incomplete."""

    async def answer(limit: int | None) -> list[dict]:
        """The forced call in a fresh session (the same prompt), seeded."""
        client = await _tool_session(srv, {"type": "function", "name": "get_weather"})
        await client.send({"type": "session.update", "session": {"sampling": {"seed": 5}}})
        await client.until("session.updated", fail_on="error")
        await client.send({"type": "response.create", "response": {} if limit is None
                           else {"max_output_tokens": limit}})
        events = await client.until("response.done")
        await client.ws.close()
        return events

    async def run():
        whole = await answer(None)
        n = whole[-1]["response"]["usage"]["output_token_details"]["text_tokens"]
        for limit in range(n - 1, 0, -1):
            cut = await answer(limit)
            output = cut[-1]["response"]["output"]
            if output and output[0]["type"] == "function_call" and \
                    output[0]["status"] == "incomplete":
                return whole, cut
        raise AssertionError(f"no cut of the {n} tokens ends inside the arguments")

    whole, cut = asyncio.run(run())
    full = whole[-1]["response"]["output"][0]["arguments"]
    done = cut[-1]["response"]
    call = done["output"][0]
    assert done["status"] == "incomplete"
    assert done["status_details"]["reason"] == "max_output_tokens"
    assert call_frame(cut) == CALL_TYPES
    deltas = "".join(e["delta"] for e in cut if e["type"] == ARGS_DELTA)
    args_done = next(e for e in cut if e["type"] == "response.function_call_arguments.done")
    assert deltas == args_done["arguments"] == call["arguments"]
    assert full.startswith(call["arguments"]) and len(call["arguments"]) < len(full)
    with pytest.raises(json.JSONDecodeError):
        json.loads(call["arguments"])
    srv.wait_idle()


def test_response_create_brings_its_own_tools(srv):
    """response.create's tools / tool_choice apply to that response alone: a session with no
    tools gets one forced call, then a plain answer; a bad per-response tool names its field
    under response. and the session lives on."""

    async def run():
        client = await connect(srv)
        await client.send({"type": "session.update", "session": {
            "max_output_tokens": 160, "output_modalities": ["text"],
            "audio": {"input": {"turn_detection": None}}}})
        await client.until("session.updated", fail_on="error")
        await client.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "What time is it in Paris?"}]}})
        await client.until("conversation.item.done")
        await client.send({"type": "response.create", "response": {
            "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"}}})
        forced = await client.until("response.done")
        await client.send({"type": "response.create", "response": {
            "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}})
        error = await client.recv()
        await client.send({"type": "response.create", "response": {"max_output_tokens": 8}})
        plain = await client.until("response.done")
        await client.ws.close()
        return forced, error, plain

    forced, error, plain = asyncio.run(run())
    assert call_frame(forced) == CALL_TYPES
    call = forced[-1]["response"]["output"][0]
    check_streamed_call(forced, call)
    assert call["type"] == "function_call" and call["name"] == "get_time"
    jsonschema.validate(json.loads(call["arguments"]), TIME)
    assert error["type"] == "error" and error["error"]["param"] == "response.tools[1].name"
    # the session's own tools (none) again: a message, no call
    out = plain[-1]["response"]["output"]
    assert plain[-1]["response"]["status"] in ("completed", "incomplete")
    assert out and out[0]["type"] == "message", out
    srv.wait_idle()


def test_conversation_renders_as_qwen_tool_template(srv):
    """The session's rendering (through the omni template) equals Qwen2.5's tool layout."""
    cfg = SessionConfig.model_validate({"tools": TOOLS, "instructions": "Be brief."})
    args = {"city": "Oslo", "days": 2}
    items = [Item("i1", "user", [("text", "Weather in Oslo?")]),
             CallItem("i2", "call_1", "get_weather", json.dumps(args)),
             CallItem("i3", "call_2", "get_time", json.dumps({"zone": "CET"})),
             CallOutputItem("i4", "call_1", "rain"), CallOutputItem("i5", "call_2", "noon")]
    ours = render_conversation(items, f"Be brief.\n\n{tools_text(cfg)}")
    processor = srv.llm.pipeline.processor
    text = processor.tokenizer.apply_chat_template(
        ours, chat_template=processor.chat_template, tokenize=False, add_generation_prompt=True)
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                  for t in TOOLS]
    ref = processor.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "Weather in Oslo?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"type": "function", "function": {"name": "get_weather", "arguments": args}},
             {"type": "function", "function": {"name": "get_time",
                                               "arguments": {"zone": "CET"}}}]},
         {"role": "tool", "content": "rain"}, {"role": "tool", "content": "noon"}],
        chat_template=QWEN2_5_TOOLS_TEMPLATE, tools=chat_tools, tokenize=False,
        add_generation_prompt=True)
    assert text == ref


def test_bad_tools_and_transcription_get_errors_and_the_session_lives_on(srv):
    bad = [({"tools": [{"type": "function", "name": "bad name!"}]}, "session.tools[0].name"),
           ({"tools": [{"type": "function", "name": "f", "strict": True}]},
            "session.tools[0].strict"),
           ({"tools": [{"type": "function", "name": "f", "parameters": {
               "type": "object", "properties": {"x": {"type": "nonsense"}}}}]},
            "session.tools[0].parameters"),
           ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]},
            "session.tools[1].name"),
           ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
            "session.tool_choice.name"),
           ({"tool_choice": "required"}, "session.tool_choice"),
           ({"audio": {"input": {"transcription": {"model": MODEL_NAME, "language": "xx"}}}},
            "session.audio.input.transcription.language"),
           ({"audio": {"input": {"transcription": {"model": "whisper-1"}}}},
            "session.audio.input.transcription.model")]

    async def run():
        client = await connect(srv)
        errors = []
        for session, _ in bad:
            await client.send({"type": "session.update", "session": session})
            errors.append(await client.recv())
        await client.send({"type": "conversation.item.create", "item": {
            "type": "function_call_output", "call_id": "call_missing", "output": "x"}})
        errors.append(await client.recv())
        await client.send({"type": "session.update", "session": {"tools": TOOLS}})
        updated = await client.recv()
        await client.ws.close()
        return errors, updated

    errors, updated = asyncio.run(run())
    for (session, param), err in zip(bad + [(None, "item.call_id")], errors):
        assert err["type"] == "error", (session, err)
        assert err["error"]["param"] == param, (session, err)
        assert err["error"]["message"].startswith(param), (session, err)
    assert updated["type"] == "session.updated"
    assert updated["session"]["tools"][0]["name"] == "get_weather"
