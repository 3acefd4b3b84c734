"""code2wav as a generation stage: codes arrive from the talker as it speaks.

Streaming (the default): each request keeps a sliding-window decoder (code2wav_stream.py); a
step decodes the next ready chunk of every request together, in one batched DiT pass per ODE
evaluation, and emits it. One-shot (streaming off): an utterance is decoded whole once its last
code has arrived, several utterances per batch.

Streaming chunks go through `Qwen2_5OmniCode2WavDecoder` (code2wav_graphs.py): fixed-shape
padded windows; on CUDA, graphs per (batch bucket, window width), one per RK4 interval of the
ODE. A step of later chunks may run in parts (preempt_intervals), first chunks going between."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from omnistage.models.qwen2_5_omni.code2wav_graphs import DecodeJob, Qwen2_5OmniCode2WavDecoder
from omnistage.models.qwen2_5_omni.code2wav_stream import (ODE_STEPS, Qwen2_5OmniCode2WavChunk,
                                                           Qwen2_5OmniCode2WavStream,
                                                           Qwen2_5OmniCode2WavStreamConfig)
from omnistage.models.qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav
from omnistage.models.qwen2_5_omni.voices import MAX_VOICES
from omnistage.models.registry import register_model
from omnistage.runtime.stage import LaunchedStep, StageEvent, StageStream

register_model("Qwen2_5OmniToken2Wav")(Qwen2_5OmniToken2Wav)

MAX_BATCH = 32  # the decoder's largest graph bucket: one graph per step


def _switch(env_name: str, device: torch.device) -> bool:
    """An on/off environment switch: "1" on, "0" off, unset (or anything else): on for CUDA."""
    env = os.environ.get(env_name, "")
    return env == "1" or (env != "0" and device.type == "cuda")


def first_chunks_alone(device: torch.device) -> bool:
    """OMNISTAGE_FIRST_CHUNK_ALONE ("1" on, "0" off; unset: on for CUDA): a step with the first
    chunks of every request still waiting for audio holds those only and runs with the GPU to
    itself (the AR stages wait for it: it is those requests' time to first audio, and beside
    the AR decodes it ran slower: H100, 8 requests at once, TTFA 0.35 s alone vs 0.45 s)."""
    return _switch("OMNISTAGE_FIRST_CHUNK_ALONE", device)


def launch_on_thread(device: torch.device) -> bool:
    """OMNISTAGE_CODE2WAV_THREAD ("1" on, "0" off; unset: on for CUDA): a streaming step queues
    its GPU work from a thread of the stage's own, so the orchestrator goes on launching the AR
    stages meanwhile.

    NOTE: why: launching the DiT's CUDA graph at batch 32 (~9000 kernels, 12-block chunks)
    blocks the calling thread until most of it has run (H100: cudaGraphLaunch returned after
    583 of ~690 ms; at batch 1, after 0.13 ms). Called from the orchestrator, that stalled the
    talker for ~0.6 s per chunk step, and code2wav then waited ~0.33 s per step for its codes.
    The replay releases the GIL: with this thread the loop's launch takes 0.1-0.4 ms."""
    return _switch("OMNISTAGE_CODE2WAV_THREAD", device)


def preempt_intervals(device: torch.device) -> int:
    """OMNISTAGE_CODE2WAV_PREEMPT: a step of later chunks runs in parts of this many of the
    ODE's 9 RK4 intervals, and a step of first chunks may run between two parts ("0": whole
    steps; unset: 3 on CUDA, 0 elsewhere).

    NOTE: why: a request that arrives while a batch-32 step of 24-block chunks runs (~1.7 s on
    an H100) would wait for all of it before its first audio; in parts of 3 intervals it waits
    for at most one part (0.41-0.44 s; the last, with BigVGAN, 0.82 s). The parts cost nothing
    extra on the GPU (the DiT graphs are one per interval anyway: 654.5 vs 651.6 ms for one
    whole-ODE graph at batch 32 x 360 frames). H100, c32: 72.5 audio-s/s; arrivals spread over
    6 s: time to first audio p50 0.59 s (0.67 s in whole steps)."""
    env = os.environ.get("OMNISTAGE_CODE2WAV_PREEMPT", "")
    if not env:
        return 3 if device.type == "cuda" else 0
    if not env.isdigit():
        raise ValueError(f"OMNISTAGE_CODE2WAV_PREEMPT: an int >= 0, got {env!r}")
    return int(env)


@dataclass
class Code2WavRequest:
    cond: torch.Tensor  # [enc_emb_dim] speaker vector (fp32, device)
    ref_mel: torch.Tensor  # [frames, 80] reference mel (fp32, device)
    seed: int
    codes: list[int] = field(default_factory=list)
    codes_finished: bool = False
    stream: Qwen2_5OmniCode2WavStream | None = None
    next_chunk: int = 0
    in_job: bool = False  # its next chunk is in the stage's unfinished step (job)


