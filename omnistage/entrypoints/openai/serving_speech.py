"""POST /v1/audio/speech: speak exactly the given text. The thinker's reply is forced to the
input's tokens (prompt key `forced_reply`, no sampling), so the talker and code2wav voice that
text. Formats: wav, flac, aiff, mp3, opus, ogg (whole file), pcm (streamed as it is made);
`stream_format: "sse"` streams `speech.audio.delta` events (base64 pcm16 for pcm, else the
whole file in one delta) and ends with `speech.audio.done` (usage, transcript); a stream the
server's shutdown cuts short ends with an error event and `[DONE]`."""

from __future__ import annotations

import base64
import contextlib
import uuid
from collections.abc import AsyncIterator
from urllib.parse import quote

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from omnistage.entrypoints.openai.metrics import mark_outcome
from omnistage.entrypoints.openai.protocol import APIError, SpeechRequest
from omnistage.entrypoints.openai.serving import (ClientGone, ManagedStreamingResponse,
                                                  client_gone, close_stream, with_audio_codes,
                                                  release_unless_handed_over,
                                                  RequestStream, ServerShuttingDown,
                                                  ServerState, build_sampling,
                                                  collect, encode_audio, first_output, log,
                                                  runtime_error, seconds, sse, start_request,
                                                  to_pcm16)
from omnistage.outputs import OmniRequestOutput

MAX_TRANSCRIPT_HEADER = 8192


def no_audio(out: OmniRequestOutput) -> APIError:
    """A request that finished without error but with no audio (e.g. the talker stopped at
    once): never an empty 200."""
    log.warning("%s: finished without audio (%s codec codes)", out.request_id,
                out.metrics.tokens_per_stage)
    return APIError(500, "no audio was generated for this input; retry, or change the input "
                    "or seed", type_="server_error", code="no_audio_generated")


