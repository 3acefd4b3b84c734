"""Qwen3-Omni prompt processing: chat messages / raw prompts + media -> thinker inputs.

Same surface and `ProcessedPrompt` as Qwen2.5-Omni's processor (message parsing, media loading,
validation and bounds are Qwen2.5's, reused); what differs is Qwen3-Omni's:
- placeholders: `<|audio_start|><|audio_pad|><|audio_end|>`,
  `<|vision_start|><|image_pad|><|vision_end|>`, `<|vision_start|><|video_pad|><|vision_end|>`;
- audio pad counts from the AuT length rule (rope_index.audio_tokens_for_frames, n_window from
  the thinker's audio_config);
- images and video in 16-pixel patches merged 2 x 2, mean / std 0.5 (from the checkpoint's
  preprocessor_config.json); video frames sized as transformers' Qwen3OmniMoeProcessor asks
  (128 to 768 merged tokens per frame), with Qwen's total pixel budget per video;
- a video with its audio track (`use_audio_in_video`): `<|audio_start|>` + video and audio pads
  merged by time + `<|audio_end|>` inside the vision tokens (rope_index.merge_by_time);
- 3-axis positions (rope_index.mrope_positions), equal to transformers' get_rope_index.

Each audio is featurised alone, padded to itself (transformers' Qwen3 processor pads to the
longest audio of the call): identical to transformers for prompts with one audio (a video's
audio track included); with several, transformers' shorter ones differ in their last frames
and may get one more frame (their features depend on the others; ours on their samples only,
which the prefix cache's content hashes rely on).

The audio system prompt: Qwen3-Omni speaks without Qwen2.5's system prompt (transformers'
generate checks none, the talker drops system turns, the released chat template adds no default
system message), so `add_audio_system_prompt` is accepted and ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase, WhisperFeatureExtractor

from omnistage.models.qwen2_5_omni.processor import (DeferredImageProcessor,
                                                     Qwen2_5OmniInputProcessor)
from omnistage.models.qwen2_5_omni.video import Qwen2_5OmniVideoConfig

if TYPE_CHECKING:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
from omnistage.models.qwen3_omni.rope_index import (
    Qwen3OmniRopeConfig,
    audio_tokens_for_frames,
    merge_by_time,
    mrope_positions,
)

AUDIO_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN = "<|audio_pad|>", "<|image_pad|>", "<|video_pad|>"
PLACEHOLDERS = {"audio": AUDIO_TOKEN, "image": IMAGE_TOKEN, "video": VIDEO_TOKEN}
# transformers' Qwen3OmniMoeProcessor passes this video size to its video processor, whatever
# the video processor's own settings say: 128 to 768 tokens of 32 x 32 pixels per frame
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 128 * 32 * 32, 768 * 32 * 32
_MIN_AUDIO_FRAMES = 3  # the STFT's reflect padding needs more samples than half its window
_VIDEO_KEYS = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
               "rescale_factor")


def qwen3_omni_video_config(image_processor: dict[str, Any], saved_video: dict[str, Any]
                            ) -> Qwen2_5OmniVideoConfig:
    """Video settings: the saved video processor's (the released checkpoints have none, and
    transformers' video processor then reads preprocessor_config.json, i.e. the image
    processor's patch / merge / mean / std), with the processor's frame size bounds."""
    d = {k: image_processor[k] for k in _VIDEO_KEYS if image_processor.get(k) is not None}
    d.update({k: v for k, v in saved_video.items() if k not in ("min_pixels", "max_pixels")})
    d["size"] = {"shortest_edge": VIDEO_MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS}
    return Qwen2_5OmniVideoConfig.from_dict(d)


class Qwen3OmniInputProcessor(Qwen2_5OmniInputProcessor):
    """Turns chat messages or raw prompts with media into `ProcessedPrompt`s (Qwen3-Omni).

    Stateless after construction (safe to share between threads that do not mutate it).
    `rope_config` is a `Qwen3OmniRopeConfig`; the other arguments are Qwen2.5's.
    `from_pretrained` (Qwen2.5's) loads a Qwen3-Omni checkpoint directory.
    """

    family = "Qwen3-Omni"
    placeholders = PLACEHOLDERS
    rope_config_class = Qwen3OmniRopeConfig
    audio_system_prompt = None  # add_audio_system_prompt is accepted and ignored (module doc)
    video_with_audio_wrapping = f"<|vision_start|>{VIDEO_TOKEN}<|vision_end|>"
    mrope_positions = staticmethod(mrope_positions)

    def __init__(self, tokenizer: PreTrainedTokenizerBase,
                 feature_extractor: WhisperFeatureExtractor,
                 image_processor: Qwen2VLImageProcessorPil | DeferredImageProcessor,
                 chat_template: str,
                 rope_config: Qwen3OmniRopeConfig, **limits: Any) -> None:
        super().__init__(tokenizer, feature_extractor, image_processor, chat_template,
                         rope_config, **limits)  # type: ignore[arg-type]
        self.rope_config: Qwen3OmniRopeConfig = rope_config
        want = {"audio": rope_config.audio_token_id, "image": rope_config.image_token_id,
                "video": rope_config.video_token_id}
        if self.token_ids != want:
            raise ValueError(f"tokenizer: placeholder ids {self.token_ids} differ from the "
                             f"thinker config's {want}")

    @classmethod
    def _video_config_from(cls, image_processor: dict[str, Any], saved_video: dict[str, Any]
                           ) -> Qwen2_5OmniVideoConfig:
        return qwen3_omni_video_config(image_processor, saved_video)

    # ----------------------------------------------------------------------------- hooks

    def _audio_features(self, samples: np.ndarray, where: str) -> torch.Tensor:
        # samples float32 [n] at 16 kHz -> log-mel [n_mels, n // hop] (padded to itself)
        fe = self.feature_extractor
        if samples.shape[0] // fe.hop_length < _MIN_AUDIO_FRAMES:
            raise ValueError(f"{where}: audio is too short ({samples.shape[0]} samples)")
        out = fe([samples], sampling_rate=fe.sampling_rate, padding="longest",
                 truncation=False, return_attention_mask=True, return_tensors="pt")
        valid = int(out["attention_mask"][0].sum())
        return out["input_features"][0, :, :valid].contiguous()

    def _audio_pads(self, feats: torch.Tensor) -> int:
        return audio_tokens_for_frames(int(feats.shape[1]), self.rope_config.n_window)

    def _video_with_audio_run(self, grid: list[int], second_per_grid: float, n_audio: int
                              ) -> list[int]:
        """Pad ids of a video with its audio track, merged by time as transformers' processor
        does (float64 times: grid step x seconds per step x positions per second)."""
        cfg, merge = self.rope_config, self.video_config.merge_size
        per_step = (grid[1] // merge) * (grid[2] // merge)
        times = np.repeat(np.arange(grid[0]), per_step) * second_per_grid \
            * float(cfg.position_id_per_seconds)
        order = merge_by_time(times.tolist(), list(range(n_audio)))
        return [cfg.video_token_id if is_video else cfg.audio_token_id for is_video in order]
