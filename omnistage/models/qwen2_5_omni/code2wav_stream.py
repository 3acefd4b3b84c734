"""Qwen2.5-Omni code2wav streaming: a growing list of codec ids -> waveform chunks.

NOTE: sliding-window decoding, defined by frame positions only (never by when codes arrive).
With B = dit block_size (24 frames = 12 codes), C = chunk_blocks * B and C0 = first_chunk_blocks
* B (= C unless set), chunk k starts at frame s_k = 0, C0, C0 + C, C0 + 2 C, ...:
  - chunk k is the mel frames [s_k, s_k + C_k) (clipped to the utterance), s_k x 240 samples on;
  - its DiT window is [s_k - past_blocks B, s_k + C_k + future_blocks B), clipped to [0, F);
    the ODE (the one of `generate`) runs on the window alone, with the window's slice of
    `initial_noise(seed, ...)` and absolute positions (rotary angles and attention blocks),
    and only the chunk's frames of its result are kept;
  - BigVGAN runs on the chunk's mel plus up to `vocoder_overlap_frames` context frames on each
    side, taken from the same window's result, and the context's samples are trimmed, so the
    chunks concatenate to exactly F x 240 samples (= codes x 480).
With past/future windows that cover the whole utterance the result equals `generate`.

Latency: chunk k can be decoded once the codes up to its window's end exist,
((k + 1) chunk_blocks + future_blocks) x 12 codes, or once the utterance has finished. With the
defaults (chunk 1 block, past 2, future 1, overlap 20 frames) the first chunk (12 codes = 0.24 s
of audio) needs 24 codes and each later one 12 more: 12 codes (0.24 s) of look-ahead.
Why these: one DiT pass reaches 2 blocks back (two look-backward layers) and 1 block ahead (one
look-ahead layer); with random weights in the real layer layout the mel SNR rises steeply up to
exactly past 2 / future 1 (more past adds nothing, future 0 loses ~45 dB). BigVGAN's exact reach
is ~27 frames each side in the real layout, but its influence falls below 1e-4 of the peak by
16 frames; 20 frames fits inside a 24-frame future block (Qwen's own streaming code uses past 2
blocks, future 1 block, 20 vocoder frames, with 3-block chunks). Cost per chunk: the DiT runs
past + chunk + future blocks (4x one-shot's frames at the defaults), BigVGAN chunk + 2 x overlap.
`first_chunk_blocks=1, chunk_blocks=3` keeps the first chunk's latency (24 codes) and runs the
DiT on 2x (not 4x) the frames afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .token2wav import NOISE_MAX_FRAMES, Qwen2_5OmniToken2Wav

# generate()'s ODE: RK4 (3/8 rule) over a 10-point sway-warped grid, classifier-free guidance
ODE_STEPS, GUIDANCE_SCALE, SWAY_COEFFICIENT = 10, 0.5, -1.0


@dataclass(frozen=True)
class Qwen2_5OmniCode2WavStreamConfig:
    """Window sizes of the streaming decoder (validated once, here)."""

    past_blocks: int = 2  # DiT context blocks before the chunk
    future_blocks: int = 1  # DiT context blocks after it: the latency beyond the chunk
    vocoder_overlap_frames: int = 20  # BigVGAN context mel frames on each side of the chunk
    chunk_blocks: int = 1  # DiT blocks per emitted chunk
    first_chunk_blocks: int | None = None  # DiT blocks of chunk 0 (None: chunk_blocks)

    def __post_init__(self) -> None:
        for name in ("past_blocks", "future_blocks", "vocoder_overlap_frames", "chunk_blocks",
                     "first_chunk_blocks"):
            value = getattr(self, name)
            if name == "first_chunk_blocks" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
        for name in ("chunk_blocks", "first_chunk_blocks"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {getattr(self, name)}")

    @property
    def first_blocks(self) -> int:
        return self.chunk_blocks if self.first_chunk_blocks is None else self.first_chunk_blocks


@dataclass(frozen=True)
class Qwen2_5OmniCode2WavSpan:
    """Absolute mel-frame ranges [start, end) of one chunk's decode."""

    chunk: tuple[int, int]  # frames emitted
    window: tuple[int, int]  # frames the DiT runs on
    vocoder: tuple[int, int]  # frames BigVGAN runs on (chunk + context, inside window)


