"""code2wav on the non-AR engine: codes arrive from the talker as it speaks.

Streaming (the default): each request keeps a sliding-window decoder (code2wav_stream.py); a
step of the engine (`GenStageWorker`) decodes the next ready chunk of every batched request
together, in one batched DiT pass per ODE evaluation, and emits it. One-shot (streaming off):
an utterance is decoded whole once its last code has arrived, several utterances per batch.

`Qwen2_5OmniCode2WavModel` is this family's `GenModel`: streaming chunks go through
`Qwen2_5OmniCode2WavDecoder` (code2wav_graphs.py: fixed-shape padded windows; on CUDA, graphs
per (batch bucket, window width), one per RK4 interval of the ODE), so a step of later chunks
runs in parts of RK4 intervals (the engine's preempt_parts), first chunks going between."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omnistage.checkpoint import iter_tensors, load_parameters
from omnistage.config.schema import StageConfig
from omnistage.engine.gen import GenEngineConfig, GenRequest, GenStageWorker
from omnistage.engine.gen.graphs import BUCKETS
from omnistage.engine.kernels_ahead import KernelJob
from omnistage.models.qwen2_5_omni.code2wav_graphs import DecodeJob, Qwen2_5OmniCode2WavDecoder
from omnistage.models.qwen2_5_omni.code2wav_options import (VOCODER_DTYPES,
                                                            Qwen2_5OmniCode2WavOptions)
from omnistage.models.qwen2_5_omni.code2wav_plan import vocoder_lengths
from omnistage.models.qwen2_5_omni.code2wav_stream import (ODE_STEPS, Qwen2_5OmniCode2WavChunk,
                                                           Qwen2_5OmniCode2WavStream,
                                                           Qwen2_5OmniCode2WavStreamConfig)
from omnistage.models.qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav
from omnistage.models.qwen2_5_omni.token2wav_bigvgan import BigVGANLayout
from omnistage.models.qwen2_5_omni.token2wav_dit import Qwen2_5OmniDiTSpec
from omnistage.models.qwen2_5_omni.voices import MAX_VOICES
from omnistage.models.registry import register_model
from omnistage.runtime import startup

register_model("Qwen2_5OmniToken2Wav")(Qwen2_5OmniToken2Wav)


@dataclass
class Code2WavRequest(GenRequest):
    cond: torch.Tensor  # [enc_emb_dim] speaker vector (fp32, device)
    ref_mel: torch.Tensor  # [frames, 80] reference mel (fp32, device)
    seed: int
    codes: list[int] = field(default_factory=list)
    codes_finished: bool = False
    stream: Qwen2_5OmniCode2WavStream | None = None

    @property
    def next_chunk(self) -> int:
        """The chunk it decodes next (= chunks emitted)."""
        return self.outputs


@dataclass
class _HostAudio:
    """A step's chunks queued for the host: samples per chunk, one pinned buffer."""

    lengths: list[int]
    host: torch.Tensor


