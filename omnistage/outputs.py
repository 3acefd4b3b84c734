"""What generate() returns: one OmniRequestOutput per request, with per-stage outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class StageOutput:
    """One stage's result for one request (tokens for AR stages, audio for code2wav)."""

    stage: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    audio: np.ndarray | None = None  # float32 [samples]
    # multi-codebook stages (Qwen3-Omni's talker): int64 [frames, codebooks], every codebook of
    # each frame; token_ids holds codebook 0
    codes: np.ndarray | None = None
    images: list = field(default_factory=list)  # image stages: PIL.Image.Image per image
    # AR stages whose SamplingParams.logprobs is set: one dict per token of token_ids
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestMetrics:
    ttft: float | None = None  # seconds to the first text token
    ttfa: float | None = None  # seconds to the first audio sample
    e2e: float | None = None
    tokens_per_stage: dict[str, int] = field(default_factory=dict)
    seed: int | None = None
    num_cached_tokens: int = 0


@dataclass
class OmniRequestOutput:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    text_delta: str = ""
    audio: np.ndarray | None = None
    sample_rate: int | None = None
    stages: dict[str, StageOutput] = field(default_factory=dict)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    finished: bool = False
    error: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    # image pipelines: the images (PIL.Image.Image, num_images of them) on the last output, and
    # (denoising steps done, steps in all) as the request progresses
    images: list = field(default_factory=list)
    progress: tuple[int, int] | None = None
    # SamplingParams.logprobs set (None otherwise): per token of token_ids (the text stage's),
    # {token id: logprob} of the emitted token (first) and the top k, as vLLM's SampleLogprobs;
    # see SamplingParams for the distribution. logprobs_delta: those of the tokens new since
    # the previous streamed output (a token whose text is held back comes with a later one)
    logprobs: list[dict[int, float]] | None = None
    logprobs_delta: list[dict[int, float]] | None = None