@dataclass
class Qwen2_5OmniCode2WavChunk:
    """One decoded chunk: mel [M, n] and waveform [n * 240] fp32 on the model's device."""

    index: int
    frames: tuple[int, int]  # absolute mel frames [start, start + n)
    mel: torch.Tensor
    waveform: torch.Tensor


class Qwen2_5OmniCode2WavStream:
    """Per-request streaming state: the codes so far, the voice and the noise seed.

    Holds no audio or noise tensors (each chunk is recomputed from codes and positions alone), so
    any chunk that `ready_chunks` allows can be decoded at any time, in any order, in any batch.
    """

    def __init__(self, model: Qwen2_5OmniToken2Wav, cond: torch.Tensor, ref_mel: torch.Tensor,
                 seed: int, config: Qwen2_5OmniCode2WavStreamConfig | None = None) -> None:
        # cond [E] or [1, E]; ref_mel [L, M] or [1, L, M]
        self.config = config or Qwen2_5OmniCode2WavStreamConfig()
        if not isinstance(self.config, Qwen2_5OmniCode2WavStreamConfig):
            raise ValueError("config: expected a Qwen2_5OmniCode2WavStreamConfig")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed: expected an int, got {seed!r}")
        spec = model.spec
        if spec.block_size % spec.repeats:
            raise ValueError("dit_config.block_size: must be a multiple of repeats for streaming")
        self.spec, self.seed = spec, seed
        self.cond, self.ref_mel = model.check_voice(cond, ref_mel)
        self.block = spec.block_size
        self.chunk_frames = self.config.chunk_blocks * spec.block_size
        self.first_frames = self.config.first_blocks * spec.block_size
        self.max_frames = min(spec.max_position_embeddings, NOISE_MAX_FRAMES)
        self.codes: list[int] = []
        self.finished = False

    @property
    def num_frames(self) -> int:
        return len(self.codes) * self.spec.repeats

    def add_codes(self, codes: list[int], finished: bool = False) -> None:
        """Append codec ids (ints in [0, num_embeds]); `finished` marks the utterance's end.

        Mutates the stream; on a ValueError nothing was appended.
        """
        if self.finished:
            raise ValueError("finished: the stream has already finished; no more codes")
        if isinstance(codes, torch.Tensor):
            codes = codes.reshape(-1).tolist()
        if not isinstance(codes, (list, tuple)):
            raise ValueError("codes: expected a list of ints")
        for c in codes:
            if not isinstance(c, int) or isinstance(c, bool) or not 0 <= c <= self.spec.num_embeds:
                raise ValueError(f"codes: ids must be ints in [0, {self.spec.num_embeds}], "
                                 f"got {c!r}")
        if (len(self.codes) + len(codes)) * self.spec.repeats > self.max_frames:
            raise ValueError(f"codes: the utterance would exceed {self.max_frames} mel frames")
        self.codes.extend(codes)
        self.finished = bool(finished)

    def num_chunks(self) -> int | None:
        """Chunks of the whole utterance once finished, else None."""
        if not self.finished:
            return None
        rest = self.num_frames - self.first_frames
        return min(1, self.num_frames) + max(0, -(-rest // self.chunk_frames))

    def chunk_start(self, k: int) -> int:
        """First frame of chunk k (a function of k and the config alone)."""
        return 0 if k == 0 else self.first_frames + (k - 1) * self.chunk_frames

    def ready_chunks(self) -> int:
        """Chunks 0 .. n-1 can be decoded now: returns n (grows as codes arrive)."""
        if self.finished:
            return self.num_chunks() or 0
        # chunk k is ready once its window's end (its end + the future blocks) has arrived
        known = self.num_frames - self.config.future_blocks * self.block - self.first_frames
        return 0 if known < 0 else 1 + known // self.chunk_frames

    def span(self, k: int) -> Qwen2_5OmniCode2WavSpan:
        """Frame ranges of chunk k (0 <= k < ready_chunks(), which makes them final)."""
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < self.ready_chunks():
            raise ValueError(f"chunk: {k!r} is not ready (ready_chunks() = {self.ready_chunks()})")
        cfg, total = self.config, self.num_frames
        start = self.chunk_start(k)
        length = self.first_frames if k == 0 else self.chunk_frames
        end = min(start + length, total)
        w0 = max(0, start - cfg.past_blocks * self.block)
        w1 = min(total, start + length + cfg.future_blocks * self.block)
        ov = cfg.vocoder_overlap_frames
        return Qwen2_5OmniCode2WavSpan((start, end), (w0, w1), (max(w0, start - ov),
                                                              min(w1, end + ov)))

    def window_inputs(self, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                             torch.Tensor, int]:
        """Chunk k's DiT row for `sample_mels`: (codes [1, n], cond, ref_mel, noise [W, M], w0)."""
        w0, w1 = self.span(k).window
        rep = self.spec.repeats
        codes = torch.tensor(self.codes[w0 // rep:w1 // rep], dtype=torch.long).reshape(1, -1)
        # prefix-stable draw: drawing only w1 frames equals the utterance-long draw's prefix
        noise = Qwen2_5OmniToken2Wav.initial_noise(self.seed, w1, self.spec.mel_dim,
                                                   max_frames=w1)[w0:]
        return codes, self.cond, self.ref_mel, noise, w0


@torch.inference_mode()
def decode_chunks_with_mel(model: Qwen2_5OmniToken2Wav,
                           requests: list[tuple[Qwen2_5OmniCode2WavStream, int]]
                           ) -> list[Qwen2_5OmniCode2WavChunk]:
    """Decode chunk k of each (stream, k) with one batched DiT call per ODE evaluation.

    Each result equals that chunk decoded alone (the batch pads and masks). Mutates nothing.
    """
    check_requests(model, requests)
    if not requests:
        return []
    spans = [s.span(k) for s, k in requests]
    mels = model.sample_mels([s.window_inputs(k) for s, k in requests], ODE_STEPS,
                             GUIDANCE_SCALE, SWAY_COEFFICIENT)
    return assemble_chunks(model, requests, spans, mels, model.vocode(vocoder_inputs(spans, mels)))


def check_requests(model: Qwen2_5OmniToken2Wav,
                   requests: list[tuple[Qwen2_5OmniCode2WavStream, int]]) -> None:
    """Raise ValueError unless requests is a list of (stream of this model's config, int)."""
    if not isinstance(requests, (list, tuple)):
        raise ValueError("requests: expected a list of (stream, chunk index) pairs")
    for i, req in enumerate(requests):
        if not (isinstance(req, tuple) and len(req) == 2
                and isinstance(req[0], Qwen2_5OmniCode2WavStream)):
            raise ValueError(f"requests[{i}]: expected a (Qwen2_5OmniCode2WavStream, int) pair")
        if req[0].spec != model.spec:
            raise ValueError(f"requests[{i}]: the stream was made for another token2wav config")


def vocoder_inputs(spans: list[Qwen2_5OmniCode2WavSpan], mels: list[torch.Tensor]
                   ) -> list[torch.Tensor]:
    """Each window's mel [W_i, M] -> its vocoder span [M, V_i]."""
    return [mel[sp.vocoder[0] - sp.window[0]:sp.vocoder[1] - sp.window[0]].transpose(0, 1)
            for mel, sp in zip(mels, spans, strict=True)]


def assemble_chunks(model: Qwen2_5OmniToken2Wav,
                    requests: list[tuple[Qwen2_5OmniCode2WavStream, int]],
                    spans: list[Qwen2_5OmniCode2WavSpan], mels: list[torch.Tensor],
                    wavs: list[torch.Tensor]) -> list[Qwen2_5OmniCode2WavChunk]:
    """Window mels [W_i, M] and vocoder-span waveforms -> the chunks (context trimmed)."""
    hop = model.code2wav_bigvgan_model.hop
    out = []
    for (_, k), sp, mel, wav in zip(requests, spans, mels, wavs, strict=True):
        (c0, c1), (w0, _), (v0, _) = sp.chunk, sp.window, sp.vocoder
        out.append(Qwen2_5OmniCode2WavChunk(
            k, sp.chunk, mel[c0 - w0:c1 - w0].transpose(0, 1).float(),
            wav[(c0 - v0) * hop:(c1 - v0) * hop]))
    return out


def decode_chunks(model: Qwen2_5OmniToken2Wav,
                  requests: list[tuple[Qwen2_5OmniCode2WavStream, int]]) -> list[torch.Tensor]:
    """Waveforms [n_i * 240] fp32 of chunk k of each (stream, k), in order (see
    decode_chunks_with_mel)."""
    return [c.waveform for c in decode_chunks_with_mel(model, requests)]
