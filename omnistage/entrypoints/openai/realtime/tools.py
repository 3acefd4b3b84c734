"""Function tools in a Realtime session, on the chat path's pieces (tool_calls.py): the
session's tools are checked and a forced call's grammar is built exactly as chat does for the
same functions; the model's `<tool_call>` blocks are parsed as they stream
(tool_calls.IncrementalToolCallParser): a call's arguments go out as they are generated.

The omni models' chat templates have no tool layout (their pipelines refuse `tools`), so the
conversation is rendered here in Qwen2.5's tool layout, as its template writes it:
  - the system turn: the instructions, then "# Tools" with each function's JSON in <tools>;
  - an assistant turn with calls: its text, then one `<tool_call>` block per call;
  - function_call_output items: a user turn of `<tool_response>` blocks (consecutive ones
    merged into one turn)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from omnistage.entrypoints.openai.protocol import APIError, NamedFunction, NamedToolChoice, Tool
from omnistage.entrypoints.openai.protocol import FunctionDefinition as ChatFunction
from omnistage.entrypoints.openai.realtime.items import (CallItem, CallOutputItem, Item,
                                                         Response, new_id)
from omnistage.entrypoints.openai.realtime.protocol import (RealtimeProtocolError,
                                                            SessionConfig)
from omnistage.entrypoints.openai.tool_calls import (CALL_CLOSE, CALL_OPEN, ArgumentsPiece,
                                                     CallEnded, CallStarted, ToolCallEvent,
                                                     call_arguments, check_tools, forced,
                                                     forced_call_output)
from omnistage.sampling_params import StructuredOutput

_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query."
               "\n\nYou are provided with function signatures within <tools></tools> XML "
               "tags:\n<tools>")
_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name "
               "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


@dataclass
class ChatTools:
    """A session's tools in the chat request's shape (what tool_calls.py reads)."""

    tools: list[Tool]
    tool_choice: str | NamedToolChoice | None
    response_format: None = None


def chat_tools(cfg: SessionConfig) -> ChatTools:
    tools = [Tool(type="function", function=ChatFunction(
        name=t.name, description=t.description, parameters=t.parameters)) for t in cfg.tools]
    choice: str | NamedToolChoice | None = cfg.tool_choice if cfg.tools else None
    if choice is not None and not isinstance(choice, str):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return ChatTools(tools, choice)


def _session_param(param: str | None, where: str = "session") -> str:
    """chat's field names -> the session's ('tools[0].function.parameters' ->
    'session.tools[0].parameters'), or a response.create's ('response.tools[0]...')."""
    path = (param or "tools").replace(".function.", ".")
    return f"{where}.{path}"


def check_session_tools(cfg: SessionConfig, event_id: str | None,
                        where: str = "session") -> None:
    """chat's checks (repeated names, unusable schemas, a named choice that is no tool), as
    RealtimeProtocolErrors naming the fields of `where` (session.update's session, or a
    response.create's response with its own tools)."""
    if not cfg.tools and cfg.tool_choice not in ("auto", "none"):
        raise RealtimeProtocolError(f"{where}.tool_choice: needs {where}.tools",
                                    f"{where}.tool_choice", event_id)
    try:
        body = chat_tools(cfg)
        check_tools(body)  # type: ignore[arg-type]  (reads tools, tool_choice, response_format)
        if forced(body):  # type: ignore[arg-type]
            forced_call_output(body)  # type: ignore[arg-type]
    except APIError as e:
        param = _session_param(e.param, where)
        why = e.message.split(": ", 1)[-1]
        raise RealtimeProtocolError(f"{param}: {why}", param, event_id) from e


def tools_active(cfg: SessionConfig) -> bool:
    return bool(cfg.tools) and cfg.tool_choice != "none"


def forced_output(cfg: SessionConfig) -> StructuredOutput | None:
    """The grammar of a forced call (tool_choice required or a named function), as chat's."""
    body = chat_tools(cfg)
    return forced_call_output(body) if forced(body) else None  # type: ignore[arg-type]


