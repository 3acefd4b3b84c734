"""The OpenAI-compatible server, end to end: a real `omnistage serve` subprocess on the tiny
Qwen2.5-Omni, driven with the official `openai` client (and raw httpx for bad input)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from urllib.parse import unquote

import httpx
import numpy as np
import openai
import pytest
import soundfile
from PIL import Image

from tests.entrypoints.server_utils import (MODEL_NAME, metric, openai_client, read_wav,
                                           running_server, scrape)

SAMPLES_PER_CODE = 480  # 2 mel frames x 240 (BigVGAN) at 24 kHz
# the talker of a random model may never emit its stop code: bound it
TALKER_CAP = {"stage_sampling_params": {"talker": {"max_tokens": 60}}}
MESSAGES = [{"role": "user", "content": "Say something nice."}]


# every test runs against both engine placements: in the server's process (the CPU's default)
# and in an engine process of its own (--engine-process)
@pytest.fixture(scope="module", params=["off", "on"], ids=["inprocess", "engine_process"])
def server(request, tiny_omni_dir, tmp_path_factory):
    engine = ["--engine-process"] if request.param == "on" else []
    with running_server(tiny_omni_dir, tmp_path_factory.mktemp("srv") / "server.log",
                        *engine) as srv:
        srv.engine_process = request.param == "on"
        yield srv


def test_engine_placement(server):
    """The engine process is really used when asked for (its start-up phase is reported) and
    not otherwise."""
    phases = {dict(labels)["phase"] for (name, labels) in scrape(server.url)
              if name == "omnistage_startup_seconds"}
    assert {"total", "thinker", "runtime", "gc_freeze"} <= phases
    assert ("engine_process" in phases) == server.engine_process
    # the engine process froze its own start-up heap too
    assert ("engine_gc_freeze" in phases) == server.engine_process
    # the serving process runs at the shorter GIL switch interval (server.set_switch_interval),
    # and so does the engine process when there is one
    assert server.log_path.read_text().count("GIL switch interval: 0.5 ms") == \
        (2 if server.engine_process else 1)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["voices"] == ["Chelsie", "Ethan"]


def test_chat_text_only(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8,
                                       seed=0)
    msg = r.choices[0].message
    assert isinstance(msg.content, str) and msg.content
    assert msg.audio is None
    assert r.choices[0].finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 5
    # same seed, streamed: the same text
    chunks = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8,
                                            seed=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        msg.content


def _audio_request(client, stream: bool, seed: int = 7):
    return client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=12, seed=seed, stream=stream,
        modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"},
        stream_options={"include_usage": True} if stream else None, extra_body=TALKER_CAP)


def test_chat_audio_streamed_equals_non_streamed(client):
    r = _audio_request(client, stream=False)
    audio = r.choices[0].message.audio
    assert r.choices[0].message.content is None and audio.transcript
    wave, sr = read_wav(base64.b64decode(audio.data))
    codes = r.usage.completion_tokens_details.audio_tokens
    assert sr == 24000 and codes > 0
    assert len(wave) == codes * SAMPLES_PER_CODE
    assert np.abs(wave).max() > 100  # not silence
    assert r.usage.completion_tokens == codes + r.usage.completion_tokens_details.text_tokens

    transcript, pcm, usage, finish = [], [], None, None
    for c in _audio_request(client, stream=True):
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            a = ch.delta.audio
            if a is not None and a.transcript:
                transcript.append(a.transcript)
            if a is not None and a.data:
                pcm.append(base64.b64decode(a.data))
            finish = ch.finish_reason or finish
    assert "".join(transcript) == audio.transcript
    streamed = np.frombuffer(b"".join(pcm), "<i2")
    np.testing.assert_array_equal(streamed, wave)
    assert usage.completion_tokens_details.audio_tokens == codes
    assert finish == r.choices[0].finish_reason


def test_chat_audio_and_image_input(client):
    sr = 16000
    t = np.arange(sr) / sr
    buf = io.BytesIO()
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), sr,
                    format="WAV", subtype="PCM_16")
    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 84, 3), np.uint8)).save(
        png, format="PNG")
    content = [{"type": "input_audio", "input_audio": {
        "data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"}},
        {"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()}},
        {"type": "text", "text": "What is this?"}]
    r = client.chat.completions.create(model=MODEL_NAME, max_tokens=4, seed=1,
                                       messages=[{"role": "user", "content": content}])
    plain = client.chat.completions.create(model=MODEL_NAME, max_tokens=4, seed=1,
                                           messages=[{"role": "user", "content": "What is this?"}])
    assert r.choices[0].message.content
    # the audio's and the image's placeholder tokens are in the prompt
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 20


def _mp4(frames: int = 8, size: int = 56) -> bytes:
    av = pytest.importorskip("av")
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as box:
        stream = box.add_stream("mpeg4", rate=4)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        rng = np.random.default_rng(0)
        for _ in range(frames):
            img = rng.integers(0, 255, (size, size, 3), np.uint8)
            box.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        box.mux(stream.encode())
    return buf.getvalue()


def test_chat_video_input(client):
    url = "data:video/mp4;base64," + base64.b64encode(_mp4()).decode()
    r = client.chat.completions.create(model=MODEL_NAME, max_tokens=4, seed=1, messages=[
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                     {"type": "text", "text": "What happens?"}]}])
    assert r.choices[0].message.content and r.usage.prompt_tokens > 40


def test_speech(client, server):
    text = "Hello, wörld! Ünïcödé ✓ 42."
    raw = client.audio.speech.with_raw_response.create(model=MODEL_NAME, voice="Chelsie",
                                                       input=text, response_format="wav",
                                                       extra_body={"seed": 3})
    assert unquote(raw.headers["x-transcript"]) == text  # exactly the input, byte for byte
    wave, sr = read_wav(raw.content)
    codes = int(raw.headers["x-codec-tokens"])
    assert sr == 24000 and codes > 0 and len(wave) == codes * SAMPLES_PER_CODE
    flac = client.audio.speech.create(model=MODEL_NAME, voice="Chelsie", input=text,
                                      response_format="flac", extra_body={"seed": 3})
    assert len(read_wav(flac.content)[0]) > 0
    with httpx.stream("POST", server.url + "/v1/audio/speech", timeout=60, json={
            "model": MODEL_NAME, "voice": "Ethan", "input": text, "response_format": "pcm",
            "stream_format": "sse", "seed": 3}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["transcript"] == text
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(pcm) == 2 * SAMPLES_PER_CODE * events[-1]["usage"]["output_tokens"] > 0


def test_concurrent_streaming_clients(server):
    async def one(client, i: int) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": f"Count to {i}."}],
            max_tokens=6, seed=i, stream=True, modalities=["text", "audio"],
            audio={"voice": "Chelsie", "format": "pcm16"}, extra_body=TALKER_CAP)
        text, finish = [], None
        async for c in stream:
            for ch in c.choices:
                if ch.delta.audio is not None and ch.delta.audio.transcript:
                    text.append(ch.delta.audio.transcript)
                finish = ch.finish_reason or finish
        return "".join(text), finish

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                      max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(50)))

    t0 = time.perf_counter()
    results = asyncio.run(main())
    assert len(results) == 50
    assert all(finish in ("stop", "length") for _, finish in results)
    assert sum(bool(text) for text, _ in results) >= 40  # a random model may end at once
    assert time.perf_counter() - t0 < 60


BAD = [  # (body, expected status, what the message names)
    (b"{not json", 400, "JSON"),
    ({"model": MODEL_NAME, "messages": "hi"}, 400, "messages"),
    ({"model": MODEL_NAME, "messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 10 ** 6}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "messages": MESSAGES, "bogus": 1}, 400, "bogus"),
    ({"model": MODEL_NAME, "messages": MESSAGES, "n": 9}, 400, "n"),
    ({"model": "gpt-4o", "messages": MESSAGES}, 404, "gpt-4o"),
    ({"model": MODEL_NAME, "messages": MESSAGES, "modalities": ["text", "audio"],
      "audio": {"voice": "alloy", "format": "wav"}}, 400, "Chelsie"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "input_audio",
      "input_audio": {"data": "!!not base64!!", "format": "wav"}}]}]}, 400, "base64"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "image_url",
      "image_url": {"url": "http://example.com/a.png"}}]}]}, 400, "remote"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "video_url",
      "video_url": {"url": "/etc/hostname"}}]}]}, 400, "data URL"),
    ({"model": MODEL_NAME, "messages": MESSAGES,
      "stage_sampling_params": {"vocoder": {"seed": 1}}}, 400, "vocoder"),
    ({"model": MODEL_NAME, "messages": MESSAGES,
      "stage_sampling_params": {"talker": {"top_p": 7.0}}}, 400, "top_p"),
    ({"model": MODEL_NAME, "voice": "alloy", "input": "hi"}, 400, "Ethan"),
]


def _oversized_audio() -> dict:
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(40 * 16000, np.float32), 16000, format="WAV",
                    subtype="PCM_16")  # 40 s: over the 30 s audio window
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue())
                                                .decode(), "format": "wav"}}]}]}


@pytest.mark.parametrize("body,status,needle", BAD + [(None, 400, "limit")])
def test_bad_input_gets_openai_error(server, body, status, needle):
    body = _oversized_audio() if body is None else body
    path = "/v1/audio/speech" if isinstance(body, dict) and "input" in body else \
        "/v1/chat/completions"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]


def test_openai_client_errors_and_still_serving(client):
    with pytest.raises(openai.BadRequestError, match="Chelsie"):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                       modalities=["text", "audio"],
                                       audio={"voice": "alloy", "format": "wav"})
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=4)
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4)
    assert r.choices[0].message.content


def test_disconnect_aborts_every_stage_and_frees_kv(server):
    before = scrape(server.url)
    total = {s: metric(before, "omnistage_stage_kv_blocks_total", stage=s)
             for s in ("thinker", "talker")}
    assert all(total.values())
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1500, "stream": True,
            "modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "pcm16"},
            "stage_sampling_params": {"thinker": {"ignore_eos": True},
                                      "talker": {"min_tokens": 1000}}}  # neither stops early
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        during = scrape(server.url)
    # both AR stages held KV blocks for it while it ran
    assert metric(during, "omnistage_runtime_requests") == 1
    for s in ("thinker", "talker"):
        assert metric(during, "omnistage_stage_kv_blocks_free", stage=s) < total[s]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = scrape(server.url)
        if metric(after, "omnistage_runtime_requests") == 0 and \
                metric(after, "omnistage_server_requests_in_flight") == 0:
            break
        time.sleep(0.1)
    assert metric(after, "omnistage_requests_aborted_total", endpoint="chat") == \
        metric(before, "omnistage_requests_aborted_total", endpoint="chat") + 1
    assert metric(after, "omnistage_runtime_requests") == 0
    for s in ("thinker", "talker", "code2wav"):
        assert metric(after, "omnistage_stage_running_requests", stage=s) == 0
        assert metric(after, "omnistage_stage_queue_depth", stage=s) == 0
    for s in ("thinker", "talker"):
        assert metric(after, "omnistage_stage_kv_blocks_free", stage=s) == total[s]
    for s in ("thinker", "talker", "code2wav"):  # (the CPU has no graphs to leave)
        key = ("omnistage_stage_graph_captures_pending", (("stage", s),))
        assert key in after and after[key] == 0, s
    # and it was cut short: the thinker is far from its 1500 tokens
    assert metric(after, "omnistage_stage_generated_tokens_total", stage="thinker") < \
        metric(before, "omnistage_stage_generated_tokens_total", stage="thinker") + 1500


def test_disconnect_aborts_a_non_streamed_request(server):
    before = scrape(server.url)
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1500,
            "stage_sampling_params": {"thinker": {"ignore_eos": True}}}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.3)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = scrape(server.url)
        if metric(after, "omnistage_server_requests_in_flight") == 0:
            break
        time.sleep(0.1)
    assert metric(after, "omnistage_requests_aborted_total", endpoint="chat") == \
        metric(before, "omnistage_requests_aborted_total", endpoint="chat") + 1
    assert metric(after, "omnistage_runtime_requests") == 0
    assert metric(after, "omnistage_stage_kv_blocks_free", stage="thinker") == \
        metric(after, "omnistage_stage_kv_blocks_total", stage="thinker")


def test_metrics_after_requests(server):
    s = scrape(server.url)
    assert metric(s, "omnistage_http_requests_total", endpoint="chat", status="ok") >= 50
    assert metric(s, "omnistage_http_requests_total", endpoint="speech", status="ok") >= 3
    assert metric(s, "omnistage_time_to_first_token_seconds_count") >= 50
    assert metric(s, "omnistage_time_to_first_audio_seconds_count") >= 1
    assert metric(s, "omnistage_e2e_request_latency_seconds_sum") > 0
    for stage in ("thinker", "talker"):
        assert metric(s, "omnistage_stage_generated_tokens_total", stage=stage) > 0
        assert metric(s, "omnistage_stage_steps_total", stage=stage) > 0
        assert metric(s, "omnistage_stage_requests_total", stage=stage,
                      finish_reason="length") + \
            metric(s, "omnistage_stage_requests_total", stage=stage, finish_reason="stop") > 0
    assert metric(s, "omnistage_audio_seconds_total") > 0
    assert metric(s, "omnistage_stage_batch_size", stage="thinker") >= 0
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
