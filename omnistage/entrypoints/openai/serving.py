"""What the chat and speech endpoints share: server state (config, admission, metrics, the
shutdown drain), one request's output stream (watching the client), OpenAI -> SamplingParams,
audio encoding."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import io
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import soundfile
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from omnistage.entrypoints.async_llm import NotAdmitted, RequestOutputs, RuntimeShutDown
from omnistage.entrypoints.openai.metrics import RECEIVED_KEY, ServerMetrics, mark_outcome
from omnistage.entrypoints.openai.protocol import APIError, StageSamplingParams
from omnistage.outputs import OmniRequestOutput
from omnistage.sampling_params import SamplingParams

log = logging.getLogger("omnistage.server")

# response format -> (soundfile format, subtype, int16 samples?, media type)
_ENCODINGS = {
    "wav": ("WAV", "PCM_16", True, "audio/wav"),
    "flac": ("FLAC", "PCM_16", True, "audio/flac"),
    "aiff": ("AIFF", "PCM_16", True, "audio/aiff"),
    "mp3": ("MP3", "MPEG_LAYER_III", False, "audio/mpeg"),
    "opus": ("OGG", "OPUS", False, "audio/ogg; codecs=opus"),
    "ogg": ("OGG", "VORBIS", False, "audio/ogg"),
}
_PCM_MEDIA_TYPE = "audio/pcm"
# shutdown: after the drain deadline, how long the requests ended then have to send their last
# bytes (an error event and [DONE], or a 503), and how often the drain looks at what is left
END_GRACE_SECONDS = 5.0
_DRAIN_POLL_SECONDS = 0.05


SWITCH_INTERVAL_MS = (0.05, 100.0)  # the bounds of ServerConfig.switch_interval_ms


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    max_queue: int = 256  # generation requests in flight; more get 429
    max_request_bytes: int = 64 << 20
    allow_remote_media: bool = False  # fetch http(s) image/video URLs
    allow_local_media: bool = False  # video_url may name a file on the server
    remote_media_timeout: float = 10.0
    max_audio_seconds: float = 300.0  # per input audio part
    shutdown_timeout: float = 30.0
    audio_expiry_seconds: int = 3600
    # requests waiting for or in request preparation (tokenising, media decoding); more get 429
    max_pending_prepares: int = 64
    # Python's GIL switch interval once serving (server.set_switch_interval; Python's: 5 ms)
    switch_interval_ms: float = 0.5

    def validate(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError("served_model_name: at least one non-empty name")
        if self.max_queue < 1:
            raise ValueError(f"max_queue: must be >= 1, got {self.max_queue}")
        if not self.max_audio_seconds > 0:
            raise ValueError(f"max_audio_seconds: must be > 0, got {self.max_audio_seconds}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes: must be >= 1024, got {self.max_request_bytes}")
        if self.max_pending_prepares < 1:
            raise ValueError(f"max_pending_prepares: must be >= 1, got "
                             f"{self.max_pending_prepares}")
        if not SWITCH_INTERVAL_MS[0] <= self.switch_interval_ms <= SWITCH_INTERVAL_MS[1]:
            raise ValueError(f"switch_interval_ms: {SWITCH_INTERVAL_MS[0]} to "
                             f"{SWITCH_INTERVAL_MS[1]}, got {self.switch_interval_ms}")


class ServerShuttingDown(APIError):
    """The server is shutting down: a request that came while draining, or one still running at
    the drain deadline. A 503 where no response has started; a stream ends with it as its error
    event (SSE) or ends its body (raw pcm)."""

    def __init__(self) -> None:
        super().__init__(503, "the server is shutting down", type_="server_error",
                         code="shutting_down")


class ServerState:
    """Shared by the endpoints. Only touched from the event loop (no locking)."""

    def __init__(self, llm, config: ServerConfig) -> None:
        config.validate()
        self.llm, self.config = llm, config
        self.in_flight = 0
        self.draining = False  # refusing new requests (503)
        self.ending = False  # past the drain deadline: the requests left are being ended
        self.streams: set[RequestStream] = set()  # requests in the runtime, not closed yet
        self.metrics = ServerMetrics(llm, lambda: self.in_flight)
        self.voices: list[str] = sorted(llm.pipeline.voices)
        self.output_modalities: list[str] = list(llm.pipeline.output_modalities)
        self.first_stage = llm.stage_names[0]
        # (not an engine's: a stage may run in a process of its own)
        self.max_model_len = llm.pipeline.max_model_len
        # the stage whose tokens are codec codes: the one before the audio stage
        names = llm.stage_names
        self.codec_stage = names[-2] if "audio" in self.output_modalities and len(names) > 2 \
            else None

    # ------------------------------------------------------------------ checks
    def check_model(self, name: str) -> None:
        if name not in self.config.served_model_names:
            raise APIError(404, f"The model {name!r} does not exist; this server serves "
                           f"{self.config.served_model_names}", param="model",
                           code="model_not_found")

    def resolve_voice(self, voice: str | None, param: str) -> str | None:
        if voice is None:
            return None
        by_lower = {v.lower(): v for v in self.voices}
        if voice.lower() not in by_lower:
            raise APIError(400, f"{param}: voice {voice!r} is not available; this model's voices "
                           f"are {self.voices}", param=param, code="invalid_voice")
        return by_lower[voice.lower()]

    # ------------------------------------------------------------------ admission
    def acquire(self) -> None:
        """Take an in-flight slot or refuse: 503 while draining, 429 when full (requests in
        flight, or requests waiting for preparation). The caller must start its preparation
        (start_request) before it next awaits, so that the count it was admitted on holds."""
        if self.draining:
            raise ServerShuttingDown()
        if self.in_flight >= self.config.max_queue:
            self._refuse(f"{self.in_flight} requests in flight")
        if self.llm.preparing >= self.config.max_pending_prepares:
            self._refuse(f"{self.llm.preparing} requests waiting for preparation")
        self.in_flight += 1

    def _refuse(self, why: str) -> None:
        self.metrics.rejected.inc()
        raise APIError(429, f"the server is at capacity ({why}); retry later",
                       type_="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": "1"})

    def release(self) -> None:
        self.in_flight -= 1

    # ------------------------------------------------------------------ shutdown
    async def drain(self, timeout: float, forced: Callable[[], bool]) -> None:
        """Shutdown, on the event loop: refuse new requests, wait up to `timeout` s for those in
        flight, then end the rest (RequestStream.end: a stream's error event and [DONE], a 503
        where no response started) and wait up to END_GRACE_SECONDS for their last bytes to go
        out. The caller stops the engine after this. `forced()` true: stop waiting."""
        self.draining = True
        await self._wait_idle(timeout, forced)
        if not self.in_flight:
            return
        rids = sorted(s.rid for s in self.streams)
        log.warning("shutdown: %d request(s) still running after the %.0f s drain; ending them "
                    "with error 'shutting_down': %s", self.in_flight, timeout, rids)
        self.ending = True
        for stream in list(self.streams):
            stream.end()
        await self._wait_idle(END_GRACE_SECONDS, forced)
        if self.in_flight:
            log.warning("shutdown: %d request(s) did not end within %.0f s (preparing, or their "
                        "client is not reading); stopping anyway", self.in_flight,
                        END_GRACE_SECONDS)

    async def _wait_idle(self, timeout: float, forced: Callable[[], bool]) -> None:
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline and not forced():
            await asyncio.sleep(_DRAIN_POLL_SECONDS)


# ------------------------------------------------------------------ sampling
def with_audio_codes(state: ServerState, stages: dict[str, StageSamplingParams] | None
                     ) -> dict[str, StageSamplingParams]:
    """`stages` with the codec stage (the talker) drawing at least one code: a talker whose
    first draw is its stop code would make no audio, and a 200 with no audio is no answer."""
    out = dict(stages or {})
    talker = state.codec_stage
    if talker is None:
        return out
    given = out.get(talker)
    floor = (given.min_tokens if given is not None and given.min_tokens is not None
             else state.llm.pipeline.default_params[talker].min_tokens)
    update = {"min_tokens": max(1, floor)}
    out[talker] = (given.model_copy(update=update) if given is not None
                   else StageSamplingParams(**update))
    return out


def build_sampling(state: ServerState, top: dict[str, Any],
                   stages: dict[str, StageSamplingParams] | None,
                   seed: int | None) -> dict[str, SamplingParams] | None:
    """Top-level OpenAI fields go to the first stage (the thinker); `stage_sampling_params`
    sets any stage over the pipeline's defaults. A request `seed` seeds the first stage; the
    pipeline derives the others (thinker s, talker s+1, code2wav s+2)."""
    names = state.llm.stage_names
    defaults = state.llm.pipeline.default_params
    for name in stages or {}:
        if name not in names:
            raise APIError(400, f"stage_sampling_params: unknown stage {name!r}; stages: {names}",
                           param=f"stage_sampling_params.{name}")
    out: dict[str, SamplingParams] = {}
    for name in names:
        fields = {k: v for k, v in top.items() if v is not None} if name == names[0] else {}
        if seed is not None and name == names[0]:
            fields["seed"] = seed
        if stages and name in stages:
            fields.update(stages[name].model_dump(exclude_none=True))
        if fields:
            out[name] = dataclasses.replace(defaults.get(name, SamplingParams()), **fields)
            try:  # every stage given, also those this request's modalities leave out
                out[name].validate(f"stage_sampling_params.{name}")
            except ValueError as e:
                raise value_error(e) from e
    first = out.get(names[0])
    if first is not None and first.max_tokens is not None and \
            first.max_tokens >= state.max_model_len:
        raise APIError(400, f"max_tokens: {first.max_tokens} is more than this model's context "
                       f"allows (max_model_len {state.max_model_len})", param="max_tokens")
    return out or None


def value_error(e: ValueError) -> APIError:
    """generate()'s ValueError ('prompts[0].messages[1].content[0].audio: ...') -> a 400."""
    msg = re.sub(r"^(prompts|sampling_params)\[0\]\.?", "", str(e))
    param = msg.split(":", 1)[0] if ":" in msg else None
    return APIError(400, msg, param=param if param and " " not in param else None)


