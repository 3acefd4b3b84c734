"""Fixed-shape streaming code2wav (code2wav_graphs.py, code2wav_fast.py) on the CPU: padded
windows and batch buckets equal the unpadded module path; the first-chunk schedule; the graph
runner's host-side logic (buckets, widths, static buffers) without capturing; the DiT's step
functions compiled by inductor (on the CPU) against eager."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from omnistage.engine.gen import GenEngineConfig
from omnistage.models.qwen2_5_omni.code2wav_fast import IntervalCursor, ode_times
from omnistage.models.qwen2_5_omni.code2wav_graphs import (Qwen2_5OmniCode2WavDecoder, bucket_for,
                                                           vocoder_lengths, window_widths)
from omnistage.models.qwen2_5_omni.code2wav_stage import Code2WavRequest, code2wav_worker
from omnistage.models.qwen2_5_omni.code2wav_stream import (Qwen2_5OmniCode2WavStream,
                                                           Qwen2_5OmniCode2WavStreamConfig,
                                                           decode_chunks_with_mel)
from omnistage.models.qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav

from .test_code2wav_stream import N_CODES, SEED, _request
from .test_token2wav import tiny_token2wav_pair

Config = Qwen2_5OmniCode2WavStreamConfig
SCHEDULE = Config(chunk_blocks=3, first_chunk_blocks=1)  # 1 block first, then 3


@pytest.fixture(scope="module")
def t2w() -> Qwen2_5OmniToken2Wav:
    return tiny_token2wav_pair()[1]  # a real (unclipped) signal that depends on the mel


@pytest.fixture(scope="module")
def one_shot(t2w: Qwen2_5OmniToken2Wav) -> tuple[torch.Tensor, torch.Tensor]:
    codes, cond, ref_mel = _request(1, N_CODES)
    mels, wavs = t2w.generate([torch.tensor(codes)], [cond], [ref_mel],
                              [Qwen2_5OmniToken2Wav.initial_noise(SEED, 2 * N_CODES)])
    assert wavs[0].pow(2).mean().sqrt() > 0.01 and (wavs[0].abs() > 0.999).float().mean() < 0.01
    return mels[0], wavs[0]


def _stream(t2w: Qwen2_5OmniToken2Wav, seed: int, n: int, config: Config | None = None,
            finished: bool = True) -> Qwen2_5OmniCode2WavStream:
    codes, cond, ref_mel = _request(seed, n)
    stream = Qwen2_5OmniCode2WavStream(t2w, cond, ref_mel, 100 + seed, config)
    stream.add_codes(codes, finished=finished)
    return stream


def _max_diff(a: list, b: list) -> tuple[float, float]:
    mel = max(float((x.mel - y.mel).abs().max()) for x, y in zip(a, b, strict=True))
    wav = max(float((x.waveform - y.waveform).abs().max()) for x, y in zip(a, b, strict=True))
    return mel, wav


def test_padded_windows_equal_unpadded(t2w: Qwen2_5OmniToken2Wav) -> None:
    dec = Qwen2_5OmniCode2WavDecoder(t2w, pad_batch=True)
    stream = _stream(t2w, 1, 70)  # 140 frames: 6 chunks of 24 frames, the last one 20
    reqs = [(stream, k) for k in (0, 1, 3, 5)]  # clipped at 0 (0, 1), inside (3), at the end (5)
    widths = [w1 - w0 for w0, w1 in (stream.span(k).window for _, k in reqs)]
    assert widths == [48, 72, 96, 68]
    assert dec.plan(widths, stream.config) == [([0, 1, 2, 3], 4, 96)]  # all padded to 96
    assert dec.plan([48], stream.config) == [([0], 1, 48)]  # chunk 0 alone: its own width
    # the fast ODE on the exact window (batch 1, no padding) vs padded to (bucket 4, width 96)
    alone = []
    with torch.inference_mode():
        for s, k in reqs:
            w0, w1 = s.span(k).window
            buf = dec.new_dit_inputs(1, w1 - w0)
            dec.fill_dit_inputs(buf, [(s, k)])
            alone.append(dec._dit(buf)[0])
        padded = dec.sample_windows(reqs, stream.config)
    assert all(m.abs().max() > 0.1 for m in alone)
    diff = max(float((a - p).abs().max()) for a, p in zip(alone, padded, strict=True))
    assert diff < 1e-5, diff
    # and the whole chunk (DiT + BigVGAN) against the module path of decode_chunks_with_mel
    mel_diff, wav_diff = _max_diff(dec.decode(reqs), decode_chunks_with_mel(t2w, reqs))
    print(f"padded vs unpadded ODE {diff:.2e}; vs module path: mel {mel_diff:.2e}, "
          f"wave {wav_diff:.2e}")
    assert mel_diff < 1e-5 and wav_diff < 1e-5


def test_mixed_batch_equals_alone(t2w: Qwen2_5OmniToken2Wav) -> None:
    dec = Qwen2_5OmniCode2WavDecoder(t2w, pad_batch=True, buckets=(1, 2, 4))
    streams = [_stream(t2w, 40, 30), _stream(t2w, 41, 70, finished=False),
               _stream(t2w, 42, 13)]
    # 5 rows > bucket 4: two batches (4 rows, then 1); mixed widths, starts and ends
    reqs = [(streams[0], 2), (streams[1], 3), (streams[2], 1), (streams[1], 0), (streams[0], 0)]
    assert [len(idx) for idx, _, _ in dec.plan([96] * 5, Config())] == [4, 1]
    batched = dec.decode(reqs)
    assert [c.waveform.shape[0] for c in batched] == [12 * 240, 24 * 240, 2 * 240, 24 * 240,
                                                      24 * 240]
    for req, chunk in zip(reqs, batched, strict=True):
        alone = dec.decode([req])[0]
        assert chunk.waveform.pow(2).mean().sqrt() > 0.01
        assert (chunk.waveform - alone.waveform).abs().max() < 1e-5
        assert (chunk.mel - alone.mel).abs().max() < 1e-5


def test_first_chunk_schedule_spans(t2w: Qwen2_5OmniToken2Wav) -> None:
    stream = _stream(t2w, 1, 70, SCHEDULE, finished=False)  # 140 frames
    # chunk 0 = 1 block, later chunks 3 blocks; ready once the window's end (+1 block) exists
    assert stream.ready_chunks() == 2 and stream.num_chunks() is None
    assert [stream.span(k).chunk for k in range(2)] == [(0, 24), (24, 96)]
    assert stream.span(1).window == (0, 120) and stream.span(1).vocoder == (4, 116)
    stream.add_codes([], finished=True)
    assert stream.num_chunks() == stream.ready_chunks() == 3
    assert stream.span(2).chunk == (96, 140) and stream.span(2).window == (48, 140)
    frames = [stream.span(k).chunk for k in range(3)]
    assert all(a[1] == b[0] for a, b in zip(frames, frames[1:]))  # contiguous, from 0 to F
    for n, chunks in ((1, 1), (12, 1), (13, 2), (48, 2), (49, 3)):  # short utterances
        assert _stream(t2w, 2, n, SCHEDULE).num_chunks() == chunks
    assert window_widths(SCHEDULE, 24) == (48, 96, 144)  # first, 1 (a quarter+) and 3 blocks
    # 12-block chunks: a last chunk of 8 frames (a 56-frame window) pads to 144, not 360
    twelve = Config(chunk_blocks=12, first_chunk_blocks=1)
    assert window_widths(twelve, 24) == (48, 144, 216, 360)
    assert Qwen2_5OmniCode2WavDecoder(t2w).plan([56, 360], twelve) == [([0, 1], 2, 360)]
    assert Qwen2_5OmniCode2WavDecoder(t2w).plan([56], twelve) == [([0], 1, 144)]
    assert vocoder_lengths(SCHEDULE, 24) == (44, 112)
    assert window_widths(Config(), 24) == (48, 96) and vocoder_lengths(Config(), 24) == (44, 64)


def test_first_chunk_schedule_arrival_independent(t2w: Qwen2_5OmniToken2Wav) -> None:
    dec = Qwen2_5OmniCode2WavDecoder(t2w)
    whole = _stream(t2w, 1, 70, SCHEDULE)
    ref = dec.decode([(whole, k) for k in range(3)])
    wav = torch.cat([c.waveform for c in ref])
    assert wav.shape == (70 * 480,) and wav.pow(2).mean().sqrt() > 0.01
    codes, cond, ref_mel = _request(1, 70)
    stream = Qwen2_5OmniCode2WavStream(t2w, cond, ref_mel, 101, SCHEDULE)
    got, ready_at = [], []
    for i in range(0, 70, 6):  # codes arrive 6 at a time
        stream.add_codes(codes[i:i + 6])
        while len(got) < stream.ready_chunks():
            ready_at.append(len(stream.codes))
            got += dec.decode([(stream, len(got))])
    assert ready_at == [24, 60]  # chunk 0 after 24 codes, chunk 1 (to frame 96) after 60
    stream.add_codes([], finished=True)
    got += dec.decode([(stream, 2)])
    for a, b in zip(got, ref, strict=True):
        assert a.frames == b.frames and (a.waveform - b.waveform).abs().max() <= 1e-6


def test_whole_window_schedule_equals_one_shot(t2w: Qwen2_5OmniToken2Wav,
                                               one_shot: tuple) -> None:
    mel_ref, wav_ref = one_shot
    config = Config(past_blocks=8, future_blocks=8, vocoder_overlap_frames=16, chunk_blocks=3,
                    first_chunk_blocks=1)
    dec = Qwen2_5OmniCode2WavDecoder(t2w, pad_batch=True, max_graph_frames=512)
    codes, cond, ref_mel = _request(1, N_CODES)
    stream = Qwen2_5OmniCode2WavStream(t2w, cond, ref_mel, SEED, config)
    stream.add_codes(codes, finished=True)
    assert window_widths(config, 24) == (216, 408, 456)  # windows of 80 frames padded to 216
    chunks = dec.decode([(stream, k) for k in range(stream.num_chunks())])
    assert [c.frames for c in chunks] == [(0, 24), (24, 80)]
    mel, wav = torch.cat([c.mel for c in chunks], 1), torch.cat([c.waveform for c in chunks])
    assert wav.shape == wav_ref.shape == (N_CODES * 480,)
    mel_diff, wav_diff = float((mel - mel_ref).abs().max()), float((wav - wav_ref).abs().max())
    print(f"whole-window first-chunk schedule vs one-shot: mel {mel_diff:.2e}, "
          f"wave {wav_diff:.2e}")
    assert mel_diff < 1e-4 and wav_diff < 1e-4


def test_host_logic(t2w: Qwen2_5OmniToken2Wav) -> None:
    assert [bucket_for(n, (1, 2, 4, 8, 16)) for n in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    with pytest.raises(ValueError, match="batch"):
        bucket_for(17, (1, 2, 4, 8, 16))
    times, widths = ode_times(10, -1.0)
    assert len(times) == 36 and times[0] == 0.0 and times[-1] == 1.0
    assert abs(sum(widths) - 1.0) < 1e-6
    dec = Qwen2_5OmniCode2WavDecoder(t2w, pad_batch=True)
    assert not dec.use_graphs and dec.pool is None  # CPU: never captures
    # 36 rows: 32 + 4; whole-utterance windows (over max_graph_frames) round up to a block
    plan = dec.plan([96] * 33 + [48] * 3, Config())
    assert [(len(i), b, w) for i, b, w in plan] == [(32, 32, 96), (4, 4, 96)]
    assert dec.buckets == (1, 2, 4, 8, 16, 32) and not dec.compile
    assert dec.plan([50], Config(past_blocks=64, future_blocks=64)) == [([0], 1, 72)]
    # static buffers: a (bucket 4, width 96) buffer filled with 2 rows; the rest is padding
    streams = [_stream(t2w, 1, 70), _stream(t2w, 2, 30)]
    buf = dec.new_dit_inputs(4, 96)
    buf["spk"].fill_(7.0)  # stale values from an earlier step must not survive
    with torch.inference_mode():
        dec.fill_dit_inputs(buf, [(streams[0], 3), (streams[1], 0)])
    assert buf["start"].tolist() == [24, 0, 0, 0] and buf["nvalid"].tolist() == [96, 48, 0, 0]
    assert buf["codes"][0].tolist() == streams[0].codes[12:60]
    assert buf["codes"][1, :24].tolist() == streams[1].codes[:24]
    assert not buf["codes"][1, 24:].any() and not buf["codes"][2:].any()
    assert torch.equal(buf["noise"][0], Qwen2_5OmniToken2Wav.initial_noise(101, 120)[24:])
    assert torch.equal(buf["noise"][1, :48], Qwen2_5OmniToken2Wav.initial_noise(102, 48))
    assert not buf["noise"][1, 48:].any() and not buf["spk"][2:].any()
    assert torch.equal(buf["spk"][1], dec.speaker(streams[1]))
    assert torch.equal(buf["cond"][0], streams[0].cond[0])
    # the noise cache grows, and stays a prefix of one draw
    assert dec.noise(streams[0], 10).shape[0] == 256
    assert torch.equal(dec.noise(streams[0], 600)[:140],
                       Qwen2_5OmniToken2Wav.initial_noise(101, 140))


@pytest.mark.parametrize("thread", ["0", "1"], ids=["inline", "launcher_thread"])
def test_stage_streams_through_decoder(t2w: Qwen2_5OmniToken2Wav, thread: str) -> None:
    # launch_thread's default: on for CUDA only
    stage = code2wav_worker("code2wav", t2w, torch.device("cpu"), SCHEDULE,
                            GenEngineConfig(launch_thread=thread == "1"))
    assert (stage.launcher is not None) == (thread == "1")
    codes, cond, ref_mel = _request(1, 70)
    stage.submit("a", Code2WavRequest(cond, ref_mel, 101))
    stage.add_input("a", codes[:30], finished=False)
    audio = []
    while stage.has_work():
        audio += [e.audio for e in stage.step()]
    stage.add_input("a", codes[30:], finished=True)
    while stage.has_work():
        audio += [e.audio for e in stage.step()]
    assert [len(a) for a in audio] == [24 * 240, 72 * 240, 44 * 240]
    assert stage.stats()["dit_graphs"] == 0 and not stage.requests
    ref = Qwen2_5OmniCode2WavDecoder(t2w).decode(
        [(_stream(t2w, 1, 70, SCHEDULE), k) for k in range(3)])
    for a, c in zip(audio, ref, strict=True):
        assert abs(torch.from_numpy(a) - c.waveform).max() <= 1e-6


def test_job_in_parts_equals_decode(t2w: Qwen2_5OmniToken2Wav) -> None:
    # a decode run in parts of RK4 intervals, with another decode between the parts, gives
    # decode()'s chunks exactly (eager, CPU: the same arithmetic in the same order)
    dec = Qwen2_5OmniCode2WavDecoder(t2w)
    a, b = _stream(t2w, 1, 70, SCHEDULE), _stream(t2w, 2, 50, SCHEDULE)
    reqs = [(a, 1), (b, 2)]
    want = dec.decode(reqs)
    job = dec.begin_job(reqs)
    assert not dec.advance(job, 4) and job.done == 4
    other = dec.decode([(b, 0)])
    assert not dec.advance(job, 4) and dec.advance(job, 4) and job.done == 9
    got = dec.finish(job)
    assert _max_diff(got, want) == (0.0, 0.0)
    assert _max_diff(other, dec.decode([(b, 0)])) == (0.0, 0.0)
    with pytest.raises(ValueError, match="requests"):
        dec.begin_job([])


@pytest.mark.parametrize("thread", ["0", "1"], ids=["inline", "launcher_thread"])
def test_stage_first_chunk_goes_between_parts(t2w: Qwen2_5OmniToken2Wav, thread: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of later chunks runs in parts (preempt=4: 3 parts of the 9 intervals); a new
    request's first chunk, ready meanwhile, is emitted before that step's; all audio equals
    the whole-step stage's."""

    def run(preempt: int) -> list[tuple[str, int]]:
        stage = code2wav_worker(
            "code2wav", t2w, torch.device("cpu"), SCHEDULE,
            GenEngineConfig(preempt_parts=preempt, launch_thread=thread == "1"))
        out = []
        for rid, seed in (("a", 1), ("b", 2)):
            codes, cond, ref_mel = _request(seed, 70)
            stage.submit(rid, Code2WavRequest(cond, ref_mel, 100 + seed))
            if rid == "a":
                stage.add_input("a", codes, finished=True)
                out += [(e.request_id, e.audio) for e in stage.step()]  # a's first chunk
                launched = stage.launch()  # a's second chunk: the first part of its step
                assert launched.state[0] == [] if preempt else len(launched.state[0]) == 1
                out += [(e.request_id, e.audio) for e in stage.collect(launched)]
            else:
                stage.add_input("b", codes, finished=True)
        while stage.has_work():
            out += [(e.request_id, e.audio) for e in stage.step()]
        assert not stage.requests and stage.job is None
        return out

    parts, whole = run(4), run(0)
    # the first chunk's DiT shape held by the step in progress (graphs): it waits for the step
    monkeypatch.setattr(Qwen2_5OmniCode2WavDecoder, "is_held", lambda self, requests: True)
    held = run(4)
    assert [rid for rid, _ in parts][:3] == ["a", "b", "a"]  # b's first chunk went ahead
    assert [rid for rid, _ in whole][:3] == [rid for rid, _ in held][:3] == ["a", "a", "b"]
    for rid in ("a", "b"):
        got = [x for r, x in parts if r == rid]
        want = [x for r, x in whole if r == rid]
        assert len(got) == len(want) == 3
        assert all(np.array_equal(x, y) for x, y in zip(got, want, strict=True))
        assert all(np.array_equal(x, y) for x, y in zip([x for r, x in held if r == rid], want,
                                                         strict=True))


