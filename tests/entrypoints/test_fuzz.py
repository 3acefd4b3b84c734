"""Schema fuzzing of every endpoint (issue 24). Request bodies come from the app's own OpenAPI
schema (`app.openapi()`) through schemathesis: valid by schema (a share of them steered to the
served model, a real voice, real or damaged media and small counts, so that they reach the
pipeline) and schema-violating; then values at any depth swapped for JSON edge tokens (NaN, 1e999,
2^64, lone surrogates, nesting 3000 deep, oversized strings) and whole bodies that are not JSON.
GET routes get random path ids, queries and headers; any method on any path an OpenAI error.

POST /v1/audio/transcriptions takes multipart/form-data: its generated bodies are sent as forms
(a list as repeated parts, the binary `file` as a file part), mutated by swapping a field for an
edge token, duplicating, renaming or retyping a part, and replaced by malformed multipart bodies.

Servers: uvicorn threads on the tiny Qwen2.5-Omni (max_model_len 128, so that no request runs
long) and the tiny Z-Image (sides capped at 64 px). Every endpoint gets at least MIN_CASES
generated requests per mode (counted). Every answer must be below 500, every 4xx OpenAI's
error JSON, no stream may carry a server error, and the servers are healthy after: no request
left in flight, no stage error, no 5xx in /metrics. Generation is derandomized: the same cases
on every run (raise MIN_CASES locally to search further)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from PIL import Image

from omnistage.entrypoints.async_llm import AsyncOmniLLM
from omnistage.entrypoints.openai.server import build_app
from omnistage.entrypoints.openai.serving import ServerConfig
from omnistage.models.diffusion_pipeline import MAX_IMAGES, MAX_STEPS
from tests.entrypoints.server_utils import MODEL_NAME, ThreadServer, scrape

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402

MIN_CASES = 200  # generated requests per endpoint and mode, asserted
MAX_MODEL_LEN = 128  # bounds every request on the tiny omni model (~0.3 s at most)
MAX_REQUEST_BYTES = 256 << 10
IMAGE_NAME = "tiny-z-image"
IMAGE_MAX_SIDE = 64
CHAT, SPEECH, IMAGES = "/v1/chat/completions", "/v1/audio/speech", "/v1/images/generations"
COMPLETIONS = "/v1/completions"
TRANSCRIPTIONS = "/v1/audio/transcriptions"
ERROR_KEYS = {"message", "type", "param", "code"}

# no shrinking: a failure names its request, and shrinking through a server takes minutes
FUZZ = settings(max_examples=MIN_CASES, deadline=None, database=None, derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.data_too_large])

# a field's value replaced by raw JSON text (what json.dumps would never write, or edges)
EDGE_TOKENS = [
    "NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" + "0" * 400, "9223372036854775808",
    "-9223372036854775809", "18446744073709551616", "2147483648", "-1", "0", "-0", "1.0", "0.5",
    "1e-320", '"\\ud800"', '"\\u0000"', '"\\udfff\\ud800"', '""', "null", "true", "[]", "{}",
    "[" * 3000 + "]" * 3000, '{"a":' * 3000 + "1" + "}" * 3000, '"' + "x" * 70_000 + '"',
    '"' + "y" * MAX_REQUEST_BYTES + '"', '[{"type": "text", "text": "hi"}]', '{"thinker": {}}',
]
# whole bodies
RAW_BODIES = [b"", b"null", b"[]", b"{}", b"{", b"\xff\xfe{}", b"\xef\xbb\xbf{}", b'{"a": 1} x',
              b'{"model": 1, "model": "x"}', b"[" * 100_000, b'"' + b"\x80" * 64 + b'"',
              b"{" + b'"k": 0, ' * 20_000 + b'"z": 0}']


# ------------------------------------------------------------------ media for steered bodies
def _wav() -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, np.random.default_rng(0).uniform(-0.3, 0.3, 3200), 16000, format="WAV")
    return buf.getvalue()


def _png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (28, 28, 3), np.uint8)).save(
        buf, format="PNG")
    return buf.getvalue()


def _mp4() -> bytes:
    import av
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as box:
        stream = box.add_stream("mpeg4", rate=4)
        stream.width = stream.height = 28
        stream.pix_fmt = "yuv420p"
        rng = np.random.default_rng(0)
        for _ in range(2):
            img = rng.integers(0, 255, (28, 28, 3), np.uint8)
            box.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        box.mux(stream.encode())
    return buf.getvalue()


def _damaged(data: bytes) -> list[bytes]:
    """Truncated, header-flipped and padded copies of a valid file."""
    flipped = bytearray(data)
    for i in range(4, min(64, len(data)), 7):
        flipped[i] ^= 0xFF
    return [data[: len(data) // 2], data[:12], bytes(flipped), data + b"\x00" * 999, b"", b"\x00"]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _wav_of(seconds: float, rate: int = 16000, channels: int = 1) -> bytes:
    buf = io.BytesIO()
    x = np.random.default_rng(1).uniform(-0.3, 0.3, (int(seconds * rate), channels))
    soundfile.write(buf, x, rate, format="WAV")
    return buf.getvalue()


WAV, PNG, MP4 = _wav(), _png(), _mp4()
# uploads for steered transcription forms: valid clips (other rates, stereo, FLAC), damaged
# ones, one over the server's 30 s limit (a 400 from its header), and files that are not audio
UPLOADS = [WAV, _wav_of(0.5, 8000), _wav_of(0.3, 44100, 2), *_damaged(WAV), _wav_of(31, 2000),
           PNG, MP4, b"plain text"]
AUDIO_DATA = [_b64(d) for d in (WAV, *_damaged(WAV))] + ["not base64!", "QQ", "QUJD"]
IMAGE_URLS = [f"data:image/png;base64,{_b64(d)}" for d in (PNG, *_damaged(PNG))] + [
    "data:image/png,raw", "http://127.0.0.1:1/x.png", "/etc/passwd", "file:///etc/passwd"]
VIDEO_URLS = [f"data:video/mp4;base64,{_b64(d)}" for d in (MP4, *_damaged(MP4))] + [
    "/dev/zero", "data:video/mp4;base64,"]
IMAGE_SIZES = ["16x16", "32x32", "48x32", "64x16", "auto", "64x64", "0x0", "15x16", "16x4096",
               "32X32", " 32x32", "1024x1024"]


# ------------------------------------------------------------------ in-process servers
class _ThreadServer(ThreadServer):
    """An in-process server that counts and checks what the fuzzer sends it."""

    def __init__(self, app, llm: AsyncOmniLLM) -> None:
        super().__init__(app)
        self.app, self.llm = app, llm
        self.sent: Counter[str] = Counter()  # requests sent, by label
        self.statuses: Counter[tuple[str, int]] = Counter()  # (label, HTTP status)

    def __enter__(self) -> _ThreadServer:
        super().__enter__()
        self.client = httpx.Client(base_url=self.url, timeout=60)
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()
        super().__exit__(*exc)

    def send(self, method: str, path: str, label: str, content: bytes | None = None,
             **kwargs: Any) -> httpx.Response:
        """One request, counted under `label`, checked (_check) before it is returned."""
        headers = kwargs.pop("headers", None) or {}
        if content is not None:
            headers.setdefault("content-type", "application/json")
        r = self.client.request(method, path, content=content, headers=headers, **kwargs)
        self.sent[label] += 1
        self.statuses[label, r.status_code] += 1
        _check(r, f"{method} {path} {content[:300] if content else ''!r}")
        return r


def _check(r: httpx.Response, what: str) -> None:
    """No 5xx; a 4xx is OpenAI's error JSON; a stream carries no server error."""
    assert r.status_code < 500, f"{what} -> {r.status_code}: {r.text[:1000]}"
    if r.status_code >= 400 and r.request.method != "HEAD":
        body = r.json()
        assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, f"{what}: {body}"
        err = body["error"]
        assert isinstance(err["message"], str) and err["message"], f"{what}: {body}"
        assert err["type"] in ("invalid_request_error", "rate_limit_error"), f"{what}: {body}"
        assert all(err[k] is None or isinstance(err[k], str) for k in ("param", "code")), body
    elif r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event"):
        assert "server_error" not in r.text, f"{what}: a stream's error event: {r.text[-1000:]}"
        end = '"speech.audio.done"' if r.request.url.path == SPEECH else "data: [DONE]"
        assert end in r.text[-2000:], f"{what}: the stream did not end: {r.text[-300:]}"
    elif r.status_code == 200 and r.request.method == "POST":
        assert r.content, f"{what}: an empty 200"


