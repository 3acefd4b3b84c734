"""The OpenAI Realtime API's GA client events as pydantic models (unknown fields rejected), and
the one parser that turns a WebSocket text frame into one of them or a RealtimeProtocolError
naming the field. Server events are plain dicts built in session.py (their shapes are checked in
the tests against the `openai` SDK's own models)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, TypeAdapter, ValidationError,
                      field_validator)

from omnistage.entrypoints.openai.protocol import MAX_TOOLS
from omnistage.entrypoints.openai.serving_transcriptions import LANGUAGES, MAX_PROMPT_CHARS
from omnistage.sampling_params import INT64_MAX, INT64_MIN

PCM_RATE = 24000  # OpenAI's audio/pcm: int16 little-endian mono at 24 kHz, both ways
MAX_INSTRUCTIONS_CHARS = 16384
MAX_ITEM_TEXT_CHARS = 65536
MAX_ID_CHARS = 64
MAX_NAME_CHARS = 64  # a function's name (as OpenAI's)
MAX_DESCRIPTION_CHARS = 4096
MAX_OUTPUT_CHARS = 65536  # a function_call_output item's output


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ------------------------------------------------------------------------- session config
class AudioFormat(_Strict):
    type: Literal["audio/pcm"] = "audio/pcm"
    rate: Literal[24000] = PCM_RATE


class ServerVad(_Strict):
    type: Literal["server_vad"]
    threshold: float = Field(0.5, ge=0.0, le=1.0)
    prefix_padding_ms: int = Field(300, ge=0, le=5000)
    silence_duration_ms: int = Field(500, ge=50, le=10000)
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: None = None  # (not supported: must stay null)


class InputTranscription(_Strict):
    """Transcribe each committed user audio item (the session's own model does it, with the
    ASR prompt of /v1/audio/transcriptions); `model` names it (this server has no other)."""

    model: str = Field(min_length=1, max_length=MAX_ID_CHARS * 4)
    language: str | None = Field(None, pattern=r"^[A-Za-z]{2,3}$")
    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)

    @field_validator("language")
    @classmethod
    def _known_language(cls, value: str | None) -> str | None:
        if value is not None and value.lower() not in LANGUAGES:
            raise ValueError(f"{value!r} is not a supported ISO-639-1 code; supported: "
                             f"{sorted(LANGUAGES)}")
        return value


class AudioInput(_Strict):
    format: AudioFormat = Field(default_factory=AudioFormat)
    turn_detection: ServerVad | None = Field(default_factory=lambda: ServerVad(type="server_vad"))
    transcription: InputTranscription | None = None  # None: no input transcription
    noise_reduction: None = None


class AudioOutput(_Strict):
    format: AudioFormat = Field(default_factory=AudioFormat)
    voice: str | None = None  # None: the model's default voice
    speed: Literal[1.0] = 1.0


class AudioConfig(_Strict):
    input: AudioInput = Field(default_factory=AudioInput)
    output: AudioOutput = Field(default_factory=AudioOutput)


class Sampling(_Strict):
    """omnistage's extension: the thinker's sampling for this session's responses."""

    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=1 << 20)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)


Modalities = list[Literal["text", "audio"]]


