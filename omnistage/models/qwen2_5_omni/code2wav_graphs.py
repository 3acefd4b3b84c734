"""Qwen2.5-Omni streaming code2wav at fixed shapes: padded windows, batch buckets, CUDA graphs.

`Qwen2_5OmniCode2WavDecoder.decode` gives the chunks of `decode_chunks_with_mel`, computed as:
  - DiT: each chunk's window is padded at its end to a fixed width (chunk 0's window width, or
    the full window, (past + chunk + future) blocks) and the batch to a bucket size; positions
    stay absolute and padded frames are masked out of attention (the DiT's only cross-frame op),
    so a padded row equals its window decoded alone. Edge chunks (windows clipped at frame 0 or
    at the utterance's end) are padded the same way: every chunk runs in a fixed shape. On CUDA
    the ODE (36 evaluations with CFG and the RK4 arithmetic) of one (bucket, width) is the
    window's preparation and one RK4 interval graph (twice: DiTGraph) replayed for each of the 9
    with its time step loaded before it, captured lazily into a shared memory pool; run back
    to back, or in parts with other shapes' graphs between them (begin_job). By default the
    DiT's step functions inside these graphs are inductor-compiled (code2wav_fast.
    _compiled_steps): norms, modulation, rotary, activations and residuals fuse around the
    GEMMs and attention, compiled once for all 22 layers and (after a dim first changes) every
    later (bucket, width), on one evaluation before the capture.
  - BigVGAN: its convs pad at the sequence's ends, so padding would change the result. Spans of
    the standard length (chunk + both overlaps) and chunk 0's span run as graphs per (bucket,
    length); other spans (the utterance's last chunk, tiny utterances) run eagerly.
On the CPU the same padding code runs, with no graphs (batch padding only when asked).
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict, deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from omnistage.engine.gen.graphs import BUCKETS, GraphCache, SegmentGraph, bucket_for

from .code2wav_fast import DiTGraph, DiTState, IntervalCursor, Qwen2_5OmniFastDiT
from .code2wav_options import DIT_DTYPES, VOCODER_DTYPES
from .code2wav_plan import (BESIDE_MIN_BUCKET, MAX_GRAPH_FRAMES, GraphKey, capture_plan,
                            vocoder_lengths, window_widths)
from .code2wav_stream import (GUIDANCE_SCALE, ODE_STEPS, SWAY_COEFFICIENT,
                              Qwen2_5OmniCode2WavChunk, Qwen2_5OmniCode2WavSpan,
                              Qwen2_5OmniCode2WavStream, Qwen2_5OmniCode2WavStreamConfig,
                              assemble_chunks, check_requests)
from .token2wav import Qwen2_5OmniToken2Wav
from .voices import MAX_VOICES

__all__ = ["BUCKETS", "DecodeJob", "Qwen2_5OmniCode2WavDecoder", "bucket_for", "capture_plan",
           "vocoder_lengths", "window_widths"]

DIT_INPUTS = ("noise", "codes", "spk", "cond", "start", "nvalid")  # FastDiT.sample's first


@contextmanager
def _matmul_tf32(on: bool):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on or old
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@dataclass
class DecodeJob:
    """A decode run in parts (Qwen2_5OmniCode2WavDecoder.begin_job / advance / finish): the
    DiT's RK4 intervals, then BigVGAN. Other decodes may run between the parts."""

    requests: list[tuple[Qwen2_5OmniCode2WavStream, int]]
    config: Qwen2_5OmniCode2WavStreamConfig
    spans: list[Qwen2_5OmniCode2WavSpan]
    key: tuple[int, int, bool]  # (bucket, width, beside) of its DiT
    graph: DiTGraph | None  # graphed: the DiT graph holding the state
    state: DiTState | None = None  # eager: the ODE state
    done: int = 0  # RK4 intervals run


