"""Qwen2.5-Omni streaming code2wav at fixed shapes: padded windows, batch buckets, CUDA graphs.

`Qwen2_5OmniCode2WavDecoder.decode` gives the chunks of `decode_chunks_with_mel`, computed as:
  - DiT: each chunk's window is padded at its end to a fixed width (chunk 0's window width, or
    the full window, (past + chunk + future) blocks) and the batch to a bucket size; positions
    stay absolute and padded frames are masked out of attention (the DiT's only cross-frame op),
    so a padded row equals its window decoded alone. Edge chunks (windows clipped at frame 0 or
    at the utterance's end) are padded the same way: every chunk runs in a fixed shape. On CUDA
    the ODE (36 evaluations with CFG and the RK4 arithmetic) of one (bucket, width) is one CUDA
    graph per RK4 interval (9), captured lazily into a shared memory pool; run back to back, or
    in parts with other shapes' graphs between them (begin_job). By default the DiT's step functions
    inside these graphs are inductor-compiled (code2wav_fast._compiled_steps): norms, modulation,
    rotary, activations and residuals fuse around the GEMMs and attention, one compile per
    (bucket, width) shared by all 22 layers, done in the warm-up run before the capture.
  - BigVGAN: its convs pad at the sequence's ends, so padding would change the result. Spans of
    the standard length (chunk + both overlaps) and chunk 0's span run as graphs per (bucket,
    length); other spans (the utterance's last chunk, tiny utterances) run eagerly.
On the CPU the same padding code runs, with no graphs (batch padding only when asked).
"""

from __future__ import annotations

import os
import time
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from omnistage.engine.ar.cuda_graphs import green_context_stream, private_stream

from .code2wav_fast import DTYPES, DiTState, Qwen2_5OmniFastDiT
from .code2wav_stream import (GUIDANCE_SCALE, ODE_STEPS, SWAY_COEFFICIENT,
                              Qwen2_5OmniCode2WavChunk, Qwen2_5OmniCode2WavSpan,
                              Qwen2_5OmniCode2WavStream, Qwen2_5OmniCode2WavStreamConfig,
                              assemble_chunks, check_requests)
from .token2wav import Qwen2_5OmniToken2Wav
from .voices import MAX_VOICES

BUCKETS = (1, 2, 4, 8, 16, 32)
# windows wider than this (e.g. whole-utterance windows) are not padded; 672 = 28 blocks holds a
# 24-block chunk's window (past 2 + 24 + future 1)
MAX_GRAPH_FRAMES = 672
DIT_INPUTS = ("noise", "codes", "spk", "cond", "start", "nvalid")  # FastDiT.sample's first
# the smallest DiT batch that runs on the green context beside other stages (H100, c1: RTF
# 0.123 with batch-1 steps beside the talker on 100 SMs vs 0.121 on all 132; c8 39.5 vs 37.4
# audio-s/s with batch-8 steps beside it)
BESIDE_MIN_BUCKET = 8
VOCODER_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                  "bfloat16": torch.bfloat16}


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n (n <= max(buckets))."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"batch: {n} rows exceed the largest bucket {max(buckets)}")


def first_window_width(config: Qwen2_5OmniCode2WavStreamConfig, block: int) -> int:
    """Chunk 0's DiT window (frames) before clipping: its blocks and the future blocks."""
    return (config.first_blocks + config.future_blocks) * block


