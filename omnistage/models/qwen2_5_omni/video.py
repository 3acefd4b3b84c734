"""Qwen2.5-Omni video input: decoding (PyAV), frame sampling, preprocessing to vision patches.

A video is a file (path, bytes, base64 data URL; decoded with PyAV) or a frame array
uint8 [T, H, W, 3] (taken as given, at `fps` frames per second, 2 by default). Every error is
a ValueError that starts with the request part (`where`), as in media.py.

Frame sampling follows Qwen's reference loader (qwen-omni-utils): `fps` frames per second
(2 by default), at least 4 and at most 768 frames, an even count, spread evenly over the video;
the sampled frames' rate sets the seconds per temporal grid step (temporal_patch_size / rate).

NOTE: files are bounded three times, because headers can lie. (1) The container's header:
frame size, duration, frame count, the audio track's rate and channels, and (with `max_tokens`)
the tokens the sampled frames will take, before anything is read. (2) The demuxed packets
(read, not decoded): their count and timestamp span, stopping as soon as either passes the
bound. (3) The decoding pass, which decodes no further than the last sampled frame, converts
only the sampled frames, and holds only those; the audio track is mixed to mono frame by frame
and stops at its bound.

Preprocessing equals transformers' `Qwen2VLVideoProcessor` (torchvision backend on CPU, with
`cap_pixels_per_frame=True`, the reference behaviour): smart_resize to multiples of 28 within
[min_pixels, max_pixels] (max_pixels also capped by an even share of a 128k-token budget),
antialiased bicubic resize of the uint8 frames (the very `interpolate` call torchvision makes on
CPU; torchvision itself is not needed), rescale + normalise fused in float32, the last frame
repeated to an even count, and patches ordered (t, h-merge, w-merge, merge_h, merge_w).
"""

from __future__ import annotations

import bisect
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
    check_audio_format,
    resample,
    sha256_of,
)

DEFAULT_MAX_VIDEO_FRAMES = 768  # frames given to the model (after sampling)
DEFAULT_MAX_VIDEO_SECONDS = 600.0
DEFAULT_VIDEO_FPS = 2.0
# Source frames (before sampling) are all demuxed and, up to the last sampled one, decoded:
# bound them at this rate over the longest allowed video.
MAX_SOURCE_FPS = 240.0
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