def runtime_error(error: str, produced: bool) -> APIError:
    """An error that came back in a request's output."""
    if error.startswith("stage ") or "shut down" in error:
        return APIError(500 if error.startswith("stage ") else 503, error, type_="server_error")
    if "timed out" in error:
        return APIError(504, error, type_="server_error", code="timeout")
    if not produced:  # refused by a stage on submit (e.g. a prompt over a stage's limit)
        return APIError(400, error)
    return APIError(500, error, type_="server_error")


# ------------------------------------------------------------------ one request's stream
class ClientGone(Exception):
    """The HTTP client disconnected."""


@dataclass
class RequestTimeline:
    """When one request passed each point of the server path (time.monotonic() seconds; None:
    not reached): the HTTP request received (RequestCounter, outermost), prepared (tokenised,
    off the preparation pool), taken in by the runtime loop (the RuntimeRequest's arrival,
    set on the runtime's thread), the first text and audio events written (chat streams).
    ServerMetrics.observe_timeline turns it into the omnistage_server_* histograms."""

    received: float
    prepared: float | None = None
    runtime_request: Any = None  # (its `arrival`: 0.0 until the runtime took it in)
    first_text: float | None = None
    first_audio: float | None = None

    @property
    def admitted(self) -> float | None:
        arrival = getattr(self.runtime_request, "arrival", 0.0)
        return arrival or None

    def mark_text(self) -> None:
        if self.first_text is None:
            self.first_text = time.monotonic()

    def mark_audio(self) -> None:
        if self.first_audio is None:
            self.first_audio = time.monotonic()


