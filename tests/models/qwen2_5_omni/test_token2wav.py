"""Qwen2_5OmniToken2Wav against transformers' Qwen2_5OmniToken2WavModel (tiny config, fp32 CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
    Qwen2_5OmniToken2WavConfig,
)
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

from omnistage.models.qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav

# the tiny token2wav config of shared/reference/tiny_omni_reference.py (x240, 24-frame blocks)
TINY_TOKEN2WAV = dict(
    dit_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                    ff_mult=2, emb_dim=16, block_size=24, look_ahead_layers=[1],
                    look_backward_layers=[0], repeats=2, num_embeds=128, mel_dim=80,
                    enc_emb_dim=16, enc_dim=16, enc_channels=[32, 32, 32, 32, 96],
                    enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1],
                    enc_attention_channels=16, enc_res2net_scale=2, enc_se_channels=16),
    bigvgan_config=dict(mel_dim=80, upsample_initial_channel=64, resblock_kernel_sizes=[3],
                        resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[5, 3, 2, 2, 2, 2],
                        upsample_kernel_sizes=[11, 7, 4, 4, 4, 4]))


@pytest.fixture(scope="module")
def models() -> tuple[Qwen2_5OmniToken2WavModel, Qwen2_5OmniToken2Wav]:
    return tiny_token2wav_pair()


def tiny_token2wav_pair() -> tuple[Qwen2_5OmniToken2WavModel, Qwen2_5OmniToken2Wav]:
    """transformers' tiny token2wav and ours with the same weights (also used by the
    code2wav streaming tests)."""
    torch.manual_seed(0)
    ref = Qwen2_5OmniToken2WavModel(Qwen2_5OmniToken2WavConfig(**TINY_TOKEN2WAV)).eval()
    # transformers' init makes the waveform ~1e-8; torch's default init gives a real signal
    for m in ref.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            m.reset_parameters()
    # that init leaves BigVGAN nearly deaf to its input (a new seed moves the wave by only ~1e-2):
    # boost its input conv so the waveform comparison also checks the mel path (still unclipped)
    ref.code2wav_bigvgan_model.conv_pre.weight.data *= 8
    ours = Qwen2_5OmniToken2Wav(TINY_TOKEN2WAV).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def _voice(seed: int, ref_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 16, generator=g), torch.randn(1, ref_frames, 80, generator=g)


def _codes(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 129, (n,), generator=torch.Generator().manual_seed(seed))


def _reference(ref: Qwen2_5OmniToken2WavModel, codes: torch.Tensor, cond: torch.Tensor,
               ref_mel: torch.Tensor, seed: int) -> torch.Tensor:
    # called the way Qwen2_5OmniForConditionalGeneration.generate calls token2wav
    torch.manual_seed(seed)
    with torch.no_grad():
        return ref(codes[None], conditioning=cond, reference_mel=ref_mel).reshape(-1).float()


def test_matches_transformers(models: tuple) -> None:
    ref, ours = models
    codes, (cond, ref_mel), seed = _codes(1, 40), _voice(2, 64), 7
    wav_ref = _reference(ref, codes, cond, ref_mel, seed)
    assert wav_ref.shape == (40 * 2 * 240,)
    assert wav_ref.pow(2).mean().sqrt() >= 0.01
    other = _reference(ref, codes, cond, ref_mel, seed + 1)
    assert (other - wav_ref).abs().max() > 1e-2  # the noise matters

    torch.manual_seed(seed)
    with torch.no_grad():
        mel_ref = ref.code2wav_dit_model.sample(cond, ref_mel, codes[None])[0]  # [80, F]
    mels, wavs = ours.generate([codes], [cond[0]], [ref_mel[0]],
                               [Qwen2_5OmniToken2Wav.initial_noise(seed, 80)])
    assert mels[0].shape == mel_ref.shape == (80, 80)
    assert mel_ref.abs().max() > 0.1
    assert (mels[0] - mel_ref).abs().max() < 1e-4
    assert wavs[0].dtype == torch.float32 and wavs[0].shape == wav_ref.shape
    assert (wavs[0] - wav_ref).abs().max() < 1e-4


def test_batch_equals_alone(models: tuple) -> None:
    _, ours = models
    lengths, ref_frames = [13, 40, 27, 13], [64, 50, 37, 41]
    codes = [_codes(10 + i, n) for i, n in enumerate(lengths)]
    voices = [_voice(20 + i, f) for i, f in enumerate(ref_frames)]
    noises = [Qwen2_5OmniToken2Wav.initial_noise(30 + i, 2 * n) for i, n in enumerate(lengths)]
    conds, ref_mels = [v[0] for v in voices], [v[1] for v in voices]
    mels, wavs = ours.generate(codes, conds, ref_mels, noises)
    for i in range(len(lengths)):
        mel1, wav1 = ours.generate([codes[i]], [conds[i]], [ref_mels[i]], [noises[i]])
        assert wav1[0].shape == (lengths[i] * 2 * 240,) and wav1[0].pow(2).mean() > 1e-4
        assert (mels[i] - mel1[0]).abs().max() < 1e-5
        assert (wavs[i] - wav1[0]).abs().max() < 1e-5
    # requests 0 and 3 share a length but not a voice or noise: their outputs must differ
    assert (wavs[0] - wavs[3]).abs().max() > 1e-2


def test_initial_noise_matches_transformers_draw() -> None:
    for seed, frames in ((0, 26), (123, 80), (5, 1001)):
        torch.manual_seed(seed)
        expected = torch.randn(1, frames, 80)  # what the DiT's sample() draws
        got = Qwen2_5OmniToken2Wav.initial_noise(seed, frames)
        assert got.shape == (frames, 80) and got.dtype == torch.float32
        assert torch.equal(got, expected[0])


@pytest.mark.parametrize("field,change", [
    ("codes", lambda a: a.update(codes=[torch.tensor([3, 129])])),
    ("codes", lambda a: a.update(codes=[torch.tensor([-1, 2])])),
    ("codes", lambda a: a.update(codes=[torch.zeros(0, dtype=torch.long)])),
    ("codes", lambda a: a.update(codes=[torch.tensor([1.0, 2.0])])),
    ("noises", lambda a: a.update(noises=[torch.zeros(5, 80)])),
    ("noises", lambda a: a.update(noises=[])),
    ("conds", lambda a: a.update(conds=[torch.zeros(15)])),
    ("ref_mels", lambda a: a.update(ref_mels=[torch.zeros(10, 81)])),
    ("ref_mels", lambda a: a.update(ref_mels=[torch.zeros(2, 80)])),
    ("num_steps", lambda a: a.update(num_steps=1)),
])
def test_bad_input_raises(models: tuple, field: str, change) -> None:
    _, ours = models
    args = dict(codes=[torch.tensor([1, 2, 3])], conds=[torch.zeros(16)],
                ref_mels=[torch.zeros(20, 80)], noises=[torch.zeros(6, 80)])
    ours.generate(**args, num_steps=2)  # the unchanged arguments are valid
    change(args)
    with pytest.raises(ValueError, match=field):
        ours.generate(**args)
