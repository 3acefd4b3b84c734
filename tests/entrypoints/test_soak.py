"""A bounded soak of the OpenAI server (issue 24): a seeded mix of chat (text, audio, streamed or
not) and speech (wav, SSE) requests at a steady concurrency on the tiny Qwen2.5-Omni, with 10%
malformed bodies, 10% streams the client drops after the first chunk, and one request whose
talker step raises inside a batch of others. Nothing may be lost, the only 5xx is the injected
one, memory stays flat after warm-up, and every gauge and KV block is back to idle at the end.

The server runs in this process (uvicorn in a thread) so that the talker can be steered and
broken with plain attribute patches, and so that RSS is this process's."""

from __future__ import annotations

import asyncio
import base64
import ctypes
import ctypes.util
import dataclasses
import gc
import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import psutil
import pytest

from omnistage.entrypoints.async_llm import AsyncOmniLLM
from omnistage.entrypoints.openai.server import build_app
from omnistage.entrypoints.openai.serving import ServerConfig
from tests.faults import poison_talker
from tests.entrypoints.server_utils import (MODEL_NAME, ThreadServer, metric, read_wav,
                                           scrape)

# NOTE: RSS grows over the first ~100-300 audio requests and then stays flat (oneDNN caches a
# primitive per conv shape, the heap settles); warm-up covers most of that, so that the drift
# measured after it is a leak's, not the caches'
NUM_WARMUP = 200  # requests before RSS is first measured
NUM_MEASURED = 200
CONCURRENCY = 16
REQUEST_TIMEOUT_S = 90.0  # per request: generous, the machine may be loaded
PHASE_TIMEOUT_S = 150.0  # the whole warm-up, or the whole measured phase
MAX_RSS_DRIFT = 0.05
POISON_SEED = 424242  # the one request whose talker steps raise (talker seed = seed + 1)
TALKER_CODES = (8, 24)  # every talker request: at least 8 codes (audio), at most 24 (cheap)
LONG_TOKENS = 1000  # a stream the client drops: long enough that it is still running then

CHAT, SPEECH = "/v1/chat/completions", "/v1/audio/speech"
PROMPTS = ["Hello", "Say something nice.", "Count to three.", "What is the weather like?"]
VOICES = ["Chelsie", "Ethan"]
KINDS = ["chat_text", "chat_text_stream", "chat_audio_stream", "chat_audio_wav", "speech_wav",
         "speech_sse"]
BIG = 2 ** 70
# (path, body, status): malformed requests, each refused with a 4xx in OpenAI's error shape
MALFORMED: list[tuple[str, Any, int]] = [
    (CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "bogus": 1},
     400),
    (CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "temperature": "hot"}, 400),
    (CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "seed": BIG},
     400),
    (CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "top_p": 5},
     400),
    (CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 0}, 400),
    (CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "stream": "yes"}, 400),
    (CHAT, {"model": MODEL_NAME, "messages": []}, 400),
    (CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "stage_sampling_params": {"talker": {"top_p": 5.0}}}, 400),
    (CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "stage_sampling_params": {"vocoder": {"seed": 1}}}, 400),
    (CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, 400),
    (CHAT, b'{"model": "tiny-omni", "messages": [', 400),
    (CHAT, {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404),
    (SPEECH, {"model": MODEL_NAME, "input": "hi", "voice": "alloy"}, 400),
    (SPEECH, {"model": MODEL_NAME, "input": "hi", "voice": "Chelsie", "seed": BIG}, 400),
    (SPEECH, {"model": MODEL_NAME, "input": "hi", "voice": "Chelsie", "speed": 2.0}, 400),
    (SPEECH, {"model": MODEL_NAME, "input": "", "voice": "Chelsie"}, 400),
    (SPEECH, {"model": MODEL_NAME, "input": "hi", "voice": "Chelsie",
              "response_format": "wma"}, 400),
    (SPEECH, b"{not json", 400),
    (SPEECH, {"model": "tts-1", "input": "hi", "voice": "Chelsie"}, 404),
]


