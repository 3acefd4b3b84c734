"""Parity of our Qwen3-Omni audio (AuT) / vision encoders with transformers' (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf_modeling
from transformers.models.qwen3_omni_moe import processing_qwen3_omni_moe as hf_processing
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoderConfig,
    Qwen3OmniMoeVisionEncoderConfig,
)

from omnistage.models.qwen3_omni.audio_encoder import Qwen3OmniAudioEncoder
from omnistage.models.qwen3_omni.vision_encoder import Qwen3OmniVisionEncoder

ATOL = 1e-5
MEL = 128
# n_window stays 50 (chunks of 100 frames -> 13 rows: transformers hard-codes the 13);
# n_window_infer 200 gives attention windows of 2 chunks = 26 rows
AUDIO = dict(num_mel_bins=MEL, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
             d_model=32, output_dim=24, n_window=50, n_window_infer=200, conv_chunksize=3,
             downsample_hidden_size=8, max_source_positions=1500)
VISION = dict(depth=4, hidden_size=32, num_heads=4, intermediate_size=48, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=24,
              num_position_embeddings=64, deepstack_visual_indexes=[0, 2])


def _widen(module: torch.nn.Module) -> None:
    """transformers' init (std 0.02) gives near-constant outputs: widen every weight."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.normal_(0.0, 0.15)
            if "norm" in name or "ln_" in name:
                p.add_(1.0 if name.endswith("weight") else 0.0)


@pytest.fixture(scope="module")
def hf_audio() -> torch.nn.Module:
    model = hf_modeling.Qwen3OmniMoeAudioEncoder(Qwen3OmniMoeAudioEncoderConfig(**AUDIO)).eval()
    _widen(model)
    return model


@pytest.fixture(scope="module")
def hf_vision() -> torch.nn.Module:
    model = hf_modeling.Qwen3OmniMoeVisionEncoder(Qwen3OmniMoeVisionEncoderConfig(**VISION)).eval()
    _widen(model)
    return model


@pytest.fixture(scope="module")
def audio_encoder(hf_audio) -> Qwen3OmniAudioEncoder:
    enc = Qwen3OmniAudioEncoder(hf_audio.config.to_dict()).eval()
    enc.load_state_dict(hf_audio.state_dict(), strict=True)
    return enc


@pytest.fixture(scope="module")
def vision_encoder(hf_vision) -> Qwen3OmniVisionEncoder:
    enc = Qwen3OmniVisionEncoder(hf_vision.config.to_dict()).eval()
    enc.load_state_dict(hf_vision.state_dict(), strict=True)
    return enc


