"""The server path between the runtime and the client (issue 24): outputs cross from the
runtime's thread to the event loop in batches (one wakeup per batch, order kept), a stream
writes what has piled up in one go without losing its end, and every request's timeline
(received -> prepared -> admitted -> first text / audio written) is recorded in order and
exported as the omnistage_server_* histograms."""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import sys
import threading
import time
import weakref
from collections.abc import Iterator

import httpx
import pytest
from fastapi.routing import APIRoute

from omnistage import AsyncOmniLLM
from omnistage.entrypoints.async_llm import Mailbox
from omnistage.entrypoints.openai.metrics import ServerMetrics
from omnistage.entrypoints.openai.server import (build_app, freeze_startup_heap,
                                                 set_switch_interval, warm_up_http)
from omnistage.entrypoints.openai.serving import RequestStream, RequestTimeline, ServerConfig
from omnistage.outputs import OmniRequestOutput
from tests.entrypoints.server_utils import ThreadServer, metric, scrape

NAME = "tiny-omni"


# ------------------------------------------------------------------ the start-up heap
def test_start_up_heap_is_frozen_after_its_garbage_is_collected():
    """The serving process's start-up objects leave the GC's generations (a full collection
    scans only what serving allocates), and garbage of start-up is freed, not frozen."""
    class Node:
        def __init__(self) -> None:
            self.me = self  # a reference cycle: only the cyclic GC frees it

    try:
        garbage = Node()
        alive = Node()
        garbage_ref = weakref.ref(garbage)
        del garbage
        seconds = freeze_startup_heap()
        assert seconds >= 0.0 and garbage_ref() is None  # collected before the freeze
        assert gc.get_freeze_count() > 0
        assert not any(o is alive for o in gc.get_objects())  # frozen: out of every generation
    finally:
        gc.unfreeze()


def test_serving_sets_the_gil_switch_interval():
    """The serving process's GIL switch interval (ServerConfig.switch_interval_ms): the
    runtime's thread waits at most that long for the GIL the HTTP loop holds. Its default is
    shorter than Python's 5 ms."""
    before = sys.getswitchinterval()
    try:
        assert set_switch_interval(2.0) == before
        assert sys.getswitchinterval() == pytest.approx(0.002)
        assert set_switch_interval(ServerConfig(["m"]).switch_interval_ms) == pytest.approx(0.002)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)


# ------------------------------------------------------------------ the mailbox
def test_mailbox_wakes_the_loop_once_per_batch_in_order():
    async def go() -> None:
        box = Mailbox(asyncio.get_running_loop())
        queues: list[asyncio.Queue] = [asyncio.Queue(), asyncio.Queue()]
        for i in range(10):  # one runtime pass: outputs for two requests, interleaved
            box.post(queues[i % 2], OmniRequestOutput(f"r{i % 2}", text_delta=str(i)))
        assert box.wakeups == 1
        assert all(q.empty() for q in queues)  # (handed over on the loop, not here)
        await asyncio.sleep(0)
        got = [[q.get_nowait().text_delta for _ in range(q.qsize())] for q in queues]
        assert got == [["0", "2", "4", "6", "8"], ["1", "3", "5", "7", "9"]]
        box.post(queues[0], OmniRequestOutput("r0", text_delta="next"))  # a later pass
        assert box.wakeups == 2
        await asyncio.sleep(0)
        assert queues[0].get_nowait().text_delta == "next"

    asyncio.run(go())


def test_mailbox_from_another_thread_keeps_every_output_in_order():
    async def go() -> None:
        box = Mailbox(asyncio.get_running_loop())
        queue: asyncio.Queue = asyncio.Queue()
        n = 500
        poster = threading.Thread(target=lambda: [
            box.post(queue, OmniRequestOutput("r", text_delta=str(i))) for i in range(n)])
        poster.start()
        got = [(await asyncio.wait_for(queue.get(), 10)).text_delta for _ in range(n)]
        poster.join()
        assert got == [str(i) for i in range(n)]
        assert 1 <= box.wakeups <= n

    asyncio.run(go())


def test_mailbox_of_a_closed_loop_drops_the_output():
    loop = asyncio.new_event_loop()
    box = Mailbox(loop)
    queue: asyncio.Queue = asyncio.Queue()
    loop.close()
    box.post(queue, OmniRequestOutput("r", finished=True))  # logged, not raised
    assert queue.empty()