def test_stage_steps_beside_the_talker(t2w: Qwen2_5OmniToken2Wav) -> None:
    """A step of later chunks begun while some request's codes still arrive (the talker runs)
    is a decode beside other stages (free_sms); once every request's codes are in, not."""
    stage = code2wav_worker("code2wav", t2w, torch.device("cpu"), SCHEDULE,
                            GenEngineConfig(preempt_parts=4))
    codes, cond, ref_mel = _request(1, 70)
    stage.submit("a", Code2WavRequest(cond, ref_mel, 101))
    stage.add_input("a", codes[:60], finished=False)  # chunks 0 and 1 ready
    stage.step()  # a's first chunk
    stage.collect(stage.launch())
    assert stage.job is not None and stage.job.beside
    while stage.job is not None:
        stage.step()
    stage.add_input("a", codes[60:], finished=True)
    stage.collect(stage.launch())
    assert stage.job is not None and not stage.job.beside


def test_speaker_encoded_once_per_voice(t2w: Qwen2_5OmniToken2Wav) -> None:
    """Requests of one voice share the stage's copy of it, and the decoder encodes it once; a
    copy of the same values (another voice object) is encoded on its own, to the same values."""
    stage = code2wav_worker("code2wav", t2w, torch.device("cpu"), SCHEDULE)
    _, cond, ref_mel = _request(1, 30)
    for rid in ("a", "b"):
        stage.submit(rid, Code2WavRequest(cond, ref_mel, 7))
    stage.submit("c", Code2WavRequest(cond.clone(), ref_mel.clone(), 7))
    a, b, c = (stage.requests[r] for r in "abc")
    assert a.ref_mel is b.ref_mel and a.cond is b.cond and c.ref_mel is not a.ref_mel
    dec = stage.model.decoder
    with torch.inference_mode():
        spk_a, spk_b, spk_c = (dec.speaker(r.stream) for r in (a, b, c))
    assert spk_a is spk_b and len(dec.speakers) == 2 and torch.equal(spk_a, spk_c)