def video_token_count(num_frames: int, height: int, width: int, cfg: Qwen2_5OmniVideoConfig
                      ) -> int:
    """Prompt tokens of `num_frames` sampled frames of height x width (known before decoding)."""
    rh, rw = video_target_size(num_frames, height, width, cfg)
    steps = -(-num_frames // cfg.temporal_patch_size)
    return steps * (rh // cfg.patch_size) * (rw // cfg.patch_size) // cfg.merge_size ** 2


def _check_video_tokens(num_frames: int, height: int, width: int, cfg: Qwen2_5OmniVideoConfig,
                        max_tokens: int | None, where: str) -> None:
    if max_tokens is None:
        return
    tokens = video_token_count(num_frames, height, width, cfg)
    if tokens > max_tokens:
        raise ValueError(f"{where}: video would take {tokens} tokens ({num_frames} sampled "
                         f"frames), more than the limit of {max_tokens}")


_PREPROCESS_CHUNK_STEPS = 16  # temporal grid steps preprocessed at a time


def preprocess_video(frames: np.ndarray | torch.Tensor, cfg: Qwen2_5OmniVideoConfig
                     ) -> tuple[torch.Tensor, list[int]]:
    """frames uint8 [T, H, W, 3] -> (pixel_values float32 [t*h*w, 3*tp*p*p], grid [t, h, w]).

    Chunks of temporal steps are resized and normalised straight into the output, so the
    peak memory is the output plus one chunk (each frame is resized on its own either way)."""
    src = torch.as_tensor(frames)
    T, H, W, C = src.shape
    rh, rw = video_target_size(T, H, W, cfg)
    mean = torch.tensor(cfg.image_mean) * (1.0 / cfg.rescale_factor)
    std = torch.tensor(cfg.image_std) * (1.0 / cfg.rescale_factor)
    tp, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    gt, gh, gw = -(-T // tp), rh // p, rw // p
    out = torch.empty(gt, gh * gw, C * tp * p * p, dtype=torch.float32)
    for t0 in range(0, gt, _PREPROCESS_CHUNK_STEPS):
        t1 = min(gt, t0 + _PREPROCESS_CHUNK_STEPS)
        x = src[t0 * tp:t1 * tp].permute(0, 3, 1, 2).contiguous()  # [n, 3, H, W] uint8
        if (rh, rw) != (H, W):
            x = torch.nn.functional.interpolate(x, size=(rh, rw), mode="bicubic",
                                                antialias=True)
        x = x.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
        if x.shape[0] < (t1 - t0) * tp:  # the last frame repeated to a whole temporal step
            x = torch.cat([x, x[-1:].expand((t1 - t0) * tp - x.shape[0], -1, -1, -1)])
        x = x.view(t1 - t0, tp, C, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1,
                                                                          5, 8)
        out[t0:t1] = x.reshape(t1 - t0, gh * gw, C * tp * p * p)
    return out.view(gt * gh * gw, C * tp * p * p), [gt, gh, gw]


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


def _header_seconds(box: Any, stream: Any) -> float:
    """The longest duration the container's header states for `stream` (0 when it has none)."""
    import av

    seconds = [box.duration / av.time_base if box.duration else 0.0]
    if stream.duration and stream.time_base:
        seconds.append(float(stream.duration * stream.time_base))
    return max(seconds)


def _check_audio_header(box: Any, where: str, max_seconds: float) -> Any:
    """The first audio stream, its rate, channels and stated duration bounded; None if none."""
    if not box.streams.audio:
        return None
    stream = box.streams.audio[0]
    ctx = stream.codec_context
    check_audio_format(f"{where} (its audio track)", ctx.sample_rate or 0,
                       ctx.layout.nb_channels, _header_seconds(box, stream), max_seconds)
    return stream


@dataclass(frozen=True)
class _PacketIndex:
    """What the demuxed packets of a video stream say: `pts` the presentation timestamps in
    order (None when some packet has none, or two share one: frames are then found by
    decoding in order), `keyframe_pts` those of keyframes, sorted."""

    total: int
    pts: list[int] | None
    keyframe_pts: list[int]


def _count_frames(box: Any, stream: Any, where: str, max_seconds: float,
                  header_seconds: float) -> _PacketIndex:
    """Frames of `stream`, counted on its demuxed packets (no decoding), stopping as soon as
    their count or timestamp span passes the bound: the header's duration may be a lie."""
    max_count = int(max_seconds * MAX_SOURCE_FPS)
    total, first, last = 0, math.inf, -math.inf
    pts: list[int] | None = []
    keyframe_pts: list[int] = []
    for pkt in box.demux(stream):
        if not pkt.size:
            continue
        total += 1
        if pkt.pts is None:
            pts = None
        elif pts is not None:
            pts.append(pkt.pts)
            if pkt.is_keyframe:
                keyframe_pts.append(pkt.pts)
        if pkt.pts is not None and pkt.time_base:
            t = float(pkt.pts * pkt.time_base)
            first, last = min(first, t), max(last, t)
        if total > max_count:
            raise ValueError(f"{where}: video has more than {max_count} frames, the limit "
                             f"({MAX_SOURCE_FPS:g} per second over {max_seconds:g} s)")
        if last - first > max_seconds:
            raise ValueError(f"{where}: video is longer than the limit of {max_seconds:g} s "
                             f"(its header said {header_seconds:.1f} s)")
    if pts is not None:
        pts.sort()
        if any(a == b for a, b in zip(pts, pts[1:])):
            pts = None
    return _PacketIndex(total, pts, sorted(keyframe_pts))


def _decode_file(raw: bytes, where: str, cfg: Qwen2_5OmniVideoConfig, *, fps: float,
                 max_frames: int, max_seconds: float, max_frame_pixels: int,
                 max_tokens: int | None, with_audio: bool, max_audio_seconds: float
                 ) -> tuple[np.ndarray, float, np.ndarray | None]:
    """(sampled frames uint8 [T, H, W, 3], their rate, audio track float32 16 kHz or None)."""
    try:
        import av
    except ImportError as e:
        raise ValueError(f"{where}: decoding video files needs PyAV (pip install av)") from e

    def sample(total: int, video_fps: float) -> np.ndarray:
        return sample_frame_indices(total, video_fps, fps, cfg.min_frames, max_frames,
                                    cfg.temporal_patch_size)

    try:
        with av.open(io.BytesIO(raw), metadata_errors="ignore") as box:
            if not box.streams.video:
                raise ValueError(f"{where}: the file has no video stream")
            stream = box.streams.video[0]
            w, h = stream.codec_context.width, stream.codec_context.height
            # (1) the header, before anything is read
            _check_frame_size(w, h, where, max_frame_pixels)
            rate = stream.average_rate or stream.guessed_rate
            if not rate or float(rate) <= 0:
                raise ValueError(f"{where}: the video stream has no frame rate")
            video_fps = float(rate)
            stated = _header_seconds(box, stream)
            if stated > max_seconds:
                raise ValueError(f"{where}: video is {stated:.1f} s long, more than the limit "
                                 f"of {max_seconds:g} s")
            if stream.frames > max_seconds * MAX_SOURCE_FPS:
                raise ValueError(f"{where}: video has {stream.frames} frames, more than the "
                                 f"limit of {max_seconds * MAX_SOURCE_FPS:g}")
            stated_frames = stream.frames or round(stated * video_fps)
            if stated_frames:
                _check_video_tokens(len(sample(stated_frames, video_fps)), h, w, cfg,
                                    max_tokens, where)
            if with_audio:
                _check_audio_header(box, where, max_audio_seconds)
            # (2) the demuxed packets, read but not decoded
            packets = _count_frames(box, stream, where, max_seconds, stated)
        total = packets.total
        if total == 0:
            raise ValueError(f"{where}: the video stream has no frames")
        if total / video_fps > max_seconds:
            raise ValueError(f"{where}: video is {total / video_fps:.1f} s long, more than the "
                             f"limit of {max_seconds:g} s")
        idx = sample(total, video_fps)
        _check_video_tokens(len(idx), h, w, cfg, max_tokens, where)
        frames, filled, _ = _decode_sampled(raw, idx, w, h, packets)  # (3) decoding
        audio = _decode_audio(raw, where, max_audio_seconds) if with_audio else None
    except av.FFmpegError as e:
        raise ValueError(f"{where}: cannot decode video: {e}") from e
    if not filled.any():
        raise ValueError(f"{where}: no video frame could be decoded")
    # fewer frames decoded than packets: a missing frame repeats the one before it
    for slot in np.flatnonzero(~filled).tolist():
        earlier = np.flatnonzero(filled[:slot])
        frames[slot] = frames[earlier[-1] if earlier.size else np.flatnonzero(filled)[0]]
    return frames, len(idx) / total * video_fps, audio


def _decode_sampled(raw: bytes, idx: np.ndarray, w: int, h: int, packets: _PacketIndex
                    ) -> tuple[np.ndarray, np.ndarray, int]:
    """(frames at sorted indices `idx` uint8 [len(idx), h, w, 3], which slots were filled,
    frames decoded).

    Only the sampled frames are converted to RGB and held. With timestamps on every packet,
    the decoder seeks to the last keyframe before a sampled frame whenever that skips frames,
    so long gaps between sampled frames are not decoded; otherwise it decodes in order, no
    further than the last index."""
    import av

    frames = np.empty((len(idx), h, w, 3), dtype=np.uint8)
    filled = np.zeros(len(idx), dtype=bool)
    slots: dict[int, list[int]] = {}  # frame index -> output slots
    for slot, i in enumerate(idx.tolist()):
        slots.setdefault(i, []).append(slot)

    def keep(i: int, frame: Any) -> None:
        if i in slots and not filled[slots[i][0]]:
            frames[slots[i]] = frame.to_ndarray(format="rgb24", width=w, height=h)
            filled[slots[i]] = True

    def in_order() -> tuple[np.ndarray, np.ndarray, int]:
        filled[:] = False
        decoded = 0
        with av.open(io.BytesIO(raw), metadata_errors="ignore") as box:
            for i, frame in enumerate(box.decode(box.streams.video[0])):
                decoded += 1
                keep(i, frame)
                if i >= idx[-1]:
                    break
        return frames, filled, decoded

    if packets.pts is None or not packets.keyframe_pts:
        return in_order()
    decoded = 0
    with av.open(io.BytesIO(raw), metadata_errors="ignore") as box:
        stream = box.streams.video[0]
        index_of = {t: i for i, t in enumerate(packets.pts)}
        keys, decoding, last = packets.keyframe_pts, None, -math.inf
        for i in sorted(slots):
            target = packets.pts[i]
            if filled[slots[i][0]]:
                continue
            key = keys[max(0, bisect.bisect_right(keys, target) - 1)]
            seeked = decoding is None or last < key <= target  # the keyframe skips frames
            if seeked:
                box.seek(key, stream=stream, backward=True, any_frame=False)
                decoding, last = box.decode(stream), -math.inf
            for frame in decoding:
                decoded += 1
                if frame.pts is None:
                    continue
                if seeked and last == -math.inf and frame.pts > target:
                    return in_order()  # the seek overshot: this container's index is off
                last = frame.pts
                if frame.pts in index_of:
                    keep(index_of[frame.pts], frame)
                if frame.pts >= target:
                    break
    return frames, filled, decoded


def _decode_audio(raw: bytes, where: str, max_seconds: float) -> np.ndarray | None:
    """The container's first audio track as float32 mono 16 kHz, or None if it has none.

    Its header is bounded first; then each decoded frame is mixed to mono at once, and decoding
    stops as soon as the samples pass `max_seconds` (the header may understate them)."""
    import av

    chunks, n = [], 0
    with av.open(io.BytesIO(raw), metadata_errors="ignore") as box:
        stream = _check_audio_header(box, where, max_seconds)
        if stream is None:
            return None
        sr = stream.codec_context.sample_rate
        to_float = av.AudioResampler(format="fltp")  # any sample format -> planar float32
        for frame in box.decode(stream):
            for f in to_float.resample(frame):
                chunks.append(f.to_ndarray().mean(axis=0))  # [channels, n] -> mono
                n += chunks[-1].shape[0]
            if n > max_seconds * sr:
                raise ValueError(f"{where}: the audio track is longer than the limit of "
                                 f"{max_seconds:g} s (its header said "
                                 f"{_header_seconds(box, stream):.1f} s)")
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
               max_tokens: int | None = None,
               allow_local_paths: bool = True) -> Qwen2_5OmniVideo:
    """Decode and sample a video file, or take a frame array as given (at `fps`, default 2).

    `fps` for files is the sampling rate (default: the config's, 2); `with_audio` also extracts
    the file's audio track (mono, resampled to 16 kHz). Frames are bounded by `max_frames`
    (arrays over it are rejected, files are sampled under it), seconds by `max_seconds`, frame
    size by `max_frame_pixels`, and (when given) the prompt tokens the sampled frames will
    take by `max_tokens`: files are checked on their header and packets before decoding."""
    cfg = cfg or Qwen2_5OmniVideoConfig()
    if fps is not None and (not isinstance(fps, (int, float)) or not 0 < fps <= 1000):
        raise ValueError(f"{where}: fps must be a number in (0, 1000], got {fps!r}")
    raw = None if isinstance(src, (np.ndarray, torch.Tensor, list, tuple)) else \
        _media_bytes(src, where, "video", allow_local_paths)
    audio = None
    if raw is not None:
        frames, rate, audio = _decode_file(
            raw, where, cfg, fps=fps or cfg.fps, max_frames=min(max_frames, cfg.max_frames),
            max_seconds=max_seconds, max_frame_pixels=max_frame_pixels, max_tokens=max_tokens,
            with_audio=with_audio, max_audio_seconds=max_audio_seconds)
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
        _check_video_tokens(frames.shape[0], frames.shape[1], frames.shape[2], cfg, max_tokens,
                            where)
    digest = sha256_of("video", frames.shape, frames.tobytes() + repr(rate).encode())
    if audio is not None:
        digest = sha256_of("video+audio", audio.shape, digest + audio.tobytes())
    return Qwen2_5OmniVideo(frames, rate, audio, digest)