# ------------------------------------------------------------------ piled-up outputs
def test_next_nowait_takes_what_is_waiting_and_keeps_the_end():
    async def outputs():
        for i in range(3):
            yield OmniRequestOutput("r", text_delta=str(i), finished=i == 2)

    async def go() -> None:
        stream = RequestStream(outputs(), None)
        first = await stream.next()
        await asyncio.sleep(0)  # the pump has queued the rest and the end
        rest = []
        while (out := stream.next_nowait()) is not None:
            rest.append(out)
        assert [o.text_delta for o in [first, *rest]] == ["0", "1", "2"]
        assert stream.finished
        assert stream.next_nowait() is None
        assert await asyncio.wait_for(stream.next(), 5) is None  # the end, not a hang

    asyncio.run(go())


# ------------------------------------------------------------------ timelines over HTTP
@pytest.fixture(scope="module")
def served(tiny_omni_dir) -> Iterator[tuple[str, list[RequestTimeline], AsyncOmniLLM]]:
    """An in-process server on the tiny Qwen2.5-Omni; every request's timeline as the server
    records it (ServerMetrics.observe_timeline, wrapped); its engine."""
    llm = AsyncOmniLLM(str(tiny_omni_dir), device="cpu", prepare_workers=3)
    app = build_app(llm, ServerConfig(served_model_names=[NAME]))
    seen: list[RequestTimeline] = []
    metrics: ServerMetrics = app.state.omni.metrics
    observe = metrics.observe_timeline

    def recording(timeline: RequestTimeline | None) -> None:
        if timeline is not None:
            seen.append(timeline)
        observe(timeline)

    metrics.observe_timeline = recording
    with ThreadServer(app) as srv:
        yield srv.url, seen, llm
    llm.shutdown()


async def _stream(client: httpx.AsyncClient, url: str, seed: int) -> list[dict]:
    body = {"model": NAME, "stream": True, "seed": seed, "max_tokens": 6,
            "messages": [{"role": "user", "content": "Say something nice."}],
            "modalities": ["text", "audio"], "audio": {"format": "pcm16"},
            "stage_sampling_params": {"talker": {"max_tokens": 40}}}
    chunks = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_concurrent_streams_record_their_timeline_in_order(served):
    url, seen, _ = served
    names = ["omnistage_server_prepare_seconds_count", "omnistage_server_admission_seconds_count",
             "omnistage_server_time_to_first_text_seconds_count",
             "omnistage_server_time_to_first_audio_seconds_count"]
    before = scrape(url)
    seen.clear()
    n = 4

    async def go() -> list[list[dict]]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(_stream(client, url, i) for i in range(n)))

    streams = asyncio.run(go())
    for chunks in streams:  # every stream complete: audio, then its finish chunk
        audio = b"".join(base64.b64decode(c["choices"][0]["delta"]["audio"]["data"])
                         for c in chunks if c["choices"]
                         and c["choices"][0]["delta"].get("audio", {}).get("data"))
        assert len(audio) > 0 and len(audio) % 2 == 0
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] \
            in ("stop", "length")
    after = scrape(url)
    for name in names:
        assert metric(after, name) - metric(before, name) == n, name
    assert len(seen) == n
    for t in seen:  # the server path, point by point
        assert t.prepared is not None and t.admitted is not None
        assert t.first_text is not None and t.first_audio is not None
        assert t.received <= t.prepared <= t.admitted <= t.first_text
        assert t.admitted <= t.first_audio


# ------------------------------------------------------------------ warm-up
def test_post_requests_skip_fastapis_request_handling(served):
    """Every POST endpoint is called directly behind omnistage's middleware (server._App says
    why): a request reaches neither Starlette's middleware stack nor the FastAPI route that
    declares its typed body to the OpenAPI document, and it is still counted, guarded and
    streamed."""
    app = build_app(served[2], ServerConfig(served_model_names=[NAME], api_key="k"))
    posts = [p for p, ops in app.openapi()["paths"].items() if "post" in ops]
    assert sorted(posts) == sorted(app.posts) and len(posts) == 5
    for path in posts:
        routes = [r for r in app.router.routes if getattr(r, "path", None) == path]
        assert [type(r) for r in routes] == [APIRoute], path
        routes[0].app = None  # (a request reaching it would fail with a 500)

    def unreachable(*_):
        raise AssertionError("a POST went through the middleware stack")

    async def ask() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            app.middleware_stack = unreachable  # (what Starlette.__call__ would run)
            body = {"model": NAME, "max_tokens": 2, "ignore_eos": True, "stream": True,
                    "messages": [{"role": "user", "content": "Hi"}]}
            return [await client.post("/v1/chat/completions", json=body,
                                      headers={"Authorization": "Bearer k"}),
                    await client.post("/v1/chat/completions", json=body),
                    await client.post("/v1/chat/completions", json={**body, "n": 0},
                                      headers={"Authorization": "Bearer k"})]

    streamed, no_key, bad = asyncio.run(ask())
    assert streamed.status_code == 200, streamed.text
    assert streamed.text.rstrip().endswith("data: [DONE]")
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
    counted = app.state.omni.metrics.render().decode()
    for status in ("ok", "401", "400"):
        assert f'endpoint="chat",status="{status}"' in counted, status