def _assert_healthy(srv: _ThreadServer) -> None:
    """After fuzzing: alive, nothing left in flight anywhere, no stage error, no 5xx counted."""
    assert srv.send("GET", "/health", "health").json() == {"status": "ok"}
    state, runtime = srv.app.state.omni, srv.llm.runtime
    deadline = time.monotonic() + 10
    while (state.in_flight or srv.llm.preparing or runtime.num_active()) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert (state.in_flight, srv.llm.preparing, runtime.num_active()) == (0, 0, 0)
    assert not any(runtime.stage_errors.values()), runtime.stage_errors
    bad = {k: v for k, v in scrape(srv.url).items() if k[0] == "omnistage_http_requests_total"
           and v and dict(k[1])["status"][:1] in ("5", "e")}
    assert not bad, bad


@pytest.fixture(scope="module")
def omni(tiny_omni_dir) -> Iterator[_ThreadServer]:
    llm = AsyncOmniLLM(str(tiny_omni_dir), device="cpu", max_model_len=MAX_MODEL_LEN)
    # Short answers unless a request asks for more (up to max_model_len).
    thinker, talker = llm.stage_names[:2]
    defaults = llm.pipeline.default_params
    defaults[thinker] = dataclasses.replace(defaults[thinker], max_tokens=8)
    defaults[talker] = dataclasses.replace(defaults[talker], max_tokens=16)
    config = ServerConfig(served_model_names=[MODEL_NAME], max_audio_seconds=30,
                          max_request_bytes=MAX_REQUEST_BYTES)
    try:
        with _ThreadServer(build_app(llm, config), llm) as srv:
            yield srv
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Iterator[_ThreadServer]:
    pytest.importorskip("diffusers")  # the tiny checkpoint is written by diffusers
    from omnistage.testing.tiny_z_image import build_tiny_z_image
    llm = AsyncOmniLLM(str(build_tiny_z_image(tmp_path_factory.mktemp("fuzz") / "z_image")),
                       device="cpu")
    # cheap images only: 'auto' and the default 1024x1024 become 400s
    llm.pipeline.max_side, llm.pipeline.max_pixels = IMAGE_MAX_SIDE, IMAGE_MAX_SIDE ** 2
    config = ServerConfig(served_model_names=[IMAGE_NAME], max_request_bytes=MAX_REQUEST_BYTES)
    try:
        with _ThreadServer(build_app(llm, config), llm) as srv:
            yield srv
    finally:
        llm.shutdown()


