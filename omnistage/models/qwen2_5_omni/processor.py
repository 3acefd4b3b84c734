"""Qwen2.5-Omni prompt processing: chat messages / raw prompts + media -> thinker inputs.

Equals transformers' `Qwen2_5OmniProcessor` (ids exactly, features to float rounding) for text,
audio, images and video, with or without the video's audio track (`use_audio_in_video`: the
track is extracted, featurised like any audio, and its placeholders are interleaved with the
video's in 2-second chunks). Loads the processor config from either layout: the legacy root
`preprocessor_config.json` (feature extractor + image processor fields merged) or transformers
5's nested `processor_config.json`; video settings from its `video_processor` entry or
`video_preprocessor_config.json`, else Qwen2.5-Omni's video defaults. Uses the PIL image
processor and our own video preprocessing (video.py), so torchvision is not needed.

Audio longer than the feature extractor's window (300 s on the released checkpoint) is
rejected instead of silently truncated as transformers does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch
from transformers import PreTrainedTokenizerBase, WhisperFeatureExtractor

if TYPE_CHECKING:  # (imported where first built: DeferredImageProcessor)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

from omnistage.tokenizer_loader import load_tokenizer
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
    video_audio_layout,
)
from omnistage.models.qwen2_5_omni.video import (
    DEFAULT_MAX_VIDEO_FRAMES,
    DEFAULT_MAX_VIDEO_SECONDS,
    Qwen2_5OmniVideoConfig,
    load_video,
    preprocess_video,
)

QWEN_AUDIO_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
    "perceiving auditory and visual inputs, as well as generating text and speech.")
AUDIO_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN = "<|AUDIO|>", "<|IMAGE|>", "<|VIDEO|>"
PLACEHOLDERS = {"audio": AUDIO_TOKEN, "image": IMAGE_TOKEN, "video": VIDEO_TOKEN}
_PART_TYPES = ("text", "audio", "image", "video")
_URL_PARTS = ("image_url", "audio_url", "video_url")  # OpenAI style: {"type": "image_url", ...}


@dataclass(frozen=True)
class MediaItem:
    """One media input: its placeholder run is input_ids[start : start + length]."""

    kind: str  # "audio" | "image" | "video"
    index: int  # index among the prompt's items of this kind
    start: int
    length: int
    content_hash: bytes  # sha256 of the decoded samples / pixels (prefix-cache key)
    audio_tokens: int = 0  # a video with its audio track: the run interleaves this many


@dataclass
class ProcessedPrompt:
    """Thinker inputs of one prompt.

    audio_features: per audio in prompt order (a video's audio track at its video), float32
    [128, frames] (valid frames only); image_pixel_values / video_pixel_values: float32
    [sum of patches, 3 * 2 * 14 * 14] or None; image_grid_thw / video_grid_thw: int64 [n, 3] or
    None; video_second_per_grid: float32 [n_videos] or None; mrope_positions: int64
    [3, len(input_ids)]; decode positions are `num_tokens + rope_delta` on all three axes.
    """

    input_ids: list[int]
    audio_features: list[torch.Tensor]
    image_pixel_values: torch.Tensor | None
    image_grid_thw: torch.LongTensor | None
    media: list[MediaItem]
    mrope_positions: torch.LongTensor
    rope_delta: int
    prompt_text: str
    video_pixel_values: torch.Tensor | None = None
    video_grid_thw: torch.LongTensor | None = None
    video_second_per_grid: torch.Tensor | None = None
    use_audio_in_video: bool = False
    placeholder_ids: dict[str, int] = field(default_factory=dict)

    @property
    def audio_feature_lengths(self) -> list[int]:
        return [int(f.shape[1]) for f in self.audio_features]

    def media_rows(self) -> dict[str, list[torch.Tensor]]:
        """Prompt indices (int64 [n]) of each item's encoder rows, per kind in feature order:
        "audio" (standalone audio and video audio tracks, in prompt order), "image", "video"."""
        rows: dict[str, list[torch.Tensor]] = {"audio": [], "image": [], "video": []}
        ids = torch.tensor(self.input_ids)
        for m in self.media:
            span = torch.arange(m.start, m.start + m.length)
            if m.audio_tokens:
                is_video = ids[span] == self.placeholder_ids["video"]
                rows["video"].append(span[is_video])
                rows["audio"].append(span[~is_video])
            else:
                rows[m.kind].append(span)
        return rows


@dataclass(frozen=True)
class _Video:
    """One preprocessed video: pixel_values float32 [patches, 1176], grid [t, h, w]."""

    pixel_values: torch.Tensor
    grid: list[int]
    second_per_grid: float
    content_hash: bytes
    audio_features: torch.Tensor | None  # its audio track's [128, frames], when used


def read_json_file(path: Path) -> dict[str, Any]:
    """A JSON file's contents; ValueError naming the file when it is not valid JSON."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from e


def processor_dicts(root: Path) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """(feature extractor dict, image processor dict, whether that dict is the legacy merged
    one: DeferredImageProcessor keeps only the image processor's fields) from either processor
    config layout."""
    nested = root / "processor_config.json"
    if nested.is_file():
        cfg = read_json_file(nested)
        if "feature_extractor" in cfg and "image_processor" in cfg:
            return cfg["feature_extractor"], cfg["image_processor"], False
    legacy = root / "preprocessor_config.json"
    if legacy.is_file():
        # one dict holds both processors' fields: give each processor its own
        cfg = read_json_file(legacy)
        fe_keys = set(WhisperFeatureExtractor().to_dict())
        return {k: v for k, v in cfg.items() if k in fe_keys}, cfg, True
    raise ValueError(f"{root}: no processor config (preprocessor_config.json or "
                     "processor_config.json with feature_extractor and image_processor)")


@dataclass
class DeferredImageProcessor:
    """The checkpoint's image processor, built on first use.

    NOTE (why deferred): transformers' image processor module imports its modeling stack
    (modeling_utils, DTensor, ...): 2-9 s of a server's start-up, for a processor that only
    requests with images or video need."""

    config: dict[str, Any]
    merged: bool  # the legacy preprocessor_config.json: keep the image processor's fields
    _built: Any = None

    def get(self) -> Qwen2VLImageProcessorPil:
        # (no lock: two preparation threads racing on the first image both build an equal
        # processor, and the last assignment wins)
        if self._built is None:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
                Qwen2VLImageProcessorPil,
            )
            cfg = self.config
            if self.merged:
                keys = set(Qwen2VLImageProcessorPil().to_dict()) | {"min_pixels", "max_pixels"}
                cfg = {k: v for k, v in cfg.items() if k in keys}
            self._built = Qwen2VLImageProcessorPil.from_dict(cfg)
        return self._built


