"""Input audio transcription (session.audio.input.transcription): each committed user audio
item is transcribed by the session's own model, the thinker, with the ASR prompt of
/v1/audio/transcriptions (asr_messages, greedy, the same reply cap), as a request of its own
that runs beside the response: submitted after it (so never ahead of it in the engine's
queue), then run concurrently with it, and never waited for by it. Its text streams as
conversation.item.input_audio_transcription.delta events, then .completed (or .failed)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from omnistage.entrypoints.async_llm import RuntimeShutDown
from omnistage.entrypoints.openai.protocol import APIError
from omnistage.entrypoints.openai.realtime.items import Item
from omnistage.entrypoints.openai.realtime.protocol import (InputTranscription,
                                                            RealtimeProtocolError)
from omnistage.entrypoints.openai.serving import ServerState, build_sampling
from omnistage.entrypoints.openai.serving_transcriptions import (asr_messages,
                                                                 transcription_max_tokens)

log = logging.getLogger("omnistage.realtime")
THINKER_RATE = 16000


def check_transcription(cfg: InputTranscription | None, state: ServerState, model: str,
                        event_id: str | None) -> None:
    """session.audio.input.transcription: the session's own model, one that hears audio."""
    if cfg is None:
        return
    where = "session.audio.input.transcription"
    if cfg.model not in (model, *state.config.served_model_names):
        raise RealtimeProtocolError(f"{where}.model: {cfg.model!r}; this server transcribes with "
                                    f"the session's model {model!r}", f"{where}.model", event_id)
    processor = getattr(state.llm.pipeline, "processor", None)
    if "audio" not in getattr(processor, "placeholders", {}):
        raise RealtimeProtocolError(f"{where}: this model does not take audio input", where,
                                    event_id)


class InputTranscriber:
    """The transcriptions of one session in flight: started on commit, aborted on close."""

    def __init__(self, state: ServerState, session_id: str,
                 send: Callable[[dict[str, Any]], Awaitable[None]],
                 response_first: Callable[[], Awaitable[None]]) -> None:
        self.state, self.session_id, self.send = state, session_id, send
        self.response_first = response_first  # waits until the response is submitted
        self.running: dict[str, asyncio.Task] = {}  # request id -> its task
        self.num_done = 0

    def start(self, item: Item, cfg: InputTranscription) -> None:
        audio = next(v for k, v in item.parts if k == "audio")
        rid = f"realtime-trsc-{item.id}"
        task = asyncio.get_running_loop().create_task(self._run(item, audio, cfg, rid))
        self.running[rid] = task
        task.add_done_callback(lambda _: self.running.pop(rid, None))

    async def _failed(self, item: Item, message: str, code: str) -> None:
        log.info("%s: transcription of %s failed: %s", self.session_id, item.id, message)
        await self.send({"type": "conversation.item.input_audio_transcription.failed",
                         "item_id": item.id, "content_index": 0,
                         "error": {"type": "transcription_error", "code": code,
                                   "message": message, "param": None}})

    async def _run(self, item: Item, audio: Any, cfg: InputTranscription, rid: str) -> None:
        st, llm = self.state, self.state.llm
        seconds = len(audio) / THINKER_RATE
        params = build_sampling(st, {"temperature": 0.0, "max_tokens": transcription_max_tokens(
            seconds, st.max_model_len)}, None, None)
        try:
            st.acquire()  # (bounded with every other request of the server)
        except APIError as e:
            await self._failed(item, e.message, e.code or "server_busy")
            return
        last = outputs = None
        try:
            await self.response_first()  # (the response goes first: never delayed by this)
            prompt = {"messages": asr_messages(audio, cfg.language, cfg.prompt)}
            _, outputs = await llm.start(prompt, params, ["text"], request_id=rid)
            async for out in outputs:
                if out.text_delta:
                    await self.send({"type": "conversation.item.input_audio_transcription.delta",
                                     "item_id": item.id, "content_index": 0,
                                     "delta": out.text_delta})
                last = out
        except ValueError as e:  # refused (e.g. the clip does not fit the context)
            await self._failed(item, str(e), "invalid_audio")
            return
        except RuntimeShutDown:
            await self._failed(item, "the server is shutting down", "shutting_down")
            return
        finally:
            st.release()
            if outputs is not None:  # (aborts the request unless it finished)
                outputs.close()
        if last is None or last.error:
            await self._failed(item, last.error if last is not None else "no output",
                               "generation_failed")
            return
        item.transcript = last.text
        self.num_done += 1
        n_in, n_out = len(last.prompt_token_ids), len(last.token_ids)
        await self.send({"type": "conversation.item.input_audio_transcription.completed",
                         "item_id": item.id, "content_index": 0, "transcript": last.text,
                         "usage": {"type": "tokens", "input_tokens": n_in,
                                   "output_tokens": n_out, "total_tokens": n_in + n_out}})

    async def close(self) -> None:
        """Abort every transcription in flight in the engine, then end its task."""
        for rid, task in list(self.running.items()):
            await self.state.llm.abort(rid)
            task.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)
        self.running.clear()
