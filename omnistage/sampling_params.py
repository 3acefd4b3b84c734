"""Per-request sampling parameters (vLLM's names, transformers' semantics)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MAX_STOP_STRINGS = 32
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 1024
# the bounds of every numeric field, shared by the HTTP models and the pipeline YAML: seeds are
# int64 (torch.Generator and the sampler's seed tensor), counts fit int32, float fields stay
# finite and meaningful in the sampler's float32 rows
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_LOGPROBS = 20  # top tokens per position (OpenAI's top_logprobs bound)
MAX_SCHEMA_CHARS = 1 << 16  # a JSON schema, as compact JSON text
MAX_WRAP_CHARS = 256  # StructuredOutput.prefix / suffix


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must follow, enforced while decoding (an xgrammar token bitmask
    applied to the logits before sampling): exactly one of `json_schema` (a JSON schema, as a
    dict or JSON text; OpenAI's strict json_schema) or `json_object` (any JSON object), with
    optional literal text around it (`prefix` + JSON + `suffix`, e.g. Qwen's tool-call tags).

    End-of-sequence ids are allowed only once the grammar is complete; a request that reaches
    max_tokens first ends with finish_reason "length" and incomplete JSON (OpenAI's rule)."""

    json_schema: dict[str, Any] | str | None = None
    json_object: bool = False
    prefix: str = ""
    suffix: str = ""

    def schema_text(self) -> str:
        """The schema as JSON text (the grammar cache's key). Keys keep their order: a
        schema's property order is the order the output writes them in."""
        if self.json_object:
            return '{"type": "object"}'
        if isinstance(self.json_schema, str):
            return json.dumps(json.loads(self.json_schema))
        return json.dumps(self.json_schema)

    def key(self) -> tuple[str, str, str]:
        return self.schema_text(), self.prefix, self.suffix

    def validate(self, where: str) -> None:
        """Raise ValueError naming the offending field (prefixed with `where`): the schema must
        be a JSON object of at most MAX_SCHEMA_CHARS that xgrammar can turn into a grammar."""
        if (self.json_schema is None) == (not self.json_object):
            raise ValueError(f"{where}: set exactly one of json_schema and json_object")
        for name in ("prefix", "suffix"):
            text = getattr(self, name)
            if not isinstance(text, str) or len(text) > MAX_WRAP_CHARS:
                raise ValueError(f"{where}.{name}: must be a string of at most "
                                 f"{MAX_WRAP_CHARS} characters")
        if self.json_object:
            return
        schema = self.json_schema
        if isinstance(schema, str):
            if len(schema) > MAX_SCHEMA_CHARS:
                raise ValueError(f"{where}.json_schema: longer than {MAX_SCHEMA_CHARS} "
                                 "characters")
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}.json_schema: not valid JSON: {e}") from e
        if not isinstance(schema, dict):
            raise ValueError(f"{where}.json_schema: must be a JSON object, got "
                             f"{type(schema).__name__}")
        try:
            text = json.dumps(schema, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}.json_schema: not JSON-serialisable: {e}") from e
        if len(text) > MAX_SCHEMA_CHARS:
            raise ValueError(f"{where}.json_schema: {len(text)} characters as JSON, more than "
                             f"{MAX_SCHEMA_CHARS}")
        import xgrammar  # (a grammar without a tokenizer: checks the schema only)
        try:
            xgrammar.Grammar.from_json_schema(text)
        except RuntimeError as e:  # xgrammar reports unsupported or malformed schemas so
            reason = str(e).strip().splitlines()[-1].split(": ", 1)[-1]
            raise ValueError(f"{where}.json_schema: invalid or unsupported schema: "
                             f"{reason}") from e


def stage_seed(seed: int, offset: int) -> int:
    """The seed of the stage `offset` stages after one seeded with `seed` (a pipeline seeds its
    stages s, s+1, s+2): `seed + offset` wrapped modulo 2^64 into int64 [-2^63, 2^63-1], so
    2^63-1 + 1 is -2^63. torch.Generator and the sampler read seeds modulo 2^64, so the wrap
    changes no draw; it keeps every derived seed in range for them."""
    return (seed + offset - INT64_MIN) % (1 << 64) + INT64_MIN


