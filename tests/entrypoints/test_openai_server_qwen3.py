"""`omnistage serve` on the tiny Qwen3-Omni (MoE thinker and talker, 16-codebook frames,
streaming code2wav): every endpoint, with the official `openai` client."""

from __future__ import annotations

import base64
import io
from importlib import resources

import numpy as np
import openai
import pytest
from PIL import Image

from tests.entrypoints.server_utils import MODEL_NAME, openai_client, read_wav, running_server

SAMPLES_PER_FRAME, TRIM = 1920, 555  # 12.5 Hz frames at 24 kHz; the decoder's causal trim
CAP = 30
TALKER_CAP = {"stage_sampling_params": {"talker": {"max_tokens": CAP}}}


def audio_frames(codes: int) -> int:
    """Frames that become audio: a talker cut at max_tokens never draws its last frame's
    codebooks 1.. (as transformers), so that frame is not audio."""
    return codes - 1 if codes == CAP else codes
MESSAGES = [{"role": "user", "content": "Say something nice."}]


@pytest.fixture(scope="module")
def server(tiny_qwen3_omni_dir, tmp_path_factory):
    # the built-in pipeline with the talker capped (a random talker rarely ends by itself):
    # /v1/audio/speech has no per-stage sampling fields, the YAML sets the stage default
    tmp = tmp_path_factory.mktemp("srv")
    yaml_text = (resources.files("omnistage") / "config" / "pipelines" / "qwen3_omni.yaml"
                 ).read_text().replace("max_tokens: 4096", f"max_tokens: {CAP}")
    assert f"max_tokens: {CAP}" in yaml_text
    (tmp / "pipeline.yaml").write_text(yaml_text)
    with running_server(tiny_qwen3_omni_dir, tmp / "server.log", "--pipeline",
                        str(tmp / "pipeline.yaml")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_models_lists_speakers(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def _audio_request(client, stream: bool, content):
    return client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": content}], max_tokens=10,
        seed=5, stream=stream, modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "wav"},
        stream_options={"include_usage": True} if stream else None, extra_body=TALKER_CAP)


def test_chat_image_in_audio_out_streamed_equals_non_streamed(client):
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)
                    ).save(buf, format="PNG")
    content = [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}},
        {"type": "text", "text": "What is this?"}]
    r = _audio_request(client, False, content)
    audio = r.choices[0].message.audio
    wave, sr = read_wav(base64.b64decode(audio.data))
    frames = r.usage.completion_tokens_details.audio_tokens
    assert sr == 24000 and frames > 0 and audio.transcript
    assert len(wave) == audio_frames(frames) * SAMPLES_PER_FRAME - TRIM
    assert np.abs(wave).max() > 100  # not silence
    pcm, transcript = [], []
    for c in _audio_request(client, True, content):
        for ch in c.choices:
            a = ch.delta.audio
            if a is not None and a.data:
                pcm.append(base64.b64decode(a.data))
            if a is not None and a.transcript:
                transcript.append(a.transcript)
    assert "".join(transcript) == audio.transcript
    np.testing.assert_array_equal(np.frombuffer(b"".join(pcm), "<i2"), wave)


def test_chat_text_only(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6,
                                       seed=0)
    assert r.choices[0].message.content and r.choices[0].message.audio is None


def test_speech_speakers_case_insensitive(client):
    text = "Hello there."
    raw = client.audio.speech.with_raw_response.create(
        model=MODEL_NAME, voice="AIDEN", input=text, response_format="wav",
        extra_body={"seed": 3})
    wave, sr = read_wav(raw.content)
    frames = int(raw.headers["x-codec-tokens"])
    assert sr == 24000 and frames > 1
    assert len(wave) == audio_frames(frames) * SAMPLES_PER_FRAME - TRIM
    with pytest.raises(openai.BadRequestError, match="voice"):
        client.audio.speech.create(model=MODEL_NAME, voice="nobody", input=text)
