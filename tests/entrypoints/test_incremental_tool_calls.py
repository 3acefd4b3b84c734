"""tool_calls.IncrementalToolCallParser (the realtime session's call streaming), checked against
the whole-answer parser parse_tool_calls and `json`: fed in pieces of every size, a call's
argument pieces add up to its CallEnded arguments, which are the JSON object the model wrote;
the name comes before any argument; text around calls is the answer's content; blocks in
another layout, non-calls and cut-off answers come out as parse_tool_calls has them."""

from __future__ import annotations

import json

import pytest

from omnistage.entrypoints.openai.tool_calls import (ArgumentsPiece, CallEnded, CallStarted,
                                                     ContentPiece, IncrementalToolCallParser,
                                                     parse_tool_calls)

ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "U}T\\"C",'
          ' "n": [1, {"a": "]"}]}}\n</tool_call>\n<tool_call>\n{"arguments": {"city": "Oslo"}, '
          '"name": "get_weather"}\n</tool_call>\n<tool_call>{ "name" : "f" ,"arguments":'
          '"{\\"x\\": 1}"}</tool_call>')


def _feed(text: str, step: int) -> list:
    parser = IncrementalToolCallParser()
    events = [e for i in range(0, len(text), step) for e in parser.feed(text[i:i + step])]
    return events + parser.finish()


def _calls(events: list) -> list[tuple[str, str, str]]:
    """(name, concatenated argument pieces, CallEnded arguments) per call, checking order."""
    out, names, pieces = [], {}, {}
    for ev in events:
        if isinstance(ev, CallStarted):
            assert ev.index == len(names) and ev.id.startswith("call_")
            names[ev.index], pieces[ev.index] = ev.name, ""
        elif isinstance(ev, ArgumentsPiece):
            assert ev.index in names and ev.text  # (after its start; no empty pieces)
            pieces[ev.index] += ev.text
        elif isinstance(ev, CallEnded):
            assert ev.complete
            out.append((names[ev.index], pieces[ev.index], ev.arguments))
    return out


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_pieces_add_up_to_the_calls_of_the_whole_parser(step):
    events = _feed(ANSWER, step)
    content, ref = parse_tool_calls(ANSWER)
    calls = _calls(events)
    assert [c[0] for c in calls] == [c["function"]["name"] for c in ref]
    for (_, pieces, args), c in zip(calls, ref):
        assert pieces == args
        assert json.loads(args) == json.loads(c["function"]["arguments"])
    # the first call streams its object as the model wrote it, at most one piece per feed
    assert calls[0][2] == '{"zone": "U}T\\"C", "n": [1, {"a": "]"}]}'
    first = [e.text for e in events if isinstance(e, ArgumentsPiece) and e.index == 0]
    assert all(len(t) <= step for t in first)
    assert len(first) >= -(-len(calls[0][2]) // step)
    assert "".join(e.text for e in events if isinstance(e, ContentPiece)).strip() == content


def test_more_than_one_piece_while_the_arguments_are_generated():
    parser = IncrementalToolCallParser()
    assert parser.feed('<tool_call>\n{"name": "get_weather", "argu') == []
    assert parser.call_open
    started = parser.feed('ments": {"ci')
    assert [type(e) for e in started] == [CallStarted, ArgumentsPiece]
    assert started[0].name == "get_weather" and started[1].text == '{"ci'
    assert parser.feed('ty": "Os') == [ArgumentsPiece(0, 'ty": "Os')]
    end = parser.feed('lo"}}\n</tool')
    assert end == [ArgumentsPiece(0, 'lo"}'), CallEnded(0, '{"city": "Oslo"}', True)]
    assert parser.feed("_call> Done.") == [ContentPiece("Done.")]
    assert not parser.call_open and parser.finish() == []


@pytest.mark.parametrize("text", ["<tool_call>not json</tool_call>", "no calls at all <tool",
                                  '<tool_call>\n{"name": "f", "argu',
                                  '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>'])
def test_non_calls_are_content_as_the_whole_parser_has_them(text):
    for step in (1, 4, 1000):
        events = _feed(text, step)
        assert all(isinstance(e, ContentPiece) for e in events), events
        assert "".join(e.text for e in events) == parse_tool_calls(text)[0] == text


def test_an_answer_cut_inside_the_arguments_ends_the_call_incomplete():
    parser = IncrementalToolCallParser()
    events = parser.feed('<tool_call>\n{"name": "f", "arguments": {"x": "ab')
    events += parser.finish()
    assert events[-1] == CallEnded(0, '{"x": "ab', complete=False)
    assert "".join(e.text for e in events if isinstance(e, ArgumentsPiece)) == '{"x": "ab'


def test_text_after_the_arguments_that_is_no_block_end_goes_on_as_content():
    events = _feed('<tool_call>{"name": "f", "arguments": {}} and more', 1000)
    assert [type(e) for e in events] == [CallStarted, ArgumentsPiece, CallEnded, ContentPiece]
    assert events[-1].text == "and more"
