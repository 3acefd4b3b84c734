"""The decoder half of diffusers' `AutoencoderKL` (SD / SDXL / Flux / SD3 / Z-Image VAEs).

Parameter names mirror diffusers' checkpoints (`decoder.up_blocks.0.resnets.1.conv2`,
`decoder.mid_block.attentions.0.to_q`, `post_quant_conv` ...), so the full VAE file loads by name
with the encoder skipped.

Layout: post_quant_conv (when the config uses it) -> conv_in -> mid block (resnet, single-head
self-attention over all pixels, resnet) -> up blocks from the widest channel count down (each
`layers_per_block + 1` resnets, then nearest x2 + 3x3 conv except the last) -> GroupNorm, SiLU,
conv_out.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.checkpoint import load_parameters

GROUP_NORM_EPS = 1e-6


class VAEResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_channels, eps=GROUP_NORM_EPS)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, out_channels, eps=GROUP_NORM_EPS)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.conv_shortcut = (nn.Conv2d(in_channels, out_channels, 1)
                              if in_channels != out_channels else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.conv_shortcut is None else self.conv_shortcut(x)) + h


class VAEAttention(nn.Module):
    """One head over all H*W positions, GroupNorm first, residual added."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, channels, eps=GROUP_NORM_EPS)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        tokens = self.group_norm(x).view(b, c, h * w).transpose(1, 2)  # [B, HW, C]
        q, k, v = (proj(tokens)[:, None] for proj in (self.to_q, self.to_k, self.to_v))
        out = self.to_out[0](F.scaled_dot_product_attention(q, k, v)[:, 0])
        return x + out.transpose(1, 2).reshape(b, c, h, w)


class VAEMidBlock(nn.Module):
    def __init__(self, channels: int, groups: int, attention: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([VAEResnetBlock(channels, channels, groups)
                                      for _ in range(2)])
        self.attentions = nn.ModuleList([VAEAttention(channels, groups)]) if attention else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x)
        if self.attentions is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x)


class VAEUpsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class VAEUpBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, layers: int, groups: int,
                 upsample: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([
            VAEResnetBlock(in_channels if i == 0 else out_channels, out_channels, groups)
            for i in range(layers)])
        self.upsamplers = nn.ModuleList([VAEUpsample(out_channels)]) if upsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)
        return x


class VAEDecoderBody(nn.Module):
    """diffusers' `Decoder` (group norms, no spatial-norm variant)."""

    def __init__(self, latent_channels: int, out_channels: int, widths: list[int],
                 layers_per_block: int, groups: int, mid_attention: bool) -> None:
        super().__init__()
        top = widths[-1]
        self.conv_in = nn.Conv2d(latent_channels, top, 3, padding=1)
        self.mid_block = VAEMidBlock(top, groups, mid_attention)
        reversed_widths = list(reversed(widths))
        self.up_blocks = nn.ModuleList([
            VAEUpBlock(reversed_widths[max(i - 1, 0)], width, layers_per_block + 1, groups,
                       upsample=i < len(widths) - 1)
            for i, width in enumerate(reversed_widths)])
        self.conv_norm_out = nn.GroupNorm(groups, widths[0], eps=GROUP_NORM_EPS)
        self.conv_out = nn.Conv2d(widths[0], out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


class AutoencoderKLDecoder(nn.Module):
    """Latents as the denoiser ends with -> images in [-1, 1]."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        widths = [int(c) for c in config.get("block_out_channels", [64])]
        up_types = list(config.get("up_block_types", ["UpDecoderBlock2D"]))
        if any(t != "UpDecoderBlock2D" for t in up_types) or len(up_types) != len(widths):
            raise ValueError(f"config.up_block_types: {up_types}: expected one "
                             f"'UpDecoderBlock2D' per block_out_channels entry ({len(widths)})")
        if config.get("act_fn", "silu") != "silu":
            raise ValueError(f"config.act_fn: {config.get('act_fn')!r} is not supported "
                             "(only 'silu')")
        self.latent_channels = int(config.get("latent_channels", 4))
        self.scaling_factor = float(config.get("scaling_factor", 0.18215))
        self.shift_factor = float(config.get("shift_factor") or 0.0)
        self.upscale = 2 ** (len(widths) - 1)
        self.decoder = VAEDecoderBody(
            self.latent_channels, int(config.get("out_channels", 3)), widths,
            int(config.get("layers_per_block", 1)), int(config.get("norm_num_groups", 32)),
            bool(config.get("mid_block_add_attention", True)))
        self.post_quant_conv = (nn.Conv2d(self.latent_channels, self.latent_channels, 1)
                                if config.get("use_post_quant_conv", True) else None)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The full VAE file by diffusers' names: encoder.* and quant_conv.* are skipped;
        ValueError on a missing, unexpected or mis-shaped decoder tensor."""
        def rename(name: str) -> str | None:
            return None if name.startswith(("encoder.", "quant_conv.")) else name
        load_parameters(self, tensors, rename=rename)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents: [B, latent_channels, h, w] -> [B, out_channels, h * 2^(n-1), w * 2^(n-1)]
        fp32 in [-1, 1]. Unscales as the pipelines do (`latents / scaling_factor +
        shift_factor`, in the model's dtype)."""
        if latents.dim() != 4 or latents.shape[1] != self.latent_channels:
            raise ValueError(f"latents: shape {tuple(latents.shape)}, expected "
                             f"[B, {self.latent_channels}, h, w]")
        z = latents.to(self.decoder.conv_in.weight.dtype) / self.scaling_factor
        z = z + self.shift_factor
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z).clamp(-1.0, 1.0).float()

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.decode(latents)
