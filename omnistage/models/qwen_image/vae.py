"""Qwen-Image VAE decoder (diffusers' `AutoencoderKLQwenImage.decode`) for single images.

Path: normalised latents [B, z_dim, h, w] -> latents * std + mean -> post_quant_conv (1x1) ->
conv_in -> mid block (residual, single-head spatial attention, residual) -> up blocks (residual
blocks, then x2 nearest upsample + conv halving the channels, except the last) -> RMS norm ->
SiLU -> conv_out -> clamp to [-1, 1]: [B, 3, 8h, 8w].

NOTE: one frame through a causal 3-D VAE is a 2-D network. The checkpoint is a video VAE
(Wan-style causal Conv3d, time padding only in front, zeros). On a single frame with no cached
frames a k x k x k causal conv sees its frame only through its last time slice, so it equals a
2-D conv with weight[:, :, -1]; the temporal upsamplers' `time_conv` runs only from the second
frame on (diffusers marks the first chunk "Rep" and skips it), so its weights are never used.
We keep 2-D convs (faster, less memory) and convert the tensors when loading. The RMS norms
normalise over channels: F.normalize(x) * sqrt(C) * gamma, in fp32 for half inputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.checkpoint import load_parameters

# Wan / Qwen-Image VAE per-channel latent statistics (diffusers' defaults, the released config)
_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134,
                 -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526,
                2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)
# checkpoint tensors decoding does not use: the encoder side, and the temporal upsample convs
_SKIPPED_PREFIXES = ("encoder.", "quant_conv.")
_SKIPPED_PARTS = (".time_conv.",)


@dataclass(frozen=True)
class QwenImageVAEConfig:
    """vae/config.json (defaults: the released Qwen-Image VAE)."""

    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temperal_downsample: tuple[bool, ...] = (False, True, True)  # diffusers' spelling
    latents_mean: tuple[float, ...] = _LATENTS_MEAN
    latents_std: tuple[float, ...] = _LATENTS_STD

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> QwenImageVAEConfig:
        if not isinstance(cfg, dict):
            raise ValueError(f"vae config: a dict, got {type(cfg).__name__}")
        if cfg.get("attn_scales"):
            raise ValueError(f"vae config.attn_scales: {cfg['attn_scales']!r} is not supported "
                             "(the decoder has no attention at scales; expected [])")
        if cfg.get("input_channels", 3) != 3:
            raise ValueError(f"vae config.input_channels: 3 (RGB), got {cfg['input_channels']}")
        d = cls()

        def seq(name: str, kind: type) -> tuple:
            value = cfg.get(name, getattr(d, name))
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"vae config.{name}: a list, got {value!r}")
            return tuple(kind(v) for v in value)

        return cls(base_dim=int(cfg.get("base_dim", d.base_dim)),
                   z_dim=int(cfg.get("z_dim", d.z_dim)),
                   dim_mult=seq("dim_mult", int),
                   num_res_blocks=int(cfg.get("num_res_blocks", d.num_res_blocks)),
                   temperal_downsample=seq("temperal_downsample", bool),
                   latents_mean=seq("latents_mean", float),
                   latents_std=seq("latents_std", float))

    def __post_init__(self) -> None:
        for name in ("base_dim", "z_dim", "num_res_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"vae config.{name}: >= 1, got {getattr(self, name)}")
        if len(self.dim_mult) < 2 or min(self.dim_mult) < 1:
            raise ValueError(f"vae config.dim_mult: >= 2 ints >= 1, got {self.dim_mult}")
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(f"vae config.temperal_downsample: {len(self.dim_mult) - 1} flags "
                             f"(one per downsample), got {len(self.temperal_downsample)}")
        for name in ("latents_mean", "latents_std"):
            if len(getattr(self, name)) != self.z_dim:
                raise ValueError(f"vae config.{name}: {self.z_dim} values (z_dim), got "
                                 f"{len(getattr(self, name))}")
        if min(self.latents_std) <= 0:
            raise ValueError("vae config.latents_std: values > 0")
        if any(self.base_dim * m % 2 for m in self.dim_mult[1:]):
            raise ValueError("vae config.base_dim * dim_mult: even (each upsampler halves)")

    @property
    def scale_factor(self) -> int:
        """Pixels per latent along each side (8 on the release)."""
        return 2 ** len(self.temperal_downsample)


class QwenImageRMSNorm(nn.Module):
    """Channel RMS norm of [B, C, H, W]: F.normalize over C * sqrt(C) * gamma."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))
        self.scale = dim ** 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xn = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        return F.normalize(xn, dim=1).to(x.dtype) * self.scale * self.gamma[:, None, None]


class QwenImageResBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.norm1 = QwenImageRMSNorm(in_dim)
        self.conv1 = nn.Conv2d(in_dim, out_dim, 3, padding=1)
        self.norm2 = QwenImageRMSNorm(out_dim)
        self.conv2 = nn.Conv2d(out_dim, out_dim, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(in_dim, out_dim, 1) if in_dim != out_dim else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.conv_shortcut is None else self.conv_shortcut(x)
        x = self.conv1(F.silu(self.norm1(x)))
        return self.conv2(F.silu(self.norm2(x))) + shortcut


class QwenImageAttnBlock(nn.Module):
    """Single-head self-attention over the h*w positions, channels as the head dim."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = QwenImageRMSNorm(dim)
        self.to_qkv = nn.Conv2d(dim, 3 * dim, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        qkv = self.to_qkv(self.norm(x)).flatten(2).transpose(1, 2)[:, None]  # [B, 1, hw, 3C]
        q, k, v = qkv.chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v)[:, 0].transpose(1, 2).reshape(b, c, h, w)
        return self.proj(out) + x


class QwenImageMidBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([QwenImageResBlock(dim, dim), QwenImageResBlock(dim, dim)])
        self.attentions = nn.ModuleList([QwenImageAttnBlock(dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


class QwenImageUpBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, num_res: int, upsample: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(QwenImageResBlock(in_dim if i == 0 else out_dim, out_dim)
                                     for i in range(num_res))
        # checkpoint name: upsamplers.0.resample.1 (resample.0 is the parameter-free upsample)
        self.upsample = nn.Conv2d(out_dim, out_dim // 2, 3, padding=1) if upsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        if self.upsample is not None:
            # nearest-exact x2 (= nearest for an integer factor), in fp32 as diffusers
            x = F.interpolate(x.float(), scale_factor=2.0, mode="nearest-exact").to(x.dtype)
            x = self.upsample(x)
        return x


class QwenImageDecoder(nn.Module):
    def __init__(self, cfg: QwenImageVAEConfig) -> None:
        super().__init__()
        mult = cfg.dim_mult
        dims = [cfg.base_dim * m for m in (mult[-1], *mult[::-1])]
        self.conv_in = nn.Conv2d(cfg.z_dim, dims[0], 3, padding=1)
        self.mid_block = QwenImageMidBlock(dims[0])
        blocks = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            # every upsampler halves the channels, so later blocks start from half
            blocks.append(QwenImageUpBlock(in_dim // 2 if i > 0 else in_dim, out_dim,
                                           cfg.num_res_blocks + 1, upsample=i < len(mult) - 1))
        self.up_blocks = nn.ModuleList(blocks)
        self.norm_out = QwenImageRMSNorm(dims[-1])
        self.conv_out = nn.Conv2d(dims[-1], 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.norm_out(x)))


class QwenImageVAEDecoder(nn.Module):
    """Decoder half of the Qwen-Image VAE (parameter names as the checkpoint's, see `_rename`)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        cfg = QwenImageVAEConfig.from_dict(config)
        self.cfg = cfg
        self.post_quant_conv = nn.Conv2d(cfg.z_dim, cfg.z_dim, 1)
        self.decoder = QwenImageDecoder(cfg)
        # plain attributes, not buffers: model.to(bf16) must not round them before use
        self.latents_mean = torch.tensor(cfg.latents_mean, dtype=torch.float32)
        self.latents_std = torch.tensor(cfg.latents_std, dtype=torch.float32)

    @staticmethod
    def _rename(name: str) -> str | None:
        if name.startswith(_SKIPPED_PREFIXES) or any(p in name for p in _SKIPPED_PARTS):
            return None
        return name.replace(".upsamplers.0.resample.1.", ".upsample.")

    def _to_2d(self, tensors: Iterable[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint (3-D causal conv) tensors as our 2-D parameters (see the module NOTE)."""
        params = dict(self.named_parameters())
        for name, tensor in tensors:
            ours = self._rename(name)
            p = params.get(ours) if ours is not None else None
            if p is not None and p.dim() == 4 and tensor.dim() == 5:
                expected = (*p.shape[:2], p.shape[-1], *p.shape[2:])  # cubic kernels
                if tuple(tensor.shape) != expected:
                    raise ValueError(f"checkpoint tensor 'vae.{name}': shape "
                                     f"{tuple(tensor.shape)}, expected {expected}")
                tensor = tensor[:, :, -1]  # the slice that sees the current frame
            elif p is not None and name.endswith(".gamma") and tensor.dim() > 1:
                if tensor.shape[0] != p.shape[0] or tensor.numel() != p.numel():
                    raise ValueError(f"checkpoint tensor 'vae.{name}': shape "
                                     f"{tuple(tensor.shape)}, expected ({p.shape[0]}, 1, ...)")
                tensor = tensor.reshape(p.shape)
            yield name, tensor

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the VAE file's tensors (vae/*.safetensors, diffusers' names) into the decoder;
        the encoder, quant_conv and temporal upsample convs are skipped. ValueError on an
        unknown name, a wrong shape or a missing tensor."""
        load_parameters(self, self._to_2d(tensors), rename=self._rename, shown_prefix="vae.")

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, z_dim, h, w], normalised (the denoiser's space) -> images
        [B, 3, 8h, 8w] in [-1, 1], in the module's dtype."""
        cfg = self.cfg
        if latents.dim() != 4 or latents.shape[1] != cfg.z_dim:
            raise ValueError(f"latents: [B, {cfg.z_dim}, h, w], got {tuple(latents.shape)}")
        dtype = self.post_quant_conv.weight.dtype
        if self.latents_std.device != latents.device:
            self.latents_mean = self.latents_mean.to(latents.device)
            self.latents_std = self.latents_std.to(latents.device)
        # as diffusers' pipeline: divide by 1/std, both statistics in the latents' dtype first
        inv_std = (1.0 / self.latents_std).to(dtype)[:, None, None]
        z = latents.to(dtype) / inv_std + self.latents_mean.to(dtype)[:, None, None]
        return self.decoder(self.post_quant_conv(z)).clamp(-1.0, 1.0)
