"""POST /v1/audio/transcriptions (omni models): OpenAI's speech-to-text upload, transcribed by
the first stage (the thinker) with the model's ASR prompt, text out only.

The body is multipart/form-data: `file` (the audio), `model`, and optional `language`
(ISO-639-1), `prompt`, `response_format` (json, text, verbose_json) and `temperature` (0..1,
default 0: greedy). OpenAI fields this server does not implement (timestamp_granularities[],
stream, include[], chunking_strategy, srt/vtt output) are refused with a 400 naming them.

Bounds: the server's body limit (ServerConfig.max_request_bytes, enforced by the ASGI guard
before and while the body is read) bounds the upload; the audio's sample rate, channels and
duration are checked on its container header (media.check_audio_format) before anything is
decoded, against the server's and the processor's audio limits; the processor checks again
while decoding (headers can lie).

The prompt is Qwen2.5-Omni's documented ASR usage (its audio-understanding cookbook): the
system message "You are a speech recognition model." and a user turn holding the instruction
and the audio. Qwen3-Omni takes the same messages. The reply is capped at
`transcription_max_tokens(seconds)` text tokens."""

from __future__ import annotations

import asyncio
import io
import math
import re
import uuid
import zlib
from typing import Any, Literal

import soundfile
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from omnistage.entrypoints.openai.protocol import APIError
from omnistage.entrypoints.openai.serving import (ClientGone, ServerState, build_sampling,
                                                  client_gone, collect, log,
                                                  release_unless_handed_over, runtime_error,
                                                  seconds, start_request, value_error)
from omnistage.models.qwen2_5_omni.media import check_audio_format

ASR_SYSTEM_PROMPT = "You are a speech recognition model."
MAX_PROMPT_CHARS = 4096
MAX_FORM_FIELDS = 16  # a transcription form has 6 fields; more is not a transcription
MAX_FIELD_BYTES = 64 << 10  # one text field (file parts are bounded by the body limit)
# reply cap: generous for speech (fast English is ~6 tokens/s, Chinese ~8), so that only a
# model that does not stop hits it
TOKENS_PER_AUDIO_SECOND = 25
MIN_TRANSCRIPTION_TOKENS = 64

FIELDS = ("file", "model", "language", "prompt", "response_format", "temperature")
# OpenAI's transcription fields this server refuses, and why
UNSUPPORTED = {
    "timestamp_granularities[]": "word and segment timestamps are not supported (the thinker "
                                 "gives no timestamps)",
    "timestamp_granularities": "word and segment timestamps are not supported (the thinker "
                               "gives no timestamps)",
    "stream": "streamed transcriptions are not supported; send the request without stream",
    "include[]": "include (logprobs) is not supported",
    "include": "include (logprobs) is not supported",
    "chunking_strategy": "chunking_strategy is not supported: the audio is transcribed whole",
}
RESPONSE_FORMATS = ("json", "text", "verbose_json")

# ISO-639-1 codes (what OpenAI's `language` takes) -> the name used in the instruction
LANGUAGES = {
    "ar": "Arabic", "bg": "Bulgarian", "ca": "Catalan", "cs": "Czech", "da": "Danish",
    "de": "German", "el": "Greek", "en": "English", "es": "Spanish", "et": "Estonian",
    "fa": "Persian", "fi": "Finnish", "fr": "French", "he": "Hebrew", "hi": "Hindi",
    "hr": "Croatian", "hu": "Hungarian", "id": "Indonesian", "it": "Italian", "ja": "Japanese",
    "ko": "Korean", "lt": "Lithuanian", "lv": "Latvian", "ms": "Malay", "nl": "Dutch",
    "no": "Norwegian", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian",
    "sk": "Slovak", "sl": "Slovenian", "sr": "Serbian", "sv": "Swedish", "th": "Thai",
    "tl": "Tagalog", "tr": "Turkish", "uk": "Ukrainian", "ur": "Urdu", "vi": "Vietnamese",
    "yue": "Cantonese", "zh": "Chinese",
}


class TranscriptionFields(BaseModel):
    """The text fields of a transcription form (lax: form values are strings)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    language: str | None = Field(default=None, pattern=r"^[A-Za-z]{2,3}$",
                                 description="ISO-639-1 code of the audio's language")
    prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS,
                               description="context for the transcription (names, spelling)")
    response_format: Literal[RESPONSE_FORMATS] = "json"
    temperature: float = Field(default=0.0, ge=0, le=1, allow_inf_nan=False)


class TranscriptionRequest(TranscriptionFields):
    """POST /v1/audio/transcriptions, multipart/form-data (the OpenAPI body)."""

    file: bytes = Field(description="the audio: wav, flac, ogg (vorbis, opus), mp3 or aiff")


def transcription_max_tokens(audio_seconds: float, max_model_len: int) -> int:
    """The reply's text token cap for a clip of `audio_seconds`."""
    want = max(MIN_TRANSCRIPTION_TOKENS, math.ceil(audio_seconds * TOKENS_PER_AUDIO_SECOND))
    return min(want, max_model_len - 1)


