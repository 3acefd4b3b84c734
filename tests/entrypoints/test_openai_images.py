"""POST /v1/images/generations end to end: real `omnistage serve` subprocesses on the tiny
Z-Image and tiny Qwen-Image checkpoints (CPU, 64x48, 2 steps), driven with the official `openai`
client (and raw httpx / a raw socket for bad input and disconnects)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from omnistage.entrypoints.openai.protocol import APIError
from omnistage.entrypoints.openai.protocol_images import ImageGenerationRequest
from omnistage.entrypoints.openai.serving_images import (OpenAIServingImages, params_error,
                                                         parse_size)
from tests.entrypoints.server_utils import ServerProcess, free_port, metric, openai_client, scrape

pytest.importorskip("diffusers")  # the tiny checkpoints are written by diffusers

Z_IMAGE, QWEN_IMAGE = "tiny-z-image", "tiny-qwen-image"
FAST = {"num_inference_steps": 2}  # omnistage extension fields (extra_body)


class ImageServer(ServerProcess):
    """ServerProcess without the AR engine flags (an image pipeline takes none of them)."""

    def __init__(self, model: Path, log_path: Path, name: str, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "omnistage.entrypoints.cli", "serve", str(model),
               "--device", "cpu", "--port", str(self.port), "--served-model-name", name, *args]
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Both servers, started side by side (each builds its checkpoint first). Z-Image's has a
    queue of one, for the 429 test."""
    from omnistage.testing.tiny_qwen_image import build_tiny_qwen_image
    from omnistage.testing.tiny_z_image import build_tiny_z_image
    root = tmp_path_factory.mktemp("images")
    started = {Z_IMAGE: ImageServer(build_tiny_z_image(root / "z_image"), root / "z.log",
                                    Z_IMAGE, "--max-queue", "1")}
    started[QWEN_IMAGE] = ImageServer(build_tiny_qwen_image(root / "qwen_image"),
                                      root / "qwen.log", QWEN_IMAGE)
    try:
        ready = {name: srv.wait_ready() for name, srv in started.items()}
    except BaseException:
        for srv in started.values():
            srv.stop()
        raise
    yield ready
    codes = {name: srv.stop() for name, srv in started.items()}  # a clean SIGTERM exits 0
    assert codes == {Z_IMAGE: 0, QWEN_IMAGE: 0}, {n: s.log() for n, s in started.items()}


def post(server: ServerProcess, body: dict | str, path: str = "/v1/images/generations"
         ) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"Content-Type": "application/json"})