# ------------------------------------------------------------------ steering valid bodies
def _clamp(limit: int) -> Callable[[Any, random.Random], Any]:
    return lambda v, rng: min(v, limit) if isinstance(v, int) and not isinstance(v, bool) else v


def _chat_fixes(srv: _ThreadServer) -> dict[str, Callable[[Any, random.Random], Any]]:
    voices, stages = srv.app.state.omni.voices, srv.llm.stage_names

    def messages(v, rng):  # most messages with content (schemathesis often leaves it out)
        return [{**m, "content": "Hello"} if isinstance(m, dict) and m.get("content") is None
                and rng.random() < 0.9 else m for m in v] if isinstance(v, list) else v

    def stage_params(v, rng):
        return {stages[i % len(stages)]: p for i, p in enumerate(v.values())} \
            if isinstance(v, dict) else v

    return {"model": lambda v, rng: MODEL_NAME, "n": lambda v, rng: 1,
            "max_tokens": _clamp(4), "max_completion_tokens": _clamp(4), "min_tokens": _clamp(2),
            "voice": lambda v, rng: rng.choice(voices), "messages": messages,
            "stage_sampling_params": stage_params,
            "data": lambda v, rng: rng.choice(AUDIO_DATA) if isinstance(v, str) else v,
            "image_url": lambda v, rng: _with_url(v, rng.choice(IMAGE_URLS)),
            "video_url": lambda v, rng: _with_url(v, rng.choice(VIDEO_URLS)),
            # random tools / formats mostly fail their own checks (400): usually left out
            "tools": _mostly_none, "tool_choice": _mostly_none, "response_format": _mostly_none}


def _mostly_none(value: Any, rng: random.Random) -> Any:
    return None if rng.random() < 0.8 else value


def _with_url(value: Any, url: str) -> Any:
    return {**value, "url": url} if isinstance(value, dict) else value