class RequestStream:
    """Runs one request's outputs (llm.start()'s RequestOutputs, or any async iterator) in a
    task of its own so that a client disconnect (polled every `poll` seconds) or cancel()
    aborts it in every stage: cancel() cancels the task and closes RequestOutputs, which
    aborts the request in the runtime even if the task never ran. end() (server shutdown)
    makes the consumer's next() raise ServerShuttingDown."""

    def __init__(self, gen: AsyncIterator[OmniRequestOutput], request: Request | None,
                 poll: float = 0.25, rid: str = "",
                 timeline: RequestTimeline | None = None) -> None:
        self.request, self.poll, self.rid = request, poll, rid
        self.scope = request.scope if request is not None else None  # (for mark_outcome)
        self.timeline = timeline
        # the generator's outputs, then None (its end), or the exception that ended it; a
        # waiting next() sleeps on `_waiter` (one future per wait: no task, no queue getter)
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self.finished = False
        self.ended = False  # by end(): the server is shutting down
        self._exhausted = False  # the generator's end was taken
        self._next_check = time.monotonic() + poll
        self._gen = gen
        self._task = asyncio.get_running_loop().create_task(self._pump(gen))

    def _put(self, item: OmniRequestOutput | Exception | None) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _pump(self, gen) -> None:
        try:
            async for out in gen:
                self._put(out)
        except Exception as e:  # noqa: BLE001 - handed to the consumer, who raises it
            self._put(e)  # ValueError: generate() rejected the request (a 400)
        finally:
            self._put(None)

    async def next(self) -> OmniRequestOutput | None:
        """The next output; None after the last. Raises ValueError (bad request), ClientGone,
        ServerShuttingDown (after end()), or whatever else ended the generator."""
        while True:
            if self.ended:
                raise ServerShuttingDown()
            if self._exhausted:
                return None
            if self.request is not None and time.monotonic() >= self._next_check:
                # checked on a clock, not only when idle: outputs may never pause
                self._next_check = time.monotonic() + self.poll
                if await self.request.is_disconnected():
                    self.cancel()
                    raise ClientGone()
            if self._items:  # (the usual case under load: nothing to wait for)
                return self._take(self._items.popleft())
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(self.poll, _wake, waiter)  # to look at the client again
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None

    def next_nowait(self) -> OmniRequestOutput | None:
        """The next output if one is waiting, else None (then next() waits for it, or returns
        the end); raises as next() does. For writing what has piled up in one go."""
        if self._exhausted or not self._items:
            return None
        return self._take(self._items.popleft())

    def _take(self, item: OmniRequestOutput | Exception | None) -> OmniRequestOutput | None:
        if self.ended:
            raise ServerShuttingDown()
        if isinstance(item, Exception):
            raise item
        if item is None:
            self._exhausted = True  # (next() answers None from now on)
        elif item.finished:
            self.finished = True
        return item

    def end(self) -> None:
        """The server is shutting down: next() raises ServerShuttingDown from now on, at once if
        it is waiting. The request runs on until cancel()."""
        self.ended = True
        self._put(None)  # wakes a waiting next()

    def cancel(self) -> bool:
        """Abort the request if it has not finished; True if it had to be aborted. A next()
        waiting meanwhile raises CancelledError."""
        if self._waiter is not None:
            self._waiter.cancel()
        if self._task.done():
            return False
        self._task.cancel()
        # (outputs of a request already submitted abort it at once, even if the pump task
        # never ran: an async generator's cleanup would not run then)
        if isinstance(self._gen, RequestOutputs):
            self._gen.close()
        return not self.finished


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def start_request(state: ServerState, request: Request | None, prompt: Any, params: Any,
                        modalities: list[str] | None, rid: str,
                        bad_request: Callable[[ValueError], APIError] = value_error
                        ) -> RequestStream:
    """Prepare the request on the engine's preparation pool (off the event loop; a ValueError
    becomes `bad_request(e)`, a 400) and start it from there (llm.start: the runtime takes it
    in without waiting for this loop), in a RequestStream watching `request`
    (ServerShuttingDown instead when the server is shutting down)."""
    received = request.scope.get(RECEIVED_KEY) if request is not None else None
    timeline = RequestTimeline(received if received is not None else time.monotonic())

    def admit(req: Any) -> bool:  # (on the preparation thread, just before the submission)
        timeline.prepared, timeline.runtime_request = time.monotonic(), req
        return not state.ending

    try:
        _, outputs = await state.llm.start(prompt, params, modalities, request_id=rid,
                                           admit=admit)
        if state.ending:  # (it ended while this loop had not yet taken the request back)
            outputs.close()
            raise NotAdmitted(f"request {rid}: the server is shutting down")
    except ValueError as e:
        raise bad_request(e) from e
    except (RuntimeShutDown, NotAdmitted) as e:  # (dropped from the queue, or refused)
        log.info("%s: not started, the server is shutting down (503)", rid)
        raise ServerShuttingDown() from e
    stream = RequestStream(outputs, request, rid=rid, timeline=timeline)
    state.streams.add(stream)
    return stream


