"""Qwen3-Omni's 3-axis (time, height, width) positions for the thinker and talker prompts.

Layouts (ids as Qwen3-Omni's processor writes them):
- text: all three axes advance by one per token;
- audio `<|audio_start|>` + pads + `<|audio_end|>`: one per token, like text (the pad count is
  the AuT length rule, `audio_tokens_for_frames`);
- image / video `<|vision_start|>` + pads + `<|vision_end|>`: the start token takes the next
  position, the pads sit on a (t, h, w) grid of merged patches from the one after it, with
  t = grid step x seconds per step x `position_id_per_seconds` (an image's step counts as one
  second), and the end token takes 1 + the largest position of the grid;
- a video with its audio track (`use_audio_in_video`): `<|vision_start|><|audio_start|>` (two
  positions) + video and audio pads merged by time + `<|audio_end|><|vision_end|>` (two
  positions from 1 + the largest position of the last run, see `mrope_positions`).
Decode positions are `num_tokens_so_far + rope_delta` on all three axes.

NOTE: the results equal transformers 5.24's `get_rope_index` (thinker and talker), whose control
flow this mirrors, quirks included: it counts media by their start tokens, advances by the
lengths the media need (not by the ids), and the talker calls it with `use_audio_in_video`
unset, which lays a video-with-audio block out as text + one audio run. Two choices of ours:
- a plain video (no audio track) in a prompt with `use_audio_in_video` is laid out as a plain
  video (transformers miscounts such prompts);
- transformers keeps float positions; a video whose seconds per grid step x 13 is not whole
  (e.g. 3 fps) gives fractional time positions there. Ours are int64 and truncate those times
  (as integer-position engines do), so such prompts differ from transformers from that video
  on. Frames sampled at 1 or 2 fps (Qwen's default) give whole positions: identical.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from omnistage.models.qwen2_5_omni.rope_index import MropeTokenConfig, spatial_merge_size

if TYPE_CHECKING:
    from omnistage.models.qwen2_5_omni.processor import ProcessedPrompt

# transformers' talker prompt: <|im_start|>assistant\n, 4 x tts_pad, tts_bos, the first reply row
TALKER_ASSISTANT_PROMPT_LEN = 9


@dataclass(frozen=True)
class Qwen3OmniRopeConfig(MropeTokenConfig):
    """The config fields the 3-axis positions need (thinker or talker token ids)."""

    position_id_per_seconds: float = 13
    n_window: int = 50  # the audio encoder's, for the AuT length rule

    @classmethod
    def from_thinker_config(cls, cfg: Mapping[str, Any],
                            audio_config: Mapping[str, Any] | None = None
                            ) -> Qwen3OmniRopeConfig:
        """From config.json's `thinker_config` (or `talker_config`, with the thinker's
        `audio_config` passed: the talker config has none). `spatial_merge_size` is read at the
        top level or in `vision_config`; `vision_end_token_id` / `audio_end_token_id` default to
        the start id + 1, as in the released vocab."""
        def need(key: str) -> int:
            value = cfg.get(key)
            if value is None:
                raise ValueError(f"config: missing {key}")
            return int(value)

        audio = audio_config if audio_config is not None else (cfg.get("audio_config") or {})
        vision_start, audio_start = need("vision_start_token_id"), need("audio_start_token_id")
        return cls(
            audio_token_id=need("audio_token_id"), image_token_id=need("image_token_id"),
            video_token_id=need("video_token_id"), audio_start_token_id=audio_start,
            audio_end_token_id=int(cfg.get("audio_end_token_id") or audio_start + 1),
            vision_start_token_id=vision_start,
            vision_end_token_id=int(cfg.get("vision_end_token_id") or vision_start + 1),
            spatial_merge_size=spatial_merge_size(cfg),
            position_id_per_seconds=cfg.get("position_id_per_seconds", 13),
            n_window=int(audio.get("n_window", 50)))


def audio_tokens_for_frames(num_frames: int, n_window: int = 50) -> int:
    """AuT output length for `num_frames` mel frames: 13 tokens per full 2 x n_window-frame chunk,
    and three stride-2 convolutions over the remainder."""
    chunk = 2 * n_window
    rest = (num_frames % chunk - 1) // 2 + 1
    return ((rest - 1) // 2 + 1 - 1) // 2 + 1 + (num_frames // chunk) * 13


def video_time_positions(grid_t: int, second_per_grid: float, config: Qwen3OmniRopeConfig
                         ) -> torch.Tensor:
    """Time positions (float32 [grid_t]) of a video's grid steps, as the model computes them."""
    step = torch.tensor(float(second_per_grid), dtype=torch.float32)
    return torch.arange(grid_t) * step * config.position_id_per_seconds