def tools_text(cfg: SessionConfig) -> str:
    """The system turn's tool section (each function as the chat template shows it)."""
    lines = [json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False)
             for t in chat_tools(cfg).tools]
    return _TOOLS_HEAD + "".join("\n" + line for line in lines) + _TOOLS_TAIL


def _call_block(call: CallItem, where: str) -> str:
    try:
        args = call_arguments(call.arguments, where)
    except APIError:  # (a cut-off call: shown as the model wrote it)
        return f"{CALL_OPEN}\n{call.arguments}\n{CALL_CLOSE}"
    body = json.dumps({"name": call.name, "arguments": args}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def render_conversation(items: list, system: str | None) -> list[dict[str, Any]]:
    """The conversation as the thinker's chat messages (module note for the tool layout)."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": system})
    previous: str | None = None  # the role of the last message rendered, "tool" for outputs
    for it in items:
        if isinstance(it, CallItem):
            block = _call_block(it, f"item {it.id}.arguments")
            if previous == "assistant":  # (the calls of that turn)
                out[-1]["content"] += ("\n" if out[-1]["content"] else "") + block
            else:
                out.append({"role": "assistant", "content": block})
            previous = "assistant"
            continue
        if isinstance(it, CallOutputItem):
            block = f"<tool_response>\n{it.output}\n</tool_response>"
            if previous == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            previous = "tool"
            continue
        item: Item = it
        if item.role == "assistant":
            out.append({"role": "assistant", "content": item.transcript})
        else:
            out.append({"role": item.role, "content": [
                {"type": "text", "text": v} if k == "text" else {"type": "audio", "audio": v}
                for k, v in item.parts]})
        previous = item.role
    return out


async def send_call_event(send: Callable[[dict[str, Any]], Awaitable[None]], resp: Response,
                          items: list, ev: ToolCallEvent) -> None:
    """One call event of the parser, in OpenAI's order: CallStarted -> the function_call item
    (its name and call_id, no arguments yet; added to the conversation), each ArgumentsPiece ->
    response.function_call_arguments.delta, CallEnded -> .done with the whole arguments, then
    the item's end (status incomplete when the answer stopped inside the arguments)."""
    if isinstance(ev, CallStarted):
        item = CallItem(new_id("item"), ev.id, ev.name, "", status="in_progress")
        index, previous = len(resp.output_items()), items[-1].id if items else None
        resp.calls.append(item)
        await send({"type": "response.output_item.added", "response_id": resp.id,
                    "output_index": index, "item": item.event_item()})
        items.append(item)
        await send({"type": "conversation.item.added", "previous_item_id": previous,
                    "item": item.event_item()})
        return
    item = resp.calls[-1]  # (the parser streams one call at a time)
    index = next(i for i, it in enumerate(resp.output_items()) if it is item)
    where = {"response_id": resp.id, "item_id": item.id, "output_index": index,
             "call_id": item.call_id}
    if isinstance(ev, ArgumentsPiece):
        item.arguments += ev.text
        await send({"type": "response.function_call_arguments.delta", **where,
                    "delta": ev.text})
        return
    if not isinstance(ev, CallEnded):
        raise TypeError(f"send_call_event: not a call event: {ev!r}")
    item.arguments, item.status = ev.arguments, "completed" if ev.complete else "incomplete"
    await send({"type": "response.function_call_arguments.done", **where,
                "name": item.name, "arguments": item.arguments})
    await send({"type": "response.output_item.done", "response_id": resp.id,
                "output_index": index, "item": item.event_item()})
    await send({"type": "conversation.item.done", "item": item.event_item()})


def end_open_calls(resp: Response) -> None:
    """A response that ends inside a call (cancelled): the call stays incomplete."""
    for call in resp.calls:
        if call.status == "in_progress":
            call.status = "incomplete"


def session_messages(items: list, instructions: str | None, cfg: SessionConfig) -> list[dict]:
    """The conversation as chat messages for the prompt: the instructions, with the active
    tools (Qwen's layout) after them in the system turn."""
    system = instructions
    if tools_active(cfg):
        tools = tools_text(cfg)
        system = f"{instructions}\n\n{tools}" if instructions else tools
    return render_conversation(items, system)