async def first_output(stream: RequestStream) -> OmniRequestOutput:
    """The request's first output; a rejected or failed-at-once request raises APIError."""
    try:
        first = await stream.next()
    except ValueError as e:
        raise value_error(e) from e
    if first is None:
        raise APIError(500, "the request ended without output", type_="server_error")
    if first.finished and first.error:
        raise runtime_error(first.error, produced=bool(first.token_ids))
    return first


async def collect(stream: RequestStream) -> tuple[OmniRequestOutput, np.ndarray | None]:
    """Run a request to its end: (last output, the whole audio or None)."""
    chunks: list[np.ndarray] = []
    last = None
    while (out := await stream.next()) is not None:
        if out.audio is not None:
            chunks.append(out.audio)
        last = out
    if last is None:
        raise APIError(500, "the request ended without output", type_="server_error")
    audio = None
    if chunks or any(s.audio is not None for s in last.stages.values()):
        audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    return last, audio


def client_gone(state: ServerState, rid: str, endpoint: str) -> Response:
    """The client disconnected before the response started: count it; 499 (nginx's code)."""
    state.metrics.aborted.labels(endpoint).inc()
    log.info("%s: aborted, the client disconnected", rid)
    return Response(status_code=499)


def release_unless_handed_over(state: ServerState, stream: RequestStream | None,
                               handed_over: bool) -> None:
    """A handler is leaving: unless a streaming response owns the request now, stop it and give
    its queue slot back."""
    if not handed_over:
        if stream is not None:
            state.metrics.observe_timeline(stream.timeline)
            state.streams.discard(stream)
            if stream.cancel() and stream.ended:
                log.info("%s: aborted before its response started (503): the server is "
                         "shutting down", stream.rid)
        state.release()


