"""Media loading for Qwen2.5-Omni requests: audio (16 kHz mono float32) and images (RGB PIL).

Every error is a ValueError that starts with the name of the request part (`where`), e.g.
"messages[0].content[1].image: cannot decode image: ...".

NOTE: media are bounded before they are decoded, and again while they are decoded, because
headers can lie: image dimensions are read from the header first; audio files are checked on
their header (sample rate, channels, duration) and then decoded in blocks mixed to mono at once,
stopping as soon as the decoded samples pass the duration limit, so no more than the bound (plus
one block) is ever held. The sample rate is bounded so that resampling stays cheap.

Resampling is our own polyphase windowed-sinc filter (Kaiser window, 32 zero crossings on each
side, cutoff at 0.945 x the lower Nyquist, ~85 dB stopband), run as one strided `conv1d` per
call in float64; scipy is not needed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile
import torch
from PIL import Image

SAMPLE_RATE = 16000
DEFAULT_MAX_AUDIO_SECONDS = 300.0
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
MAX_IMAGE_ASPECT_RATIO = 200  # Qwen2-VL's smart_resize rejects more extreme shapes
MAX_AUDIO_CHANNELS = 16
MIN_AUDIO_SAMPLE_RATE = 1000
MAX_AUDIO_SAMPLE_RATE = 192000
# Resampling uses one [phases, taps] float64 kernel: rates whose ratio to 16 kHz reduces to a
# large fraction (e.g. 44101 Hz: 16000 phases x 44k taps = 5.7 GB) are rejected above this size.
_MAX_RESAMPLE_KERNEL = 1 << 22  # float64 elements (32 MiB)
_AUDIO_BLOCK_FRAMES = 1 << 16  # frames decoded at a time

# Exceptions PIL raises on corrupt, truncated or unknown data (it has no single base class).
_PIL_DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error, IndexError,
                      Image.DecompressionBombError)


@dataclass(frozen=True)
class Qwen2_5OmniAudio:
    """Decoded audio: `samples` float32 [n] mono at 16 kHz; `content_hash` sha256 of them."""

    samples: np.ndarray
    content_hash: bytes


@dataclass(frozen=True)
class Qwen2_5OmniImage:
    """Decoded image: RGB PIL image; `content_hash` sha256 of its size and pixels."""

    image: Image.Image
    content_hash: bytes


def _media_bytes(src: Any, where: str, kind: str, allow_local_paths: bool) -> bytes | None:
    """Raw bytes of a path / data URL / bytes source; None when `src` is not one of those."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        return bytes(src)
    if isinstance(src, str) and src.startswith("data:"):
        header, sep, payload = src.partition(",")
        if not sep or ";base64" not in header:
            raise ValueError(f"{where}: data URL must be base64 encoded")
        try:
            return base64.b64decode(payload, validate=True)
        except binascii.Error as e:
            raise ValueError(f"{where}: invalid base64 in data URL: {e}") from e
    if isinstance(src, (str, Path)):
        text = str(src)
        if text.startswith(("http://", "https://")):
            raise ValueError(f"{where}: URLs are not fetched here; pass bytes or a local path")
        if not allow_local_paths:
            raise ValueError(f"{where}: local file paths are not allowed")
        path = Path(text.removeprefix("file://"))
        if not path.is_file():
            raise ValueError(f"{where}: {kind} file not found: {text}")
        return path.read_bytes()
    return None


def sha256_of(kind: str, shape: tuple[int, ...], data: bytes) -> bytes:
    h = hashlib.sha256(kind.encode())
    h.update(repr(shape).encode())
    h.update(data)
    return h.digest()


# ------------------------------------------------------------------------------------- audio


def _kaiser(x: np.ndarray, beta: float) -> np.ndarray:
    # Kaiser window on x in [-1, 1]
    return np.i0(beta * np.sqrt(np.clip(1.0 - x * x, 0.0, None))) / np.i0(beta)


def _resample_plan(orig_sr: int, new_sr: int, zero_crossings: int, rolloff: float
                   ) -> tuple[int, int, float, float, int]:
    # (a, b, cutoff in cycles per input sample, kernel half width, padding): see resample
    g = math.gcd(orig_sr, new_sr)
    a, b = orig_sr // g, new_sr // g
    fc = 0.5 * min(1.0, b / a) * rolloff
    half = zero_crossings / (2.0 * fc)
    return a, b, fc, half, int(math.ceil(half))


def resample_kernel_elements(orig_sr: int, new_sr: int, zero_crossings: int = 32,
                             rolloff: float = 0.945) -> int:
    """Elements of the float64 kernel that `resample(x, orig_sr, new_sr)` builds."""
    a, b, _, _, pad = _resample_plan(orig_sr, new_sr, zero_crossings, rolloff)
    return b * (2 * pad + a + 1)


