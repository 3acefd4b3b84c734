"""Streaming code2wav (sliding-window DiT + overlapped BigVGAN) against one-shot `generate`."""

from __future__ import annotations

import logging

import pytest
import torch

from omnistage.models.qwen2_5_omni.code2wav_stream import (
    Qwen2_5OmniCode2WavStreamConfig,
    Qwen2_5OmniCode2WavStream,
    decode_chunks,
    decode_chunks_with_mel,
)
from omnistage.models.qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav

from .test_token2wav import tiny_token2wav_pair

logger = logging.getLogger(__name__)
N_CODES, SEED = 40, 7  # 80 frames: chunks of 24, 24, 24 and 8 frames


@pytest.fixture(scope="module")
def model() -> Qwen2_5OmniToken2Wav:
    return tiny_token2wav_pair()[1]  # a real (unclipped) signal that depends on the mel


def _request(seed: int, n: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 129, (n,), generator=g).tolist()
    return codes, torch.randn(16, generator=g), torch.randn(24, 80, generator=g)


@pytest.fixture(scope="module")
def one_shot(model: Qwen2_5OmniToken2Wav) -> tuple[torch.Tensor, torch.Tensor]:
    codes, cond, ref_mel = _request(1, N_CODES)
    mels, wavs = model.generate([torch.tensor(codes)], [cond], [ref_mel],
                                [Qwen2_5OmniToken2Wav.initial_noise(SEED, 2 * N_CODES)])
    assert wavs[0].pow(2).mean().sqrt() > 0.01 and (wavs[0].abs() > 0.999).float().mean() < 0.01
    return mels[0], wavs[0]


def _stream(model: Qwen2_5OmniToken2Wav, config: Qwen2_5OmniCode2WavStreamConfig
            ) -> Qwen2_5OmniCode2WavStream:
    codes, cond, ref_mel = _request(1, N_CODES)
    stream = Qwen2_5OmniCode2WavStream(model, cond, ref_mel, SEED, config)
    stream.add_codes(codes, finished=True)
    assert stream.ready_chunks() == stream.num_chunks() == 4
    return stream


def _stream_all(model: Qwen2_5OmniToken2Wav, config: Qwen2_5OmniCode2WavStreamConfig
                ) -> tuple[Qwen2_5OmniCode2WavStream, list]:
    stream = _stream(model, config)
    return stream, decode_chunks_with_mel(model, [(stream, k) for k in range(4)])


def _snr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (x - ref).pow(2).sum()))


@pytest.fixture(scope="module")
def default_chunks(model: Qwen2_5OmniToken2Wav) -> list:
    return _stream_all(model, Qwen2_5OmniCode2WavStreamConfig())[1]


def test_full_window_equals_generate(model: Qwen2_5OmniToken2Wav, one_shot: tuple) -> None:
    mel_ref, wav_ref = one_shot
    # DiT windows cover the whole utterance; 16 vocoder frames cover BigVGAN's reach (~12 here)
    stream, chunks = _stream_all(model, Qwen2_5OmniCode2WavStreamConfig(8, 8, 16))
    assert [c.frames for c in chunks] == [(0, 24), (24, 48), (48, 72), (72, 80)]
    assert stream.span(1).vocoder == (8, 64) and stream.span(3).vocoder == (56, 80)
    mel, wav = torch.cat([c.mel for c in chunks], 1), torch.cat([c.waveform for c in chunks])
    assert mel.shape == mel_ref.shape and wav.shape == wav_ref.shape == (N_CODES * 480,)
    assert (mel - mel_ref).abs().max() < 1e-4
    assert (wav - wav_ref).abs().max() < 1e-4
    # without vocoder context a chunk's edges differ: the overlap is what makes it match
    bare = model.vocode([mel_ref[:, 24:48]])[0]
    assert (bare - wav_ref[24 * 240:48 * 240]).abs().max() > 1e-2


def test_default_window_snr(model: Qwen2_5OmniToken2Wav, one_shot: tuple, default_chunks: list,
                            record_property) -> None:
    mel_ref, wav_ref = one_shot
    wav = torch.cat([c.waveform for c in default_chunks])
    mel = torch.cat([c.mel for c in default_chunks], 1)
    assert wav.dtype == torch.float32 and wav.shape == (N_CODES * 480,)
    snr, mel_snr = _snr_db(wav, wav_ref), _snr_db(mel, mel_ref)
    _, bare = _stream_all(model, Qwen2_5OmniCode2WavStreamConfig(0, 0, 0))
    bare_snr = _snr_db(torch.cat([c.waveform for c in bare]), wav_ref)
    logger.info("default window: waveform SNR %.1f dB (mel %.1f dB); no context %.1f dB",
                snr, mel_snr, bare_snr)
    print(f"default window SNR {snr:.1f} dB (mel {mel_snr:.1f} dB), no context {bare_snr:.1f} dB")
    record_property("snr_db", round(snr, 1))
    # a window's inputs are the slices of the utterance's codes and noise at its frames
    stream = _stream(model, Qwen2_5OmniCode2WavStreamConfig())
    assert stream.span(2).window == (0, 80) and stream.span(3).window == (24, 80)
    codes, _, _, noise, start = stream.window_inputs(3)
    assert start == 24 and codes[0].tolist() == _request(1, N_CODES)[0][12:40]
    assert torch.equal(noise, Qwen2_5OmniToken2Wav.initial_noise(SEED, 80)[24:80])
    # measured with these tiny random weights: 75.3 dB (mel 92.0 dB); no context 12.6 dB
    assert snr > 60.0 and mel_snr > 75.0
    assert snr > bare_snr + 20.0


