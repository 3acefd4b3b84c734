"""One Realtime session: a conversation (items), an input audio buffer with optional server VAD,
and at most one response at a time, run on the AsyncOmniLLM with the whole conversation as its
prompt (earlier turns' KV comes back from the prefix cache).

Server events for a response, in OpenAI's order: response.created, response.output_item.added,
conversation.item.added, response.content_part.added, then transcript and audio deltas
(response.output_audio_transcript.delta / response.output_audio.delta, or
response.output_text.delta), then response.output_audio.done, .output_audio_transcript.done,
response.content_part.done, response.output_item.done, conversation.item.done, response.done.

Transcript truncation (conversation.item.truncate, barge-in): the talker emits codec code k
from the thinker's reply row k, so the audio of the first c codes speaks at most the first c
text tokens; a truncated item keeps the text tokens of the codes played."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from pydantic import BaseModel
from starlette.websockets import WebSocketDisconnect

from omnistage.entrypoints.async_llm import RuntimeShutDown
from omnistage.entrypoints.openai.protocol import APIError
from omnistage.entrypoints.openai.realtime import tools as rt_tools
from omnistage.entrypoints.openai.realtime.items import (AudioClock, CallItem, CallOutputItem,
                                                         ConversationEntry, Item,
                                                         RealtimeLimits, Response,
                                                         response_usage)
from omnistage.entrypoints.openai.realtime.items import new_id as _id
from omnistage.entrypoints.openai.realtime.protocol import (
    PCM_RATE, BufferAppend, BufferClear, BufferCommit, FunctionCallItem, FunctionCallOutputItem,
    ItemCreate, ItemTruncate, MessageItem, RealtimeProtocolError, ResponseCancel,
    ResponseCreate, SessionConfig, SessionUpdate, merge_session)
from omnistage.entrypoints.openai.realtime.transcription import (InputTranscriber,
                                                                 check_transcription)
from omnistage.entrypoints.openai.realtime.vad import TurnDetector
from omnistage.entrypoints.openai.realtime.vad_worker import shared_vad_worker
from omnistage.entrypoints.openai.serving import ServerState, build_sampling, to_pcm16
from omnistage.entrypoints.openai.tool_calls import ContentPiece, IncrementalToolCallParser
from omnistage.models.qwen2_5_omni.media import resample

__all__ = ["AudioClock", "RealtimeLimits", "RealtimeSession"]  # (routes imports them here)

log = logging.getLogger("omnistage.realtime")
THINKER_RATE = 16000  # the audio encoders' input rate
MIN_COMMIT_MS = 100  # OpenAI refuses to commit less than 100 ms of audio


class RealtimeSession:
    def __init__(self, state: ServerState, model: str, send: Callable[[str], Awaitable[None]],
                 limits: RealtimeLimits, clock: AudioClock | None = None) -> None:
        self.state, self.model, self._send, self.limits = state, model, send, limits
        self.clock = clock or AudioClock()
        self.id = _id("sess")
        self.started = time.monotonic()
        processor = getattr(state.llm.pipeline, "processor", None)
        audio_out = "audio" in state.output_modalities
        self.config = SessionConfig(
            model=model, output_modalities=["audio" if audio_out else "text"],
            instructions=getattr(processor, "audio_system_prompt", None))
        self.items: list[ConversationEntry] = []
        self.buffer = bytearray()  # uncommitted pcm16 at 24 kHz
        self.buffer_start_ms = 0  # session audio time of buffer[0]
        self.appended_samples = 0  # all audio appended, at 24 kHz
        self.detector: TurnDetector | None = None
        self.speech_item: str | None = None  # item id of the speech in progress (VAD)
        self.response: Response | None = None
        self.closed = False
        self._send_lock = asyncio.Lock()
        self._reset_detector()
        self.num_responses = 0
        self.last_response: Response | None = None  # (tests, the benchmark)
        self.transcriber = InputTranscriber(state, self.id, self.send, self._response_submitted)

    # ------------------------------------------------------------------ sending
    async def send(self, event: dict[str, Any]) -> None:
        if self.closed:
            return
        event = {"event_id": _id("event"), **event}
        async with self._send_lock:
            try:
                await self._send(json.dumps(event, separators=(",", ":")))
            except (WebSocketDisconnect, RuntimeError, OSError) as e:
                # the client went away: the receive loop sees it and closes the session
                log.info("%s: event %s not sent, the socket is closed (%s)", self.id,
                         event["type"], type(e).__name__)
                self.closed = True

    async def start(self) -> None:
        await self.send({"type": "session.created", "session": self.session_object()})

    def session_object(self) -> dict[str, Any]:
        data = self.config.model_dump()
        return {"id": self.id, "object": "realtime.session", **data}

    # ------------------------------------------------------------------ dispatch
    async def handle(self, event: BaseModel) -> None:
        """One parsed client event; RealtimeProtocolError for what cannot be served."""
        handler = {SessionUpdate: self._session_update, BufferAppend: self._append,
                   BufferCommit: self._commit, BufferClear: self._clear,
                   ItemCreate: self._item_create, ItemTruncate: self._truncate,
                   ResponseCreate: self._response_create,
                   ResponseCancel: self._response_cancel}[type(event)]
        await handler(event)

    async def _session_update(self, ev: SessionUpdate) -> None:
        cfg = merge_session(self.config, ev.session, ev.event_id)
        if cfg.model is not None and cfg.model != self.model:
            raise RealtimeProtocolError(f"session.model: {cfg.model!r} cannot change within a "
                                        f"session (it is {self.model!r})", "session.model",
                                        ev.event_id)
        if cfg.output_modalities == ["audio"] and "audio" not in self.state.output_modalities:
            raise RealtimeProtocolError("session.output_modalities: this model gives text only",
                                        "session.output_modalities", ev.event_id)
        voice = cfg.audio.output.voice
        if voice is not None:
            try:
                cfg.audio.output.voice = self.state.resolve_voice(voice,
                                                                  "session.audio.output.voice")
            except APIError as e:
                raise RealtimeProtocolError(e.message, e.param, ev.event_id) from e
        self._sampling(cfg, cfg.max_output_tokens, ev.event_id)  # (bounds checked now)
        rt_tools.check_session_tools(cfg, ev.event_id)
        check_transcription(cfg.audio.input.transcription, self.state, self.model, ev.event_id)
        old_vad = self.config.audio.input.turn_detection
        self.config = cfg
        if cfg.audio.input.turn_detection != old_vad:
            self._reset_detector()
        await self.send({"type": "session.updated", "session": self.session_object()})

    def _reset_detector(self) -> None:
        vad = self.config.audio.input.turn_detection
        self.detector = None if vad is None else TurnDetector(
            vad.threshold, vad.silence_duration_ms, vad.prefix_padding_ms)
        self.speech_item = None

    # ------------------------------------------------------------------ input audio
    def _ms(self, samples: int) -> int:
        return samples * 1000 // PCM_RATE

    async def _append(self, ev: BufferAppend) -> None:
        raw = _b64(ev.audio, "audio", ev.event_id)
        if len(raw) % 2:
            raise RealtimeProtocolError("audio: pcm16 needs an even number of bytes", "audio",
                                        ev.event_id)
        limit = int(self.limits.max_buffer_seconds * PCM_RATE) * 2
        if len(self.buffer) + len(raw) > limit:
            raise RealtimeProtocolError(
                f"audio: the input audio buffer would exceed {self.limits.max_buffer_seconds:g}"
                " s; commit or clear it", "audio", ev.event_id, code="buffer_too_large")
        self.buffer += raw
        self.appended_samples += len(raw) // 2
        if self.detector is None:
            return
        vad = self.config.audio.input.turn_detection
        # (on the VAD thread, batched with other sessions; the next client event waits)
        for vad_event in await shared_vad_worker().feed(self.detector, np.frombuffer(raw, "<i2")):
            if vad_event.kind == "start":
                self._drop_buffer_before(vad_event.ms)
                self.speech_item = _id("item")
                barge_in = self.response is not None and vad.interrupt_response
                if barge_in:  # no audio delta goes out after speech_started
                    await self._stop_response("turn_detected")
                await self.send({"type": "input_audio_buffer.speech_started",
                                 "audio_start_ms": vad_event.ms, "item_id": self.speech_item})
                if barge_in:
                    await self.cancel_response("turn_detected")
            elif self.speech_item is not None:
                item_id, self.speech_item = self.speech_item, None
                await self.send({"type": "input_audio_buffer.speech_stopped",
                                 "audio_end_ms": vad_event.ms, "item_id": item_id})
                end = min(len(self.buffer), (vad_event.ms - self.buffer_start_ms)
                          * PCM_RATE // 1000 * 2)
                await self._commit_audio(bytes(self.buffer[:end]), item_id, None)
                del self.buffer[:end]
                self.buffer_start_ms = vad_event.ms
                if vad.create_response:
                    await self._start_response(None, None)
        if self.speech_item is None:  # no speech: keep only what prefix padding may need
            self._drop_buffer_before(self._ms(self.appended_samples) - vad.prefix_padding_ms
                                     - 100)

    def _drop_buffer_before(self, ms: int) -> None:
        if ms > self.buffer_start_ms:
            cut = min(len(self.buffer), (ms - self.buffer_start_ms) * PCM_RATE // 1000 * 2)
            del self.buffer[:cut]
            self.buffer_start_ms += self._ms(cut // 2)

    async def _commit(self, ev: BufferCommit) -> None:
        ms = self._ms(len(self.buffer) // 2)
        if ms < MIN_COMMIT_MS:
            raise RealtimeProtocolError(
                f"input_audio_buffer: buffer too small: {ms} ms of audio; at least "
                f"{MIN_COMMIT_MS} ms must be appended before a commit", "input_audio_buffer",
                ev.event_id, code="input_audio_buffer_commit_empty")
        item_id = self.speech_item or _id("item")
        self.speech_item = None
        await self._commit_audio(bytes(self.buffer), item_id, ev.event_id)
        self.buffer_start_ms += ms
        self.buffer.clear()

    async def _commit_audio(self, pcm: bytes, item_id: str, event_id: str | None) -> None:
        x = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
        audio = resample(x, PCM_RATE, THINKER_RATE).astype(np.float32)  # for the thinker
        used = sum(len(v) for it in self.items for k, v in it.parts if k == "audio")
        if (used + len(audio)) / THINKER_RATE > self.limits.max_conversation_audio_seconds:
            raise RealtimeProtocolError(
                f"input_audio_buffer: the conversation would hold more than "
                f"{self.limits.max_conversation_audio_seconds:g} s of audio",
                "input_audio_buffer", event_id, code="conversation_too_long")
        previous = self.items[-1].id if self.items else None
        item = Item(item_id, "user", [("audio", audio)])
        await self.send({"type": "input_audio_buffer.committed", "previous_item_id": previous,
                         "item_id": item_id})
        await self._add_item(item, previous)
        if self.config.audio.input.transcription is not None:  # (beside the response)
            self.transcriber.start(item, self.config.audio.input.transcription)

    async def _response_submitted(self) -> None:
        """An input transcription starts once the response it rides beside is in the engine,
        never ahead of it (bounded: a response is submitted or ended within a prepare)."""
        if self.response is not None:
            await asyncio.wait([asyncio.ensure_future(self.response.submitted.wait())],
                               timeout=10.0)

    async def _clear(self, ev: BufferClear) -> None:
        self.buffer_start_ms += self._ms(len(self.buffer) // 2)
        self.buffer.clear()
        self.speech_item = None
        await self.send({"type": "input_audio_buffer.cleared"})

    # ------------------------------------------------------------------ items
    async def _add_item(self, item: ConversationEntry, previous: str | None) -> None:
        if len(self.items) >= self.limits.max_items:
            self.items.pop(0)  # oldest first (OpenAI's truncation: auto)
        self.items.append(item)
        await self.send({"type": "conversation.item.added", "previous_item_id": previous,
                         "item": item.event_item()})
        await self.send({"type": "conversation.item.done", "previous_item_id": previous,
                         "item": item.event_item()})

    async def _item_create(self, ev: ItemCreate) -> None:
        ids = {it.id for it in self.items}
        if ev.item.id is not None and ev.item.id in ids:
            raise RealtimeProtocolError(f"item.id: {ev.item.id!r} is already in the "
                                        "conversation", "item.id", ev.event_id)
        if ev.previous_item_id is not None and ev.previous_item_id not in ids:
            raise RealtimeProtocolError(f"previous_item_id: no item {ev.previous_item_id!r}",
                                        "previous_item_id", ev.event_id)
        previous = ev.previous_item_id or (self.items[-1].id if self.items else None)
        if isinstance(ev.item, FunctionCallItem):
            c = ev.item
            await self._add_item(CallItem(c.id or _id("item"), c.call_id, c.name, c.arguments),
                                 previous)
            return
        if isinstance(ev.item, FunctionCallOutputItem):
            o = ev.item
            if not any(isinstance(it, CallItem) and it.call_id == o.call_id
                       for it in self.items):
                raise RealtimeProtocolError(f"item.call_id: no function_call {o.call_id!r} in "
                                            "the conversation", "item.call_id", ev.event_id)
            await self._add_item(CallOutputItem(o.id or _id("item"), o.call_id, o.output),
                                 previous)
            return
        m: MessageItem = ev.item
        parts: list[tuple[str, Any]] = []
        for j, part in enumerate(m.content):
            where = f"item.content[{j}]"
            if part.type == "input_audio":
                if m.role != "user":
                    raise RealtimeProtocolError(f"{where}.type: {m.role} items take text only",
                                                f"{where}.type", ev.event_id)
                raw = _b64(part.audio, f"{where}.audio", ev.event_id)
                if len(raw) % 2 or not raw:
                    raise RealtimeProtocolError(f"{where}.audio: pcm16 needs a non-empty, even "
                                                "number of bytes", f"{where}.audio", ev.event_id)
                x = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
                parts.append(("audio", resample(x, PCM_RATE, THINKER_RATE).astype(np.float32)))
            elif (part.type == "input_text") != (m.role != "assistant"):
                raise RealtimeProtocolError(f"{where}.type: {part.type!r} does not fit a "
                                            f"{m.role} item", f"{where}.type", ev.event_id)
            else:
                parts.append(("text", part.text))
        item = Item(m.id or _id("item"), m.role, parts)
        if m.role == "assistant":
            item.transcript = "".join(v for _, v in parts)
        await self._add_item(item, previous)

    async def _truncate(self, ev: ItemTruncate) -> None:
        item = next((it for it in self.items if it.id == ev.item_id), None)
        if item is None or item.role != "assistant":
            raise RealtimeProtocolError(f"item_id: no assistant item {ev.item_id!r}", "item_id",
                                        ev.event_id)
        if ev.content_index != 0:
            raise RealtimeProtocolError("content_index: must be 0", "content_index", ev.event_id)
        if self.response is not None and self.response.item is item:
            await self.cancel_response("client_cancelled")
        played = ev.audio_end_ms * PCM_RATE // 1000
        if played > item.audio_samples:
            raise RealtimeProtocolError(
                f"audio_end_ms: {ev.audio_end_ms} is past the item's audio "
                f"({self._ms(item.audio_samples)} ms)", "audio_end_ms", ev.event_id)
        self._cut_transcript(item, played)
        await self.send({"type": "conversation.item.truncated", "item_id": item.id,
                         "content_index": 0, "audio_end_ms": ev.audio_end_ms})

    def _cut_transcript(self, item: Item, played: int) -> None:
        item.cut_to_played(played, self.clock.samples_per_code, lambda ids: (
            self.state.llm.tokenizer.decode(ids, skip_special_tokens=True)))

    # ------------------------------------------------------------------ responses
    async def _response_create(self, ev: ResponseCreate) -> None:
        if self.response is not None:
            raise RealtimeProtocolError(
                f"response: {self.response.id} is in progress; cancel it or wait for its "
                "response.done", "response", ev.event_id, code="conversation_already_has_"
                "active_response")
        await self._start_response(ev.response, ev.event_id)

    async def _response_cancel(self, ev: ResponseCancel) -> None:
        resp = self.response
        if resp is None or (ev.response_id is not None and ev.response_id != resp.id):
            raise RealtimeProtocolError("response_id: no response in progress"
                                        + (f" with id {ev.response_id!r}" if ev.response_id
                                           else ""), "response_id", ev.event_id,
                                        code="response_cancel_not_active")
        await self.cancel_response("client_cancelled")

    def _sampling(self, cfg: SessionConfig, max_tokens: int | str, event_id: str | None,
                  structured=None):
        s = cfg.sampling
        top = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
               "repetition_penalty": s.repetition_penalty,
               "max_tokens": None if max_tokens == "inf" else max_tokens,
               "structured_output": structured}  # (a forced call's grammar)
        try:
            return build_sampling(self.state, top, None, s.seed)
        except APIError as e:
            param = f"session.sampling.{e.param}" if e.param else "session.sampling"
            raise RealtimeProtocolError(f"session.sampling: {e.message}", param,
                                        event_id) from e

    async def _start_response(self, params, event_id: str | None) -> None:
        cfg = self.config
        if params and (params.tools is not None or params.tool_choice is not None):
            cfg = cfg.model_copy(update={k: getattr(params, k) for k in ("tools", "tool_choice")
                                         if getattr(params, k) is not None})
            rt_tools.check_session_tools(cfg, event_id, where="response")
        modalities = (params.output_modalities if params and params.output_modalities
                      else cfg.output_modalities)
        max_tokens = params.max_output_tokens if params and params.max_output_tokens \
            is not None else cfg.max_output_tokens
        instructions = params.instructions if params and params.instructions is not None \
            else cfg.instructions
        if not any(it.role in ("user", "function_call_output") for it in self.items):
            raise RealtimeProtocolError("response: the conversation has no user item yet",
                                        "response", event_id)
        if modalities == ["audio"] and "audio" not in self.state.output_modalities:
            raise RealtimeProtocolError("response.output_modalities: this model gives text "
                                        "only", "response.output_modalities", event_id)
        # tool_choice required / a named function: the answer is one call, by grammar
        forced = rt_tools.forced_output(cfg) if rt_tools.tools_active(cfg) else None
        sampling = self._sampling(cfg, max_tokens, event_id, forced)
        item = Item(_id("item"), "assistant", [("text", "")], status="in_progress",
                    audio=modalities == ["audio"] and forced is None)
        resp = Response(_id("resp"), item, modalities, cfg.audio.output.voice, max_tokens,
                        forced=forced is not None)
        if rt_tools.tools_active(cfg):
            resp.tools = IncrementalToolCallParser()
        prompt: dict[str, Any] = {"messages": rt_tools.session_messages(self.items,
                                                                         instructions, cfg)}
        if resp.voice is not None and item.audio:
            prompt["voice"] = resp.voice
        try:
            self.state.acquire()
        except APIError as e:
            raise RealtimeProtocolError(e.message, "response", event_id, code=e.code or
                                        "server_busy") from e
        self.response = resp
        self.num_responses += 1
        resp.task = asyncio.get_running_loop().create_task(self._run(resp, prompt, sampling))

    def _response_object(self, resp: Response) -> dict[str, Any]:
        details = None
        if resp.status in ("cancelled", "incomplete"):
            details = {"type": resp.status, "reason": resp.reason}
        elif resp.status == "failed":
            details = {"type": "failed", "error": {"type": "server_error",
                                                   "code": "generation_failed",
                                                   "message": resp.error}}
        return {"id": resp.id, "object": "realtime.response", "status": resp.status,
                "status_details": details, "conversation_id": self.id,
                "output_modalities": resp.modalities,
                "output": [it.event_item() for it in resp.output_items()]
                if resp.status != "in_progress" else [],
                "audio": {"output": {"format": {"type": "audio/pcm", "rate": PCM_RATE},
                                     "voice": resp.voice}},
                "max_output_tokens": resp.max_output_tokens, "usage": resp.usage}

    def _where(self, resp: Response) -> dict[str, Any]:
        return {"response_id": resp.id, "item_id": resp.item.id,
                "output_index": resp.message_index or 0}

    async def _open_message(self, resp: Response) -> None:
        """The response's message item (with tools, only once it has something to say)."""
        if resp.message_index is not None:
            return
        item, previous = resp.item, self.items[-1].id if self.items else None
        resp.message_index = len(resp.calls)
        await self.send({"type": "response.output_item.added", "response_id": resp.id,
                         "output_index": resp.message_index, "item": item.event_item()})
        self.items.append(item)
        await self.send({"type": "conversation.item.added", "previous_item_id": previous,
                         "item": item.event_item()})
        part = {"type": "audio", "transcript": ""} if item.audio else \
            {"type": "text", "text": ""}
        await self.send({"type": "response.content_part.added", **self._where(resp),
                         "content_index": 0, "part": part})

    async def _run(self, resp: Response, prompt: dict[str, Any], sampling) -> None:
        """The response's events and its request; ended by _end (here, or by cancel)."""
        llm, item = self.state.llm, resp.item
        resp.rid = f"realtime-{resp.id}"
        outputs = None
        try:
            await self.send({"type": "response.created",
                             "response": self._response_object(resp)})
            if resp.tools is None:
                await self._open_message(resp)
            modalities = ["text", "audio"] if item.audio else ["text"]
            # (prepared and submitted by the preparation thread: the loop may be busy)
            _, outputs = await llm.start(prompt, sampling, modalities, request_id=resp.rid)
            resp.submitted.set()
            async for out in outputs:
                await self._deltas(resp, out)
                if out.finished:
                    resp.cached_tokens = out.metrics.num_cached_tokens
                    if out.error:
                        resp.status, resp.error = "failed", out.error
                    resp.usage = response_usage(out, self.state.codec_stage)
                    if not out.error and item.audio and not resp.calls:
                        self.clock.observe(item.audio_samples, item.codes)
                    if resp.tools is not None and not out.error:
                        await self._tool_text(resp, resp.tools.finish())
                        if (resp.forced and not resp.calls) or any(  # (cut off)
                                c.status == "incomplete" for c in resp.calls):
                            resp.status, resp.reason = "incomplete", "max_output_tokens"
        except ValueError as e:  # the request was refused (e.g. the conversation is too long)
            resp.status, resp.error = "failed", str(e)
        except RuntimeShutDown:
            resp.status, resp.error = "failed", "the server is shutting down"
        except asyncio.CancelledError:
            if resp.status == "in_progress":  # not our cancel: the session is closing
                raise
            return  # cancel_response ends it
        finally:
            if outputs is not None:  # (aborts the request unless it finished)
                outputs.close()
        if resp.status == "in_progress":
            resp.status = "completed"
        await self._end(resp)

    async def _deltas(self, resp: Response, out) -> None:
        item = resp.item
        item.text_ids = list(out.token_ids)
        codec = self.state.codec_stage
        if codec is not None and codec in out.stages:  # (the last output)
            item.codes = len(out.stages[codec].token_ids)
        if out.text_delta and resp.tools is not None:
            await self._tool_text(resp, resp.tools.feed(out.text_delta))
        elif out.text_delta:
            await self._text(resp, out.text_delta)
        if out.audio is not None and len(out.audio) and item.audio and not (
                resp.tools is not None and (resp.calls or resp.tools.call_open)):
            # (with tools, audio stops where a call begins: a call is not said)
            await self._open_message(resp)
            wave = out.audio
            if out.sample_rate and out.sample_rate != PCM_RATE:
                wave = resample(wave, out.sample_rate, PCM_RATE)
            pcm = to_pcm16(wave)
            item.audio_samples += len(pcm)
            await self.send({"type": "response.output_audio.delta", **self._where(resp),
                             "content_index": 0,
                             "delta": base64.b64encode(pcm.tobytes()).decode()})

    async def _text(self, resp: Response, text: str) -> None:
        await self._open_message(resp)
        resp.item.transcript += text
        kind = "response.output_audio_transcript.delta" if resp.item.audio else \
            "response.output_text.delta"
        await self.send({"type": kind, **self._where(resp), "content_index": 0,
                         "delta": text})

    async def _tool_text(self, resp: Response, events: list) -> None:
        """The tool parser's events: text for the message (none for a forced call), calls as
        their arguments stream (tools.send_call_event: OpenAI's events of a call)."""
        for ev in events:
            if not isinstance(ev, ContentPiece):
                await rt_tools.send_call_event(self.send, resp, self.items, ev)
            elif not resp.forced:
                await self._text(resp, ev.text)

    async def cancel_response(self, reason: str) -> None:
        """Abort the response in every stage (AsyncOmniLLM.abort, then the consumer task is
        cancelled, which aborts again if needed) and end it with status cancelled."""
        if (resp := await self._stop_response(reason)) is not None:
            if resp.task is not None:  # (a cancelled send lets go of the lock at once)
                await asyncio.gather(resp.task, return_exceptions=True)
            await self._end(resp)

    async def _stop_response(self, reason: str) -> Response | None:
        """Cancelled: the abort queued to the runtime, the consumer task cancelled (no delta
        is sent after this), waiting for neither. The response, if one runs."""
        resp = self.response
        if resp is None or resp.ended:
            return None
        resp.status, resp.reason = "cancelled", reason
        if resp.rid:
            await self.state.llm.abort(resp.rid)  # (a put on the runtime's control queue)
        if resp.task is not None and not resp.task.done() and not resp.task.cancelling():
            resp.task.cancel()
        return resp

    async def _end(self, resp: Response) -> None:
        if resp.ended:
            return
        resp.ended = True
        resp.submitted.set()
        self.response = None
        self.last_response = resp
        self.state.release()
        item = resp.item
        item.status = "completed" if resp.status == "completed" else "incomplete"
        rt_tools.end_open_calls(resp)  # (cancelled inside a call)
        if resp.status == "cancelled" and item.audio and not resp.calls:
            self._cut_transcript(item, item.audio_samples)  # text past the audio: not said
        if resp.message_index is None and not resp.calls and not resp.forced:
            if resp.tools is None:  # (cancelled before its item was added)
                resp.message_index = 0
                self.items.append(item)
            elif resp.status != "cancelled":  # (it said nothing and called nothing)
                await self._open_message(resp)
        if resp.message_index is not None:
            await self._message_done(resp)
        await self.send({"type": "response.done", "response": self._response_object(resp)})
        log.info("%s: %s %s (%d text tokens, %d audio samples, %d calls, %d cached prompt "
                 "tokens)", self.id, resp.id, resp.status, len(item.text_ids),
                 item.audio_samples, len(resp.calls), resp.cached_tokens)

    async def _message_done(self, resp: Response) -> None:
        item = resp.item
        where = self._where(resp)
        if item.audio:
            await self.send({"type": "response.output_audio.done", **where, "content_index": 0})
            await self.send({"type": "response.output_audio_transcript.done", **where,
                             "content_index": 0, "transcript": item.transcript})
            part = {"type": "audio", "transcript": item.transcript}
        else:
            await self.send({"type": "response.output_text.done", **where, "content_index": 0,
                             "text": item.transcript})
            part = {"type": "text", "text": item.transcript}
        await self.send({"type": "response.content_part.done", **where, "content_index": 0,
                         "part": part})
        await self.send({"type": "response.output_item.done", "response_id": resp.id,
                         "output_index": where["output_index"], "item": item.event_item()})
        await self.send({"type": "conversation.item.done", "item": item.event_item()})

    # ------------------------------------------------------------------ close
    async def close(self) -> None:
        """The socket closed: abort the response in every stage; send nothing more."""
        resp = self.response
        self.closed = True
        if resp is not None and not resp.ended:
            resp.status, resp.reason = "cancelled", "client_disconnected"
            if resp.rid:
                await self.state.llm.abort(resp.rid)
            if resp.task is not None:
                resp.task.cancel()
                await asyncio.gather(resp.task, return_exceptions=True)
            await self._end(resp)
        await self.transcriber.close()
        self.items.clear()
        self.buffer.clear()


def _b64(data: str, param: str, event_id: str | None) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RealtimeProtocolError(f"{param}: invalid base64: {e}", param, event_id) from e
