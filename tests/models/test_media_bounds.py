"""Media are bounded before they are decoded, and again while they are decoded (issue 24,
defect 2): a long tiny video, a many-channel audio file and containers whose headers
understate their length are each rejected with the prompt field named, without decoding the
whole file (spies on the decoders; tracemalloc for what numpy allocates)."""

from __future__ import annotations

import fractions
import io
import re
import struct
import tracemalloc

import numpy as np
import pytest
import soundfile
import torch

from omnistage.models.qwen2_5_omni import media, video
from omnistage.models.qwen2_5_omni.media import (MAX_AUDIO_CHANNELS, check_audio_format,
                                                 load_audio)
from omnistage.models.qwen2_5_omni.video import (Qwen2_5OmniVideoConfig, load_video,
                                                 preprocess_video, video_token_count)

av = pytest.importorskip("av", reason="video decoding needs PyAV (pip install av)")
WHERE = "prompts[0].messages[0].content[1]"
FIELD = re.escape(WHERE)  # in patterns
SR = 16000


def _video_file(seconds: float, fps: int, fmt: str = "mp4", audio_seconds: float = 0.0
                ) -> bytes:
    """Black 32x32 frames (mpeg4) at `fps`, with an optional silent FLAC mono track."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as box:
        vs = box.add_stream("mpeg4", rate=fps)
        vs.width = vs.height = 32
        vs.pix_fmt = "yuv420p"
        if audio_seconds:
            track = box.add_stream("flac", rate=SR)
            track.layout = "mono"
            pcm = np.zeros(int(audio_seconds * SR), np.int16)
            for i in range(0, len(pcm), 4096):
                f = av.AudioFrame.from_ndarray(pcm[None, i:i + 4096], format="s16",
                                               layout="mono")
                f.sample_rate, f.pts, f.time_base = SR, i, fractions.Fraction(1, SR)
                for pkt in track.encode(f):
                    box.mux(pkt)
            for pkt in track.encode():
                box.mux(pkt)
        frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
        for _ in range(int(seconds * fps)):
            for pkt in vs.encode(frame):
                box.mux(pkt)
        for pkt in vs.encode():
            box.mux(pkt)
    return buf.getvalue()


def _state_duration(mkv: bytes, seconds: float) -> bytes:
    """The Matroska file with its Segment Duration (EBML 0x4489, 8-byte float, ms) rewritten."""
    at = mkv.find(b"\x44\x89\x88")
    assert at > 0, "no 8-byte Duration element"
    return mkv[:at + 3] + struct.pack(">d", seconds * 1000.0) + mkv[at + 11:]


@pytest.fixture
def no_video_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("video frames were decoded")
    monkeypatch.setattr(video, "_decode_sampled", refuse)


@pytest.fixture
def no_audio_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("audio samples were decoded")
    monkeypatch.setattr(soundfile.SoundFile, "blocks", refuse)
    monkeypatch.setattr(soundfile.SoundFile, "read", refuse)


# ------------------------------------------------------------------------------------- video


@pytest.fixture(scope="module")
def long_tiny_mp4() -> bytes:
    return _video_file(590, fps=2)  # 1,180 frames of 32x32: a few KB


def test_long_tiny_mp4_over_token_budget_rejected_from_header(
        long_tiny_mp4: bytes, no_video_decoding: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # 768 sampled frames upscaled to 336x336 take 55,296 tokens (2 GB of pixel values): the
    # budget is checked on the header's frame count, before even the packets are read
    monkeypatch.setattr(video, "_count_frames", lambda *a: pytest.fail("packets were read"))
    with pytest.raises(ValueError, match=rf"^{FIELD}\.video: video would take 55296 tokens "
                                         r"\(768 sampled frames\), more than the limit of 32768"):
        load_video(long_tiny_mp4, f"{WHERE}.video", max_tokens=32768)


def test_long_tiny_mp4_over_duration_rejected_from_header(
        long_tiny_mp4: bytes, no_video_decoding: None) -> None:
    with pytest.raises(ValueError, match=rf"^{FIELD}\.video: video is 590\.0 s long, more than "
                                         r"the limit of 300 s"):
        load_video(long_tiny_mp4, f"{WHERE}.video", max_seconds=300)


def test_video_within_bounds_still_decodes(long_tiny_mp4: bytes) -> None:
    clip = load_video(long_tiny_mp4, "v", max_tokens=60000)
    assert clip.frames.shape == (768, 32, 32, 3)
    tokens = video_token_count(768, 32, 32, Qwen2_5OmniVideoConfig())
    _, grid = preprocess_video(clip.frames[:8], Qwen2_5OmniVideoConfig())
    assert tokens == 55296 and grid == [4, 24, 24]  # 144 tokens per temporal step either way


def test_video_header_understating_duration_stops_at_the_bound(no_video_decoding: None
                                                              ) -> None:
    lying = _state_duration(_video_file(20, fps=5, fmt="matroska"), 1.0)
    with av.open(io.BytesIO(lying)) as box:
        assert box.duration == 1_000_000  # the header says 1 s; the packets hold 20 s
    with pytest.raises(ValueError, match=rf"^{FIELD}\.video: video is longer than the limit of "
                                         r"5 s \(its header said 1\.0 s\)"):
        load_video(lying, f"{WHERE}.video", max_seconds=5)


def test_audio_track_header_understating_duration_stops_while_decoding(
        monkeypatch: pytest.MonkeyPatch) -> None:
    lying = _state_duration(_video_file(2, fps=5, fmt="matroska", audio_seconds=30), 1.0)
    decoded = []
    real_resampler = av.AudioResampler

    class CountingResampler:  # PyAV's resampler cannot be subclassed
        def __init__(self, **kwargs: object) -> None:
            self.inner = real_resampler(**kwargs)

        def resample(self, frame: object) -> list:
            out = self.inner.resample(frame)
            decoded.extend(f.samples for f in out)
            return out

    monkeypatch.setattr(av, "AudioResampler", CountingResampler)
    with pytest.raises(ValueError, match=rf"^{FIELD}\.video: the audio track is longer than the "
                                         r"limit of 5 s \(its header said 1\.0 s\)"):
        load_video(lying, f"{WHERE}.video", with_audio=True, max_audio_seconds=5)
    assert 5 * SR < sum(decoded) < 6 * SR  # stopped one frame past the bound, not at 30 s


def test_video_audio_track_channels_and_rate_checked_before_decoding() -> None:
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as box:
        vs = box.add_stream("mpeg4", rate=5)
        vs.width = vs.height = 32
        track = box.add_stream("pcm_s16le", rate=250000)
        track.layout = "stereo"
        for pkt in vs.encode(av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8),
                                                        format="rgb24")):
            box.mux(pkt)
        for pkt in vs.encode():
            box.mux(pkt)
    with pytest.raises(ValueError, match=rf"^{FIELD}\.video \(its audio track\): audio sample "
                                         r"rate 250000 Hz is outside"):
        load_video(buf.getvalue(), f"{WHERE}.video", with_audio=True)


@pytest.mark.parametrize("fmt", ["mp4", "matroska"])
def test_sampled_frames_decoded_by_seeking_equal_decoding_in_order(fmt: str) -> None:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as box:
        vs = box.add_stream("mpeg4", rate=10)  # every frame a keyframe
        vs.width = vs.height = 32
        vs.pix_fmt = "yuv420p"
        for i in range(600):
            level = np.full((32, 32, 3), i * 7 % 256, np.uint8)
            for pkt in vs.encode(av.VideoFrame.from_ndarray(level, format="rgb24")):
                box.mux(pkt)
        for pkt in vs.encode():
            box.mux(pkt)
    raw = buf.getvalue()
    with av.open(io.BytesIO(raw)) as box:
        packets = video._count_frames(box, box.streams.video[0], "v", 600, 0.0)
    idx = video.sample_frame_indices(packets.total, 10.0, 2.0)
    assert packets.total == 600 and len(idx) == 120
    seeking, filled, decoded = video._decode_sampled(raw, idx, 32, 32, packets)
    in_order, filled_in_order, decoded_in_order = video._decode_sampled(
        raw, idx, 32, 32, video._PacketIndex(packets.total, None, []))
    assert filled.all() and filled_in_order.all()
    np.testing.assert_array_equal(seeking, in_order)
    assert (decoded, decoded_in_order) == (120, 600)  # only the sampled frames were decoded


def test_chunked_preprocessing_equals_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    frames = np.random.default_rng(0).integers(0, 256, (7, 40, 60, 3), dtype=np.uint8)
    cfg = Qwen2_5OmniVideoConfig()
    whole, grid = preprocess_video(frames, cfg)
    monkeypatch.setattr(video, "_PREPROCESS_CHUNK_STEPS", 1)
    chunked, grid_chunked = preprocess_video(frames, cfg)
    assert grid == grid_chunked
    assert torch.equal(whole, chunked)
    assert whole.shape[0] == video_token_count(7, 40, 60, cfg) * cfg.merge_size ** 2


# ------------------------------------------------------------------------------------- audio


def _audio_file(seconds: float, channels: int, fmt: str, subtype: str) -> bytes:
    buf = io.BytesIO()
    with soundfile.SoundFile(buf, "w", SR, channels, format=fmt, subtype=subtype) as f:
        block = np.zeros((SR // 4, channels), np.float32)
        for _ in range(int(seconds * 4)):
            f.write(block)
    return buf.getvalue()


@pytest.mark.parametrize("fmt, subtype", [("OGG", "VORBIS"), ("WAV", "PCM_16")])
def test_many_channel_audio_rejected_from_header(fmt: str, subtype: str,
                                                 no_audio_decoding: None) -> None:
    raw = _audio_file(1, 255, fmt, subtype)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=rf"^{FIELD}\.audio: audio has 255 channels, the "
                                             rf"limit is {MAX_AUDIO_CHANNELS}"):
            load_audio(raw, f"{WHERE}.audio")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # nothing decoded: 1 s x 255 channels would be 16 MB of float32


def test_long_audio_rejected_from_header(no_audio_decoding: None) -> None:
    with pytest.raises(ValueError, match=rf"^{FIELD}\.audio: audio is 2\.0 s long, more than "
                                         r"the limit of 1 s"):
        load_audio(_audio_file(2, 1, "FLAC", "PCM_16"), f"{WHERE}.audio", max_audio_seconds=1)


def test_audio_decoded_in_blocks_mixed_to_mono(monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.random.default_rng(1).uniform(-0.5, 0.5, (3 * SR, 8)).astype(np.float32)
    buf = io.BytesIO()
    soundfile.write(buf, x, SR, format="WAV", subtype="FLOAT")
    raw = buf.getvalue()
    monkeypatch.setattr(media, "_AUDIO_BLOCK_FRAMES", 1000)
    tracemalloc.start()
    try:
        got = load_audio(raw, "a").samples
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(got, x.mean(axis=1))
    assert peak < x.nbytes / 2  # never all 8 channels at once


def test_wav_header_understating_length_is_not_read_past() -> None:
    # libsndfile reads what the header declares and no further: 1 s out of 10 s
    buf = io.BytesIO()
    soundfile.write(buf, np.full(10 * SR, 0.25, np.float32), SR, format="WAV", subtype="PCM_16")
    raw = bytearray(buf.getvalue())
    at = raw.find(b"data")
    raw[at + 4:at + 8] = struct.pack("<I", 2 * SR)
    assert load_audio(bytes(raw), "a", max_audio_seconds=5).samples.shape == (SR,)


@pytest.mark.parametrize("rate, pattern", [
    (250000, r"audio sample rate 250000 Hz is outside \[1000, 192000\] Hz"),
    (500, r"audio sample rate 500 Hz is outside"),
    (44101, r"audio sample rate 44101 Hz cannot be resampled to 16000 Hz cheaply"),
])
def test_sample_rate_bounded(rate: int, pattern: str) -> None:
    with pytest.raises(ValueError, match=rf"^{FIELD}\.audio: {pattern}"):
        load_audio((np.zeros(rate, np.float32), rate), f"{WHERE}.audio")


@pytest.mark.parametrize("rate", [8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000,
                                  88200, 96000, 176400, 192000])
def test_common_sample_rates_pass(rate: int) -> None:
    check_audio_format("a", rate, 2, 1.0, 300.0)


def test_many_channel_array_rejected() -> None:
    with pytest.raises(ValueError, match=r"^a: audio array must be 1-D \(mono\) or "):
        load_audio(np.zeros((SR, 255), np.float32), "a")