def test_arrival_independence(model: Qwen2_5OmniToken2Wav, default_chunks: list) -> None:
    codes, cond, ref_mel = _request(1, N_CODES)
    stream = Qwen2_5OmniCode2WavStream(model, cond, ref_mel, SEED)
    got: list[torch.Tensor] = []
    for i, code in enumerate(codes):
        stream.add_codes([code])
        # chunk k needs codes up to the end of its future block: 12 (k + 2) with the defaults
        assert stream.ready_chunks() == max(0, (i + 1) // 12 - 1) and stream.num_chunks() is None
        while len(got) < stream.ready_chunks():
            got += decode_chunks(model, [(stream, len(got))])
    assert len(got) == 2
    stream.add_codes([], finished=True)
    assert stream.ready_chunks() == 4
    got += decode_chunks(model, [(stream, 2), (stream, 3)])
    for a, b in zip(got, default_chunks, strict=True):
        assert a.shape == b.waveform.shape and (a - b.waveform).abs().max() <= 1e-6


def test_batched_requests_equal_alone(model: Qwen2_5OmniToken2Wav) -> None:
    streams = []
    for i, (n, finished) in enumerate([(30, True), (70, False), (13, True)]):
        codes, cond, ref_mel = _request(40 + i, n)
        stream = Qwen2_5OmniCode2WavStream(model, cond, ref_mel, 100 + i)
        stream.add_codes(codes, finished=finished)
        streams.append(stream)
    # different chunk positions and window lengths: 30 codes' last chunk (12 frames),
    # a middle chunk of an unfinished stream, a one-chunk utterance (26 frames -> chunk 0, 1)
    reqs = [(streams[0], 2), (streams[1], 3), (streams[2], 1)]
    assert [s.ready_chunks() for s in streams] == [3, 4, 2]
    batched = decode_chunks(model, reqs)
    assert [w.shape[0] for w in batched] == [12 * 240, 24 * 240, 2 * 240]
    for req, wav in zip(reqs, batched, strict=True):
        alone = decode_chunks(model, [req])[0]
        assert wav.pow(2).mean().sqrt() > 0.01
        assert (wav - alone).abs().max() < 1e-5
    assert decode_chunks(model, []) == []


@pytest.mark.parametrize("field,action", [
    ("codes", lambda s, m: s.add_codes([3, 129])),
    ("codes", lambda s, m: s.add_codes([-1])),
    ("codes", lambda s, m: s.add_codes([1.5])),
    ("codes", lambda s, m: s.add_codes("12")),
    ("finished", lambda s, m: (s.add_codes([1], finished=True), s.add_codes([2]))),
    ("chunk", lambda s, m: decode_chunks(m, [(s, 0)])),
    ("chunk", lambda s, m: s.span(-1)),
    ("requests", lambda s, m: decode_chunks(m, [s])),
    ("past_blocks", lambda s, m: Qwen2_5OmniCode2WavStreamConfig(past_blocks=-1)),
    ("chunk_blocks", lambda s, m: Qwen2_5OmniCode2WavStreamConfig(chunk_blocks=0)),
    ("cond", lambda s, m: Qwen2_5OmniCode2WavStream(m, torch.zeros(15), torch.zeros(20, 80), 0)),
    ("ref_mel", lambda s, m: Qwen2_5OmniCode2WavStream(m, torch.zeros(16), torch.zeros(20, 81), 0)),
    ("seed", lambda s, m: Qwen2_5OmniCode2WavStream(m, torch.zeros(16), torch.zeros(20, 80), 1.0)),
])
def test_bad_input_raises(model: Qwen2_5OmniToken2Wav, field: str, action) -> None:
    stream = Qwen2_5OmniCode2WavStream(model, torch.zeros(16), torch.zeros(20, 80), 0)
    stream.add_codes([0, 128, 5])  # valid ids at both ends of the range
    with pytest.raises(ValueError, match=field):
        action(stream, model)
    assert stream.codes[:3] == [0, 128, 5]  # a rejected add appends nothing