def close_stream(state: ServerState, stream: RequestStream, rid: str, endpoint: str) -> None:
    """A streamed response ended: abort the request if it was still running (the client went
    away, or the server is shutting down), and give its queue slot back."""
    state.metrics.observe_timeline(stream.timeline)
    state.streams.discard(stream)
    if stream.cancel():
        if stream.ended:  # (its generator sent the error and marked the outcome)
            log.info("%s: aborted mid-stream: the server is shutting down", rid)
        else:
            state.metrics.aborted.labels(endpoint).inc()
            mark_outcome(stream.scope, "499")
            log.info("%s: aborted, the client disconnected", rid)
    state.release()


class ManagedStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends (done, error, disconnect, or
    never started). It streams without Starlette's disconnect listener (a task group and a
    task per response, on the event loop): its content reads a RequestStream, which polls the
    client and aborts the request when it has gone."""

    def __init__(self, content, on_close, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.stream_response(send)
        except OSError as e:  # (a server on ASGI spec 2.4 says so: the client has gone)
            raise ClientDisconnect() from e
        finally:
            self._on_close()


_EMPTY_DATA = '"data":""'


def sse(data: dict[str, Any] | str, base64_data: str | None = None) -> str:
    """One server-sent event. base64_data: the value of the event's "data" field, which `data`
    holds empty (its only such field): spliced into the JSON text rather than scanned by
    json.dumps, since base64 needs no escaping and an audio chunk's base64 was most of its
    event's encoding time (32 chunks of a code2wav step are encoded on the event loop in one
    go, holding the GIL that the runtime's thread waits for)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    if base64_data is not None:
        # (inside a JSON string a quote is escaped, so the first match is the field itself)
        text = text.replace(_EMPTY_DATA, f'"data":"{base64_data}"', 1)
    return f"data: {text}\n\n"


def seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}s"


# ------------------------------------------------------------------ audio
def to_pcm16(x: np.ndarray) -> np.ndarray:
    """float32 [-1, 1] -> int16 (the one quantisation used by every format and by streaming)."""
    return np.clip(np.round(np.asarray(x, np.float32) * 32767.0), -32768, 32767).astype("<i2")


def encode_audio(x: np.ndarray, sample_rate: int, fmt: str) -> tuple[bytes, str]:
    """(encoded bytes, media type) of a mono float32 waveform."""
    if fmt in ("pcm", "pcm16"):
        return to_pcm16(x).tobytes(), _PCM_MEDIA_TYPE
    container, subtype, as_int, media = _ENCODINGS[fmt]
    buf = io.BytesIO()
    data = to_pcm16(x) if as_int else np.asarray(x, np.float32)
    try:
        soundfile.write(buf, data, sample_rate, format=container, subtype=subtype)
    except (soundfile.LibsndfileError, TypeError, RuntimeError) as e:
        raise APIError(500, f"cannot encode audio as {fmt}: {e}", type_="server_error") from e
    return buf.getvalue(), media


def finish_reason(state: ServerState, out: OmniRequestOutput) -> str:
    """OpenAI's finish_reason of a text answer: the first stage's stop or length."""
    so = out.stages.get(state.first_stage)
    reason = so.finish_reason if so is not None else None
    return reason if reason in ("stop", "length") else "stop"


def token_logprob(tokenizer: Any, token: int, logprob: float) -> tuple[str, float]:
    """(the token's text, its logprob with -inf written as vLLM writes it: -9999.0)."""
    return tokenizer.decode([token], skip_special_tokens=False), max(logprob, -9999.0)


def usage(out: OmniRequestOutput, audio_stage_tokens: str | None) -> dict[str, Any]:
    """OpenAI usage; the talker's codec codes count as audio completion tokens."""
    text_tokens = len(out.token_ids)
    codes = out.metrics.tokens_per_stage.get(audio_stage_tokens, 0) if audio_stage_tokens else 0
    prompt = len(out.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": text_tokens + codes,
            "total_tokens": prompt + text_tokens + codes,
            "prompt_tokens_details": {"cached_tokens": out.metrics.num_cached_tokens},
            "completion_tokens_details": {"text_tokens": text_tokens, "audio_tokens": codes,
                                          "reasoning_tokens": 0}}