class FunctionTool(_Strict):
    """A function the model may call (OpenAI Realtime's flat shape)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = None  # a JSON schema (checked as chat checks it)


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)


ToolChoice = Literal["auto", "none", "required"] | ToolChoiceFunction


class SessionConfig(_Strict):
    """`session` of session.update (every field optional there: merged over the current one)."""

    type: Literal["realtime"] = "realtime"
    model: str | None = None
    output_modalities: Annotated[Modalities, Field(min_length=1, max_length=1)] = ["audio"]
    instructions: str | None = Field(None, max_length=MAX_INSTRUCTIONS_CHARS)
    audio: AudioConfig = Field(default_factory=AudioConfig)
    max_output_tokens: int | Literal["inf"] = "inf"
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] = []
    tool_choice: ToolChoice = "auto"
    sampling: Sampling = Field(default_factory=Sampling)


# ------------------------------------------------------------------------- items
class InputText(_Strict):
    type: Literal["input_text"]
    text: str = Field(max_length=MAX_ITEM_TEXT_CHARS)


class InputAudio(_Strict):
    type: Literal["input_audio"]
    audio: str  # base64 pcm16 at 24 kHz
    transcript: str | None = None


class OutputText(_Strict):
    type: Literal["output_text", "text"]
    text: str = Field(max_length=MAX_ITEM_TEXT_CHARS)


ContentPart = Annotated[InputText | InputAudio | OutputText, Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"]
    role: Literal["user", "assistant", "system"]
    id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None
    content: Annotated[list[ContentPart], Field(min_length=1, max_length=16)]


class FunctionCallItem(_Strict):
    """A call the client adds to the conversation (e.g. one it keeps from another session)."""

    type: Literal["function_call"]
    id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    arguments: str = Field(max_length=MAX_ITEM_TEXT_CHARS)


class FunctionCallOutputItem(_Strict):
    """The result of a call, from the client."""

    type: Literal["function_call_output"]
    id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    output: str = Field(max_length=MAX_OUTPUT_CHARS)


ConversationItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem,
                             Field(discriminator="type")]


# ------------------------------------------------------------------------- client events
class _Event(_Strict):
    event_id: str | None = Field(None, max_length=MAX_ID_CHARS)


class SessionUpdate(_Event):
    type: Literal["session.update"]
    session: dict[str, Any]  # validated by merging into SessionConfig (field names kept)


class BufferAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    audio: str


class BufferCommit(_Event):
    type: Literal["input_audio_buffer.commit"]


class BufferClear(_Event):
    type: Literal["input_audio_buffer.clear"]


class ItemCreate(_Event):
    type: Literal["conversation.item.create"]
    previous_item_id: str | None = None
    item: ConversationItem


class ItemTruncate(_Event):
    type: Literal["conversation.item.truncate"]
    item_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    content_index: int = Field(ge=0, le=16)
    audio_end_ms: int = Field(ge=0)


class ResponseParams(_Strict):
    output_modalities: Annotated[Modalities, Field(min_length=1, max_length=1)] | None = None
    instructions: str | None = Field(None, max_length=MAX_INSTRUCTIONS_CHARS)
    max_output_tokens: int | Literal["inf"] | None = None
    conversation: Literal["auto"] | None = None
    metadata: dict[str, str] | None = None
    # this response's tools and choice instead of the session's (None: the session's)
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None


class ResponseCreate(_Event):
    type: Literal["response.create"]
    response: ResponseParams | None = None


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    response_id: str | None = None


ClientEvent = Annotated[SessionUpdate | BufferAppend | BufferCommit | BufferClear | ItemCreate
                        | ItemTruncate | ResponseCreate | ResponseCancel,
                        Field(discriminator="type")]
_CLIENT_EVENT: TypeAdapter = TypeAdapter(ClientEvent)
CLIENT_EVENT_TYPES = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                      "input_audio_buffer.clear", "conversation.item.create",
                      "conversation.item.truncate", "response.create", "response.cancel")


class RealtimeProtocolError(Exception):
    """A client event that cannot be served: sent back as an `error` event; the session lives."""

    def __init__(self, message: str, param: str | None = None, event_id: str | None = None,
                 code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.event_id, self.code = message, param, event_id, code

    def event(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": "invalid_request_error", "code": self.code,
                                           "message": self.message, "param": self.param,
                                           "event_id": self.event_id}}


_PART_TAGS = ("input_text", "input_audio", "output_text", "text")
_ITEM_TAGS = ("message", "function_call", "function_call_output")
_MODEL_NAMES = ("ServerVad", "InputText", "InputAudio", "OutputText", "InputTranscription",
                "ToolChoiceFunction", "int", "str")


def field_path(loc: tuple) -> str:
    """pydantic's error location -> 'session.audio.input.turn_detection.threshold': the
    union tags pydantic inserts (an event's type first, a part's type after its index, model
    and validator names) are dropped."""
    parts: list[str] = []
    tag_next = True  # a discriminator value may come next (the event type, a part's type)
    for p in loc:
        if isinstance(p, int):
            parts[-1:] = [f"{parts[-1]}[{p}]"] if parts else [f"[{p}]"]
            tag_next = True
            continue
        if tag_next and (p in CLIENT_EVENT_TYPES or p in _PART_TAGS):
            tag_next = False
            continue
        tag_next = False
        if parts and parts[-1] == "item" and p in _ITEM_TAGS:  # (the item's type tag)
            continue
        if p in _MODEL_NAMES or "[" in p or "-" in p:
            continue
        parts.append(p)
    return ".".join(parts)


def validation_error(e: ValidationError, prefix: str = "",
                     event_id: str | None = None) -> RealtimeProtocolError:
    err = e.errors()[0]
    path = field_path(err["loc"])
    path = f"{prefix}.{path}" if prefix and path else prefix or path
    return RealtimeProtocolError(f"{path}: {err['msg']}", param=path or None, event_id=event_id)


def parse_client_event(raw: str | bytes, max_bytes: int) -> BaseModel:
    """One WebSocket frame -> a client event model; RealtimeProtocolError naming the field."""
    if len(raw) > max_bytes:
        raise RealtimeProtocolError(f"event: {len(raw)} bytes, more than the limit of "
                                    f"{max_bytes}", param="event", code="event_too_large")
    if isinstance(raw, bytes):
        raise RealtimeProtocolError("event: binary frames are not accepted; send JSON text",
                                    param="event")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise RealtimeProtocolError(f"event: invalid JSON: {e}", param="event") from e
    if not isinstance(data, dict):
        raise RealtimeProtocolError("event: must be a JSON object", param="event")
    event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
    kind = data.get("type")
    if kind not in CLIENT_EVENT_TYPES:
        raise RealtimeProtocolError(f"type: unknown client event type {kind!r}; one of "
                                    f"{list(CLIENT_EVENT_TYPES)}", param="type",
                                    event_id=event_id)
    try:
        return _CLIENT_EVENT.validate_python(data)
    except ValidationError as e:
        raise validation_error(e, event_id=event_id) from e


def merge_session(current: SessionConfig, update: dict[str, Any],
                  event_id: str | None) -> SessionConfig:
    """session.update: the given fields over the current config, validated as a whole."""
    merged = _deep_merge(current.model_dump(), update)
    try:
        return SessionConfig.model_validate(merged)
    except ValidationError as e:
        raise validation_error(e, "session", event_id) from e


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) \
                and key != "turn_detection":  # (a new turn_detection replaces the old one)
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out
