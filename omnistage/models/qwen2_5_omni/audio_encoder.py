"""Qwen2.5-Omni thinker audio encoder (Whisper-style, chunked attention).

Parameter names mirror the checkpoint's `thinker.audio_tower.*` with that prefix stripped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# A segment plan: per group of equal-length segments, (row indices [k*L] on device, k, L).
SegmentPlan = list[tuple[torch.Tensor, int, int]]


def build_segment_plan(seqlens: list[int], device: torch.device) -> SegmentPlan:
    """Groups consecutive segments of a packed sequence by length, for `segment_attention`."""
    starts = [0]
    for n in seqlens[:-1]:
        starts.append(starts[-1] + n)
    groups: dict[int, list[int]] = {}
    for start, n in zip(starts, seqlens, strict=True):
        if n > 0:
            groups.setdefault(n, []).append(start)
    plan = []
    for n, group_starts in groups.items():
        rows = torch.tensor(group_starts)[:, None] + torch.arange(n)[None, :]
        plan.append((rows.flatten().to(device), len(group_starts), n))
    return plan


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      plan: SegmentPlan) -> torch.Tensor:
    """Bidirectional attention restricted to segments of a packed sequence.

    q, k, v: [N, H, D]; returns [N, H, D].
    NOTE: segments of equal length are gathered into one batch, so a whole image's windows (or
    an audio's 100-row chunks) run as a single SDPA call, with no masks and no padding.
    """
    n_rows, n_heads, head_dim = q.shape
    if len(plan) == 1 and plan[0][1] == 1 and plan[0][2] == n_rows:  # one segment: no gather
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)))
        return out.transpose(0, 1)
    out = q.new_empty(q.shape)
    for rows, count, length in plan:
        qs, ks, vs = (t.index_select(0, rows).view(count, length, n_heads, head_dim).transpose(1, 2)
                      for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs)  # [count, H, L, D]
        out.index_copy_(0, rows, o.transpose(1, 2).reshape(count * length, n_heads, head_dim))
    return out


class Qwen2_5OmniAudioAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, key_bias: bool = False) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"audio_config.d_model {dim} is not divisible by "
                             f"encoder_attention_heads {num_heads}")
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=key_bias)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
        # x: [N, dim]
        shape = (x.shape[0], self.num_heads, -1)
        q, k, v = (p(x).view(shape) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(segment_attention(q, k, v, plan).flatten(1))


class Qwen2_5OmniAudioEncoderLayer(nn.Module):
    def __init__(self, dim: int, num_heads: int, ffn_dim: int,
                 act: Callable[[torch.Tensor], torch.Tensor] = F.gelu,
                 key_bias: bool = False) -> None:
        super().__init__()
        self.self_attn = Qwen2_5OmniAudioAttention(dim, num_heads, key_bias)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, dim)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.act = act

    def forward(self, x: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
        # x: [N, dim] (pre-norm residual blocks)
        x = x + self.self_attn(self.self_attn_layer_norm(x), plan)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


def validate_features(features: list[torch.Tensor], num_mel_bins: int) -> None:
    """features: a non-empty list of [num_mel_bins, frames] tensors, each with frames."""
    if not isinstance(features, (list, tuple)) or not features:
        raise ValueError("features must be a non-empty list of [num_mel_bins, frames] tensors")
    for i, f in enumerate(features):
        if not isinstance(f, torch.Tensor) or f.dim() != 2 or f.shape[0] != num_mel_bins:
            shape = tuple(f.shape) if isinstance(f, torch.Tensor) else type(f).__name__
            raise ValueError(f"features[{i}] must be [{num_mel_bins}, frames], got {shape}")
        if f.shape[1] < 1:
            raise ValueError(f"features[{i}] has no frames")


def sinusoid_positions(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's fixed sinusoidal table: [length, channels] = [sin | cos]."""
    if channels % 2:
        raise ValueError(f"audio_config.d_model must be even, got {channels}")
    log_step = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_step * torch.arange(channels // 2).float())
    angles = torch.arange(length)[:, None].float() * inv_timescales[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class Qwen2_5OmniAudioEncoder(nn.Module):
    """Mel features -> audio embeddings in the thinker's hidden size.

    Each audio's mel frames are cut into chunks of `2 * n_window` frames; every chunk goes through
    the conv stem alone (stride 2), gets positions 0.. of its own, and attends only within itself.
    The encoded rows of one audio are then re-joined, average-pooled by 2 and projected.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        act = config.get("activation_function", "gelu")
        if act != "gelu":
            raise ValueError(f"audio_config.activation_function {act!r} is not supported (gelu)")
        dim = config["d_model"]
        self.num_mel_bins = config["num_mel_bins"]
        self.n_window = config["n_window"]
        self.max_source_positions = config["max_source_positions"]
        self.conv1 = nn.Conv1d(self.num_mel_bins, dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=3, stride=2, padding=1)
        self.register_buffer(
            "positional_embedding", sinusoid_positions(self.max_source_positions, dim),
            persistent=False)
        # Unused by the encoder itself; the checkpoint ships it, so strict loading needs it.
        self.audio_bos_eos_token = nn.Embedding(2, config["output_dim"])
        self.layers = nn.ModuleList(
            Qwen2_5OmniAudioEncoderLayer(dim, config["encoder_attention_heads"],
                                         config["encoder_ffn_dim"])
            for _ in range(config["encoder_layers"]))
        self.ln_post = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, config["output_dim"])

    @staticmethod
    def output_length(num_frames: int) -> int:
        """Number of embeddings (= placeholder tokens) an audio of `num_frames` mel frames gives."""
        after_conv = (num_frames - 1) // 2 + 1
        return (after_conv - 2) // 2 + 1

    def _stem(self, chunks: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        # chunks: list of [mel, L_c] -> rows [sum_c L2_c, dim] in chunk order, and L2_c
        lens = [c.shape[1] for c in chunks]
        padded = nn.utils.rnn.pad_sequence([c.T for c in chunks], batch_first=True)
        padded = padded.transpose(1, 2).to(self.conv1.weight.dtype)  # [C, mel, Lmax]
        device = padded.device
        lens_t = torch.tensor(lens, device=device)
        valid = torch.arange(padded.shape[2], device=device) < lens_t[:, None]  # [C, Lmax]
        # zero the padding after conv1 so each chunk's conv2 sees the zero padding it would alone
        x = F.gelu(self.conv1(padded)) * valid[:, None, :]
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [C, L2max, dim]
        if x.shape[1] > self.max_source_positions:
            raise ValueError(f"audio_config.n_window {self.n_window} exceeds max_source_positions")
        x = x + self.positional_embedding[: x.shape[1]].to(x.dtype)
        lens2 = [(n - 1) // 2 + 1 for n in lens]
        keep = valid[:, ::2]  # conv2 output j is valid iff input 2j is
        return x[keep], lens2

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        # features[i]: [num_mel_bins, T_i] (valid frames only) -> per audio [N_i, output_dim]
        validate_features(features, self.num_mel_bins)
        win = 2 * self.n_window
        chunks = [c for f in features for c in f.split(win, dim=1)]
        x, chunk_rows = self._stem(chunks)
        plan = build_segment_plan(chunk_rows, x.device)
        for layer in self.layers:
            x = layer(x, plan)
        # re-join each audio's rows and average adjacent pairs (a trailing odd row is dropped)
        per_audio_rows = [(f.shape[1] - 1) // 2 + 1 for f in features]
        pooled = [a[: a.shape[0] // 2 * 2].view(-1, 2, a.shape[1]).mean(1)
                  for a in x.split(per_audio_rows)]
        out = self.proj(self.ln_post(torch.cat(pooled)))
        return list(out.split([p.shape[0] for p in pooled]))
