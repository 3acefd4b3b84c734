"""AutoencoderKLDecoder equals diffusers' AutoencoderKL.decode (latents / scaling_factor +
shift_factor, clamped to [-1, 1]) on the same weights: the Z-Image VAE layout (shift, no quant
convs) and an SD-style one (post_quant_conv, no shift, 2 resnets per block, channel changes)."""

import pytest
import torch

from omnistage.models.autoencoder_kl import AutoencoderKLDecoder
from omnistage.testing.tiny_z_image import VAE_CONFIG, reinit_vae_decoder_

diffusers = pytest.importorskip("diffusers")

SD_STYLE = {**VAE_CONFIG, "block_out_channels": [8, 16, 16], "down_block_types":
            ["DownEncoderBlock2D"] * 3, "up_block_types": ["UpDecoderBlock2D"] * 3,
            "layers_per_block": 2, "latent_channels": 4, "norm_num_groups": 4,
            "scaling_factor": 0.18215, "shift_factor": None, "use_quant_conv": True,
            "use_post_quant_conv": True}


def _pair(config: dict, seed: int = 0):
    torch.manual_seed(seed)
    ref = diffusers.AutoencoderKL(**config).eval()
    reinit_vae_decoder_(ref)
    with torch.no_grad():
        if ref.post_quant_conv is not None:
            ref.post_quant_conv.weight.normal_(0.0, 0.5)
    ours = AutoencoderKLDecoder(dict(config)).eval()
    ours.load_weights(ref.state_dict().items())  # the full VAE: the encoder is skipped
    return ref, ours


@pytest.mark.parametrize("config", [VAE_CONFIG, SD_STYLE], ids=["z_image", "sd_style"])
def test_decode_equals_diffusers(config):
    ref, ours = _pair(config)
    torch.manual_seed(1)
    latents = torch.randn(2, config["latent_channels"], 6, 5)  # batch 2, non-square
    with torch.no_grad():
        out = ours.decode(latents)
        shift = config["shift_factor"] or 0.0
        expected = ref.decode(latents / config["scaling_factor"] + shift).sample.clamp(-1, 1)
    up = 2 ** (len(config["block_out_channels"]) - 1)
    assert out.shape == (2, 3, 6 * up, 5 * up) and out.dtype == torch.float32
    assert expected.std() > 0.1 and (expected.abs() < 1).float().mean() > 0.5  # not flat
    assert (expected[0] - expected[1]).abs().mean() > 0.05
    assert (out - expected).abs().max() < 1e-5


def test_scaling_and_shift_are_applied():
    _, ours = _pair(VAE_CONFIG)
    latents = torch.randn(1, 16, 4, 4)
    with torch.no_grad():
        base = ours.decode(latents)
        ours.shift_factor += 0.5
        shifted = ours.decode(latents)
    assert (base - shifted).abs().mean() > 0.01


def test_load_weights_rejects_a_missing_decoder_tensor():
    ref, ours = _pair(VAE_CONFIG)
    state = {k: v for k, v in ref.state_dict().items() if k != "decoder.conv_out.bias"}
    with pytest.raises(ValueError, match="decoder.conv_out.bias"):
        ours.load_weights(state.items())
    with pytest.raises(ValueError, match="no matching parameter"):
        ours.load_weights([*ref.state_dict().items(), ("post_quant_conv.weight",
                                                       torch.zeros(16, 16, 1, 1))])


def test_rejects_unsupported_configs():
    with pytest.raises(ValueError, match="up_block_types"):
        AutoencoderKLDecoder({**VAE_CONFIG, "up_block_types": ["UpDecoderBlock2D"] * 3})
    with pytest.raises(ValueError, match="act_fn"):
        AutoencoderKLDecoder({**VAE_CONFIG, "act_fn": "gelu"})
    with pytest.raises(ValueError, match="latents"):
        AutoencoderKLDecoder(dict(VAE_CONFIG)).decode(torch.randn(1, 4, 4, 4))
