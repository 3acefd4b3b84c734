"""Server limits on a second `omnistage serve`: API key (401), a queue of one (429 with
Retry-After), the body size limit (413), and a graceful SIGTERM that lets a running stream end."""

from __future__ import annotations

import json
import signal
import time

import httpx
import openai
import pytest

from tests.entrypoints.server_utils import MODEL_NAME, ServerProcess

KEY = "sk-test-omnistage"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "Hello"}]
# a text request that runs for a while: the thinker ignores its end token
LONG = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1500, "stream": True,
        "stage_sampling_params": {"thinker": {"ignore_eos": True}}}


@pytest.fixture(scope="module")
def server(tiny_omni_dir, tmp_path_factory):
    srv = ServerProcess(tiny_omni_dir, tmp_path_factory.mktemp("srv") / "server.log",
                        "--max-queue", "1", "--max-request-mb", "0.05", "--shutdown-timeout",
                        "20", env={"OMNISTAGE_API_KEY": KEY})
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_api_key(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL_NAME})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert good.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                        max_tokens=2).choices[0].message.content
    assert httpx.get(server.url + "/health").status_code == 200  # not behind the key


def test_body_too_large(server):
    text = "x" * 60_000  # over the 0.05 MiB limit
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_full_queue_gets_429_then_recovers(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=LONG, headers=AUTH,
                      timeout=30) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # keep it: a dropped iterator closes the response
        next(lines)
        r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, json={
            "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
    # the first client went away: its slot comes back
    deadline = time.monotonic() + 10
    while True:
        r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, json={
            "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2})
        if r.status_code != 429 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert r.status_code == 200, r.text


def test_sigterm_drains_running_stream(server):
    body = {**LONG, "max_tokens": 400}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH,
                      timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    text = "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in map(lambda line: json.loads(line[6:]), rest[:-1]) if c["choices"])
    assert len(text) > 0
    assert server.proc.wait(30) == 0, server.log()
    assert "draining 1 request(s)" in server.log()