def merge_by_time(video_times: Sequence[float], audio_times: Sequence[float]) -> list[bool]:
    """Order of a video's pads (row-major over t, h, w, at `video_times`) and its audio pads (at
    `audio_times`): True for a video pad. A video pad goes first when its time is <= the next
    audio pad's. transformers' processor orders the ids this way (float64 times, audio pad j at
    j) and its model the positions (float32 positions)."""
    order, v, a = [], 0, 0
    while v < len(video_times) and a < len(audio_times):
        take_video = video_times[v] <= audio_times[a]
        order.append(take_video)
        v, a = (v + 1, a) if take_video else (v, a + 1)
    return order + [True] * (len(video_times) - v) + [False] * (len(audio_times) - a)


def _trailing_run(order: list[bool]) -> int:
    n = 1
    while n < len(order) and order[-n - 1] == order[-1]:
        n += 1
    return n


def _grid(start: torch.Tensor, t_times: torch.Tensor, grid_thw: Sequence[int], merge: int
          ) -> torch.Tensor:
    # float32 [3, t*h*w] positions of one image/video's merged patches, row-major over (t, h, w)
    t, h, w = len(t_times), int(grid_thw[1]) // merge, int(grid_thw[2]) // merge
    tt = t_times.view(-1, 1, 1).expand(t, h, w)
    hh = torch.arange(h, dtype=torch.float32).view(1, -1, 1).expand(t, h, w)
    ww = torch.arange(w, dtype=torch.float32).view(1, 1, -1).expand(t, h, w)
    return torch.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + start


def _line(start: torch.Tensor | float, n: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float32) + start).view(1, -1).expand(3, -1)


def _index(ids: list[int], token: int, start: int) -> int:
    try:
        return ids.index(token, start)
    except ValueError as e:
        raise ValueError(f"input_ids: no more start tokens {token} after position {start}, "
                         "but the media given need one") from e