def test_warmup_prepares_on_every_preparation_thread(served):
    llm = served[2]
    assert llm.warmup() is not None
    assert len(llm.warmed_prepare_threads) == llm.prepare_workers == 3
    assert threading.get_ident() not in llm.warmed_prepare_threads  # (on the pool, not here)


def test_http_warmup_streams_through_an_app_of_its_own(served):
    url, _, llm = served
    name = "omnistage_http_requests_total"
    before = scrape(url)
    seconds = asyncio.run(warm_up_http(build_app(llm, ServerConfig(served_model_names=[NAME]))))
    assert seconds > 0
    after = scrape(url)  # the served app counted nothing: the warm-up had its own metrics
    assert metric(after, name, endpoint="chat", status="ok") == \
        metric(before, name, endpoint="chat", status="ok")
    assert metric(after, "omnistage_server_prepare_seconds_count") == \
        metric(before, "omnistage_server_prepare_seconds_count")


def test_http_warmup_fails_loudly():
    """A warm-up that does not stream to [DONE] stops the start (here: a wrong API key)."""
    class Refusing:
        async def __call__(self, scope, receive, send):
            await send({"type": "http.response.start", "status": 401, "headers": []})
            await send({"type": "http.response.body", "body": b'{"error": {}}'})

    class State:
        config = ServerConfig(served_model_names=[NAME])
        output_modalities, voices, codec_stage = ["text"], [], None

    app = Refusing()
    app.state = type("AppState", (), {"omni": State()})()
    with pytest.raises(RuntimeError, match="status 401"):
        asyncio.run(warm_up_http(app))


def test_mailboxes_do_not_keep_their_loops_alive(served):
    import gc
    import weakref

    llm = served[2]
    loop = asyncio.new_event_loop()
    llm.mailbox(loop)
    gone = weakref.ref(loop)
    loop.close()
    del loop
    gc.collect()
    assert gone() is None


# ------------------------------------------------------------------ start(): no loop between
_PROMPT = {"messages": [{"role": "user", "content": "Say something nice."}]}


def _text_params(tokens: int) -> dict:
    from omnistage import SamplingParams
    return {"thinker": SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)}


def test_start_submits_from_the_preparation_thread_while_the_loop_is_busy(served):
    """llm.start(): the thread that prepared the request submits it, so the runtime takes it
    in while the caller's event loop is still busy (with prepare() then run(), the request
    waited for two passes of that loop first)."""
    llm = served[2]
    seen: dict = {}

    def admit(req) -> bool:
        seen["req"], seen["thread"] = req, threading.get_ident()
        return True

    async def go() -> list[OmniRequestOutput]:
        task = asyncio.ensure_future(llm.start(_PROMPT, _text_params(4), ["text"],
                                               admit=admit))
        await asyncio.sleep(0)  # (the task queues its preparation and waits for it)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not getattr(seen.get("req"), "arrival", 0.0):
            time.sleep(0.01)  # the loop stays busy: nothing it runs can submit the request
        assert getattr(seen.get("req"), "arrival", 0.0) > 0, "not taken in while the loop was busy"
        assert seen["thread"] != threading.get_ident()
        req, outputs = await task
        assert req is seen["req"]
        return [out async for out in outputs]

    outs = asyncio.run(go())
    assert outs[-1].finished and not outs[-1].error and len(outs[-1].token_ids) == 4


def test_a_request_start_refuses_is_never_submitted(served):
    from omnistage.entrypoints.async_llm import NotAdmitted
    llm = served[2]
    before = llm.runtime.num_active()

    async def go() -> None:
        with pytest.raises(NotAdmitted):
            await llm.start(_PROMPT, _text_params(4), ["text"], request_id="refused",
                            admit=lambda req: False)

    asyncio.run(go())
    assert llm.preparing == 0 and llm.runtime.num_active() == before


def test_started_outputs_closed_before_reading_abort_the_request(served):
    """A stream dropped before it read anything (its task never ran) still aborts its
    request: RequestStream.cancel() closes the outputs."""
    llm = served[2]

    async def go() -> tuple[bool, int]:
        _, outputs = await llm.start(_PROMPT, _text_params(3000), ["text"])
        stream = RequestStream(outputs, None)
        aborted = stream.cancel()  # (before its pump task ever ran)
        deadline = time.monotonic() + 30
        while llm.runtime.num_active() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return aborted, llm.runtime.num_active()

    aborted, active = asyncio.run(go())
    assert aborted and active == 0
