"""`n` > 1 in chat completions (issue 26), through the official openai client against a real
server: n seeded choices, distinct, each equal to its own single request (choice i = the
request with seed + i), streamed or not; with audio output (tiny Qwen2.5-Omni) each choice
gets its own audio, equal to its single request's; the choices after the first reuse the
first one's prompt blocks (prefix cache); n out of range is a 400 naming `n`."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import numpy as np
import openai
import pytest

from omnistage import AsyncOmniLLM, OmniLLM, SamplingParams
from omnistage.entrypoints.openai.server import build_app
from omnistage.entrypoints.openai.serving import ServerConfig
from tests.entrypoints.server_utils import ThreadServer, metric, read_wav, scrape

NAME = "tiny"
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat and a dog."}]
TALKER_CAP = {"stage_sampling_params": {"talker": {"max_tokens": 40}}}


@pytest.fixture(scope="module")
def served_lm(tiny_qwen2) -> Iterator[tuple[openai.OpenAI, OmniLLM, AsyncOmniLLM]]:
    llm = AsyncOmniLLM(str(tiny_qwen2), device="cpu")
    ref = OmniLLM(str(tiny_qwen2), device="cpu")
    with ThreadServer(build_app(llm, ServerConfig(served_model_names=[NAME]))) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0), ref, llm
    llm.shutdown()
    ref.shutdown()


def _single(ref: OmniLLM, seed: int) -> str:
    params = SamplingParams(**{**ref.pipeline.default_params["llm"].__dict__,
                               "temperature": 1.0, "seed": seed, "max_tokens": 12})
    return ref.generate({"messages": MESSAGES}, params, use_tqdm=False)[0].text


def test_n_choices_equal_their_single_requests(served_lm):
    client, ref, _ = served_lm
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, n=3, seed=40,
                                       temperature=1.0, max_tokens=12)
    texts = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len(set(texts)) == 3
    assert texts == [_single(ref, 40 + i) for i in range(3)]
    single = client.chat.completions.create(model=NAME, messages=MESSAGES, seed=41,
                                            temperature=1.0, max_tokens=12)
    assert single.choices[0].message.content == texts[1]
    # usage: the prompt once, the completions summed
    assert r.usage.prompt_tokens == single.usage.prompt_tokens
    assert r.usage.completion_tokens == 36
    # streamed: the chunks of each index reassemble into that choice
    parts = ["", "", ""]
    finished = set()
    for c in client.chat.completions.create(model=NAME, messages=MESSAGES, n=3, seed=40,
                                            temperature=1.0, max_tokens=12, stream=True):
        for ch in c.choices:
            parts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert parts == texts and finished == {0, 1, 2}


def test_n_shares_the_prompt_through_the_prefix_cache(served_lm):
    client = served_lm[0]
    url = str(client.base_url).removesuffix("/").removesuffix("/v1")
    long = [{"role": "user", "content": "A long prompt about prefix caching " * 20}]
    name = "omnistage_stage_prefix_cache_hit_tokens_total"
    before = metric(scrape(url), name, stage="llm")
    r = client.chat.completions.create(model=NAME, messages=long, n=3, seed=1,
                                       temperature=1.0, max_tokens=4)
    hits = metric(scrape(url), name, stage="llm") - before
    block = 16  # EngineConfig's default block size: the prompt's full blocks are shared
    assert hits >= 2 * (r.usage.prompt_tokens // block - 1) * block > 0


def test_unseeded_choices_differ(served_lm):
    client, _, _ = served_lm
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, n=3, temperature=1.0,
                                       max_tokens=12)
    assert len({c.message.content for c in r.choices}) == 3


@pytest.mark.parametrize("n", [0, 9, -1])
def test_n_out_of_range_is_400(served_lm, n):
    client, _, _ = served_lm
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=MESSAGES, n=n, max_tokens=2)
    assert e.value.param == "n"


@pytest.fixture(scope="module")
def omni_client(tiny_omni_dir) -> Iterator[openai.OpenAI]:
    llm = AsyncOmniLLM(str(tiny_omni_dir), device="cpu")
    with ThreadServer(build_app(llm, ServerConfig(served_model_names=[NAME]))) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    llm.shutdown()


def _audio(client, **kw):
    return client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=6, temperature=1.0,
        modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"},
        extra_body=TALKER_CAP, **kw)


def test_n_with_audio_gives_each_choice_its_own_audio(omni_client):
    r = _audio(omni_client, n=2, seed=7)
    assert [c.index for c in r.choices] == [0, 1]
    waves = []
    for c in r.choices:
        audio = c.message.audio
        wave, _ = read_wav(base64.b64decode(audio.data))
        single = _audio(omni_client, seed=7 + c.index).choices[0].message.audio
        want, _ = read_wav(base64.b64decode(single.data))
        assert audio.transcript == single.transcript
        assert len(wave) > 0 and np.array_equal(wave, want)
        waves.append(wave)
    assert r.choices[0].message.audio.id != r.choices[1].message.audio.id
    assert len(waves[0]) != len(waves[1]) or not np.array_equal(waves[0], waves[1])


TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_tools_need_a_template_that_renders_them(served_lm, omni_client):
    # the tiny LM's ChatML template and Qwen-Omni's have no tools section: a 400, not a prompt
    # that silently drops them
    for client in (served_lm[0], omni_client):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOL,
                                           max_tokens=2)
        assert e.value.param == "tools"