def _speech_fixes(srv: _ThreadServer) -> dict[str, Callable[[Any, random.Random], Any]]:
    voices = srv.app.state.omni.voices + ["chelsie", "ETHAN"]
    return {"model": lambda v, rng: MODEL_NAME, "voice": lambda v, rng: rng.choice(voices),
            "speed": lambda v, rng: 1.0 if rng.random() < 0.8 else v}


def _transcription_fixes(srv: _ThreadServer) -> dict[str, Callable[[Any, random.Random], Any]]:
    valid = UPLOADS[:3]
    return {"model": lambda v, rng: MODEL_NAME,
            "file": lambda v, rng: rng.choice(valid if rng.random() < 0.6 else UPLOADS),
            "language": lambda v, rng: rng.choice(["en", "zh", "EN", "yue", "xx", v]),
            "response_format": lambda v, rng: v if rng.random() < 0.8 else
            rng.choice(["srt", "vtt", "JSON"])}


def _image_fixes(srv: _ThreadServer) -> dict[str, Callable[[Any, random.Random], Any]]:
    return {"model": lambda v, rng: IMAGE_NAME if rng.random() < 0.8 else v,
            "size": lambda v, rng: rng.choice(IMAGE_SIZES),
            "response_format": lambda v, rng: "b64_json" if rng.random() < 0.8 else v,
            "stream": lambda v, rng: False if rng.random() < 0.8 else v}


def _cheap(limit: int, valid_max: int) -> Callable[[Any, random.Random], Any]:
    """A valid but costly count (limit < v <= valid_max) lowered to `limit`; others kept."""
    return lambda v, rng: limit if isinstance(v, int) and not isinstance(v, bool) and \
        limit < v <= valid_max else v


# every image body, steered or not, mutated or not, asks for little work: at most 2 images of
# 2 steps, 32x32 where no size is given (out-of-range values stay: they must give 400)
IMAGE_BOUNDS = {"n": _cheap(2, MAX_IMAGES), "num_inference_steps": _cheap(2, MAX_STEPS)}
IMAGE_DEFAULTS = {"size": "32x32", "num_inference_steps": 2}


def _steer(value: Any, fixes: dict, rng: random.Random) -> Any:
    """`value` with every dict entry named in `fixes` (at any depth) passed through its fix, and
    integral floats as ints (JSON Schema's integers include 2.0; the strict models do not)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, list):
        return [_steer(v, fixes, rng) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: _steer(v, fixes, rng) for k, v in value.items()}
    for k in out.keys() & fixes.keys():
        out[k] = fixes[k](out[k], rng)
    return out


def _encode(body: Any) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def _mutate(body: dict, token: str, rng: random.Random) -> bytes:
    """`body` as JSON with one field's value, at any depth, or a new field, the raw `token`."""
    mark = "\x00MUTATED\x00"
    body = json.loads(json.dumps(body))  # a copy to change in place
    spots = []  # (object, key)
    stack: list[Any] = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            spots += [(value, k) for k in value] + [(value, "unknown_field")]
            stack += value.values()
        elif isinstance(value, list):
            stack += value
    obj, key = rng.choice(spots)
    obj[key] = mark
    return json.dumps(body).replace(json.dumps(mark), token).encode()


def _operation(srv: _ThreadServer, path: str, method: str = "POST"):
    return schemathesis.openapi.from_dict(srv.app.openapi())[path][method]


class _Target:
    """One POST endpoint to fuzz: bodies from its schema, steered with `fixes` (a share
    `steer_odds` of them), each over `defaults` and within `bounds`."""

    def __init__(self, srv: _ThreadServer, path: str, fixes: dict, steer_odds: float = 0.5,
                 defaults: dict | None = None, bounds: dict | None = None) -> None:
        self.srv, self.path, self.fixes, self.steer_odds = srv, path, fixes, steer_odds
        self.defaults, self.bounds = defaults or {}, bounds or {}
        self.operation = _operation(srv, path)

    def cases(self, mode: GenerationMode):
        return self.operation.as_strategy(generation_mode=mode)

    def body(self, case, rng: random.Random, steer: bool) -> Any:
        body = case.body if isinstance(case.body, (dict, list, bytes)) else {}
        if not isinstance(body, dict):
            return body
        body = {**self.defaults, **body}
        if steer:
            body = _steer(body, self.fixes, rng)
        return _steer(body, self.bounds, rng)

    def post(self, label: str, body: Any) -> httpx.Response:
        """Send a body (a dict as JSON, bytes as they are)."""
        return self.srv.send("POST", self.path, label, _encode(body))

    def invalid(self, data, rng: random.Random, kind: str, label: str) -> None:
        """One invalid request of `kind` (see _fuzz_invalid)."""
        if kind == "schema":
            body = self.body(data.draw(self.cases(GenerationMode.NEGATIVE)), rng,
                             rng.random() < self.steer_odds)
            self.post(label, body)
        elif kind == "mutated":
            body = self.body(data.draw(self.cases(GenerationMode.POSITIVE)), rng, True)
            token = data.draw(st.sampled_from(EDGE_TOKENS))
            self.post(label, _mutate(body, token, rng) if isinstance(body, dict) else body)
        else:
            self.post(label, rng.choice(RAW_BODIES))