# ------------------------------------------------------------------ the workload
@dataclass
class Spec:
    """One request of the plan and what it must get back."""

    index: int
    kind: str  # one of KINDS, or "malformed"
    path: str
    body: Any  # a dict (sent as JSON) or raw bytes
    expect: int | None = None  # a malformed request's status
    cancel: bool = False  # the client drops the stream after its first chunk
    poison: bool = False  # the injected failure

    @property
    def endpoint(self) -> str:
        return "chat" if self.path == CHAT else "speech"

    @property
    def streamed(self) -> bool:
        return isinstance(self.body, dict) and (self.body.get("stream") is True
                                                or self.body.get("stream_format") == "sse")

    def counted_as(self) -> str:
        """Its status in omnistage_http_requests_total."""
        if self.expect is not None:
            return str(self.expect)
        return "499" if self.cancel else "500" if self.poison else "ok"


@dataclass
class Outcome:
    status: int
    body: bytes = b""
    events: list[str] = field(default_factory=list)  # a stream's `data: ` payloads


def _valid(kind: str, seed: int, rng: random.Random) -> tuple[str, dict]:
    if kind.startswith("speech"):
        body = {"model": MODEL_NAME, "input": rng.choice(PROMPTS), "voice": rng.choice(VOICES),
                "seed": seed, "response_format": "wav"}
        if kind == "speech_sse":
            body.update(response_format="pcm", stream_format="sse")
        return SPEECH, body
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": rng.randint(2, 8), "seed": seed, "stream": kind.endswith("_stream")}
    if "audio" in kind:
        body["modalities"] = ["text", "audio"]
        body["audio"] = {"voice": rng.choice(VOICES),
                         "format": "pcm16" if body["stream"] else "wav"}
    return CHAT, body


def _cancelled(kind: str, seed: int, rng: random.Random) -> tuple[str, dict]:
    """A stream that would run for long: the thinker (text) or the talker (audio) must not
    stop before the client goes away."""
    path, body = _valid(kind, seed, rng)
    if kind == "chat_text_stream":
        body.update(max_tokens=LONG_TOKENS,
                    stage_sampling_params={"thinker": {"ignore_eos": True}})
    else:
        body["stage_sampling_params"] = {"talker": {"min_tokens": LONG_TOKENS,
                                                    "max_tokens": LONG_TOKENS}}
    return path, body