def mrope_positions(
    input_ids: Sequence[int] | torch.Tensor,
    image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None,
    audio_seqlens: torch.Tensor | Sequence[int] | None,
    config: Qwen3OmniRopeConfig,
    *,
    video_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None,
    second_per_grid: torch.Tensor | Sequence[float] | None = None,
    use_audio_in_video: bool = False,
) -> tuple[torch.LongTensor, int]:
    """3-axis positions of one prompt: input_ids [T] -> (positions int64 [3, T], rope_delta).

    image_grid_thw [n_images, 3] / video_grid_thw [n_videos, 3] in patches (before the merge);
    audio_seqlens [n_audios] valid mel frames per audio in prompt order (a video's audio track
    at its video); second_per_grid [n_videos]. Raises ValueError for media the ids do not match.
    """
    ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
    images = [] if image_grid_thw is None else [[int(x) for x in g] for g in image_grid_thw]
    videos = [] if video_grid_thw is None else [[int(x) for x in g] for g in video_grid_thw]
    audios = [] if audio_seqlens is None else [int(n) for n in audio_seqlens]
    spg = [] if second_per_grid is None else [float(s) for s in second_per_grid]
    if len(spg) < len(videos):
        raise ValueError(f"second_per_grid: need one value per video ({len(videos)}), "
                         f"got {len(spg)}")
    cfg, merge = config, config.spatial_merge_size
    if not images and not videos:  # transformers: plain positions without vision grids
        pads = {cfg.image_token_id, cfg.video_token_id}
        if any(t in pads for t in ids):
            raise ValueError("input_ids: image / video placeholders but no grid_thw entries")
        return torch.arange(len(ids)).view(1, -1).expand(3, -1).clone(), 0
    after_start = [ids[i + 1] for i, t in enumerate(ids[:-1]) if t == cfg.vision_start_token_id]
    n_image = after_start.count(cfg.image_token_id)
    n_plain = after_start.count(cfg.video_token_id)
    n_av = after_start.count(cfg.audio_start_token_id)
    n_audio = ids.count(cfg.audio_start_token_id)
    left = {"image": n_image, "video": n_plain + (n_av if use_audio_in_video else 0),
            "audio": n_audio}
    has_vision = cfg.image_token_id in ids or cfg.video_token_id in ids
    has_audio = cfg.audio_token_id in ids
    used = {"image": 0, "video": 0, "audio": 0}
    pieces: list[torch.Tensor] = []
    cursor = 0

    def nxt() -> torch.Tensor:
        return pieces[-1].max() + 1 if pieces else torch.tensor(0.0)

    def take(kind: str, entries: list) -> Any:
        if used[kind] >= len(entries):
            raise ValueError(f"input_ids: more {kind} placeholders than {kind} entries given "
                             f"({len(entries)})")
        used[kind] += 1
        return entries[used[kind] - 1]

    def expect(start: int, tokens: Sequence[int], what: str) -> None:
        if ids[start:start + len(tokens)] != list(tokens):
            raise ValueError(f"input_ids: {what} at {start} does not match its media "
                             f"({len(tokens)} tokens expected)")

    for _ in range(n_image + n_audio + n_plain):
        far = len(ids) + 1
        at_vision = _index(ids, cfg.vision_start_token_id, cursor) \
            if has_vision and (left["video"] > 0 or left["image"] > 0) else far
        at_audio = _index(ids, cfg.audio_start_token_id, cursor) \
            if has_audio and left["audio"] > 0 else far
        first = min(at_vision, at_audio)
        if first == far:
            raise ValueError("input_ids: fewer media start tokens than media")
        if first > cursor:
            pieces.append(_line(nxt(), first - cursor))
        av_block = first == at_vision and at_vision + 1 == at_audio
        pieces.append(_line(nxt(), 2 if av_block else 1))
        start = nxt()
        if first == at_audio:  # an audio (or, as the talker sees it, a video-with-audio block)
            n = audio_tokens_for_frames(take("audio", audios), cfg.n_window)
            if ids[first - 1:first] != [cfg.vision_start_token_id] or use_audio_in_video:
                expect(first + 1, [cfg.audio_token_id] * n + [cfg.audio_end_token_id],
                       f"audio #{used['audio'] - 1}")
            pieces.append(_line(start, n))
            cursor = first + 2 + n
            left["audio"] -= 1
        elif ids[first + 1] in (cfg.image_token_id, cfg.video_token_id):
            is_image = ids[first + 1] == cfg.image_token_id
            kind = "image" if is_image else "video"
            k = used[kind]
            grid = take(kind, images if is_image else videos)
            # an image's one grid step counts as one second
            times = torch.arange(grid[0]) * 1.0 * cfg.position_id_per_seconds if is_image \
                else video_time_positions(grid[0], spg[k], cfg)
            n = grid[0] * grid[1] * grid[2] // merge**2
            expect(first + 1, [ids[first + 1]] * n + [cfg.vision_end_token_id], f"{kind} #{k}")
            pieces.append(_grid(start, times, grid, merge))
            cursor = first + 2 + n
            left[kind] -= 1
        else:  # <|vision_start|><|audio_start|>: a video with its audio track
            k = used["video"]
            grid = take("video", videos)
            n_pads = audio_tokens_for_frames(take("audio", audios), cfg.n_window)
            vid = _grid(start, video_time_positions(grid[0], spg[k], cfg), grid, merge)
            aud = _line(start, n_pads)
            order = merge_by_time(vid[0].tolist(), aud[0].tolist())
            end = first + 2 + len(order)
            block = ids[first + 2:end]
            if block.count(cfg.video_token_id) != vid.shape[1] or \
                    block.count(cfg.audio_token_id) != n_pads:
                raise ValueError(f"input_ids: video+audio block at {first} does not match its "
                                 f"media ({vid.shape[1]} video and {n_pads} audio pads)")
            expect(end, [cfg.audio_end_token_id, cfg.vision_end_token_id], "its end tokens")
            cols, v, a = [], 0, 0
            for is_video in order:  # positions in the model's order, whatever the ids' order
                cols.append(vid[:, v] if is_video else aud[:, a])
                v, a = (v + 1, a) if is_video else (v, a + 1)
            pieces.append(torch.stack(cols, dim=1))
            # NOTE: the end tokens take 1 + the largest position of the LAST run (the rest of
            # whichever pads outlast the others), not of the whole block, as transformers does
            tail = _trailing_run(order)
            last = vid[:, -tail:] if order[-1] else aud[:, -tail:]
            pieces.append(_line(last.max() + 1, 2))
            cursor = end + 2
            left["video"] -= 1
            left["audio"] -= 1
            continue
        pieces.append(_line(nxt(), 1))
    if cursor > len(ids):
        raise ValueError(f"input_ids: {len(ids)} tokens, but the media need {cursor}")
    if cursor < len(ids):
        pieces.append(_line(nxt(), len(ids) - cursor))
    for kind, entries in (("image_grid_thw", images), ("video_grid_thw", videos),
                          ("audio_seqlens", audios)):
        n_used = used[kind.split("_")[0]]
        if kind == "video_grid_thw" and n_av and not use_audio_in_video:
            continue  # video+audio blocks read as text + audio: their grids go unused
        if n_used != len(entries):
            raise ValueError(f"{kind}: {len(entries)} entries but the prompt has {n_used} "
                             "placeholder runs for them")
    if not pieces:
        return torch.zeros((3, 0), dtype=torch.long), 0
    positions = torch.cat(pieces, dim=1).long()  # whole, or fractional times truncated
    return positions, int(positions.max()) + 1 - positions.shape[1]


