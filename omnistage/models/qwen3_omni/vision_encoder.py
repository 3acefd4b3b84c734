"""Qwen3-Omni thinker vision encoder (Qwen3-VL ViT): learned positions resampled to each grid,
2-D rotary, full attention per frame, a merger for the output and one per deepstack layer.

Parameter names mirror the checkpoint's `thinker.visual.*` with that prefix stripped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.checkpoint import load_parameters
from omnistage.models.qwen2_5_omni.audio_encoder import (
    SegmentPlan,
    build_segment_plan,
    segment_attention,
)
from omnistage.models.qwen2_5_omni.vision_encoder import (
    axial_cos_sin,
    axial_inv_freq,
    patch_positions,
    rotate_qk,
    validate_patches,
)
from omnistage.models.qwen3_omni.audio_encoder import activation

VISION_CHECKPOINT_PREFIX = "thinker.visual."


class Qwen3OmniVisionPatchEmbed(nn.Module):
    def __init__(self, in_channels: int, temporal_patch: int, patch: int, dim: int) -> None:
        super().__init__()
        kernel = (temporal_patch, patch, patch)
        # kept as Conv3d for the checkpoint's weight layout; applied as one matmul
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=kernel, stride=kernel)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # pixels: [N, C*tp*p*p] (flattened in the (C, tp, p, p) order of the weight) -> [N, dim]
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.view(w.shape[0], -1), self.proj.bias)


class Qwen3OmniVisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                plan: SegmentPlan) -> torch.Tensor:
        # x: [N, dim]; cos, sin: [N, 1, head_dim] fp32
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        q, k = rotate_qk(q, k, cos, sin)
        return self.proj(segment_attention(q, k, v, plan).flatten(1))


class Qwen3OmniVisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3OmniVisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, ffn: int,
                 act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Qwen3OmniVisionAttention(dim, num_heads)
        self.mlp = Qwen3OmniVisionMLP(dim, ffn, act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                plan: SegmentPlan) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, plan)
        return x + self.mlp(self.norm2(x))


class Qwen3OmniVisionPatchMerger(nn.Module):
    """Concatenates each merge unit's patches and projects them to the thinker's width. The final
    merger normalises each patch before concatenating; the deepstack mergers normalise after."""

    def __init__(self, dim: int, out_dim: int, merge_unit: int, norm_after_concat: bool) -> None:
        super().__init__()
        hidden = dim * merge_unit
        self.norm_after_concat = norm_after_concat
        self.ln_q = nn.LayerNorm(hidden if norm_after_concat else dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, dim] with each merge unit's patches adjacent -> [N / merge_unit, out_dim]
        hidden = self.mlp[0].in_features
        if self.norm_after_concat:
            return self.mlp(self.ln_q(x.reshape(-1, hidden)))
        return self.mlp(self.ln_q(x).reshape(-1, hidden))


class Qwen3OmniVisionEncoder(nn.Module):
    """Patches of one or more images/videos -> merged embeddings + deepstack features.

    Returns (embeds, deepstack): both in the processor's patch order, one row per merge unit;
    deepstack[j] is the output of block `deepstack_visual_indexes[j]` through `merger_list[j]`
    (the thinker adds it to its hidden states after its decoder layer j).
    """

    def __init__(self, vision_config: dict[str, Any]) -> None:
        super().__init__()
        config = vision_config
        dim, depth = config["hidden_size"], config["depth"]
        self.merge: int = config.get("spatial_merge_size", 2)
        self.merge_unit = self.merge**2
        self.patch_size = config.get("patch_size", 16)
        self.temporal_patch = config.get("temporal_patch_size", 2)
        self.in_channels = config.get("in_channels", 3)
        for field in ("patch_size", "temporal_patch_size"):
            if not isinstance(config.get(field, 1), int):
                raise ValueError(f"vision_config.{field} must be an int, got {config[field]!r}")
        self.deepstack_indexes = list(config.get("deepstack_visual_indexes", ()))
        if (sorted(set(self.deepstack_indexes)) != self.deepstack_indexes
                or any(not 0 <= i < depth for i in self.deepstack_indexes)):
            raise ValueError(f"vision_config.deepstack_visual_indexes {self.deepstack_indexes} "
                             f"must be increasing block indexes below depth {depth}")
        num_positions = config["num_position_embeddings"]
        self.grid_side = math.isqrt(num_positions)
        if self.grid_side**2 != num_positions:
            raise ValueError(f"vision_config.num_position_embeddings {num_positions} is not a "
                             "square")
        num_heads = config["num_heads"]
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config.rope_parameters.rope_type {rope['rope_type']!r} is "
                             "not supported (axial)")
        self.register_buffer("inv_freq",
                             axial_inv_freq(dim, num_heads, rope.get("rope_theta", 10000.0)),
                             persistent=False)
        act = activation(config.get("hidden_act", "gelu_pytorch_tanh"), "vision_config.hidden_act")
        out_dim = config["out_hidden_size"]

        self.patch_embed = Qwen3OmniVisionPatchEmbed(
            self.in_channels, self.temporal_patch, self.patch_size, dim)
        self.pos_embed = nn.Embedding(num_positions, dim)
        self.blocks = nn.ModuleList(
            Qwen3OmniVisionBlock(dim, num_heads, config["intermediate_size"], act)
            for _ in range(depth))
        self.merger = Qwen3OmniVisionPatchMerger(dim, out_dim, self.merge_unit,
                                                 norm_after_concat=False)
        self.merger_list = nn.ModuleList(
            Qwen3OmniVisionPatchMerger(dim, out_dim, self.merge_unit, norm_after_concat=True)
            for _ in self.deepstack_indexes)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads checkpoint tensors named as `thinker.visual.*` or without that prefix."""
        load_parameters(self, named_tensors,
                        rename=lambda name: name.removeprefix(VISION_CHECKPOINT_PREFIX))

    def _learned_positions(self, h: int, w: int) -> torch.Tensor:
        """The square table resampled bilinearly (corners aligned) to an h x w grid, in fp32:
        [h * w, dim], row-major."""
        side, table = self.grid_side, self.pos_embed.weight.float()
        grid = table.T.reshape(1, -1, side, side)
        grid = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)
        return grid[0].flatten(1).T

    def forward(self, pixel_values: torch.Tensor,
                grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # pixel_values: [sum t*h*w, C*tp*p*p] in the processor's order (merge units row-major,
        # the merge x merge patches of a unit adjacent); grid_thw: [n, 3]
        # -> embeds [sum t*h*w / merge^2, out], deepstack: list of the same shape
        patch_dim = self.in_channels * self.temporal_patch * self.patch_size**2
        grid = validate_patches(pixel_values, grid_thw, patch_dim, self.merge)
        device = pixel_values.device
        positions, learned, frame_lens = [], [], []
        resampled: dict[tuple[int, int], torch.Tensor] = {}
        for t, h, w in grid:
            pos = patch_positions(t, h, w, self.merge)  # [t*h*w, 2] (row, col)
            if (h, w) not in resampled:
                resampled[(h, w)] = self._learned_positions(h, w)
            learned.append(resampled[(h, w)][(pos[:, 0] * w + pos[:, 1]).to(device)])
            positions.append(pos)
            frame_lens += [h * w] * t
        pos = torch.cat(positions).to(device)
        cos, sin = axial_cos_sin(pos, self.inv_freq)
        plan = build_segment_plan(frame_lens, device)  # attention stays within a frame

        x = self.patch_embed(pixel_values)
        x = x + torch.cat(learned).to(x.dtype)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, plan)
            if i in self.deepstack_indexes:
                deepstack.append(self.merger_list[self.deepstack_indexes.index(i)](x))
        return self.merger(x), deepstack