@dataclass
class SamplingParams:
    """temperature 0 = greedy. top_k <= 0 = off (-1 or 0). Penalties follow transformers
    (repetition: prompt + output ids, divide positive / multiply negative logits) and
    vLLM/OpenAI (presence, frequency: output ids only). validate() gives each field's bounds.

    logprobs (vLLM's meaning): None = none; k in [0, MAX_LOGPROBS] = per generated token, the
    emitted token's logprob and the k most likely tokens' (OmniRequestOutput.logprobs).
    They are vLLM's "processed_logprobs": log-softmax of the distribution the token was drawn
    from, i.e. the logits after the repetition/presence/frequency penalties and bans
    (suppressed ids, stop ids under min_tokens), then temperature, top-k, top-p and min-p
    (cut tokens: -inf). Greedy (temperature 0): the penalised logits, no temperature. Tokens
    the processing cut (logprob -inf) are left out of the top k, so a position may list fewer
    than k (as OpenAI allows); the emitted token is always listed."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    structured_output: StructuredOutput | None = None
    # internal: ids that may never be sampled (e.g. the talker's codec bos)
    suppress_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def validate(self, where: str = "sampling_params", vocab_size: int | None = None) -> None:
        """Raise ValueError naming the offending field (prefixed with `where`)."""

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{where}.{name}: {why}")

        def number(name: str, value: object) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(name, f"must be a number, got {type(value).__name__}")
            if value != value or value in (float("inf"), float("-inf")):
                raise bad(name, "must be finite")
            return float(value)

        def integer(name: str, value: object, low: int, high: int) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, f"must be an integer, got {type(value).__name__}")
            if not low <= value <= high:
                raise bad(name, f"must be in [{low}, {high}], got {value}")
            return value

        if not 0 <= number("temperature", self.temperature) <= MAX_TEMPERATURE:
            raise bad("temperature", f"must be in [0, {MAX_TEMPERATURE}], got {self.temperature}")
        if not 0 < number("top_p", self.top_p) <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        integer("top_k", self.top_k, -1, INT32_MAX)
        if not 0 <= number("min_p", self.min_p) <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0 < number("repetition_penalty", self.repetition_penalty) \
                <= MAX_REPETITION_PENALTY:
            raise bad("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY}], got "
                      f"{self.repetition_penalty}")
        if not -2 <= number("presence_penalty", self.presence_penalty) <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= number("frequency_penalty", self.frequency_penalty) <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None:
            integer("max_tokens", self.max_tokens, 1, INT32_MAX)
        integer("min_tokens", self.min_tokens, 0, INT32_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"{self.min_tokens} exceeds max_tokens {self.max_tokens}")
        if self.seed is not None:
            integer("seed", self.seed, INT64_MIN, INT64_MAX)
        if self.logprobs is not None:
            integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_LEN:
                raise bad(f"stop[{i}]",
                          f"must be a non-empty string of <= {MAX_STOP_STRING_LEN} chars")
        top_id = INT64_MAX if vocab_size is None else vocab_size - 1
        for name in ("stop_token_ids", "suppress_token_ids"):
            ids = getattr(self, name)
            if not isinstance(ids, list):
                raise bad(name, f"must be a list of token ids, got {type(ids).__name__}")
            if name == "stop_token_ids" and len(ids) > MAX_STOP_TOKEN_IDS:
                raise bad(name, f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
            for i, t in enumerate(ids):  # the range: ids inside the vocabulary
                integer(f"{name}[{i}]", t, 0, top_id)
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise bad("structured_output", "must be a StructuredOutput, got "
                          f"{type(self.structured_output).__name__}")
            # the grammar allows an end-of-sequence id only where the JSON is complete: with
            # min_tokens the ban on stop ids could leave no token; ignore_eos, no way to end
            if self.ignore_eos:
                raise bad("ignore_eos", "cannot be combined with structured_output")
            if self.min_tokens:
                raise bad("min_tokens", "cannot be combined with structured_output")
            self.structured_output.validate(f"{where}.structured_output")


@dataclass
class DiffusionParams:
    """The sampling parameters of an image pipeline (diffusers' names). None = the pipeline's
    default (its model card's steps and guidance). `seed` draws the initial noise exactly as
    diffusers does with `generator=torch.Generator("cpu").manual_seed(seed)`; the
    `num_images` images of a prompt come from that one stream."""

    height: int = 1024
    width: int = 1024
    num_inference_steps: int | None = None
    guidance_scale: float | None = None  # distilled / Z-Image style CFG
    true_cfg_scale: float | None = None  # Qwen-Image's CFG (with a negative prompt)
    negative_prompt: str | None = None
    num_images: int = 1
    seed: int | None = None

    def validate(self, where: str, *, multiple: int, max_pixels: int, max_side: int,
                 max_steps: int, max_images: int) -> None:
        """Raise ValueError naming the offending field (prefixed with `where`)."""

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{where}.{name}: {why}")

        def integer(name: str, value: object, low: int, high: int) -> None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, f"must be an integer, got {type(value).__name__}")
            if not low <= value <= high:
                raise bad(name, f"must be in [{low}, {high}], got {value}")

        for name in ("height", "width"):
            integer(name, getattr(self, name), multiple, max_side)
            if getattr(self, name) % multiple:
                raise bad(name, f"must be a multiple of {multiple}, got {getattr(self, name)}")
        if self.height * self.width > max_pixels:
            raise bad("height", f"{self.width}x{self.height} exceeds {max_pixels} pixels")
        if self.num_inference_steps is not None:
            integer("num_inference_steps", self.num_inference_steps, 1, max_steps)
        for name in ("guidance_scale", "true_cfg_scale"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or value != value or not 0 <= value <= 100:
                raise bad(name, f"must be a number in [0, 100], got {value!r}")
        if self.negative_prompt is not None and (
                not isinstance(self.negative_prompt, str) or len(self.negative_prompt) > 1 << 16):
            raise bad("negative_prompt", "must be a string of at most 65536 characters")
        integer("num_images", self.num_images, 1, max_images)
        if self.seed is not None:
            integer("seed", self.seed, -(1 << 63), (1 << 64) - 1)
