"""Qwen2.5-Omni code2wav BigVGAN vocoder: log-mel [B, 80, F] -> waveform [B, F * 240] at 24 kHz.

Parameter names mirror the checkpoint's `token2wav.code2wav_bigvgan_model.*` tensors. Its convs pad
at the sequence ends, so a batch must hold mels of one length (the caller groups them).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# -115 dB as a natural-log amplitude floor, rounded to float32 as a float32 exp would give it
MEL_FLOOR = float(torch.tensor(-115 / 20.0 * math.log(10)).exp())


def _kaiser_lowpass(cutoff: float, half_width: float, taps: int) -> torch.Tensor:
    """Kaiser-windowed sinc low-pass filter with unit DC gain: [taps]."""
    half = taps // 2
    # Kaiser's empirical formulas for the attenuation of a transition band of this width
    atten = 2.285 * (half - 1) * math.pi * 4 * half_width + 7.95
    if atten > 50.0:
        beta = 0.1102 * (atten - 8.7)
    elif atten >= 21.0:
        beta = 0.5842 * (atten - 21) ** 0.4 + 0.07886 * (atten - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(taps, periodic=False, beta=beta, dtype=torch.float32)
    # even filters are centred between two taps
    t = torch.arange(-half, half) + 0.5 if taps % 2 == 0 else torch.arange(taps) - half
    filt = 2 * cutoff * window * torch.sinc(2 * cutoff * t)
    return filt / filt.sum()


class Qwen2_5OmniSnakeBeta(nn.Module):
    """x + sin^2(x * e^alpha) / e^beta, per channel."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, L]
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        return x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)


@functools.cache
def _triton_kernels() -> Any:
    """bigvgan_triton (the fused activation), or None where triton is missing."""
    try:
        from omnistage.models.qwen2_5_omni import bigvgan_triton
    except ImportError:
        return None
    return bigvgan_triton


def _triton_variant(x: torch.Tensor, act: Qwen2_5OmniSnakeBeta) -> str | None:
    """The fused Triton kernel's default variant for this call (None: the torch path). It
    serves CUDA inference (it has no backward); host only: CUDA-graph safe."""
    if not x.is_cuda or (kernels := _triton_kernels()) is None:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or act.alpha.requires_grad):
        return None
    return kernels.DEFAULT_VARIANT


