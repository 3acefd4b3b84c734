"""Numeric fields bounded at the HTTP edge (issue 24, defect 1): a seed out of int64 or a top_k
or token count out of range is a 400 naming the field, on chat and speech, before it reaches a
stage (where it used to fail every request in the stage); the int64 edge itself wraps and works."""

from __future__ import annotations

import base64

import httpx
import pytest

from tests.entrypoints.server_utils import MODEL_NAME, read_wav, running_server

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MESSAGES = [{"role": "user", "content": "Say something nice."}]
# the talker of a random model may never emit its stop code: bound it
AUDIO = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 6,
         "modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "wav"},
         "stage_sampling_params": {"talker": {"max_tokens": 40}}}
SPEECH = {"model": MODEL_NAME, "voice": "Chelsie", "input": "Hello there."}


@pytest.fixture(scope="module")
def server(tiny_omni_dir, tmp_path_factory):
    with running_server(tiny_omni_dir, tmp_path_factory.mktemp("srv") / "server.log") as srv:
        yield srv


def _stage(name: str, **fields) -> dict:
    return {**AUDIO, "stage_sampling_params": {"talker": {"max_tokens": 40}, name: fields}}


BAD = [  # (path, body, the field the 400 names)
    ("chat", {**AUDIO, "seed": (1 << 64) - 1}, "seed"),
    ("chat", {**AUDIO, "seed": INT64_MIN - 1}, "seed"),
    ("chat", {**AUDIO, "max_tokens": 1 << 63}, "max_tokens"),
    ("chat", {**AUDIO, "max_completion_tokens": 1 << 40}, "max_completion_tokens"),
    ("chat", _stage("talker", top_k=1 << 63), "stage_sampling_params.talker.top_k"),
    ("chat", _stage("thinker", top_k=-2), "stage_sampling_params.thinker.top_k"),
    ("chat", _stage("talker", min_tokens=1 << 63), "stage_sampling_params.talker.min_tokens"),
    ("chat", _stage("code2wav", seed=(1 << 64) - 2), "stage_sampling_params.code2wav.seed"),
    ("chat", _stage("thinker", stop_token_ids=[1 << 63]),
     "stage_sampling_params.thinker.stop_token_ids[0]"),
    ("speech", {**SPEECH, "seed": (1 << 64) - 1}, "seed"),
    ("speech", {**SPEECH, "seed": INT64_MIN - 1}, "seed"),
]


def _post(server, path: str, body: dict) -> httpx.Response:
    url = server.url + ("/v1/chat/completions" if path == "chat" else "/v1/audio/speech")
    return httpx.post(url, json=body, timeout=60)


@pytest.mark.parametrize("path,body,param", BAD)
def test_out_of_range_is_400_naming_the_field(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param + ":"), err


def test_int64_edge_seeds_wrap_and_give_audio(server):
    """Seed 2^63-1: the talker and code2wav seeds (s+1, s+2) wrap into int64; a stage seed at
    -2^63 is taken as it is. Audio comes back, and again the same for the same seed."""
    r = _post(server, "chat", {**AUDIO, "seed": INT64_MAX})
    assert r.status_code == 200, r.text[:500]
    audio = r.json()["choices"][0]["message"]["audio"]
    wave, sr = read_wav(base64.b64decode(audio["data"]))
    assert sr == 24000 and len(wave) > 0
    again = _post(server, "chat", {**AUDIO, "seed": INT64_MAX}).json()
    assert again["choices"][0]["message"]["audio"]["data"] == audio["data"]
    r = _post(server, "chat", {**_stage("code2wav", seed=INT64_MIN), "seed": INT64_MIN})
    assert r.status_code == 200, r.text[:500]
    r = _post(server, "speech", {**SPEECH, "seed": INT64_MAX})
    assert r.status_code == 200, r.text[:500]
    wave, sr = read_wav(r.content)
    assert sr == 24000 and len(wave) > 0