def resample(samples: np.ndarray, orig_sr: int, new_sr: int, zero_crossings: int = 32,
             rolloff: float = 0.945, beta: float = 8.6) -> np.ndarray:
    """Band-limited resampling of a 1-D signal: float32 [n] -> float32 [ceil(n * new / orig)].

    NOTE: polyphase form. With g = gcd, a = orig/g, b = new/g, output j sits at input time
    j * a / b; phase p = j % b always falls at fractional offset p * a / b from a multiple of a,
    so each phase is a fixed FIR kernel applied with stride a: one conv1d with b output channels.
    """
    if orig_sr <= 0 or new_sr <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_sr} -> {new_sr}")
    x = np.asarray(samples, dtype=np.float64)
    if orig_sr == new_sr or x.size == 0:
        return x.astype(np.float32)
    # fc: cutoff in cycles per input sample; half: half width of the kernel, in input samples
    a, b, fc, half, pad = _resample_plan(orig_sr, new_sr, zero_crossings, rolloff)
    taps = np.arange(2 * pad + a + 1, dtype=np.float64)  # covers every phase's support
    t = taps[None, :] - pad - (np.arange(b, dtype=np.float64)[:, None] * a / b)
    kernels = 2 * fc * np.sinc(2 * fc * t) * _kaiser(np.clip(t / half, -1, 1), beta)
    kernels[np.abs(t) > half] = 0.0
    n_out = int(math.ceil(x.size * b / a))
    n_frames = int(math.ceil(n_out / b))
    right = max(0, (n_frames - 1) * a + taps.size - pad - x.size)
    xp = np.pad(x, (pad, right))
    out = torch.nn.functional.conv1d(torch.from_numpy(xp)[None, None],
                                     torch.from_numpy(kernels)[:, None, :], stride=a)
    # out [1, b, n_frames] -> output index j = frame * b + phase
    return out[0].T.reshape(-1)[:n_out].numpy().astype(np.float32)


def _to_mono(x: np.ndarray, where: str) -> np.ndarray:
    if x.ndim == 1:
        return x
    if x.ndim == 2 and min(x.shape) <= MAX_AUDIO_CHANNELS:
        axis = 1 if x.shape[1] <= x.shape[0] else 0  # channels are the short axis
        return x.mean(axis=axis)
    raise ValueError(f"{where}: audio array must be 1-D (mono) or [samples, channels], "
                     f"got shape {tuple(x.shape)}")


def _array_to_float(x: np.ndarray, where: str) -> np.ndarray:
    if x.dtype == np.int16:
        return x.astype(np.float32) / 32768.0
    if x.dtype == np.int32:
        return (x.astype(np.float64) / 2147483648.0).astype(np.float32)
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"{where}: audio array must be float (or int16/int32), got {x.dtype}")
    return x.astype(np.float32)


def check_audio_format(where: str, sample_rate: int, channels: int, seconds: float,
                       max_seconds: float) -> None:
    """Bounds an audio stream from its header, before any of it is decoded."""
    if not MIN_AUDIO_SAMPLE_RATE <= sample_rate <= MAX_AUDIO_SAMPLE_RATE:
        raise ValueError(f"{where}: audio sample rate {sample_rate} Hz is outside "
                         f"[{MIN_AUDIO_SAMPLE_RATE}, {MAX_AUDIO_SAMPLE_RATE}] Hz")
    if (sample_rate != SAMPLE_RATE
            and resample_kernel_elements(sample_rate, SAMPLE_RATE) > _MAX_RESAMPLE_KERNEL):
        raise ValueError(f"{where}: audio sample rate {sample_rate} Hz cannot be resampled to "
                         f"{SAMPLE_RATE} Hz cheaply; use a common rate (8, 11.025, 16, 22.05, "
                         f"24, 32, 44.1, 48, 96 kHz ...)")
    if not 1 <= channels <= MAX_AUDIO_CHANNELS:
        raise ValueError(f"{where}: audio has {channels} channels, the limit is "
                         f"{MAX_AUDIO_CHANNELS}")
    if seconds > max_seconds:
        raise ValueError(f"{where}: audio is {seconds:.1f} s long, more than the limit of "
                         f"{max_seconds:g} s")