def video_processor_dict(root: Path) -> dict[str, Any]:
    """The saved video processor settings, or {} (the family's defaults apply)."""
    nested = root / "processor_config.json"
    if nested.is_file() and isinstance(read_json_file(nested).get("video_processor"), dict):
        return read_json_file(nested)["video_processor"]
    if (root / "video_preprocessor_config.json").is_file():
        return read_json_file(root / "video_preprocessor_config.json")
    return {}


def load_chat_template(root: Path, tok: PreTrainedTokenizerBase) -> str:
    """The tokenizer's chat template, else the checkpoint's chat_template.jinja / .json."""
    if tok.chat_template:
        return tok.chat_template
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text()
    if (root / "chat_template.json").is_file():
        return read_json_file(root / "chat_template.json")["chat_template"]
    raise ValueError(f"{root}: checkpoint has no chat template")


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


@dataclass
class _LoadedMedia:
    """A prompt's media after decoding, before the placeholders are expanded."""

    audios: list[tuple[torch.Tensor, bytes]]  # per audio: features [n_mels, frames], hash
    image_pixels: torch.Tensor | None  # [patches, patch_dim]
    image_grid: torch.LongTensor | None  # [n_images, 3]
    image_hashes: list[bytes]
    videos: list[tuple[str, _Video]]  # per video: (where, preprocessed video)


