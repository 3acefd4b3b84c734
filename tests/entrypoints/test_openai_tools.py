"""Structured output and tools in chat completions (issue 26), through the official openai
client against a real server on a tiny random Qwen2 whose chat template renders tools as
Qwen2.5's does: json_schema output validates (`jsonschema`) and equals OmniLLM's with the same
StructuredOutput; json_object output parses; a forced tool call's arguments validate against
the function's parameters, streamed deltas reassemble into the same call, and the call
round-trips (assistant tool_calls + tool message rendered by the template and answered);
tool_choice "none" gives no tool_calls; bad schemas are 400s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from omnistage import AsyncOmniLLM, OmniLLM, SamplingParams
from omnistage.entrypoints.openai.server import build_app
from omnistage.entrypoints.openai.serving import ServerConfig
from omnistage.entrypoints.openai.tool_calls import ToolCallStream, parse_tool_calls
from omnistage.sampling_params import StructuredOutput
from omnistage.testing.chat_templates import with_chat_template
from tests.entrypoints.server_utils import ThreadServer

NAME = "tiny-tools"
SCHEMA = {"type": "object",
          "properties": {"color": {"enum": ["red", "green", "blue"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "count"], "additionalProperties": False}
WEATHER = {"type": "object",
           "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_lm(tiny_qwen2, tmp_path_factory):
    return with_chat_template(tiny_qwen2, tmp_path_factory.mktemp("tools_lm"))


@pytest.fixture(scope="module")
def served(tools_lm) -> Iterator[tuple[openai.OpenAI, OmniLLM]]:
    llm = AsyncOmniLLM(str(tools_lm), device="cpu")
    ref = OmniLLM(str(tools_lm), device="cpu")
    with ThreadServer(build_app(llm, ServerConfig(served_model_names=[NAME]))) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0), ref
    llm.shutdown()
    ref.shutdown()


def chat(client, **kw):
    return client.chat.completions.create(model=NAME, **{"messages": USER, "max_tokens": 64,
                                                         **kw})


def test_json_schema_validates_and_equals_omnillm(served):
    client, ref = served
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA,
                                                   "strict": True}}
    for seed in (1, 2):
        r = chat(client, response_format=fmt, temperature=1.0, seed=seed)
        text = r.choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)
        assert r.choices[0].finish_reason == "stop"
        params = SamplingParams(**{**ref.pipeline.default_params["llm"].__dict__,
                                   "temperature": 1.0, "seed": seed, "max_tokens": 64,
                                   "structured_output": StructuredOutput(json_schema=SCHEMA)})
        assert ref.generate({"messages": USER}, params, use_tqdm=False)[0].text == text


def test_json_object_parses(served):
    client, _ = served
    reasons = []
    for seed in range(4):
        r = chat(client, response_format={"type": "json_object"}, temperature=1.0, seed=seed,
                 max_tokens=96)
        reasons.append(r.choices[0].finish_reason)
        if reasons[-1] == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:  # cut by max_tokens mid-JSON: OpenAI's "length"
            assert reasons[-1] == "length" and r.choices[0].message.content.startswith("{")
    assert "stop" in reasons


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_forced_call_validates_and_streams_the_same(served, choice):
    client, _ = served
    for seed in (3, 4):
        r = chat(client, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed,
                 max_tokens=160)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
        call = msg.tool_calls[0]
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
        # streamed: the deltas reassemble into the same call
        chunks = list(chat(client, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed,
                           max_tokens=160, stream=True))
        calls: dict[int, dict] = {}
        for c in chunks:
            for d in c.choices[0].delta.tool_calls or [] if c.choices else []:
                got = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
                got["id"] = got["id"] or d.id
                got["name"] += d.function.name or "" if d.function else ""
                got["arguments"] += d.function.arguments or "" if d.function else ""
        assert list(calls) == [0]
        assert calls[0]["name"] == call.function.name
        assert calls[0]["arguments"] == call.function.arguments
        assert calls[0]["id"].startswith("call_")
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_call_round_trips(served):
    client, ref = served
    r = chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=5,
             max_tokens=160)
    call = r.choices[0].message.tool_calls[0]
    messages = USER + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": call.function.name,
                                      "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = chat(client, messages=messages, tools=TOOLS, temperature=0, max_tokens=8)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason == "length"
    # the prompt is the template's rendering of the call and its result
    rendered = [m if m["role"] != "assistant" else
                {**m, "content": "", "tool_calls": [
                    {**m["tool_calls"][0], "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments)}}]}
                for m in messages]
    ids = ref.tokenizer.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    text = ref.tokenizer.decode(ids)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert f'"name": "{call.function.name}"' in text
    assert answer.usage.prompt_tokens == len(ids)
    params = SamplingParams(**{**ref.pipeline.default_params["llm"].__dict__,
                               "temperature": 0.0, "max_tokens": 8})
    want = ref.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert answer.choices[0].message.content == want.text


def test_tool_choice_none_and_auto(served):
    client, ref = served
    none = chat(client, tools=TOOLS, tool_choice="none", temperature=1.0, seed=6)
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason in ("stop", "length")
    auto = chat(client, tools=TOOLS, tool_choice="auto", temperature=1.0, seed=6)
    # random weights write no <tool_call> block unforced: the same text, as content
    assert parse_tool_calls(auto.choices[0].message.content or "")[1] == []
    assert auto.choices[0].message.content == none.choices[0].message.content
    ids = ref.tokenizer.apply_chat_template(USER, tools=TOOLS, add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    assert none.usage.prompt_tokens == len(ids)  # the tools are in the prompt either way


def test_parser_whole_and_streamed():
    text = ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo", "days": 2}}\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "days": 2})]
    for step in (1, 3, 7):
        s = ToolCallStream()
        deltas = [d for i in range(0, len(text), step) for d in s.feed(text[i:i + step])]
        deltas += s.finish()
        got_content = "".join(d.get("content", "") for d in deltas)
        args: dict[int, str] = {}
        names: dict[int, str] = {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                names[tc["index"]] = names.get(tc["index"], "") + tc["function"].get("name", "")
                args[tc["index"]] = args.get(tc["index"], "") + tc["function"]["arguments"]
        assert got_content.strip() == content
        assert [names[0], names[1]] == ["get_time", "get_weather"]
        assert [args[0], args[1]] == [c["function"]["arguments"] for c in calls]
    assert parse_tool_calls("<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>", [])


@pytest.mark.parametrize("kw,param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {
                              "type": "string", "enum": ["x" * 70000]}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "nope"}}}]},
     "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_bad_input_is_400_naming_the_field(served, kw, param):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **{k: v for k, v in kw.items() if k == "messages"},
             extra_body={k: v for k, v in kw.items() if k != "messages"})
    assert e.value.param == param