def _decode_audio_file(raw: bytes, where: str, max_seconds: float) -> tuple[np.ndarray, int]:
    """(mono float32 [n], sample rate) of an audio file: header checked first, then decoded in
    blocks, each mixed to mono at once, stopping as soon as the bound is passed."""
    try:
        with soundfile.SoundFile(io.BytesIO(raw)) as f:
            sr = f.samplerate
            check_audio_format(where, sr, f.channels, f.frames / max(sr, 1), max_seconds)
            limit = int(max_seconds * sr)
            chunks, n = [], 0
            for block in f.blocks(_AUDIO_BLOCK_FRAMES, dtype="float32", always_2d=True):
                n += block.shape[0]
                if n > limit:  # the header understated the length
                    raise ValueError(f"{where}: audio is longer than the limit of "
                                     f"{max_seconds:g} s (its header said "
                                     f"{f.frames / sr:.1f} s)")
                chunks.append(block.mean(axis=1))
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as e:
        raise ValueError(f"{where}: cannot decode audio: {e}") from e
    x = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    return x, sr


def load_audio(src: Any, where: str, *, max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
               allow_local_paths: bool = True) -> Qwen2_5OmniAudio:
    """Decode audio from a path, bytes, base64 data URL, float32 array at 16 kHz, or an
    `(array, sample_rate)` tuple; mix to mono and resample to 16 kHz.

    Files are bounded on their header (sample rate, channels, duration) before decoding and
    on the decoded samples while decoding; arrays on their shape and rate."""
    sr = SAMPLE_RATE
    if isinstance(src, tuple) and len(src) == 2 and isinstance(src[1], (int, np.integer)):
        src, sr = src[0], int(src[1])
    if isinstance(src, torch.Tensor):
        src = src.detach().cpu().numpy()
    raw = _media_bytes(src, where, "audio", allow_local_paths)
    if raw is not None:
        x, sr = _decode_audio_file(raw, where, max_audio_seconds)
    elif isinstance(src, np.ndarray):
        x = _to_mono(_array_to_float(src, where), where)
        check_audio_format(where, sr, 1, x.shape[0] / max(sr, 1), max_audio_seconds)
    else:
        raise ValueError(f"{where}: audio must be a path, bytes, a float32 array at 16 kHz or "
                         f"(array, sample_rate), got {type(src).__name__}")
    if x.shape[0] == 0:
        raise ValueError(f"{where}: audio is empty")
    if not np.isfinite(x).all():
        raise ValueError(f"{where}: audio contains NaN or infinite samples")
    x = resample(x, sr, SAMPLE_RATE) if sr != SAMPLE_RATE else np.ascontiguousarray(x)
    return Qwen2_5OmniAudio(x, sha256_of("audio", x.shape, x.tobytes()))


# ------------------------------------------------------------------------------------- images


def _to_rgb(image: Image.Image) -> Image.Image:
    # Transparency is composited onto white, as transformers' convert_to_rgb does.
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _check_size(size: tuple[int, int], where: str, max_image_pixels: int) -> None:
    w, h = size
    if w < 1 or h < 1:
        raise ValueError(f"{where}: image has an empty size {w}x{h}")
    if w * h > max_image_pixels:
        raise ValueError(f"{where}: image is {w}x{h} = {w * h} pixels, more than the limit of "
                         f"{max_image_pixels}")
    if max(w, h) / min(w, h) > MAX_IMAGE_ASPECT_RATIO:
        raise ValueError(f"{where}: image aspect ratio {w}x{h} exceeds "
                         f"{MAX_IMAGE_ASPECT_RATIO}:1")


def load_image(src: Any, where: str, *, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
               allow_local_paths: bool = True) -> Qwen2_5OmniImage:
    """Decode an image from a path, bytes, base64 data URL or PIL.Image; convert to RGB."""
    if isinstance(src, Image.Image):
        _check_size(src.size, where, max_image_pixels)
        try:
            image = _to_rgb(src)
        except _PIL_DECODE_ERRORS as e:
            raise ValueError(f"{where}: cannot decode image: {e}") from e
    else:
        raw = _media_bytes(src, where, "image", allow_local_paths)
        if raw is None:
            raise ValueError(f"{where}: image must be a path, bytes or PIL.Image, "
                             f"got {type(src).__name__}")
        try:
            opened = Image.open(io.BytesIO(raw))
        except _PIL_DECODE_ERRORS as e:
            raise ValueError(f"{where}: cannot decode image: {e}") from e
        with opened:
            _check_size(opened.size, where, max_image_pixels)  # header only, before decoding
            try:
                opened.load()
                image = _to_rgb(opened)
                image.load()
            except _PIL_DECODE_ERRORS as e:
                raise ValueError(f"{where}: cannot decode image: {e}") from e
    pixels = np.asarray(image, dtype=np.uint8)
    return Qwen2_5OmniImage(image, sha256_of("image", pixels.shape, pixels.tobytes()))
