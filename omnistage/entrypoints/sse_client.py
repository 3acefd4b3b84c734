"""A lean HTTP/1.1 client for the load generator: POST a JSON body, read the server-sent
events line by line, over kept-alive asyncio connections.

Why not httpx here: its layers (httpcore, h11, anyio) cost about 2 ms of the one event loop per
request, so 32 requests sent at once reached a server spread over ~75 ms, and every stream's
timestamps were late by the client's own queue: the benchmark measured its client. This one
writes a request in one call and parses only the status line, the headers it needs and the
(chunked or sized) body. httpx stays for everything else (/health, /v1/models, /metrics)."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 * 1024
MAX_LINE_BYTES = 64 * 1024 * 1024  # one SSE line (a large audio delta fits)
IDLE_KEEP_S = 2.0  # an idle kept-alive connection older than this is not reused (uvicorn
# closes idle connections after 5 s: one closing as a request is written would fail it)


class HTTPStatusError(Exception):
    """A non-200 answer: its status and the start of its body."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300]!r}")
        self.status = status


class SSEClient:
    """POSTs to one server (`base_url`: http or https) over a pool of kept-alive connections."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base_url: {base_url!r} is not an http(s) URL")
        self.host, self.path_prefix = url.hostname, url.path.rstrip("/")
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        netloc = self.host if url.port is None else f"{self.host}:{url.port}"
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.head = f"Host: {netloc}\r\nContent-Type: application/json\r\n" \
                    f"Accept: text/event-stream\r\n{extra}"
        self.idle: list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]] = []

    def _take_idle(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A kept-alive connection fresh enough to reuse (the stale ones are closed)."""
        now = time.monotonic()
        while self.idle:
            since, reader, writer = self.idle.pop()
            if now - since < IDLE_KEEP_S and not writer.is_closing() and not reader.at_eof():
                return reader, writer
            writer.close()
        return None

    async def _send(self, request: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter,
                                                   int, dict[str, str]]:
        """Writes `request` and reads the answer's head, on an idle kept-alive connection if
        there is one. A reused connection that the server had closed meanwhile (no byte of an
        answer: it never took the request) is replaced by a new one, once, as HTTP clients
        do."""
        conn = self._take_idle()
        if conn is not None:
            try:
                return *conn, *await _exchange(*conn, request)
            except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError) as e:
                if isinstance(e, asyncio.IncompleteReadError) and e.partial:
                    raise  # (it answered something: the request was taken)
        conn = await asyncio.open_connection(self.host, self.port, ssl=self.ssl,
                                             limit=MAX_LINE_BYTES)
        return *conn, *await _exchange(*conn, request)

    @asynccontextmanager
    async def post_events(self, path: str, body: dict[str, Any]) -> AsyncIterator[
            AsyncIterator[str]]:
        """`async with client.post_events(path, body) as lines:` the response's lines (without
        line ends) once it answered 200; HTTPStatusError otherwise. The connection goes back
        to the pool only when the body was read to its end."""
        payload = json.dumps(body).encode()
        reader, writer, status, headers = await self._send(
            f"POST {self.path_prefix}{path} HTTP/1.1\r\n{self.head}"
            f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        reusable = False
        try:
            chunked = "chunked" in headers.get("transfer-encoding", "")
            length = int(headers["content-length"]) if "content-length" in headers else None
            keep = headers.get("connection", "").lower() != "close" and (chunked or
                                                                       length is not None)
            if status != 200:
                data = await _read_body(reader, chunked, length)
                reusable = keep
                raise HTTPStatusError(status, data)
            state = {"done": False}
            yield _lines(reader, chunked, length, state)
            reusable = keep and state["done"]
        finally:
            if reusable:
                self.idle.append((time.monotonic(), reader, writer))
            else:
                writer.close()

    async def aclose(self) -> None:
        for _, _, writer in self.idle:
            writer.close()
        self.idle.clear()


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    request: bytes) -> tuple[int, dict[str, str]]:
    """Writes the request, reads the answer's head; the connection is closed if that fails."""
    try:
        writer.write(request)
        return await _read_head(reader)
    except BaseException:
        writer.close()
        raise


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    raw = await reader.readuntil(b"\r\n\r\n")
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"response headers: {len(raw)} bytes")
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ValueError(f"response status line: {lines[0][:100]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _chunks(reader: asyncio.StreamReader, chunked: bool, length: int | None
                  ) -> AsyncIterator[bytes]:
    """The body's bytes as they come: chunked, sized, or up to the connection's end."""
    if chunked:
        while True:
            size_line = await reader.readuntil(b"\r\n")
            try:
                size = int(size_line.split(b";", 1)[0], 16)
            except ValueError:
                raise ValueError(f"response chunk size: {size_line[:40]!r}") from None
            if size == 0:
                await reader.readuntil(b"\r\n")  # (no trailers from our server)
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    elif length is not None:
        while length > 0:
            data = await reader.read(min(length, 1 << 16))
            if not data:
                raise asyncio.IncompleteReadError(b"", length)
            length -= len(data)
            yield data
    else:
        while data := await reader.read(1 << 16):
            yield data


async def _read_body(reader: asyncio.StreamReader, chunked: bool, length: int | None) -> bytes:
    return b"".join([c async for c in _chunks(reader, chunked, length)])


async def _lines(reader: asyncio.StreamReader, chunked: bool, length: int | None,
                 state: dict[str, bool]) -> AsyncIterator[str]:
    pending = b""
    async for data in _chunks(reader, chunked, length):
        pending += data
        if len(pending) > MAX_LINE_BYTES:
            raise ValueError(f"response line: over {MAX_LINE_BYTES} bytes")
        *complete, pending = pending.split(b"\n")
        for line in complete:
            yield line.rstrip(b"\r").decode()
    if pending:
        yield pending.rstrip(b"\r").decode()
    state["done"] = True