def talker_positions(prompt_ids: Sequence[int], user_indices: Sequence[int],
                     tts_pad_token_id: int, processed: ProcessedPrompt,
                     config: Qwen3OmniRopeConfig | Mapping[str, Any], *,
                     assistant_len: int = TALKER_ASSISTANT_PROMPT_LEN
                     ) -> tuple[torch.LongTensor, int]:
    """Positions of the talker prompt as transformers builds it: the thinker prompt's user-turn
    tokens (`prompt_ids` at `user_indices`) then `assistant_len` rows whose ids are tts_pad,
    with the prompt's media. transformers calls the talker's rope index without
    `use_audio_in_video` (see the module NOTE). `config`: the talker's token ids, as a
    `Qwen3OmniRopeConfig` or a thinker-config-like mapping (with `audio_config` or `n_window`).
    Returns (positions int64 [3, len(user_indices) + assistant_len], rope_delta)."""
    if isinstance(config, Qwen3OmniRopeConfig):
        cfg = config
    else:
        n_window = config.get("n_window")
        cfg = Qwen3OmniRopeConfig.from_thinker_config(
            config, None if n_window is None else {"n_window": n_window})
    ids = [int(prompt_ids[i]) for i in user_indices] + [tts_pad_token_id] * assistant_len
    return mrope_positions(ids, processed.image_grid_thw, processed.audio_feature_lengths,
                           cfg, video_grid_thw=processed.video_grid_thw,
                           second_per_grid=processed.video_second_per_grid,
                           use_audio_in_video=False)
