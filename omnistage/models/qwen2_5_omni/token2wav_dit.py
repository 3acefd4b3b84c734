"""Qwen2.5-Omni code2wav DiT: ECAPA-TDNN speaker encoder, block-attention DiT, RK4 flow sampler.

Parameter names mirror the checkpoint's `token2wav.code2wav_dit_model.*` tensors.
The DiT runs a padded batch of requests: every op is per frame except attention, whose mask
(`qwen2_5_omni_dit_attention_mask`) is the only place frames of a request meet each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Qwen2_5OmniDiTSpec:
    """The DiT fields of the checkpoint's `token2wav_config.dit_config` (transformers' defaults)."""

    hidden_size: int = 1024
    num_hidden_layers: int = 22
    num_attention_heads: int = 16
    head_dim: int = 64
    ff_mult: int = 2
    emb_dim: int = 512
    max_position_embeddings: int = 32768
    block_size: int = 24
    look_ahead_layers: tuple[int, ...] = (10,)
    look_backward_layers: tuple[int, ...] = (0, 20)
    repeats: int = 2
    num_embeds: int = 8193
    mel_dim: int = 80
    enc_emb_dim: int = 192
    enc_dim: int = 128
    enc_channels: tuple[int, ...] = (256, 256, 256, 256, 768)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 64
    enc_res2net_scale: int = 2
    enc_se_channels: int = 64
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> Qwen2_5OmniDiTSpec:
        kw = {f.name: cfg[f.name] for f in fields(cls) if f.name in cfg}
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()}
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError("dit_config.rope_parameters: unsupported rope_type "
                             f"{rope['rope_type']!r}")
        kw["rope_theta"] = float(rope.get("rope_theta", cls.rope_theta))
        n = len(kw.get("enc_channels", cls.enc_channels))
        for name in ("enc_kernel_sizes", "enc_dilations"):
            if len(kw.get(name, getattr(cls, name))) != n:
                raise ValueError(f"dit_config.{name}: must have the length of enc_channels ({n})")
        return cls(**kw)


# ----------------------------------------------------------------------------- ECAPA-TDNN
class Qwen2_5OmniTDNNBlock(nn.Module):
    """Conv1d ('same', reflect padding) + ReLU."""

    def __init__(self, c_in: int, c_out: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, dilation=dilation, padding="same",
                              padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, L] -> [B, C', L]
        return F.relu(self.conv(x))


class Qwen2_5OmniRes2NetBlock(nn.Module):
    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        c = channels // scale
        self.blocks = nn.ModuleList(
            Qwen2_5OmniTDNNBlock(c, c, kernel, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, L]
        parts = list(x.chunk(len(self.blocks) + 1, dim=1))
        out, prev = [parts[0]], None
        for block, part in zip(self.blocks, parts[1:], strict=True):
            # hierarchical residual: each split also sees the previous split's output
            prev = block(part if prev is None else part + prev)
            out.append(prev)
        return torch.cat(out, dim=1)


class Qwen2_5OmniSqueezeExcitation(nn.Module):
    def __init__(self, channels: int, se_channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, se_channels, 1)
        self.conv2 = nn.Conv1d(se_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, L]
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class Qwen2_5OmniSERes2NetBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, scale: int, se_channels: int, kernel: int,
                 dilation: int) -> None:
        super().__init__()
        self.tdnn1 = Qwen2_5OmniTDNNBlock(c_in, c_out, 1, 1)
        self.res2net_block = Qwen2_5OmniRes2NetBlock(c_out, scale, kernel, dilation)
        self.tdnn2 = Qwen2_5OmniTDNNBlock(c_out, c_out, 1, 1)
        self.se_block = Qwen2_5OmniSqueezeExcitation(c_out, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, L]
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _weighted_stats(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # x [B, C, L], w [B, C or 1, L] summing to 1 over L -> mean, std [B, C]
    mean = (w * x).sum(2)
    var = (w * (x - mean.unsqueeze(2)).pow(2)).sum(2)
    return mean, var.clamp(min=1e-12).sqrt()


class Qwen2_5OmniAttentiveStatsPool(nn.Module):
    def __init__(self, channels: int, attention_channels: int) -> None:
        super().__init__()
        self.tdnn = Qwen2_5OmniTDNNBlock(channels * 3, attention_channels, 1, 1)
        self.conv = nn.Conv1d(attention_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, L] -> [B, 2C, 1]
        length = x.shape[2]
        uniform = x.new_ones(x.shape[0], 1, length) / length
        mean, std = _weighted_stats(x, uniform)
        # the attention sees the utterance's global statistics beside each frame
        ctx = torch.cat([x, mean.unsqueeze(2).expand_as(x), std.unsqueeze(2).expand_as(x)], dim=1)
        attn = torch.softmax(self.conv(torch.tanh(self.tdnn(ctx))), dim=2)
        mean, std = _weighted_stats(x, attn)
        return torch.cat([mean, std], dim=1).unsqueeze(2)


class Qwen2_5OmniECAPATDNN(nn.Module):
    """Speaker encoder over a reference mel: [B, L, mel] -> [B, enc_dim]."""

    def __init__(self, spec: Qwen2_5OmniDiTSpec) -> None:
        super().__init__()
        ch, ks, dil = spec.enc_channels, spec.enc_kernel_sizes, spec.enc_dilations
        self.blocks = nn.ModuleList([Qwen2_5OmniTDNNBlock(spec.mel_dim, ch[0], ks[0], dil[0])])
        for i in range(1, len(ch) - 1):
            self.blocks.append(Qwen2_5OmniSERes2NetBlock(
                ch[i - 1], ch[i], spec.enc_res2net_scale, spec.enc_se_channels, ks[i], dil[i]))
        self.mfa = Qwen2_5OmniTDNNBlock(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = Qwen2_5OmniAttentiveStatsPool(ch[-1], spec.enc_attention_channels)
        self.fc = nn.Conv1d(ch[-1] * 2, spec.enc_dim, 1)
        # reflect padding needs more frames than its pad on each side
        pads = [d * (k - 1) - d * (k - 1) // 2 for k, d in zip(ks, dil, strict=True)]
        self.min_frames = max(pads) + 1

    def forward(self, mel: torch.Tensor) -> torch.Tensor:  # [B, L, mel] -> [B, enc_dim]
        x, feats = mel.transpose(1, 2), []
        for block in self.blocks:
            x = block(x)
            feats.append(x)
        x = self.mfa(torch.cat(feats[1:], dim=1))  # multi-layer feature aggregation
        return self.fc(self.asp(x)).squeeze(2)


# ----------------------------------------------------------------------------- DiT
class Qwen2_5OmniDiTCodecEmbedding(nn.Module):
    def __init__(self, num_embeds: int, dim: int, repeats: int) -> None:
        super().__init__()
        self.repeats = repeats
        self.codec_embed = nn.Embedding(num_embeds + 1, dim)  # id 0 doubles as the CFG "no code"

    def forward(self, codes: torch.Tensor) -> torch.Tensor:  # [B, N] -> [B, N*repeats, dim]
        return self.codec_embed(codes).repeat_interleave(self.repeats, dim=1)


class Qwen2_5OmniDiTInputEmbedding(nn.Module):
    def __init__(self, spec: Qwen2_5OmniDiTSpec) -> None:
        super().__init__()
        width = spec.mel_dim + spec.enc_dim + spec.enc_emb_dim + spec.emb_dim
        self.proj = nn.Linear(width, spec.hidden_size)
        self.spk_encoder = Qwen2_5OmniECAPATDNN(spec)

    def forward(self, x: torch.Tensor, static: torch.Tensor) -> torch.Tensor:
        # x [B, T, mel]; static [B, T, enc_dim + emb_dim + enc_emb_dim] -> [B, T, hidden]
        return self.proj(torch.cat([x, static], dim=-1))


class Qwen2_5OmniDiTTimestepEmbedding(nn.Module):
    def __init__(self, dim: int, freq_dim: int = 256) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.ModuleList([nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim)])

    def forward(self, t: torch.Tensor) -> torch.Tensor:  # [B] in [0, 1] -> [B, dim]
        half = self.freq_dim // 2
        freqs = torch.exp(torch.arange(half, device=t.device).float()
                          * -(math.log(10000) / (half - 1)))
        angles = 1000 * t.float().unsqueeze(1) * freqs.unsqueeze(0)
        h = torch.cat([angles.sin(), angles.cos()], dim=-1).to(t.dtype)
        for layer in self.time_mlp:
            h = layer(h)
        return h


class Qwen2_5OmniAdaLayerNormZero(nn.Module):
    """LayerNorm modulated by the time embedding; `chunks` = 6 in blocks, 2 at the output."""

    def __init__(self, dim: int, chunks: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim * chunks)
        self.chunks = chunks

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # x [B, T, D], emb [B, D] -> (modulated x [B, T, D], *remaining chunks [B, D])
        mods = self.linear(F.silu(emb)).chunk(self.chunks, dim=1)
        if self.chunks == 2:  # final layer: (scale, shift)
            scale, shift = mods
            return (F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale)[:, None]
                    + shift[:, None],)
        shift, scale = mods[0], mods[1]
        return (F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale[:, None]) + shift[:, None],
                *mods[2:])


def qwen2_5_omni_dit_attention_mask(positions: torch.Tensor, valid: torch.Tensor, block_size: int,
                                    look_backward: int, look_ahead: int) -> torch.Tensor:
    """Block attention mask as a function of frame positions: [B, T], [B, T] -> [B, 1, T, T] bool.

    NOTE: frames are grouped in blocks of `block_size` by absolute position; a query sees the keys
    whose block lies within [-look_backward, +look_ahead] of its own. Padding keys are hidden from
    real queries; padding queries see their block (never an empty row, so no NaN).
    """
    block = torch.div(positions, block_size, rounding_mode="floor")
    diff = block[:, None, :] - block[:, :, None]  # key block - query block
    in_window = (diff >= -look_backward) & (diff <= look_ahead)
    return (in_window & (valid[:, None, :] | ~valid[:, :, None])).unsqueeze(1)


def _rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, h, T, D] with (even, odd) pairs rotated; cos/sin [B, 1, T, D/2]
    # NOTE: output is in (evens, odds) order; q and k share it, so q.k is unchanged.
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1)


class Qwen2_5OmniDiTAttention(nn.Module):
    def __init__(self, spec: Qwen2_5OmniDiTSpec) -> None:
        super().__init__()
        self.heads, self.head_dim = spec.num_attention_heads, spec.head_dim
        inner = spec.num_attention_heads * spec.head_dim
        self.to_q = nn.Linear(spec.hidden_size, inner)
        self.to_k = nn.Linear(spec.hidden_size, inner)
        self.to_v = nn.Linear(spec.hidden_size, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, spec.hidden_size)])

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor) -> torch.Tensor:  # x [B, T, D], mask [B, 1, T, T]
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
                   for proj in (self.to_q, self.to_k, self.to_v))
        # NOTE: the checkpoint was trained with rotary on the first head only.
        q = torch.cat([_rope_interleaved(q[:, :1], *rope), q[:, 1:]], dim=1)
        k = torch.cat([_rope_interleaved(k[:, :1], *rope), k[:, 1:]], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.to_out[0](out.transpose(1, 2).reshape(b, t, -1))


class Qwen2_5OmniDiTMLP(nn.Module):
    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        # indices 0 and 3 hold the weights (checkpoint layout: linear, gelu, dropout, linear)
        self.ff = nn.ModuleList([nn.Linear(dim, dim * mult), nn.GELU(approximate="tanh"),
                                 nn.Identity(), nn.Linear(dim * mult, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.ff:
            x = layer(x)
        return x


class Qwen2_5OmniDiTDecoderLayer(nn.Module):
    def __init__(self, spec: Qwen2_5OmniDiTSpec, look_backward: int, look_ahead: int) -> None:
        super().__init__()
        self.look_backward, self.look_ahead = look_backward, look_ahead
        self.attn_norm = Qwen2_5OmniAdaLayerNormZero(spec.hidden_size, 6)
        self.attn = Qwen2_5OmniDiTAttention(spec)
        self.ff = Qwen2_5OmniDiTMLP(spec.hidden_size, spec.ff_mult)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor) -> torch.Tensor:  # x [B, T, D], temb [B, D]
        h, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(x, temb)
        x = x + gate_msa[:, None] * self.attn(h, rope, mask)
        h = F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return x + gate_mlp[:, None] * self.ff(h)


class Qwen2_5OmniToken2WavDiT(nn.Module):
    """Codec ids + speaker conditioning -> mel frames by flow matching."""

    def __init__(self, spec: Qwen2_5OmniDiTSpec) -> None:
        super().__init__()
        self.spec = spec
        self.time_embed = Qwen2_5OmniDiTTimestepEmbedding(spec.hidden_size)
        self.text_embed = Qwen2_5OmniDiTCodecEmbedding(spec.num_embeds, spec.emb_dim, spec.repeats)
        self.input_embed = Qwen2_5OmniDiTInputEmbedding(spec)
        self.transformer_blocks = nn.ModuleList(
            Qwen2_5OmniDiTDecoderLayer(spec, int(i in spec.look_backward_layers),
                                       int(i in spec.look_ahead_layers))
            for i in range(spec.num_hidden_layers))
        self.norm_out = Qwen2_5OmniAdaLayerNormZero(spec.hidden_size, 2)
        self.proj_out = nn.Linear(spec.hidden_size, spec.mel_dim)
        inv_freq = 1.0 / spec.rope_theta ** (
            torch.arange(0, spec.head_dim, 2, dtype=torch.float) / spec.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def static_condition(self, codes: torch.Tensor, cond: torch.Tensor, ref_mel: torch.Tensor,
                         use_cfg: bool) -> torch.Tensor:
        """Per-frame conditioning of one request, fixed over the ODE: [rows, F, enc+emb+spk].

        codes [1, N], cond [1, enc_emb_dim], ref_mel [1, L, mel]; rows = 2 with CFG (the second
        row drops the codes, the speaker vector and the reference mel), else 1.
        """
        frames = codes.shape[1] * self.spec.repeats
        spk_enc = self.input_embed.spk_encoder
        rows = [(spk_enc(ref_mel), self.text_embed(codes), cond)]
        if use_cfg:
            rows.append((spk_enc(torch.zeros_like(ref_mel)),
                         self.text_embed(torch.zeros_like(codes)), torch.zeros_like(cond)))
        return torch.cat([torch.cat([enc.unsqueeze(1).expand(-1, frames, -1), code_emb,
                                     spk.unsqueeze(1).expand(-1, frames, -1)], dim=-1)
                          for enc, code_emb, spk in rows], dim=0)

    def geometry(self, positions: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor], dict]:
        """Rotary cos/sin [B, 1, T, hd/2] and masks by (look_backward, look_ahead) [B, 1, T, T]
        of positions/valid [B, T]: fixed over the ODE, so `sample` builds them once."""
        angles = positions[:, None, :, None].float() * self.inv_freq
        keys = {(layer.look_backward, layer.look_ahead) for layer in self.transformer_blocks}
        masks = {key: qwen2_5_omni_dit_attention_mask(positions, valid, self.spec.block_size, *key)
                 for key in keys}
        return (angles.cos().to(dtype), angles.sin().to(dtype)), masks

    def forward(self, x: torch.Tensor, static: torch.Tensor, t: torch.Tensor,
                positions: torch.Tensor, valid: torch.Tensor,
                geometry: tuple[tuple[torch.Tensor, torch.Tensor], dict] | None = None
                ) -> torch.Tensor:
        """Velocity field. x [B, T, mel], static [B, T, C], t 0-d, positions/valid [B, T]."""
        temb = self.time_embed(t.reshape(1).to(x.dtype))
        h = self.input_embed(x, static)
        rope, masks = geometry or self.geometry(positions, valid, x.dtype)
        for layer in self.transformer_blocks:
            h = layer(h, temb, rope, masks[(layer.look_backward, layer.look_ahead)])
        return self.proj_out(self.norm_out(h, temb)[0])

    def sample(self, noise: torch.Tensor, static: torch.Tensor, positions: torch.Tensor,
               valid: torch.Tensor, num_steps: int, guidance_scale: float,
               sway_coefficient: float | None) -> torch.Tensor:
        """Integrate the flow from noise [R, T, mel] to mel [R, T, mel] (padded frames zeroed).

        static is [2R, T, C] (conditioned rows, then unconditioned) when guidance_scale >= 1e-5,
        else [R, T, C]. NOTE: RK4 with Kutta's 3/8 rule over a sway-warped time grid
        t + s * (cos(pi/2 t) - 1 + t); CFG: v = v_c + (v_c - v_u) * guidance_scale.
        """
        use_cfg = guidance_scale >= 1e-5
        rows = 2 if use_cfg else 1
        pos2, valid2 = positions.repeat(rows, 1), valid.repeat(rows, 1)
        keep = valid.unsqueeze(-1)
        geo = self.geometry(pos2, valid2, noise.dtype)

        def velocity(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            if not use_cfg:
                return self(x, static, t, pos2, valid2, geo).masked_fill(~keep, 0.0)
            v_cond, v_null = self(torch.cat([x, x]), static, t, pos2, valid2, geo).chunk(2)
            return (v_cond + (v_cond - v_null) * guidance_scale).masked_fill(~keep, 0.0)

        grid = torch.linspace(0, 1, num_steps, device=noise.device, dtype=torch.float32)
        if sway_coefficient is not None:
            grid = grid + sway_coefficient * (torch.cos(torch.pi / 2 * grid) - 1 + grid)
        x, third = noise, 1 / 3
        for t0, t1 in zip(grid[:-1], grid[1:], strict=True):
            h = t1 - t0
            k1 = velocity(t0, x)
            k2 = velocity(t0 + h * third, x + h * k1 * third)
            k3 = velocity(t0 + h * (2 / 3), x + h * (k2 - k1 * third))
            k4 = velocity(t1, x + h * (k1 - k2 + k3))
            x = x + (k1 + 3 * (k2 + k3) + k4) * h / 8
        return x
