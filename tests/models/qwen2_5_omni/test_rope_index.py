"""TMRoPE position ids vs transformers' thinker get_rope_index on the tiny checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniProcessor

from omnistage.models.qwen2_5_omni.processor import Qwen2_5OmniInputProcessor
from omnistage.models.qwen2_5_omni.rope_index import (
    Qwen2_5OmniRopeConfig,
    audio_tokens_for_frames,
    mrope_decode_positions,
    mrope_positions,
)
from omnistage.testing.tiny_omni import TINY_OMNI_IDS, tiny_omni_test_messages

IDS = TINY_OMNI_IDS
CASES = tiny_omni_test_messages()
TEXT = [100, 101, 102]


@pytest.fixture(scope="module")
def thinker(tiny_omni_dir: Path):
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_omni_dir).eval()
    return model.thinker


@pytest.fixture(scope="module")
def rope_cfg(tiny_omni_dir: Path) -> Qwen2_5OmniRopeConfig:
    cfg = json.loads((tiny_omni_dir / "config.json").read_text())["thinker_config"]
    return Qwen2_5OmniRopeConfig.from_thinker_config(cfg)


def hf_rope(thinker, ids: list[int], image_grid_thw=None, audio_seqlens=None,
            video_grid_thw=None, second_per_grid=None, use_audio_in_video=False):
    ids_t = torch.tensor([ids])
    pos, delta = thinker.get_rope_index(
        ids_t, image_grid_thw, video_grid_thw, torch.ones_like(ids_t), use_audio_in_video,
        None if audio_seqlens is None else torch.tensor(audio_seqlens), second_per_grid)
    return pos[:, 0], int(delta)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers(name: str, tiny_omni_dir: Path, thinker) -> None:
    proc = Qwen2_5OmniInputProcessor.from_pretrained(tiny_omni_dir)
    p = proc.process(CASES[name])
    grid = p.image_grid_thw
    lens = p.audio_feature_lengths or None
    want, want_delta = hf_rope(thinker, p.input_ids, grid, lens)
    cfg = json.loads((tiny_omni_dir / "config.json").read_text())["thinker_config"]
    got, delta = mrope_positions(p.input_ids, grid, lens, cfg)
    assert got.shape == (3, len(p.input_ids)) and got.dtype == torch.long
    assert torch.equal(got, want) and delta == want_delta
    assert torch.equal(got, p.mrope_positions) and delta == p.rope_delta
    if grid is not None:  # images really use 2-D positions
        assert delta < 0 and not torch.equal(got[1], got[2])


def _video_with_audio(grid: list[int], spg: float, audio_frames: int, merge: int = 2,
                      pps: int = 25, chunk_s: float = 2.0) -> list[int]:
    """Interleaved video/audio placeholders, laid out by transformers' processor's chunking."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    v_idx = np.repeat(np.arange(t), h * w) * spg * pps
    a_idx = np.arange(audio_tokens_for_frames(audio_frames))
    per_chunk = int(pps * chunk_s)
    v_chunks = Qwen2_5OmniProcessor.get_chunked_index(None, v_idx, per_chunk)
    a_chunks = Qwen2_5OmniProcessor.get_chunked_index(None, a_idx, per_chunk)
    out = [IDS["<|vision_bos|>"], IDS["<|audio_bos|>"]]
    for j in range(max(len(v_chunks), len(a_chunks))):
        if j < len(v_chunks):
            out += [IDS["<|VIDEO|>"]] * (v_chunks[j][1] - v_chunks[j][0])
        if j < len(a_chunks):
            out += [IDS["<|AUDIO|>"]] * (a_chunks[j][1] - a_chunks[j][0])
    return out + [IDS["<|audio_eos|>"], IDS["<|vision_eos|>"]]


def _wrapped(token: str, n: int, bos: str, eos: str) -> list[int]:
    return [IDS[bos]] + [IDS[token]] * n + [IDS[eos]]


