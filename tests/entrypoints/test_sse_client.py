"""sse_client (the load generator's streaming client) against a scripted HTTP/1.1 server on
loopback: chunked events, a sized error answer, keep-alive reuse, a body cut short, a malformed
status line and a timeout, each one request's error row, never a crash of the level."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

from omnistage.entrypoints import bench
from omnistage.entrypoints.sse_client import SSEClient

AUDIO = "AAAAAAAA"  # 6 bytes: 3 pcm16 samples


def _event(obj) -> bytes:
    data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


@asynccontextmanager
async def _client_of(script):
    """An SSEClient of a loopback server whose every request is answered by
    script(body, writer) (False: the connection is closed after it); yields (client, the
    requests each connection carried)."""
    conns: list[int] = []

    async def handle(reader, writer):
        conns.append(0)
        me = len(conns) - 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                size = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-length"))
                body = json.loads(await reader.readexactly(size))
                conns[me] += 1
                if not await script(body, writer):
                    writer.close()
                    return
                await writer.drain()
        except asyncio.IncompleteReadError:  # the client closed its connection
            writer.close()
        except asyncio.CancelledError:  # the test's loop ends ("slow" still sleeping)
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    client = SSEClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        yield client, conns
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def _script(body, writer) -> bool:
    kind = body["messages"][0]["content"]
    if kind == "ok":
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        writer.write(_event({"choices": [{"delta": {"content": "hi"}}]}))
        writer.write(_event({"choices": [{"delta": {"audio": {"data": AUDIO}}}]}))
        writer.write(_event({"choices": [], "usage": {"completion_tokens": 7}}))
        writer.write(_event(b"[DONE]") + b"0\r\n\r\n")
        return True
    if kind == "bad":
        err = json.dumps({"error": {"message": "temperature: too hot"}}).encode()
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(err), err))
        return True
    if kind == "cut":  # headers and one event, then the connection drops
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(_event({"choices": [{"delta": {"content": "hi"}}]}))
        return False
    if kind == "garbage":
        writer.write(b"HELLO\r\n\r\n")
        return False
    await asyncio.sleep(5)  # "slow": outlasts the request's timeout
    return False


def _body(kind: str) -> dict:
    return {"messages": [{"role": "user", "content": kind}]}


def test_streams_errors_and_reuse():
    async def main():
        async with _client_of(_script) as (client, conns):
            ok = await bench.one_request(client, _body("ok"), 5)
            assert ok["ttft"] is not None and ok["ttfa"] is not None
            assert ok["audio_s"] == 3 / bench.PCM16_RATE and ok["output_tokens"] == 7
            bad = await bench.one_request(client, _body("bad"), 5)
            assert bad["error"].startswith("HTTP 400") and "too hot" in bad["error"]
            again = await bench.one_request(client, _body("ok"), 5)
            assert "error" not in again
            assert conns == [3]  # one kept-alive connection served all three
            cut = await bench.one_request(client, _body("cut"), 5)
            assert "IncompleteReadError" in cut["error"]
            garbage = await bench.one_request(client, _body("garbage"), 5)
            assert "status line" in garbage["error"]
            slow = await bench.one_request(client, _body("slow"), 0.3)
            assert slow["error"] == "timed out after 0.3 s"
            rows = await asyncio.gather(*(bench.one_request(client, _body("ok"), 5)
                                          for _ in range(8)))  # concurrent: new connections
            assert all("error" not in r for r in rows) and len(client.idle) == 8

    asyncio.run(main())


def test_a_kept_alive_connection_the_server_closed_is_replaced():
    """A server that answers one request per connection and drops the connection at the next
    one, unanswered (as a server closing an idle connection while a request is on its way):
    that request is sent again on a new connection, once, and every request succeeds."""
    answered: set = set()

    async def one_per_connection(body, writer) -> bool:
        if writer in answered:
            return False  # closed, no byte of an answer
        answered.add(writer)
        return await _script(body, writer)

    async def main():
        async with _client_of(one_per_connection) as (client, conns):
            for _ in range(3):
                row = await bench.one_request(client, _body("ok"), 5)
                assert "error" not in row and row["output_tokens"] == 7
            assert conns == [2, 2, 1]  # each dropped request was sent again on a new one

    asyncio.run(main())


def test_bad_base_url_is_named():
    import pytest
    with pytest.raises(ValueError, match="base_url"):
        SSEClient("ftp://example")