def build_plan(seed: int = 0) -> list[Spec]:
    """NUM_WARMUP + NUM_MEASURED requests: 10% malformed, 10% dropped streams, one poisoned
    request in the measured phase, the rest spread over KINDS."""
    rng = random.Random(seed)
    total = NUM_WARMUP + NUM_MEASURED
    roles = ["malformed"] * (total // 10) + ["cancel"] * (total // 10)
    roles += ["valid"] * (total - len(roles))
    rng.shuffle(roles)
    # mid-way through the measured phase, when the talker is busy with others
    poison_at = roles.index("valid", NUM_WARMUP + NUM_MEASURED // 2)
    roles[poison_at] = "poison"
    plan = []
    for i, role in enumerate(roles):
        seed_i = rng.randrange(1 << 20)
        if seed_i == POISON_SEED:
            seed_i += 1
        if role == "malformed":
            path, body, status = rng.choice(MALFORMED)
            plan.append(Spec(i, "malformed", path, body, expect=status))
        elif role == "cancel":
            kind = rng.choice(["chat_text_stream", "chat_audio_stream"])
            plan.append(Spec(i, kind, *_cancelled(kind, seed_i, rng), cancel=True))
        elif role == "poison":
            plan.append(Spec(i, "chat_audio_wav", *_valid("chat_audio_wav", POISON_SEED, rng),
                             poison=True))
        else:
            kind = rng.choice(KINDS)
            plan.append(Spec(i, kind, *_valid(kind, seed_i, rng)))
    return plan


# ------------------------------------------------------------------ the client
async def _send(client: httpx.AsyncClient, url: str, spec: Spec) -> Outcome:
    content = spec.body if isinstance(spec.body, bytes) else json.dumps(spec.body).encode()
    headers = {"content-type": "application/json"}
    if not spec.streamed:
        r = await client.post(url + spec.path, content=content, headers=headers)
        return Outcome(r.status_code, r.content)
    async with client.stream("POST", url + spec.path, content=content, headers=headers) as r:
        if r.status_code != 200:
            return Outcome(r.status_code, await r.aread())
        out = Outcome(200)
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                out.events.append(line[6:])
                if spec.cancel:
                    break  # leaving the block closes the connection mid-stream
        return out


async def _run(url: str, plan: list[Spec]) -> dict[int, Outcome | BaseException]:
    """Every request of `plan`, CONCURRENCY at a time; each one's outcome or exception."""
    sem = asyncio.Semaphore(CONCURRENCY)
    results: dict[int, Outcome | BaseException] = {}
    limits = httpx.Limits(max_connections=CONCURRENCY + 4, max_keepalive_connections=CONCURRENCY)

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        async def one(spec: Spec) -> None:
            async with sem:
                try:
                    results[spec.index] = await _send(client, url, spec)
                except Exception as e:  # noqa: BLE001 - a lost request, reported by the test
                    results[spec.index] = e

        await asyncio.wait_for(asyncio.gather(*(one(s) for s in plan)), PHASE_TIMEOUT_S)
    return results


# ------------------------------------------------------------------ checks of one response
def _openai_error(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    return err


def _audible(samples: np.ndarray) -> bool:
    return len(samples) > 0 and int(np.abs(samples.astype(np.int32)).max()) > 0


def _check_stream_chat(spec: Spec, out: Outcome) -> None:
    assert out.events[-1] == "[DONE]", out.events[-3:]
    chunks = [json.loads(e) for e in out.events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    finish = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finish in (["stop"], ["length"]), finish
    if "audio" in spec.kind:
        pcm = b"".join(base64.b64decode(ch["delta"]["audio"]["data"]) for c in chunks
                       for ch in c["choices"] if "data" in (ch["delta"].get("audio") or {}))
        assert _audible(np.frombuffer(pcm, "<i2"))


def _check_ok(spec: Spec, out: Outcome) -> None:
    """A complete, well-formed success for the spec's kind."""
    assert out.status == 200, (spec, out.status, out.body[:300])
    if spec.kind in ("chat_text_stream", "chat_audio_stream"):
        return _check_stream_chat(spec, out)
    if spec.kind == "speech_sse":
        events = [json.loads(e) for e in out.events if e != "[DONE]"]
        assert events[-1]["type"] == "speech.audio.done", events[-1]
        pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
        assert _audible(np.frombuffer(pcm, "<i2"))
        return None
    if spec.kind == "speech_wav":
        samples, rate = read_wav(out.body)
        assert rate == 24000 and _audible(samples)
        return None
    r = json.loads(out.body)
    choice = r["choices"][0]
    assert r["object"] == "chat.completion" and choice["finish_reason"] in ("stop", "length")
    assert r["usage"]["completion_tokens"] >= 1
    if spec.kind == "chat_audio_wav":
        samples, rate = read_wav(base64.b64decode(choice["message"]["audio"]["data"]))
        assert rate == 24000 and _audible(samples)
    return None


def _check(spec: Spec, out: Outcome) -> None:
    if spec.expect is not None:  # malformed: refused up front
        assert out.status == spec.expect, (spec.body, out.status, out.body[:300])
        _openai_error(out.body)
    elif spec.poison:  # its talker step raised: a 500 naming the stage, nothing else
        assert out.status == 500, (out.status, out.body[:300])
        err = _openai_error(out.body)
        assert err["type"] == "server_error" and "talker" in err["message"] and \
            "injected" in err["message"], err
    elif spec.cancel:  # we left after the first chunk, which must have been a good one
        assert out.status == 200 and len(out.events) == 1, (out.status, out.events)
        assert json.loads(out.events[0])["object"] == "chat.completion.chunk"
    else:
        _check_ok(spec, out)


# ------------------------------------------------------------------ the server
@pytest.fixture(scope="module")
def llm(tiny_omni_dir) -> Iterator[AsyncOmniLLM]:
    llm = AsyncOmniLLM(str(tiny_omni_dir), device="cpu", prepare_workers=2)
    # every talker request makes some audio, and little of it (a random talker may stop at
    # once or run for its 4096 codes); a request's stage_sampling_params still override it
    low, high = TALKER_CODES
    talker = llm.pipeline.default_params["talker"]
    llm.pipeline.default_params["talker"] = dataclasses.replace(talker, min_tokens=low,
                                                                max_tokens=high)
    yield llm
    llm.shutdown()


def _wait_idle(llm: AsyncOmniLLM, server: ThreadServer, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(server.url)
        idle = llm.runtime.num_active() == 0 and llm.preparing == 0 and \
            metric(samples, "omnistage_server_requests_in_flight") == 0
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def _rss() -> int:
    """This process's resident memory, less what the allocator holds free: garbage collected,
    then glibc's free heap pages handed back (they are not live memory, and how many it keeps
    depends on the order of frees across threads)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim(0)
    return psutil.Process().memory_info().rss


def _http_counts(samples: dict) -> Counter:
    return Counter({(dict(labels)["endpoint"], dict(labels)["status"]): value
                    for (name, labels), value in samples.items()
                    if name == "omnistage_http_requests_total"})


# ------------------------------------------------------------------ the soak
@pytest.mark.slow  # (runs by default: ~30-40 s on 2 cores; deselect with -m "not slow")
def test_soak_mixed_traffic(llm):
    t0 = time.monotonic()
    plan = build_plan()
    assert sum(s.poison for s in plan) == 1
    seen = poison_talker(llm, POISON_SEED + 1)
    config = ServerConfig(served_model_names=[MODEL_NAME], max_audio_seconds=30)
    with ThreadServer(build_app(llm, config)) as server:
        before = _http_counts(scrape(server.url))
        results = asyncio.run(_run(server.url, plan[:NUM_WARMUP]))
        _wait_idle(llm, server)
        rss_warm = _rss()
        results |= asyncio.run(_run(server.url, plan[NUM_WARMUP:]))
        samples = _wait_idle(llm, server)
        rss_end = _rss()
        took = time.monotonic() - t0

        # nothing lost: every request has its answer, and it is the one it must be
        assert sorted(results) == [s.index for s in plan]
        lost = {i: repr(r) for i, r in results.items() if isinstance(r, BaseException)}
        assert not lost, lost
        for spec in plan:
            _check(spec, results[spec.index])
        server_errors = [s.index for s in plan if results[s.index].status >= 500]
        assert server_errors == [s.index for s in plan if s.poison]

        # the injected failure hit a batched talker step, then failed its request alone
        assert seen["raised"] >= 2 and seen["batch"] > 1, seen
        assert llm.runtime.stage_errors.get("talker", 0) >= 1

        # every HTTP request counted once, with its status
        sent = Counter((s.endpoint, s.counted_as()) for s in plan)
        counted = _http_counts(samples)
        counted.subtract(before)
        assert +counted == sent, (+counted, sent)
        assert metric(samples, "omnistage_requests_aborted_total", endpoint="chat") == \
            sum(s.cancel for s in plan)

        # back to idle: runtime, stages, KV, code2wav, gauges
        assert llm.runtime.num_active() == 0 and not llm.runtime.requests
        for name, host in llm.runtime.local.items():
            assert not host.links and not host.early and host.num_early == 0, name
        for name, engine in llm.pipeline.engines.items():
            assert not engine.seqs and not engine.detok, name
            assert engine.blocks.num_free_blocks == engine.blocks.num_blocks, name
        assert not llm.pipeline.workers["code2wav"].requests
        assert metric(samples, "omnistage_runtime_requests") == 0
        assert metric(samples, "omnistage_server_requests_in_flight") == 0
        for stage in llm.stage_names:
            assert metric(samples, "omnistage_stage_running_requests", stage=stage) == 0, stage
            assert metric(samples, "omnistage_stage_queue_depth", stage=stage) == 0, stage
        for stage in ("thinker", "talker"):
            assert metric(samples, "omnistage_stage_kv_blocks_free", stage=stage) == \
                metric(samples, "omnistage_stage_kv_blocks_total", stage=stage) > 0, stage

        # memory flat after warm-up
        drift = (rss_end - rss_warm) / rss_warm
        print(f"soak: {len(plan)} requests in {took:.1f} s; RSS {rss_warm / 2**20:.0f} -> "
              f"{rss_end / 2**20:.0f} MiB ({100 * drift:+.1f}%); talker raised "
              f"{seen['raised']}x, largest batch {seen['batch']}")
        assert drift < MAX_RSS_DRIFT, f"RSS grew {100 * drift:.1f}% after warm-up"
        assert took < 2 * PHASE_TIMEOUT_S