class Qwen2_5OmniInputProcessor:
    """Turns chat messages or raw prompts with media into `ProcessedPrompt`s.

    Stateless after construction (safe to share between threads that do not mutate it).
    A family with the same prompt layout subclasses it: the class attributes below, and the
    hooks `_video_config_from`, `_audio_features`, `_audio_pads`, `_video_with_audio_run`.
    """

    family = "Qwen2.5-Omni"  # named in checkpoint errors
    placeholders = PLACEHOLDERS  # kind -> the placeholder token a prompt holds per item
    rope_config_class: Any = Qwen2_5OmniRopeConfig
    audio_system_prompt: str | None = QWEN_AUDIO_SYSTEM_PROMPT  # None: never added
    # how a video used with its audio track must sit in the prompt (error message)
    video_with_audio_wrapping = f"<|vision_bos|>{VIDEO_TOKEN}<|vision_eos|>"
    # (expanded ids, image grid, audio frames, rope config, video grid, seconds per grid,
    # use_audio_in_video) -> (3-axis positions [3, T], decode rope delta)
    mrope_positions = staticmethod(mrope_positions)

    def __init__(self, tokenizer: PreTrainedTokenizerBase,
                 feature_extractor: WhisperFeatureExtractor,
                 image_processor: Qwen2VLImageProcessorPil | DeferredImageProcessor,
                 chat_template: str,
                 rope_config: Qwen2_5OmniRopeConfig, *,
                 max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
                 max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 video_config: Qwen2_5OmniVideoConfig | None = None,
                 max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES,
                 max_video_seconds: float = DEFAULT_MAX_VIDEO_SECONDS,
                 allow_local_paths: bool = True) -> None:
        self.tokenizer = tokenizer
        self.feature_extractor = feature_extractor
        self._image_processor = image_processor
        self.chat_template = chat_template
        self.rope_config = rope_config
        window = feature_extractor.n_samples / feature_extractor.sampling_rate
        self.max_audio_seconds = min(max_audio_seconds, window)
        self.max_image_pixels = max_image_pixels
        self.video_config = video_config or Qwen2_5OmniVideoConfig()
        self.max_video_frames = max_video_frames
        self.max_video_seconds = max_video_seconds
        self.allow_local_paths = allow_local_paths
        self.token_ids = {kind: tokenizer.convert_tokens_to_ids(tok)
                          for kind, tok in self.placeholders.items()}

    @property
    def image_processor(self) -> Qwen2VLImageProcessorPil:
        ip = self._image_processor
        return ip.get() if isinstance(ip, DeferredImageProcessor) else ip

    @classmethod
    def from_pretrained(cls, path: str | Path, **limits: Any) -> Self:
        """Load from a checkpoint directory of this family (root preprocessor_config.json as
        released, or transformers 5's nested processor_config.json)."""
        root = Path(path)
        if not (root / "config.json").is_file():
            raise ValueError(f"{root}: not a checkpoint directory (no config.json)")
        thinker = read_json_file(root / "config.json").get("thinker_config")
        if not thinker:
            raise ValueError(f"{root}/config.json: no thinker_config (not {cls.family}?)")
        tok = load_tokenizer(root)  # AutoTokenizer's choice, without importing it
        fe_dict, ip_dict, merged = processor_dicts(root)
        fe = WhisperFeatureExtractor.from_dict(fe_dict)
        ip = DeferredImageProcessor(ip_dict, merged)
        rope = cls.rope_config_class.from_thinker_config(thinker)
        limits.setdefault("video_config",
                          cls._video_config_from(ip_dict, video_processor_dict(root)))
        return cls(tok, fe, ip, load_chat_template(root, tok), rope, **limits)

    @classmethod
    def _video_config_from(cls, image_processor: dict[str, Any], saved_video: dict[str, Any]
                           ) -> Qwen2_5OmniVideoConfig:
        """Video settings from the checkpoint's saved video processor ({}: the defaults)."""
        return Qwen2_5OmniVideoConfig.from_dict(saved_video)

    # ------------------------------------------------------------------------------ public

    def process(self, messages: list[dict], *, add_audio_system_prompt: bool = False,
                max_prompt_tokens: int | None = None,
                use_audio_in_video: bool = False) -> ProcessedPrompt:
        """Render chat `messages` (Qwen's convention) with the chat template and expand media.

        A video part is {"type": "video", "video": path | bytes | data URL | uint8 [T, H, W, 3]
        frames | list of PIL images, "fps": optional}; with `use_audio_in_video`, each video
        file's audio track (if it has one) is used too."""
        rendered, media = self._parse_messages(messages)
        if add_audio_system_prompt and self.audio_system_prompt is not None \
                and not any(m["role"] == "system" for m in rendered):
            rendered.insert(0, {"role": "system", "content": self.audio_system_prompt})
        text = self.tokenizer.apply_chat_template(
            rendered, chat_template=self.chat_template, tokenize=False,
            add_generation_prompt=True)
        return self._build(text, media, "messages", max_prompt_tokens, use_audio_in_video)

    def process_prompt(self, prompt: str, multi_modal_data: dict | None = None, *,
                       max_prompt_tokens: int | None = None,
                       use_audio_in_video: bool = False) -> ProcessedPrompt:
        """Raw prompt that already holds `<|AUDIO|>` / `<|IMAGE|>` / `<|VIDEO|>` placeholders
        (one per item, wrapped as `<|audio_bos|><|AUDIO|><|audio_eos|>` /
        `<|vision_bos|><|IMAGE|><|vision_eos|>`); they are expanded here. A video item may be
        `(source, fps)`."""
        if not isinstance(prompt, str):
            raise ValueError(f"prompt: must be a string, got {type(prompt).__name__}")
        data = multi_modal_data or {}
        if not isinstance(data, dict):
            raise ValueError("multi_modal_data: must be a dict")
        media: list[tuple[str, str, Any]] = []
        for key, value in data.items():
            if key not in self.placeholders:
                raise ValueError(f"multi_modal_data.{key}: unknown modality "
                                 "(expected 'audio', 'image' or 'video')")
            media += [(key, f"multi_modal_data.{key}[{i}]", v)
                      for i, v in enumerate(_as_list(value))]
        return self._build(prompt, media, "prompt", max_prompt_tokens, use_audio_in_video)

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
                    if kind == "video" and part.get("fps") is not None:
                        value = (value, part["fps"])
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
        if kind in _URL_PARTS:
            ref = part.get(kind)
            url = ref.get("url") if isinstance(ref, dict) else ref
            return kind.removesuffix("_url"), url
        if kind not in _PART_TYPES:
            raise ValueError(f"{where}.type: unknown part type {kind!r} "
                             f"(expected one of {', '.join(_PART_TYPES)})")
        if kind not in part:
            raise ValueError(f"{where}.{kind}: missing")
        if kind == "text" and not isinstance(part["text"], str):
            raise ValueError(f"{where}.text: must be a string")
        return kind, part[kind]

    def _check_text(self, text: str, where: str) -> None:
        for tok in self.placeholders.values():
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

    def _load_video(self, src: Any, where: str, with_audio: bool) -> _Video:
        fps = None
        if isinstance(src, tuple) and len(src) == 2 and isinstance(src[1], (int, float)):
            src, fps = src
        video = load_video(src, where, self.video_config, fps=fps, with_audio=with_audio,
                           max_frames=self.max_video_frames, max_seconds=self.max_video_seconds,
                           max_frame_pixels=self.max_image_pixels,
                           max_audio_seconds=self.max_audio_seconds,
                           allow_local_paths=self.allow_local_paths)
        pixels, grid = preprocess_video(video.frames, self.video_config)
        feats = None if video.audio is None else \
            self._audio_features(video.audio, f"{where} (its audio track)")
        spg = video.second_per_grid(self.video_config.temporal_patch_size)
        return _Video(pixels, grid, spg, video.content_hash, feats)

    # ------------------------------------------------------------------ family hooks

    def _audio_pads(self, feats: torch.Tensor) -> int:
        """Placeholders of an audio with features [n_mels, frames]."""
        return audio_tokens_for_frames(int(feats.shape[1]))

    def _video_with_audio_run(self, grid: list[int], second_per_grid: float, n_audio: int
                              ) -> list[int]:
        """Pad ids of a video with its audio track: video and audio pads in 2-second chunks."""
        runs = video_audio_layout(grid, second_per_grid, n_audio, self.rope_config)
        video, audio = self.token_ids["video"], self.token_ids["audio"]
        return [video if is_video else audio for is_video, n in runs for _ in range(n)]

    # ------------------------------------------------------------ prompt assembly

    def _build(self, text: str, media: list[tuple[str, str, Any]], field: str,
               max_prompt_tokens: int | None, use_audio_in_video: bool = False
               ) -> ProcessedPrompt:
        ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        self._check_placeholders(ids, media, field)  # before any decoding work
        loaded = self._load_media(media, use_audio_in_video)
        expanded, items, audio_feats = self._expand(ids, loaded)
        if max_prompt_tokens is not None and len(expanded) > max_prompt_tokens:
            raise ValueError(f"{field}: prompt is {len(expanded)} tokens (with media), more than "
                             f"max_prompt_tokens={max_prompt_tokens}")
        vids = [v for _, v in loaded.videos]
        video_pixels = torch.cat([v.pixel_values for v in vids]) if vids else None
        video_grid = torch.tensor([v.grid for v in vids], dtype=torch.long) if vids else None
        spg = torch.tensor([v.second_per_grid for v in vids]) if vids else None
        positions, delta = self.mrope_positions(
            expanded, loaded.image_grid, [f.shape[1] for f in audio_feats], self.rope_config,
            video_grid_thw=video_grid, second_per_grid=spg, use_audio_in_video=use_audio_in_video)
        return ProcessedPrompt(expanded, audio_feats, loaded.image_pixels, loaded.image_grid,
                               items, positions, delta, text, video_pixels, video_grid, spg,
                               use_audio_in_video, dict(self.token_ids))

    def _check_placeholders(self, ids: list[int], media: list[tuple[str, str, Any]],
                            field: str) -> None:
        """One placeholder per media item of each kind."""
        for kind, token in self.placeholders.items():
            wheres = [w for k, w, _ in media if k == kind]
            found = sum(1 for t in ids if t == self.token_ids[kind])
            if found < len(wheres):
                raise ValueError(f"{wheres[found]}: the prompt has no {token} placeholder for "
                                 f"this {kind} ({found} placeholders for {len(wheres)} items)")
            if found > len(wheres):
                raise ValueError(f"{field}: the prompt has {found} {token} placeholders but "
                                 f"{len(wheres)} {kind} items were given")

    def _load_media(self, media: list[tuple[str, str, Any]], use_audio_in_video: bool
                    ) -> _LoadedMedia:
        """Decode and featurise every item (images through the image processor together)."""
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
        return _LoadedMedia(audios, pixel_values, grid, image_hashes, videos)

    def _expand(self, ids: list[int], loaded: _LoadedMedia
                ) -> tuple[list[int], list[MediaItem], list[torch.Tensor]]:
        """Each placeholder -> its run of pads: (expanded ids, media items, audio features in
        prompt order, video audio tracks included)."""
        # (the image processor only where there are images: it is built on first use)
        image_merge = self.image_processor.merge_size if loaded.image_grid is not None else 1
        video_merge = self.video_config.merge_size
        cfg = self.rope_config
        expanded: list[int] = []
        items: list[MediaItem] = []
        audio_feats: list[torch.Tensor] = []
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
                feats, digest = loaded.audios[k]
                audio_feats.append(feats)
                n = self._audio_pads(feats)
                items.append(MediaItem(kind, k, len(expanded), n, digest))
                expanded += [t] * n
            elif kind == "image":
                n = int(loaded.image_grid[k].prod()) // image_merge**2
                items.append(MediaItem(kind, k, len(expanded), n, loaded.image_hashes[k]))
                expanded += [t] * n
            else:
                where, v = loaded.videos[k]
                if v.audio_features is None:
                    n = math.prod(v.grid) // video_merge**2
                    items.append(MediaItem(kind, k, len(expanded), n, v.content_hash))
                    expanded += [t] * n
                    continue
                self._check_video_wrapping(ids, pos, where)
                n_audio = self._audio_pads(v.audio_features)
                run = self._video_with_audio_run(v.grid, v.second_per_grid, n_audio)
                expanded.append(cfg.audio_start_token_id)
                items.append(MediaItem(kind, k, len(expanded), len(run), v.content_hash,
                                       audio_tokens=n_audio))
                expanded += run + [cfg.audio_end_token_id]
                audio_feats.append(v.audio_features)
        return expanded, items, audio_feats

    def _check_video_wrapping(self, ids: list[int], pos: int, where: str) -> None:
        # the interleaved layout (and its positions) needs the video wrapped in vision start/end
        cfg = self.rope_config
        if not (0 < pos < len(ids) - 1 and ids[pos - 1] == cfg.vision_start_token_id
                and ids[pos + 1] == cfg.vision_end_token_id):
            raise ValueError(f"{where}: a video used with its audio must be placed as "
                             f"{self.video_with_audio_wrapping} in the prompt")
