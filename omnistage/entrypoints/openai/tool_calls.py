"""Tools in chat completions, in Qwen's format (Qwen2.5's chat template renders `tools` into
the system turn and asks for calls as
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>
): the grammar of a forced call (tool_choice "required" or a named function), the structured
output of response_format, and the parsers that turn the model's text into OpenAI `tool_calls`
(whole, as stream deltas of whole calls, or incrementally: arguments as they are generated)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from omnistage.entrypoints.openai.protocol import APIError, ChatCompletionRequest, Tool
from omnistage.sampling_params import StructuredOutput

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# what a forced call's grammar wraps the JSON in (as the template shows the model)
FORCED_PREFIX, FORCED_SUFFIX = CALL_OPEN + "\n", "\n" + CALL_CLOSE
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


def _checked(spec: StructuredOutput, where: str) -> StructuredOutput:
    try:
        spec.validate(where)
    except ValueError as e:  # "where.json_schema: why" -> a 400 naming the user's field
        why = str(e).split(": ", 1)[-1]
        raise APIError(400, f"{where}: {why}", param=where) from e
    return spec


def response_format_output(body: ChatCompletionRequest) -> StructuredOutput | None:
    """response_format -> the first stage's StructuredOutput (None: free text)."""
    rf = body.response_format
    if rf is None or rf.type == "text":
        if rf is not None and rf.json_schema is not None:
            raise APIError(400, "response_format.json_schema: only with type json_schema",
                           param="response_format.json_schema")
        return None
    if rf.type == "json_object":
        return StructuredOutput(json_object=True)
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise APIError(400, "response_format.json_schema.schema: is required for type "
                       "json_schema", param="response_format.json_schema.schema")
    return _checked(StructuredOutput(json_schema=rf.json_schema.schema_),
                    "response_format.json_schema.schema")


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def check_tools(body: ChatCompletionRequest) -> None:
    """400s naming the field: tool_choice without tools, a named function that is not one of
    them, duplicate names, parameters that are no usable JSON schema."""
    tools, choice = body.tools or [], body.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise APIError(400, "tool_choice: needs tools", param="tool_choice")
    names = [t.function.name for t in tools]
    for i, t in enumerate(tools):
        if names.index(t.function.name) != i:
            raise APIError(400, f"tools[{i}].function.name: {t.function.name!r} is repeated",
                           param=f"tools[{i}].function.name")
        _checked(StructuredOutput(json_schema=_parameters(t)), f"tools[{i}].function.parameters")
    if not isinstance(choice, str) and choice is not None and choice.function.name not in names:
        raise APIError(400, f"tool_choice.function.name: {choice.function.name!r} is not one of "
                       f"the tools {names}", param="tool_choice.function.name")
    if forced(body) and body.response_format is not None and body.response_format.type != "text":
        raise APIError(400, "tool_choice: a forced tool call cannot be combined with "
                       "response_format", param="tool_choice")


def forced(body: ChatCompletionRequest) -> bool:
    """tool_choice "required" or a named function: the answer is one call, by grammar."""
    return bool(body.tools) and body.tool_choice not in (None, "none", "auto")


def parses_calls(body: ChatCompletionRequest) -> bool:
    """Whether the answer's text is parsed for tool calls (tools given, choice not "none")."""
    return bool(body.tools) and body.tool_choice != "none"


