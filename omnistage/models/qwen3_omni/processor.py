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

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, WhisperFeatureExtractor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from omnistage.checkpoint import quiet_transformers
from omnistage.models.qwen2_5_omni.media import load_audio, load_image
from omnistage.models.qwen2_5_omni.processor import (
    MediaItem,
    ProcessedPrompt,
    Qwen2_5OmniInputProcessor,
    _chat_template,
    _processor_dicts,
    _read_json,
    _video_dict,
)
from omnistage.models.qwen2_5_omni.video import Qwen2_5OmniVideoConfig
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
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase,
                 feature_extractor: WhisperFeatureExtractor,
                 image_processor: Qwen2VLImageProcessorPil, chat_template: str,
                 rope_config: Qwen3OmniRopeConfig, **limits: Any) -> None:
        super().__init__(tokenizer, feature_extractor, image_processor, chat_template,
                         rope_config, **limits)  # type: ignore[arg-type]
        self.rope_config: Qwen3OmniRopeConfig = rope_config
        self.token_ids = {kind: tokenizer.convert_tokens_to_ids(tok)
                          for kind, tok in PLACEHOLDERS.items()}
        want = {"audio": rope_config.audio_token_id, "image": rope_config.image_token_id,
                "video": rope_config.video_token_id}
        if self.token_ids != want:
            raise ValueError(f"tokenizer: placeholder ids {self.token_ids} differ from the "
                             f"thinker config's {want}")

    @classmethod
    def from_pretrained(cls, path: str | Path, **limits: Any) -> Qwen3OmniInputProcessor:
        """Load from a Qwen3-Omni checkpoint directory (root preprocessor_config.json as
        released, or transformers 5's nested processor_config.json)."""
        root = Path(path)
        if not (root / "config.json").is_file():
            raise ValueError(f"{root}: not a checkpoint directory (no config.json)")
        thinker = _read_json(root / "config.json").get("thinker_config")
        if not thinker:
            raise ValueError(f"{root}/config.json: no thinker_config (not Qwen3-Omni?)")
        with quiet_transformers():  # AutoTokenizer reads config.json through AutoConfig
            tok = AutoTokenizer.from_pretrained(str(root))
        fe_dict, ip_dict = _processor_dicts(root)
        fe = WhisperFeatureExtractor.from_dict(fe_dict)
        ip = Qwen2VLImageProcessorPil.from_dict(ip_dict)
        rope = Qwen3OmniRopeConfig.from_thinker_config(thinker)
        limits.setdefault("video_config", qwen3_omni_video_config(ip_dict, _video_dict(root)))
        return cls(tok, fe, ip, _chat_template(root, tok), rope, **limits)

    def process(self, messages: list[dict], *, add_audio_system_prompt: bool = False,
                max_prompt_tokens: int | None = None,
                use_audio_in_video: bool = False) -> ProcessedPrompt:
        """Render chat `messages` (Qwen's convention) with the chat template and expand media;
        see Qwen2_5OmniInputProcessor.process. `add_audio_system_prompt` is ignored (see the
        module docstring)."""
        del add_audio_system_prompt
        return super().process(messages, max_prompt_tokens=max_prompt_tokens,
                               use_audio_in_video=use_audio_in_video)

    # ----------------------------------------------------------------------------- helpers

    def _check_text(self, text: str, where: str) -> None:
        for tok in PLACEHOLDERS.values():
            if tok in text:
                raise ValueError(f"{where}: contains the reserved media placeholder {tok}")

    def _check_video_wrapping(self, ids: list[int], pos: int, where: str) -> None:
        # the merged layout (and its positions) needs the video wrapped in vision start / end
        cfg = self.rope_config
        if not (0 < pos < len(ids) - 1 and ids[pos - 1] == cfg.vision_start_token_id
                and ids[pos + 1] == cfg.vision_end_token_id):
            raise ValueError(f"{where}: a video used with its audio must be placed as "
                             f"<|vision_start|>{VIDEO_TOKEN}<|vision_end|> in the prompt")

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

    def _build(self, text: str, media: list[tuple[str, str, Any]], field: str,
               max_prompt_tokens: int | None, use_audio_in_video: bool = False
               ) -> ProcessedPrompt:
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        for kind, token in PLACEHOLDERS.items():  # before any decoding work
            wheres = [w for k, w, _ in media if k == kind]
            found = sum(1 for t in ids if t == self.token_ids[kind])
            if found < len(wheres):
                raise ValueError(f"{wheres[found]}: the prompt has no {token} placeholder for "
                                 f"this {kind} ({found} placeholders for {len(wheres)} items)")
            if found > len(wheres):
                raise ValueError(f"{field}: the prompt has {found} {token} placeholders but "
                                 f"{len(wheres)} {kind} items were given")
        audios: list[tuple[torch.Tensor, bytes]] = []
        images, image_hashes, videos = [], [], []
        for kind, where, src in media:
            if kind == "audio":
                audio = load_audio(src, where, max_audio_seconds=self.max_audio_seconds,
                                   allow_local_paths=self.allow_local_paths)
                audios.append((self._audio_features(audio.samples, where), audio.content_hash))
            elif kind == "image":
                image = load_image(src, where, max_image_pixels=self.max_image_pixels,
                                   allow_local_paths=self.allow_local_paths)
                images.append(image.image)
                image_hashes.append(image.content_hash)
            else:
                videos.append((where, self._load_video(src, where, use_audio_in_video)))
        pixel_values = grid = None
        if images:
            out = self.image_processor(images=images, return_tensors="pt")
            pixel_values, grid = out["pixel_values"], out["image_grid_thw"].long()
        merge = self.image_processor.merge_size
        expanded: list[int] = []
        items: list[MediaItem] = []
        audio_feats: list[torch.Tensor] = []  # prompt order, video audio tracks included
        seen = {"audio": 0, "image": 0, "video": 0}
        kind_of = {v: k for k, v in self.token_ids.items()}
        for pos, t in enumerate(ids):
            kind = kind_of.get(t)
            if kind is None:
                expanded.append(t)
                continue
            k = seen[kind]
            seen[kind] += 1
            if kind == "audio":
                feats, digest = audios[k]
                audio_feats.append(feats)
                n = self._audio_pads(feats)
                items.append(MediaItem(kind, k, len(expanded), n, digest))
                expanded += [t] * n
            elif kind == "image":
                n = int(grid[k].prod()) // merge**2
                items.append(MediaItem(kind, k, len(expanded), n, image_hashes[k]))
                expanded += [t] * n
            else:
                where, v = videos[k]
                if v.audio_features is None:
                    n = math.prod(v.grid) // self.video_config.merge_size**2
                    items.append(MediaItem(kind, k, len(expanded), n, v.content_hash))
                    expanded += [t] * n
                    continue
                self._check_video_wrapping(ids, pos, where)
                n_audio = self._audio_pads(v.audio_features)
                run = self._video_with_audio_run(v.grid, v.second_per_grid, n_audio)
                expanded.append(self.rope_config.audio_start_token_id)
                items.append(MediaItem(kind, k, len(expanded), len(run), v.content_hash,
                                       audio_tokens=n_audio))
                expanded += run + [self.rope_config.audio_end_token_id]
                audio_feats.append(v.audio_features)
        if max_prompt_tokens is not None and len(expanded) > max_prompt_tokens:
            raise ValueError(f"{field}: prompt is {len(expanded)} tokens (with media), more than "
                             f"max_prompt_tokens={max_prompt_tokens}")
        vids = [v for _, v in videos]
        video_pixels = torch.cat([v.pixel_values for v in vids]) if vids else None
        video_grid = torch.tensor([v.grid for v in vids], dtype=torch.long) if vids else None
        spg = torch.tensor([v.second_per_grid for v in vids]) if vids else None
        positions, delta = mrope_positions(
            expanded, grid, [f.shape[1] for f in audio_feats], self.rope_config,
            video_grid_thw=video_grid, second_per_grid=spg, use_audio_in_video=use_audio_in_video)
        return ProcessedPrompt(expanded, audio_feats, pixel_values, grid, items, positions,
                               delta, text, video_pixels, video_grid, spg, use_audio_in_video,
                               dict(self.token_ids))
