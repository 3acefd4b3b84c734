"""POST /v1/audio/transcriptions (issue 26) through the official openai client against a real
`omnistage serve` on the tiny Qwen2.5-Omni (and an in-process server on the tiny Qwen3-Omni):
the transcription of an espeak-ng clip equals the text of the same ASR messages sent through
chat completions (greedy, the same reply cap); json / text / verbose_json shapes; bad inputs
are 400s in OpenAI's error shape naming the field."""

from __future__ import annotations

import base64
import io
import shutil
import subprocess
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import soundfile

from omnistage.entrypoints.async_llm import AsyncOmniLLM
from omnistage.entrypoints.openai.server import build_app
from omnistage.entrypoints.openai.serving import ServerConfig
from omnistage.entrypoints.openai.serving_transcriptions import transcription_max_tokens
from tests.entrypoints.server_utils import (MODEL_NAME, ThreadServer, openai_client,
                                            running_server)

MAX_MODEL_LEN = 2048  # ServerProcess's
SYSTEM = "You are a speech recognition model."  # Qwen2.5-Omni's documented ASR prompt


@pytest.fixture(scope="module")
def clip() -> bytes:
    """espeak-ng's WAV (22.05 kHz mono pcm16) of a short sentence."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install -y espeak-ng)")
    return subprocess.run(["espeak-ng", "--stdout", "The quick brown fox jumps over the dog."],
                          check=True, capture_output=True).stdout


@pytest.fixture(scope="module")
def server(tiny_omni_dir, tmp_path_factory) -> Iterator:
    log = tmp_path_factory.mktemp("transcriptions") / "server.log"
    with running_server(tiny_omni_dir, log, "--no-warmup") as srv:
        yield srv


def _seconds(wav: bytes) -> float:
    return soundfile.info(io.BytesIO(wav)).duration


def _chat_text(client: openai.OpenAI, wav: bytes, instruction: str) -> tuple[str, int]:
    """(text, completion tokens) of the ASR messages through chat completions, greedy."""
    r = client.chat.completions.create(
        model=MODEL_NAME, temperature=0,
        max_tokens=transcription_max_tokens(_seconds(wav), MAX_MODEL_LEN),
        messages=[{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": [
                      {"type": "text", "text": instruction},
                      {"type": "input_audio", "input_audio": {
                          "data": base64.b64encode(wav).decode(), "format": "wav"}}]}])
    return r.choices[0].message.content, r.usage.completion_tokens


@pytest.mark.parametrize("fields,instruction", [
    ({}, "Transcribe the audio into text."),
    ({"language": "en"}, "Transcribe the English audio into text."),
    ({"language": "de", "prompt": "Names: Omnistage."},
     "Transcribe the German audio into text. Context: Names: Omnistage.")])
def test_transcription_equals_chat(server, clip, fields, instruction):
    client = openai_client(server)
    r = client.audio.transcriptions.create(model=MODEL_NAME, file=("clip.wav", clip,
                                                                   "audio/wav"), **fields)
    text, tokens = _chat_text(client, clip, instruction)
    assert r.text == text and text
    assert r.usage.type == "tokens" and r.usage.output_tokens == tokens


def test_response_formats(server, clip):
    client = openai_client(server)
    whole = client.audio.transcriptions.create(model=MODEL_NAME, file=("clip.wav", clip),
                                               language="en")
    text = client.audio.transcriptions.create(model=MODEL_NAME, file=("clip.wav", clip),
                                              response_format="text", language="en")
    assert isinstance(text, str) and text == whole.text
    v = client.audio.transcriptions.create(model=MODEL_NAME, file=("clip.wav", clip),
                                           response_format="verbose_json", language="en")
    assert v.text == whole.text and v.language == "english"
    assert v.duration == pytest.approx(_seconds(clip), abs=1e-3)
    [seg] = v.segments
    assert seg.text == v.text and seg.start == 0 and seg.end == pytest.approx(v.duration)
    assert len(seg.tokens) == v.usage.output_tokens == whole.usage.output_tokens
    assert seg.temperature == 0 and seg.avg_logprob <= 0 and seg.compression_ratio > 0
    # seeded sampling is not part of OpenAI's form; a temperature in range is accepted
    sampled = client.audio.transcriptions.create(model=MODEL_NAME, file=("clip.wav", clip),
                                                 temperature=0.7)
    assert sampled.usage.output_tokens > 0


def _wav(seconds: float, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(int(seconds * rate), np.int16), rate, format="WAV")
    return buf.getvalue()


@pytest.mark.parametrize("kwargs,param", [
    ({"response_format": "srt"}, "response_format"),
    ({"response_format": "yaml"}, "response_format"),
    ({"temperature": 1.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"language": "xx"}, "language"),
    ({"prompt": "x" * 4000}, "prompt"),  # with the clip, longer than the context (2048)
    ({"prompt": "x" * 4097}, "prompt"),  # over the field's 4096 characters
    ({"timestamp_granularities": ["word"]}, "timestamp_granularities[]"),
    ({"file": ("notes.txt", b"this is not audio at all", "text/plain")}, "file"),
    ({"file": ("long.wav", _wav(31.0))}, "file"),  # the server's limit is 30 s
    ({"file": ("empty.wav", b"")}, "file"),
    ({"file": ("short.wav", _wav(0.001))}, "file"),  # decodes, but too short to transcribe
    ({"model": "no-such-model"}, "model")])
def test_bad_inputs_are_400_naming_the_field(server, clip, kwargs, param):
    client = openai_client(server)
    args = {"model": MODEL_NAME, "file": ("clip.wav", clip), **kwargs}
    error = openai.NotFoundError if param == "model" else openai.BadRequestError
    with pytest.raises(error) as e:
        client.audio.transcriptions.create(**args)
    assert e.value.body["param"] == param, e.value.body
    assert param in e.value.body["message"]


def test_bad_forms_are_400_naming_the_field(server, clip):
    url = server.url + "/v1/audio/transcriptions"
    cases = [  # (multipart parts, the field named)
        ([("model", (None, MODEL_NAME))], "file"),  # no file
        ([("model", (None, MODEL_NAME)), ("file", (None, "text, not a file part"))], "file"),
        ([("file", ("a.wav", clip))], "model"),
        ([("model", (None, MODEL_NAME)), ("file", ("a.wav", clip)), ("stream", (None, "true"))],
         "stream"),
        ([("model", (None, MODEL_NAME)), ("file", ("a.wav", clip)), ("x", (None, "1"))], "x"),
        ([("model", (None, MODEL_NAME)), ("model", (None, MODEL_NAME)), ("file", ("a.wav", clip))],
         "model")]
    for parts, param in cases:
        r = httpx.post(url, files=parts, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (parts, r.text)
    r = httpx.post(url, json={"model": MODEL_NAME}, timeout=30)  # not multipart
    assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"]


def test_text_only_model_is_400(tiny_qwen2, clip):
    llm = AsyncOmniLLM(str(tiny_qwen2), device="cpu")
    try:
        with ThreadServer(build_app(llm, ServerConfig(served_model_names=["lm"]))) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError) as e:
                client.audio.transcriptions.create(model="lm", file=("clip.wav", clip))
            assert e.value.body["param"] == "model" and "audio input" in str(e.value)
    finally:
        llm.shutdown()


def test_qwen3_omni_transcription_equals_chat(tiny_qwen3_omni_dir, clip):
    llm = AsyncOmniLLM(str(tiny_qwen3_omni_dir), device="cpu", max_model_len=MAX_MODEL_LEN)
    try:
        config = ServerConfig(served_model_names=[MODEL_NAME], max_audio_seconds=30)
        with ThreadServer(build_app(llm, config)) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            r = client.audio.transcriptions.create(model=MODEL_NAME, file=("clip.wav", clip),
                                                   language="en")
            text, tokens = _chat_text(client, clip, "Transcribe the English audio into text.")
            assert r.text == text and text and r.usage.output_tokens == tokens
    finally:
        llm.shutdown()
