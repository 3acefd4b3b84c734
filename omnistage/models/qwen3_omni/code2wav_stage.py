"""Qwen3-Omni code2wav on the non-AR engine: codec frames arrive from the talker as it speaks,
and each request's audio streams out in chunks from one exact, stateful decoder (code2wav.py).

`Qwen3OmniCode2WavModel` is this family's `GenModel` (engine/gen/model.py): a request's state
(`Qwen3OmniCode2WavRequest`) holds its frames not yet decoded and its decoder state (per-layer
sliding-window keys/values, every causal conv's tail). A step decodes the next chunk of every
batched request; rows with the same frame count (and both first or both later chunks, whose
transposed convs trim differently) run as one batch: their states are stacked for the call and
split back after it. One interval per step (no parts); eager (no graphs yet).

NOTE: chunk schedule, by frame position: chunk 0 is the first `first_chunk_frames` frames, then
chunks of `chunk_frames`; the last one is whatever remains once the talker has finished. The
decoder is exact for any chunking, so the schedule sets latency and batching, never the audio."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omnistage.engine.gen import GenEngineConfig, GenRequest, GenStageWorker
from omnistage.engine.gen.config import pop_stage_options
from omnistage.models.qwen3_omni.code2wav import (SAMPLE_RATE, Qwen3OmniCode2Wav,
                                                  Qwen3OmniCode2WavConfig,
                                                  Qwen3OmniCode2WavStreamState)
from omnistage.models.registry import register_stage
from omnistage.runtime import startup
from omnistage.runtime.build import StageContext, build_stage_model


def _check_frames(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: an int >= 1, got {value!r}")


@dataclass(frozen=True)
class Qwen3OmniCode2WavOptions:
    """The chunk schedule (frames of 80 ms; a chunk of n frames is n x 1920 samples, the first
    555 fewer).

    first_chunk_frames: 4. The first audio waits for this many talker frames (plus one small
    decode); its 297 ms of audio cover the production of the next 25-frame chunk at the target
    RTF 0.15 (25 x 80 ms x 0.15 = 300 ms), so playback need not stall at that speed. 1 frame
    would save ~3 talker steps of latency but give 57 ms of audio to hide the next chunk.
    chunk_frames: 25 (2 s of audio): long enough that a step's fixed cost (kernel launches of
    8 layers and ~30 convs) is small against its work, short enough that audio keeps flowing
    while the talker runs behind real time at high load."""

    first_chunk_frames: int = 4
    chunk_frames: int = 25

    def __post_init__(self) -> None:
        _check_frames("first_chunk_frames", self.first_chunk_frames)
        _check_frames("chunk_frames", self.chunk_frames)


# pipeline keyword option -> Qwen3OmniCode2WavOptions field (the engine's: ENGINE_KEYWORDS)
MODEL_KEYWORDS = {"code2wav_first_chunk_frames": "first_chunk_frames",
                  "code2wav_chunk_frames": "chunk_frames"}


def pop_code2wav_options(opts: dict[str, Any]) -> tuple[GenEngineConfig, Qwen3OmniCode2WavOptions]:
    """Take the `code2wav_*` keyword options out of opts (None or absent: the default); a bad
    value raises ValueError naming its keyword. The pipeline passes the pair to the stage
    builder as options["code2wav"]."""
    return pop_stage_options(opts, Qwen3OmniCode2WavOptions, MODEL_KEYWORDS)


@dataclass
class Qwen3OmniCode2WavRequest(GenRequest):
    """A request's code2wav state (the pipeline may submit one, or None)."""

    pending: list[torch.Tensor] = field(default_factory=list)  # [n, 16] int64, CPU: not decoded
    received: int = 0  # frames received
    decoded: int = 0  # frames decoded (queued to the device)
    codes_finished: bool = False
    stream: Qwen3OmniCode2WavStreamState | None = None  # the decoder's state (batch of 1)

    def take(self, frames: int) -> torch.Tensor:
        """The next `frames` pending frames [frames, 16] (removed from pending)."""
        codes = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.pending = [codes[frames:]] if frames < codes.shape[0] else []
        self.decoded += frames
        return codes[:frames]


