"""Parity of our Qwen2.5-Omni audio / vision encoders with transformers' thinker (fp32, CPU)."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2_5OmniThinkerForConditionalGeneration, WhisperFeatureExtractor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from omnistage.models.qwen2_5_omni.audio_encoder import Qwen2_5OmniAudioEncoder
from omnistage.models.qwen2_5_omni.vision_encoder import Qwen2_5OmniVisionEncoder

REFERENCE = "/work/shared/reference/tiny_omni_reference.py"
SR = 16000
ATOL = 1e-4


def _load_reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tiny_omni_reference", REFERENCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ref() -> ModuleType:
    return _load_reference()


@pytest.fixture(scope="module")
def thinker(ref: ModuleType) -> Qwen2_5OmniThinkerForConditionalGeneration:
    torch.manual_seed(0)
    model = Qwen2_5OmniThinkerForConditionalGeneration(
        ref.build_config(ref.build_tokenizer()).thinker_config).eval()
    # transformers' init (std 0.02, unit norms) gives near-constant outputs: widen every weight
    with torch.no_grad():
        for p in [*model.model.audio_tower.parameters(), *model.model.visual.parameters()]:
            p.normal_(0.0, 0.15).add_(1.0 if p.dim() == 1 and p.numel() <= 64 else 0.0)
    return model


@pytest.fixture(scope="module")
def audio_encoder(thinker) -> Qwen2_5OmniAudioEncoder:
    enc = Qwen2_5OmniAudioEncoder(thinker.config.audio_config.to_dict()).eval()
    enc.load_state_dict(thinker.model.audio_tower.state_dict(), strict=True)
    return enc


@pytest.fixture(scope="module")
def vision_encoder(thinker) -> Qwen2_5OmniVisionEncoder:
    enc = Qwen2_5OmniVisionEncoder(thinker.config.vision_config.to_dict()).eval()
    enc.load_state_dict(thinker.model.visual.state_dict(), strict=True)
    return enc


def _audio(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * SR)
    tone = 0.3 * np.sin(2 * np.pi * (150 + 100 * seed) * np.arange(n) / SR)
    return (tone + 0.05 * rng.standard_normal(n)).astype(np.float32)


def _features(seconds: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    fe = WhisperFeatureExtractor(feature_size=128)
    out = fe([_audio(s, i) for i, s in enumerate(seconds)], sampling_rate=SR,
             padding="max_length", return_attention_mask=True, return_tensors="pt")
    return out["input_features"], out["attention_mask"]


def _check(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    assert theirs.abs().mean() > 0.05 and theirs.std(0).mean() > 0.05, "reference output trivial"
    diff = (ours - theirs).abs().max().item()
    assert diff < ATOL, diff
    return diff


@pytest.mark.parametrize("seconds", [[2.0], [0.7, 2.3, 5.0]])
@torch.no_grad()
def test_audio_matches_transformers(thinker, audio_encoder, seconds: list[float]) -> None:
    feats, mask = _features(seconds)
    theirs = thinker.get_audio_features(feats, feature_attention_mask=mask).last_hidden_state
    lens = mask.sum(-1).tolist()
    ours = audio_encoder([feats[i, :, :n] for i, n in enumerate(lens)])
    assert [o.shape[0] for o in ours] == [Qwen2_5OmniAudioEncoder.output_length(n) for n in lens]
    _check(torch.cat(ours), theirs)
    # batched == each alone
    for i, n in enumerate(lens):
        alone = audio_encoder([feats[i, :, :n]])[0]
        assert (alone - ours[i]).abs().max().item() < 1e-5


def test_audio_output_length_matches_processor(ref: ModuleType) -> None:
    tok = ref.build_tokenizer()
    proc = ref.build_processor(tok)
    audio_id = tok.convert_tokens_to_ids("<|AUDIO|>")
    msgs = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "hi"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    for seconds in (0.05, 0.5, 1.0, 1.99, 2.01, 3.7, 10.0):
        inputs = proc(text=text, audio=[_audio(seconds, 0)], return_tensors="pt")
        frames = int(inputs["feature_attention_mask"].sum())
        placeholders = int((inputs["input_ids"] == audio_id).sum())
        assert placeholders > 0
        assert Qwen2_5OmniAudioEncoder.output_length(frames) == placeholders, seconds


def _image(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))


@pytest.mark.parametrize("sizes", [[(56, 84)], [(56, 84), (112, 112)], [(224, 308)]])
@torch.no_grad()
def test_vision_matches_transformers(thinker, vision_encoder, sizes) -> None:
    out = Qwen2VLImageProcessorPil()(images=[_image(h, w, i) for i, (h, w) in enumerate(sizes)],
                                     return_tensors="pt")
    pixels, grid = out["pixel_values"], out["image_grid_thw"]
    if sizes == [(224, 308)]:  # more than one window (window = 4x4 merge units)
        assert grid[0, 1] // 2 > 4 and grid[0, 2] // 2 > 4
    theirs = torch.cat(thinker.get_image_features(pixels, image_grid_thw=grid).pooler_output)
    ours = vision_encoder(pixels, grid)
    assert ours.shape[0] == int(grid.prod(-1).sum()) // 4
    _check(ours, theirs)
    # batched == each alone
    starts = [0, *grid.prod(-1).cumsum(0).tolist()]
    merged = [0, *(grid.prod(-1) // 4).cumsum(0).tolist()]
    for i in range(len(sizes)):
        alone = vision_encoder(pixels[starts[i]:starts[i + 1]], grid[i:i + 1])
        assert (alone - ours[merged[i]:merged[i + 1]]).abs().max().item() < 1e-5


@torch.no_grad()
def test_vision_multi_frame_grid(thinker, vision_encoder) -> None:
    # a video-like grid (t = 2) beside an image: attention stays per frame
    torch.manual_seed(1)
    grid = torch.tensor([[2, 8, 12], [1, 4, 6]])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14)
    theirs = torch.cat(thinker.get_image_features(pixels, image_grid_thw=grid).pooler_output)
    _check(vision_encoder(pixels, grid), theirs)


def test_input_validation(audio_encoder, vision_encoder) -> None:
    with pytest.raises(ValueError, match="features"):
        audio_encoder([torch.zeros(80, 100)])
    with pytest.raises(ValueError, match="grid_thw"):
        vision_encoder(torch.zeros(24, 1176), torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="pixel_values"):
        vision_encoder(torch.zeros(16, 100), torch.tensor([[1, 4, 4]]))