class OpenAIServingSpeech:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, body: SpeechRequest, request: Request) -> Response:
        st = self.state
        st.check_model(body.model)
        if "audio" not in st.output_modalities:
            raise APIError(400, "model: this model does not speak (no audio output)",
                           param="model")
        voice = st.resolve_voice(body.voice, "voice")
        if body.speed != 1.0:
            raise APIError(400, f"speed: only 1.0 is supported, got {body.speed}", param="speed")
        prompt = {"messages": [{"role": "user", "content": body.input}],
                  "forced_reply": body.input, "voice": voice}
        params = build_sampling(st, {}, with_audio_codes(st, None), body.seed)
        rid = f"speech-{uuid.uuid4().hex}"
        st.acquire()
        stream = None
        handed_over = False
        try:
            stream = await start_request(st, request, prompt, params, ["text", "audio"], rid)
            first = await first_output(stream)
            log.info("%s: speech format=%s stream_format=%s voice=%s chars=%d", rid,
                     body.response_format, body.stream_format, voice, len(body.input))
            if body.stream_format == "sse" or body.response_format in ("pcm", "pcm16"):
                # the status line waits for the first audio (text outputs carry none), so that
                # a request that makes no audio is an error, not an empty 200
                first = await self._first_audio(stream, first)
                handed_over = True
                gen = self._sse(stream, first, body, rid) if body.stream_format == "sse" \
                    else self._pcm(stream, first, rid)
                media = "text/event-stream" if body.stream_format == "sse" else "audio/pcm"
                return ManagedStreamingResponse(gen, lambda: self._close(stream, rid),
                                                media_type=media, headers={"X-Request-Id": rid})
            last, audio = await self._rest(stream, first)
            data, media = encode_audio(audio, last.sample_rate or 24000, body.response_format)
            headers = {"X-Request-Id": rid,
                       "X-Codec-Tokens": str(last.metrics.tokens_per_stage.get(st.codec_stage, 0))}
            transcript = quote(last.text, safe="")
            if len(transcript) <= MAX_TRANSCRIPT_HEADER:  # clients bound header sizes
                headers["X-Transcript"] = transcript
            return Response(data, media_type=media, headers=headers)
        except ClientGone:
            return client_gone(st, rid, "speech")
        finally:
            release_unless_handed_over(st, stream, handed_over)

    def _close(self, stream: RequestStream, rid: str) -> None:
        close_stream(self.state, stream, rid, "speech")

    async def _rest(self, stream: RequestStream, first: OmniRequestOutput):
        """(last output, the whole waveform) from `first` on; a failed request raises."""
        chunks = [first.audio] if first.audio is not None else []
        last = first
        if not first.finished:
            last, rest = await collect(stream)
            if rest is not None:
                chunks.append(rest)
        if last.error:
            raise runtime_error(last.error, produced=bool(last.token_ids))
        self._finished(last)
        audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        if not len(audio):
            raise no_audio(last)
        return last, audio

    async def _first_audio(self, stream: RequestStream, out: OmniRequestOutput
                           ) -> OmniRequestOutput:
        """The first output, from `out` on, that carries audio; a request that fails or ends
        without any raises APIError."""
        while not (out.audio is not None and len(out.audio)):
            if out.finished:
                if out.error:
                    raise runtime_error(out.error, produced=bool(out.token_ids))
                self._finished(out)
                raise no_audio(out)
            nxt = await stream.next()
            if nxt is None:
                raise APIError(500, "the request ended without output", type_="server_error")
            out = nxt
        return out

    def _finished(self, out: OmniRequestOutput) -> None:
        self.state.metrics.observe_finished("speech", out)
        m = out.metrics
        log.info("%s: finished error=%s tokens=%s ttfa=%s e2e=%s", out.request_id, out.error,
                 m.tokens_per_stage, seconds(m.ttfa), seconds(m.e2e))

    async def _outputs(self, stream: RequestStream, first: OmniRequestOutput
                       ) -> AsyncIterator[OmniRequestOutput]:
        """The outputs from `first` on; ends quietly when the client goes away; raises
        ServerShuttingDown when the server ends the stream."""
        out = first
        try:
            while out is not None:
                yield out
                if out.finished:
                    self._finished(out)
                    return
                out = await stream.next()
        except ClientGone:
            mark_outcome(stream.scope, "499")
            return

    async def _pcm(self, stream: RequestStream, first: OmniRequestOutput,
                   rid: str) -> AsyncIterator[bytes]:
        try:
            async for out in self._outputs(stream, first):
                if out.error:  # the status line is gone: end the body early, say it in the log
                    log.warning("%s: failed mid-stream: %s", rid, out.error)
                    mark_outcome(stream.scope, "error")
                    return
                if out.audio is not None and len(out.audio):
                    yield to_pcm16(out.audio).tobytes()
        except ServerShuttingDown:  # raw audio has no error event: the body ends cleanly
            mark_outcome(stream.scope, "error")

    async def _sse(self, stream: RequestStream, first: OmniRequestOutput, body: SpeechRequest,
                   rid: str) -> AsyncIterator[str]:
        try:
            async with contextlib.aclosing(self._sse_events(stream, first, body)) as events:
                async for event in events:
                    yield event
        except ServerShuttingDown as e:  # the drain deadline passed: end the stream in order
            mark_outcome(stream.scope, "error")
            yield sse(e.body())
            yield sse("[DONE]")

    async def _sse_events(self, stream: RequestStream, first: OmniRequestOutput,
                          body: SpeechRequest) -> AsyncIterator[str]:
        raw = body.response_format in ("pcm", "pcm16")
        chunks = []
        async for out in self._outputs(stream, first):
            if out.error:
                mark_outcome(stream.scope, "error")
                yield sse(runtime_error(out.error, produced=True).body())
                return
            if out.audio is not None and len(out.audio):
                if raw:
                    yield sse({"type": "speech.audio.delta",
                               "audio": base64.b64encode(to_pcm16(out.audio).tobytes()).decode()})
                else:
                    chunks.append(out.audio)
            if out.finished:
                if not raw:
                    wave = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
                    data, _ = encode_audio(wave, out.sample_rate or 24000, body.response_format)
                    yield sse({"type": "speech.audio.delta",
                               "audio": base64.b64encode(data).decode()})
                n_in = len(out.prompt_token_ids)
                n_out = out.metrics.tokens_per_stage.get(self.state.codec_stage, 0)
                yield sse({"type": "speech.audio.done", "transcript": out.text,
                           "usage": {"input_tokens": n_in, "output_tokens": n_out,
                                     "total_tokens": n_in + n_out}})
