"""Qwen2.5-Omni code2wav's model-level options (one frozen dataclass, read once at
construction) and the pipeline's `code2wav_*` keyword options, which fill it and the engine's
`GenEngineConfig` (engine/gen/config.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from omnistage.engine.gen.config import GenEngineConfig, pop_stage_options
from omnistage.runtime.build import DTYPES

from .code2wav_stream import Qwen2_5OmniCode2WavStreamConfig

# the DiT's compute dtypes ("tf32": float32 weights, TF32 matmuls)
DIT_DTYPES = {"float32": DTYPES["float32"], "tf32": DTYPES["float32"],
              "bfloat16": DTYPES["bfloat16"]}
# BigVGAN's conv dtypes (half ones: autocast; the weights stay float32)
VOCODER_DTYPES = {name: DTYPES[name] for name in ("float32", "float16", "bfloat16")}
DIT_ATTENTIONS = ("block", "sdpa")  # the Triton block kernel; torch SDPA over a dense mask
BIGVGAN_TRITON = ("auto", "off", "recompute", "gather")  # auto: the default fused variant


@dataclass(frozen=True)
class Qwen2_5OmniCode2WavOptions:
    """window: "auto" = on CUDA a 1-block first chunk, then 24-block chunks; elsewhere the
    stream config's defaults (1-block chunks); None = one-shot decode per utterance (measured:
    benchmarks/results/qwen2_5_omni_pipeline_gpu_h100_chunk24_c32_2026-11-23.json).
    dit_dtype: None = bfloat16 on CUDA (mel SNR 52.7 dB against fp32 at 7B shapes), float32
    elsewhere. vocoder_dtype: None = float16 on CUDA (measured: benchmarks/results/
    bigvgan_gpu_h100_precision_fp16_2026-11-23.json), float32 elsewhere.
    dit_attention: None = "block" (Triton) on CUDA where triton is usable, else "sdpa".
    bigvgan_triton: BigVGAN's fused anti-aliased Snake on CUDA: "auto" (its default variant),
    "off" (the torch ops), or a variant name."""

    window: Qwen2_5OmniCode2WavStreamConfig | None | Literal["auto"] = "auto"
    dit_dtype: str | None = None
    vocoder_dtype: str | None = None
    dit_attention: str | None = None
    bigvgan_triton: str = "auto"

    def __post_init__(self) -> None:
        if self.window not in (None, "auto") \
                and not isinstance(self.window, Qwen2_5OmniCode2WavStreamConfig):
            raise ValueError(f"window: a Qwen2_5OmniCode2WavStreamConfig, None or 'auto', got "
                             f"{self.window!r}")
        if self.dit_dtype is not None and self.dit_dtype not in DIT_DTYPES:
            raise ValueError(f"dit_dtype: {self.dit_dtype!r}; one of {', '.join(DIT_DTYPES)}")
        if self.vocoder_dtype is not None and self.vocoder_dtype not in VOCODER_DTYPES:
            raise ValueError(f"vocoder_dtype: {self.vocoder_dtype!r}; one of "
                             f"{', '.join(VOCODER_DTYPES)}")
        if self.dit_attention is not None and self.dit_attention not in DIT_ATTENTIONS:
            raise ValueError(f"dit_attention: {self.dit_attention!r}; one of {DIT_ATTENTIONS}")
        if self.bigvgan_triton not in BIGVGAN_TRITON:
            raise ValueError(f"bigvgan_triton: {self.bigvgan_triton!r}; one of {BIGVGAN_TRITON}")

    def stream_config(self, device: torch.device) -> Qwen2_5OmniCode2WavStreamConfig | None:
        if self.window != "auto":
            return self.window
        if device.type == "cuda":
            return Qwen2_5OmniCode2WavStreamConfig(chunk_blocks=24, first_chunk_blocks=1)
        return Qwen2_5OmniCode2WavStreamConfig()

    def dit_dtype_for(self, device: torch.device) -> str:
        return self.dit_dtype or ("bfloat16" if device.type == "cuda" else "float32")

    def vocoder_dtype_for(self, device: torch.device) -> str:
        return self.vocoder_dtype or ("float16" if device.type == "cuda" else "float32")


# pipeline keyword option -> Qwen2_5OmniCode2WavOptions field (the engine's: ENGINE_KEYWORDS)
MODEL_KEYWORDS = {"code2wav_window": "window", "code2wav_dit_dtype": "dit_dtype",
                  "code2wav_vocoder_dtype": "vocoder_dtype",
                  "code2wav_dit_attention": "dit_attention",
                  "code2wav_bigvgan_triton": "bigvgan_triton"}


def pop_code2wav_options(opts: dict[str, Any]
                         ) -> tuple[GenEngineConfig, Qwen2_5OmniCode2WavOptions]:
    """Take the `code2wav_*` keyword options out of opts (None or absent: the default);
    a bad value raises ValueError naming its keyword. (A window of None is a choice: one-shot
    decode.)"""
    return pop_stage_options(opts, Qwen2_5OmniCode2WavOptions, MODEL_KEYWORDS,
                             absent={"window": "auto"})