def test_video_positions_match_transformers(thinker, rope_cfg) -> None:
    grids = torch.tensor([[4, 4, 6], [3, 2, 2]])
    spg = torch.tensor([1.0, 0.52])  # 0.52 * 25 is not exact in float32: truncation matters
    ids = (TEXT + _wrapped("<|VIDEO|>", 24, "<|vision_bos|>", "<|vision_eos|>") + TEXT
           + _wrapped("<|AUDIO|>", audio_tokens_for_frames(333), "<|audio_bos|>", "<|audio_eos|>")
           + _wrapped("<|VIDEO|>", 3, "<|vision_bos|>", "<|vision_eos|>") + TEXT)
    want, want_delta = hf_rope(thinker, ids, None, [333], grids, spg)
    got, delta = mrope_positions(ids, None, [333], rope_cfg, video_grid_thw=grids,
                                 second_per_grid=spg)
    assert torch.equal(got, want) and delta == want_delta
    assert got[0].max() >= 75  # the 4th temporal step of video 0 sits at 3 s * 25


def test_audio_in_video_positions_match_transformers(thinker, rope_cfg) -> None:
    grids = torch.tensor([[6, 4, 4], [2, 2, 4]])
    spg = torch.tensor([1.0, 2.0])
    frames = [600, 97, 50]
    ids = (TEXT + _video_with_audio([6, 4, 4], 1.0, 600) + TEXT
           + _wrapped("<|AUDIO|>", audio_tokens_for_frames(97), "<|audio_bos|>", "<|audio_eos|>")
           + _video_with_audio([2, 2, 4], 2.0, 50) + TEXT)
    want, want_delta = hf_rope(thinker, ids, None, frames, grids, spg, use_audio_in_video=True)
    got, delta = mrope_positions(ids, None, frames, rope_cfg, video_grid_thw=grids,
                                 second_per_grid=spg, use_audio_in_video=True)
    assert torch.equal(got, want) and delta == want_delta


def test_mixed_image_audio_synthetic(thinker, rope_cfg) -> None:
    grids = torch.tensor([[1, 4, 6], [1, 8, 2], [1, 2, 2]])
    ids = (TEXT + _wrapped("<|IMAGE|>", 6, "<|vision_bos|>", "<|vision_eos|>")
           + _wrapped("<|AUDIO|>", audio_tokens_for_frames(1000), "<|audio_bos|>", "<|audio_eos|>")
           + _wrapped("<|IMAGE|>", 4, "<|vision_bos|>", "<|vision_eos|>") + TEXT
           + _wrapped("<|IMAGE|>", 1, "<|vision_bos|>", "<|vision_eos|>") + TEXT)
    want, want_delta = hf_rope(thinker, ids, grids, [1000])
    got, delta = mrope_positions(torch.tensor(ids), grids, torch.tensor([1000]), rope_cfg)
    assert torch.equal(got, want) and delta == want_delta


def test_decode_positions(rope_cfg) -> None:
    ids = TEXT + _wrapped("<|IMAGE|>", 6, "<|vision_bos|>", "<|vision_eos|>") + TEXT
    pos, delta = mrope_positions(ids, [[1, 4, 6]], None, rope_cfg)
    assert delta == int(pos.max()) + 1 - len(ids) == -3
    nxt = mrope_decode_positions(len(ids), delta, n=2)
    assert nxt.tolist() == [[int(pos.max()) + 1, int(pos.max()) + 2]] * 3


@pytest.mark.parametrize("ids, grids, lens, pattern", [
    (TEXT + [IDS["<|IMAGE|>"]] * 5, [[1, 4, 6]], None, r"image #0 placeholder run at 3 has 5"),
    (TEXT + [IDS["<|AUDIO|>"]] * 3, None, [100], r"audio #0 placeholder run .* needs 25"),
    (TEXT + [IDS["<|AUDIO|>"]], None, None, r"audio placeholder at 3 has no audio_seqlens"),
    (TEXT, [[1, 2, 2]], None, r"image_grid_thw: 1 entries but the prompt has 0"),
])
def test_malformed_raises(rope_cfg, ids, grids, lens, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        mrope_positions(ids, grids, lens, rope_cfg)


@pytest.mark.parametrize("ids", [TEXT, TEXT * 50, []])
def test_text_only_positions_match_transformers(thinker, rope_cfg, ids) -> None:
    """Text-only prompts (and an empty one): transformers' positions, delta 0, contiguous (the
    engine slices and copies them)."""
    got, delta = mrope_positions(ids, None, None, rope_cfg)
    assert got.shape == (3, len(ids)) and got.dtype == torch.long and got.is_contiguous()
    if ids:
        want, want_delta = hf_rope(thinker, ids)
        assert torch.equal(got, want) and delta == want_delta == 0
    else:
        assert delta == 0
