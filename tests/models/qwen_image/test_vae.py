"""Qwen-Image VAE decoder (omnistage/models/qwen_image/vae.py) against diffusers'
AutoencoderKLQwenImage.decode on the same random weights, fp32 on the CPU: the released layout
(dim_mult 1/2/4/4, 2 residual blocks, temporal flags F/T/T) at base_dim 8, and another layout."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLQwenImage

from omnistage.models.qwen_image.vae import QwenImageVAEDecoder

RELEASED = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                temperal_downsample=[False, True, True])
OTHER = dict(base_dim=4, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
             temperal_downsample=[True, False], latents_mean=[0.5, -0.2, 0.1, 1.0],
             latents_std=[2.0, 0.7, 1.3, 1.1])


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _reference(config: dict) -> AutoencoderKLQwenImage:
    """Random weights on every time slice of the causal convs (so a wrong slice shows): conv
    weights N(0, 1.4/sqrt(in * kh * kw)), biases N(0, 0.05), gammas N(1, 0.2)."""
    torch.manual_seed(0)
    ref = AutoencoderKLQwenImage(**config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("gamma"):
                p.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
            else:
                p.normal_(0.0, 1.4 / (p.shape[1] * p.shape[-1] * p.shape[-2]) ** 0.5)
    return ref


@pytest.fixture(scope="module")
def released() -> tuple[AutoencoderKLQwenImage, QwenImageVAEDecoder]:
    ref = _reference(RELEASED)
    ours = QwenImageVAEDecoder(dict(ref.config)).eval()
    ours.load_weights(ref.state_dict().items())  # the whole VAE: encoder tensors skipped
    return ref, ours


def _expected(ref: AutoencoderKLQwenImage, latents: torch.Tensor) -> torch.Tensor:
    z = ref.config.z_dim
    mean = torch.tensor(ref.config.latents_mean).view(1, z, 1, 1, 1)
    std = torch.tensor(ref.config.latents_std).view(1, z, 1, 1, 1)
    with torch.no_grad():
        return ref.decode(latents[:, :, None] * std + mean).sample[:, :, 0].clamp(-1, 1)


def _check(ours: QwenImageVAEDecoder, ref: AutoencoderKLQwenImage, latents: torch.Tensor):
    with torch.no_grad():
        out = ours.decode(latents)
    expected = _expected(ref, latents)
    b, _, h, w = latents.shape
    factor = ours.cfg.scale_factor
    assert out.shape == expected.shape == (b, 3, factor * h, factor * w)
    inside = (expected.abs() < 1).float().mean().item()
    assert expected.std() > 0.2 and inside > 0.5  # a live image, mostly not clamped
    assert (out - expected).abs().max().item() <= 1e-5
    return out


def test_matches_diffusers_decode_released_layout(released):
    ref, ours = released
    latents = torch.randn(2, 16, 5, 7, generator=torch.Generator().manual_seed(1))
    out = _check(ours, ref, latents)
    assert out.shape == (2, 3, 40, 56)
    assert (out[0] - out[1]).abs().mean() > 0.1  # batch rows decoded separately


def test_matches_diffusers_decode_other_layout():
    ref = _reference(OTHER)
    ours = QwenImageVAEDecoder(dict(ref.config)).eval()
    ours.load_weights(ref.state_dict().items())
    latents = torch.randn(2, 4, 6, 3, generator=torch.Generator().manual_seed(2))
    assert _check(ours, ref, latents).shape == (2, 3, 24, 12)  # x4: two upsamplers


def test_load_weights_rejects_bad_checkpoints(released):
    ref, _ = released
    good = dict(ref.state_dict())
    ours = QwenImageVAEDecoder(RELEASED)
    missing = {k: v for k, v in good.items() if k != "decoder.conv_out.bias"}
    with pytest.raises(ValueError, match="missing.*decoder.conv_out.bias"):
        ours.load_weights(missing.items())
    with pytest.raises(ValueError, match="decoder.extra.weight"):
        ours.load_weights([*good.items(), ("decoder.extra.weight", torch.zeros(1))])
    name = "decoder.up_blocks.0.resnets.0.conv1.weight"
    flat = dict(good, **{name: good[name][:, :, :1]})  # a 1-frame kernel where 3 are expected
    with pytest.raises(ValueError, match="resnets.0.conv1.weight.*shape"):
        ours.load_weights(flat.items())
    gamma = "decoder.norm_out.gamma"
    with pytest.raises(ValueError, match="norm_out.gamma.*shape"):
        ours.load_weights(dict(good, **{gamma: torch.ones(4, 1, 1, 1)}).items())


@pytest.mark.parametrize("override, field", [
    ({"latents_std": [1.0] * 15}, "latents_std"),
    ({"temperal_downsample": [True]}, "temperal_downsample"),
    ({"attn_scales": [0.5]}, "attn_scales"),
    ({"z_dim": 0}, "z_dim"),
])
def test_config_errors_name_the_field(override, field):
    with pytest.raises(ValueError, match=field):
        QwenImageVAEDecoder({**RELEASED, **override})


def test_decode_rejects_wrong_latents(released):
    _, ours = released
    with pytest.raises(ValueError, match="latents"):
        ours.decode(torch.zeros(1, 8, 4, 4))
