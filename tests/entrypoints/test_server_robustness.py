"""Server robustness (issue 24): request preparation off the event loop and bounded (defect 3),
every HTTP request counted in /metrics with its status (defect 5), and /v1/audio/speech never an
empty 200 (defect 6). One in-process server (uvicorn in a thread) on the tiny Qwen2.5-Omni, so
that tests can slow down or steer the pipeline with monkeypatch."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from omnistage.entrypoints.async_llm import AsyncOmniLLM
from omnistage.entrypoints.openai.server import build_app
from omnistage.entrypoints.openai.serving import ServerConfig
from tests.entrypoints.server_utils import (MODEL_NAME, ThreadServer, metric, read_wav,
                                           scrape)

MESSAGES = [{"role": "user", "content": "Hello"}]
CHAT = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2}
SPEECH = {"model": MODEL_NAME, "input": "Hi there", "voice": "Chelsie", "seed": 0}
SLOW_PREPARE_S = 2.0


@pytest.fixture(scope="module")
def llm(tiny_omni_dir) -> Iterator[AsyncOmniLLM]:
    llm = AsyncOmniLLM(str(tiny_omni_dir), device="cpu", prepare_workers=2)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def server(llm) -> Iterator[ThreadServer]:
    config = ServerConfig(served_model_names=[MODEL_NAME], max_pending_prepares=1,
                          max_audio_seconds=30)
    with ThreadServer(build_app(llm, config)) as srv:
        yield srv


@pytest.fixture
def slow_prepare(llm, monkeypatch) -> threading.Event:
    """Every preparation sleeps SLOW_PREPARE_S (as a large video's decoding would); the event
    is set once one has started."""
    started = threading.Event()
    original = llm.pipeline.prepare

    def prepare(*args, **kwargs):
        started.set()
        time.sleep(SLOW_PREPARE_S)
        return original(*args, **kwargs)

    monkeypatch.setattr(llm.pipeline, "prepare", prepare)
    return started


def _post(server: ThreadServer, body: dict, path: str = "/v1/chat/completions"
          ) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


# ------------------------------------------------------------------ defect 3
def test_health_answers_while_a_request_is_prepared(server, llm, slow_prepare):
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(_post, server, CHAT)
        assert slow_prepare.wait(10)
        assert llm.preparing == 1
        t0 = time.monotonic()
        r = httpx.get(server.url + "/health", timeout=10)
        took = time.monotonic() - t0
        assert r.status_code == 200 and took < 0.3, f"/health took {took:.2f} s"
        assert slow.result().status_code == 200  # and the slow request still succeeds
    assert llm.preparing == 0


def test_pending_preparations_are_bounded(server, llm, slow_prepare):
    before = scrape(server.url)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(_post, server, CHAT)
        assert slow_prepare.wait(10)
        r = _post(server, CHAT)  # max_pending_prepares=1: this one must wait its turn
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert "preparation" in r.json()["error"]["message"]
        assert slow.result().status_code == 200
    after = scrape(server.url)
    assert metric(after, "omnistage_requests_rejected_total") == \
        metric(before, "omnistage_requests_rejected_total") + 1
    assert metric(after, "omnistage_server_requests_in_flight") == 0


def test_python_api_bad_prompt_raises_value_error(llm):
    async def main() -> None:
        with pytest.raises(ValueError, match="voice"):
            async for _ in llm.generate({"messages": MESSAGES, "voice": "nobody"}):
                pass
        with pytest.raises(ValueError, match="request_id"):
            async for _ in llm.generate("hi", request_id=""):
                pass
        outs = [out async for out in llm.generate("hi", {"thinker": _greedy(llm, 2)},
                                                  ["text"])]
        assert outs[-1].finished and not outs[-1].error

    asyncio.run(main())
    assert llm.runtime.num_active() == 0 and llm.preparing == 0


def _greedy(llm: AsyncOmniLLM, max_tokens: int):
    return dataclasses.replace(llm.pipeline.default_params["thinker"], temperature=0.0,
                               max_tokens=max_tokens)


# ------------------------------------------------------------------ defect 5
def _requests(samples: dict, endpoint: str, status: str) -> float:
    return metric(samples, "omnistage_http_requests_total", endpoint=endpoint, status=status)


def test_every_request_is_counted_with_its_status(server, slow_prepare):
    before = scrape(server.url)
    assert _post(server, {"model": MODEL_NAME}).status_code == 400  # no messages
    assert _post(server, {**CHAT, "model": "nope"}).status_code == 404
    assert httpx.get(server.url + "/v1/nothing-here").status_code == 404
    with ThreadPoolExecutor(1) as pool:  # a 429: the preparation queue is full
        slow = pool.submit(_post, server, CHAT)
        assert slow_prepare.wait(10)
        assert _post(server, CHAT).status_code == 429
        assert slow.result().status_code == 200
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200 and r.read().endswith(b"data: [DONE]\n\n")
    after = scrape(server.url)
    for endpoint, status, added in (("chat", "400", 1), ("chat", "404", 1), ("other", "404", 1),
                                    ("chat", "429", 1), ("chat", "ok", 2)):
        assert _requests(after, endpoint, status) == _requests(before, endpoint, status) + added, \
            (endpoint, status)
    # /health and /metrics are not counted
    assert not any(s[0] == "omnistage_http_requests_total" and ("endpoint", "other") in s[1]
                   and ("status", "ok") in s[1] for s in after)


# ------------------------------------------------------------------ defect 6
@pytest.fixture
def no_audio_decoded(llm, monkeypatch) -> None:
    """code2wav finds nothing to decode in any request, so it finishes with no audio (speech
    asks the talker for at least one code, so the talker alone cannot make that happen)."""
    monkeypatch.setattr(llm.pipeline.workers["code2wav"].model, "empty", lambda state: True)


@pytest.mark.parametrize("response_format,stream_format", [
    ("wav", "audio"), ("mp3", "audio"), ("pcm", "audio"), ("pcm", "sse"), ("wav", "sse")])
def test_speech_without_audio_is_an_error(server, no_audio_decoded, response_format,
                                          stream_format):
    r = _post(server, {**SPEECH, "response_format": response_format,
                       "stream_format": stream_format}, "/v1/audio/speech")
    assert r.status_code == 500, (r.status_code, r.headers, r.content[:200])
    error = r.json()["error"]
    assert error["code"] == "no_audio_generated" and error["type"] == "server_error"
    assert "no audio" in error["message"]


def test_speech_with_audio_still_succeeds(server):
    r = _post(server, {**SPEECH, "response_format": "wav"}, "/v1/audio/speech")
    assert r.status_code == 200, r.text
    samples, rate = read_wav(r.content)
    assert rate == 24000 and len(samples) > 0


@pytest.mark.parametrize("talker_params", [None, {"min_tokens": 0, "max_tokens": 1}])
def test_chat_with_audio_asks_the_talker_for_a_code(server, llm, monkeypatch, talker_params):
    """Chat with audio output, like speech: the talker draws at least one code whatever the
    request says (a first draw of its stop code would give a 200 with no audio)."""
    seen = []
    start = llm.start

    async def recording(prompt, sampling_params=None, *args, **kwargs):
        seen.append(sampling_params)
        return await start(prompt, sampling_params, *args, **kwargs)

    monkeypatch.setattr(llm, "start", recording)
    body = {**CHAT, "modalities": ["text", "audio"], "audio": {"voice": "Chelsie",
                                                                "format": "wav"}}
    if talker_params:
        body["stage_sampling_params"] = {"talker": talker_params}
    r = _post(server, body)
    assert r.status_code == 200, r.text
    talker = seen[-1]["talker"]
    assert talker.min_tokens >= 1
    if talker_params:
        assert talker.max_tokens == 1
    assert r.json()["choices"][0]["message"]["audio"]["data"]  # some audio came back
    text_only = _post(server, CHAT)  # text only: the talker's params are left alone
    assert text_only.status_code == 200 and "talker" not in (seen[-1] or {})