def asr_messages(audio: Any, language: str | None, prompt: str | None) -> list[dict[str, Any]]:
    """The ASR conversation for one clip (the same messages through chat give the same text)."""
    name = f"{LANGUAGES[language.lower()]} " if language else ""
    instruction = f"Transcribe the {name}audio into text."
    if prompt:
        instruction += f" Context: {prompt}"
    return [{"role": "system", "content": ASR_SYSTEM_PROMPT},
            {"role": "user", "content": [{"type": "text", "text": instruction},
                                         {"type": "audio", "audio": audio}]}]


_AUDIO_WHERE = re.compile(r"^messages\[1\]\.content\[1\](\.audio)?( \(.*?\))?")


def _bad_input(e: ValueError, has_prompt: bool) -> APIError:
    """The processor's errors name the form's fields: the clip's `file`; the whole input's
    length `prompt` when one was given, else `file`."""
    err = value_error(e)
    if err.param and err.param.startswith("messages[1].content[1]"):
        return APIError(400, _AUDIO_WHERE.sub("file", err.message), param="file",
                        code="invalid_audio")
    if err.param == "messages":  # (the rendered conversation: too long for the context)
        field = "prompt" if has_prompt else "file"
        why = err.message.split(": ", 1)[-1]
        return APIError(400, f"{field}: the transcription's input is too long: {why}",
                        param=field)
    return err


