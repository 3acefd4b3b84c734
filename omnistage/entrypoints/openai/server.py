"""The OpenAI-compatible server: a FastAPI app on one AsyncOmniLLM, run by uvicorn.

Routes: POST /v1/chat/completions, /v1/completions, /v1/audio/speech, /v1/audio/transcriptions
(multipart), /v1/images/generations (image pipelines; they answer 400 on the others),
GET /v1/models[/{id}], GET /health, GET /metrics.
Every error is OpenAI's JSON ({"error": {message, type, param, code}}). An ASGI guard in front
checks the API key (/v1 routes) and the body size before any route runs. The POST endpoints
parse their body themselves (a 400 naming the field, never FastAPI's 422) and are called
directly behind that guard (_App); their pydantic models are still the request bodies of
app.openapi(), for clients and schema-driven fuzzers.
SIGTERM/SIGINT: stop accepting, refuse new requests with 503, let running ones finish for up
to `shutdown_timeout` seconds, end those left (a stream's error event `shutting_down` and
[DONE], a 503 where no response started), then stop the engine (_DrainingServer)."""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import resource
import sys
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

import torch
import uvicorn
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omnistage.entrypoints.base import WARMUP_LATER_TOKENS, WARMUP_PROMPT, WARMUP_TOKENS
from omnistage.entrypoints.openai.metrics import RequestCounter, ServerMetrics
from omnistage.entrypoints.openai.protocol import (APIError, ChatCompletionRequest,
                                                   CompletionRequest,
                                                   SpeechRequest, error_body, parse_body)
from omnistage.entrypoints.openai.protocol_images import ImageGenerationRequest
from omnistage.entrypoints.openai.realtime.routes import register_realtime
from omnistage.entrypoints.openai.serving import END_GRACE_SECONDS, ServerConfig, ServerState
from omnistage.entrypoints.openai.serving_completions import OpenAIServingCompletions
from omnistage.entrypoints.openai.serving_chat import OpenAIServingChat
from omnistage.entrypoints.openai.serving_images import OpenAIServingImages
from omnistage.entrypoints.openai.serving_speech import OpenAIServingSpeech
from omnistage.entrypoints.openai.serving_transcriptions import (OpenAIServingTranscriptions,
                                                                 TranscriptionRequest)

log = logging.getLogger("omnistage.server")


class RequestTooLarge(Exception):
    pass


class _Guard:
    """Pure ASGI middleware (streaming and disconnects pass through untouched): API key on /v1
    routes, request body size (Content-Length up front, counted for chunked bodies)."""

    def __init__(self, app, config: ServerConfig) -> None:
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        key = self.config.api_key
        if key and scope["path"].startswith("/v1"):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), key.encode()):
                return await _error(401, "invalid or missing API key (Authorization: Bearer "
                                    "KEY)", "invalid_api_key", scope, receive, send)
        limit = self.config.max_request_bytes
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await _error(400, "invalid Content-Length", "invalid_request", scope,
                                    receive, send)
            if int(length) > limit:
                return await _error(413, f"request body of {int(length)} bytes is larger than "
                                    f"the limit of {limit}", "request_too_large", scope, receive,
                                    send)
        seen = 0

        async def counted():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise RequestTooLarge(f"request body is larger than the limit of {limit}")
            return msg

        await self.app(scope, counted, send)


_SCHEMA_REF = "#/components/schemas/{model}"
_BODY_MODELS = (ChatCompletionRequest, CompletionRequest, SpeechRequest,
                ImageGenerationRequest, TranscriptionRequest)


def _request_body(model: type[BaseModel], media_type: str = "application/json") -> dict:
    """A route's `openapi_extra`: its request body is `model` (in components/schemas)."""
    ref = {"$ref": _SCHEMA_REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {media_type: {"schema": ref}}}}


