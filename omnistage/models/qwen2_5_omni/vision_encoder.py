"""Qwen2.5-Omni thinker vision encoder (Qwen2.5-VL ViT: 2-D rotary, window attention, merger).

Parameter names mirror the checkpoint's `thinker.visual.*` with that prefix stripped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.qwen2_5_omni.audio_encoder import (
    SegmentPlan,
    build_segment_plan,
    segment_attention,
)

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu": F.gelu}


class Qwen2_5OmniVisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in fp32, as the checkpoint was trained
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Qwen2_5OmniVisionPatchEmbed(nn.Module):
    def __init__(self, in_channels: int, temporal_patch: int, patch: int, dim: int) -> None:
        super().__init__()
        kernel = (temporal_patch, patch, patch)
        # kept as Conv3d for the checkpoint's weight layout; applied as one matmul
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # pixels: [N, C*tp*p*p] (flattened in the (C, tp, p, p) order of the weight) -> [N, dim]
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.view(w.shape[0], -1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D rotary on q, k [N, heads, head_dim] with cos, sin [N, 1, head_dim], in fp32."""
    q = (q.float() * cos + _rotate_half(q.float()) * sin).to(q.dtype)
    k = (k.float() * cos + _rotate_half(k.float()) * sin).to(k.dtype)
    return q, k


def axial_inv_freq(dim: int, num_heads: int, theta: float) -> torch.Tensor:
    """Frequencies [head_dim / 4] of the 2-D rotary: half the rotated channels turn with the
    patch row, half with its column."""
    head_dim = dim // num_heads
    if dim % num_heads or head_dim % 4:
        raise ValueError("vision_config.hidden_size / num_heads must be a multiple of 4")
    half = head_dim // 2
    return 1.0 / theta ** (torch.arange(0, half, 2).float() / half)