def test_is_held(t2w: Qwen2_5OmniToken2Wav) -> None:
    # host logic: a decode whose DiT shape (bucket, width) an unfinished job holds
    dec = Qwen2_5OmniCode2WavDecoder(t2w, pad_batch=True)
    a, b = _stream(t2w, 1, 70, SCHEDULE), _stream(t2w, 2, 70, SCHEDULE)
    assert not dec.is_held([(a, 0)])
    dec._live[(1, 48, False)] = None  # chunk 0: 1 block + 1 look-ahead block
    assert dec.is_held([(a, 0)]) and not dec.is_held([(a, 0), (b, 0)])  # bucket 2
    assert not dec.is_held([(a, 2)]) and not dec.is_held([])
    dec.drop_jobs()
    assert not dec.is_held([(a, 0)])


def test_launch_returns_while_the_decode_is_queued(t2w: Qwen2_5OmniToken2Wav,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With the launcher thread, a launch whose decode blocks (a CUDA graph launch at batch 32
    does) returns at once; the step is done, and collect has its audio, once the decode is."""
    stage = code2wav_worker("code2wav", t2w, torch.device("cpu"), SCHEDULE,
                            GenEngineConfig(launch_thread=True))
    codes, cond, ref_mel = _request(1, 70)
    stage.submit("a", Code2WavRequest(cond, ref_mel, 101))
    stage.add_input("a", codes, finished=True)
    release = threading.Event()
    decode = stage.model.decoder.decode

    def blocked_decode(jobs):
        assert threading.current_thread() is not threading.main_thread()
        release.wait(10)
        return decode(jobs)

    monkeypatch.setattr(stage.model.decoder, "decode", blocked_decode)
    t = time.perf_counter()
    launched = stage.launch()
    assert time.perf_counter() - t < 5 and launched.pending is not None
    assert not launched.done() and not launched.pending.done()
    release.set()
    launched.pending.result(10)
    assert launched.done()
    events = stage.collect(launched)
    ref = Qwen2_5OmniCode2WavDecoder(t2w).decode([(_stream(t2w, 1, 70, SCHEDULE), 0)])
    assert len(events) == 1 and events[0].request_id == "a" and not events[0].finished
    assert abs(torch.from_numpy(events[0].audio) - ref[0].waveform).max() <= 1e-6
    assert launched.busy_seconds() >= 0 and stage.requests["a"].next_chunk == 1


def _dit_args(dec: Qwen2_5OmniCode2WavDecoder, stream: Qwen2_5OmniCode2WavStream,
              bucket: int = 3, width: int = 96) -> list[torch.Tensor]:
    """sample()'s inputs for a padded batch with CFG: a window clipped at frame 0, one inside,
    and padding rows."""
    buf = dec.new_dit_inputs(bucket, width)
    dec.fill_dit_inputs(buf, [(stream, 0), (stream, 3)])
    return [buf[k] for k in ("noise", "codes", "spk", "cond", "start", "nvalid")]


def test_compiled_steps_equal_eager(t2w: Qwen2_5OmniToken2Wav) -> None:
    # the ODE through the inductor-compiled step functions (the CUDA graphs' default) vs eager,
    # on a padded batch with CFG: one window clipped at frame 0, one inside, one padding row
    dec = Qwen2_5OmniCode2WavDecoder(t2w, pad_batch=True)
    stream = _stream(t2w, 1, 70)
    with torch.inference_mode():
        args = _dit_args(dec, stream)
        eager = dec.fast.sample(*args)
        compiled = dec.fast.sample(*args, compiled=True)
    assert eager[:2].abs().max() > 1.0 and not eager[2].any()
    diff = float((compiled - eager).abs().max())
    print(f"compiled vs eager ODE: max abs {diff:.2e}")
    assert diff < 1e-5, diff


def test_interval_cursor_equals_the_time_table(t2w: Qwen2_5OmniToken2Wav) -> None:
    # one interval reading an IntervalCursor loaded with interval i (what a DiT shape's one
    # interval graph runs for every interval) equals interval i read from the time table, bit
    # for bit, eagerly and compiled
    dec = Qwen2_5OmniCode2WavDecoder(t2w, pad_batch=True)
    stream = _stream(t2w, 1, 70)
    fast, cursor = dec.fast, IntervalCursor(dec.fast)
    assert cursor.intervals == len(fast.widths) == 9
    with torch.inference_mode():
        args = _dit_args(dec, stream)
        for compiled in (False, True):
            table, by_cursor = fast.begin(*args), fast.begin(*args)
            for i in range(cursor.intervals):
                fast.interval(table, i, compiled)
                cursor.load(i)
                fast.interval(by_cursor, 0, compiled, cursor)
                assert torch.equal(table.x, by_cursor.x), (compiled, i)
            assert table.x[:2].abs().max() > 1.0 and not table.x[2].any()
            assert torch.equal(table.x, fast.sample(*args, compiled=compiled))


def test_cursor_intervals_run_the_code_compile_for_compiled(t2w: Qwen2_5OmniToken2Wav) -> None:
    # a DiT graph compiles its shape from the time table (compile_for) and captures intervals
    # that read an IntervalCursor, both under inference mode: dynamo guards on whether a
    # tensor is an inference tensor, so a cursor of the other kind compiled everything again
    from torch._dynamo.utils import counters
    dec = Qwen2_5OmniCode2WavDecoder(t2w, pad_batch=True)
    stream = _stream(t2w, 1, 70)
    with torch.inference_mode():
        args = _dit_args(dec, stream)
        dec.fast.compile_for(*args)
        frames = counters["stats"]["unique_graphs"]
        cursor = IntervalCursor(dec.fast)
        state = dec.fast.begin(*args)
        for i in range(cursor.intervals):
            cursor.load(i)
            dec.fast.interval(state, 0, True, cursor)
        assert torch.equal(state.x, dec.fast.sample(*args, compiled=True))
        assert state.x[:2].abs().max() > 1.0
    assert counters["stats"]["unique_graphs"] == frames


def test_compiled_steps_reuse_code_across_shapes(t2w: Qwen2_5OmniToken2Wav) -> None:
    # the batch and width dims are dynamic from the first compile (_DYNAMIC_DIMS): once a
    # batch of 2 or more rows has compiled, every other (bucket, width) runs that code (no new
    # dynamo frame) and still equals eager
    from torch._dynamo.utils import counters
    dec = Qwen2_5OmniCode2WavDecoder(t2w, pad_batch=True)
    stream = _stream(t2w, 1, 70)

    def run(bucket: int, width: int) -> torch.Tensor:
        args = _dit_args(dec, stream, bucket, width)
        dec.fast.compile_for(*args)
        compiled = dec.fast.sample(*args, compiled=True)
        diff = float((compiled - dec.fast.sample(*args)).abs().max())
        assert compiled[:2].abs().max() > 1.0 and diff < 1e-5, (bucket, width, diff)
        return compiled

    with torch.inference_mode():
        run(3, 104)
        frames = counters["stats"]["unique_graphs"]
        # (widths that are not multiples of 16: SDPA's masks are padded to 16, and a padded
        # stride against an unpadded one is a guard of its own)
        for bucket, width in ((3, 120), (5, 120), (6, 104), (2, 200)):
            run(bucket, width)
    assert counters["stats"]["unique_graphs"] == frames


def _cuda_streams(t2w: Qwen2_5OmniToken2Wav, requests: tuple[tuple[int, int], ...]
                  ) -> tuple[Qwen2_5OmniToken2Wav, list[Qwen2_5OmniCode2WavStream]]:
    """A CUDA copy of the model and a finished stream per (seed, codes) on it."""
    import copy
    model = copy.deepcopy(t2w).cuda()
    streams = []
    for seed, n in requests:
        codes, cond, ref_mel = _request(seed, n)
        streams.append(Qwen2_5OmniCode2WavStream(model, cond.cuda(), ref_mel.cuda(), seed))
        streams[-1].add_codes(codes, finished=True)
    return model, streams


@pytest.mark.gpu
def test_compiled_graphs_cuda(t2w: Qwen2_5OmniToken2Wav) -> None:
    # the default CUDA decoder (compiled DiT inside CUDA graphs) vs eager on the same GPU
    model, streams = _cuda_streams(t2w, ((40, 30), (41, 70)))
    reqs = [(streams[0], 2), (streams[1], 3), (streams[1], 0)]  # 3 rows: bucket 4, width 96
    eager = Qwen2_5OmniCode2WavDecoder(model, cuda_graphs=False).decode(reqs)
    dec = Qwen2_5OmniCode2WavDecoder(model)
    got = dec.decode(reqs)
    again = dec.decode(reqs)  # a replay
    assert dec.compile and dec.stats()["dit_graphs"] == 1, dec.stats()
    # the window's preparation and one interval graph (twice) replayed for all 9 intervals
    assert [len(g.segments) for g in dec.dit_graphs.values()] == [3]
    mel_diff, wav_diff = _max_diff(got, eager)
    print(f"compiled graphs vs eager (CUDA fp32): mel {mel_diff:.2e}, wave {wav_diff:.2e}")
    assert all(c.mel.abs().max() > 0.1 for c in eager)
    assert mel_diff < 1e-4 and wav_diff < 1e-4
    assert _max_diff(again, got) == (0.0, 0.0)
    # a later shape's DiT graphs are captured without warm-up runs (compile_for ran the shape)
    captures = []
    capture = dec.graphs.capture

    def spy(fn, key, beside=False, warm=True):
        captures.append((key, warm))
        return capture(fn, key, beside, warm)

    dec.graphs.capture = spy
    reqs = [(streams[1], 0), (streams[0], 0)]  # 2 rows: bucket 2, width 48
    got, eager = dec.decode(reqs), Qwen2_5OmniCode2WavDecoder(model, cuda_graphs=False).decode(reqs)
    assert dec.stats()["dit_graphs"] == 2
    assert [w for k, w in captures if k[0] == "dit"] == [False] * 3, captures
    assert all(c.mel.abs().max() > 0.1 for c in eager)
    assert max(_max_diff(got, eager)) < 1e-4, _max_diff(got, eager)


@pytest.mark.gpu
def test_graphed_job_in_parts_cuda(t2w: Qwen2_5OmniToken2Wav) -> None:
    # the graphed DiT run interval by interval with another shape's graphs in between equals
    # the graphs back to back; the job's shape is refused to other decodes until it finishes
    model, streams = _cuda_streams(t2w, ((40, 30), (41, 70)))
    reqs = [(streams[0], 2), (streams[1], 3)]  # bucket 2, width 96
    dec = Qwen2_5OmniCode2WavDecoder(model, compile=False)
    want = dec.decode(reqs)
    first = dec.decode([(streams[1], 0)])  # bucket 1, width 48
    job = dec.begin_job(reqs)
    assert job.graph is not None and not dec.advance(job, 5)
    with pytest.raises(ValueError, match="unfinished job"):
        dec.decode(reqs)
    assert _max_diff(dec.decode([(streams[1], 0)]), first) == (0.0, 0.0)
    assert dec.advance(job, 5)
    assert _max_diff(dec.finish(job), want) == (0.0, 0.0)
    assert _max_diff(dec.decode(reqs), want) == (0.0, 0.0)  # the shape is free again


@pytest.mark.gpu
def test_free_sms_graphs_cuda(t2w: Qwen2_5OmniToken2Wav) -> None:
    # DiT steps beside other stages on a green context (fewer SMs) give the chunks of the graphs
    # on every SM, whole or in parts; batches under BESIDE_MIN_BUCKET keep every SM
    model, streams = _cuda_streams(t2w, ((40, 30), (41, 70)))
    reqs = [(streams[0], 2), (streams[1], 3)]
    want = Qwen2_5OmniCode2WavDecoder(model, compile=False, buckets=(8,)).decode(reqs)
    dec = Qwen2_5OmniCode2WavDecoder(model, compile=False, free_sms=16, buckets=(8,))
    assert dec.green_context is not None and dec.beside_capture_stream is not dec.capture_stream
    assert _max_diff(dec.decode(reqs), want) == (0.0, 0.0)  # every SM: the same kernels
    got = dec.decode(reqs, beside=True)
    assert set(dec.dit_graphs) == {(8, 96, False), (8, 96, True)}
    diff = _max_diff(got, want)
    print(f"free_sms=16 vs every SM: max abs diff mel {diff[0]:.2e}, waveform {diff[1]:.2e}")
    assert diff[0] < 1e-4 and diff[1] < 1e-4, diff
    job = dec.begin_job(reqs, beside=True)
    assert dec.is_held(reqs, beside=True) and not dec.is_held(reqs)
    dec.advance(job, 9)
    assert _max_diff(dec.finish(job), got) == (0.0, 0.0)
    assert dec.stats()["free_sms"] == 16
    small = Qwen2_5OmniCode2WavDecoder(model, compile=False, free_sms=16, buckets=(2,))
    small.decode(reqs, beside=True)
    assert set(small.dit_graphs) == {(2, 96, False)}


@pytest.mark.gpu
def test_half_vocoder_cuda(t2w: Qwen2_5OmniToken2Wav) -> None:
    # BigVGAN's convs in fp16 / bf16 (autocast) vs strict float32 on the same GPU, graphs and
    # eager (the DiT runs float32 in both; its speaker encoder's convs differ by TF32 only)
    model, (stream,) = _cuda_streams(t2w, ((42, 70),))
    reqs = [(stream, 1), (stream, 2)]
    ref = Qwen2_5OmniCode2WavDecoder(model, cuda_graphs=False, vocoder_dtype="float32")
    torch.backends.cudnn.allow_tf32, tf32 = False, torch.backends.cudnn.allow_tf32
    try:
        want = ref.decode(reqs)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    for dtype, min_snr in (("float16", 45.0), ("bfloat16", 30.0)):
        for graphs in (False, True):
            dec = Qwen2_5OmniCode2WavDecoder(model, cuda_graphs=graphs, compile=False,
                                             vocoder_dtype=dtype)
            got = dec.decode(reqs)
            for a, b in zip(got, want, strict=True):
                assert a.waveform.dtype == torch.float32
                err = (a.waveform - b.waveform).pow(2).sum()
                snr = float(10 * torch.log10(b.waveform.pow(2).sum() / err))
                print(f"vocoder {dtype} graphs={graphs}: waveform SNR {snr:.1f} dB")
                assert min_snr < snr < 200, (dtype, graphs, snr)


@pytest.mark.parametrize("field,make", [
    ("dit_dtype", lambda m: Qwen2_5OmniCode2WavDecoder(m, dit_dtype="bfloat16")),
    ("dit_dtype", lambda m: Qwen2_5OmniCode2WavDecoder(m, dit_dtype="int8")),
    ("cuda_graphs", lambda m: Qwen2_5OmniCode2WavDecoder(m, cuda_graphs=True)),
    ("compile", lambda m: Qwen2_5OmniCode2WavDecoder(m, compile=True)),
    ("preempt", lambda m: code2wav_worker("c", m, torch.device("cpu"), None,
                                          GenEngineConfig(preempt_parts=-1))),
    ("vocoder_dtype", lambda m: Qwen2_5OmniCode2WavDecoder(m, vocoder_dtype="float16")),
    ("vocoder_dtype", lambda m: Qwen2_5OmniCode2WavDecoder(m, vocoder_dtype="int8")),
    ("buckets", lambda m: Qwen2_5OmniCode2WavDecoder(m, buckets=(4, 2))),
    ("free_sms", lambda m: Qwen2_5OmniCode2WavDecoder(m, free_sms=16)),  # CPU: no graphs
    ("free_sms", lambda m: Qwen2_5OmniCode2WavDecoder(m, free_sms=-1)),
    ("free_sms", lambda m: Qwen2_5OmniCode2WavDecoder(m, free_sms=True)),
    ("free_sms", lambda m: Qwen2_5OmniCode2WavDecoder(m, free_sms="half")),
    ("first_chunk_blocks", lambda m: Config(first_chunk_blocks=0)),
    ("requests", lambda m: Qwen2_5OmniCode2WavDecoder(m).decode(
        [(_stream(m, 1, 30), 0), (_stream(m, 1, 30, SCHEDULE), 0)])),
])
def test_bad_options_raise(t2w: Qwen2_5OmniToken2Wav, field: str, make) -> None:
    with pytest.raises(ValueError, match=field):
        make(t2w)


def test_free_sms_option(t2w: Qwen2_5OmniToken2Wav) -> None:
    with pytest.raises(ValueError, match="free_sms"):
        GenEngineConfig(free_sms="lots")
    # CPU: no graphs, so none
    assert Qwen2_5OmniCode2WavDecoder(t2w, free_sms="auto").free_sms == 0
    dec = Qwen2_5OmniCode2WavDecoder(t2w, pad_batch=True, free_sms=0)
    assert dec.free_sms == 0 and dec.beside_capture_stream is dec.capture_stream is None
    # without free SMs a decode beside other stages is the same decode (one lane of shapes)
    a = _stream(t2w, 1, 70, SCHEDULE)
    job = dec.begin_job([(a, 2)], beside=True)
    assert job.key[2] is False  # (CPU: eager, so the shape is not held)


def test_fast_dit_without_triton(t2w: Qwen2_5OmniToken2Wav,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only install has no triton: the DiT's attention is SDPA, and asking for the block
    kernel fails with an error naming the field."""
    from omnistage.models.qwen2_5_omni import code2wav_fast
    monkeypatch.setattr(code2wav_fast, "_block_kernels", lambda: None)
    dit = t2w.code2wav_dit_model
    assert code2wav_fast.Qwen2_5OmniFastDiT(dit).attention == "sdpa"
    with pytest.raises(ValueError, match="attention: 'block' needs triton"):
        code2wav_fast.Qwen2_5OmniFastDiT(dit, attention="block")
