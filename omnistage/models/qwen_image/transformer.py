"""Qwen-Image MMDiT: diffusers' `QwenImageTransformer2DModel`, text-to-image (no guidance embed).

Path of one denoising step: packed latent tokens [B, L, in_channels] -> img_in; text hidden
states [B, T, joint_attention_dim] -> RMSNorm -> txt_in; timestep -> 256-wide sinusoid -> MLP =
temb. Each double-stream block: per stream, LayerNorm + adaLN shift/scale from temb, q/k/v with
per-head RMS q/k norm, one joint attention over [text; image] with 3-axis rope, gated residual,
LayerNorm + adaLN + GELU(tanh) MLP, gated residual. Then adaLN (`norm_out`, scale before shift)
and `proj_out` on the image tokens. Parameters load by diffusers' names (see `_RENAMES`).

NOTE: rope positions (diffusers' `QwenEmbedRope` with scale_rope). head_dim splits into three
axes (axes_dims_rope: frame, row, column); channel pairs (2k, 2k+1) rotate by pos * theta^(-2k/d)
within each axis (theta 10000). Image token (i, j) of an h x w grid has positions
(0, i - ceil(h/2), j - ceil(w/2)) (centred rows/columns); text token t has t + max(h//2, w//2) on
all three axes, so text positions do not depend on the text length (padding at the end changes
nothing for the real tokens).

dtype notes (as diffusers, for bf16 parity): the timestep is rounded to the module dtype before
its sinusoid (computed in fp32); RMS norms and rope in fp32, cast to the weight / input dtype.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from omnistage.checkpoint import load_parameters
from omnistage.layers.compile import raise_recompile_limit

ROPE_THETA = 10000.0
TIME_PROJ_DIM = 256  # diffusers' Timesteps(num_channels=256, flip_sin_to_cos, scale=1000)
NORM_EPS = 1e-6
ROPE_CACHE_SIZE = 32
# cuDNN's attention first where it applies (bf16 on Hopper), then flash, then the others
CUDA_ATTENTION_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                           SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# diffusers name fragment -> ours, applied in order to every checkpoint name
_RENAMES = (
    ("time_text_embed.timestep_embedder.linear_1.", "time_in."),
    ("time_text_embed.timestep_embedder.linear_2.", "time_out."),
    (".img_mod.1.", ".img_mod."), (".txt_mod.1.", ".txt_mod."),
    (".attn.to_out.0.", ".attn.to_out."),
    ("_mlp.net.0.proj.", "_mlp.fc1."), ("_mlp.net.2.", "_mlp.fc2."),
    ("norm_out.linear.", "norm_out."),
)
# config flags of other Qwen-Image variants (edit, layered, distilled) this module does not run
_UNSUPPORTED_FLAGS = ("guidance_embeds", "zero_cond_t", "use_additional_t_cond",
                      "use_layer3d_rope")


@dataclass(frozen=True)
class QwenImageTransformerConfig:
    """transformer/config.json (defaults: the released Qwen-Image, ~20B)."""

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> QwenImageTransformerConfig:
        if not isinstance(cfg, dict):
            raise ValueError(f"transformer config: a dict, got {type(cfg).__name__}")
        for flag in _UNSUPPORTED_FLAGS:
            if cfg.get(flag):
                raise ValueError(f"transformer config.{flag}: true is not supported "
                                 "(text-to-image Qwen-Image only)")
        d = cls()
        in_channels = int(cfg.get("in_channels", d.in_channels))
        axes = cfg.get("axes_dims_rope", d.axes_dims_rope)
        if not isinstance(axes, (list, tuple)) or len(axes) != 3:
            raise ValueError(f"transformer config.axes_dims_rope: three ints, got {axes!r}")
        return cls(
            patch_size=int(cfg.get("patch_size", d.patch_size)),
            in_channels=in_channels,
            out_channels=int(cfg.get("out_channels") or in_channels),
            num_layers=int(cfg.get("num_layers", d.num_layers)),
            attention_head_dim=int(cfg.get("attention_head_dim", d.attention_head_dim)),
            num_attention_heads=int(cfg.get("num_attention_heads", d.num_attention_heads)),
            joint_attention_dim=int(cfg.get("joint_attention_dim", d.joint_attention_dim)),
            axes_dims_rope=tuple(int(a) for a in axes))

    def __post_init__(self) -> None:
        for name in ("patch_size", "in_channels", "out_channels", "num_layers",
                     "attention_head_dim", "num_attention_heads", "joint_attention_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"transformer config.{name}: >= 1, got {getattr(self, name)}")
        if any(a < 0 or a % 2 for a in self.axes_dims_rope):
            raise ValueError("transformer config.axes_dims_rope: even ints >= 0, got "
                             f"{self.axes_dims_rope}")
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(f"transformer config.axes_dims_rope: {self.axes_dims_rope} must sum "
                             f"to attention_head_dim {self.attention_head_dim}")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def out_dim(self) -> int:
        """Width of a returned token: out_channels * patch^2 (64 on the release)."""
        return self.out_channels * self.patch_size ** 2


def diffusers_name(name: str) -> str:
    """Our parameter name -> the checkpoint's (the inverse of `load_weights`' renaming)."""
    for old, new in reversed(_RENAMES):
        name = name.replace(new, old)
    return name


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = NORM_EPS) -> torch.Tensor:
    # diffusers' RMSNorm: statistics in fp32, cast to the weight's dtype before the scale
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(weight.dtype) * weight


def _layer_norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=NORM_EPS)


def _rope_angles(positions: torch.Tensor, axes_dims: tuple[int, ...]) -> torch.Tensor:
    """positions [S, 3] (frame, row, column) -> angles [S, sum(axes_dims) / 2] fp32."""
    parts = []
    for axis, dim in enumerate(axes_dims):
        exponent = torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim
        inv_freq = 1.0 / torch.pow(ROPE_THETA, exponent)
        parts.append(positions[:, axis, None].float() * inv_freq)
    return torch.cat(parts, dim=-1)


def rope_positions(grid: tuple[int, int], text_len: int,
                   device: torch.device | None = None) -> torch.Tensor:
    """Positions [text_len + h*w, 3] of the joint sequence [text; image] (see the module NOTE)."""
    h, w = grid
    rows = torch.arange(h, device=device) - (h - h // 2)
    cols = torch.arange(w, device=device) - (w - w // 2)
    image = torch.stack([torch.zeros(h, w, dtype=torch.long, device=device),
                         rows[:, None].expand(h, w), cols[None, :].expand(h, w)], dim=-1)
    text = (torch.arange(text_len, device=device) + max(h // 2, w // 2))[:, None].expand(-1, 3)
    return torch.cat([text, image.reshape(h * w, 3)], dim=0)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, S, H, hd]; cos/sin [S, hd/2] fp32; pairs (2k, 2k+1) rotate as complex numbers
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None], sin[:, None]
    out = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


class _Weight(nn.Module):
    """A bare norm weight (keeps diffusers' `<name>.weight` parameter names)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class QwenImageFeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class QwenImageJointAttention(nn.Module):
    """One attention over [text; image]: image projections to_*, text projections add_*."""

    def __init__(self, cfg: QwenImageTransformerConfig) -> None:
        super().__init__()
        dim, hd = cfg.inner_dim, cfg.attention_head_dim
        self.head_dim = hd
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)
        self.to_add_out = nn.Linear(dim, dim)
        for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            setattr(self, name, _Weight(hd))

    def qkv(self, img: torch.Tensor, txt: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [B, T+L, H, hd] of the joint sequence [text; image], q/k normed and rotated."""
        hd = self.head_dim

        def heads(proj: nn.Linear, x: torch.Tensor, norm: _Weight | None = None) -> torch.Tensor:
            y = proj(x).unflatten(-1, (-1, hd))  # [B, S, H, hd]
            return y if norm is None else _rms_norm(y, norm.weight)

        q = torch.cat([heads(self.add_q_proj, txt, self.norm_added_q),
                       heads(self.to_q, img, self.norm_q)], dim=1)
        k = torch.cat([heads(self.add_k_proj, txt, self.norm_added_k),
                       heads(self.to_k, img, self.norm_k)], dim=1)
        v = torch.cat([heads(self.add_v_proj, txt), heads(self.to_v, img)], dim=1)
        return _apply_rope(q, *rope), _apply_rope(k, *rope), v


def joint_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text_len: int,
                    groups: list[tuple[torch.Tensor, int]] | None) -> torch.Tensor:
    """Attention over [text; image] ([B, S, H, hd] in and out). groups: None (no text padding)
    or (rows, real text length) per distinct length."""
    if not q.is_cuda:
        return _joint_attention(q, k, v, text_len, groups)
    with sdpa_kernel(CUDA_ATTENTION_BACKENDS, set_priority=True):
        return _joint_attention(q, k, v, text_len, groups)


def _joint_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text_len: int,
                     groups: list[tuple[torch.Tensor, int]] | None) -> torch.Tensor:
    if groups is None:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2)).transpose(1, 2)
    # NOTE: one unmasked attention per text length over the real tokens only (flash kernels
    # take no mask); padded text rows keep zeros (nothing reads them)
    out = torch.zeros_like(q)
    for rows, length in groups:
        real = torch.cat([torch.arange(length, device=q.device),
                          torch.arange(text_len, q.shape[1], device=q.device)])
        pick = (rows[:, None], real[None, :])
        out[pick] = F.scaled_dot_product_attention(
            q[pick].transpose(1, 2), k[pick].transpose(1, 2),
            v[pick].transpose(1, 2)).transpose(1, 2)
    return out


class QwenImageBlock(nn.Module):
    def __init__(self, cfg: QwenImageTransformerConfig) -> None:
        super().__init__()
        dim = cfg.inner_dim
        self.img_mod = nn.Linear(dim, 6 * dim)
        self.txt_mod = nn.Linear(dim, 6 * dim)
        self.attn = QwenImageJointAttention(cfg)
        self.img_mlp = QwenImageFeedForward(dim)
        self.txt_mlp = QwenImageFeedForward(dim)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, temb_act: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor],
                groups: list[tuple[torch.Tensor, int]] | None, text_out: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """text_out=False (the last block): the text stream is not updated (nothing reads it).
        NOTE: pre and post hold every elementwise op (torch.compile fuses them on GPU); the
        attention between them stays eager (its text-length groups vary per step)."""
        q, k, v, img_mod, txt_mod = self.pre(img, txt, temb_act, rope)
        out = joint_attention(q, k, v, txt.shape[1], groups).flatten(2)  # [B, T+L, D]
        return self.post(img, txt, out, img_mod, txt_mod, text_out)

    def pre(self, img: torch.Tensor, txt: torch.Tensor, temb_act: torch.Tensor,
            rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        # temb_act: silu(temb) [B, D]; each mod row: shift, scale, gate (attention), same (MLP)
        img_mod = self.img_mod(temb_act)[:, None]
        txt_mod = self.txt_mod(temb_act)[:, None]
        i, t = img_mod.chunk(6, dim=-1), txt_mod.chunk(6, dim=-1)
        q, k, v = self.attn.qkv(_layer_norm(img) * (1 + i[1]) + i[0],
                                _layer_norm(txt) * (1 + t[1]) + t[0], rope)
        return q, k, v, img_mod, txt_mod

    def post(self, img: torch.Tensor, txt: torch.Tensor, out: torch.Tensor, img_mod: torch.Tensor,
             txt_mod: torch.Tensor, text_out: bool) -> tuple[torch.Tensor, torch.Tensor]:
        text_len, a = txt.shape[1], self.attn
        i, t = img_mod.chunk(6, dim=-1), txt_mod.chunk(6, dim=-1)
        img = img + i[2] * a.to_out(out[:, text_len:])
        img = img + i[5] * self.img_mlp(_layer_norm(img) * (1 + i[4]) + i[3])
        if text_out:
            txt = txt + t[2] * a.to_add_out(out[:, :text_len])
            txt = txt + t[5] * self.txt_mlp(_layer_norm(txt) * (1 + t[4]) + t[3])
        if img.dtype == torch.float16:  # as diffusers: keep fp16 activations finite
            img, txt = img.clip(-65504, 65504), txt.clip(-65504, 65504)
        return img, txt

    def compile_parts(self) -> None:
        """torch.compile the elementwise parts (shapes: dynamic after the first change)."""
        self.pre = torch.compile(self.pre)
        self.post = torch.compile(self.post)


class QwenImageTransformer(nn.Module):
    """The Qwen-Image denoiser. forward is CUDA-graph capturable for fixed shapes once a call
    with the same (grid, text length, device) has built its rope table (a small LRU cache)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        cfg = QwenImageTransformerConfig.from_dict(config)
        self.cfg = cfg
        dim = cfg.inner_dim
        self.img_in = nn.Linear(cfg.in_channels, dim)
        self.txt_norm = _Weight(cfg.joint_attention_dim)
        self.txt_in = nn.Linear(cfg.joint_attention_dim, dim)
        self.time_in = nn.Linear(TIME_PROJ_DIM, dim)
        self.time_out = nn.Linear(dim, dim)
        self.transformer_blocks = nn.ModuleList(QwenImageBlock(cfg) for _ in range(cfg.num_layers))
        self.norm_out = nn.Linear(dim, 2 * dim)
        self.proj_out = nn.Linear(dim, cfg.out_dim)
        self._rope_cache: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def compile_blocks(self) -> None:
        """torch.compile every block's elementwise parts (GPU serving)."""
        raise_recompile_limit()
        for block in self.transformer_blocks:
            block.compile_parts()

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy diffusers-named tensors (transformer/*.safetensors) into the parameters;
        ValueError on an unknown name, a wrong shape or a missing tensor."""
        def rename(name: str) -> str:
            for old, new in _RENAMES:
                name = name.replace(old, new)
            return name
        load_parameters(self, tensors, rename=rename, shown_prefix="transformer.")

    def rope_table(self, grid: tuple[int, int], text_len: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [text_len + h*w, head_dim/2] fp32 of the joint sequence (cached)."""
        key = (grid, text_len, device)
        table = self._rope_cache.get(key)
        if table is None:
            angles = _rope_angles(rope_positions(grid, text_len, device), self.cfg.axes_dims_rope)
            table = (angles.cos(), angles.sin())
            self._rope_cache[key] = table
            if len(self._rope_cache) > ROPE_CACHE_SIZE:
                self._rope_cache.popitem(last=False)
        else:
            self._rope_cache.move_to_end(key)
        return table

    def time_embedding(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """timestep [B] (sigma-like, diffusers' t/1000) -> temb [B, D]."""
        half = TIME_PROJ_DIM // 2
        # this order of operations is diffusers': the angles reach 1000 rad, so rounding shows
        exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32,
                                                     device=timestep.device)
        freqs = torch.exp(exponent / half)
        args = timestep.to(dtype).float()[:, None] * freqs * 1000.0
        proj = torch.cat([args.cos(), args.sin()], dim=-1).to(dtype)
        return self.time_out(F.silu(self.time_in(proj)))

    def _check_inputs(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                      text_mask: torch.Tensor | None, grid: tuple[int, int]) -> None:
        cfg = self.cfg
        if len(grid) != 2 or min(grid) < 1:
            raise ValueError(f"grid: (h, w) of ints >= 1, got {grid!r}")
        if latents.dim() != 3 or latents.shape[1:] != (grid[0] * grid[1], cfg.in_channels):
            raise ValueError(f"latents: [B, h*w={grid[0] * grid[1]}, {cfg.in_channels}], got "
                             f"{tuple(latents.shape)}")
        batch = latents.shape[0]
        if timestep.shape != (batch,) or not timestep.dtype.is_floating_point:
            raise ValueError(f"timestep: float [{batch}], got {timestep.dtype} "
                             f"{tuple(timestep.shape)}")
        if text.dim() != 3 or text.shape[0] != batch or text.shape[2] != cfg.joint_attention_dim:
            raise ValueError(f"text: [{batch}, T, {cfg.joint_attention_dim}], got "
                             f"{tuple(text.shape)}")
        if text_mask is not None and (text_mask.shape != text.shape[:2]
                                      or text_mask.dtype != torch.bool):
            raise ValueError(f"text_mask: bool {list(text.shape[:2])}, got {text_mask.dtype} "
                             f"{tuple(text_mask.shape)}")

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                text_mask: torch.Tensor | None, grid: tuple[int, int]) -> torch.Tensor:
        """latents [B, L=h*w, in_channels] packed tokens; timestep [B] float (t/1000, may differ
        per row); text [B, T, joint_attention_dim]; text_mask [B, T] bool (True = real token,
        padding at the end) or None (all real); grid (h, w) = (H//16, W//16).
        Returns the velocity [B, L, out_channels * patch^2] in the module's dtype."""
        state, _ = self.first(latents, timestep, text, text_mask, grid)
        return self.finish(state, self.rest(state))

    # NOTE: forward = first -> rest -> finish, so a step cache (engine/gen/diffusion.py) can
    # run the first block for every row and the other blocks only for rows whose first-block
    # change is large, reusing the others' residual of the later blocks
    def first(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
              text_mask: torch.Tensor | None, grid: tuple[int, int]
              ) -> tuple[FirstBlockState, torch.Tensor]:
        """Embeddings and block 0: (the state rest/finish continue from, the image stream's
        change by block 0 [B, L, D] (the cache's probe))."""
        self._check_inputs(latents, timestep, text, text_mask, grid)
        dtype = self.img_in.weight.dtype
        img = self.img_in(latents.to(dtype))
        txt = self.txt_in(_rms_norm(text.to(dtype), self.txt_norm.weight))
        temb_act = F.silu(self.time_embedding(timestep, dtype))
        rope = self.rope_table((int(grid[0]), int(grid[1])), text.shape[1], latents.device)
        lengths = None
        if text_mask is not None and not bool(text_mask.all()):  # (one host sync per step)
            lengths = [int(n) for n in text_mask.sum(dim=1).tolist()]
        last = len(self.transformer_blocks) == 1
        img1, txt1 = self.transformer_blocks[0](img, txt, temb_act, rope,
                                                _groups(lengths, latents.device),
                                                text_out=not last)
        return FirstBlockState(img1, txt1, temb_act, rope, lengths), img1 - img

    def rest(self, state: FirstBlockState, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks 1.. on `rows` of the batch (None: all): their image stream's change [r, L, D]."""
        img, txt, temb_act, lengths = state.img, state.txt, state.temb_act, state.lengths
        if rows is not None:
            img, txt, temb_act = img[rows], txt[rows], temb_act[rows]
            lengths = None if lengths is None else [lengths[i] for i in rows.tolist()]
        start, last = img, len(self.transformer_blocks) - 1
        groups = _groups(lengths, img.device)
        for index in range(1, last + 1):
            img, txt = self.transformer_blocks[index](img, txt, temb_act, state.rope, groups,
                                                      text_out=index < last)
        return img - start

    def finish(self, state: FirstBlockState, residual: torch.Tensor) -> torch.Tensor:
        """The output from block 0's image stream plus the later blocks' change."""
        scale, shift = self.norm_out(state.temb_act)[:, None].chunk(2, dim=-1)
        return self.proj_out(_layer_norm(state.img + residual) * (1 + scale) + shift)


@dataclass
class FirstBlockState:
    img: torch.Tensor
    txt: torch.Tensor
    temb_act: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]
    lengths: list[int] | None  # real text length per row (None: no padding)


def _groups(lengths: list[int] | None, device: torch.device | None = None
            ) -> list[tuple[torch.Tensor, int]] | None:
    """(rows, length) per distinct real text length (None when no row is padded)."""
    if lengths is None:
        return None
    return [(torch.tensor([i for i, n in enumerate(lengths) if n == length], device=device),
             length) for length in sorted(set(lengths))]