def _check(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    assert theirs.abs().mean() > 0.05 and theirs.std(0).mean() > 0.05, "reference output trivial"
    diff = (ours - theirs).abs().max().item()
    assert diff <= ATOL, diff


def _mel(frames: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(sum(frames))
    return [torch.randn(MEL, n, generator=gen) for n in frames]


@torch.no_grad()
def _hf_audio(hf_audio, feats: list[torch.Tensor]) -> torch.Tensor:
    lens = torch.tensor([f.shape[1] for f in feats])
    return hf_audio(input_features=torch.cat(feats, dim=1), feature_lens=lens).last_hidden_state


# 730 = 7 chunks + 30 frames -> 95 rows: windows 26, 26, 26, 17; 360 -> 47 rows: 26, 21;
# 200: whole chunks only; 101: one frame past a chunk; 70: shorter than a chunk (no padding)
@pytest.mark.parametrize("frames", [[730, 360], [200, 101], [70], [999]])
@torch.no_grad()
def test_audio_matches_transformers(hf_audio, audio_encoder, frames: list[int]) -> None:
    feats = _mel(frames)
    ours = audio_encoder(feats)
    assert [o.shape[0] for o in ours] == [Qwen3OmniAudioEncoder.num_tokens(n) for n in frames]
    _check(torch.cat(ours), _hf_audio(hf_audio, feats))


@torch.no_grad()
def test_audio_is_batch_invariant(hf_audio, audio_encoder) -> None:
    # an audio's rows never depend on its neighbours; each equals transformers' on it alone
    feats = _mel([70, 250, 130])
    ours = audio_encoder(feats)
    for f, o in zip(feats, ours, strict=True):
        alone = audio_encoder([f])[0]
        assert (alone - o).abs().max().item() <= 1e-5
        _check(o, _hf_audio(hf_audio, [f]))


def test_audio_num_tokens_matches_transformers_rule(audio_encoder) -> None:
    frames = torch.arange(0, 5001)
    for rule in (hf_modeling._get_feat_extract_output_lengths,
                 hf_processing._get_feat_extract_output_lengths):
        theirs = rule(frames, 50).tolist()
        assert [Qwen3OmniAudioEncoder.num_tokens(n) for n in range(5001)] == theirs
    assert Qwen3OmniAudioEncoder.num_tokens(730, n_window=50) == 95
    with pytest.raises(ValueError, match="frames"):
        Qwen3OmniAudioEncoder.num_tokens(-1)


def _pixels(grid: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4, generator=gen)


# grids: smaller and larger than the 8x8 position table, non-square; a video with t = 3
@pytest.mark.parametrize("grid", [[[1, 6, 8]], [[1, 6, 8], [1, 10, 4], [3, 4, 6]], [[2, 2, 2]]])
@torch.no_grad()
def test_vision_matches_transformers(hf_vision, vision_encoder, grid) -> None:
    grid = torch.tensor(grid)
    pixels = _pixels(grid, seed=len(grid))
    theirs = hf_vision(pixels, grid_thw=grid)
    embeds, deepstack = vision_encoder(pixels, grid)
    assert embeds.shape[0] == int(grid.prod(-1).sum()) // vision_encoder.merge**2
    _check(embeds, theirs.pooler_output)
    assert len(deepstack) == len(theirs.deepstack_features) == 2
    for ours_j, theirs_j in zip(deepstack, theirs.deepstack_features, strict=True):
        _check(ours_j, theirs_j)
    assert (deepstack[0] - deepstack[1]).abs().max() > 0.05  # distinct layers, distinct mergers


@torch.no_grad()
def test_vision_is_batch_invariant(vision_encoder) -> None:
    grid = torch.tensor([[1, 6, 8], [3, 4, 6]])
    pixels = _pixels(grid, seed=7)
    embeds, deepstack = vision_encoder(pixels, grid)
    split = (grid.prod(-1) // 4).tolist()
    alone = [vision_encoder(p, g[None]) for p, g in zip(pixels.split(grid.prod(-1).tolist()),
                                                           grid, strict=True)]
    for i, (e, ds) in enumerate(alone):
        assert (e - embeds.split(split)[i]).abs().max().item() <= 1e-5
        for j in range(2):
            assert (ds[j] - deepstack[j].split(split)[i]).abs().max().item() <= 1e-5


def test_load_weights(hf_audio, hf_vision, audio_encoder, vision_encoder) -> None:
    for hf, ours, prefix in ((hf_audio, audio_encoder, "thinker.audio_tower."),
                             (hf_vision, vision_encoder, "thinker.visual.")):
        fresh = type(ours)(hf.config.to_dict())
        named = [(prefix + k, v) for k, v in hf.state_dict().items()]
        fresh.load_weights(named)
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, ours.state_dict()[k]), k
        with pytest.raises(ValueError, match="missing"):
            fresh.load_weights(named[1:])
        with pytest.raises(ValueError, match="no matching parameter"):
            fresh.load_weights([*named, (prefix + "extra.weight", torch.zeros(1))])
        name, tensor = named[0]
        with pytest.raises(ValueError, match="shape"):
            fresh.load_weights([(name, tensor.new_zeros(tensor.numel() + 1))])


def test_input_validation(audio_encoder, vision_encoder) -> None:
    with pytest.raises(ValueError, match="features"):
        audio_encoder([torch.zeros(80, 100)])
    with pytest.raises(ValueError, match="features"):
        audio_encoder([])
    with pytest.raises(ValueError, match="grid_thw"):
        vision_encoder(torch.zeros(24, 96), torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="grid_thw"):
        vision_encoder(torch.zeros(12, 96), torch.tensor([[1, 3, 4]]))
    with pytest.raises(ValueError, match="pixel_values"):
        vision_encoder(torch.zeros(16, 100), torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="n_window_infer"):
        Qwen3OmniAudioEncoder({**AUDIO, "n_window_infer": 60})
    with pytest.raises(ValueError, match="deepstack_visual_indexes"):
        Qwen3OmniVisionEncoder({**VISION, "deepstack_visual_indexes": [2, 0]})