class Qwen2_5OmniCode2WavModel:
    """Qwen2.5-Omni code2wav as a GenModel (engine/gen/model.py); a step's batch is a list of
    Code2WavRequest, each at its next chunk."""

    def __init__(self, model: Qwen2_5OmniToken2Wav, device: torch.device,
                 stream_config: Qwen2_5OmniCode2WavStreamConfig | None,
                 decoder_options: dict[str, Any]) -> None:
        self.model, self.device = model, device
        self.stream_config = stream_config  # None = one-shot decode per utterance
        self.voices: dict[tuple, tuple[torch.Tensor, ...]] = {}  # see _voice_on_device
        self.decoder_options = decoder_options
        self._decoder: Qwen2_5OmniCode2WavDecoder | None = None

    @property
    def streaming(self) -> bool:
        return self.stream_config is not None

    @property
    def decoder(self) -> Qwen2_5OmniCode2WavDecoder:
        """The streaming decoder, built on first use (it snapshots the DiT's weights)."""
        if self._decoder is None:
            self._decoder = Qwen2_5OmniCode2WavDecoder(self.model, **self.decoder_options)
        return self._decoder

    def warmup(self, buckets: tuple[int, ...] | None = None, lazy: bool = False) -> None:
        if self.stream_config is not None:
            self.decoder.warmup(self.stream_config, buckets, lazy)

    def pending_captures(self) -> int:
        return 0 if self._decoder is None else self._decoder.pending_captures()

    def capture_next(self) -> object | None:
        return None if self._decoder is None else self._decoder.capture_next()

    # ---------------------------------------------------------------- requests
    def new_state(self, request: Code2WavRequest) -> Code2WavRequest:
        # the voice arrives on the host when the front end runs in another process
        request.cond, request.ref_mel = self._voice_on_device(request.cond, request.ref_mel)
        if self.stream_config is not None:
            request.stream = Qwen2_5OmniCode2WavStream(self.model, request.cond, request.ref_mel,
                                                       request.seed, self.stream_config)
        return request

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

    def add_input(self, req: Code2WavRequest, codes: list[int], finished: bool) -> None:
        if req.codes_finished:
            raise ValueError("code2wav: codes after the last one")
        req.codes.extend(codes)
        req.codes_finished = finished
        if req.stream is not None:
            req.stream.add_codes(codes, finished)

    def ready(self, req: Code2WavRequest) -> bool:
        if req.codes_finished and not req.codes:
            return True
        if req.stream is None:
            return req.codes_finished
        return req.stream.ready_chunks() > req.next_chunk

    def empty(self, req: Code2WavRequest) -> bool:
        return req.codes_finished and not req.codes

    def input_pending(self, req: Code2WavRequest) -> bool:
        return not req.codes_finished

    def done(self, req: Code2WavRequest) -> bool:
        return req.stream is None or req.stream.num_chunks() == req.next_chunk

    # ---------------------------------------------------------------- steps
    @staticmethod
    def _rows(batch: list[Code2WavRequest]) -> list[tuple[Qwen2_5OmniCode2WavStream, int]]:
        return [(r.stream, r.next_chunk) for r in batch]

    def batch_key(self, state: GenRequest) -> None:
        return None  # any chunks batch together (graphs bucket their widths)

    def batch_rows(self, state: GenRequest) -> int:
        return 1

    def is_held(self, batch: list[Code2WavRequest]) -> bool:
        return self.decoder.is_held(self._rows(batch))

    def intervals(self, batch: list[Code2WavRequest]) -> int:
        return ODE_STEPS - 1  # the ODE's RK4 intervals

    def run(self, batch: list[Code2WavRequest]) -> _HostAudio | list[torch.Tensor]:
        if self.stream_config is None:
            return self._whole_utterances(batch)
        return self._to_host(self.decoder.decode(self._rows(batch)))

    def begin(self, batch: list[Code2WavRequest], beside: bool) -> DecodeJob:
        return self.decoder.begin_job(self._rows(batch), beside)

    def advance(self, job: DecodeJob, intervals: int) -> bool:
        return self.decoder.advance(job, intervals)

    def finish(self, job: DecodeJob) -> _HostAudio:
        return self._to_host(self.decoder.finish(job))

    @staticmethod
    def _to_host(chunks: list[Qwen2_5OmniCode2WavChunk]) -> _HostAudio:
        wav = torch.cat([c.waveform.float() for c in chunks])
        # one copy into pinned memory: collect() reads it once the stream gets there
        host = torch.empty(wav.shape, dtype=wav.dtype, pin_memory=wav.is_cuda)
        host.copy_(wav, non_blocking=True)
        return _HostAudio([c.waveform.shape[0] for c in chunks], host)

    def _whole_utterances(self, batch: list[Code2WavRequest]) -> list[torch.Tensor]:
        dev = self.device
        codes = [torch.tensor(r.codes, dtype=torch.long, device=dev) for r in batch]
        noises = [Qwen2_5OmniToken2Wav.initial_noise(r.seed, 2 * len(r.codes)).to(dev)
                  for r in batch]
        _, wavs = self.model.generate(codes, [r.cond for r in batch], [r.ref_mel for r in batch],
                                      noises)
        return wavs

    def outputs(self, result: _HostAudio | list[torch.Tensor]) -> list[dict[str, np.ndarray]]:
        if not isinstance(result, _HostAudio):  # whole utterances
            return [{"audio": wav.float().cpu().numpy()} for wav in result]
        out, off = [], 0
        for n in result.lengths:
            out.append({"audio": result.host[off:off + n].numpy().copy()})
            off += n
        return out

    def drop_jobs(self) -> None:
        if self._decoder is not None:
            self._decoder.drop_jobs()

    def stats(self) -> dict[str, float]:
        return {} if self._decoder is None else self._decoder.stats()


