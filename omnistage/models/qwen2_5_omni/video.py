"""Qwen2.5-Omni video input: decoding (PyAV), frame sampling, preprocessing to vision patches.

A video is a file (path, bytes, base64 data URL; decoded with PyAV) or a frame array
uint8 [T, H, W, 3] (taken as given, at `fps` frames per second, 2 by default). Every error is
a ValueError that starts with the request part (`where`), as in media.py.

Frame sampling follows Qwen's reference loader (qwen-omni-utils): `fps` frames per second
(2 by default), at least 4 and at most 768 frames, an even count, spread evenly over the video;
the sampled frames' rate sets the seconds per temporal grid step (temporal_patch_size / rate).

Preprocessing equals transformers' `Qwen2VLVideoProcessor` (torchvision backend on CPU, with
`cap_pixels_per_frame=True`, the reference behaviour): smart_resize to multiples of 28 within
[min_pixels, max_pixels] (max_pixels also capped by an even share of a 128k-token budget),
antialiased bicubic resize of the uint8 frames (the very `interpolate` call torchvision makes on
CPU; torchvision itself is not needed), rescale + normalise fused in float32, the last frame
repeated to an even count, and patches ordered (t, h-merge, w-merge, merge_h, merge_w).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from omnistage.models.qwen2_5_omni.media import (
    DEFAULT_MAX_IMAGE_PIXELS,
    MAX_IMAGE_ASPECT_RATIO,
    SAMPLE_RATE,
    _media_bytes,
    resample,
    sha256_of,
)

DEFAULT_MAX_VIDEO_FRAMES = 768  # frames given to the model (after sampling)
DEFAULT_MAX_VIDEO_SECONDS = 600.0
DEFAULT_VIDEO_FPS = 2.0
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class Qwen2_5OmniVideoConfig:
    """Video preprocessing settings (transformers' Qwen2VLVideoProcessor fields + Qwen's
    sampling defaults)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD
    rescale_factor: float = 1 / 255
    fps: float = DEFAULT_VIDEO_FPS
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = True
    max_video_tokens: int = 128000

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Qwen2_5OmniVideoConfig:
        """From a saved video processor dict (`size` {shortest_edge, longest_edge} or
        min_pixels / max_pixels); missing fields keep Qwen2.5-Omni's video defaults."""
        d = dict(d or {})
        size = d.get("size") or {}
        kw: dict[str, Any] = {k: d[k] for k in ("patch_size", "temporal_patch_size",
                                                 "merge_size", "rescale_factor", "fps",
                                                 "min_frames", "max_frames", "max_video_tokens")
                              if d.get(k) is not None}
        kw["min_pixels"] = int(d.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels)
        kw["max_pixels"] = int(d.get("max_pixels") or size.get("longest_edge") or cls.max_pixels)
        for k in ("image_mean", "image_std"):
            if d.get(k) is not None:
                kw[k] = tuple(float(x) for x in d[k])
        if d.get("cap_pixels_per_frame") is not None:
            kw["cap_pixels_per_frame"] = bool(d["cap_pixels_per_frame"])
        return cls(**kw)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class Qwen2_5OmniVideo:
    """A decoded video: `frames` uint8 [T, H, W, 3] (sampled), shown at `fps` frames per second;
    `audio` float32 [n] mono 16 kHz (its audio track, when asked for and present);
    `content_hash` sha256 of frames, fps and audio (prefix-cache key)."""

    frames: np.ndarray
    fps: float
    audio: np.ndarray | None
    content_hash: bytes

    def second_per_grid(self, temporal_patch_size: int) -> float:
        return temporal_patch_size / self.fps


# ------------------------------------------------------------------------------- sampling


def sample_frame_indices(total: int, video_fps: float, fps: float = DEFAULT_VIDEO_FPS,
                         min_frames: int = 4, max_frames: int = 768, factor: int = 2
                         ) -> np.ndarray:
    """Indices of the frames to keep out of `total` frames at `video_fps` (Qwen's rule)."""
    if total < factor:
        return np.arange(total)
    lo = math.ceil(min_frames / factor) * factor
    hi = math.floor(min(max_frames, total) / factor) * factor
    n = min(max(total / video_fps * fps, lo), hi, total)
    n = max(factor, math.floor(n / factor) * factor)
    # float32 linspace rounded half to even, as the reference computes it
    return torch.linspace(0, total - 1, n).round().long().numpy()


# ------------------------------------------------------------------------------- preprocessing


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int
                 ) -> tuple[int, int]:
    """Qwen2-VL's target size: multiples of `factor`, area within [min, max], aspect kept."""
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


