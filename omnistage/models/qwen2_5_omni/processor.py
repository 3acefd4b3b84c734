"""Qwen2.5-Omni prompt processing: chat messages / raw prompts + media -> thinker inputs.

Equals transformers' `Qwen2_5OmniProcessor` (ids exactly, features to float rounding) for text,
audio and images; video is not supported yet. Loads the processor config from either layout:
the legacy root `preprocessor_config.json` (feature extractor + image processor fields merged)
or transformers 5's nested `processor_config.json`. Uses the PIL image processor, so torchvision
is not needed.

Audio longer than the feature extractor's window (300 s on the released checkpoint) is
rejected instead of silently truncated as transformers does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, WhisperFeatureExtractor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from omnistage.models.qwen2_5_omni.media import (
    DEFAULT_MAX_AUDIO_SECONDS,
    DEFAULT_MAX_IMAGE_PIXELS,
    load_audio,
    load_image,
)
from omnistage.models.qwen2_5_omni.rope_index import (
    Qwen2_5OmniRopeConfig,
    audio_tokens_for_frames,
    mrope_positions,
)

QWEN_AUDIO_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
    "perceiving auditory and visual inputs, as well as generating text and speech.")
AUDIO_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN = "<|AUDIO|>", "<|IMAGE|>", "<|VIDEO|>"
_PLACEHOLDERS = {"audio": AUDIO_TOKEN, "image": IMAGE_TOKEN, "video": VIDEO_TOKEN}
_PART_TYPES = ("text", "audio", "image", "video")


@dataclass(frozen=True)
class MediaItem:
    """One media input: its placeholder run is input_ids[start : start + length]."""

    kind: str  # "audio" | "image"
    index: int  # index among the prompt's items of this kind
    start: int
    length: int
    content_hash: bytes  # sha256 of the decoded samples / pixels (prefix-cache key)


@dataclass
class ProcessedPrompt:
    """Thinker inputs of one prompt.

    audio_features: per audio, float32 [128, frames] (valid frames only);
    image_pixel_values: float32 [sum of patches, 3 * 2 * 14 * 14] or None;
    image_grid_thw: int64 [n_images, 3] or None; mrope_positions: int64 [3, len(input_ids)];
    decode positions are `num_tokens + rope_delta` on all three axes.
    """

    input_ids: list[int]
    audio_features: list[torch.Tensor]
    image_pixel_values: torch.Tensor | None
    image_grid_thw: torch.LongTensor | None
    media: list[MediaItem]
    mrope_positions: torch.LongTensor
    rope_delta: int
    prompt_text: str

    @property
    def audio_feature_lengths(self) -> list[int]:
        return [int(f.shape[1]) for f in self.audio_features]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from e


def _processor_dicts(root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(feature extractor dict, image processor dict) from either processor config layout."""
    nested = root / "processor_config.json"
    if nested.is_file():
        cfg = _read_json(nested)
        if "feature_extractor" in cfg and "image_processor" in cfg:
            return cfg["feature_extractor"], cfg["image_processor"]
    legacy = root / "preprocessor_config.json"
    if legacy.is_file():
        # one dict holds both processors' fields: give each processor its own
        cfg = _read_json(legacy)
        fe_keys = set(WhisperFeatureExtractor().to_dict())
        ip_keys = set(Qwen2VLImageProcessorPil().to_dict()) | {"min_pixels", "max_pixels"}
        return ({k: v for k, v in cfg.items() if k in fe_keys},
                {k: v for k, v in cfg.items() if k in ip_keys})
    raise ValueError(f"{root}: no processor config (preprocessor_config.json or "
                     "processor_config.json with feature_extractor and image_processor)")


def _chat_template(root: Path, tok: PreTrainedTokenizerBase) -> str:
    if tok.chat_template:
        return tok.chat_template
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text()
    if (root / "chat_template.json").is_file():
        return _read_json(root / "chat_template.json")["chat_template"]
    raise ValueError(f"{root}: checkpoint has no chat template")


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