class Qwen2_5OmniCode2WavDecoder:
    """Batched chunk decoder of streams (see the module docstring). Not thread-safe.

    dit_dtype: "float32" (default; equals the module path), "tf32" (float32 weights, TF32
    matmuls) or "bfloat16" (a bf16 copy of the DiT's GEMM weights; the ODE state stays fp32).
    cuda_graphs: None = on for CUDA. pad_batch: None = with graphs.
    compile: torch.compile the DiT inside the graphs; None = with graphs (the CPU path and
    ungraphed shapes stay eager).
    dit_attention: "block" (Triton) or "sdpa"; None = Qwen2_5OmniFastDiT's default.
    vocoder_dtype: BigVGAN's convs in "float32" (default; cuDNN's TF32 on CUDA), or "float16" /
    "bfloat16" (CUDA: autocast; the weights stay float32, the waveform comes back float32).
    free_sms: SMs that a decode `beside` other stages' work leaves to them (the AR stages'
    decode steps); 0 (default) = off; "auto" = a quarter of the GPU's (GraphCache).

    NOTE (free_sms): such a decode's DiT runs graphs of its own, captured on a CUDA green
    context's stream, which binds their kernels to the other SMs wherever they replay (a
    second graph per later-chunk shape); other decodes, and BigVGAN always, keep every SM
    (BigVGAN's cuDNN convs launch thread-block clusters that an SM subset cannot hold: "cluster
    misconfiguration" at capture, H100). Why: the DiT's big GEMMs fill every SM for their
    whole run, so a decode kernel beside them waits for each one, however high its stream's
    priority (measured: benchmarks/results/green_context_gpu_h100_2026-11-23.json). Alone, the
    DiT wants every SM: the caller says which case a decode is.
    """

    def __init__(self, model: Qwen2_5OmniToken2Wav, dit_dtype: str | torch.dtype | None = None,
                 cuda_graphs: bool | None = None, buckets: tuple[int, ...] = BUCKETS,
                 pad_batch: bool | None = None, max_graph_frames: int = MAX_GRAPH_FRAMES,
                 compile: bool | None = None, dit_attention: str | None = None,
                 vocoder_dtype: str | None = None, free_sms: int | str | None = None) -> None:
        p = next(model.parameters())
        self.model, self.device = model, p.device
        dit_dtype = dit_dtype or "float32"
        names = {v: k for k, v in DIT_DTYPES.items() if k != "tf32"}
        self.dtype_name = names.get(dit_dtype, dit_dtype) if isinstance(
            dit_dtype, torch.dtype) else str(dit_dtype)
        if self.dtype_name not in DIT_DTYPES:
            raise ValueError(f"dit_dtype: one of {sorted(DIT_DTYPES)}, got {dit_dtype!r}")
        if self.dtype_name != "float32" and self.device.type != "cuda":
            raise ValueError(f"dit_dtype: {self.dtype_name} needs a CUDA model")
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs: needs a CUDA model")
        if compile is None:
            compile = bool(cuda_graphs)
        if compile and not cuda_graphs:
            raise ValueError("compile: compiles the CUDA-graphed shapes; needs cuda_graphs")
        voc_dtype = vocoder_dtype or "float32"
        if voc_dtype not in VOCODER_DTYPES:
            raise ValueError(f"vocoder_dtype: one of {sorted(VOCODER_DTYPES)}, got {voc_dtype!r}")
        if voc_dtype != "float32" and self.device.type != "cuda":
            raise ValueError(f"vocoder_dtype: {voc_dtype} needs a CUDA model")
        # the engine's graph services: pool, private capture streams, green context, held shapes
        self.graphs = GraphCache(self.device, bool(cuda_graphs), tuple(buckets),
                                 0 if free_sms is None else free_sms, BESIDE_MIN_BUCKET,
                                 name="code2wav")
        self.compile = bool(compile)
        self.pad_batch = self.use_graphs if pad_batch is None else bool(pad_batch)
        self.max_graph_frames = int(max_graph_frames)
        self.fast = Qwen2_5OmniFastDiT(model.code2wav_dit_model, DIT_DTYPES[self.dtype_name],
                                       ODE_STEPS, GUIDANCE_SCALE, SWAY_COEFFICIENT,
                                       dit_attention)
        self.tf32 = self.dtype_name == "tf32"
        self.vocoder_dtype = voc_dtype
        self.spec, self.block = model.spec, model.spec.block_size
        # voice memory -> (its ref_mel, speaker encodings): see speaker()
        self.speakers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.noises: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # (bucket, width, beside) -> graph; beside: on the SMs free_sms leaves (see NOTE)
        self.dit_graphs: dict[tuple[int, int, bool], DiTGraph] = {}
        self.voc_graphs: dict[tuple[int, int], SegmentGraph] = {}
        # lazy warm-up (warmup(lazy=True)): graphs not captured yet run on a captured larger
        # bucket or eagerly, never captured inside a step; capture_next() takes them in order
        self.lazy = False
        self.later: deque[GraphKey] = deque()
        self.later_captured, self.later_seconds = 0, 0.0
        # queued graphs steps needed and ran without (a larger bucket or eagerly) -> how many
        # times: capture_next() takes them first, `beside` ones before the rest
        self.wanted: dict[GraphKey, int] = {}

    # the graph services' state, by the names the decoder has always shown
    use_graphs = property(lambda self: self.graphs.enabled)
    buckets = property(lambda self: self.graphs.buckets)
    pool = property(lambda self: self.graphs.pool)
    capture_stream = property(lambda self: self.graphs.capture_stream)
    beside_capture_stream = property(lambda self: self.graphs.beside_capture_stream)
    green_context = property(lambda self: self.graphs.green_context)
    free_sms = property(lambda self: self.graphs.free_sms)
    _live = property(lambda self: self.graphs.held)  # graphed DiT shapes held by jobs

    # ------------------------------------------------------------------ host-side planning
    def plan(self, widths_needed: list[int], config: Qwen2_5OmniCode2WavStreamConfig
             ) -> list[tuple[list[int], int, int]]:
        """Rows (by their window widths) -> batches [(row indices, bucket, width)].

        Rows are cut into runs of at most max(buckets); a run's width is the smallest fixed
        width that holds its widest window, or that window rounded up to a block when the
        fixed widths are over max_graph_frames (no padding to a huge window then).
        """
        fixed = [w for w in window_widths(config, self.block) if w <= self.max_graph_frames]
        out, top = [], self.buckets[-1]
        for i in range(0, len(widths_needed), top):
            idx = list(range(i, min(i + top, len(widths_needed))))
            need = max(widths_needed[j] for j in idx)
            width = next((w for w in fixed if w >= need), -(-need // self.block) * self.block)
            bucket = self.graphs.bucket(len(idx)) if self.pad_batch else len(idx)
            out.append((idx, bucket, width))
        return out

    def speaker(self, stream: Qwen2_5OmniCode2WavStream) -> torch.Tensor:
        """The stream's speaker encodings [2, enc_dim] (ref_mel, zeros): once per voice.

        NOTE: keyed by the ref_mel's memory (address, shape, strides; voices are read-only), the
        tensor held in the entry so that its memory cannot be reused meanwhile: streams of one
        voice share the stage's device copy of it (Qwen2_5OmniCode2WavModel.new_state), so a voice
        costs its two ECAPA-TDNN runs (~90 small eager kernels each) once, not on every
        request's first-chunk step.
        """
        ref = stream.ref_mel
        key = (ref.device, ref.data_ptr(), tuple(ref.shape), ref.stride(), ref.dtype)
        hit = self.speakers.get(key)
        if hit is not None:
            return hit[1]
        enc = self.model.code2wav_dit_model.input_embed.spk_encoder
        mel = ref.to(self.device, self.fast.w_in_static.dtype)
        spk = torch.cat([enc(mel), enc(torch.zeros_like(mel))])
        if len(self.speakers) >= MAX_VOICES:  # bounded: the oldest voice goes
            del self.speakers[next(iter(self.speakers))]
        self.speakers[key] = (ref, spk)
        return spk

    def new_dit_inputs(self, bucket: int, width: int) -> dict[str, torch.Tensor]:
        spec, dev, fdt = self.spec, self.device, self.fast.w_in_static.dtype
        return {"noise": torch.zeros(bucket, width, spec.mel_dim, device=dev),
                "codes": torch.zeros(bucket, width // spec.repeats, dtype=torch.long, device=dev),
                "spk": torch.zeros(bucket, 2, spec.enc_dim, device=dev, dtype=fdt),
                "cond": torch.zeros(bucket, spec.enc_emb_dim, device=dev, dtype=fdt),
                "start": torch.zeros(bucket, dtype=torch.long, device=dev),
                "nvalid": torch.zeros(bucket, dtype=torch.long, device=dev)}

    def fill_dit_inputs(self, buf: dict[str, torch.Tensor],
                        rows: list[tuple[Qwen2_5OmniCode2WavStream, int]]) -> None:
        """Write the rows' windows into the (bucket, width) buffers; the rest is padding."""
        bucket, width = buf["noise"].shape[:2]
        rep, n = self.spec.repeats, len(rows)
        noise = torch.zeros(bucket, width, self.spec.mel_dim)
        codes = torch.zeros(bucket, width // rep, dtype=torch.long)
        start, nvalid = torch.zeros(bucket, dtype=torch.long), torch.zeros(bucket, dtype=torch.long)
        for r, (stream, k) in enumerate(rows):
            w0, w1 = stream.span(k).window
            noise[r, :w1 - w0] = self.noise(stream, w1)[w0:w1]
            codes[r, :(w1 - w0) // rep] = torch.tensor(stream.codes[w0 // rep:w1 // rep])
            start[r], nvalid[r] = w0, w1 - w0
        for name, t in (("noise", noise), ("codes", codes), ("start", start), ("nvalid", nvalid)):
            buf[name].copy_(t, non_blocking=True)
        # padding rows get zeros: finite, and masked out
        buf["spk"][n:].zero_()
        buf["cond"][n:].zero_()
        buf["spk"][:n] = torch.stack([self.speaker(s) for s, _ in rows])
        buf["cond"][:n] = torch.cat([s.cond.to(buf["cond"]) for s, _ in rows])

    def noise(self, stream: Qwen2_5OmniCode2WavStream, frames: int) -> torch.Tensor:
        """The stream's initial noise, at least [frames, M], on the CPU: drawn once per doubling.

        NOTE: a prefix of a longer draw equals the shorter draw (Qwen2_5OmniToken2Wav.
        initial_noise), so the cache never changes a frame's noise.
        """
        z = self.noises.get(stream)
        if z is None or z.shape[0] < frames:
            grown = min(stream.max_frames, max(2 * (0 if z is None else z.shape[0]), 256))
            n = max(frames, grown)
            z = Qwen2_5OmniToken2Wav.initial_noise(stream.seed, n, self.spec.mel_dim, max_frames=n)
            self.noises[stream] = z
        return z

    def _dit(self, buf: dict[str, torch.Tensor], compiled: bool = False) -> torch.Tensor:
        with _matmul_tf32(self.tf32):
            return self.fast.sample(*(buf[k] for k in DIT_INPUTS), compiled)

    # ------------------------------------------------------------------ graphs
    def dit_graph(self, bucket: int, width: int, beside: bool = False) -> DiTGraph:
        """The DiT graph of (bucket, width), captured on first use (beside: the one on the SMs
        that free_sms leaves; the same as beside=False when free_sms is 0)."""
        key = self._key(bucket, width, beside)
        g = self.dit_graphs.get(key)
        if g is None:
            g = DiTGraph(self.new_dit_inputs(bucket, width), IntervalCursor(self.fast))
            if self.compile:
                self._compile_or_fall_back(g.inputs)
            # the window's preparation, then one RK4 interval that reads its time step from
            # g.cursor: a step can run in parts with other graphs between them (begin_job);
            # back to back they cost the same as one graph (measured: benchmarks/results/
            # code2wav_gpu_h100_overlap_*.json)
            g.cursor.load(0)  # (the interval's warm-up run reads some interval's inputs)
            # warm-up runs only where something is left to settle: compile_for has just run
            # this shape's preparation and compiled DiT (its cuBLAS and Triton kernels loaded)
            # and an earlier graph the rest (the driver loads kernels during a capture since
            # CUDA 12.3); the interval's second copy never (the first one's capture was it)
            settled = self.compile and bool(self.dit_graphs)
            for capture, warm in ((self._dit_begin, not settled),
                                  (self._dit_interval, not settled),
                                  (self._dit_interval, False)):
                graph, _ = self.graphs.capture(lambda capture=capture: capture(g),
                                               ("dit", bucket, width), key[2], warm)
                g.segments.append(graph)
            g.output = g.state.x
            self.dit_graphs[key] = g
        return g

    def dit_target(self, bucket: int, width: int, beside: bool = False
                   ) -> tuple[int, int, bool] | None:
        """The DiT graph key that runs a (bucket, width, beside) batch; None: eagerly. Host
        logic only. Not lazy: its own key (captured on first use, if need be). Lazy: its own
        key if captured, else (beside) the same shape on every SM, else the smallest captured
        larger bucket of that width (padding rows are masked out: the same rows' results)."""
        key = self._key(bucket, width, beside)
        if not self.lazy or key in self.dit_graphs:
            return key
        for b in (b for b in self.buckets if b >= bucket):
            for side in dict.fromkeys((beside, False)):
                k = self._key(b, width, side)
                if k in self.dit_graphs:
                    return k
        return None

    def voc_target(self, bucket: int, length: int) -> tuple[int, int] | None:
        """The vocoder graph key of a (bucket, length) batch (as dit_target); None: eagerly."""
        if not self.lazy or (bucket, length) in self.voc_graphs:
            return bucket, length
        self._want(("vocoder", bucket, length))
        return next(((b, length) for b in self.buckets
                     if b >= bucket and (b, length) in self.voc_graphs), None)

    def _dit_begin(self, g: DiTGraph) -> torch.Tensor:
        # the captured run leaves g.state in the graph pool, where the interval graph reads
        # and writes it
        with _matmul_tf32(self.tf32):
            g.state = self.fast.begin(*(g.inputs[k] for k in DIT_INPUTS))
        return g.state.x

    def _dit_interval(self, g: DiTGraph) -> torch.Tensor:
        # (no load here: the graph must read the cursor, not refill it)
        with _matmul_tf32(self.tf32):
            return self.fast.interval(g.state, 0, self.compile, g.cursor)

    def _compile_or_fall_back(self, inputs: dict[str, torch.Tensor]) -> None:
        # compile this shape before the capture; where inductor cannot build, the graphs stay
        # uncompiled (GraphCache.compile_or_fall_back warns)
        def compile_run() -> None:
            with _matmul_tf32(self.tf32):
                self.fast.compile_for(*(inputs[k] for k in DIT_INPUTS))

        if not self.graphs.compile_or_fall_back(compile_run, "the DiT"):
            self.compile = False

    def voc_graph(self, bucket: int, length: int) -> SegmentGraph:
        g = self.voc_graphs.get((bucket, length))
        if g is None:
            p = next(self.model.code2wav_bigvgan_model.parameters())
            mel = torch.zeros(bucket, self.spec.mel_dim, length, device=self.device,
                              dtype=p.dtype)
            g = SegmentGraph({"mel": mel})
            graph, g.output = self.graphs.capture(lambda: self._vocoder(g.inputs["mel"]),
                                                  ("vocoder", bucket, length))
            g.segments.append(graph)
            self.voc_graphs[(bucket, length)] = g
        return g

    # ------------------------------------------------------------------ decode
    def sample_windows(self, rows: list[tuple[Qwen2_5OmniCode2WavStream, int]],
                       config: Qwen2_5OmniCode2WavStreamConfig, beside: bool = False
                       ) -> list[torch.Tensor]:
        """Each row's window mel [W_i, M] float32 (owned copies, not graph buffers)."""
        widths = [w1 - w0 for w0, w1 in (s.span(k).window for s, k in rows)]
        mels: list[torch.Tensor] = [torch.empty(0)] * len(rows)
        for idx, bucket, width in self.plan(widths, config):
            part = [rows[i] for i in idx]
            target = self._graphed(bucket, width, beside)
            if target is not None:
                g = self.dit_graph(*target)
                self.graphs.claim(self._key(*target), None)
                self.fill_dit_inputs(g.inputs, part)
                g.replay()
                out = g.output
            else:
                buf = self.new_dit_inputs(bucket, width)
                self.fill_dit_inputs(buf, part)
                out = self._dit(buf)
            for j, i in enumerate(idx):
                mels[i] = out[j, :widths[i]].clone()
        return mels

    def _vocoder(self, mel: torch.Tensor) -> torch.Tensor:
        """BigVGAN on mel [B, M, L] with its convs in vocoder_dtype -> waveform [B, L hop]."""
        voc = self.model.code2wav_bigvgan_model
        if self.vocoder_dtype == "float32":
            return voc(mel)
        # no weight cache: a graph captures the casts (they cost ~0.3 ms, not a stale copy)
        with torch.autocast("cuda", VOCODER_DTYPES[self.vocoder_dtype], cache_enabled=False):
            return voc(mel).float()

    def vocode(self, spans: list[Qwen2_5OmniCode2WavSpan], mels: list[torch.Tensor],
               config: Qwen2_5OmniCode2WavStreamConfig) -> list[torch.Tensor]:
        """Each row's vocoder span -> waveform [V_i * hop] float32 (owned)."""
        p = next(self.model.code2wav_bigvgan_model.parameters())
        by_len: dict[int, list[int]] = defaultdict(list)
        for i, sp in enumerate(spans):
            by_len[sp.vocoder[1] - sp.vocoder[0]].append(i)
        graphed = vocoder_lengths(config, self.block) if self.use_graphs else ()
        wavs: list[torch.Tensor] = [torch.empty(0)] * len(spans)
        for length, idx in by_len.items():
            for c in range(0, len(idx), self.buckets[-1]):
                part = idx[c:c + self.buckets[-1]]
                ins = [mels[i][spans[i].vocoder[0] - spans[i].window[0]:
                               spans[i].vocoder[1] - spans[i].window[0]].T for i in part]
                target = (self.voc_target(self.graphs.bucket(len(part)), length)
                          if length in graphed else None)
                if target is not None:
                    g = self.voc_graph(*target)
                    for j, m in enumerate(ins):
                        g.inputs["mel"][j].copy_(m)
                    g.replay()
                    out = g.output
                else:
                    out = self._vocoder(torch.stack(ins).to(p.dtype))
                for j, i in enumerate(part):
                    wavs[i] = out[j].float().clone()
        return wavs

    @torch.inference_mode()
    def decode(self, requests: list[tuple[Qwen2_5OmniCode2WavStream, int]],
               beside: bool = False) -> list[Qwen2_5OmniCode2WavChunk]:
        """Chunk k of each (stream, k): the chunks of `decode_chunks_with_mel` (all streams of
        one stream config). beside: other stages run beside it (free_sms). Mutates nothing but
        this decoder's caches."""
        check_requests(self.model, requests)
        if not requests:
            return []
        config = self._one_config(requests)
        spans = [s.span(k) for s, k in requests]
        with self._on_device():
            mels = self.sample_windows(list(requests), config, beside)
            wavs = self.vocode(spans, mels, config)
        return assemble_chunks(self.model, list(requests), spans, mels, wavs)

    # ------------------------------------------------------------------ decode in parts
    @torch.inference_mode()
    def begin_job(self, requests: list[tuple[Qwen2_5OmniCode2WavStream, int]],
                  beside: bool = False) -> DecodeJob:
        """A decode of up to max(buckets) chunks (one DiT batch) that advance() runs in parts;
        finish() gives decode()'s chunks. Until then its DiT shape (bucket, width) is taken:
        decode() and begin_job() raise ValueError on it."""
        check_requests(self.model, requests)
        if not requests or len(requests) > self.buckets[-1]:
            raise ValueError(f"requests: a job holds 1 to {self.buckets[-1]} chunks, got "
                             f"{len(requests)}")
        config = self._one_config(requests)
        rows = list(requests)
        spans = [s.span(k) for s, k in rows]
        widths = [w1 - w0 for w0, w1 in (sp.window for sp in spans)]
        (_, bucket, width), = self.plan(widths, config)
        with self._on_device():
            target = self._graphed(bucket, width, beside)
            if target is not None:
                g = self.dit_graph(*target)
                job = DecodeJob(rows, config, spans, self._key(*target), g)
                self.graphs.claim(job.key, job)
                self.fill_dit_inputs(g.inputs, rows)
                return job
            buf = self.new_dit_inputs(bucket, width)
            self.fill_dit_inputs(buf, rows)
            with _matmul_tf32(self.tf32):
                state = self.fast.begin(*(buf[k] for k in DIT_INPUTS))
        return DecodeJob(rows, config, spans, self._key(bucket, width, beside), None, state)

    @torch.inference_mode()
    def advance(self, job: DecodeJob, intervals: int) -> bool:
        """Queue up to `intervals` more of the job's RK4 intervals; True once all are queued."""
        total = len(self.fast.widths)
        with self._on_device():
            for i in range(job.done, min(total, job.done + max(1, intervals))):
                if job.graph is not None:
                    job.graph.run_interval(i)
                else:
                    with _matmul_tf32(self.tf32):
                        self.fast.interval(job.state, i)
                job.done = i + 1
        return job.done == total

    @torch.inference_mode()
    def finish(self, job: DecodeJob) -> list[Qwen2_5OmniCode2WavChunk]:
        """The job's chunks (its DiT done: advance returned True); frees its DiT shape."""
        if job.done != len(self.fast.widths):
            raise ValueError(f"job: {job.done} of {len(self.fast.widths)} intervals run")
        with self._on_device():
            x = job.graph.state.x if job.graph is not None else job.state.x
            mels = [x[j, :w1 - w0].clone() for j, (w0, w1) in
                    enumerate(sp.window for sp in job.spans)]
            if job.graph is not None:  # (an eager job holds no shape)
                self.graphs.release(job.key)
            wavs = self.vocode(job.spans, mels, job.config)
        return assemble_chunks(self.model, job.requests, job.spans, mels, wavs)

    def is_held(self, requests: list[tuple[Qwen2_5OmniCode2WavStream, int]],
                beside: bool = False) -> bool:
        """Whether decode(requests, beside) needs a graphed DiT shape that an unfinished job
        holds (it would raise ValueError). Host logic only."""
        if not self._live or not requests:
            return False
        config = requests[0][0].config
        widths = [w1 - w0 for w0, w1 in (s.span(k).window for s, k in requests)]
        # (the routing of _graphed, whether or not graphs are on: held shapes are graphed)
        targets = (self.dit_target(bucket, width, beside) if width <= self.max_graph_frames
                   else None for _, bucket, width in self.plan(widths, config))
        return any(t is not None and self.graphs.is_held(self._key(*t)) for t in targets)

    def drop_jobs(self) -> None:
        """Forget unfinished jobs (their stage failed): their DiT shapes serve decodes again."""
        self.graphs.drop_held()

    def _graphed(self, bucket: int, width: int, beside: bool) -> tuple[int, int, bool] | None:
        # the graph that runs this DiT batch, None: eagerly (no graphs, too wide, lazy)
        if not self.use_graphs or width > self.max_graph_frames:
            return None
        key = self._key(bucket, width, beside)
        if self.lazy and key not in self.dit_graphs:
            self._want(("dit", *key))
        return self.dit_target(bucket, width, beside)

    def _want(self, key: GraphKey) -> None:
        self.wanted[key] = self.wanted.get(key, 0) + 1

    def _key(self, bucket: int, width: int, beside: bool) -> tuple[int, int, bool]:
        # below BESIDE_MIN_BUCKET the DiT's small kernels leave SMs idle anyway: every SM
        return self.graphs.key(bucket, width, beside)

    @staticmethod
    def _one_config(requests: list[tuple[Qwen2_5OmniCode2WavStream, int]]
                    ) -> Qwen2_5OmniCode2WavStreamConfig:
        config = requests[0][0].config
        if any(s.config != config for s, _ in requests):
            raise ValueError("requests: all streams of one batch need the same stream config")
        return config

    def _on_device(self):
        # graphs are captured and replayed with the model's GPU as the current device
        return torch.cuda.device(self.device) if self.use_graphs else nullcontext()

    @torch.inference_mode()
    def warmup(self, config: Qwen2_5OmniCode2WavStreamConfig,
               buckets: tuple[int, ...] | None = None, lazy: bool = False) -> None:
        """Capture the graphs of these buckets (default: all) for this stream config now; lazy:
        only those of a first request (capture_plan), the rest queued for capture_next()."""
        if not self.use_graphs:
            return
        sizes = tuple(sorted({self.graphs.bucket(b) for b in buckets or self.buckets}))
        beside = BESIDE_MIN_BUCKET if self.free_sms > 0 else None
        now, later = capture_plan(config, self.block, sizes, self.max_graph_frames, beside, lazy)
        self.lazy = self.lazy or lazy
        with self._on_device():
            for key in now:
                self._capture(key)
        self.later = deque(k for k in later if not self.captured(k))
        self.wanted.clear()

    def _normal(self, key: GraphKey) -> GraphKey:
        # a queued key as _want() records it (the DiT's `beside` as _key routes it)
        return ("dit", *self._key(*key[1:])) if key[0] == "dit" else key

    def captured(self, key: GraphKey) -> bool:
        if key[0] == "dit":
            return self._key(*key[1:]) in self.dit_graphs
        return key[1:] in self.voc_graphs

    def _capture(self, key: GraphKey) -> None:
        if key[0] == "dit":
            self.dit_graph(*key[1:])
        else:
            self.voc_graph(*key[1:])

    def pending_captures(self) -> int:
        """Graphs queued by a lazy warm-up that capture_next() has not taken yet."""
        return len(self.later)

    @torch.inference_mode()
    def capture_next(self) -> GraphKey | None:
        """Capture a queued graph (None: none left): the one steps needed most (wanted), else
        the next in order; one graph, seconds at most with its compile. Call it on the thread
        that runs this decoder's steps, between steps (no job in progress): a capture must not
        interleave with the steps' graphs on this decoder."""
        self.later = deque(k for k in self.later if not self.captured(k))
        if not self.later or self._live:
            return None
        wanted = [k for k in self.later if self._normal(k) in self.wanted]
        # NOTE (beside first): without its beside graph a wide step runs eagerly on every SM
        # and slows the AR stages beside it (the talker: 7.7 against 5.0-5.3 ms per step at
        # c32 on the H200, benchmarks/results/
        # qwen2_5_omni_pipeline_gpu_h200_captures_under_load_session22_issue24_2026-11-28.json)
        key = (max(wanted, key=lambda k: (k[0] == "dit" and self._normal(k)[3],
                                          self.wanted[self._normal(k)])) if wanted
               else self.later[0])
        self.later.remove(key)  # (taken first: a capture that raised is not retried)
        self.wanted.pop(self._normal(key), None)
        t0 = time.perf_counter()
        with self._on_device():
            self._capture(key)
        self.later_captured += 1
        self.later_seconds += time.perf_counter() - t0
        return key

    def stats(self) -> dict[str, float]:
        """Graph counts and the graph services' times and pool memory (GraphCache.stats)."""
        return {"dit_graphs": len(self.dit_graphs), "vocoder_graphs": len(self.voc_graphs),
                "compiled": self.compile, "captures_pending": len(self.later),
                "captured_later": self.later_captured,
                "captured_later_seconds": round(self.later_seconds, 3), **self.graphs.stats()}
