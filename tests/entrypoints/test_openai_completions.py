"""POST /v1/completions (issue 26): a plain LM's text completions through the official openai
client equal OmniLLM's, for string, strings and token-id prompts, streamed or not, with echo
and logprobs; n > 1, best_of and suffix are refused naming the field."""

from __future__ import annotations

import math
from collections.abc import Iterator

import openai
import pytest

from omnistage import AsyncOmniLLM, OmniLLM, SamplingParams
from omnistage.entrypoints.openai.server import build_app
from omnistage.entrypoints.openai.serving import ServerConfig
from tests.entrypoints.server_utils import ThreadServer

NAME = "tiny-lm"
PROMPTS = ["The capital of France is", "Once upon a time"]


@pytest.fixture(scope="module")
def served(tiny_qwen2) -> Iterator[tuple[openai.OpenAI, OmniLLM]]:
    llm = AsyncOmniLLM(str(tiny_qwen2), device="cpu")
    ref = OmniLLM(str(tiny_qwen2), device="cpu")
    with ThreadServer(build_app(llm, ServerConfig(served_model_names=[NAME]))) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0), ref
    llm.shutdown()
    ref.shutdown()


def reference(ref: OmniLLM, prompt, **fields):
    params = SamplingParams(**{**ref.pipeline.default_params["llm"].__dict__, **fields})
    p = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    return ref.generate(p, params, use_tqdm=False)[0]


def test_strings_equal_omnillm(served):
    client, ref = served
    r = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for choice, prompt in zip(r.choices, PROMPTS):
        want = reference(ref, prompt, max_tokens=8, temperature=0)
        assert choice.text == want.text and want.text
        assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 16


def test_token_ids_seeded_sampling_and_echo(served):
    client, ref = served
    ids = ref.tokenizer.encode(PROMPTS[0])
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=1.0,
                                  seed=3, echo=True)
    want = reference(ref, ids, max_tokens=6, temperature=1.0, seed=3)
    assert r.choices[0].text == ref.tokenizer.decode(ids) + want.text


def test_streamed_equals_whole_with_logprobs(served):
    client, ref = served
    whole = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=10,
                                      temperature=0, logprobs=2)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=10,
                                            temperature=0, logprobs=2, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    lp = whole.choices[0].logprobs
    want = reference(ref, PROMPTS[1], max_tokens=10, temperature=0, logprobs=2)
    assert len(lp.tokens) == len(want.token_ids) == 10
    for got, token, lps in zip(lp.token_logprobs, want.token_ids, want.logprobs):
        assert math.isclose(got, lps[token], abs_tol=1e-6)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == whole.choices[0].text


@pytest.mark.parametrize("fields,param", [
    ({"n": 2}, "n"), ({"best_of": 3}, "best_of"), ({"suffix": "end"}, "suffix"),
    ({"echo": True, "logprobs": 1}, "echo"), ({"logprobs": 21}, "logprobs"),
    ({"top_k": -5}, "top_k"), ({"frobnicate": 1}, "frobnicate")])
def test_refused_fields_are_named(served, fields, param):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="Hi", max_tokens=2, extra_body=fields)
    assert param in str(e.value)


def test_empty_and_bad_prompts_are_400(served):
    client, _ = served
    for prompt in ("", [], [[]], [-1]):
        with pytest.raises(openai.BadRequestError, match="prompt"):
            client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