def video_target_size(num_frames: int, height: int, width: int, cfg: Qwen2_5OmniVideoConfig
                      ) -> tuple[int, int]:
    max_pixels = cfg.max_pixels
    if cfg.cap_pixels_per_frame:  # an even share of the whole video's pixel budget
        budget = int(cfg.max_video_tokens * cfg.factor * cfg.factor * 0.9)
        max_pixels = max(min(max_pixels, budget * cfg.temporal_patch_size // num_frames),
                         int(cfg.min_pixels * 1.05))
    return smart_resize(height, width, cfg.factor, cfg.min_pixels, max_pixels)


def preprocess_video(frames: np.ndarray | torch.Tensor, cfg: Qwen2_5OmniVideoConfig
                     ) -> tuple[torch.Tensor, list[int]]:
    """frames uint8 [T, H, W, 3] -> (pixel_values float32 [t*h*w, 3*tp*p*p], grid [t, h, w])."""
    x = torch.as_tensor(frames).permute(0, 3, 1, 2).contiguous()  # [T, 3, H, W] uint8
    T, C, H, W = x.shape
    rh, rw = video_target_size(T, H, W, cfg)
    if (rh, rw) != (H, W):
        x = torch.nn.functional.interpolate(x, size=(rh, rw), mode="bicubic", antialias=True)
    mean = torch.tensor(cfg.image_mean) * (1.0 / cfg.rescale_factor)
    std = torch.tensor(cfg.image_std) * (1.0 / cfg.rescale_factor)
    x = x.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    tp, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    if T % tp:
        x = torch.cat([x, x[-1:].expand(tp - T % tp, -1, -1, -1)])
    gt, gh, gw = x.shape[0] // tp, rh // p, rw // p
    x = x.view(gt, tp, C, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, C * tp * p * p), [gt, gh, gw]


# ------------------------------------------------------------------------------- loading


def _check_frame_size(w: int, h: int, where: str, max_frame_pixels: int) -> None:
    if w < 1 or h < 1:
        raise ValueError(f"{where}: video frames have an empty size {w}x{h}")
    if w * h > max_frame_pixels:
        raise ValueError(f"{where}: video frames are {w}x{h} = {w * h} pixels, more than the "
                         f"limit of {max_frame_pixels}")
    if max(w, h) / min(w, h) > MAX_IMAGE_ASPECT_RATIO:
        raise ValueError(f"{where}: video aspect ratio {w}x{h} exceeds "
                         f"{MAX_IMAGE_ASPECT_RATIO}:1")


def _frames_from_array(src: Any, where: str) -> np.ndarray:
    if isinstance(src, (list, tuple)) and src and all(isinstance(f, Image.Image) for f in src):
        if len({f.size for f in src}) != 1:
            raise ValueError(f"{where}: video frames must all have the same size")
        src = np.stack([np.asarray(f.convert("RGB")) for f in src])
    if isinstance(src, torch.Tensor):
        src = src.detach().cpu().numpy()
    if not isinstance(src, np.ndarray):
        raise ValueError(f"{where}: video must be a path, bytes, a uint8 frame array "
                         f"[T, H, W, 3] or a list of PIL images, got {type(src).__name__}")
    if src.ndim != 4 or src.shape[-1] != 3:
        raise ValueError(f"{where}: video frame array must be [T, H, W, 3], got shape "
                         f"{tuple(src.shape)}")
    if src.dtype != np.uint8:
        raise ValueError(f"{where}: video frame array must be uint8, got {src.dtype}")
    return np.ascontiguousarray(src)


def _decode_file(raw: bytes, where: str, *, fps: float, max_frames: int, min_frames: int,
                 factor: int, max_seconds: float, max_frame_pixels: int, with_audio: bool,
                 max_audio_seconds: float) -> tuple[np.ndarray, float, np.ndarray | None]:
    """(sampled frames uint8 [T, H, W, 3], their rate, audio track float32 16 kHz or None)."""
    try:
        import av
    except ImportError as e:
        raise ValueError(f"{where}: decoding video files needs PyAV (pip install av)") from e
    try:
        with av.open(io.BytesIO(raw), metadata_errors="ignore") as box:
            if not box.streams.video:
                raise ValueError(f"{where}: the file has no video stream")
            stream = box.streams.video[0]
            w, h = stream.codec_context.width, stream.codec_context.height
            _check_frame_size(w, h, where, max_frame_pixels)  # header only, before decoding
            rate = stream.average_rate or stream.guessed_rate
            if not rate or float(rate) <= 0:
                raise ValueError(f"{where}: the video stream has no frame rate")
            total = sum(1 for pkt in box.demux(stream) if pkt.size)  # counting needs no decoding
        if total == 0:
            raise ValueError(f"{where}: the video stream has no frames")
        video_fps = float(rate)
        if total / video_fps > max_seconds:
            raise ValueError(f"{where}: video is {total / video_fps:.1f} s long, more than the "
                             f"limit of {max_seconds:g} s")
        idx = sample_frame_indices(total, video_fps, fps, min_frames, max_frames, factor)
        frames = np.empty((len(idx), h, w, 3), dtype=np.uint8)
        slots = {}
        for slot, i in enumerate(idx.tolist()):
            slots.setdefault(i, []).append(slot)
        got = 0
        with av.open(io.BytesIO(raw), metadata_errors="ignore") as box:
            for i, frame in enumerate(box.decode(box.streams.video[0])):
                if i in slots:
                    frames[slots[i]] = frame.to_ndarray(format="rgb24", width=w, height=h)
                    got = i + 1
                if i >= idx[-1]:
                    break
        audio = _decode_audio(raw, where, max_audio_seconds) if with_audio else None
    except av.FFmpegError as e:
        raise ValueError(f"{where}: cannot decode video: {e}") from e
    if got == 0:
        raise ValueError(f"{where}: no video frame could be decoded")
    missing = idx >= got  # fewer frames decoded than packets: repeat the last decoded frame
    if missing.any():
        frames[missing] = frames[int(np.flatnonzero(~missing)[-1])]
    return frames, len(idx) / total * video_fps, audio


def _decode_audio(raw: bytes, where: str, max_seconds: float) -> np.ndarray | None:
    """The container's first audio track as float32 mono 16 kHz, or None if it has none."""
    import av

    chunks, n = [], 0
    with av.open(io.BytesIO(raw), metadata_errors="ignore") as box:
        if not box.streams.audio:
            return None
        stream = box.streams.audio[0]
        sr = stream.codec_context.sample_rate
        if not sr:
            raise ValueError(f"{where}: the audio track has no sample rate")
        to_float = av.AudioResampler(format="fltp")  # any sample format -> planar float32
        for frame in box.decode(stream):
            for f in to_float.resample(frame):
                chunks.append(f.to_ndarray().mean(axis=0))  # [channels, n] -> mono
                n += chunks[-1].shape[0]
            if n > max_seconds * sr:
                raise ValueError(f"{where}: the audio track is longer than the limit of "
                                 f"{max_seconds:g} s")
    if n == 0:
        return None
    x = np.concatenate(chunks).astype(np.float32)
    if not np.isfinite(x).all():
        raise ValueError(f"{where}: the audio track contains NaN or infinite samples")
    return resample(x, sr, SAMPLE_RATE) if sr != SAMPLE_RATE else x


def load_video(src: Any, where: str, cfg: Qwen2_5OmniVideoConfig | None = None, *,
               fps: float | None = None, with_audio: bool = False,
               max_frames: int = DEFAULT_MAX_VIDEO_FRAMES,
               max_seconds: float = DEFAULT_MAX_VIDEO_SECONDS,
               max_frame_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
               max_audio_seconds: float = 300.0,
               allow_local_paths: bool = True) -> Qwen2_5OmniVideo:
    """Decode and sample a video file, or take a frame array as given (at `fps`, default 2).

    `fps` for files is the sampling rate (default: the config's, 2); `with_audio` also extracts
    the file's audio track (mono, resampled to 16 kHz). Frames are bounded by `max_frames`
    (arrays over it are rejected, files are sampled under it), seconds by `max_seconds`, frame
    size by `max_frame_pixels`."""
    cfg = cfg or Qwen2_5OmniVideoConfig()
    if fps is not None and (not isinstance(fps, (int, float)) or not 0 < fps <= 1000):
        raise ValueError(f"{where}: fps must be a number in (0, 1000], got {fps!r}")
    raw = None if isinstance(src, (np.ndarray, torch.Tensor, list, tuple)) else \
        _media_bytes(src, where, "video", allow_local_paths)
    audio = None
    if raw is not None:
        frames, rate, audio = _decode_file(
            raw, where, fps=fps or cfg.fps, max_frames=min(max_frames, cfg.max_frames),
            min_frames=cfg.min_frames, factor=cfg.temporal_patch_size, max_seconds=max_seconds,
            max_frame_pixels=max_frame_pixels, with_audio=with_audio,
            max_audio_seconds=max_audio_seconds)
    else:
        frames, rate = _frames_from_array(src, where), float(fps or cfg.fps)
        if frames.shape[0] == 0:
            raise ValueError(f"{where}: video has no frames")
        if frames.shape[0] > max_frames:
            raise ValueError(f"{where}: video has {frames.shape[0]} frames, more than the limit "
                             f"of {max_frames}")
        if frames.shape[0] / rate > max_seconds:
            raise ValueError(f"{where}: video is {frames.shape[0] / rate:.1f} s long, more "
                             f"than the limit of {max_seconds:g} s")
        _check_frame_size(frames.shape[2], frames.shape[1], where, max_frame_pixels)
    digest = sha256_of("video", frames.shape, frames.tobytes() + repr(rate).encode())
    if audio is not None:
        digest = sha256_of("video+audio", audio.shape, digest + audio.tobytes())
    return Qwen2_5OmniVideo(frames, rate, audio, digest)