@dataclass
class _HostAudio:
    """A step's chunks on their way to the host: samples per row, one (pinned) buffer."""

    lengths: list[int]
    host: torch.Tensor


class Qwen3OmniCode2WavModel:
    """Qwen3-Omni code2wav as a GenModel; a step's batch is a list of Qwen3OmniCode2WavRequest,
    each at its next chunk."""

    streaming = True

    def __init__(self, model: Qwen3OmniCode2Wav, device: torch.device,
                 options: Qwen3OmniCode2WavOptions | None = None) -> None:
        self.model, self.device = model, device
        self.options = options or Qwen3OmniCode2WavOptions()
        self.decode_calls = 0  # a step runs one per (frames, first chunk) group of its rows

    # ---------------------------------------------------------------- requests
    def new_state(self, request: Qwen3OmniCode2WavRequest | None) -> Qwen3OmniCode2WavRequest:
        if request is None:
            request = Qwen3OmniCode2WavRequest()
        if not isinstance(request, Qwen3OmniCode2WavRequest):
            raise ValueError(f"request: a Qwen3OmniCode2WavRequest or None, got "
                             f"{type(request).__name__}")
        request.stream = self.model.new_stream_state(1)
        return request

    def add_input(self, req: Qwen3OmniCode2WavRequest, codes: torch.Tensor,
                  finished: bool) -> None:
        """codes: [n, num_quantizers] integer ids of the next n frames (n may be 0)."""
        if req.codes_finished:
            raise ValueError("codes: input after the last one")
        q = self.model.cfg.num_quantizers
        if not isinstance(codes, torch.Tensor) or codes.dim() != 2 or codes.shape[1] != q:
            raise ValueError(f"codes: a tensor [frames, {q}], got "
                             f"{tuple(getattr(codes, 'shape', ())) or type(codes).__name__}")
        codes = codes.detach().to("cpu")  # checked and queued on the CPU (no device sync)
        self.model.check_codes(codes.T[None])  # integer ids in the codebook
        codes = codes.long()
        if codes.shape[0]:  # (the worker holds req.inputs_held() here)
            req.pending.append(codes)
            req.received += codes.shape[0]
        req.codes_finished = bool(finished)

    def _next_frames(self, req: Qwen3OmniCode2WavRequest) -> int:
        """Frames of its next chunk once they are all here (its schedule, clipped at the end)."""
        size = self.options.first_chunk_frames if req.decoded == 0 else self.options.chunk_frames
        return min(size, req.received - req.decoded) if req.codes_finished else size

    def ready(self, req: Qwen3OmniCode2WavRequest) -> bool:
        return req.received - req.decoded >= self._next_frames(req)

    def empty(self, req: Qwen3OmniCode2WavRequest) -> bool:
        # (also after its last chunk, when the talker's end came after that chunk was decoded)
        return req.codes_finished and req.received == req.decoded

    def input_pending(self, req: Qwen3OmniCode2WavRequest) -> bool:
        return not req.codes_finished

    def done(self, req: Qwen3OmniCode2WavRequest) -> bool:
        return req.codes_finished and req.received == req.decoded

    # ---------------------------------------------------------------- steps
    def batch_key(self, state: GenRequest) -> None:
        return None  # any chunks batch together (graphs bucket their widths)

    def batch_rows(self, state: GenRequest) -> int:
        return 1

    def is_held(self, batch: list[Qwen3OmniCode2WavRequest]) -> bool:
        return False  # no graphs: no shape is held by a job

    def intervals(self, batch: list[Qwen3OmniCode2WavRequest]) -> int:
        return 1

    def run(self, batch: list[Qwen3OmniCode2WavRequest]) -> _HostAudio:
        """Queue each row's next chunk, rows of one (frames, first) group in one call."""
        groups: dict[tuple[int, bool], list[int]] = {}
        chunks: list[torch.Tensor] = []  # batch row -> its chunk's codes [frames, 16]
        for i, req in enumerate(batch):
            # NOTE: on the engine's launcher thread while add_input may run: the chunk's
            # size and codes are taken from one view of the input
            with req.inputs_held():
                chunks.append(req.take(self._next_frames(req)))
            groups.setdefault((chunks[-1].shape[0], req.stream.started), []).append(i)
        wavs: dict[int, torch.Tensor] = {}  # batch row -> its samples [m]
        with torch.inference_mode():
            for _, rows in groups.items():
                reqs = [batch[i] for i in rows]
                codes = torch.stack([chunks[i].T for i in rows]).to(self.device)
                state = Qwen3OmniCode2WavStreamState.stack([r.stream for r in reqs])
                wav = self.model.decode_chunk(codes, state)  # [G, 1, samples]
                for i, req, row_state, row_wav in zip(rows, reqs, state.split(), wav,
                                                      strict=True):
                    req.stream = row_state
                    wavs[i] = row_wav[0]
                self.decode_calls += 1
            return self._to_host([wavs[i] for i in range(len(batch))])

    @staticmethod
    def _to_host(wavs: list[torch.Tensor]) -> _HostAudio:
        wav = torch.cat(wavs).float()
        # one copy into pinned memory: outputs() reads it once the stream gets there
        host = torch.empty(wav.shape, dtype=wav.dtype, pin_memory=wav.is_cuda)
        host.copy_(wav, non_blocking=True)
        return _HostAudio([w.shape[0] for w in wavs], host)

    def begin(self, batch: list[Qwen3OmniCode2WavRequest], beside: bool
              ) -> list[Qwen3OmniCode2WavRequest]:
        return list(batch)  # one interval: the job is its batch, run at finish

    def advance(self, job: list[Qwen3OmniCode2WavRequest], intervals: int) -> bool:
        return True

    def finish(self, job: list[Qwen3OmniCode2WavRequest]) -> _HostAudio:
        return self.run(job)

    def outputs(self, result: _HostAudio) -> list[dict[str, np.ndarray]]:
        out, offset = [], 0
        for n in result.lengths:
            out.append({"audio": result.host[offset:offset + n].numpy().copy()})
            offset += n
        return out

    def warmup(self, buckets: tuple[int, ...] | None = None) -> None:
        pass  # eager: nothing to capture

    def drop_jobs(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {"decode_calls": self.decode_calls}


def code2wav_worker(name: str, model: Qwen3OmniCode2Wav, device: torch.device,
                    config: GenEngineConfig | None = None,
                    options: Qwen3OmniCode2WavOptions | None = None) -> GenStageWorker:
    """The code2wav stage: the engine's worker over `Qwen3OmniCode2WavModel` (every scheduling
    decision is the engine's)."""
    decoder = Qwen3OmniCode2WavModel(model, device, options)
    with startup.phase("graphs"):  # the worker's warm-up: compiles and graph captures
        return GenStageWorker(name, decoder, device, config or GenEngineConfig())


@register_stage("Qwen3OmniMoeCode2Wav", "gen", sample_rate=SAMPLE_RATE)
def build_code2wav(ctx: StageContext) -> GenStageWorker:
    """The pipeline's code2wav stage: the checkpoint's `code2wav.*` tensors on ctx.device in
    ctx.dtype; options["code2wav"] (pop_code2wav_options' pair) sets the engine and chunks."""
    engine, options = ctx.options.get("code2wav") or (GenEngineConfig(),
                                                      Qwen3OmniCode2WavOptions())
    if not isinstance(engine, GenEngineConfig) \
            or not isinstance(options, Qwen3OmniCode2WavOptions):
        raise ValueError("options.code2wav: (GenEngineConfig, Qwen3OmniCode2WavOptions), as "
                         "pop_code2wav_options returns")
    if "code2wav_config" not in ctx.config:
        raise ValueError(f"model: {ctx.path}/config.json has no code2wav_config")
    cfg = Qwen3OmniCode2WavConfig.from_hf(ctx.config["code2wav_config"])
    model = build_stage_model(Qwen3OmniCode2Wav, cfg, ctx, "code2wav.")
    return code2wav_worker(ctx.name, model, ctx.device, engine, options)