class Qwen2_5OmniAntiAliasedSnake(nn.Module):
    """Snake at twice the sample rate: 2x upsample, activation, 2x downsample (12-tap filters).
    triton: the fused kernel on CUDA: "auto" (its default variant), "off", or a variant."""

    def __init__(self, channels: int, taps: int = 12) -> None:
        super().__init__()
        self.act = Qwen2_5OmniSnakeBeta(channels)
        self.taps = taps
        self.triton = "auto"
        self.register_buffer("filter", _kaiser_lowpass(0.25, 0.3, taps), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, L] -> [B, C, L]
        variant = None
        if self.taps == 12 and self.triton != "off":
            variant = _triton_variant(x, self.act)
            if variant is not None and self.triton != "auto":
                variant = self.triton
        if variant is not None:
            return _triton_kernels().anti_aliased_snake(x, self.act.alpha, self.act.beta,
                                                        self.filter, variant)
        c, k = x.shape[1], self.taps
        w = self.filter.to(x.dtype).expand(c, 1, k)
        pad = k // 2 - 1
        up = F.conv_transpose1d(F.pad(x, (pad, pad), mode="replicate"), w, stride=2, groups=c)
        crop = 2 * pad + (k - 2) // 2  # keep exactly 2L samples, aligned with the input
        up = 2 * up[..., crop: up.shape[-1] - (2 * pad + (k - 1) // 2)]
        up = self.act(up)
        down = F.pad(up, (k // 2 - 1 + k % 2, k // 2), mode="replicate")
        return F.conv1d(down, w, stride=2, groups=c)


class Qwen2_5OmniAMPBlock(nn.Module):
    """Residual block: three (snake, dilated conv, snake, conv) branches in sequence."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        if len(dilations) != 3:
            raise ValueError("bigvgan_config.resblock_dilation_sizes: each entry needs 3 dilations")
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel, dilation=d, padding=d * (kernel - 1) // 2)
            for d in dilations)
        self.convs2 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel, padding=(kernel - 1) // 2) for _ in dilations)
        self.activations = nn.ModuleList(Qwen2_5OmniAntiAliasedSnake(channels) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, L]
        for i, (conv1, conv2) in enumerate(zip(self.convs1, self.convs2, strict=True)):
            h = conv1(self.activations[2 * i](x))
            x = x + conv2(self.activations[2 * i + 1](h))
        return x


@dataclass(frozen=True)
class BigVGANLayout:
    """BigVGAN's shape, from the checkpoint's bigvgan_config (its defaults: the released one)."""

    mel_dim: int
    channels: int  # upsample_initial_channel: stage i runs at channels >> (i + 1)
    rates: tuple[int, ...]
    kernels: tuple[int, ...]
    res_kernels: tuple[int, ...]
    res_dils: tuple[tuple[int, ...], ...]

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> BigVGANLayout:
        layout = cls(cfg.get("mel_dim", 80), cfg.get("upsample_initial_channel", 1536),
                     tuple(cfg.get("upsample_rates", (5, 3, 2, 2, 2, 2))),
                     tuple(cfg.get("upsample_kernel_sizes", (11, 7, 4, 4, 4, 4))),
                     tuple(cfg.get("resblock_kernel_sizes", (3, 7, 11))),
                     tuple(tuple(d) for d in cfg.get("resblock_dilation_sizes",
                                                     [(1, 3, 5)] * 3)))
        if len(layout.rates) != len(layout.kernels):
            raise ValueError("bigvgan_config.upsample_kernel_sizes: needs one per upsample rate")
        if len(layout.res_kernels) != len(layout.res_dils):
            raise ValueError("bigvgan_config.resblock_dilation_sizes: needs one per kernel size")
        return layout

    def snake_shapes(self, batch: int, frames: int) -> set[tuple[int, int, int]]:
        """The [B, C, L] inputs of the anti-aliased Snakes in forward() on [batch, mel, frames]
        (what their Triton kernel is compiled for: kernels_ahead)."""
        shapes, length = set(), frames
        for i, (r, k) in enumerate(zip(self.rates, self.kernels, strict=True)):
            length = (length - 1) * r - 2 * ((k - r) // 2) + k  # the ConvTranspose1d's
            shapes.add((batch, self.channels >> (i + 1), length))  # its AMP blocks keep L
        return shapes


class Qwen2_5OmniToken2WavBigVGAN(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        layout = BigVGANLayout.from_config(cfg)
        ch, rates = layout.channels, layout.rates
        self.num_kernels = len(layout.res_kernels)
        self.hop = math.prod(rates)
        self.conv_pre = nn.Conv1d(layout.mel_dim, ch, 7, padding=3)
        # one extra ModuleList level per stage: the checkpoint's names are ups.{i}.0.*
        self.ups = nn.ModuleList(
            nn.ModuleList([nn.ConvTranspose1d(ch >> i, ch >> (i + 1), k, r, padding=(k - r) // 2)])
            for i, (r, k) in enumerate(zip(rates, layout.kernels, strict=True)))
        self.resblocks = nn.ModuleList(
            Qwen2_5OmniAMPBlock(ch >> (i + 1), k, d)
            for i in range(len(rates))
            for k, d in zip(layout.res_kernels, layout.res_dils, strict=True))
        self.activation_post = Qwen2_5OmniAntiAliasedSnake(ch >> len(rates))
        self.conv_post = nn.Conv1d(ch >> len(rates), 1, 7, padding=3, bias=False)

    def set_triton(self, mode: str) -> None:
        """Every anti-aliased Snake's fused kernel: "auto", "off", "recompute" or "gather"."""
        if mode not in ("auto", "off", "recompute", "gather"):
            raise ValueError(f"bigvgan_triton: 'auto', 'off', 'recompute' or 'gather', got "
                             f"{mode!r}")
        for m in self.modules():
            if isinstance(m, Qwen2_5OmniAntiAliasedSnake):
                m.triton = mode

    @staticmethod
    def normalize_mel(mel: torch.Tensor) -> torch.Tensor:
        """Natural-log mel -> dB (floor -115 dB, -20 dB offset) -> clamp into [-1, 1]."""
        # a Python float, not a device tensor: no host-to-device copy (CUDA-graph capturable)
        db = 20 * torch.log10(torch.clamp(torch.exp(mel), min=MEL_FLOOR)) - 20
        return torch.clamp(2 * ((db + 115) / 115) - 1, -1, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:  # [B, mel, F] -> [B, F * hop] in [-1, 1]
        x = self.conv_pre(self.normalize_mel(mel))
        for i, (up,) in enumerate(self.ups):
            x = up(x)
            blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
            x = sum(block(x) for block in blocks) / self.num_kernels
        x = self.conv_post(self.activation_post(x))
        return torch.clamp(x, -1.0, 1.0).squeeze(1)
