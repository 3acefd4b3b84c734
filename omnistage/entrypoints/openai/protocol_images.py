"""What clients send to POST /v1/images/generations (OpenAI's Images API; pydantic, unknown
fields forbidden). The size is checked against the served pipeline in serving_images.py."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from omnistage.entrypoints.openai.protocol import _Strict
from omnistage.models.diffusion_pipeline import MAX_IMAGES, MAX_PROMPT_CHARS, MAX_STEPS

IMAGE_FORMATS = ("png", "jpeg", "webp")
MAX_SIZE_CHARS = 32  # "WxH" or "auto"
MAX_TAG_CHARS = 256  # OpenAI's descriptive options we accept and ignore
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

_Tag = Annotated[str, Field(max_length=MAX_TAG_CHARS)]
_Scale = Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)]


class ImageGenerationRequest(_Strict):
    """OpenAI's image generation body plus diffusers' knobs (omnistage extensions)."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = None  # OpenAI makes it optional: the served model
    n: int = Field(default=1, ge=1, le=MAX_IMAGES)
    size: str = Field(default="1024x1024", max_length=MAX_SIZE_CHARS)  # "WxH" or "auto"
    response_format: Literal["b64_json", "url"] = "b64_json"  # "url": refused (no hosting)
    output_format: Literal[IMAGE_FORMATS] = "png"
    stream: bool = False  # refused when true
    # OpenAI options that do not apply to a diffusers pipeline: accepted, ignored
    quality: _Tag | None = None
    style: _Tag | None = None
    user: _Tag | None = None
    safety_identifier: _Tag | None = None
    background: _Tag | None = None
    moderation: _Tag | None = None
    output_compression: int | None = Field(default=None, ge=0, le=100)
    # omnistage extensions: diffusers' names; None = the model's default
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    num_inference_steps: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    guidance_scale: _Scale | None = None
    true_cfg_scale: _Scale | None = None
    negative_prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
