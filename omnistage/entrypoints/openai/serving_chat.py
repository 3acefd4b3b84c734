"""POST /v1/chat/completions: OpenAI chat messages -> one AsyncOmniLLM request -> a
`chat.completion` (text, and audio in `message.audio`) or an SSE stream of `chat.completion.chunk`s
(`delta.content`, or `delta.audio` transcript deltas and pcm16 chunks)."""

from __future__ import annotations

import base64
import binascii
import io
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import soundfile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omnistage.entrypoints.openai.metrics import mark_outcome
from omnistage.entrypoints.openai.protocol import (AudioOutputParams, ChatCompletionRequest,
                                                   ChatMessage, ImageURLPart, InputAudioPart,
                                                   TextPart, APIError, VideoURLPart)
from omnistage.entrypoints.openai.serving import (finish_reason, token_logprob,
                                                  ClientGone, ManagedStreamingResponse,
                                                  client_gone, close_stream,
                                                  release_unless_handed_over,
                                                  RequestStream, ServerShuttingDown,
                                                  ServerState, build_sampling,
                                                  collect, encode_audio, first_output, log,
                                                  runtime_error, seconds, sse, start_request,
                                                  to_pcm16, usage)
from omnistage.outputs import OmniRequestOutput

PCM16_INPUT_RATE = 24000  # OpenAI's pcm16: raw int16 little-endian mono at 24 kHz