class Qwen2_5OmniInputProcessor:
    """Turns chat messages or raw prompts with media into `ProcessedPrompt`s.

    Stateless after construction (safe to share between threads that do not mutate it).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase,
                 feature_extractor: WhisperFeatureExtractor,
                 image_processor: Qwen2VLImageProcessorPil, chat_template: str,
                 rope_config: Qwen2_5OmniRopeConfig, *,
                 max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
                 max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 allow_local_paths: bool = True) -> None:
        self.tokenizer = tokenizer
        self.feature_extractor = feature_extractor
        self.image_processor = image_processor
        self.chat_template = chat_template
        self.rope_config = rope_config
        window = feature_extractor.n_samples / feature_extractor.sampling_rate
        self.max_audio_seconds = min(max_audio_seconds, window)
        self.max_image_pixels = max_image_pixels
        self.allow_local_paths = allow_local_paths
        self.token_ids = {kind: tokenizer.convert_tokens_to_ids(tok)
                          for kind, tok in _PLACEHOLDERS.items()}

    @classmethod
    def from_pretrained(cls, path: str | Path, **limits: Any) -> Qwen2_5OmniInputProcessor:
        """Load from a Qwen2.5-Omni checkpoint directory (either processor config layout)."""
        root = Path(path)
        if not (root / "config.json").is_file():
            raise ValueError(f"{root}: not a checkpoint directory (no config.json)")
        tok = AutoTokenizer.from_pretrained(str(root))
        fe_dict, ip_dict = _processor_dicts(root)
        fe = WhisperFeatureExtractor.from_dict(fe_dict)
        ip = Qwen2VLImageProcessorPil.from_dict(ip_dict)
        thinker = _read_json(root / "config.json").get("thinker_config")
        if not thinker:
            raise ValueError(f"{root}/config.json: no thinker_config (not Qwen2.5-Omni?)")
        rope = Qwen2_5OmniRopeConfig.from_thinker_config(thinker)
        return cls(tok, fe, ip, _chat_template(root, tok), rope, **limits)

    # ------------------------------------------------------------------------------ public

    def process(self, messages: list[dict], *, add_audio_system_prompt: bool = False,
                max_prompt_tokens: int | None = None) -> ProcessedPrompt:
        """Render chat `messages` (Qwen's convention) with the chat template and expand media."""
        rendered, media = self._parse_messages(messages)
        if add_audio_system_prompt and not any(m["role"] == "system" for m in rendered):
            rendered.insert(0, {"role": "system", "content": QWEN_AUDIO_SYSTEM_PROMPT})
        text = self.tokenizer.apply_chat_template(
            rendered, chat_template=self.chat_template, tokenize=False,
            add_generation_prompt=True)
        return self._build(text, media, "messages", max_prompt_tokens)

    def process_prompt(self, prompt: str, multi_modal_data: dict | None = None, *,
                       max_prompt_tokens: int | None = None) -> ProcessedPrompt:
        """Raw prompt that already holds `<|AUDIO|>` / `<|IMAGE|>` placeholders (one per item,
        usually wrapped as `<|audio_bos|><|AUDIO|><|audio_eos|>`); they are expanded here."""
        if not isinstance(prompt, str):
            raise ValueError(f"prompt: must be a string, got {type(prompt).__name__}")
        data = multi_modal_data or {}
        if not isinstance(data, dict):
            raise ValueError("multi_modal_data: must be a dict")
        media: list[tuple[str, str, Any]] = []
        for key, value in data.items():
            if key == "video":
                raise ValueError("multi_modal_data.video: video input is not supported yet")
            if key not in ("audio", "image"):
                raise ValueError(f"multi_modal_data.{key}: unknown modality "
                                 "(expected 'audio' or 'image')")
            media += [(key, f"multi_modal_data.{key}[{i}]", v)
                      for i, v in enumerate(_as_list(value))]
        return self._build(prompt, media, "prompt", max_prompt_tokens)

    # ----------------------------------------------------------------------------- helpers

    def _parse_messages(self, messages: Any) -> tuple[list[dict], list[tuple[str, str, Any]]]:
        """Validate messages -> (template-safe messages, [(kind, where, source)] in order)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: must be a non-empty list")
        rendered: list[dict] = []
        media: list[tuple[str, str, Any]] = []
        for i, msg in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                raise ValueError(f"{where}: must be a dict with a string 'role'")
            content = msg.get("content")
            if isinstance(content, str):
                self._check_text(content, f"{where}.content")
                rendered.append({"role": msg["role"], "content": content})
                continue
            if not isinstance(content, list):
                raise ValueError(f"{where}.content: must be a string or a list of parts")
            parts = []
            for j, part in enumerate(content):
                pw = f"{where}.content[{j}]"
                kind, value = self._part(part, pw)
                if kind == "text":
                    self._check_text(value, f"{pw}.text")
                    parts.append({"type": "text", "text": value})
                else:
                    media.append((kind, f"{pw}.{kind}", value))
                    # the template only looks at the type; keep media objects out of jinja
                    parts.append({"type": kind, kind: f"<{kind}>"})
            rendered.append({"role": msg["role"], "content": parts})
        return rendered, media

    @staticmethod
    def _part(part: Any, where: str) -> tuple[str, Any]:
        if not isinstance(part, dict):
            raise ValueError(f"{where}: a content part must be a dict")
        kind = part.get("type") or next((k for k in _PART_TYPES if k in part), None)
        if kind in ("image_url", "audio_url"):  # OpenAI style: {"type": "image_url", ...}
            ref = part.get(kind)
            url = ref.get("url") if isinstance(ref, dict) else ref
            return kind.removesuffix("_url"), url
        if kind not in _PART_TYPES:
            raise ValueError(f"{where}.type: unknown part type {kind!r} "
                             f"(expected one of {', '.join(_PART_TYPES)})")
        if kind == "video":
            raise ValueError(f"{where}.video: video input is not supported yet")
        if kind not in part:
            raise ValueError(f"{where}.{kind}: missing")
        if kind == "text" and not isinstance(part["text"], str):
            raise ValueError(f"{where}.text: must be a string")
        return kind, part[kind]

    @staticmethod
    def _check_text(text: str, where: str) -> None:
        for tok in _PLACEHOLDERS.values():
            if tok in text:
                raise ValueError(f"{where}: contains the reserved media placeholder {tok}")

    def _audio_features(self, samples: Any, where: str) -> torch.Tensor:
        # samples float32 [n] at 16 kHz -> log-mel [n_mels, frames] (valid frames only)
        fe = self.feature_extractor
        frames = math.ceil(samples.shape[0] / fe.hop_length)
        if audio_tokens_for_frames(frames) < 1:
            raise ValueError(f"{where}: audio is too short ({samples.shape[0]} samples)")
        # NOTE: transformers pads every audio to the full window (300 s); the valid frames only
        # see the audio plus zeros after it, so padding by n_fft + hop past the end gives the
        # same frames (the per-audio max clamp covers every frame that overlaps the audio).
        length = (frames + fe.n_fft // fe.hop_length + 2) * fe.hop_length
        out = fe([samples], sampling_rate=fe.sampling_rate, padding="max_length",
                 max_length=length, truncation=False, return_attention_mask=True,
                 return_tensors="pt")
        valid = int(out["attention_mask"][0].sum())
        if valid != frames:
            raise RuntimeError(f"feature extractor gave {valid} valid frames, expected {frames}")
        return out["input_features"][0, :, :frames].contiguous()

    def _build(self, text: str, media: list[tuple[str, str, Any]], field: str,
               max_prompt_tokens: int | None) -> ProcessedPrompt:
        if VIDEO_TOKEN in text:
            raise ValueError(f"{field}: video placeholders are not supported yet")
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        for kind in ("audio", "image"):  # before any decoding work
            wheres = [w for k, w, _ in media if k == kind]
            found = sum(1 for t in ids if t == self.token_ids[kind])
            if found < len(wheres):
                raise ValueError(f"{wheres[found]}: the prompt has no {_PLACEHOLDERS[kind]} "
                                 f"placeholder for this {kind} ({found} placeholders for "
                                 f"{len(wheres)} items)")
            if found > len(wheres):
                raise ValueError(f"{field}: the prompt has {found} {_PLACEHOLDERS[kind]} "
                                 f"placeholders but {len(wheres)} {kind} items were given")
        audio_feats: list[torch.Tensor] = []
        hashes: dict[str, list[bytes]] = {"audio": [], "image": []}
        images = []
        for kind, where, src in media:
            if kind == "audio":
                audio = load_audio(src, where, max_audio_seconds=self.max_audio_seconds,
                                   allow_local_paths=self.allow_local_paths)
                audio_feats.append(self._audio_features(audio.samples, where))
                hashes["audio"].append(audio.content_hash)
            else:
                image = load_image(src, where, max_image_pixels=self.max_image_pixels,
                                   allow_local_paths=self.allow_local_paths)
                images.append(image.image)
                hashes["image"].append(image.content_hash)
        pixel_values = grid = None
        if images:
            out = self.image_processor(images=images, return_tensors="pt")
            pixel_values, grid = out["pixel_values"], out["image_grid_thw"].long()
        merge = self.image_processor.merge_size
        lengths = {"audio": [audio_tokens_for_frames(f.shape[1]) for f in audio_feats],
                   "image": [] if grid is None else [int(g.prod()) // merge**2 for g in grid]}
        expanded: list[int] = []
        items: list[MediaItem] = []
        seen = {"audio": 0, "image": 0}
        kind_of = {v: k for k, v in self.token_ids.items()}
        for t in ids:
            kind = kind_of.get(t)
            if kind is None:
                expanded.append(t)
                continue
            k = seen[kind]
            n = lengths[kind][k]
            items.append(MediaItem(kind, k, len(expanded), n, hashes[kind][k]))
            expanded += [t] * n
            seen[kind] += 1
        if max_prompt_tokens is not None and len(expanded) > max_prompt_tokens:
            raise ValueError(f"{field}: prompt is {len(expanded)} tokens (with media), more than "
                             f"max_prompt_tokens={max_prompt_tokens}")
        positions, delta = mrope_positions(
            expanded, grid, [f.shape[1] for f in audio_feats], self.rope_config)
        return ProcessedPrompt(expanded, audio_feats, pixel_values, grid, items, positions,
                               delta, text)