def axial_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) positions [N, 2] -> cos, sin [N, 1, head_dim] (fp32) for rotate_qk."""
    angles = (positions[..., None].float() * inv_freq).flatten(1)  # [N, head_dim/2]: rows|cols
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    return angles.cos(), angles.sin()


def validate_patches(pixel_values: torch.Tensor, grid_thw: torch.Tensor, patch_dim: int,
                     merge: int) -> list[list[int]]:
    """Check pixel_values [patches, patch_dim] against grid_thw [n, 3] -> the grids as lists."""
    if pixel_values.dim() != 2 or pixel_values.shape[1] != patch_dim:
        raise ValueError(f"pixel_values must be [num_patches, {patch_dim}], "
                         f"got {tuple(pixel_values.shape)}")
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3 or grid_thw.shape[0] == 0:
        raise ValueError(f"grid_thw must be [n_images, 3], got {tuple(grid_thw.shape)}")
    grid = grid_thw.tolist()
    for i, (t, h, w) in enumerate(grid):
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise ValueError(f"grid_thw[{i}] = {[t, h, w]}: sizes must be positive and h, w "
                             f"multiples of spatial_merge_size {merge}")
    total = sum(t * h * w for t, h, w in grid)
    if total != pixel_values.shape[0]:
        raise ValueError(f"grid_thw covers {total} patches, pixel_values has "
                         f"{pixel_values.shape[0]}")
    return grid


class Qwen2_5OmniVisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                plan: SegmentPlan) -> torch.Tensor:
        # x: [N, dim]; cos, sin: [N, 1, head_dim] fp32
        shape = (x.shape[0], self.num_heads, -1)
        q, k, v = (p(x).view(shape) for p in (self.q, self.k, self.v))
        q, k = rotate_qk(q, k, cos, sin)
        return self.proj(segment_attention(q, k, v, plan).flatten(1))


class Qwen2_5OmniVisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Qwen2_5OmniVisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, ffn: int,
                 act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.norm1 = Qwen2_5OmniVisionRMSNorm(dim)
        self.norm2 = Qwen2_5OmniVisionRMSNorm(dim)
        self.attn = Qwen2_5OmniVisionAttention(dim, num_heads)
        self.mlp = Qwen2_5OmniVisionMLP(dim, ffn, act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                plan: SegmentPlan) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, plan)
        return x + self.mlp(self.norm2(x))


class Qwen2_5OmniVisionPatchMerger(nn.Module):
    def __init__(self, dim: int, out_dim: int, merge_unit: int) -> None:
        super().__init__()
        self.ln_q = Qwen2_5OmniVisionRMSNorm(dim)
        hidden = dim * merge_unit
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, dim] with each merge unit's patches adjacent -> [N / merge_unit, out_dim]
        return self.mlp(self.ln_q(x).view(-1, self.mlp[0].in_features))


def patch_positions(t: int, h: int, w: int, merge: int) -> torch.Tensor:
    """(row, col) of every patch in the processor's order: merge units row-major, then the
    merge x merge patches inside each unit row-major; repeated per frame. Returns [t*h*w, 2]."""
    grid = (h // merge, merge, w // merge, merge)
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(grid).transpose(1, 2).flatten()
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(grid).transpose(1, 2).flatten()
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


def _window_order(t: int, units_h: int, units_w: int,
                  window: int) -> tuple[torch.Tensor, list[int]]:
    """Merge units reordered window by window (frame, window row, window col; row-major inside a
    window, edge windows smaller). Returns (unit order [t*units_h*units_w], units per window)."""
    frame, row, col = torch.meshgrid(torch.arange(t), torch.arange(units_h),
                                     torch.arange(units_w), indexing="ij")
    win_h, win_w = -(-units_h // window), -(-units_w // window)
    window_id = ((frame * win_h + row // window) * win_w + col // window).flatten()
    # a stable sort keeps the natural (row-major) order of units inside each window
    order = torch.argsort(window_id, stable=True)
    return order, torch.bincount(window_id).tolist()


class Qwen2_5OmniVisionEncoder(nn.Module):
    """Patches of one or more images/videos -> merged embeddings in the thinker's hidden size.

    NOTE: tokens are permuted so that each attention window (window_size pixels square, counted in
    merge units) is contiguous; most blocks attend within a window, the blocks in
    `fullatt_block_indexes` within a whole frame. The merger keeps the window order, so its output
    is permuted back (inverse of the unit permutation) before it is returned.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        dim, self.merge = config["hidden_size"], config.get("spatial_merge_size", 2)
        self.merge_unit = self.merge**2
        self.patch_size = config.get("patch_size", 14)
        self.temporal_patch = config.get("temporal_patch_size", 2)
        self.in_channels = config.get("in_channels", config.get("in_chans", 3))
        self.fullatt_blocks = set(config.get("fullatt_block_indexes", ()))
        self.window_units = config.get("window_size", 112) // self.merge // self.patch_size
        if self.window_units < 1:
            raise ValueError("vision_config.window_size must be >= spatial_merge_size * patch_size")
        act_name = config.get("hidden_act", "silu")
        if act_name not in _ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {act_name!r} is not one of "
                             f"{list(_ACTIVATIONS)}")
        num_heads = config["num_heads"]
        theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.register_buffer("inv_freq", axial_inv_freq(dim, num_heads, theta), persistent=False)

        self.patch_embed = Qwen2_5OmniVisionPatchEmbed(
            self.in_channels, self.temporal_patch, self.patch_size, dim)
        self.blocks = nn.ModuleList(
            Qwen2_5OmniVisionBlock(dim, num_heads, config["intermediate_size"],
                                   _ACTIVATIONS[act_name])
            for _ in range(config["depth"]))
        self.merger = Qwen2_5OmniVisionPatchMerger(dim, config["out_hidden_size"], self.merge_unit)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        # pixel_values: [sum t*h*w, C*tp*p*p]; grid_thw: [n, 3] -> [sum t*h*w / merge^2, out]
        patch_dim = self.in_channels * self.temporal_patch * self.patch_size**2
        grid = validate_patches(pixel_values, grid_thw, patch_dim, self.merge)
        device = pixel_values.device
        orders, window_lens, frame_lens, positions = [], [], [], []
        offset = 0
        for t, h, w in grid:
            order, units_per_window = _window_order(t, h // self.merge, w // self.merge,
                                                    self.window_units)
            orders.append(order + offset)
            offset += order.numel()
            window_lens += [n * self.merge_unit for n in units_per_window]
            frame_lens += [h * w] * t
            positions.append(patch_positions(t, h, w, self.merge))
        unit_order = torch.cat(orders)
        unit_patches = torch.arange(self.merge_unit)
        token_order = (unit_order[:, None] * self.merge_unit + unit_patches).flatten()
        pos = torch.cat(positions)[token_order].to(device)  # [N, 2]

        cos, sin = axial_cos_sin(pos, self.inv_freq)
        # windows never cross a frame, so the window order keeps frames contiguous too
        window_plan = build_segment_plan(window_lens, device)
        frame_plan = build_segment_plan(frame_lens, device)

        x = self.patch_embed(pixel_values)[token_order.to(device)]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame_plan if i in self.fullatt_blocks else window_plan)
        merged = self.merger(x)
        out = torch.empty_like(merged)
        out[unit_order.to(device)] = merged
        return out
