"""What clients send to the OpenAI-compatible server (pydantic, unknown fields forbidden) and the
OpenAI-style error every failure turns into."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omnistage.config.schema import SamplingDefaults
from omnistage.sampling_params import (INT32_MAX, INT64_MAX, INT64_MIN, MAX_LOGPROBS,
                                       MAX_REPETITION_PENALTY, MAX_STOP_TOKEN_IDS)

MAX_MESSAGES = 256
MAX_CHOICES = 8  # chat `n`
MAX_TOOLS = 128
MAX_TOOL_CALLS = 32  # per assistant message
MAX_NAME_CHARS = 64  # OpenAI's function-name limit
MAX_TEXT_CHARS = 1 << 20
MAX_SPEECH_CHARS = 4096

# what soundfile encodes, by OpenAI's response_format / audio.format names
AUDIO_FORMATS = ("wav", "flac", "pcm", "pcm16", "mp3", "opus", "ogg", "aiff")
INPUT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus", "aiff", "pcm16")

# SamplingParams.validate's bounds, checked where the body is parsed: a 400 naming the field
# before anything reaches a stage (a seed or count out of int64 would fail the whole stage)
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenCount = Annotated[int, Field(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ------------------------------------------------------------------------- chat content parts
class TextPart(_Strict):
    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT_CHARS)


class InputAudio(_Strict):
    data: str  # base64
    format: Literal[INPUT_AUDIO_FORMATS] = "wav"  # pcm16: raw int16 LE mono at 24 kHz


class InputAudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


class MediaURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLPart(_Strict):
    type: Literal["image_url"]
    image_url: MediaURL


class VideoURLPart(_Strict):
    type: Literal["video_url"]
    video_url: MediaURL


ContentPart = Annotated[TextPart | InputAudioPart | ImageURLPart | VideoURLPart,
                        Field(discriminator="type")]


class ToolCallFunction(_Strict):
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    arguments: str = Field(max_length=MAX_TEXT_CHARS)  # a JSON object, as OpenAI sends it


class ToolCall(_Strict):
    """A call in an assistant message (what an earlier response returned)."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=MAX_TEXT_CHARS)] | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = Field(default=None, max_length=256)


# ------------------------------------------------------------------------- structured output
class JSONSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    description: str | None = None
    # the schema is checked (size, what xgrammar supports) when the request is built: a 400
    # naming response_format.json_schema.schema
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    parameters: dict[str, Any] | None = None  # a JSON schema (checked as response_format's)
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


# ------------------------------------------------------------------------- chat request
class AudioOutputParams(_Strict):
    voice: str | None = None
    format: Literal[AUDIO_FORMATS] = "wav"


class StreamOptions(_Strict):
    include_usage: bool = False


class StageSamplingParams(SamplingDefaults):
    """Any stage's sampling (omnistage extension `stage_sampling_params: {stage: {...}}`):
    the pipeline YAML's sampling fields plus per-request ones."""

    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    seed: Seed | None = None


class _SamplingFields(_Strict):
    """The sampling fields chat and text completions share: OpenAI's, then vLLM's extra ones
    at the top level as vLLM's server takes them (the first stage's sampling;
    stage_sampling_params sets the others)."""

    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: TokenCount | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # -1 or 0: off
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=MAX_REPETITION_PENALTY)
    min_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool | None = None
    # taken as vLLM takes it; a fast tokenizer (every model here) puts no spaces between
    # special tokens either way
    spaces_between_special_tokens: bool | None = None
    stage_sampling_params: dict[str, StageSamplingParams] | None = None

    def sampling_fields(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        """The first stage's SamplingParams fields this request sets (None: not set)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": max_tokens,
                "stop": self.stop, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "top_k": self.top_k,
                "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
                "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
                "stop_token_ids": self.stop_token_ids,
                "skip_special_tokens": self.skip_special_tokens, "logprobs": logprobs}


class ChatCompletionRequest(_SamplingFields):
    model: str
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioOutputParams | None = None
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def chat_sampling_fields(self) -> dict[str, Any]:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs set to true",
                           param="top_logprobs")
        return self.sampling_fields(self.max_completion_tokens or self.max_tokens,
                                    (self.top_logprobs or 0) if self.logprobs else None)


MAX_PROMPTS = 64  # prompts per /v1/completions request
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=1 << 20)]


class CompletionRequest(_SamplingFields):
    """POST /v1/completions (OpenAI's legacy text completions): one choice per prompt."""

    model: str
    prompt: (Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS)]
             | Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)]
             | TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])
    max_tokens: TokenCount | None = 16  # OpenAI's default
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


# ------------------------------------------------------------------------- speech request
class SpeechRequest(_Strict):
    model: str
    input: str = Field(min_length=1, max_length=MAX_SPEECH_CHARS)
    voice: str
    response_format: Literal[AUDIO_FORMATS] = "wav"
    speed: float = 1.0
    stream_format: Literal["audio", "sse"] = "audio"
    seed: Seed | None = None  # omnistage extension


# ------------------------------------------------------------------------- errors
class APIError(Exception):
    """Becomes an OpenAI error response: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code, self.headers = code, headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _loc(parts: tuple) -> str:
    """('messages', 0, 'content', 'list[...]', 1, 'input_audio', 'input_audio', 'data') ->
    'messages[0].content[1].input_audio.data' (union branch names and repeated tags dropped)."""
    out: list[str] = []
    for p in parts:
        if isinstance(p, int):
            out.append(f"[{p}]")
        elif not ("[" in p or "-" in p or p in _TYPE_NAMES) and (not out or out[-1] != "." + p):
            out.append("." + p)
    return "".join(out).lstrip(".")


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """Validate a JSON body; malformed JSON and bad fields become a 400 naming the field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        if errors[0]["type"] == "json_invalid":
            raise APIError(400, f"body is not valid JSON: {errors[0]['msg']}",
                           code="invalid_json") from e
        err = max(errors, key=lambda x: len(x["loc"]))  # the most specific one
        loc = _loc(err["loc"])
        raise APIError(400, f"{loc or 'body'}: {err['msg']}", param=loc or None,
                       code="invalid_value") from e