class _App(FastAPI):
    """FastAPI behind omnistage's own middleware (RequestCounter, then _Guard), which every
    request passes once; then the POST endpoints (`posts`: path -> endpoint) are called
    directly, with the app's exception handlers, and every other request goes on through
    FastAPI. Every POST endpoint parses its own body, so the layers of Starlette and FastAPI
    around a route (error and exception middleware, FastAPI's own middleware, routing, its
    request handler, exit stacks) and the streaming response's disconnect listener added
    nothing but event-loop time per request, before a burst's requests reached the engine and
    before their first events went out (benchmarks/server_front.py measures this path against
    FastAPI's). Their FastAPI routes stay in the router only to declare the typed bodies in
    the OpenAPI document."""

    def __init__(self, config: ServerConfig, metrics: ServerMetrics, **kwargs) -> None:
        super().__init__(**kwargs)
        self.posts: dict[str, Callable] = {}
        # (the counter outermost: it counts the guard's refusals too)
        self.front = RequestCounter(_Guard(self._dispatch, config), metrics)

    async def __call__(self, scope, receive, send) -> None:
        await self.front(scope, receive, send)

    async def _dispatch(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and \
                scope["path"] in self.posts:
            scope["app"] = self
            return await self._serve_post(scope, receive, send)
        await super().__call__(scope, receive, send)

    async def _serve_post(self, scope, receive, send) -> None:
        request = Request(scope, receive, send)
        try:
            response = await self.posts[scope["path"]](request)
        except Exception as e:  # noqa: BLE001 - answered by the app's handler for its type
            response = await self._handle(request, e)
        await response(scope, receive, send)

    async def _handle(self, request: Request, error: Exception) -> Response:
        """The answer of the app's exception handler for `error`'s nearest type (Exception's:
        a logged 500), as Starlette's middleware would choose it."""
        for cls in type(error).__mro__:
            handler = self.exception_handlers.get(cls)
            if handler is not None:
                return await handler(request, error)
        raise error


def _post(app: _App, path: str, body: type[BaseModel],
          media_type: str = "application/json") -> Callable:
    """Decorator: POST `path` served by `endpoint` (see _App), and declared to the OpenAPI
    document (its typed body, which the schema fuzzing reads) by a FastAPI route with the same
    endpoint that no request reaches."""
    def register(endpoint: Callable) -> Callable:
        app.posts[path] = endpoint
        app.add_api_route(path, endpoint, methods=["POST"],
                          openapi_extra=_request_body(body, media_type))
        return endpoint
    return register


def _add_body_schemas(app: FastAPI) -> None:
    """Wrap app.openapi so that components/schemas holds every _BODY_MODELS model and the models
    they reference (the routes only name them: FastAPI sees no body parameter)."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()
            _, defs = models_json_schema([(m, "validation") for m in _BODY_MODELS],
                                         ref_template=_SCHEMA_REF)
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            clash = sorted(set(schemas) & set(defs["$defs"]))
            if clash:
                raise ValueError(f"openapi: body models named like FastAPI's schemas: {clash}")
            schemas.update(defs["$defs"])
        return app.openapi_schema

    app.openapi = openapi


async def _error(status: int, message: str, code: str, scope, receive, send) -> None:
    type_ = "invalid_request_error" if status < 500 else "server_error"
    await JSONResponse(error_body(message, type_, None, code), status)(scope, receive, send)


def build_app(llm, config: ServerConfig) -> FastAPI:
    """The app serving `llm` (an AsyncOmniLLM). `app.state.omni` is the ServerState."""
    state = ServerState(llm, config)
    processor = getattr(llm.pipeline, "processor", None)
    if processor is not None and hasattr(processor, "allow_local_paths"):
        processor.allow_local_paths = config.allow_local_media  # no file reads from requests
    chat, speech = OpenAIServingChat(state), OpenAIServingSpeech(state)
    images, text = OpenAIServingImages(state), OpenAIServingCompletions(state)
    transcriptions = OpenAIServingTranscriptions(state)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = type(asyncio.get_running_loop())
        log.info("event loop: %s.%s", loop.__module__, loop.__qualname__)  # (uvloop's: faster)
        yield
        state.draining = True

    app = _App(config, state.metrics, title="omnistage", lifespan=lifespan, docs_url=None,
               redoc_url=None)
    app.state.omni = state

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), e.status, headers=e.headers)

    @app.exception_handler(RequestTooLarge)
    async def too_large(_: Request, e: RequestTooLarge) -> JSONResponse:
        return JSONResponse(error_body(str(e), code="request_too_large"), 413)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(e.detail), type_), e.status_code)

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"),
                            500)

    @app.get("/health")
    async def health() -> Response:
        if not llm.runtime.alive:
            return JSONResponse({"status": "dead"}, 503)
        return JSONResponse({"status": "draining" if state.draining else "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "omnistage",
                "modalities": state.output_modalities, "voices": state.voices}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card(n) for n in config.served_model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        state.check_model(model_id)
        return card(model_id)

    def not_an_image_model() -> None:
        if "image" in state.output_modalities:
            raise APIError(400, "model: this model generates images; use "
                           "/v1/images/generations", param="model")

    @_post(app, "/v1/chat/completions", ChatCompletionRequest)
    async def chat_completions(request: Request) -> Response:
        not_an_image_model()
        return await chat.create(parse_body(ChatCompletionRequest, await request.body()),
                                 request)

    @_post(app, "/v1/completions", CompletionRequest)
    async def completions(request: Request) -> Response:
        not_an_image_model()
        return await text.create(parse_body(CompletionRequest, await request.body()), request)

    @_post(app, "/v1/audio/speech", SpeechRequest)
    async def audio_speech(request: Request) -> Response:
        not_an_image_model()
        return await speech.create(parse_body(SpeechRequest, await request.body()), request)

    @_post(app, "/v1/audio/transcriptions", TranscriptionRequest, "multipart/form-data")
    async def audio_transcriptions(request: Request) -> Response:
        not_an_image_model()
        return await transcriptions.create(request)

    @_post(app, "/v1/images/generations", ImageGenerationRequest)
    async def images_generations(request: Request) -> Response:
        return await images.create(parse_body(ImageGenerationRequest, await request.body()),
                                   request)

    register_realtime(app, state)  # GET /v1/realtime (WebSocket) and the page at /
    _add_body_schemas(app)
    return app


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def log_placement(llm) -> None:
    """One line per stage: device, dtype, weight and KV cache memory; then process memory.
    Nothing for an engine in a process of its own (it logs its own lines there; here a CUDA
    query would make this process a CUDA context it does not need)."""
    if not llm.pipeline.workers:
        return
    for name, worker in llm.pipeline.workers.items():
        engine = getattr(worker, "engine", None)
        model = engine.runner.model if engine is not None else getattr(worker, "model", None)
        model = getattr(model, "module", model)  # (gen stages: the network holding weights)
        params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
        weights = sum(p.numel() * p.element_size() for p in params)
        where = f"device={params[0].device} dtype={params[0].dtype}" if params else "device=?"
        kv = ""
        if engine is not None:
            r, c = engine.runner, engine.config
            kv = (f" kv_cache={_mib(2 * r.k_cache.numel() * r.k_cache.element_size())} "
                  f"({engine.stats['num_kv_blocks']} blocks x {c.block_size} tokens; "
                  f"max_model_len={c.max_model_len} max_num_seqs={c.max_num_seqs})")
        log.info("stage %s [%s]: %s weights=%s%s", name, type(worker).__name__, where,
                 _mib(weights), kv)
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    msg = f"process peak RSS {_mib(rss_kib * 1024)}"
    if torch.cuda.is_available():
        msg += "; " + ", ".join(f"cuda:{i} allocated {_mib(torch.cuda.memory_allocated(i))}"
                                for i in range(torch.cuda.device_count()))
    log.info(msg)


async def post_in_process(app: FastAPI, path: str, body: dict, api_key: str | None = None,
                          on_chunk: Callable[[bytes], None] | None = None
                          ) -> tuple[int, bytes]:
    """POST `body` as JSON to `app` as uvicorn calls it, without a socket; the client never
    leaves (a receive after the body waits). Returns the status and the whole answer;
    `on_chunk` sees each body message's bytes as it is sent."""
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(raw)).encode())]
    if api_key:
        headers.append((b"authorization", f"Bearer {api_key}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    sent = False
    never = asyncio.Event()

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    status, chunks = 0, []

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if on_chunk is not None:
                on_chunk(chunks[-1])

    await app(scope, receive, send)
    return status, b"".join(chunks)


async def warm_up_http(app: FastAPI) -> float:
    """One short streamed request through the whole app, in this process (no socket): the
    middleware, body parsing, the handler, the preparation pool, the runtime, the SSE writer
    and what each sets up on its first use, so that the first client request runs as fast as
    the next. Give it an app of its own (build_app again): its metrics are not the served
    app's. Returns its seconds; RuntimeError if it did not answer 200 with a complete stream."""
    state: ServerState = app.state.omni
    name = state.config.served_model_names[0]
    if "image" in state.output_modalities:
        return 0.0  # (image pipelines warm up while they are built)
    path = "/v1/chat/completions" if state.voices else "/v1/completions"
    # fixed lengths whatever the pipeline's defaults (as OmniBase.warmup's request)
    body: dict = {"model": name, "stream": True, "max_tokens": WARMUP_TOKENS,
                  "min_tokens": WARMUP_TOKENS, "seed": 0, "ignore_eos": True}
    if state.voices:  # (models that speak have a chat template; a plain LM may have none)
        body["messages"] = [{"role": "user", "content": WARMUP_PROMPT}]
        if state.codec_stage is not None:
            body.update(modalities=["text", "audio"], audio={"format": "pcm16"})
        later = [n for n in state.llm.pipeline.default_params if n != state.first_stage]
        if later:
            body["stage_sampling_params"] = {n: {
                "max_tokens": WARMUP_LATER_TOKENS, "min_tokens": WARMUP_LATER_TOKENS,
                "ignore_eos": True} for n in later}
    else:
        body["prompt"] = WARMUP_PROMPT
    t0 = time.perf_counter()
    status, answer = await post_in_process(app, path, body, state.config.api_key)
    text = answer.decode("utf-8", "replace")
    if status != 200 or not text.rstrip().endswith("data: [DONE]") or '"error"' in text:
        raise RuntimeError(f"HTTP warm-up request failed: status {status}: {text[-500:]}")
    return time.perf_counter() - t0


def freeze_startup_heap() -> float:
    """Collect start-up's garbage, then gc.freeze() what is left (modules, the models' Python
    objects, compiled graphs, caches: millions of objects) for the life of this serving
    process; returns the seconds it took. The cyclic GC's oldest generation then scans only
    what serving allocates, so a full collection, which can come in the middle of a burst,
    stops the runtime thread (and every stream with it) for milliseconds, not for a scan of
    the whole start-up heap (serving_h200_c32_gap_gc_freeze_row_tail_session28_*.json)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    seconds = time.perf_counter() - t0
    log.info("start-up heap frozen: %d objects, %.2f s", gc.get_freeze_count(), seconds)
    return seconds


# NOTE (the GIL switch interval while serving, ServerConfig.switch_interval_ms): the runtime's
# thread shares the interpreter with the HTTP loop. When a stage's step ends while the loop is
# writing a burst of stream events, the runtime waits for the GIL until the loop lets go, or
# until the switch interval (Python's: 5 ms) has passed and it asks for it. A shorter interval
# bounds that wait; measured at c32 on an H200, alternating starts:
# serving_h200_starts_pinning_switch_interval_session31_issue24_2026-11-29.json.
def set_switch_interval(milliseconds: float) -> float:
    """Set this process's GIL switch interval; returns the one it replaces (seconds)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(milliseconds / 1e3)
    log.info("GIL switch interval: %g ms (was %g ms)", milliseconds, before * 1e3)
    return before


class _DrainingServer(uvicorn.Server):
    """uvicorn's server with omnistage's shutdown, in order: stop accepting, drain for up to
    `shutdown_timeout`, end the requests left (error event and [DONE], or 503), stop the engine
    while this event loop still runs (the runtime thread calls back into it), then let uvicorn
    close the connections and run the lifespan's shutdown."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.omni_state = state

    def handle_exit(self, sig, frame) -> None:
        if not self.omni_state.draining:
            log.info("shutting down: draining %d request(s), at most %.0f s",
                     self.omni_state.in_flight, self.omni_state.config.shutdown_timeout)
        self.omni_state.draining = True
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # a drained shutdown exits 0, not by re-raising the signal

    async def shutdown(self, sockets: list | None = None) -> None:
        state = self.omni_state
        for listener in self.servers:  # stop accepting
            listener.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # idle keep-alive ones close now, busy ones after the response
        await state.drain(state.config.shutdown_timeout, lambda: self.force_exit)
        await asyncio.to_thread(state.llm.shutdown)  # (its requests are aborted or ended)
        log.info("engine stopped")
        await super().shutdown(sockets)


def run_server(llm, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info", access_log: bool = False, warmup: bool = False
               ) -> None:
    """Serve until SIGTERM/SIGINT, then drain and stop `llm`. warmup: one request through the
    HTTP app (warm_up_http) before listening."""
    try:
        if warmup:  # (before the served app: its startup gauge shows this phase too)
            seconds = asyncio.run(warm_up_http(build_app(llm, config)))
            llm.startup_seconds["http_warmup"] = seconds
            log.info("warm-up request through the HTTP app: %.2f s", seconds)
        llm.startup_seconds["gc_freeze"] = freeze_startup_heap()
        set_switch_interval(config.switch_interval_ms)  # (serving only, not the start-up)
        app = build_app(llm, config)
        log_placement(llm)
        # (uvicorn's own wait comes after the drain: for connections still open then)
        uv = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=END_GRACE_SECONDS)
        server = _DrainingServer(uv, app.state.omni)
        log.info("serving %s on http://%s:%d (api key %s, max %d requests in flight)",
                 config.served_model_names, host, port, "on" if config.api_key else "off",
                 config.max_queue)
        server.run()
    finally:
        llm.shutdown()  # (done already after a drained shutdown; not after a failed start)
        log.info("stopped")