def code2wav_worker(name: str, model: Qwen2_5OmniToken2Wav, device: torch.device,
                    stream_config: Qwen2_5OmniCode2WavStreamConfig | None,
                    config: GenEngineConfig | None = None,
                    options: Qwen2_5OmniCode2WavOptions | None = None) -> GenStageWorker:
    """The code2wav stage: the engine's worker over `Qwen2_5OmniCode2WavModel` (every
    scheduling decision is the engine's; `worker.model.decoder` is the streaming decoder).

    stream_config: the chunk schedule (None: one-shot per utterance; settable later as
    `worker.model.stream_config`); config: the engine's options (None: GenEngineConfig's
    defaults); options: the model's (dtypes, attention, BigVGAN kernel; its window is the
    pipeline's, resolved by build_code2wav_stage)."""
    config = config or GenEngineConfig()
    options = options or Qwen2_5OmniCode2WavOptions()
    model.code2wav_bigvgan_model.set_triton(options.bigvgan_triton)
    graphs = config.use_graphs(device)
    decoder_options = {"dit_dtype": options.dit_dtype_for(device),
                       "vocoder_dtype": options.vocoder_dtype_for(device),
                       "dit_attention": options.dit_attention, "cuda_graphs": graphs,
                       "compile": config.compile and graphs, "free_sms": config.free_sms}
    decoder = Qwen2_5OmniCode2WavModel(model, device, stream_config, decoder_options)
    with startup.phase("graphs"):  # the worker's warm-up: compiles and graph captures
        return GenStageWorker(name, decoder, device, config)


def token2wav_dtype(stage: StageConfig, dtype: torch.dtype) -> torch.dtype:
    """The token2wav's parameters: float32 unless the stage's YAML names a dtype."""
    return dtype if stage.dtype != "auto" else torch.float32


def build_code2wav_stage(path: Any, config: dict, stage: StageConfig, name: str,
                         device: torch.device, dtype: torch.dtype,
                         engine: GenEngineConfig, options: Qwen2_5OmniCode2WavOptions
                         ) -> GenStageWorker:
    """The pipeline's code2wav stage: the checkpoint's token2wav on `device`, on the engine."""
    with torch.device(device):
        token2wav = Qwen2_5OmniToken2Wav(config["token2wav_config"])
    prefix = "token2wav." if stage.checkpoint_prefix is None else stage.checkpoint_prefix
    with startup.phase("weights"):
        # (staged through pinned buffers and converted on the GPU: a bf16 checkpoint into the
        # float32 token2wav; every parameter filled, every tensor used, as strict loading)
        load_parameters(token2wav, iter_tensors(path, prefix), shown_prefix=prefix)
    token2wav.to(token2wav_dtype(stage, dtype)).eval()
    return code2wav_worker(name, token2wav, device, options.stream_config(device), engine,
                           options)


def code2wav_kernels_ahead(ctx: Any) -> list[KernelJob]:
    """The BigVGAN Snake kernel's variants that the warm-up's vocoder graphs launch, one job
    each, compiled ahead while the other stages load (engine/kernels_ahead.py; on a cold start
    they were 32 s of the 7B pipeline's load: benchmarks/results/
    qwen2_5_omni_pipeline_gpu_h200_cold_start_profile_session25_issue24_2026-11-29.json)."""
    engine, options = ctx.options["code2wav"]
    if ctx.device.type != "cuda" or options.bigvgan_triton == "off" \
            or not engine.use_graphs(ctx.device):
        return []
    stream = options.stream_config(ctx.device)
    if stream is None:  # one-shot: no graphs of fixed lengths
        return []
    from omnistage.models.qwen2_5_omni import bigvgan_triton  # triton: CUDA only
    variant = (bigvgan_triton.DEFAULT_VARIANT if options.bigvgan_triton == "auto"
               else options.bigvgan_triton)
    t2w = ctx.config["token2wav_config"]
    layout = BigVGANLayout.from_config(t2w.get("bigvgan_config") or {})
    block = Qwen2_5OmniDiTSpec.from_dict(t2w.get("dit_config") or {}).block_size
    param_dtype = token2wav_dtype(ctx.stage, ctx.dtype)
    vocoder = options.vocoder_dtype_for(ctx.device)
    x_dtype = param_dtype if vocoder == "float32" else VOCODER_DTYPES[vocoder]  # autocast's
    shapes: dict[tuple[int, ...], tuple[int, int, int]] = {}  # a shape per compiled variant
    for bucket in BUCKETS:
        for frames in vocoder_lengths(stream, block):
            for shape in sorted(layout.snake_shapes(bucket, frames)):
                shapes.setdefault(bigvgan_triton.variant_key(shape, variant), shape)
    return [KernelJob(bigvgan_triton.compile_ahead, (shape, variant, x_dtype, param_dtype))
            for shape in shapes.values()]
