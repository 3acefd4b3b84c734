"""A Realtime session's state objects: its limits, conversation items (messages, function calls
and their outputs), responses, and the audio clock that cuts cancelled transcripts."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omnistage.entrypoints.openai.tool_calls import IncrementalToolCallParser


@dataclass(frozen=True)
class RealtimeLimits:
    max_event_bytes: int = 4 << 20  # one client event (base64 audio: ~64 KB per second)
    max_buffer_seconds: float = 60.0  # uncommitted input audio
    max_session_seconds: float = 1800.0  # wall clock from session.created
    max_items: int = 256  # conversation items kept
    max_conversation_audio_seconds: float = 600.0  # user audio in the conversation


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


@dataclass
class Item:
    id: str
    role: str  # user | assistant | system
    parts: list[tuple[str, Any]]  # ("text", str) | ("audio", float32 16 kHz array)
    status: str = "completed"
    # assistant items; user audio items: the input transcription, once completed
    text_ids: list[int] = field(default_factory=list)
    transcript: str = ""
    audio_samples: int = 0  # pcm16 samples at 24 kHz sent to the client
    codes: int = 0  # codec codes the talker made for it
    audio: bool = False  # the response had audio output

    def cut_to_played(self, played: int, samples_per_code: float | None,
                      decode: Callable[[list[int]], str]) -> None:
        """Keep the text tokens whose codes were played (an assistant item truncated to the
        audio the client played: session.py's module note); samples_per_code None: no
        response has finished yet, nothing to measure with (left whole)."""
        if played == 0:
            keep = 0
        elif samples_per_code is not None:
            keep = min(len(self.text_ids), -(-played // max(int(samples_per_code), 1)))
        else:
            return
        self.text_ids = self.text_ids[:keep]
        self.transcript = decode(self.text_ids)
        self.audio_samples = played
        self.status = "incomplete"

    def event_item(self) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        for kind, value in self.parts:
            if self.role == "assistant":
                content.append({"type": "output_audio", "transcript": self.transcript}
                               if self.audio else {"type": "output_text",
                                                   "text": self.transcript})
            elif kind == "text":
                content.append({"type": "input_text", "text": value})
            else:
                content.append({"type": "input_audio", "transcript": self.transcript or None})
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": self.role,
                "status": self.status, "content": content}


@dataclass
class CallItem:
    """A function call: the model's (a response output) or one the client added."""

    id: str
    call_id: str
    name: str
    arguments: str  # a JSON object as text
    status: str = "completed"
    role: str = "function_call"  # (no message role: never truncated, never a user turn)
    parts: tuple = ()

    def event_item(self) -> dict[str, Any]:
        return {"id": self.id, "object": "realtime.item", "type": "function_call",
                "status": self.status, "call_id": self.call_id, "name": self.name,
                "arguments": self.arguments}


@dataclass
class CallOutputItem:
    """A function call's result, from the client."""

    id: str
    call_id: str
    output: str
    status: str = "completed"
    role: str = "function_call_output"
    parts: tuple = ()

    def event_item(self) -> dict[str, Any]:
        return {"id": self.id, "object": "realtime.item", "type": "function_call_output",
                "status": self.status, "call_id": self.call_id, "output": self.output}


ConversationEntry = Item | CallItem | CallOutputItem


@dataclass
class Response:
    id: str
    item: Item  # its message (sent only when `message_index` is set)
    modalities: list[str]
    voice: str | None
    max_output_tokens: int | str
    task: asyncio.Task | None = None
    rid: str = ""
    status: str = "in_progress"
    reason: str | None = None  # cancelled: turn_detected | client_cancelled; incomplete: why
    error: str | None = None
    ended: bool = False
    usage: dict[str, Any] | None = None
    cached_tokens: int = 0
    # tools: the parser of the model's text (None: no tools), whether the answer must be one
    # call (tool_choice required / a named function), the calls made, the message's index
    tools: IncrementalToolCallParser | None = None
    forced: bool = False
    calls: list[CallItem] = field(default_factory=list)
    message_index: int | None = None
    # set once its request is in the engine (or it ended): input transcriptions wait for it
    submitted: asyncio.Event = field(default_factory=asyncio.Event)

    def output_items(self) -> list[Item | CallItem]:
        out: list[Item | CallItem] = list(self.calls)
        if self.message_index is not None:
            out.insert(self.message_index, self.item)
        return out


class AudioClock:
    """Audio samples (24 kHz) per codec code of this server's pipeline, measured on the
    responses that ran to their end (streamed outputs carry no code counts; a cancelled
    response's transcript is cut with this)."""

    def __init__(self) -> None:
        self.samples_per_code: float | None = None
        self._codes = 0  # of the longest response measured (the least off by a code)

    def observe(self, samples: int, codes: int) -> None:
        if samples > 0 and codes > self._codes:
            self.samples_per_code, self._codes = samples / codes, codes


def response_usage(out: Any, codec_stage: str | None) -> dict[str, Any]:
    """A finished response's usage: text tokens and the talker's codes (its audio tokens)."""
    codes = out.metrics.tokens_per_stage.get(codec_stage, 0) if codec_stage else 0
    prompt, text = len(out.prompt_token_ids), len(out.token_ids)
    return {"total_tokens": prompt + text + codes, "input_tokens": prompt,
            "output_tokens": text + codes,
            "input_token_details": {"cached_tokens": out.metrics.num_cached_tokens,
                                    "text_tokens": prompt, "audio_tokens": 0},
            "output_token_details": {"text_tokens": text, "audio_tokens": codes}}
