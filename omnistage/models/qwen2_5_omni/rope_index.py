"""TMRoPE: Qwen2.5-Omni's 3-axis (time, height, width) position ids for the thinker prompt.

Text, audio and the start/end tokens around media advance all three axes together by one per
token. An image (or video) run places its tokens on a (t, h, w) grid of merged patches starting
at the next free position; the text after it continues at 1 + the largest position used so far.
Decode positions are `num_tokens_so_far + rope_delta` on all three axes.

A video with its audio track (`use_audio_in_video`) is `<|vision_bos|><|audio_bos|>` + video and
audio placeholders interleaved in 2-second chunks + `<|audio_eos|><|vision_eos|>` (see
`video_audio_layout`); a video without that prefix (no audio track) is laid out as usual.

Results equal transformers' `Qwen2_5OmniThinkerForConditionalGeneration.get_rope_index` for
well-formed prompts (each placeholder run has exactly the length its media needs); malformed
prompts raise ValueError here instead of getting shifted positions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class MropeTokenConfig:
    """The media token ids and merge size every 3-axis position layout (Qwen2.5-Omni's,
    Qwen3-Omni's) reads; each family's config adds its own fields."""

    audio_token_id: int
    image_token_id: int
    video_token_id: int
    audio_start_token_id: int
    audio_end_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    spatial_merge_size: int = 2


def spatial_merge_size(cfg: Mapping[str, Any]) -> int:
    """A thinker config's spatial merge size: top level, else in `vision_config`, else 2."""
    return int(cfg.get("spatial_merge_size")
               or (cfg.get("vision_config") or {}).get("spatial_merge_size", 2))


@dataclass(frozen=True)
class Qwen2_5OmniRopeConfig(MropeTokenConfig):
    """The thinker-config fields TMRoPE needs."""

    position_id_per_seconds: float = 25
    seconds_per_chunk: float = 2.0

    @classmethod
    def from_thinker_config(cls, cfg: Mapping[str, Any]) -> Qwen2_5OmniRopeConfig:
        """From a thinker config dict (config.json's `thinker_config`, `*_token_index` or
        `*_token_id` keys; `spatial_merge_size` top level or in `vision_config`)."""
        def token(name: str) -> int:
            for key in (f"{name}_token_id", f"{name}_token_index"):
                if cfg.get(key) is not None:
                    return int(cfg[key])
            raise ValueError(f"thinker config: missing {name}_token_id")

        return cls(
            audio_token_id=token("audio"), image_token_id=token("image"),
            video_token_id=token("video"),
            audio_start_token_id=int(cfg["audio_start_token_id"]),
            audio_end_token_id=int(cfg["audio_end_token_id"]),
            vision_start_token_id=int(cfg["vision_start_token_id"]),
            vision_end_token_id=int(cfg["vision_end_token_id"]),
            spatial_merge_size=spatial_merge_size(cfg),
            position_id_per_seconds=cfg.get("position_id_per_seconds", 25),
            seconds_per_chunk=cfg.get("seconds_per_chunk", 2.0))


def audio_tokens_for_frames(num_frames: int) -> int:
    """Audio encoder output length for `num_frames` mel frames (conv stride 2, then pool 2)."""
    return ((num_frames - 1) // 2 + 1 - 2) // 2 + 1


def _vision_grid(start: int, grid_thw: Sequence[int], merge: int, t_step: torch.Tensor
                 ) -> torch.Tensor:
    # [3, t*h*w/merge^2] positions of one image/video, row-major over (t, h, w)
    t, h, w = int(grid_thw[0]), int(grid_thw[1]) // merge, int(grid_thw[2]) // merge
    tt = t_step.view(-1, 1, 1).expand(t, h, w)
    hh = torch.arange(h).view(1, -1, 1).expand(t, h, w)
    ww = torch.arange(w).view(1, 1, -1).expand(t, h, w)
    return torch.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + start


def _run_end(ids: list[int], start: int, *tokens: int) -> int:
    end = start
    while end < len(ids) and ids[end] in tokens:
        end += 1
    return end


def chunk_bounds(values: Iterable[float], per_chunk: int) -> list[tuple[int, int]]:
    """[start, end) ranges splitting ascending time `values` into Qwen2.5-Omni's chunks.

    A new range starts at index i when values[i] >= k * per_chunk, k being the number of ranges
    so far; k rises by one per split, so a jump over several chunk lengths splits one time step
    over several ranges (transformers' processor and model both chunk this way)."""
    bounds: list[tuple[int, int]] = []
    start, k, n = 0, 1, 0
    for n, v in enumerate(values, 1):
        if v >= k * per_chunk:
            bounds.append((start, n - 1))
            start, k = n - 1, k + 1
    bounds.append((start, n))
    return bounds


def video_audio_layout(grid_thw: Sequence[int], second_per_grid: float, num_audio_tokens: int,
                       cfg: Qwen2_5OmniRopeConfig) -> list[tuple[bool, int]]:
    """Placeholder runs [(is_video, count), ...] of a video interleaved with its audio track:
    video chunk 0, audio chunk 0, video chunk 1, ... (empty runs dropped). Times are float64
    t * second_per_grid * position_id_per_seconds, as transformers' processor computes them."""
    t, h, w = (int(x) for x in grid_thw)
    per_step = (h // cfg.spatial_merge_size) * (w // cfg.spatial_merge_size)
    times = np.repeat(np.arange(t), per_step) * second_per_grid * cfg.position_id_per_seconds
    per_chunk = int(cfg.position_id_per_seconds * cfg.seconds_per_chunk)
    v_chunks = chunk_bounds(times.tolist(), per_chunk)
    a_chunks = chunk_bounds(range(num_audio_tokens), per_chunk)
    runs = []
    for k in range(max(len(v_chunks), len(a_chunks))):
        for is_video, chunks in ((True, v_chunks), (False, a_chunks)):
            if k < len(chunks) and chunks[k][1] > chunks[k][0]:
                runs.append((is_video, chunks[k][1] - chunks[k][0]))
    return runs


def _video_with_audio(ids: list[int], j: int, grid: list[int], t_steps: torch.Tensor,
                      audio_frames: int, bos: int, cfg: Qwen2_5OmniRopeConfig,
                      pieces: list[torch.Tensor]) -> int:
    """Append the positions of `<|vision_bos|><|audio_bos|>` + the run at j + the two end
    tokens to `pieces`; returns the index after the end tokens.

    NOTE (as transformers' get_rope_index builds it): both start tokens share one position;
    video (t, h, w) and audio (1-D) positions both count from the next one; the pieces follow
    in chunk order (video chunk k, then audio chunk k), whatever the ids' order; both end
    tokens share the position after the largest one of the LAST piece, not of the block."""
    pieces.append(torch.full((3, 2), bos, dtype=torch.long))
    vid = _vision_grid(bos + 1, grid, cfg.spatial_merge_size, t_steps)
    n_audio = audio_tokens_for_frames(audio_frames)
    aud = (torch.arange(n_audio) + bos + 1).view(1, -1).expand(3, -1)
    end = _run_end(ids, j, cfg.video_token_id, cfg.audio_token_id)
    n_video_ids = sum(1 for t in ids[j:end] if t == cfg.video_token_id)
    if n_video_ids != vid.shape[1] or end - j - n_video_ids != n_audio:
        raise ValueError(f"input_ids: video+audio block at {j} has {n_video_ids} video / "
                         f"{end - j - n_video_ids} audio tokens, its media needs "
                         f"{vid.shape[1]} / {n_audio}")
    if ids[end:end + 2] != [cfg.audio_end_token_id, cfg.vision_end_token_id]:
        raise ValueError(f"input_ids: video with audio ending at {end} must be followed "
                         "by <|audio_eos|><|vision_eos|>")
    per_chunk = int(cfg.position_id_per_seconds * cfg.seconds_per_chunk)
    v_chunks = chunk_bounds((vid[0] - bos - 1).tolist(), per_chunk)
    a_chunks = chunk_bounds(range(n_audio), per_chunk)
    block = []
    for k in range(max(len(v_chunks), len(a_chunks))):
        for chunks, rows in ((v_chunks, vid), (a_chunks, aud)):
            if k < len(chunks) and chunks[k][1] > chunks[k][0]:
                block.append(rows[:, chunks[k][0]:chunks[k][1]])
    pieces.extend(block)
    pieces.append(torch.full((3, 2), int(block[-1].max()) + 1, dtype=torch.long))
    return end + 2


def mrope_positions(
    input_ids: Sequence[int] | torch.Tensor,
    image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None,
    audio_seqlens: torch.Tensor | Sequence[int] | None,
    config: Mapping[str, Any] | Qwen2_5OmniRopeConfig,
    *,
    video_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None,
    second_per_grid: torch.Tensor | Sequence[float] | None = None,
    use_audio_in_video: bool = False,
) -> tuple[torch.LongTensor, int]:
    """3-axis positions of one prompt: input_ids [T] -> (positions LongTensor [3, T], rope_delta).

    image_grid_thw [n_images, 3] and video_grid_thw [n_videos, 3] are in patches (before the
    spatial merge); audio_seqlens [n_audios] are the valid mel frame counts of each audio;
    second_per_grid [n_videos] seconds per temporal grid step. With `use_audio_in_video`, each
    video placed as `<|vision_bos|><|audio_bos|>` + interleaved video/audio chunks +
    `<|audio_eos|><|vision_eos|>` consumes the next audio; other videos are plain.
    """
    cfg = config if isinstance(config, Qwen2_5OmniRopeConfig) else \
        Qwen2_5OmniRopeConfig.from_thinker_config(config)
    ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
    images = [] if image_grid_thw is None else [list(map(int, g)) for g in image_grid_thw]
    videos = [] if video_grid_thw is None else [list(map(int, g)) for g in video_grid_thw]
    audios = [] if audio_seqlens is None else [int(n) for n in audio_seqlens]
    spg = [] if second_per_grid is None else [float(s) for s in second_per_grid]
    if videos and len(spg) != len(videos):
        raise ValueError(f"second_per_grid: need one value per video ({len(videos)}), "
                         f"got {len(spg)}")
    merge, pps = cfg.spatial_merge_size, cfg.position_id_per_seconds
    media = {cfg.audio_token_id, cfg.image_token_id, cfg.video_token_id}
    pieces: list[torch.Tensor] = []
    next_pos, i, n_img, n_vid, n_aud = 0, 0, 0, 0, 0

    def emit(block: torch.Tensor) -> None:
        nonlocal next_pos
        pieces.append(block)
        next_pos = int(block.max()) + 1

    def text(n: int) -> None:
        if n > 0:
            emit(torch.arange(next_pos, next_pos + n).view(1, -1).expand(3, -1))

    def expect_run(tok: int, start: int, want: int, what: str) -> int:
        end = _run_end(ids, start, tok)
        if end - start != want:
            raise ValueError(f"input_ids: {what} placeholder run at {start} has {end - start} "
                             f"tokens, its media needs {want}")
        return end

    def video_t_steps(k: int, t: int) -> torch.Tensor:
        # float32 math then truncation, as transformers computes it
        sec = torch.tensor(spg[k], dtype=torch.float32)
        return (torch.arange(t) * sec * pps).long()

    while i < len(ids):
        j = i
        while j < len(ids) and ids[j] not in media:
            j += 1
        if j == len(ids):
            text(j - i)
            break
        tok = ids[j]
        if tok == cfg.video_token_id and use_audio_in_video and j >= 2 and \
                ids[j - 2] == cfg.vision_start_token_id and ids[j - 1] == cfg.audio_start_token_id:
            if n_vid >= len(videos) or n_aud >= len(audios):
                raise ValueError("input_ids: more videos with audio than video_grid_thw / "
                                 "audio_seqlens entries")
            text(j - 2 - i)
            i = _video_with_audio(ids, j, videos[n_vid], video_t_steps(n_vid, videos[n_vid][0]),
                                  audios[n_aud], next_pos, cfg, pieces)
            next_pos = int(pieces[-1].max()) + 1
            n_vid, n_aud = n_vid + 1, n_aud + 1
            continue
        text(j - i)
        if tok == cfg.audio_token_id:
            if n_aud >= len(audios):
                raise ValueError(f"input_ids: audio placeholder at {j} has no audio_seqlens entry")
            n = audio_tokens_for_frames(audios[n_aud])
            i = expect_run(tok, j, n, f"audio #{n_aud}")
            text(n)
            n_aud += 1
        else:
            is_image = tok == cfg.image_token_id
            grids, k = (images, n_img) if is_image else (videos, n_vid)
            what = f"{'image' if is_image else 'video'} #{k}"
            if k >= len(grids):
                raise ValueError(f"input_ids: {what} placeholder at {j} has no grid_thw entry")
            g = grids[k]
            steps = (torch.arange(g[0]) * pps).long() if is_image else video_t_steps(k, g[0])
            i = expect_run(tok, j, g[0] * g[1] * g[2] // merge**2, what)
            emit(_vision_grid(next_pos, g, merge, steps))
            n_img, n_vid = (n_img + 1, n_vid) if is_image else (n_img, n_vid + 1)
    for name, used, given in (("image_grid_thw", n_img, images), ("video_grid_thw", n_vid, videos),
                              ("audio_seqlens", n_aud, audios)):
        if used != len(given):
            raise ValueError(f"{name}: {len(given)} entries but the prompt has {used} "
                             "placeholder runs")
    if not pieces:
        return torch.zeros((3, 0), dtype=torch.long), 0
    positions = torch.cat(pieces, dim=1)
    return positions, int(positions.max()) + 1 - positions.shape[1]


def mrope_decode_positions(num_tokens: int, rope_delta: int, n: int = 1) -> torch.LongTensor:
    """Positions [3, n] of the next n tokens after `num_tokens` tokens (prompt + generated)."""
    return (torch.arange(num_tokens, num_tokens + n) + rope_delta).view(1, -1).expand(3, -1)