class OpenAIServingTranscriptions:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.processor = getattr(state.llm.pipeline, "processor", None)

    async def create(self, request: Request) -> Response:
        st = self.state
        form = await self._form(request)
        try:
            fields, upload = self._fields(form)
            st.check_model(fields.model)
            if "audio" not in getattr(self.processor, "placeholders", {}):
                raise APIError(400, "model: this model does not take audio input",
                               param="model")
            if fields.language and fields.language.lower() not in LANGUAGES:
                raise APIError(400, f"language: {fields.language!r} is not a supported "
                               f"ISO-639-1 code; supported: {sorted(LANGUAGES)}",
                               param="language", code="unsupported_language")
            raw = await upload.read()
        finally:
            await form.close()
        duration = await asyncio.to_thread(self._check_header, raw)
        return await self._run(fields, raw, duration, request)

    # ------------------------------------------------------------------ input
    async def _form(self, request: Request) -> FormData:
        ctype = request.headers.get("content-type", "")
        if ctype.split(";", 1)[0].strip().lower() != "multipart/form-data":
            raise APIError(400, "body: expected multipart/form-data with fields "
                           f"{', '.join(FIELDS)}", code="invalid_content_type")
        try:
            return await request.form(max_files=1, max_fields=MAX_FORM_FIELDS,
                                      max_part_size=MAX_FIELD_BYTES)
        except StarletteHTTPException as e:  # a malformed or oversized multipart body
            raise APIError(400, f"body: invalid multipart form: {e.detail}",
                           code="invalid_multipart") from e

    def _fields(self, form: FormData) -> tuple[TranscriptionFields, UploadFile]:
        """The validated text fields and the uploaded file; a 400 naming the field."""
        values: dict[str, str] = {}
        upload = None
        for name in dict.fromkeys(form.keys()):
            items = form.getlist(name)
            if name in UNSUPPORTED:
                raise APIError(400, f"{name}: {UNSUPPORTED[name]}", param=name,
                               code="unsupported_field")
            if name not in FIELDS:
                raise APIError(400, f"{name}: unknown field; the fields are "
                               f"{', '.join(FIELDS)}", param=name, code="unknown_field")
            if len(items) > 1:
                raise APIError(400, f"{name}: given {len(items)} times", param=name)
            item = items[0]
            if name == "file":
                if not isinstance(item, UploadFile):
                    raise APIError(400, "file: must be a file part (filename given), not a "
                                   "text field", param="file")
                upload = item
            elif not isinstance(item, str):
                raise APIError(400, f"{name}: must be a text field, not a file", param=name)
            else:
                values[name] = item
        if values.get("response_format") in ("srt", "vtt"):
            raise APIError(400, f"response_format: {values['response_format']} is not "
                           "supported (no timestamps); use json, text or verbose_json",
                           param="response_format")
        try:
            fields = TranscriptionFields.model_validate(values)
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            name = str(err["loc"][0]) if err["loc"] else "body"
            raise APIError(400, f"{name}: {err['msg']}", param=name,
                           code="invalid_value") from e
        if upload is None:
            raise APIError(400, "file: is required (the audio to transcribe)", param="file")
        return fields, upload

    def _check_header(self, raw: bytes) -> float:
        """The clip's duration from its container header, bounded before any decoding."""
        if not raw:
            raise APIError(400, "file: is empty", param="file", code="invalid_audio")
        limit = self.state.config.max_audio_seconds
        limit = min(limit, getattr(self.processor, "max_audio_seconds", limit))
        try:
            with soundfile.SoundFile(io.BytesIO(raw)) as f:
                duration = f.frames / max(f.samplerate, 1)
                check_audio_format("file", f.samplerate, f.channels, duration, limit)
        except (soundfile.LibsndfileError, RuntimeError, TypeError) as e:
            why = re.sub(r"^Error opening <[^>]*>: ", "", str(e))
            raise APIError(400, f"file: not an audio file this server reads (wav, flac, ogg, "
                           f"mp3, aiff): {why}", param="file", code="invalid_audio") from e
        except ValueError as e:
            code = "audio_too_long" if "long" in str(e) else "invalid_audio"
            raise APIError(400, str(e), param="file", code=code) from e
        return duration

    # ------------------------------------------------------------------ run
    async def _run(self, fields: TranscriptionFields, raw: bytes, duration: float,
                   request: Request) -> Response:
        st = self.state
        verbose = fields.response_format == "verbose_json"
        top = {"temperature": fields.temperature,
               "max_tokens": transcription_max_tokens(duration, st.max_model_len),
               "logprobs": 0 if verbose else None}  # (the segment's avg_logprob)
        params = build_sampling(st, top, None, None)
        prompt = {"messages": asr_messages(raw, fields.language, fields.prompt)}
        rid = f"trsc-{uuid.uuid4().hex}"

        def bad_input(e: ValueError) -> APIError:
            return _bad_input(e, bool(fields.prompt))

        st.acquire()
        stream = None
        try:
            stream = await start_request(st, request, prompt, params, ["text"], rid, bad_input)
            log.info("%s: transcription format=%s language=%s audio=%.2fs", rid,
                     fields.response_format, fields.language, duration)
            out, _ = await collect(stream)
        except ValueError as e:  # rejected by generate() after preparation
            raise bad_input(e) from e
        except ClientGone:
            return client_gone(st, rid, "transcriptions")
        finally:
            release_unless_handed_over(st, stream, False)
        if out.error:
            raise runtime_error(out.error, produced=bool(out.token_ids))
        st.metrics.observe_finished("transcriptions", out)
        m = out.metrics
        log.info("%s: finished tokens=%d ttft=%s e2e=%s", rid, len(out.token_ids),
                 seconds(m.ttft), seconds(m.e2e))
        headers = {"X-Request-Id": rid}
        if fields.response_format == "text":
            return PlainTextResponse(out.text, headers=headers)
        n_in, n_out = len(out.prompt_token_ids), len(out.token_ids)
        usage = {"type": "tokens", "input_tokens": n_in, "output_tokens": n_out,
                 "total_tokens": n_in + n_out}
        if not verbose:
            return JSONResponse({"text": out.text, "usage": usage}, headers=headers)
        return JSONResponse({"task": "transcribe", "language": _language_name(fields.language),
                             "duration": round(duration, 3), "text": out.text,
                             "segments": [_segment(out, duration, fields.temperature)],
                             "usage": usage}, headers=headers)


def _language_name(code: str | None) -> str | None:
    """OpenAI's verbose_json names the language in lower case ('english'); None: not given
    (this server does not detect languages)."""
    return LANGUAGES[code.lower()].lower() if code else None


def _segment(out, duration: float, temperature: float) -> dict[str, Any]:
    """The whole clip as one segment (the thinker gives no timestamps): its tokens, their mean
    logprob and the text's gzip compression ratio (as Whisper computes it)."""
    data = out.text.encode("utf-8")
    ratio = len(data) / len(zlib.compress(data)) if data else 0.0
    ids, logprobs = out.token_ids, out.logprobs or []
    lps = [max(lp[t], -9999.0) for t, lp in zip(ids[len(ids) - len(logprobs):], logprobs)]
    return {"id": 0, "seek": 0, "start": 0.0, "end": round(duration, 3), "text": out.text,
            "tokens": list(ids), "temperature": temperature,
            "avg_logprob": sum(lps) / len(lps) if lps else None,
            "compression_ratio": round(ratio, 4)}