def window_widths(config: Qwen2_5OmniCode2WavStreamConfig, block: int) -> tuple[int, ...]:
    """The fixed DiT widths (frames): chunk 0's unclipped window, the full window, and the
    windows of a half and a quarter chunk.

    NOTE: an utterance's last chunk holds what is left (1 frame to a whole chunk, no future
    context): padded to the full window, the last chunk of 12-block chunks often costs a whole
    360-frame step for a few frames; the half and quarter widths cut that waste.
    """
    context = (config.past_blocks + config.future_blocks) * block
    first = first_window_width(config, block)
    chunks = {max(config.chunk_blocks, config.first_blocks), config.chunk_blocks // 2,
              config.chunk_blocks // 4}
    return tuple(sorted({first} | {context + n * block for n in chunks if n > 0}))


def vocoder_lengths(config: Qwen2_5OmniCode2WavStreamConfig, block: int) -> tuple[int, ...]:
    """The BigVGAN span lengths run as graphs: a later chunk's and chunk 0's (unclipped)."""
    ov_past = min(config.vocoder_overlap_frames, config.past_blocks * block)
    ov_future = min(config.vocoder_overlap_frames, config.future_blocks * block)
    return tuple(sorted({ov_past + config.chunk_blocks * block + ov_future,
                         config.first_blocks * block + ov_future}))


@contextmanager
def _matmul_tf32(on: bool):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on or old
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


class _Graph:
    """One captured callable with its static input buffers and output; a DiT graph is one
    graph per RK4 interval (segments), its ODE state kept in state between them."""

    def __init__(self, inputs: dict[str, torch.Tensor]) -> None:
        self.inputs, self.graph, self.output = inputs, None, None
        self.segments: list[torch.cuda.CUDAGraph] = []
        self.state: DiTState | None = None

    def replay(self) -> None:
        for graph in self.segments or [self.graph]:
            graph.replay()


@dataclass
class DecodeJob:
    """A decode run in parts (Qwen2_5OmniCode2WavDecoder.begin_job / advance / finish): the
    DiT's RK4 intervals, then BigVGAN. Other decodes may run between the parts."""

    requests: list[tuple[Qwen2_5OmniCode2WavStream, int]]
    config: Qwen2_5OmniCode2WavStreamConfig
    spans: list[Qwen2_5OmniCode2WavSpan]
    key: tuple[int, int, bool]  # (bucket, width, beside) of its DiT
    graph: _Graph | None  # graphed: the DiT graph holding the state
    state: DiTState | None = None  # eager: the ODE state
    done: int = 0  # RK4 intervals run


class Qwen2_5OmniCode2WavDecoder:
    """Batched chunk decoder of streams (see the module docstring). Not thread-safe.

    dit_dtype: "float32" (default; equals the module path), "tf32" (float32 weights, TF32
    matmuls) or "bfloat16" (a bf16 copy of the DiT's GEMM weights; the ODE state stays fp32).
    cuda_graphs: None = on for CUDA unless OMNISTAGE_CUDA_GRAPHS=0. pad_batch: None = with graphs.
    compile: torch.compile the DiT inside the graphs; None = with graphs unless
    OMNISTAGE_CODE2WAV_COMPILE=0 (the CPU path and ungraphed shapes stay eager).
    dit_attention: "block" (Triton) or "sdpa"; None = Qwen2_5OmniFastDiT's default.
    vocoder_dtype: BigVGAN's convs in "float32" (default; cuDNN's TF32 on CUDA), or "float16" /
    "bfloat16" (CUDA: autocast; the weights stay float32, the waveform comes back float32);
    None = $OMNISTAGE_CODE2WAV_VOCODER_DTYPE or float32.
    free_sms: SMs that a decode `beside` other stages' work leaves to them (the AR stages'
    decode steps); 0 = off; "auto" = a quarter of the GPU's, in multiples of 8 (H100: 32; 0
    with a warning where green contexts are missing); None = $OMNISTAGE_CODE2WAV_FREE_SMS or 0.

    NOTE (free_sms): such a decode's DiT runs graphs of its own, captured on a CUDA green
    context's stream, which binds their kernels to the other SMs wherever they replay (a
    second graph per later-chunk shape); other decodes, and BigVGAN always, keep every SM
    (BigVGAN's cuDNN convs launch thread-block clusters that an SM subset cannot hold: "cluster
    misconfiguration" at capture, H100). Why: the DiT's big GEMMs fill every SM for their
    whole run, so a decode kernel beside them waits for each one, however high its stream's
    priority (benchmarks/green_context_gpu.py, H100: a talker-sized probe step of 1.1 ms took
    15.9 ms beside big GEMMs; with 16 / 32 / 48 SMs left free, 6.5 / 2.3 / 1.8 ms, the GEMMs
    ~10% / ~25% / ~30% slower). Alone, the DiT wants every SM: the caller says which case a
    decode is.
    """

    def __init__(self, model: Qwen2_5OmniToken2Wav, dit_dtype: str | torch.dtype | None = None,
                 cuda_graphs: bool | None = None, buckets: tuple[int, ...] = BUCKETS,
                 pad_batch: bool | None = None, max_graph_frames: int = MAX_GRAPH_FRAMES,
                 compile: bool | None = None, dit_attention: str | None = None,
                 vocoder_dtype: str | None = None, free_sms: int | str | None = None) -> None:
        p = next(model.parameters())
        self.model, self.device = model, p.device
        dit_dtype = dit_dtype or os.environ.get("OMNISTAGE_CODE2WAV_DIT_DTYPE", "float32")
        names = {v: k for k, v in DTYPES.items() if k != "tf32"}
        self.dtype_name = names.get(dit_dtype, dit_dtype) if isinstance(
            dit_dtype, torch.dtype) else str(dit_dtype)
        if self.dtype_name not in DTYPES:
            raise ValueError(f"dit_dtype: one of {sorted(DTYPES)}, got {dit_dtype!r}")
        if self.dtype_name != "float32" and self.device.type != "cuda":
            raise ValueError(f"dit_dtype: {self.dtype_name} needs a CUDA model")
        if not buckets or sorted(set(buckets)) != list(buckets) or buckets[0] < 1:
            raise ValueError(f"buckets: increasing positive ints, got {buckets!r}")
        if cuda_graphs is None:
            cuda_graphs = (self.device.type == "cuda"
                           and os.environ.get("OMNISTAGE_CUDA_GRAPHS", "1") != "0")
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs: needs a CUDA model")
        self.use_graphs, self.buckets = bool(cuda_graphs), tuple(buckets)
        if compile is None:
            compile = self.use_graphs and os.environ.get("OMNISTAGE_CODE2WAV_COMPILE", "1") != "0"
        if compile and not self.use_graphs:
            raise ValueError("compile: compiles the CUDA-graphed shapes; needs cuda_graphs")
        self.compile = bool(compile)
        self.pad_batch = self.use_graphs if pad_batch is None else bool(pad_batch)
        self.max_graph_frames = int(max_graph_frames)
        self.fast = Qwen2_5OmniFastDiT(model.code2wav_dit_model, DTYPES[self.dtype_name],
                                       ODE_STEPS, GUIDANCE_SCALE, SWAY_COEFFICIENT,
                                       dit_attention)
        self.tf32 = self.dtype_name == "tf32"
        voc_dtype = vocoder_dtype or os.environ.get("OMNISTAGE_CODE2WAV_VOCODER_DTYPE", "float32")
        if voc_dtype not in VOCODER_DTYPES:
            raise ValueError(f"vocoder_dtype: one of {sorted(VOCODER_DTYPES)}, got {voc_dtype!r}")
        if voc_dtype != "float32" and self.device.type != "cuda":
            raise ValueError(f"vocoder_dtype: {voc_dtype} needs a CUDA model")
        self.vocoder_dtype = voc_dtype
        self.spec, self.block = model.spec, model.spec.block_size
        # voice memory -> (its ref_mel, speaker encodings): see speaker()
        self.speakers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.noises: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # (bucket, width, beside) -> graph; beside: on the SMs free_sms leaves (see NOTE)
        self.dit_graphs: dict[tuple[int, int, bool], _Graph] = {}
        self._live: dict[tuple[int, int, bool], DecodeJob] = {}  # graphed DiT shapes held by jobs
        self.voc_graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # captures and their warm-up runs: streams of this decoder's own (private_stream)
        self.capture_stream = private_stream(self.device) if self.use_graphs else None
        self.warm_stream = private_stream(self.device) if self.use_graphs else None
        self.green_context, self.beside_capture_stream = None, self.capture_stream
        self.free_sms = 0
        if free_sms is None:
            self._leave_sms(os.environ.get("OMNISTAGE_CODE2WAV_FREE_SMS", "0"),
                            "OMNISTAGE_CODE2WAV_FREE_SMS")
        else:
            self._leave_sms(free_sms, "free_sms")
        self.capture_seconds = self.warmup_seconds = self.compile_seconds = 0.0
        self.graph_bytes: dict[tuple[str, int, int], int] = {}  # pool growth per capture

    def _leave_sms(self, value: int | str, name: str) -> None:
        """Validate free_sms and make the green context of the decodes beside other stages."""
        auto = value == "auto"
        if auto:
            if not self.use_graphs:
                return
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            value = sms // 4 // 8 * 8
        elif isinstance(value, str) and name != "free_sms":  # from the environment
            if not value.isdigit():
                raise ValueError(f"{name}: an int >= 0 or 'auto', got {value!r}")
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}: an int >= 0 or 'auto', got {value!r}")
        if not value:
            return
        if not self.use_graphs:
            raise ValueError(f"{name}: leaving SMs free needs CUDA graphs (a CUDA model)")
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        if value > sms - 16:
            raise ValueError(f"{name}: {value} of this GPU's {sms} SMs; at most {sms - 16} "
                             "(the DiT keeps 16 or more)")
        try:
            self.green_context, self.beside_capture_stream = green_context_stream(
                self.device, sms - value)
        except (ValueError, RuntimeError) as exc:
            if not auto:
                raise ValueError(f"{name}: no green context on this GPU ({exc})") from exc
            warnings.warn(f"code2wav: free_sms='auto' needs CUDA green contexts ({exc}); the "
                          "DiT keeps every SM", stacklevel=3)
            return
        self.free_sms = value

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
            bucket = bucket_for(len(idx), self.buckets) if self.pad_batch else len(idx)
            out.append((idx, bucket, width))
        return out

    def speaker(self, stream: Qwen2_5OmniCode2WavStream) -> torch.Tensor:
        """The stream's speaker encodings [2, enc_dim] (ref_mel, zeros): once per voice.

        NOTE: keyed by the ref_mel's memory (address, shape, strides; voices are read-only), the
        tensor held in the entry so that its memory cannot be reused meanwhile: streams of one
        voice share the stage's device copy of it (Qwen2_5OmniCode2WavStage.submit), so a voice
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
    def _capture(self, fn: Callable[[], torch.Tensor], key: tuple[str, int, int],
                 beside: bool = False) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        t0 = time.perf_counter()
        side = self.warm_stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        # warm-up: library handles, workspaces, autotuning (compiled code: compiled already)
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        self.warmup_seconds += time.perf_counter() - t0
        reserved = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other stages' threads may use the GPU while this one captures
        # own capture stream: its cuBLAS workspace is this decoder's alone (cuda_graphs.py)
        stream = self.beside_capture_stream if beside else self.capture_stream
        with torch.cuda.graph(graph, pool=self.pool, stream=stream,
                              capture_error_mode="thread_local"):
            out = fn()
        torch.cuda.synchronize(self.device)
        self.capture_seconds += time.perf_counter() - t0
        self.graph_bytes[key] = (self.graph_bytes.get(key, 0)
                                 + torch.cuda.memory_reserved(self.device) - reserved)
        return graph, out

    def dit_graph(self, bucket: int, width: int, beside: bool = False) -> _Graph:
        """The DiT graph of (bucket, width), captured on first use (beside: the one on the SMs
        that free_sms leaves; the same as beside=False when free_sms is 0)."""
        key = self._key(bucket, width, beside)
        g = self.dit_graphs.get(key)
        if g is None:
            g = _Graph(self.new_dit_inputs(bucket, width))
            if self.compile:
                self._compile_or_fall_back(g.inputs)
            # one graph per RK4 interval (the first also prepares the window): a step can run
            # in parts with other graphs between them (begin_job); back to back they cost the
            # same as one graph (H100, batch 32 x 360 frames: 654.5 vs 651.6 ms)
            for i in range(len(self.fast.widths)):
                graph, _ = self._capture(lambda i=i: self._dit_interval(g, i),
                                         ("dit", bucket, width), key[2])
                g.segments.append(graph)
            g.output = g.state.x
            self.dit_graphs[key] = g
        return g

    def _dit_interval(self, g: _Graph, i: int) -> torch.Tensor:
        # interval i of g's ODE; the first begins it (its captured run leaves g.state in the
        # graph pool, where the later intervals' graphs read and write it)
        with _matmul_tf32(self.tf32):
            if i == 0:
                g.state = self.fast.begin(*(g.inputs[k] for k in DIT_INPUTS))
            return self.fast.interval(g.state, i, self.compile)

    def _compile_or_fall_back(self, inputs: dict[str, torch.Tensor]) -> None:
        # compile this shape before the capture; a machine where inductor cannot build (no C
        # compiler, old Triton) keeps working on uncompiled graphs, with a warning
        t0 = time.perf_counter()
        try:
            self._dit(inputs, True)
        except Exception as exc:  # noqa: BLE001 - any compile failure: eager graphs instead
            warnings.warn(f"code2wav: torch.compile of the DiT failed, graphs stay uncompiled "
                          f"({type(exc).__name__}: {str(exc)[:300]})", stacklevel=3)
            self.compile = False
        torch.cuda.synchronize(self.device)
        self.compile_seconds += time.perf_counter() - t0

    def voc_graph(self, bucket: int, length: int) -> _Graph:
        g = self.voc_graphs.get((bucket, length))
        if g is None:
            p = next(self.model.code2wav_bigvgan_model.parameters())
            mel = torch.zeros(bucket, self.spec.mel_dim, length, device=self.device,
                              dtype=p.dtype)
            g = _Graph({"mel": mel})
            g.graph, g.output = self._capture(lambda: self._vocoder(g.inputs["mel"]),
                                              ("vocoder", bucket, length))
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
            if self.use_graphs and width <= self.max_graph_frames:
                g = self.dit_graph(bucket, width, beside)
                self._claim(self._key(bucket, width, beside), None)
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
                if length in graphed:
                    g = self.voc_graph(bucket_for(len(part), self.buckets), length)
                    for j, m in enumerate(ins):
                        g.inputs["mel"][j].copy_(m)
                    g.graph.replay()
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
            if self.use_graphs and width <= self.max_graph_frames:
                g = self.dit_graph(bucket, width, beside)
                job = DecodeJob(rows, config, spans, self._key(bucket, width, beside), g)
                self._claim(job.key, job)
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
                    job.graph.segments[i].replay()
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
            self._live.pop(job.key, None)
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
        return any(self._key(bucket, width, beside) in self._live
                   for _, bucket, width in self.plan(widths, config))

    def drop_jobs(self) -> None:
        """Forget unfinished jobs (their stage failed): their DiT shapes serve decodes again."""
        self._live.clear()

    def _key(self, bucket: int, width: int, beside: bool) -> tuple[int, int, bool]:
        # below BESIDE_MIN_BUCKET the DiT's small kernels leave SMs idle anyway: every SM
        return bucket, width, beside and self.free_sms > 0 and bucket >= BESIDE_MIN_BUCKET

    def _claim(self, key: tuple[int, int, bool], job: DecodeJob | None) -> None:
        # a graphed DiT shape serves one decode at a time: an unfinished job's state lives in it
        if key in self._live:
            raise ValueError(f"requests: DiT shape (batch {key[0]}, {key[1]} frames) is held by "
                             f"an unfinished job")
        if job is not None:
            self._live[key] = job

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
               buckets: tuple[int, ...] | None = None) -> None:
        """Capture the graphs of these buckets (default: all) for this stream config now."""
        if not self.use_graphs:
            return
        with self._on_device():
            self._warmup(config, buckets)

    def _warmup(self, config: Qwen2_5OmniCode2WavStreamConfig,
                buckets: tuple[int, ...] | None) -> None:
        for b in buckets or self.buckets:
            for w in window_widths(config, self.block):
                if w <= self.max_graph_frames:
                    self.dit_graph(bucket_for(b, self.buckets), w)
                    if w != first_window_width(config, self.block):  # later chunks' widths
                        self.dit_graph(bucket_for(b, self.buckets), w, beside=True)
            for length in vocoder_lengths(config, self.block):
                self.voc_graph(bucket_for(b, self.buckets), length)

    def stats(self) -> dict[str, float]:
        """Graph counts; seconds compiling (each shape's first compiled run), capturing (the
        warm-up run included) and warming up; graph pool memory (GiB) grown by the captures."""
        return {"dit_graphs": len(self.dit_graphs), "vocoder_graphs": len(self.voc_graphs),
                "free_sms": self.free_sms,
                "compiled": self.compile, "compile_seconds": round(self.compile_seconds, 3),
                "capture_seconds": round(self.capture_seconds, 3),
                "warmup_seconds": round(self.warmup_seconds, 3),
                "graph_pool_GiB": round(sum(self.graph_bytes.values()) / 2**30, 3)}
