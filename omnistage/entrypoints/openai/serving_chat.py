"""POST /v1/chat/completions: OpenAI chat messages -> AsyncOmniLLM requests (one per choice,
`n`) -> a `chat.completion` (text, `tool_calls`, and audio in `message.audio`) or an SSE stream
of `chat.completion.chunk`s (`delta.content`, `delta.tool_calls`, or `delta.audio` transcript
deltas and pcm16 chunks).

NOTE (n > 1): choice i is the request with every seed it sets increased by i (a request without
a seed: each choice draws its own); its output equals that request sent alone. Choice 0 runs
first: once its first token is out, its prompt's KV blocks are in the prefix cache and the
other choices, started then, prefill only the last partial block."""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
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

from omnistage.entrypoints.openai import tool_calls as tools_api
from omnistage.entrypoints.openai.metrics import mark_outcome
from omnistage.entrypoints.openai.protocol import (AudioOutputParams, ChatCompletionRequest,
                                                   ChatMessage, ImageURLPart, InputAudioPart,
                                                   TextPart, APIError, VideoURLPart)
from omnistage.entrypoints.openai.serving import (finish_reason, token_logprob, with_audio_codes,
                                                  ClientGone, ManagedStreamingResponse,
                                                  client_gone, close_stream,
                                                  release_unless_handed_over,
                                                  RequestStream, ServerShuttingDown,
                                                  ServerState, build_sampling,
                                                  collect, encode_audio, first_output, log,
                                                  runtime_error, seconds, sse, start_request,
                                                  to_pcm16, usage)
from omnistage.outputs import OmniRequestOutput
from omnistage.sampling_params import SamplingParams, stage_seed

PCM16_INPUT_RATE = 24000  # OpenAI's pcm16: raw int16 little-endian mono at 24 kHz
_MORE, _ENDED, _FAILED = range(3)  # a choice's state after an output (OpenAIServingChat._sse)