@dataclass
class _StepJob:
    """A step of later chunks run in parts (preempt_intervals)."""

    ready: list[tuple[str, Code2WavRequest]]
    # the talker still sends codes (of some request): the DiT leaves it SMs (free_sms)
    beside: bool = False
    decode: DecodeJob | None = None  # begun by its first part (on the launcher thread)
    parts: int = 0  # parts launched


class Qwen2_5OmniCode2WavStage:
    def __init__(self, name: str, model: Qwen2_5OmniToken2Wav, device: torch.device,
                 stream_config: Qwen2_5OmniCode2WavStreamConfig | None,
                 dit_dtype: str | torch.dtype | None = None, cuda_graphs: bool | None = None,
                 warmup: bool = False, compile: bool | None = None,
                 vocoder_dtype: str | None = None, preempt: int | None = None,
                 free_sms: int | str | None = None) -> None:
        # dit_dtype: the streaming DiT's compute dtype ("float32", "tf32", "bfloat16"; None =
        # $OMNISTAGE_CODE2WAV_DIT_DTYPE or float32); vocoder_dtype: BigVGAN's conv dtype
        # (Qwen2_5OmniCode2WavDecoder's); cuda_graphs: None = on for CUDA unless
        # OMNISTAGE_CUDA_GRAPHS=0; warmup: capture the stream config's graphs now; compile:
        # torch.compile the graphed DiT (None = with graphs unless OMNISTAGE_CODE2WAV_COMPILE=0);
        # preempt: RK4 intervals per part of a later-chunk step (None = preempt_intervals);
        # free_sms: SMs a later-chunk step leaves to the talker while its codes still come
        # (Qwen2_5OmniCode2WavDecoder's)
        self.name, self.model, self.device = name, model, device
        self.stream_config = stream_config  # None = one-shot decode per utterance
        self.requests: dict[str, Code2WavRequest] = {}
        self.voices: dict[tuple, tuple[torch.Tensor, ...]] = {}  # see _voice_on_device
        self.batch_sizes: list[int] = []
        self.alone_steps = 0  # steps of first chunks that ran with the GPU to themselves
        self.busy_seconds = 0.0
        self.gpu = StageStream(device)
        # a step with a request's first chunk runs ahead of the AR stages: it is that
        # request's time to first audio (later chunks have the audio already out as slack)
        self.gpu_first = StageStream(device, priority=-1)
        self.first_alone = first_chunks_alone(device)
        self.preempt = preempt_intervals(device) if preempt is None else int(preempt)
        if self.preempt < 0:
            raise ValueError(f"preempt: an int >= 0, got {preempt!r}")
        self.job: _StepJob | None = None  # the later-chunk step in progress (preempt > 0)
        # one worker: the orchestrator never launches this stage again before collecting it
        self.launcher = (ThreadPoolExecutor(1, thread_name_prefix=f"{name}-launch")
                         if launch_on_thread(device) else None)
        self.decoder_options = {"dit_dtype": dit_dtype, "cuda_graphs": cuda_graphs,
                                "compile": compile, "vocoder_dtype": vocoder_dtype,
                                "free_sms": free_sms}
        self._decoder: Qwen2_5OmniCode2WavDecoder | None = None
        if warmup:
            self.warmup()

    @property
    def decoder(self) -> Qwen2_5OmniCode2WavDecoder:
        """The streaming decoder, built on first use (it snapshots the DiT's weights)."""
        if self._decoder is None:
            self._decoder = Qwen2_5OmniCode2WavDecoder(self.model, **self.decoder_options)
        return self._decoder

    def warmup(self, buckets: tuple[int, ...] | None = None) -> None:
        """Capture the streaming graphs of these batch buckets (default: all) now."""
        if self.stream_config is not None:
            self.decoder.warmup(self.stream_config, buckets)

    def submit(self, request_id: str, request: Code2WavRequest) -> None:
        # the voice arrives on the host when the front end runs in another process
        request.cond, request.ref_mel = self._voice_on_device(request.cond, request.ref_mel)
        if self.stream_config is not None:
            request.stream = Qwen2_5OmniCode2WavStream(self.model, request.cond, request.ref_mel,
                                                       request.seed, self.stream_config)
        self.requests[request_id] = request

    def _voice_on_device(self, cond: torch.Tensor, ref_mel: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """One device copy per voice: the front end passes each voice's own tensors, and the
        decoder encodes a voice's speaker once per copy (Qwen2_5OmniCode2WavDecoder.speaker).
        Keyed by the host tensors' identity (voices are read-only), held in the entry (bounded)."""
        key = (id(cond), id(ref_mel))
        hit = self.voices.get(key)
        if hit is not None and hit[0] is cond and hit[1] is ref_mel:
            return hit[2], hit[3]
        on_device = cond.to(self.device), ref_mel.to(self.device)
        if len(self.voices) >= MAX_VOICES:  # the oldest voice goes
            del self.voices[next(iter(self.voices))]
        self.voices[key] = (cond, ref_mel, *on_device)
        return on_device

    def add_codes(self, request_id: str, codes: list[int], finished: bool) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        if req.codes_finished:
            raise ValueError(f"code2wav: codes for {request_id} after the last one")
        req.codes.extend(codes)
        req.codes_finished = finished
        if req.stream is not None:
            req.stream.add_codes(codes, finished)

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)  # (a job computes its chunk still; collect drops it)

    def _ready(self, req: Code2WavRequest) -> bool:
        if req.in_job:
            return False
        if req.codes_finished and not req.codes:
            return True
        if req.stream is None:
            return req.codes_finished
        return req.stream.ready_chunks() > req.next_chunk

    def has_work(self) -> bool:
        return self.job is not None or any(self._ready(r) for r in self.requests.values())

    def step(self) -> list[StageEvent]:
        launched = self.launch()
        return [] if launched is None else self.collect(launched)

    def launch(self) -> LaunchedStep | None:
        """Queue the next chunk of up to MAX_BATCH ready requests, earliest chunk first (a new
        request's first audio goes ahead of later chunks of older ones)."""
        t0 = time.perf_counter()
        ready = sorted(((rid, r) for rid, r in self.requests.items() if self._ready(r)),
                       key=lambda item: item[1].next_chunk)[:MAX_BATCH]
        events = []
        for rid, r in ready:
            if r.codes_finished and not r.codes:  # nothing to say: an empty utterance
                del self.requests[rid]
                events.append(StageEvent(self.name, rid, finished=True, finish_reason="stop"))
        ready = [(rid, r) for rid, r in ready if r.codes]
        first = [(rid, r) for rid, r in ready if r.next_chunk == 0]
        # only first chunks go ahead of the next part of a step in progress, and only where
        # their DiT shape is not the one that step holds (a short utterance's chunk 1 can be)
        if self.job is not None and (not first or self.decoder.is_held(
                [(r.stream, 0) for _, r in first])):
            return self._launch_part(t0, events)
        if not ready:
            return LaunchedStep(None, events) if events else None
        # alone only when every request still waiting for its first audio waits for code2wav
        # alone (its first chunk is ready: in this step, or in the next when they exceed a
        # step): the pause of the AR stages would delay the codes of any other (with arrivals
        # spread out, that cost more than it saved). H100, 64 requests at once (two first-chunk
        # steps of 32): time to first audio p50 1.01 s alone, 1.50 s beside the AR stages.
        alone = bool(first) and self.first_alone and all(
            self._ready(r) for r in self.requests.values() if r.next_chunk == 0)
        if alone:  # later chunks wait for the next step: their audio is already playing
            ready = first
            self.alone_steps += 1
        elif self.job is not None:
            ready = first
        if not first and self.preempt and self.stream_config is not None:
            return self._launch_part(t0, events, ready)
        self.batch_sizes.append(len(ready))
        gpu = self.gpu_first if first else self.gpu
        with gpu.active(launch=True):  # (the previous step was collected: done on the GPU)
            start = gpu.event()
            if self.stream_config is None:
                return LaunchedStep(None, events + self._whole_step(ready), start, gpu.event(),
                                    time.perf_counter() - t0)
            jobs = [(r.stream, r.next_chunk) for _, r in ready]
            if self.launcher is None:
                state = (ready, self._queue_decode(jobs), False)
                return gpu.launched(state, start, t0, events, exclusive=alone)
        # (the stream already waits for the default stream's work queued before this launch)
        end = torch.cuda.Event(enable_timing=True) if gpu.stream is not None else None
        pending = self.launcher.submit(self._queue_decode, jobs, gpu, end)
        return LaunchedStep((ready, None, False), events, start, end, time.perf_counter() - t0,
                            exclusive=alone, pending=pending)

    def _launch_part(self, t0: float, events: list[StageEvent],
                     ready: list[tuple[str, Code2WavRequest]] | None = None) -> LaunchedStep:
        """Queue the next part of the step in progress, or the first part of a new one of
        `ready` (later chunks only)."""
        if self.job is None:
            self.job = _StepJob(ready, any(not r.codes_finished for r in self.requests.values()))
            self.batch_sizes.append(len(ready))
            for _, r in ready:
                r.in_job = True
        job = self.job
        job.parts += 1
        last = job.parts * self.preempt >= ODE_STEPS - 1
        # collect emits the step's chunks after its last part (and frees its requests)
        ready = job.ready if last else []
        gpu = self.gpu
        with gpu.active(launch=True):
            start = gpu.event()
            if self.launcher is None:
                return gpu.launched((ready, self._queue_part(job), last), start, t0, events)
        end = torch.cuda.Event(enable_timing=True) if gpu.stream is not None else None
        pending = self.launcher.submit(self._queue_part, job, gpu, end)
        return LaunchedStep((ready, None, last), events, start, end, time.perf_counter() - t0,
                            pending=pending)

    def _queue_decode(self, jobs: list[tuple[Qwen2_5OmniCode2WavStream, int]],
                      gpu: StageStream | None = None, end: torch.cuda.Event | None = None
                      ) -> tuple[list[int], torch.Tensor]:
        """Queue the chunks' decode and their copy to the host: (samples per chunk, the host
        buffer collect reads once the GPU is done). On the launcher thread: gpu's stream is
        made current there, and end is recorded on it after the work."""
        with gpu.active(launch=False) if gpu is not None else nullcontext():
            out = self._to_host(self.decoder.decode(jobs))
            if end is not None:
                end.record()
        return out

    def _queue_part(self, job: _StepJob, gpu: StageStream | None = None,
                    end: torch.cuda.Event | None = None
                    ) -> tuple[list[int], torch.Tensor] | None:
        """_queue_decode for one part of a step run in parts: None until its last part."""
        with gpu.active(launch=False) if gpu is not None else nullcontext():
            if job.decode is None:
                job.decode = self.decoder.begin_job([(r.stream, r.next_chunk)
                                                     for _, r in job.ready], job.beside)
            out = None
            if self.decoder.advance(job.decode, self.preempt):
                out = self._to_host(self.decoder.finish(job.decode))
            if end is not None:
                end.record()
        return out

    @staticmethod
    def _to_host(chunks: list[Qwen2_5OmniCode2WavChunk]) -> tuple[list[int], torch.Tensor]:
        wav = torch.cat([c.waveform.float() for c in chunks])
        # one copy into pinned memory: collect() reads it once the stream gets there
        host = torch.empty(wav.shape, dtype=wav.dtype, pin_memory=wav.is_cuda)
        host.copy_(wav, non_blocking=True)
        return [c.waveform.shape[0] for c in chunks], host

    def collect(self, launched: LaunchedStep) -> list[StageEvent]:
        """The launched step's events (its chunks' audio once the GPU is done)."""
        events = list(launched.events)
        if launched.state is None:  # finished at launch (one-shot, empty utterances)
            return events
        ready, queued, ends_job = launched.state
        out = launched.pending.result() if launched.pending is not None else queued
        if launched.end is not None:
            launched.end.synchronize()
        if ends_job:
            self.job = None
            for _, r in ready:
                r.in_job = False
        if out is None:  # a part of a step: its audio comes with the last part
            return events
        lengths, host = out
        off = 0
        for (rid, r), n in zip(ready, lengths):
            wav, off = host[off:off + n].numpy().copy(), off + n
            if self.requests.get(rid) is not r:  # aborted while the chunk ran
                continue
            r.next_chunk += 1
            last = r.stream.num_chunks() == r.next_chunk
            if last:
                del self.requests[rid]
            events.append(StageEvent(self.name, rid, audio=wav, finished=last,
                                     finish_reason="stop" if last else None))
        return events

    def _whole_step(self, ready: list[tuple[str, Code2WavRequest]]) -> list[StageEvent]:
        dev = self.device
        codes = [torch.tensor(r.codes, dtype=torch.long, device=dev) for _, r in ready]
        noises = [Qwen2_5OmniToken2Wav.initial_noise(r.seed, 2 * len(r.codes)).to(dev)
                  for _, r in ready]
        _, wavs = self.model.generate(codes, [r.cond for _, r in ready],
                                      [r.ref_mel for _, r in ready], noises)
        for rid, _ in ready:
            del self.requests[rid]
        return [StageEvent(self.name, rid, audio=wav.float().cpu().numpy(), finished=True,
                           finish_reason="stop") for (rid, _), wav in zip(ready, wavs)]

    def fail_all(self, error: str) -> list[StageEvent]:
        events = [StageEvent(self.name, rid, finished=True, finish_reason="error", error=error)
                  for rid in self.requests]
        self.requests.clear()
        self.job = None
        if self._decoder is not None:
            self._decoder.drop_jobs()
        return events

    def stats(self) -> dict[str, float]:
        return {"queue": len(self.requests),
                "batch_size": self.batch_sizes[-1] if self.batch_sizes else 0,
                "max_batch_size": max(self.batch_sizes, default=0),
                "chunks": sum(self.batch_sizes), "steps": len(self.batch_sizes),
                "alone_steps": self.alone_steps, "preempt_intervals": self.preempt,
                "busy_seconds": self.busy_seconds,
                **({} if self._decoder is None else self._decoder.stats())}
