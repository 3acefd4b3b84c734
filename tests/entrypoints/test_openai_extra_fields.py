"""What OpenAI and vLLM clients send to chat completions (issue 26): vLLM's extra sampling fields
at the top level, each with its effect, and logprobs / top_logprobs equal to the engine's
(which equal transformers' processed log-softmax: tests/engine/test_logprobs.py). Through the
official `openai` client against an in-process server on the tiny Qwen2.5-Omni (text out)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import openai
import pytest

from omnistage import AsyncOmniLLM, OmniLLM
from omnistage.entrypoints.openai.server import build_app
from omnistage.entrypoints.openai.serving import ServerConfig
from tests.entrypoints.server_utils import MODEL_NAME, ThreadServer

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(tiny_omni_dir) -> Iterator[openai.OpenAI]:
    llm = AsyncOmniLLM(str(tiny_omni_dir), device="cpu")
    with ThreadServer(build_app(llm, ServerConfig(served_model_names=[MODEL_NAME]))) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    llm.shutdown()


def chat(client: openai.OpenAI, **kwargs):
    extra = {k: kwargs.pop(k) for k in list(kwargs) if k in EXTRA}
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                          extra_body=extra or None, **kwargs)


def reference(model_dir, **fields):
    """The same request through OmniLLM: the thinker's defaults with `fields` over them, as
    the server applies a request's fields. Returns (output, tokenizer)."""
    llm = OmniLLM(str(model_dir))
    params = dataclasses.replace(llm.pipeline.default_params["thinker"], **fields)
    out = llm.generate({"messages": MESSAGES}, {"thinker": params}, ["text"], use_tqdm=False)[0]
    llm.shutdown()
    return out, llm.tokenizer


EXTRA = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
         "skip_special_tokens", "spaces_between_special_tokens")


def ids_of(client, **kwargs) -> list[str]:
    r = chat(client, logprobs=True, **kwargs)
    return [t.token for t in r.choices[0].logprobs.content]


def test_top_k_1_equals_greedy(client):
    greedy = ids_of(client, temperature=0, max_tokens=8)
    for seed in (1, 2, 3):
        assert ids_of(client, temperature=1.0, top_k=1, seed=seed, max_tokens=8) == greedy
    sampled = {tuple(ids_of(client, temperature=1.5, seed=s, max_tokens=8)) for s in range(4)}
    assert len(sampled) > 1  # without top_k the draws differ: top_k=1 did something


def test_min_tokens_and_stop_token_ids(client, tiny_omni_dir):
    first = reference(tiny_omni_dir, temperature=0, max_tokens=4)[0].token_ids[0]
    stopped = chat(client, temperature=0, max_tokens=12, stop_token_ids=[first])
    assert stopped.usage.completion_tokens == 1  # stopped on its first token
    held = chat(client, temperature=0, max_tokens=12, stop_token_ids=[first], min_tokens=5)
    assert held.usage.completion_tokens >= 5


def test_ignore_eos_runs_to_max_tokens(client):
    r = chat(client, temperature=0, max_tokens=24, ignore_eos=True)
    assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"


def test_repetition_penalty_and_min_p_change_the_output(client):
    base = ids_of(client, temperature=0, max_tokens=16)
    assert ids_of(client, temperature=0, max_tokens=16, repetition_penalty=5.0) != base
    # min_p near 1 keeps only the most likely token: sampling becomes greedy
    assert ids_of(client, temperature=1.0, seed=3, max_tokens=16, min_p=0.999) == base


def test_special_tokens_fields_are_accepted(client):
    r = chat(client, temperature=0, max_tokens=4, skip_special_tokens=False,
             spaces_between_special_tokens=False)
    assert r.usage.completion_tokens == 4


def test_logprobs_equal_the_engine(client, tiny_omni_dir):
    r = chat(client, temperature=0.8, seed=5, max_tokens=6, logprobs=True, top_logprobs=3,
             top_k=20)
    ref, tok = reference(tiny_omni_dir, temperature=0.8, seed=5, max_tokens=6, top_k=20,
                         logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids) == 6
    for entry, token, lps in zip(content, ref.token_ids, ref.logprobs):
        assert entry.token == tok.decode([token], skip_special_tokens=False)
        assert math.isclose(entry.logprob, lps[token], abs_tol=1e-6)
        assert entry.bytes == list(entry.token.encode())
        want = sorted(lps.values(), reverse=True)[:3]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(want, abs=1e-6)
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6


def test_streamed_logprobs_cover_every_token(client):
    whole = chat(client, temperature=0, max_tokens=10, logprobs=True, top_logprobs=2)
    stream = chat(client, temperature=0, max_tokens=10, logprobs=True, top_logprobs=2,
                  stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 6)) for e in streamed] == \
        [(e.token, round(e.logprob, 6)) for e in whole.choices[0].logprobs.content]
    assert all(len(e.top_logprobs) == 2 for e in streamed)


def test_no_logprobs_unless_asked(client):
    assert chat(client, temperature=0, max_tokens=4).choices[0].logprobs is None


@pytest.mark.parametrize("fields,param", [
    ({"top_logprobs": 3}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21},
                                            "top_logprobs"),
    ({"top_k": 1 << 63}, "top_k"), ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"best_of": 2}, "best_of")])
def test_bad_fields_name_themselves(client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                       extra_body=fields)
    assert param in str(e.value)