def forced_call_output(body: ChatCompletionRequest) -> StructuredOutput:
    """The grammar of one call of the forced function (or, for "required", of any tool): its
    name and arguments validating against that function's parameters."""
    choice = body.tool_choice
    tools = [t for t in body.tools or [] if isinstance(choice, str)
             or t.function.name == choice.function.name]
    options = [{"type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
                "required": ["name", "arguments"], "additionalProperties": False}
               for t in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return _checked(StructuredOutput(json_schema=schema, prefix=FORCED_PREFIX,
                                     suffix=FORCED_SUFFIX), "tools")


def template_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as the chat template takes them (OpenAI's shape, as dicts)."""
    if not body.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]


def call_arguments(arguments: str, where: str) -> dict[str, Any]:
    """An assistant message's call arguments (a JSON object as text) -> the dict the template
    renders (Qwen's template writes `arguments | tojson`)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as e:
        raise APIError(400, f"{where}: not valid JSON: {e}", param=where) from e
    if not isinstance(value, dict):
        raise APIError(400, f"{where}: must be a JSON object", param=where)
    return value


# ------------------------------------------------------------------ parsing the answer
def _call(block: str) -> dict[str, Any] | None:
    """One `<tool_call>` block's JSON -> an OpenAI tool call (None: not a call)."""
    try:
        value = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"],
                         "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of an answer: every well-formed `<tool_call>` block becomes a
    call; the text before the first one is the content (None when empty). An answer without a
    well-formed block is all content."""
    calls, first = [], None
    for m in _CALL.finditer(text):
        call = _call(m.group(1))
        if call is not None:
            calls.append(call)
            first = m.start() if first is None else first
    if not calls:
        return text, []
    content = text[:first].strip()
    return content or None, calls


class ToolCallStream:
    """Streaming: text deltas in, OpenAI deltas out. Text outside calls streams as `content`
    (a possible start of `<tool_call>` is held back until it is decided); a call is sent once
    its `</tool_call>` arrives, as two deltas: its id, type and name, then its arguments. A
    block that is no call goes out as content when it closes; finish() flushes the rest."""

    def __init__(self) -> None:
        self.buffer = ""  # text not yet sent
        self.num_calls = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.buffer += text
        out: list[dict[str, Any]] = []
        while True:
            start = self.buffer.find(CALL_OPEN)
            if start < 0:
                text, self.buffer = _split_before_open(self.buffer)
                self._content(out, text)
                return out
            end = self.buffer.find(CALL_CLOSE, start)
            if end < 0:  # inside a call: everything before it can go
                self._content(out, self.buffer[:start])
                self.buffer = self.buffer[start:]
                return out
            block_end = end + len(CALL_CLOSE)
            call = _call(self.buffer[start + len(CALL_OPEN):end])
            if call is None:
                self._content(out, self.buffer[:block_end])
            else:
                self._content(out, self.buffer[:start].rstrip() if self.num_calls == 0
                              else "")
                out += self._call_deltas(call)
            self.buffer = self.buffer[block_end:]
            if self.num_calls:  # between and after calls: only whitespace is expected
                self.buffer = self.buffer.lstrip()

    def finish(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self._content(out, self.buffer)
        self.buffer = ""
        return out

    def _content(self, out: list[dict[str, Any]], text: str) -> None:
        if text:
            out.append({"content": text})

    def _call_deltas(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        i = self.num_calls
        self.num_calls += 1
        fn = call["function"]
        return [{"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                 "function": {"name": fn["name"], "arguments": ""}}]},
                {"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]}]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _split_before_open(buffer: str) -> tuple[str, str]:
    """(the text that can be sent, the end held back because it may begin CALL_OPEN)."""
    cut = len(buffer) - _partial_suffix(buffer, CALL_OPEN)
    return buffer[:cut], buffer[cut:]


# ------------------------------------------------------------------ incremental parsing
@dataclass
class ContentPiece:
    """Text outside calls."""

    text: str


@dataclass
class CallStarted:
    """A call's head was recognised: its id and name, before any of its arguments."""

    index: int
    id: str
    name: str


@dataclass
class ArgumentsPiece:
    """The next piece of the streaming call's arguments (raw JSON text, as generated)."""

    index: int
    text: str


@dataclass
class CallEnded:
    """The call's arguments are whole (`complete`), or the answer ended inside them."""

    index: int
    arguments: str  # every ArgumentsPiece of the call, concatenated
    complete: bool


ToolCallEvent = ContentPiece | CallStarted | ArgumentsPiece | CallEnded
# the head of a call that streams: `{"name": <string>, "arguments": {` (JSON whitespace between)
_HEAD_STEPS = ("{", '"name"', ":", None, ",", '"arguments"', ":", "{")  # None: a JSON string
_JSON_SPACE = " \t\n\r"


def _call_head(text: str) -> tuple[str, str | None, int]:
    """("yes", name, index of the arguments' `{`), ("maybe", None, 0) while `text` may still
    become such a head, ("no", None, 0) once it cannot."""
    i, name = 0, None
    for step in _HEAD_STEPS:
        while i < len(text) and text[i] in _JSON_SPACE:
            i += 1
        if i == len(text):
            return "maybe", None, 0
        if step is None:
            end = _string_end(text, i)
            if end is None:
                return ("maybe", None, 0) if text[i] == '"' else ("no", None, 0)
            try:
                name = json.loads(text[i:end])
            except json.JSONDecodeError:
                return "no", None, 0
            i = end
            continue
        part = text[i:i + len(step)]
        if not step.startswith(part):
            return "no", None, 0
        if len(part) < len(step):
            return "maybe", None, 0
        i += len(step)
    return "yes", name, i - 1


def _string_end(text: str, i: int) -> int | None:
    """The index past the JSON string that starts at text[i] (a quote); None if unclosed."""
    if text[i] != '"':
        return None
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


class IncrementalToolCallParser:
    """Streaming, with arguments as they are generated: text deltas in, ToolCallEvents out.

    Text outside calls streams as ContentPiece (a possible start of `<tool_call>` is held back,
    and so is the whitespace before one). Once a block's head `{"name": "...", "arguments": {`
    is recognised, CallStarted gives the call's id and name, then every feed gives at most one
    ArgumentsPiece (the arguments' JSON object text it brought), and CallEnded comes as soon as
    that object closes (braces counted outside JSON strings); the rest up to `</tool_call>`
    (`}` and whitespace) is dropped. A block whose head is another layout (e.g. "arguments"
    first, or arguments written as a JSON string) is parsed whole when it closes, like
    parse_tool_calls: one call (start, its whole arguments, end), or content if it is none.
    finish() flushes: an unclosed block that never became a call is content; a call cut inside
    its arguments ends with complete=False."""

    def __init__(self) -> None:
        self.buffer = ""  # text not yet decided
        self.state = "text"  # text | head | args | tail | block
        self.num_calls = 0
        self.arguments = ""  # the streaming call's arguments so far
        self._held = ""  # whitespace before a `<tool_call>` (dropped if it opens a call)
        self._after_call = False  # whitespace right after a call is dropped
        self._depth, self._in_string, self._escaped = 0, False, False

    @property
    def call_open(self) -> bool:
        """Inside a `<tool_call>` block (a call's text is not content, and not said)."""
        return self.state != "text"

    def feed(self, text: str) -> list[ToolCallEvent]:
        self.buffer += text
        out: list[ToolCallEvent] = []
        while getattr(self, "_" + self.state)(out):
            pass
        return out

    def finish(self) -> list[ToolCallEvent]:
        out: list[ToolCallEvent] = []
        if self.state in ("head", "block"):
            self._content(out, self._held + CALL_OPEN + self.buffer)
        elif self.state == "args":
            out.append(CallEnded(self.num_calls - 1, self.arguments, complete=False))
        elif self.state == "text":
            self._content(out, self.buffer)
        self.buffer, self._held, self.state = "", "", "text"
        return out

    # each state's step: True when it changed state and the loop goes on
    def _text(self, out: list[ToolCallEvent]) -> bool:
        if self._after_call:
            self.buffer = self.buffer.lstrip()
            if not self.buffer:
                return False
            self._after_call = False
        start = self.buffer.find(CALL_OPEN)
        if start < 0:
            text, self.buffer = _split_before_open(self.buffer)
            self._content(out, text)
            return False
        before = self.buffer[:start]
        said = before.rstrip()
        self._content(out, said)
        self._held = before[len(said):]
        self.buffer, self.state = self.buffer[start + len(CALL_OPEN):], "head"
        return True

    def _head(self, out: list[ToolCallEvent]) -> bool:
        status, name, at = _call_head(self.buffer)
        if status == "maybe" and CALL_CLOSE not in self.buffer:
            return False
        if status != "yes":
            self.state = "block"
            return True
        self._held = ""
        out.append(CallStarted(self.num_calls, f"call_{uuid.uuid4().hex[:24]}", name))
        self.num_calls += 1
        self.arguments, self.buffer, self.state = "", self.buffer[at:], "args"
        self._depth, self._in_string, self._escaped = 0, False, False
        return True

    def _args(self, out: list[ToolCallEvent]) -> bool:
        end = None
        for i, ch in enumerate(self.buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        piece = self.buffer if end is None else self.buffer[:end]
        if piece:
            self.arguments += piece
            out.append(ArgumentsPiece(self.num_calls - 1, piece))
        self.buffer = self.buffer[len(piece):]
        if end is None:
            return False
        out.append(CallEnded(self.num_calls - 1, self.arguments, complete=True))
        self.state = "tail"
        return True

    def _tail(self, out: list[ToolCallEvent]) -> bool:
        """After the arguments: `}`, whitespace and `</tool_call>` are dropped; anything else
        ends the block there (it goes on as text)."""
        rest = self.buffer.lstrip(_JSON_SPACE)
        if rest.startswith("}"):
            rest = rest[1:].lstrip(_JSON_SPACE)
        if rest.startswith(CALL_CLOSE):
            self.buffer, self.state, self._after_call = rest[len(CALL_CLOSE):], "text", True
            return True
        if CALL_CLOSE.startswith(rest):  # (empty, or a part of the closing tag)
            return False
        self.buffer, self.state = rest, "text"
        return True

    def _block(self, out: list[ToolCallEvent]) -> bool:
        end = self.buffer.find(CALL_CLOSE)
        if end < 0:
            return False
        call = _call(self.buffer[:end])
        if call is None:
            self._content(out, self._held + CALL_OPEN + self.buffer[:end + len(CALL_CLOSE)])
        else:
            i, args = self.num_calls, call["function"]["arguments"]
            self.num_calls += 1
            out += [CallStarted(i, call["id"], call["function"]["name"]),
                    ArgumentsPiece(i, args), CallEnded(i, args, complete=True)]
            self._after_call = True
        self._held = ""
        self.buffer, self.state = self.buffer[end + len(CALL_CLOSE):], "text"
        return True

    def _content(self, out: list[ToolCallEvent], text: str) -> None:
        if text:
            out.append(ContentPiece(text))