def _form_parts(body: dict) -> list[tuple[str, tuple]]:
    """A generated body as multipart parts: bytes (schemathesis' Binary) as a file part, a list
    as repeated parts, None left out (a form has no null), other values as text."""
    parts = []
    for name, value in body.items():
        for item in value if isinstance(value, list) else [value]:
            data = getattr(item, "data", item)
            if isinstance(data, bytes):
                parts.append((name, ("upload.bin", data, "application/octet-stream")))
            elif item is not None:
                text = json.dumps(item) if isinstance(item, (bool, dict, list)) else str(item)
                parts.append((name, (None, text.encode("utf-8", "surrogatepass"))))
    return parts


# multipart bodies a parser must refuse (sent with a multipart content type, boundary "b")
RAW_FORMS = [b"", b"--b\r\n", b"--b--\r\n",
             b"--x\r\nContent-Disposition: form-data\r\n\r\nv\r\n--x--",
             b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n" + b"m" * 70_000 +
             b"\r\n--b--\r\n", b"--b\r\nContent-Disposition: form-data\r\n\r\nv\r\n--b--\r\n",
             b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n\r\n",
             b"--b\r\n" + b"X-H: v\r\n" * 5000 + b"\r\n--b--\r\n",
             b"".join(b"--b\r\nContent-Disposition: form-data; name=\"f%d\"\r\n\r\nv\r\n" % i
                      for i in range(40)) + b"--b--\r\n"]
FORM_TYPES = ["multipart/form-data; boundary=b", "multipart/form-data", "multipart/form-data; "
              "boundary=", "application/x-www-form-urlencoded", "application/json", "text/plain"]


class _FormTarget(_Target):
    """A multipart/form-data endpoint: bodies sent as forms."""

    def post(self, label: str, body: Any, parts: list | None = None) -> httpx.Response:
        if not isinstance(body, dict):
            return self.srv.send("POST", self.path, label, _encode(body))
        request = httpx.Request("POST", self.srv.url, files=parts or _form_parts(body) or
                                [("model", (None, b""))])
        return self.srv.send("POST", self.path, label, request.read(),
                             headers={"content-type": request.headers["content-type"]})

    def invalid(self, data, rng: random.Random, kind: str, label: str) -> None:
        if kind != "mutated":
            if kind == "raw" and rng.random() < 0.7:
                self.srv.send("POST", self.path, label, rng.choice(RAW_FORMS + RAW_BODIES),
                              headers={"content-type": rng.choice(FORM_TYPES)})
                return
            return super().invalid(data, rng, kind, label)
        body = self.body(data.draw(self.cases(GenerationMode.POSITIVE)), rng, True)
        parts = _form_parts(body) if isinstance(body, dict) else [("model", (None, b"x"))]
        i = rng.randrange(len(parts))
        name, (filename, *rest) = parts[i]
        token = data.draw(st.sampled_from(EDGE_TOKENS)).encode("utf-8", "surrogatepass")
        how = rng.choice(["value", "duplicate", "rename", "retype", "add"])
        if how == "value":
            parts[i] = (name, (filename, token, *rest[1:]))
        elif how == "duplicate":
            parts.append(parts[i])
        elif how == "rename":
            parts[i] = (rng.choice(["timestamp_granularities[]", "stream", "include[]", "n",
                                    token.decode("utf-8", "replace")[:50] or "x"]),
                        (filename, *rest))
        elif how == "retype":  # a text field sent as a file part, or the file as text
            parts[i] = (name, ("upload.bin", *rest) if filename is None else (None, rest[0]))
        else:
            parts.append((rng.choice(["extra", "file", "model"]), (None, token)))
        self.post(label, body, parts)


