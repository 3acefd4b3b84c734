"""The engine in a process of its own (entrypoints/engine_process.py, `serve --engine-process`):
the same outputs as the engine in this process, prepared requests forgotten there when their
handle is dropped or their caller cancelled, bad requests named, a failed start raised, and a
dead engine answered (/health 503, a running stream ends with an error event and [DONE], new
requests refused) instead of hung on. The whole server suite also runs against it
(test_openai_server.py and test_server_shutdown.py are parametrised on it)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import os
import re
import signal
import threading
import time

import httpx
import numpy as np
import pytest

from omnistage import SamplingParams
from omnistage.entrypoints.async_llm import AsyncOmniLLM, NotAdmitted, RuntimeShutDown
from omnistage.entrypoints.engine_client import EngineClient
from tests.entrypoints.server_utils import MODEL_NAME, ServerProcess

OPTIONS = {"device": "cpu", "max_model_len": 2048, "num_kv_blocks": 512}
PROMPT = {"messages": [{"role": "user", "content": "Say something nice."}]}


@pytest.fixture(scope="module")
def engine(tiny_omni_dir):
    client = EngineClient(str(tiny_omni_dir), **OPTIONS)
    yield client
    client.shutdown()
    assert not client.alive


def _params(llm) -> dict[str, SamplingParams]:
    talker = llm.pipeline.default_params["talker"]
    return {"thinker": SamplingParams(max_tokens=12, seed=5, ignore_eos=True),
            "talker": dataclasses.replace(talker, max_tokens=40, min_tokens=40, seed=5)}


async def _run(llm) -> tuple[list, np.ndarray, list[int], str | None]:
    req = await llm.prepare(PROMPT, _params(llm), request_id="same-request")
    chunks, last = [], None
    async for last in llm.run(req):
        if last.audio is not None:
            chunks.append(last.audio)
    return (last.token_ids, np.concatenate(chunks), last.stages["talker"].token_ids,
            last.error)


def _prepared(engine: EngineClient) -> int:
    engine.runtime.stats()  # (asks the engine; prepared() reads that answer)
    return engine.runtime.prepared()


def _wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_outputs_equal_the_in_process_engine(engine, tiny_omni_dir):
    local = AsyncOmniLLM(str(tiny_omni_dir), **OPTIONS)
    try:
        expected = asyncio.run(_run(local))
    finally:
        local.shutdown()
    got = asyncio.run(_run(engine))
    assert expected[3] is None and got[3] is None
    assert len(expected[0]) == 12 and len(expected[2]) == 40
    assert float(np.abs(expected[1]).max()) > 1e-3  # (not silence: a real comparison)
    assert got[0] == expected[0]  # text tokens
    assert got[2] == expected[2]  # codes
    assert got[1].shape == expected[1].shape
    np.testing.assert_allclose(got[1], expected[1], atol=1e-5, rtol=0)


def test_a_dropped_handle_is_forgotten_in_the_engine(engine):
    async def prepare_and_drop() -> int:
        req = await engine.prepare(PROMPT, _params(engine))
        held = _prepared(engine)
        del req
        gc.collect()
        return held

    assert asyncio.run(prepare_and_drop()) == 1
    assert _wait_until(lambda: _prepared(engine) == 0)


def test_a_cancelled_preparation_is_forgotten_in_the_engine(engine):
    async def cancel_while_preparing() -> None:
        task = asyncio.ensure_future(engine.prepare(PROMPT, _params(engine)))
        await asyncio.sleep(0)  # (sent: the engine prepares it all the same)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_while_preparing())
    assert _wait_until(lambda: engine.preparing == 0)
    gc.collect()
    assert _wait_until(lambda: _prepared(engine) == 0)


def test_start_is_one_message_and_runs_as_the_in_process_engine(engine, tiny_omni_dir):
    """start(): prepared and submitted in the engine process from one PrepareCall (no RunCall
    round trip), with the same outputs as AsyncOmniLLM.start() in this process."""
    async def start_and_collect(llm) -> tuple[list, list[int], int]:
        req, outputs = await llm.start(PROMPT, _params(llm), request_id="same-start")
        last, chunks = None, 0
        async for last in outputs:
            chunks += last.audio is not None
        assert last.error is None and last.finished and req.request_id == "same-start"
        return last.token_ids, last.stages["talker"].token_ids, chunks

    local = AsyncOmniLLM(str(tiny_omni_dir), **OPTIONS)
    try:
        expected = asyncio.run(start_and_collect(local))
    finally:
        local.shutdown()
    sent: list = []
    send = engine._send
    engine._send = lambda msg: (sent.append(msg), send(msg))[1]
    try:
        got = asyncio.run(start_and_collect(engine))
    finally:
        del engine._send
    assert len(expected[0]) == 12 and len(expected[1]) == 40 and expected[2] > 0
    assert got == expected
    assert [type(m).__name__ for m in sent] == ["PrepareCall"] and sent[0].run
    assert engine.preparing == 0 and _prepared(engine) == 0 and not engine._running


def _running_in_engine(engine: EngineClient) -> int:
    engine.runtime.stats()
    return engine.runtime.num_active()


def test_a_refused_start_is_aborted_in_the_engine(engine):
    """admit() runs when the engine's answer comes, after the submission there: a refusal
    raises NotAdmitted and aborts the request in the engine."""
    seen = []

    def refuse(req) -> bool:
        seen.append(req.request_id)
        return False

    long = {**_params(engine), "talker": dataclasses.replace(
        _params(engine)["talker"], max_tokens=4000, min_tokens=4000)}
    with pytest.raises(NotAdmitted, match="not admitted"):
        asyncio.run(engine.start(PROMPT, long, request_id="refused", admit=refuse))
    assert seen == ["refused"]
    assert _wait_until(lambda: _running_in_engine(engine) == 0)
    assert not engine._running and engine.preparing == 0


def test_a_cancelled_start_is_aborted_in_the_engine(engine):
    """A caller cancelled before the engine's answer: the request, which runs there once
    prepared, is aborted when the answer comes."""
    long = {**_params(engine), "talker": dataclasses.replace(
        _params(engine)["talker"], max_tokens=4000, min_tokens=4000)}

    async def cancel_while_starting() -> None:
        task = asyncio.ensure_future(engine.start(PROMPT, long, request_id="cancelled"))
        await asyncio.sleep(0)  # (sent: the engine prepares and submits it all the same)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_while_starting())
    assert _wait_until(lambda: engine.preparing == 0)
    assert _wait_until(lambda: _running_in_engine(engine) == 0)
    assert not engine._running


def test_a_bad_request_names_its_field(engine):
    bad = SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"max_tokens"):
        asyncio.run(engine.prepare(PROMPT, bad))
    with pytest.raises(ValueError, match=r"request_id"):
        asyncio.run(engine.prepare(PROMPT, None, request_id=""))
    with pytest.raises(ValueError, match=r"max_tokens"):  # (start(): nothing runs there)
        asyncio.run(engine.start(PROMPT, bad))
    assert engine.alive and engine.preparing == 0 and not engine._running


def test_a_failed_start_is_raised(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModel"]}))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"failed to start: ValueError: .*NoSuchModel"):
        EngineClient(str(tmp_path), device="cpu")
    assert time.monotonic() - t0 < 60


def test_a_dead_engine_ends_streams_and_health(tiny_omni_dir, tmp_path):
    srv = ServerProcess(tiny_omni_dir, tmp_path / "server.log", "--engine-process")
    try:
        srv.wait_ready()
        pid = int(re.search(r"engine process (\d+): starting", srv.log()).group(1))
        body = {"model": MODEL_NAME, "messages": PROMPT["messages"], "max_tokens": 8,
                "stream": True, "modalities": ["text", "audio"],
                "audio": {"voice": "Chelsie", "format": "pcm16"},
                "stage_sampling_params": {"talker": {"min_tokens": 1500, "max_tokens": 1500}}}
        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body,
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        started.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert started.wait(60), srv.log()
        os.kill(pid, signal.SIGKILL)
        reader.join(30)
        assert not reader.is_alive(), srv.log()
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert "engine is gone" in error["message"], error
        health = httpx.get(srv.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json() == {"status": "dead"}
        refused = httpx.post(srv.url + "/v1/chat/completions", timeout=10,
                             json={**body, "stream": False})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "server_error"
    finally:
        rc = srv.stop()
    assert rc == 0, srv.log()
    assert "engine: the engine process exited" in srv.log()


def test_calls_after_shutdown_are_refused(tiny_omni_dir):
    client = EngineClient(str(tiny_omni_dir), **OPTIONS)
    client.shutdown()
    with pytest.raises(RuntimeShutDown):
        asyncio.run(client.prepare(PROMPT))
    assert not client.alive
