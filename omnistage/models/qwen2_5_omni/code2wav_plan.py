"""Which code2wav graphs exist, and when they are captured: the DiT window widths a stream
config uses, BigVGAN's span lengths, and the warm-up's capture plan (everything at load, or a
first request's graphs at load and the rest later)."""

from __future__ import annotations

from .code2wav_stream import Qwen2_5OmniCode2WavStreamConfig

# windows wider than this (e.g. whole-utterance windows) are not padded; 672 = 28 blocks holds a
# 24-block chunk's window (past 2 + 24 + future 1)
MAX_GRAPH_FRAMES = 672
# the smallest DiT batch that runs on the green context beside other stages (measured:
# benchmarks/results/qwen2_5_omni_pipeline_gpu_h100_free_sms32_later_shapes_2026-11-23.json)
BESIDE_MIN_BUCKET = 8


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


GraphKey = tuple  # ("dit", bucket, width, beside) or ("vocoder", bucket, length)


def full_window_width(config: Qwen2_5OmniCode2WavStreamConfig, block: int) -> int:
    """A later chunk's DiT window (frames): past, chunk and future blocks."""
    return (config.past_blocks + config.future_blocks
            + max(config.chunk_blocks, config.first_blocks)) * block


def capture_plan(config: Qwen2_5OmniCode2WavStreamConfig, block: int, buckets: tuple[int, ...],
                 max_graph_frames: int = MAX_GRAPH_FRAMES, beside_min_bucket: int | None = None,
                 lazy: bool = False) -> tuple[list[GraphKey], list[GraphKey]]:
    """The graphs of a stream config -> (captured at load, captured later while idle), each in
    capture order. beside_min_bucket: the smallest bucket with a `beside` DiT graph of its own
    (None: no such graphs, free_sms off).

    full: everything at load. lazy: at load what a first request needs at batch 1 (chunk 0's
    width, the full window for its later chunks, the vocoder's spans, its last chunk's half and
    quarter widths) and every graph of the largest bucket; later, the other buckets upwards
    (concurrency ramps up), in each the widths a step most often needs first (chunk 0's, the
    full window, the vocoder's spans, then the last chunks' half and quarter widths, then the
    beside variants).

    NOTE (why the largest bucket at load): until a bucket's own graph exists a step runs on the
    smallest captured larger bucket (padding rows are masked out), so the largest one holds a
    burst of any size. Without it a burst right after a lazy start ran its first chunks and
    wide steps eagerly on every SM (c32 on the H200: 64.6 audio-s/s against 78.7-80.4 with
    every graph; with the largest bucket at load 77.2-79.0, its `beside` graphs included:
    74.5 without them; benchmarks/results/
    qwen2_5_omni_pipeline_gpu_h200_lazy_top_bucket_session23_issue24_2026-11-29.json)."""
    first, full = first_window_width(config, block), full_window_width(config, block)
    widths = [w for w in window_widths(config, block) if w <= max_graph_frames]
    main = [w for w in (first, full) if w in widths]
    rest = [w for w in widths if w not in main]
    order: list[GraphKey] = []
    for b in buckets:
        order += [("dit", b, w, False) for w in main]
        order += [("vocoder", b, n) for n in vocoder_lengths(config, block)]
        order += [("dit", b, w, False) for w in rest]
        if beside_min_bucket is not None and b >= beside_min_bucket:
            order += [("dit", b, w, True) for w in widths if w != first]
    if not lazy:
        return order, []
    # (a first request's last chunk would otherwise pad up to the largest bucket: c1 right
    # after a lazy start ran at 7.4 against 9.5 audio-s/s with the full plan)
    now = {k for k in order if k[1] in (buckets[0], buckets[-1])}
    return [k for k in order if k in now], [k for k in order if k not in now]