def _b64(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise APIError(400, f"{where}: invalid base64: {e}", param=where) from e


def choice_params(params: dict[str, SamplingParams] | None, index: int
                  ) -> dict[str, SamplingParams] | None:
    """Choice `index`'s per-stage params: every seed set increased by `index` (module note)."""
    if not index or params is None:
        return params
    return {name: p if p.seed is None else dataclasses.replace(p, seed=stage_seed(p.seed, index))
            for name, p in params.items()}


class OpenAIServingChat:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    # ------------------------------------------------------------------ entry
    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        st = self.state
        st.check_model(body.model)
        modalities = ["text"] + [m for m in dict.fromkeys(body.modalities or []) if m != "text"]
        fmt = voice = None
        if "audio" in modalities:
            if "audio" not in st.output_modalities:
                raise APIError(400, f"modalities: this model gives {st.output_modalities}",
                               param="modalities")
            audio = body.audio or AudioOutputParams()
            voice, fmt = st.resolve_voice(audio.voice, "audio.voice"), audio.format
        tools_api.check_tools(body)
        if body.tools and fmt is not None:
            raise APIError(400, "tools: not with audio output (modalities)", param="tools")
        structured = (tools_api.forced_call_output(body) if tools_api.forced(body)
                      else tools_api.response_format_output(body))
        prompt: dict[str, Any] = {"messages": await self._messages(body.messages)}
        if body.tools:
            prompt["tools"] = tools_api.template_tools(body)
        if voice is not None:
            prompt["voice"] = voice
        fields = body.chat_sampling_fields()
        if structured is not None:
            # (EOS is allowed only where the grammar is complete: it must stay reachable)
            for name in ("ignore_eos", "min_tokens"):
                if fields.get(name):
                    what = "a forced tool call" if tools_api.forced(body) else "response_format"
                    raise APIError(400, f"{name}: cannot be combined with {what}", param=name)
            fields["structured_output"] = structured
        stages = body.stage_sampling_params
        if fmt is not None:  # audio out: never a 200 with no audio
            stages = with_audio_codes(st, stages)
        params = build_sampling(st, fields, stages, body.seed)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        ctx = _Ctx(rid, body, fmt, int(time.time()), st.llm.tokenizer)
        streams: list[RequestStream] = []
        acquired = 0
        handed_over = False
        try:
            for _ in range(body.n):  # one admission slot per choice
                st.acquire()
                acquired += 1
            firsts = []
            for i in range(body.n):  # choice 0 first: the others hit its cached prompt
                crid = rid if body.n == 1 else f"{rid}-{i}"
                streams.append(await start_request(st, request, prompt,
                                                   choice_params(params, i), modalities, crid))
                if i == 0:
                    firsts.append(await first_output(streams[0]))
            firsts += await asyncio.gather(*(first_output(s) for s in streams[1:]))
            choices = [_Choice(i, s, f, ctx) for i, (s, f) in enumerate(zip(streams, firsts))]
            log.info("%s: chat stream=%s n=%d modalities=%s voice=%s prompt_tokens=%d", rid,
                     body.stream, body.n, modalities, voice,
                     len(choices[0].first.prompt_token_ids))
            if body.stream:
                handed_over = True
                return ManagedStreamingResponse(
                    self._sse(choices, ctx), lambda: self._close(streams, rid),
                    media_type="text/event-stream", headers={"X-Request-Id": rid})
            return JSONResponse(await self._complete(choices, ctx),
                                headers={"X-Request-Id": rid})
        except ClientGone:
            return client_gone(st, rid, "chat")
        finally:
            if not handed_over:
                for stream in streams:
                    release_unless_handed_over(st, stream, False)
                for _ in range(acquired - len(streams)):
                    st.release()

    def _close(self, streams: list[RequestStream], rid: str) -> None:
        for stream in streams:
            close_stream(self.state, stream, rid, "chat")

    # ------------------------------------------------------------------ input
    async def _messages(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(messages):
            role = "system" if m.role == "developer" else m.role
            if m.tool_calls is not None and role != "assistant":
                raise APIError(400, f"messages[{i}].tool_calls: only assistant messages have "
                               "tool calls", param=f"messages[{i}].tool_calls")
            if m.content is None and not m.tool_calls:
                raise APIError(400, f"messages[{i}].content: is required",
                               param=f"messages[{i}].content")
            if m.tool_calls or role == "tool":  # text only (the template's tool layout)
                out.append(self._tool_message(i, m, role))
                continue
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

    @staticmethod
    def _tool_message(i: int, m: ChatMessage, role: str) -> dict[str, Any]:
        """A tool result, or an assistant turn with calls, as Qwen's template takes them."""
        text = m.content or ""
        if not isinstance(text, str):
            for j, part in enumerate(text):
                if not isinstance(part, TextPart):
                    where = f"messages[{i}].content[{j}]"
                    raise APIError(400, f"{where}: {role} messages take text parts only",
                                   param=where)
            text = "".join(part.text for part in text)
        msg: dict[str, Any] = {"role": role, "content": text}
        if role == "tool":
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            return msg
        msg["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": tools_api.call_arguments(
                 c.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments")}}
            for j, c in enumerate(m.tool_calls or [])]
        return msg

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
    async def _complete(self, choices: list[_Choice], ctx: _Ctx) -> dict[str, Any]:
        results = await asyncio.gather(*(self._complete_one(c) for c in choices))
        st = self.state
        audio_stage = st.codec_stage if ctx.fmt else None
        return {"id": ctx.rid, "object": "chat.completion", "created": ctx.created,
                "model": ctx.body.model, "system_fingerprint": None,
                "choices": [r[0] for r in results],
                "usage": _total_usage([usage(r[1], audio_stage) for r in results])}

    async def _complete_one(self, choice: _Choice) -> tuple[dict[str, Any], OmniRequestOutput]:
        ctx, first = choice.ctx, choice.first
        chunks = [first.audio] if first.audio is not None else []
        last = first
        if not first.finished:
            last, rest = await collect(choice.stream)
            if rest is not None:
                chunks.append(rest)
        if last.error:
            raise runtime_error(last.error, produced=bool(last.token_ids))
        self._finished(last, ctx)
        message: dict[str, Any] = {"role": "assistant", "content": last.text, "refusal": None}
        reason = self._reason(last)
        if tools_api.parses_calls(ctx.body):
            content, calls = tools_api.parse_tool_calls(last.text)
            if calls:
                message["content"], message["tool_calls"] = content, calls
                reason = "tool_calls" if reason == "stop" else reason
        if ctx.fmt is not None:
            wave = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
            data, _ = encode_audio(wave, last.sample_rate or 24000, ctx.fmt)
            message["content"] = None  # as OpenAI: the text is the audio's transcript
            message["audio"] = {"id": choice.audio_id,
                                "data": base64.b64encode(data).decode(),
                                "expires_at": ctx.created + self.state.config.audio_expiry_seconds,
                                "transcript": last.text}
        return ({"index": choice.index, "message": message,
                 "logprobs": ctx.logprobs(last.token_ids, last.logprobs),
                 "finish_reason": reason}, last)

    async def _sse(self, choices: list[_Choice], ctx: _Ctx) -> AsyncIterator[str]:
        """The SSE body. What a choice has piled up (text deltas and audio chunks of one
        runtime pass) goes out as one write; one choice is awaited directly (no task per
        output), several through asyncio.wait."""
        include_usage = bool(ctx.body.stream_options and ctx.body.stream_options.include_usage)
        yield "".join(sse(ctx.chunk(c.index, {"role": "assistant",
                                              "content": None if ctx.fmt else ""},
                                    include_usage)) for c in choices)
        outs: dict[int, OmniRequestOutput | None] = {c.index: c.first for c in choices}
        pending: dict[asyncio.Future, _Choice] = {}
        finals: list[OmniRequestOutput] = []
        try:
            while outs or pending:
                for index, out in list(outs.items()):
                    del outs[index]
                    c = choices[index]
                    events: list[str] = []
                    state = self._sse_events(c, out, ctx, include_usage, events, finals)
                    while state == _MORE and (out := c.stream.next_nowait()) is not None:
                        state = self._sse_events(c, out, ctx, include_usage, events, finals)
                    if events:
                        yield "".join(events)
                    if state == _FAILED:
                        return
                    if state == _MORE:
                        if len(choices) == 1:
                            outs[index] = await c.stream.next()
                        else:
                            pending[asyncio.ensure_future(c.stream.next())] = c
                if not pending:
                    continue
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    c = pending.pop(fut)
                    outs[c.index] = fut.result()
            if include_usage:
                u = _total_usage([usage(o, self.state.codec_stage if ctx.fmt else None)
                                  for o in finals])
                yield sse(ctx.chunk(0, None, include_usage, usage=u))
        except ClientGone:
            mark_outcome(choices[0].stream.scope, "499")
            return
        except ServerShuttingDown as e:  # the drain deadline passed: end the stream in order
            mark_outcome(choices[0].stream.scope, "error")
            yield sse(e.body())
        finally:
            for fut in pending:
                fut.cancel()
        yield sse("[DONE]")

    def _sse_events(self, c: _Choice, out: OmniRequestOutput | None, ctx: _Ctx,
                    include_usage: bool, events: list[str], finals: list[OmniRequestOutput]
                    ) -> int:
        """Append one output's SSE events to `events`: _MORE (more outputs to come), _ENDED
        (the choice is done) or _FAILED (an error event and [DONE] were appended: the stream
        ends)."""
        if out is None:  # (ended without a finished output: nothing more to send)
            return _ENDED
        if out.error:
            err = runtime_error(out.error, produced=bool(out.token_ids))
            self._finished(out, ctx)
            mark_outcome(c.stream.scope, "error")
            events += [sse(err.body()), sse("[DONE]")]
            return _FAILED
        for delta, logprobs, audio in c.deltas(out):
            events.append(sse(ctx.chunk(c.index, delta, include_usage, logprobs=logprobs),
                              audio))
        if not out.finished:
            return _MORE
        self._finished(out, ctx)
        finals.append(out)
        for delta, _ in c.flush():
            events.append(sse(ctx.chunk(c.index, delta, include_usage)))
        final = {"audio": {"id": c.audio_id, "expires_at": ctx.created +
                           self.state.config.audio_expiry_seconds}} if ctx.fmt else {}
        reason = self._reason(out)
        if c.tools is not None and c.tools.num_calls and reason == "stop":
            reason = "tool_calls"
        events.append(sse(ctx.chunk(c.index, final, include_usage, reason)))
        return _ENDED

    def _reason(self, out: OmniRequestOutput) -> str:
        return finish_reason(self.state, out)

    def _finished(self, out: OmniRequestOutput, ctx: _Ctx) -> None:
        self.state.metrics.observe_finished("chat", out)
        m = out.metrics
        log.info("%s: finished error=%s tokens=%s ttft=%s ttfa=%s e2e=%s", ctx.rid, out.error,
                 m.tokens_per_stage, seconds(m.ttft), seconds(m.ttfa), seconds(m.e2e))


def _total_usage(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The choices' usage together: the prompt once, the completions summed (OpenAI's n)."""
    total = parts[0]
    for u in parts[1:]:
        for key in ("completion_tokens", "total_tokens"):
            total[key] += u[key]
        for key in ("text_tokens", "audio_tokens", "reasoning_tokens"):
            total["completion_tokens_details"][key] += u["completion_tokens_details"][key]
    total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
    return total


class _Ctx:
    """One chat request's response identity and chunk builders."""

    def __init__(self, rid: str, body: ChatCompletionRequest, fmt: str | None,
                 created: int, tokenizer: Any) -> None:
        self.rid, self.body, self.fmt, self.created = rid, body, fmt, created
        self.tokenizer = tokenizer

    def chunk(self, index: int, delta: dict | None, include_usage: bool,
              finish: str | None = None, usage: dict | None = None,
              logprobs: dict | None = None) -> dict[str, Any]:
        c: dict[str, Any] = {"id": self.rid, "object": "chat.completion.chunk",
                             "created": self.created, "model": self.body.model,
                             "system_fingerprint": None,
                             "choices": [] if delta is None else
                             [{"index": index, "delta": delta, "logprobs": logprobs,
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


class _Choice:
    """One choice's request and its streaming state."""

    def __init__(self, index: int, stream: RequestStream, first: OmniRequestOutput,
                 ctx: _Ctx) -> None:
        self.index, self.stream, self.first, self.ctx = index, stream, first, ctx
        self.audio_id = "audio_" + ctx.rid.removeprefix("chatcmpl-") + \
            (f"_{index}" if ctx.body.n > 1 else "")
        self.pending_logprobs: list[dict[int, float]] = []  # streamed with the next text delta
        self.tools = tools_api.ToolCallStream() if tools_api.parses_calls(ctx.body) else None

    def deltas(self, out: OmniRequestOutput
               ) -> list[tuple[dict[str, Any], dict | None, str | None]]:
        """(delta, its logprobs, its base64 audio): the text (or transcript) delta, then the
        audio chunk, base64 pcm16 for sse() to splice into the delta's empty "data". Tokens
        whose text is held back keep their logprobs for the next text delta; with tools, the
        text goes through the tool-call parser."""
        deltas: list[tuple[dict[str, Any], dict | None, str | None]] = []
        ctx = self.ctx
        self.pending_logprobs += out.logprobs_delta or []
        if out.text_delta:
            lps = ctx.logprobs(out.token_ids, self.pending_logprobs)
            self.pending_logprobs = []
            if self.tools is not None:
                parsed = self.tools.feed(out.text_delta)
                deltas += [(d, lps if k == 0 else None, None) for k, d in enumerate(parsed)]
            else:
                deltas.append(({"audio": {"id": self.audio_id, "transcript": out.text_delta}}
                               if ctx.fmt else {"content": out.text_delta}, lps, None))
        timeline = self.stream.timeline
        if deltas and timeline is not None:
            timeline.mark_text()
        if ctx.fmt and out.audio is not None and len(out.audio):
            data = base64.b64encode(to_pcm16(out.audio).tobytes()).decode()
            deltas.append(({"audio": {"id": self.audio_id, "data": ""}}, None, data))
            if timeline is not None:
                timeline.mark_audio()
        return deltas

    def flush(self) -> list[tuple[dict[str, Any], dict | None]]:
        """What the tool-call parser still holds, at the end of the answer."""
        return [(d, None) for d in self.tools.finish()] if self.tools is not None else []