def decode(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    image.load()
    return image


# ------------------------------------------------------------------ in-process helpers
class _Pipeline:
    size_multiple, max_side, max_pixels = 16, 2048, 2048 * 2048


@pytest.mark.parametrize("size,want", [("auto", (1024, 1024)), ("64x48", (64, 48)),
                                       ("2048X1024", (2048, 1024))])
def test_parse_size(size, want):
    assert parse_size(size, _Pipeline()) == want


@pytest.mark.parametrize("size", ["abc", "64x", "x64", "64x48x2", " 64x48", "-16x64", "1000x1000",
                                  "0x64", "64x0", "8x8", "4096x16", "9999999x16"])
def test_parse_size_rejects(size):
    with pytest.raises(APIError) as e:
        parse_size(size, _Pipeline())
    assert e.value.status == 400 and e.value.param == "size"


@pytest.mark.parametrize("message,param", [
    ("sampling_params.guidance_scale: Qwen-Image is not guidance-distilled", "guidance_scale"),
    ("sampling_params.height: must be a multiple of 16, got 40", "size"),
    ("sampling_params.num_images: must be in [1, 8], got 9", "n"),
    ("prompts[0].prompt: a non-empty string", "prompt")])
def test_params_error_names_the_request_field(message, param):
    err = params_error(ValueError(message))
    assert err.status == 400 and err.param == param and err.message.startswith(param + ": ")


def test_a_speech_model_refers_to_chat():
    class State:  # a ServerState of a Qwen-Omni model: checks run before anything is queued
        output_modalities = ["text", "audio"]

        def check_model(self, name: str) -> None:
            pass

    body = ImageGenerationRequest(prompt="a cat")
    with pytest.raises(APIError) as e:
        asyncio.run(OpenAIServingImages(State()).create(body, None))
    assert e.value.status == 400 and e.value.param == "model"
    assert "/v1/chat/completions" in e.value.message


# ------------------------------------------------------------------ the server
def test_models_list_the_image_model(servers):
    for name, srv in servers.items():
        [card] = openai_client(srv).models.list().data
        assert card.id == name and card.model_extra["modalities"] == ["image"]


@pytest.mark.parametrize("name", [Z_IMAGE, QWEN_IMAGE])
def test_two_images_non_square(servers, name):
    r = openai_client(servers[name]).images.generate(
        model=name, prompt="a red fox in the snow", n=2, size="64x48",
        extra_body={**FAST, "seed": 1})
    assert r.size == "64x48" and r.output_format == "png" and r.created > 0
    assert len(r.data) == 2
    images = [decode(d.b64_json) for d in r.data]
    for image in images:
        assert image.format == "PNG" and image.size == (64, 48) and image.mode == "RGB"
    pixels = [np.asarray(image, np.float32) for image in images]
    assert all(p.std() > 5 for p in pixels), "a flat image"
    assert np.abs(pixels[0] - pixels[1]).mean() > 1, "n images from one noise stream differ"


def test_same_seed_same_bytes(servers):
    body = {"prompt": "a lighthouse", "size": "48x32", **FAST}
    srv = servers[Z_IMAGE]
    first, again, other = (post(srv, {**body, "seed": s}) for s in (7, 7, 8))
    assert first.status_code == again.status_code == other.status_code == 200, first.text
    assert first.json()["data"] == again.json()["data"]
    assert first.json()["data"] != other.json()["data"]


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
def test_output_formats(servers, fmt):
    r = openai_client(servers[Z_IMAGE]).images.generate(
        model=Z_IMAGE, prompt="a bowl of fruit", size="32x64", output_format=fmt,
        quality="high", background="opaque", moderation="low", output_compression=80,
        user="tester", extra_body={**FAST, "seed": 2})  # OpenAI options: accepted, ignored
    assert r.output_format == fmt and r.size == "32x64"
    image = decode(r.data[0].b64_json)
    assert image.format == fmt.upper() and image.size == (32, 64)
    assert np.asarray(image, np.float32).std() > 5


def test_qwen_image_true_cfg(servers):
    base = {"prompt": "a castle", "size": "32x32", "seed": 3, **FAST}
    plain = post(servers[QWEN_IMAGE], base)
    guided = post(servers[QWEN_IMAGE], {**base, "true_cfg_scale": 4.0,
                                        "negative_prompt": "blurry"})
    assert plain.status_code == guided.status_code == 200, guided.text
    images = [np.asarray(decode(r.json()["data"][0]["b64_json"]), np.float32)
              for r in (plain, guided)]
    assert np.abs(images[0] - images[1]).mean() > 1, "CFG changes the image"


BAD = [  # (body fields over a valid request, the param named)
    ({"size": "abc"}, "size"),
    ({"size": "1000x1000"}, "size"),
    ({"size": "0x64"}, "size"),
    ({"size": "4096x4096"}, "size"),
    ({"size": "2048x4096"}, "size"),
    ({"size": 64}, "size"),
    ({"n": 0}, "n"),
    ({"n": 99}, "n"),
    ({"n": 1.5}, "n"),
    ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"num_inference_steps": 10**9}, "num_inference_steps"),
    ({"seed": 2**70}, "seed"),
    ({"seed": -(2**70)}, "seed"),
    ({"seed": "1"}, "seed"),
    ({"guidance_scale": 1e9}, "guidance_scale"),
    ({"guidance_scale": -1}, "guidance_scale"),
    ({"true_cfg_scale": 3.0}, "true_cfg_scale"),  # Z-Image guides with guidance_scale
    ({"negative_prompt": "x" * 70_000}, "negative_prompt"),
    ({"response_format": "url"}, "response_format"),
    ({"response_format": "png"}, "response_format"),
    ({"output_format": "gif"}, "output_format"),
    ({"output_compression": 101}, "output_compression"),
    ({"quality": 3}, "quality"),
    ({"stream": True}, "stream"),
    ({"partial_images": 2}, "partial_images"),
    ({"num_images": 2}, "num_images"),  # not a request field: n is
    ({"prompt": ""}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": "x" * 70_000}, "prompt"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_request_names_the_field(servers, fields, param):
    r = post(servers[Z_IMAGE], {"model": Z_IMAGE, "prompt": "a cat", "size": "32x32", **FAST,
                                **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["message"].startswith(param), err


def test_bad_request_body_shapes(servers):
    srv = servers[Z_IMAGE]
    missing = post(srv, {"model": Z_IMAGE})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt"
    for body in ("not json", "[1, 2]", "{}"):
        assert post(srv, body).status_code == 400
    wrong_model = post(srv, {"model": "dall-e-3", "prompt": "a cat"})
    assert wrong_model.status_code == 404
    assert wrong_model.json()["error"]["code"] == "model_not_found"


def test_guidance_scale_on_qwen_image(servers):
    r = post(servers[QWEN_IMAGE], {"prompt": "a cat", "size": "32x32", "guidance_scale": 4.0,
                                   **FAST})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "guidance_scale" and "true_cfg_scale" in err["message"]


def test_other_endpoints_refer_to_images(servers):
    srv = servers[QWEN_IMAGE]
    chat = post(srv, {"model": QWEN_IMAGE, "messages": [{"role": "user", "content": "hi"}]},
                "/v1/chat/completions")
    speech = post(srv, {"model": QWEN_IMAGE, "input": "hi", "voice": "Ethan"},
                  "/v1/audio/speech")
    for r in (chat, speech):
        assert r.status_code == 400, r.text
        assert "/v1/images/generations" in r.json()["error"]["message"]


def test_metrics_count_images_and_show_image_stages(servers):
    srv = servers[QWEN_IMAGE]
    before = metric(scrape(srv.url), "omnistage_http_requests_total", endpoint="images",
                    status="ok")
    assert post(srv, {"prompt": "a boat", "size": "32x32", **FAST}).status_code == 200
    samples = scrape(srv.url)
    assert metric(samples, "omnistage_http_requests_total", endpoint="images",
                  status="ok") == before + 1
    for stage in ("text_encoder", "dit", "vae"):
        assert ("omnistage_stage_queue_depth", (("stage", stage),)) in samples
        assert metric(samples, "omnistage_stage_steps_total", stage=stage) > 0
    # the denoiser stepped per denoising step, the decoder once per request
    assert metric(samples, "omnistage_stage_steps_total", stage="dit") >= \
        2 * metric(samples, "omnistage_stage_steps_total", stage="vae")


def _raw_post(srv: ServerProcess, body: dict) -> socket.socket:
    """Send a request on a raw socket (closing it is a client disconnect)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: test\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(data), data))
    return sock


def _wait_for(srv: ServerProcess, name: str, value: float, timeout: float = 15.0, **labels):
    deadline = time.monotonic() + timeout
    while (got := metric(scrape(srv.url), name, **labels)) != value:
        assert time.monotonic() < deadline, f"{name}{labels} = {got}, want {value}"
        time.sleep(0.05)


def test_queue_limit_and_client_disconnect(servers):
    """A long request fills Z-Image's queue of one: another gets 429. Its client goes away: the
    request is aborted in every stage and the slot comes back."""
    srv = servers[Z_IMAGE]
    sock = _raw_post(srv, {"prompt": "a long one", "size": "512x512",
                           "num_inference_steps": 200, "seed": 0})
    try:
        _wait_for(srv, "omnistage_server_requests_in_flight", 1.0)
        _wait_for(srv, "omnistage_runtime_requests", 1.0)
        full = post(srv, {"prompt": "a cat", "size": "32x32", **FAST})
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        sock.close()
    _wait_for(srv, "omnistage_requests_aborted_total", 1.0, endpoint="images")
    _wait_for(srv, "omnistage_runtime_requests", 0.0)
    _wait_for(srv, "omnistage_server_requests_in_flight", 0.0)
    assert post(srv, {"prompt": "a cat", "size": "32x32", **FAST}).status_code == 200