def _fuzz_valid(target: _Target) -> None:
    """MIN_CASES bodies valid by schema, a share steered to reach the pipeline (and at least
    MIN_CASES // 40 did: answered 200)."""
    label = f"{target.path} valid"

    @FUZZ
    @given(case=target.cases(GenerationMode.POSITIVE), seed=st.integers(0, 2**32 - 1))
    def one(case, seed):
        rng = random.Random(seed)
        target.post(label, target.body(case, rng, rng.random() < target.steer_odds))

    one()
    srv = target.srv
    assert srv.sent[label] >= MIN_CASES, srv.sent
    # (after the whole suite fewer steered chat bodies reach a 200 than alone: 7 vs 10+)
    assert srv.statuses[label, 200] >= MIN_CASES // 40, srv.statuses
    _assert_healthy(srv)


def _fuzz_invalid(target: _Target) -> None:
    """MIN_CASES bodies: schema-violating ones (schemathesis' negative mode), steered bodies
    with one field's value (or a new field) an edge token, and whole bodies that are not JSON
    or not an object."""
    label = f"{target.path} invalid"

    @FUZZ
    @given(data=st.data(), seed=st.integers(0, 2**32 - 1),
           kind=st.sampled_from(["schema", "mutated", "mutated", "raw"]))
    def one(data, seed, kind):
        target.invalid(data, random.Random(seed), kind, label)

    one()
    assert target.srv.sent[label] >= MIN_CASES, target.srv.sent
    _assert_healthy(target.srv)


# ------------------------------------------------------------------ the schema itself
def test_openapi_types_every_request_body(omni):
    spec = omni.app.openapi()
    models = {CHAT: "ChatCompletionRequest", COMPLETIONS: "CompletionRequest",
              SPEECH: "SpeechRequest", IMAGES: "ImageGenerationRequest",
              TRANSCRIPTIONS: "TranscriptionRequest"}
    posts = {p for p, ops in spec["paths"].items() if "post" in ops}
    assert posts == set(models), "a new POST endpoint: add it to the fuzz tests below"
    for path, name in models.items():
        body = spec["paths"][path]["post"]["requestBody"]
        ref = {"$ref": f"#/components/schemas/{name}"}
        media = "multipart/form-data" if path == TRANSCRIPTIONS else "application/json"
        assert body["required"] and body["content"] == {media: {"schema": ref}}
        schema = spec["components"]["schemas"][name]
        assert schema["additionalProperties"] is False and schema["properties"]
    upload = spec["components"]["schemas"]["TranscriptionRequest"]
    assert upload["properties"]["file"] == {**upload["properties"]["file"], "type": "string",
                                            "format": "binary"}
    assert set(upload["required"]) == {"file", "model"}
    refs = {r.split('"', 1)[0] for r in json.dumps(spec).split('"#/components/schemas/')[1:]}
    assert refs <= set(spec["components"]["schemas"])


# ------------------------------------------------------------------ POST bodies
def _chat(omni: _ThreadServer) -> _Target:
    return _Target(omni, CHAT, _chat_fixes(omni), steer_odds=0.8)  # many fields: steer most


def _speech(omni: _ThreadServer) -> _Target:
    # a speech request that reaches the pipeline costs ~0.2 s: a quarter are steered there
    return _Target(omni, SPEECH, _speech_fixes(omni), steer_odds=0.25)


def _images(images: _ThreadServer) -> _Target:
    return _Target(images, IMAGES, _image_fixes(images), defaults=IMAGE_DEFAULTS,
                   bounds=IMAGE_BOUNDS)


@pytest.mark.parametrize("fuzz", [_fuzz_valid, _fuzz_invalid], ids=["valid", "invalid"])
def test_fuzz_chat(omni, fuzz):
    fuzz(_chat(omni))


@pytest.mark.parametrize("fuzz", [_fuzz_valid, _fuzz_invalid], ids=["valid", "invalid"])
def test_fuzz_completions(omni, fuzz):
    fuzz(_Target(omni, COMPLETIONS, _completion_fixes(omni)))


def _completion_fixes(srv: _ThreadServer) -> dict[str, Callable[[Any, random.Random], Any]]:
    fixes = _chat_fixes(srv)
    # a few short prompts, as text or small token ids (the tiny vocabulary)
    fixes["prompt"] = lambda v, rng: rng.choice(["Hello", ["Hi", "Yes"], [5, 6, 7], [[8, 9]]])
    return fixes