def _b64(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise APIError(400, f"{where}: invalid base64: {e}", param=where) from e


class OpenAIServingChat:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    # ------------------------------------------------------------------ entry
    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        st = self.state
        st.check_model(body.model)
        if body.n != 1:
            raise APIError(400, f"n: only 1 choice per request is supported, got {body.n}",
                           param="n")
        modalities = ["text"] + [m for m in dict.fromkeys(body.modalities or []) if m != "text"]
        fmt = voice = None
        if "audio" in modalities:
            if "audio" not in st.output_modalities:
                raise APIError(400, f"modalities: this model gives {st.output_modalities}",
                               param="modalities")
            audio = body.audio or AudioOutputParams()
            voice, fmt = st.resolve_voice(audio.voice, "audio.voice"), audio.format
        prompt: dict[str, Any] = {"messages": await self._messages(body.messages)}
        if voice is not None:
            prompt["voice"] = voice
        params = build_sampling(st, body.chat_sampling_fields(), body.stage_sampling_params,
                                body.seed)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        st.acquire()
        stream = None
        handed_over = False
        try:
            stream = await start_request(st, request, prompt, params, modalities, rid)
            first = await first_output(stream)
            log.info("%s: chat stream=%s modalities=%s voice=%s prompt_tokens=%d", rid,
                     body.stream, modalities, voice, len(first.prompt_token_ids))
            ctx = _Ctx(rid, body, fmt, int(time.time()), st.llm.tokenizer)
            if body.stream:
                handed_over = True
                return ManagedStreamingResponse(
                    self._sse(stream, first, ctx), lambda: self._close(stream, rid),
                    media_type="text/event-stream", headers={"X-Request-Id": rid})
            return JSONResponse(await self._complete(stream, first, ctx),
                                headers={"X-Request-Id": rid})
        except ClientGone:
            return client_gone(st, rid, "chat")
        finally:
            release_unless_handed_over(st, stream, handed_over)

    def _close(self, stream: RequestStream, rid: str) -> None:
        close_stream(self.state, stream, rid, "chat")

    # ------------------------------------------------------------------ input
    async def _messages(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(messages):
            role = "system" if m.role == "developer" else m.role
            if m.content is None:
                raise APIError(400, f"messages[{i}].content: is required",
                               param=f"messages[{i}].content")
            if isinstance(m.content, str):
                out.append({"role": role, "content": m.content})
                continue
            parts = []
            for j, part in enumerate(m.content):
                where = f"messages[{i}].content[{j}]"
                if role != "user" and not isinstance(part, TextPart):
                    raise APIError(400, f"{where}: {role} messages take text parts only",
                                   param=where)
                parts.append(await self._part(part, where))
            out.append({"role": role, "content": parts})
        return out

    async def _part(self, part, where: str) -> dict[str, Any]:
        if isinstance(part, TextPart):
            return {"type": "text", "text": part.text}
        if isinstance(part, InputAudioPart):
            field = f"{where}.input_audio.data"
            raw = _b64(part.input_audio.data, field)
            if part.input_audio.format == "pcm16":
                if len(raw) % 2:
                    raise APIError(400, f"{field}: pcm16 needs an even number of bytes",
                                   param=field)
                audio: Any = (np.frombuffer(raw, "<i2").copy(), PCM16_INPUT_RATE)
                seconds = len(raw) / 2 / PCM16_INPUT_RATE
            else:  # the header gives the length; the processor decodes it
                try:
                    info = soundfile.info(io.BytesIO(raw))
                except (soundfile.LibsndfileError, RuntimeError, TypeError) as e:
                    raise APIError(400, f"{field}: cannot decode audio: {e}", param=field) from e
                audio, seconds = raw, info.frames / max(info.samplerate, 1)
            limit = self.state.config.max_audio_seconds
            if seconds > limit:
                raise APIError(400, f"{field}: audio is {seconds:.1f} s long, more than this "
                               f"server's limit of {limit:g} s", param=field,
                               code="audio_too_long")
            return {"type": "audio", "audio": audio}
        if isinstance(part, ImageURLPart):
            return {"type": "image", "image": await self._media(part.image_url.url,
                                                                f"{where}.image_url.url", False)}
        if isinstance(part, VideoURLPart):
            return {"type": "video", "video": await self._media(part.video_url.url,
                                                                f"{where}.video_url.url", True)}
        raise APIError(400, f"{where}: unsupported content part", param=where)

    async def _media(self, url: str, where: str, local_ok: bool) -> bytes | str:
        cfg = self.state.config
        if url.startswith("data:"):
            header, sep, payload = url.partition(",")
            if not sep or not header.endswith(";base64"):
                raise APIError(400, f"{where}: a data URL must be base64 (data:<type>;base64,...)",
                               param=where)
            return _b64(payload, where)
        if url.startswith(("http://", "https://")):
            if not cfg.allow_remote_media:
                raise APIError(400, f"{where}: remote URLs are disabled on this server (start it "
                               "with --allow-remote-media); send a data URL", param=where)
            return await self._fetch(url, where)
        if local_ok and cfg.allow_local_media:
            return url.removeprefix("file://")
        hint = " or a local path (with --allow-local-media)" if local_ok else ""
        raise APIError(400, f"{where}: expected a data URL{hint}", param=where)

    async def _fetch(self, url: str, where: str) -> bytes:
        limit = self.state.config.max_request_bytes
        try:
            async with httpx.AsyncClient(timeout=self.state.config.remote_media_timeout,
                                         follow_redirects=True) as client:
                async with client.stream("GET", url) as resp:
                    resp.raise_for_status()
                    data = bytearray()
                    async for chunk in resp.aiter_bytes():
                        data += chunk
                        if len(data) > limit:
                            raise APIError(400, f"{where}: larger than {limit} bytes",
                                           param=where)
                    return bytes(data)
        except httpx.HTTPError as e:
            raise APIError(400, f"{where}: cannot fetch: {e}", param=where) from e

    # ------------------------------------------------------------------ output
    async def _complete(self, stream: RequestStream, first: OmniRequestOutput,
                        ctx: _Ctx) -> dict[str, Any]:
        chunks = [first.audio] if first.audio is not None else []
        last = first
        if not first.finished:
            last, rest = await collect(stream)
            if rest is not None:
                chunks.append(rest)
        if last.error:
            raise runtime_error(last.error, produced=bool(last.token_ids))
        self._finished(last, ctx)
        st = self.state
        message: dict[str, Any] = {"role": "assistant", "content": last.text, "refusal": None}
        if ctx.fmt is not None:
            wave = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
            data, _ = encode_audio(wave, last.sample_rate or 24000, ctx.fmt)
            message["content"] = None  # as OpenAI: the text is the audio's transcript
            message["audio"] = {"id": ctx.audio_id, "data": base64.b64encode(data).decode(),
                                "expires_at": ctx.created + st.config.audio_expiry_seconds,
                                "transcript": last.text}
        return {"id": ctx.rid, "object": "chat.completion", "created": ctx.created,
                "model": ctx.body.model, "system_fingerprint": None,
                "choices": [{"index": 0, "message": message,
                             "logprobs": ctx.logprobs(last.token_ids, last.logprobs),
                             "finish_reason": self._reason(last)}],
                "usage": usage(last, st.codec_stage if ctx.fmt else None)}

    async def _sse(self, stream: RequestStream, first: OmniRequestOutput,
                   ctx: _Ctx) -> AsyncIterator[str]:
        include_usage = bool(ctx.body.stream_options and ctx.body.stream_options.include_usage)
        yield sse(ctx.chunk({"role": "assistant", "content": None if ctx.fmt else ""},
                            include_usage))
        out = first
        try:
            while out is not None:
                if out.error:
                    err = runtime_error(out.error, produced=bool(out.token_ids))
                    self._finished(out, ctx)
                    mark_outcome(stream.scope, "error")
                    yield sse(err.body())
                    break
                for delta, logprobs in ctx.deltas(out):
                    yield sse(ctx.chunk(delta, include_usage, logprobs=logprobs))
                if out.finished:
                    self._finished(out, ctx)
                    final = {"audio": {"id": ctx.audio_id, "expires_at": ctx.created +
                                       self.state.config.audio_expiry_seconds}} if ctx.fmt else {}
                    yield sse(ctx.chunk(final, include_usage, self._reason(out)))
                    if include_usage:
                        u = usage(out, self.state.codec_stage if ctx.fmt else None)
                        yield sse(ctx.chunk(None, include_usage, usage=u))
                    break
                out = await stream.next()
        except ClientGone:
            mark_outcome(stream.scope, "499")
            return
        except ServerShuttingDown as e:  # the drain deadline passed: end the stream in order
            mark_outcome(stream.scope, "error")
            yield sse(e.body())
        yield sse("[DONE]")

    def _reason(self, out: OmniRequestOutput) -> str:
        return finish_reason(self.state, out)

    def _finished(self, out: OmniRequestOutput, ctx: _Ctx) -> None:
        self.state.metrics.observe_finished("chat", out)
        m = out.metrics
        log.info("%s: finished error=%s tokens=%s ttft=%s ttfa=%s e2e=%s", ctx.rid, out.error,
                 m.tokens_per_stage, seconds(m.ttft), seconds(m.ttfa), seconds(m.e2e))


class _Ctx:
    """One chat request's response identity and chunk builders."""

    def __init__(self, rid: str, body: ChatCompletionRequest, fmt: str | None,
                 created: int, tokenizer: Any) -> None:
        self.rid, self.body, self.fmt, self.created = rid, body, fmt, created
        self.tokenizer = tokenizer
        self.audio_id = "audio_" + rid.removeprefix("chatcmpl-")
        self.pending_logprobs: list[dict[int, float]] = []  # streamed with the next text delta

    def chunk(self, delta: dict | None, include_usage: bool, finish: str | None = None,
              usage: dict | None = None, logprobs: dict | None = None) -> dict[str, Any]:
        c: dict[str, Any] = {"id": self.rid, "object": "chat.completion.chunk",
                             "created": self.created, "model": self.body.model,
                             "system_fingerprint": None,
                             "choices": [] if delta is None else
                             [{"index": 0, "delta": delta, "logprobs": logprobs,
                               "finish_reason": finish}]}
        if include_usage:
            c["usage"] = usage
        return c

    def logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None
                 ) -> dict[str, Any] | None:
        """OpenAI's `choices[].logprobs` for these tokens (their engine logprobs: the token's
        own first, then the top ones); None when the request asked for none."""
        if not self.body.logprobs or logprobs is None:
            return None
        k = self.body.top_logprobs or 0
        content = []
        for token, lps in zip(token_ids[len(token_ids) - len(logprobs):], logprobs):
            top = sorted(lps.items(), key=lambda item: -item[1])[:k]
            content.append({**self._token(token, lps[token]),
                            "top_logprobs": [self._token(t, lp) for t, lp in top]})
        return {"content": content, "refusal": None}

    def _token(self, token: int, logprob: float) -> dict[str, Any]:
        text, logprob = token_logprob(self.tokenizer, token, logprob)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def deltas(self, out: OmniRequestOutput) -> list[tuple[dict[str, Any], dict | None]]:
        """(delta, its logprobs): the text (or transcript) delta, then the audio chunk as base64
        pcm16. Tokens whose text is held back keep their logprobs for the next text delta."""
        deltas: list[tuple[dict[str, Any], dict | None]] = []
        self.pending_logprobs += out.logprobs_delta or []
        if out.text_delta:
            lps = self.logprobs(out.token_ids, self.pending_logprobs)
            self.pending_logprobs = []
            deltas.append(({"audio": {"id": self.audio_id, "transcript": out.text_delta}}
                           if self.fmt else {"content": out.text_delta}, lps))
        if self.fmt and out.audio is not None and len(out.audio):
            data = base64.b64encode(to_pcm16(out.audio).tobytes()).decode()
            deltas.append(({"audio": {"id": self.audio_id, "data": data}}, None))
        return deltas
