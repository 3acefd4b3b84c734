"""Qwen-Image MMDiT (omnistage/models/qwen_image/transformer.py) against diffusers'
QwenImageTransformer2DModel on the same random weights: 2 blocks, 2 heads x 16, fp32 on the CPU
(plus one bf16 check of the dtype handling)."""

from __future__ import annotations

import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from omnistage.models.qwen_image.transformer import QwenImageTransformer, diffusers_name

TINY = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=[4, 6, 6])


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models() -> tuple[QwenImageTransformer2DModel, QwenImageTransformer]:
    """diffusers' model with every parameter random (matrices N(0, 1.5/sqrt(fan_in)), biases
    N(0, 0.1), norm weights N(1, 0.2)) and ours loaded from its state_dict."""
    torch.manual_seed(0)
    ref = QwenImageTransformer2DModel(**TINY).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.5 / p.shape[1] ** 0.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(1.0, 0.2)
    ours = QwenImageTransformer(dict(ref.config)).eval()
    ours.load_weights(ref.state_dict().items())
    return ref, ours


def _ref(ref, latents, timestep, text, mask, grid):
    with torch.no_grad():
        return ref(hidden_states=latents, encoder_hidden_states=text,
                   encoder_hidden_states_mask=mask, timestep=timestep,
                   img_shapes=[[(1, *grid)]] * latents.shape[0], return_dict=False)[0]


def _check_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    scale = ref.abs().max().item()
    assert ours.std() > 0.3 and scale > 1.0  # a live output, not near zero
    assert (ours - ref).abs().max().item() <= 1e-5 * scale


def test_matches_diffusers_per_row_timesteps_non_square(models):
    ref, ours = models
    grid, gen = (3, 5), torch.Generator().manual_seed(1)
    latents = torch.randn(3, 15, 64, generator=gen)
    text = torch.randn(3, 6, 32, generator=gen)
    timestep = torch.tensor([0.97, 0.41, 0.02])  # rows at different steps share the batch
    with torch.no_grad():
        out = ours(latents, timestep, text, None, grid)
        same_t = ours(latents, timestep[:1].expand(3).contiguous(), text, None, grid)
    _check_close(out, _ref(ref, latents, timestep, text, None, grid))
    assert out.shape == (3, 15, 64) and out.dtype == torch.float32
    assert torch.equal(out[0], same_t[0])
    assert (out[1:] - same_t[1:]).abs().mean() > 0.1  # each row uses its own timestep
    assert (out[0] - out[1]).abs().mean() > 0.1  # rows differ (not a broadcast of row 0)


def test_padded_batch_matches_each_sample_alone(models):
    """Texts of 7 and 4 tokens padded to 7 and masked = each sample alone, unpadded."""
    ref, ours = models
    grid, gen = (4, 2), torch.Generator().manual_seed(2)
    latents = torch.randn(2, 8, 64, generator=gen)
    text = torch.randn(2, 7, 32, generator=gen)
    text[1, 4:] = 100.0  # padding content must not leak
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    timestep = torch.tensor([0.8, 0.3])
    with torch.no_grad():
        out = ours(latents, timestep, text, mask, grid)
    for row, length in enumerate((7, 4)):
        alone = _ref(ref, latents[row:row + 1], timestep[row:row + 1],
                     text[row:row + 1, :length], None, grid)
        _check_close(out[row:row + 1], alone)
    _check_close(out, _ref(ref, latents, timestep, text, mask, grid))  # diffusers batched
    with torch.no_grad():
        unmasked = ours(latents, timestep, text, None, grid)
    assert (unmasked[1] - out[1]).abs().mean() > 0.1  # the mask is what hides the padding
    assert torch.allclose(unmasked[0], out[0], atol=1e-6)


def test_all_real_mask_equals_none(models):
    _, ours = models
    gen = torch.Generator().manual_seed(3)
    latents, text = torch.randn(1, 6, 64, generator=gen), torch.randn(1, 5, 32, generator=gen)
    timestep = torch.tensor([0.5])
    with torch.no_grad():
        a = ours(latents, timestep, text, torch.ones(1, 5, dtype=torch.bool), (2, 3))
        b = ours(latents, timestep, text, None, (2, 3))
    assert torch.allclose(a, b, atol=1e-6)


def test_bf16_follows_diffusers_dtype_handling(models):
    """bf16 on the CPU: the timestep rounded to bf16 before its sinusoid, norms in fp32 (an
    fp32 timestep would move the 1000x-scaled angles by ~0.1 rad: a visible difference)."""
    ref, ours = models
    ref16 = QwenImageTransformer2DModel(**TINY).eval()
    ref16.load_state_dict(ref.state_dict())
    ref16.to(torch.bfloat16)
    ours16 = QwenImageTransformer(TINY).eval()
    ours16.load_weights(ref.state_dict().items())
    ours16.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    latents = torch.randn(2, 12, 64, generator=gen).bfloat16()
    text = torch.randn(2, 5, 32, generator=gen).bfloat16()
    timestep = torch.tensor([0.8137, 0.3291])
    with torch.no_grad():
        out = ours16(latents, timestep, text, None, (3, 4))
    expected = _ref(ref16, latents, timestep.bfloat16(), text, None, (3, 4))
    assert out.dtype == torch.bfloat16
    err = (out.float() - expected.float()).abs().max().item()
    assert err <= 0.03 * expected.float().abs().max().item()


def test_names_round_trip_to_diffusers(models):
    ref, ours = models
    assert {diffusers_name(n) for n, _ in ours.named_parameters()} == set(ref.state_dict())


def test_load_weights_rejects_bad_checkpoints(models):
    ref, _ = models
    good = dict(ref.state_dict())
    ours = QwenImageTransformer(TINY)
    missing = {k: v for k, v in good.items() if k != "proj_out.bias"}
    with pytest.raises(ValueError, match="missing.*proj_out.bias"):
        ours.load_weights(missing.items())
    with pytest.raises(ValueError, match="guidance_embedder"):
        ours.load_weights([*good.items(), ("time_text_embed.guidance_embedder.weight",
                                           torch.zeros(3))])
    bad = dict(good, **{"txt_in.weight": torch.zeros(32, 31)})
    with pytest.raises(ValueError, match="txt_in.weight.*shape"):
        ours.load_weights(bad.items())


@pytest.mark.parametrize("override, field", [
    ({"axes_dims_rope": [4, 6, 8]}, "axes_dims_rope"),
    ({"axes_dims_rope": [5, 5, 6]}, "axes_dims_rope"),
    ({"guidance_embeds": True}, "guidance_embeds"),
    ({"zero_cond_t": True}, "zero_cond_t"),
    ({"num_layers": 0}, "num_layers"),
])
def test_config_errors_name_the_field(override, field):
    with pytest.raises(ValueError, match=field):
        QwenImageTransformer({**TINY, **override})


def test_input_errors_name_the_argument(models):
    _, ours = models
    latents, text, t = torch.zeros(1, 6, 64), torch.zeros(1, 5, 32), torch.zeros(1)
    with pytest.raises(ValueError, match="latents"):
        ours(latents, t, text, None, (3, 3))
    with pytest.raises(ValueError, match="timestep"):
        ours(latents, torch.zeros(2), text, None, (2, 3))
    with pytest.raises(ValueError, match="text_mask"):
        ours(latents, t, text, torch.ones(1, 5), (2, 3))
    with pytest.raises(ValueError, match="text:"):
        ours(latents, t, torch.zeros(1, 5, 16), None, (2, 3))
