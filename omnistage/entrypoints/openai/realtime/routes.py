"""GET /v1/realtime?model=... (a WebSocket speaking the OpenAI Realtime API) and the voice-chat
page at / (static files shipped as package data; no build step, no CDN).

Auth as on the HTTP routes (`Authorization: Bearer KEY`); browsers cannot set headers on a
WebSocket, so OpenAI's `openai-insecure-api-key.KEY` subprotocol is accepted too."""

from __future__ import annotations

import asyncio
import hmac
import importlib.resources
import logging
import time

from fastapi import FastAPI
from starlette.responses import Response
from starlette.websockets import WebSocket, WebSocketDisconnect

from omnistage.entrypoints.openai.protocol import APIError
from omnistage.entrypoints.openai.realtime.protocol import (RealtimeProtocolError,
                                                            parse_client_event)
from omnistage.entrypoints.openai.realtime.session import (AudioClock, RealtimeLimits,
                                                           RealtimeSession)
from omnistage.entrypoints.openai.realtime.vad import load_vad
from omnistage.entrypoints.openai.serving import ServerState

log = logging.getLogger("omnistage.realtime")
KEY_PROTOCOL = "openai-insecure-api-key."
# static files the page is made of: name -> media type (nothing else is served from there)
STATIC_FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript",
                "capture-worklet.js": "text/javascript", "style.css": "text/css"}
CLOSE_POLICY, CLOSE_TRY_AGAIN = 1008, 1013


def _authorized(ws: WebSocket, key: str | None) -> bool:
    if not key:
        return True
    auth = ws.headers.get("authorization", "")
    if auth[:7].lower() == "bearer " and hmac.compare_digest(auth[7:].strip().encode(),
                                                             key.encode()):
        return True
    return any(p.startswith(KEY_PROTOCOL)
               and hmac.compare_digest(p[len(KEY_PROTOCOL):].encode(), key.encode())
               for p in ws.scope.get("subprotocols", []))


def _static(name: str) -> bytes:
    return (importlib.resources.files("omnistage.entrypoints.openai") / "static" / name
            ).read_bytes()


class RealtimeRegistry:
    """The sessions open now (for tests, metrics and the drain)."""

    def __init__(self) -> None:
        self.sessions: set[RealtimeSession] = set()
        self.clock = AudioClock()


def register_realtime(app: FastAPI, state: ServerState,
                      limits: RealtimeLimits | None = None) -> RealtimeRegistry:
    limits = limits or RealtimeLimits()
    registry = RealtimeRegistry()
    app.state.realtime = registry

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return Response(_static("index.html"), media_type=STATIC_FILES["index.html"])

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in STATIC_FILES:
            raise APIError(404, f"no static file {name!r}", code="not_found")
        return Response(_static(name), media_type=STATIC_FILES[name])

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        offered = ws.scope.get("subprotocols", [])
        if not _authorized(ws, state.config.api_key):
            log.info("realtime: refused, invalid or missing API key")
            await ws.close(CLOSE_POLICY, "invalid or missing API key")
            return
        await ws.accept(subprotocol="realtime" if "realtime" in offered else None)
        model = ws.query_params.get("model") or state.config.served_model_names[0]
        why = None
        if state.draining:
            why = ("the server is shutting down", "shutting_down", CLOSE_TRY_AGAIN)
        elif model not in state.config.served_model_names:
            why = (f"model: {model!r} does not exist; this server serves "
                   f"{state.config.served_model_names}", "model_not_found", CLOSE_POLICY)
        elif "image" in state.output_modalities:
            why = ("model: this model generates images", "invalid_model", CLOSE_POLICY)
        if why is not None:
            err = RealtimeProtocolError(why[0], "model", code=why[1])
            await ws.send_json({"type": "error", "event_id": "event_refused", **err.event()})
            await ws.close(why[2], why[1])
            return
        await asyncio.to_thread(load_vad)  # (once per process; off the event loop)
        session = RealtimeSession(state, model, ws.send_text, limits, registry.clock)
        registry.sessions.add(session)
        log.info("%s: opened (model %s)", session.id, model)
        try:
            await session.start()
            await _serve(ws, session, limits)
        except WebSocketDisconnect as e:  # the client closed: nothing left to tell it
            log.info("%s: client disconnected (code %s)", session.id, e.code)
        finally:
            registry.sessions.discard(session)
            await session.close()
            log.info("%s: closed after %d response(s)", session.id, session.num_responses)

    return registry


async def _serve(ws: WebSocket, session: RealtimeSession, limits: RealtimeLimits) -> None:
    """The receive loop: one client event at a time, until the client closes or the session
    reaches its length limit."""
    while not session.closed:
        left = limits.max_session_seconds - (time.monotonic() - session.started)
        if left <= 0:
            await session.send(RealtimeProtocolError(
                f"session: reached the limit of {limits.max_session_seconds:g} s",
                "session", code="session_expired").event())
            await ws.close(1000, "session_expired")
            return
        try:
            msg = await asyncio.wait_for(ws.receive(), left)
        except TimeoutError:
            continue
        if msg["type"] == "websocket.disconnect":
            return
        raw = msg.get("text") if msg.get("text") is not None else msg.get("bytes") or b""
        try:
            await session.handle(parse_client_event(raw, limits.max_event_bytes))
        except RealtimeProtocolError as e:
            await session.send(e.event())