@pytest.mark.parametrize("fuzz", [_fuzz_valid, _fuzz_invalid], ids=["valid", "invalid"])
def test_fuzz_speech(omni, fuzz):
    fuzz(_speech(omni))


@pytest.mark.parametrize("fuzz", [_fuzz_valid, _fuzz_invalid], ids=["valid", "invalid"])
def test_fuzz_transcriptions(omni, fuzz):
    fuzz(_FormTarget(omni, TRANSCRIPTIONS, _transcription_fixes(omni)))


@pytest.mark.parametrize("fuzz", [_fuzz_valid, _fuzz_invalid], ids=["valid", "invalid"])
def test_fuzz_images(images, fuzz):
    fuzz(_images(images))


def _fuzz_cross(srv: _ThreadServer, path: str, served: str) -> None:
    target = (_FormTarget if path == TRANSCRIPTIONS else _Target)(srv, path, {})
    label = f"cross {path}"

    @settings(FUZZ, max_examples=MIN_CASES // 4)
    @given(case=target.cases(GenerationMode.POSITIVE))
    def one(case):
        body = {**case.body, "model": served} if "model" in case.body else case.body
        assert target.post(label, body).status_code == 400

    one()
    assert srv.sent[label] >= MIN_CASES // 4


def test_other_posts_on_each_server(omni, images):
    """Image bodies to the omni model, chat, speech, completion and transcription bodies to
    the image model: 400s."""
    _fuzz_cross(omni, IMAGES, MODEL_NAME)
    _fuzz_cross(images, CHAT, IMAGE_NAME)
    _fuzz_cross(images, SPEECH, IMAGE_NAME)
    _fuzz_cross(images, COMPLETIONS, IMAGE_NAME)
    _fuzz_cross(images, TRANSCRIPTIONS, IMAGE_NAME)


# ------------------------------------------------------------------ GET routes, any method
def test_fuzz_model_ids(omni):
    cases = _operation(omni, "/v1/models/{model_id}", "GET").as_strategy()
    label = "GET /v1/models/{model_id}"

    @FUZZ
    @given(case=cases, served=st.booleans())
    def one(case, served):
        r = omni.send("GET", f"/v1/models/{MODEL_NAME}" if served else case.formatted_path,
                      label)
        assert r.status_code in (200, 404), r.text
        if r.status_code == 200:
            assert r.json()["id"] == MODEL_NAME

    one()
    assert omni.sent[label] >= MIN_CASES
    _assert_healthy(omni)


_QUERY = st.dictionaries(st.text(max_size=20), st.text(max_size=40), max_size=4)
_HEADERS = st.dictionaries(
    st.sampled_from(["authorization", "accept", "content-type", "x-request-id", "range",
                     "accept-encoding", "if-none-match", "cookie", "x-forwarded-for"]),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=60).map(str.strip),
    max_size=4)


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/metrics"])
def test_fuzz_get_routes(omni, path):
    label = f"GET {path}"

    @FUZZ
    @given(query=_QUERY, headers=_HEADERS)
    def one(query, headers):
        r = omni.send("GET", path, label, params=query, headers=headers)
        assert r.status_code == 200, r.text
        if path == "/v1/models":
            assert [m["id"] for m in r.json()["data"]] == [MODEL_NAME]
        elif path == "/health":
            assert r.json() == {"status": "ok"}

    one()
    assert omni.sent[label] >= MIN_CASES
    _assert_healthy(omni)


def test_fuzz_any_method_any_path(omni):
    """Wrong methods, unknown paths, bodies where none belong: 404 / 405 in OpenAI's shape."""
    paths = st.one_of(st.sampled_from(["/health", "/v1/models", "/metrics", CHAT, SPEECH,
                                       IMAGES, "/v1/models/x", "/", "/v1", "/docs",
                                       "/openapi.json", "/v1/completions", TRANSCRIPTIONS]),
                      st.text(st.characters(min_codepoint=33, max_codepoint=126),
                              max_size=30).map(lambda s: "/" + s.lstrip("/")))
    methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])

    @FUZZ
    @given(method=methods, path=paths, body=st.sampled_from([None, b"{}", b"x"]))
    def one(method, path, body):
        omni.send(method, path, "any", body)

    one()
    assert omni.sent["any"] >= MIN_CASES
    _assert_healthy(omni)

