"""Qwen3-Omni code2wav: 16-codebook codec frames (12.5 Hz) -> 24 kHz waveform, whole or streamed.

Path of a frame: the 16 codebook embeddings averaged -> 8-layer transformer, sliding-window
(72) causal attention -> two x2 upsamplers (transposed conv + ConvNeXt block) -> causal conv to
decoder_dim -> 4 decoder blocks (SnakeBeta, causal transposed conv of stride 8/5/4/3, three
dilated residual units) -> SnakeBeta -> causal conv to 1 channel -> clamp to [-1, 1]. Module
and parameter names mirror the checkpoint's `code2wav.*` tensors (prefix stripped by the caller).

NOTE: output length. A decoder transposed conv (kernel 2r, stride r) turns L inputs into (L+1) r
samples and trims r on each side, keeping (L-1) r: it loses one input step (r samples at its
output rate), and the later blocks multiply that loss by their rates. With rates 8/5/4/3 a
decode of F frames (4F columns after the x2 x2 upsamplers) gives
F x 1920 - (8 x 60 + 5 x 12 + 4 x 3 + 3) = F x 1920 - 555 samples. transformers' chunked_decode
decodes each chunk alone, so it loses 555 samples per chunk; our streaming decoder loses them
once per utterance (its total equals one whole-utterance decode).

NOTE: exact streaming. Every part is causal with a finite reach into the past, so a decoder that
carries that reach between chunks gives the whole-utterance samples for any chunking:
  - attention: each layer keeps the rotated keys/values of its last window - 1 frames (a query
    sees itself and the 71 frames before it: transformers' mask is kv > q - window), with their
    frame positions; rope positions continue across chunks;
  - causal convs (stride 1, left zero padding (k-1) d): the last (k-1) d inputs;
  - decoder transposed convs: output step m (r samples) sums inputs m-1 and m, so a chunk of
    inputs M..M+n-1 completes steps M..M+n-1 given input M-1 (kept). The step after the last
    input (the pending overlap) is exactly what the whole-utterance decode trims at its end, so
    nothing is ever flushed; on the first chunk there is no input M-1 and the module's own head
    trim applies, as in a whole decode. The x2 upsamplers (kernel = stride) need no state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.checkpoint import load_parameters
from omnistage.models.layers import RMSNorm

SAMPLE_RATE = 24000
EMPTY_POSITION = -(1 << 40)  # the frame position of an unused key slot: always out of the window


def _field(cfg: dict, name: str, default: Any) -> Any:
    value = cfg.get(name, default)
    return default if value is None else value


@dataclass(frozen=True)
class Qwen3OmniCode2WavConfig:
    """The checkpoint's `code2wav_config` (defaults: transformers' Qwen3OmniMoeCode2WavConfig)."""

    codebook_size: int = 2048
    num_quantizers: int = 16
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64
    sliding_window: int = 72
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 1536

    @classmethod
    def from_hf(cls, cfg: dict) -> Qwen3OmniCode2WavConfig:
        if not isinstance(cfg, dict):
            raise ValueError(f"code2wav_config: a dict, got {type(cfg).__name__}")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"code2wav_config.rope_parameters.rope_type: {rope_type!r} is not "
                             "supported (only 'default')")
        if _field(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"code2wav_config.hidden_act: {cfg['hidden_act']!r}; only 'silu'")
        d = cls()
        heads = int(_field(cfg, "num_attention_heads", d.num_attention_heads))
        hidden = int(_field(cfg, "hidden_size", d.hidden_size))
        if not cfg.get("head_dim") and hidden % heads:
            raise ValueError(f"code2wav_config.num_attention_heads: {heads} does not divide "
                             f"hidden_size {hidden}")
        return cls(
            codebook_size=int(_field(cfg, "codebook_size", d.codebook_size)),
            num_quantizers=int(_field(cfg, "num_quantizers", d.num_quantizers)),
            hidden_size=hidden,
            intermediate_size=int(_field(cfg, "intermediate_size", d.intermediate_size)),
            num_hidden_layers=int(_field(cfg, "num_hidden_layers", d.num_hidden_layers)),
            num_attention_heads=heads,
            num_key_value_heads=int(_field(cfg, "num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            sliding_window=int(_field(cfg, "sliding_window", d.sliding_window)),
            rope_theta=float(rope.get("rope_theta", _field(cfg, "rope_theta", d.rope_theta))),
            rms_norm_eps=float(_field(cfg, "rms_norm_eps", d.rms_norm_eps)),
            attention_bias=bool(_field(cfg, "attention_bias", d.attention_bias)),
            upsample_rates=tuple(int(r) for r in _field(cfg, "upsample_rates", d.upsample_rates)),
            upsampling_ratios=tuple(int(r) for r in _field(cfg, "upsampling_ratios",
                                                           d.upsampling_ratios)),
            decoder_dim=int(_field(cfg, "decoder_dim", d.decoder_dim)))

    def __post_init__(self) -> None:
        for name in ("codebook_size", "num_quantizers", "hidden_size", "intermediate_size",
                     "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "sliding_window", "decoder_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"code2wav_config.{name}: >= 1, got {getattr(self, name)}")
        if self.head_dim % 2:
            raise ValueError(f"code2wav_config.head_dim: even (rope), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"code2wav_config.num_key_value_heads: {self.num_key_value_heads} "
                             f"does not divide num_attention_heads {self.num_attention_heads}")
        for name in ("upsample_rates", "upsampling_ratios"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ValueError(f"code2wav_config.{name}: ints >= 1, got {getattr(self, name)}")
        if self.decoder_dim % (1 << len(self.upsample_rates)):
            raise ValueError(f"code2wav_config.decoder_dim: {self.decoder_dim} is not divisible "
                             f"by 2^{len(self.upsample_rates)} (each decoder block halves it)")

    @property
    def samples_per_frame(self) -> int:
        """1920 on the real model: 24 kHz / 12.5 Hz."""
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)

    @property
    def cache_frames(self) -> int:
        """Frames of keys/values a layer keeps between chunks (see the module's NOTE)."""
        return self.sliding_window - 1

    def num_samples(self, frames: int) -> int:
        """Samples of one decode of `frames` frames (frames x 1920 - 555 on the real model)."""
        if frames <= 0:
            return 0
        length = frames * math.prod(self.upsampling_ratios)
        for rate in self.upsample_rates:
            length = (length - 1) * rate
        return length


class _Carry:
    """The stateful convs' tails in call order: each conv takes the one the previous chunk left
    (None: nothing decoded yet) and puts the one for the next chunk."""

    def __init__(self, tails: list[torch.Tensor] | None) -> None:
        self.tails = tails
        self.next: list[torch.Tensor] = []

    def take(self) -> torch.Tensor | None:
        return None if self.tails is None else self.tails[len(self.next)]

    def put(self, tail: torch.Tensor) -> None:
        self.next.append(tail)


def _last(x: torch.Tensor, n: int, dim: int = -1) -> torch.Tensor:
    return x.narrow(dim, x.shape[dim] - n, n)


class Qwen3OmniCode2WavCausalConv(nn.Module):
    """Conv1d of stride 1 left-padded by its reach, (kernel - 1) x dilation. x: [B, C, T]."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int,
                 dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation,
                              groups=groups)
        self.reach = (kernel_size - 1) * dilation

    def forward(self, x: torch.Tensor, carry: _Carry) -> torch.Tensor:
        if self.reach == 0:
            return self.conv(x)
        tail = carry.take()
        if tail is None:  # the utterance's start: zeros, as transformers pads
            tail = x.new_zeros(x.shape[0], x.shape[1], self.reach)
        x = torch.cat([tail, x], dim=-1)
        carry.put(_last(x, self.reach))
        return self.conv(x)


class Qwen3OmniCode2WavCausalTransConv(nn.Module):
    """ConvTranspose1d (kernel = stride or 2 x stride) trimmed by kernel - stride each side."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int,
                 stride: int) -> None:
        super().__init__()
        if kernel_size not in (stride, 2 * stride):
            raise ValueError(f"kernel_size: stride or 2 x stride ({stride}), got {kernel_size}")
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.trim = kernel_size - stride

    def forward(self, x: torch.Tensor, carry: _Carry) -> torch.Tensor:
        if self.trim == 0:  # kernel = stride: each output step comes from one input alone
            return self.conv(x)
        previous = carry.take()
        carry.put(x[..., -1:])
        if previous is not None:  # completes the step the previous chunk left pending
            x = torch.cat([previous, x], dim=-1)
        y = self.conv(x)
        return y[..., self.trim:y.shape[-1] - self.trim]


class Qwen3OmniCode2WavSnakeBeta(nn.Module):
    """x + sin^2(x e^alpha) / e^beta, per channel (log-scale parameters, as the checkpoint)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor, carry: _Carry | None = None) -> torch.Tensor:
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        return x + torch.sin(x * alpha).pow(2) / (beta + 1e-9)


class Qwen3OmniCode2WavConvNeXtBlock(nn.Module):
    """Causal depthwise conv (7) -> LayerNorm -> 4x MLP (GELU) -> gamma, residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = Qwen3OmniCode2WavCausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor, carry: _Carry) -> torch.Tensor:
        h = self.dwconv(x, carry).transpose(1, 2)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class Qwen3OmniCode2WavResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = Qwen3OmniCode2WavSnakeBeta(dim)
        self.conv1 = Qwen3OmniCode2WavCausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = Qwen3OmniCode2WavSnakeBeta(dim)
        self.conv2 = Qwen3OmniCode2WavCausalConv(dim, dim, 1)

    def forward(self, x: torch.Tensor, carry: _Carry) -> torch.Tensor:
        h = self.conv1(self.act1(x), carry)
        return x + self.conv2(self.act2(h), carry)


class Qwen3OmniCode2WavDecoderBlock(nn.Module):
    """SnakeBeta -> causal transposed conv (x rate, channels halved) -> 3 residual units."""

    def __init__(self, in_dim: int, rate: int) -> None:
        super().__init__()
        out_dim = in_dim // 2
        self.block = nn.ModuleList(
            [Qwen3OmniCode2WavSnakeBeta(in_dim),
             Qwen3OmniCode2WavCausalTransConv(in_dim, out_dim, 2 * rate, rate)]
            + [Qwen3OmniCode2WavResidualUnit(out_dim, d) for d in (1, 3, 9)])

    def forward(self, x: torch.Tensor, carry: _Carry) -> torch.Tensor:
        for layer in self.block:
            x = layer(x, carry)
        return x


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, n, heads, hd]; cos/sin: [B, n, hd] fp32 (rotate-half layout)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[:, :, None] + rotated * sin[:, :, None]).to(x.dtype)


class Qwen3OmniCode2WavAttention(nn.Module):
    def __init__(self, cfg: Qwen3OmniCode2WavConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (cfg.num_attention_heads,
                                                    cfg.num_key_value_heads, cfg.head_dim)
        d, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor, past_keys: torch.Tensor, past_values: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, n, D]; mask: [B, 1, n, P + n] (True: attend); past_*: [B, kv_heads, P, hd].
        Returns the output [B, n, D] and the keys/values [B, kv_heads, P + n, hd]."""
        b, n, _ = x.shape
        q = _rope(self.q_proj(x).view(b, n, self.heads, self.head_dim), cos, sin)
        k = _rope(self.k_proj(x).view(b, n, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim)
        keys = torch.cat([past_keys, k.transpose(1, 2)], dim=2)
        values = torch.cat([past_values, v.transpose(1, 2)], dim=2)
        k_all, v_all = keys, values
        if self.heads != self.kv_heads:
            k_all = k_all.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v_all = v_all.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k_all, v_all, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1)), keys, values


class Qwen3OmniCode2WavMlp(nn.Module):
    def __init__(self, cfg: Qwen3OmniCode2WavConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3OmniCode2WavLayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), 0.01))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class Qwen3OmniCode2WavLayer(nn.Module):
    def __init__(self, cfg: Qwen3OmniCode2WavConfig) -> None:
        super().__init__()
        self.self_attn = Qwen3OmniCode2WavAttention(cfg)
        self.mlp = Qwen3OmniCode2WavMlp(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = Qwen3OmniCode2WavLayerScale(cfg.hidden_size)
        self.mlp_layer_scale = Qwen3OmniCode2WavLayerScale(cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor, past_keys: torch.Tensor, past_values: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, keys, values = self.self_attn(self.input_layernorm(x), cos, sin, mask, past_keys,
                                         past_values)
        x = x + self.self_attn_layer_scale(h)
        x = x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))
        return x, keys, values


@dataclass
class Qwen3OmniCode2WavStreamState:
    """A batch of utterances' decoder state between chunks (device tensors; decode_chunk
    replaces its fields). One request's state is a batch of 1; `stack` / `split` gather
    requests into a step's batch and back."""

    frames: torch.Tensor  # [B] int64: frames decoded so far (= the next frame's rope position)
    keys: torch.Tensor  # [layers, B, kv_heads, window - 1, head_dim]: rotated keys of the last
    values: torch.Tensor  # frames, oldest first (model dtype); values likewise
    key_positions: torch.Tensor  # [B, window - 1] int64: their frames (EMPTY_POSITION: none)
    # every stateful conv's tail in call order, [B, C, reach] (model dtype); None: no frame
    # decoded yet (the first chunk pads with zeros and trims the transposed convs' heads)
    conv_tails: list[torch.Tensor] | None = None

    @property
    def batch_size(self) -> int:
        return self.frames.shape[0]

    @property
    def started(self) -> bool:
        return self.conv_tails is not None

    @classmethod
    def stack(cls, states: list[Qwen3OmniCode2WavStreamState]) -> Qwen3OmniCode2WavStreamState:
        """One batch of several states (all started, or none: their first chunks differ)."""
        if not states:
            raise ValueError("states: at least one")
        if len({s.started for s in states}) > 1:
            raise ValueError("states: started and fresh states cannot share a batch")
        if len(states) == 1:
            return states[0]
        tails = None
        if states[0].started:
            tails = [torch.cat(t) for t in zip(*(s.conv_tails for s in states), strict=True)]
        return cls(torch.cat([s.frames for s in states]),
                   torch.cat([s.keys for s in states], dim=1),
                   torch.cat([s.values for s in states], dim=1),
                   torch.cat([s.key_positions for s in states]), tails)

    def split(self) -> list[Qwen3OmniCode2WavStreamState]:
        """One state per batch row (views of this one's tensors)."""
        if self.batch_size == 1:
            return [self]
        return [Qwen3OmniCode2WavStreamState(
            self.frames[i:i + 1], self.keys[:, i:i + 1], self.values[:, i:i + 1],
            self.key_positions[i:i + 1],
            None if self.conv_tails is None else [t[i:i + 1] for t in self.conv_tails])
            for i in range(self.batch_size)]


class Qwen3OmniCode2WavTransformer(nn.Module):
    """The pre-transformer: sliding-window causal attention over frames, rope positions
    continued from the state."""

    def __init__(self, cfg: Qwen3OmniCode2WavConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Qwen3OmniCode2WavLayer(cfg)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        half = cfg.head_dim // 2
        # a plain attribute, not a buffer: model.to(bf16) must not round the frequencies
        self.inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(half, dtype=torch.float32) / half)

    def forward(self, x: torch.Tensor, state: Qwen3OmniCode2WavStreamState) -> torch.Tensor:
        """x: [B, n, D] -> [B, n, D]; moves the state's keys/values on by n frames."""
        n, window = x.shape[1], self.cfg.sliding_window
        if self.inv_freq.device != x.device:
            self.inv_freq = self.inv_freq.to(x.device)
        positions = state.frames[:, None] + torch.arange(n, device=x.device)  # [B, n]
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        key_positions = torch.cat([state.key_positions, positions], dim=1)  # [B, P + n]
        behind = positions[:, :, None] - key_positions[:, None, :]
        mask = ((behind >= 0) & (behind < window))[:, None]
        keep = self.cfg.cache_frames
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, cos, sin, mask, state.keys[i], state.values[i])
            keys.append(_last(k, keep, dim=2))
            values.append(_last(v, keep, dim=2))
        state.keys, state.values = torch.stack(keys), torch.stack(values)
        state.key_positions = _last(key_positions, keep, dim=1)
        return self.norm(x)


class Qwen3OmniCode2Wav(nn.Module):
    """Qwen3-Omni's code2wav. forward: whole utterances (equal to transformers'
    Qwen3OmniMoeCode2Wav.forward); new_stream_state / decode_chunk: exact streaming (see the
    module's NOTE); chunked_decode: transformers' generate decode (chunks with left context)."""

    def __init__(self, config: Qwen3OmniCode2WavConfig | dict) -> None:
        super().__init__()
        cfg = config if isinstance(config, Qwen3OmniCode2WavConfig) \
            else Qwen3OmniCode2WavConfig.from_hf(config)
        self.cfg = cfg
        d = cfg.hidden_size
        self.code_embedding = nn.Embedding(cfg.codebook_size * cfg.num_quantizers, d)
        self.pre_transformer = Qwen3OmniCode2WavTransformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([Qwen3OmniCode2WavCausalTransConv(d, d, ratio, ratio),
                           Qwen3OmniCode2WavConvNeXtBlock(d)])
            for ratio in cfg.upsampling_ratios)
        decoder: list[nn.Module] = [Qwen3OmniCode2WavCausalConv(d, cfg.decoder_dim, 7)]
        decoder += [Qwen3OmniCode2WavDecoderBlock(cfg.decoder_dim >> i, rate)
                    for i, rate in enumerate(cfg.upsample_rates)]
        out_dim = cfg.decoder_dim >> len(cfg.upsample_rates)
        decoder += [Qwen3OmniCode2WavSnakeBeta(out_dim),
                    Qwen3OmniCode2WavCausalConv(out_dim, 1, 7)]
        self.decoder = nn.ModuleList(decoder)

    # ---------------------------------------------------------------- weights
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (names without the `code2wav.` prefix) into the parameters;
        ValueError on an unknown name, a shape mismatch or a missing tensor."""
        load_parameters(self, tensors, shown_prefix="code2wav.",  # code_offset: from the config
                        rename=lambda name: None if name.endswith("code_offset") else name)

    # ---------------------------------------------------------------- decoding
    def check_codes(self, codes: torch.Tensor, name: str = "codes") -> None:
        """codes: an integer tensor [B, num_quantizers, frames] of ids < codebook_size
        (reads the values: a device sync on CUDA)."""
        q = self.cfg.num_quantizers
        if not isinstance(codes, torch.Tensor) or codes.dim() != 3 or codes.shape[1] != q:
            got = tuple(codes.shape) if isinstance(codes, torch.Tensor) else type(codes).__name__
            raise ValueError(f"{name}: a tensor [batch, {q}, frames], got {got}")
        if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
            raise ValueError(f"{name}: integer ids, got {codes.dtype}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.cfg.codebook_size):
            raise ValueError(f"{name}: ids in [0, {self.cfg.codebook_size}), got "
                             f"[{int(codes.min())}, {int(codes.max())}]")

    def new_stream_state(self, batch: int = 1) -> Qwen3OmniCode2WavStreamState:
        """The state of `batch` utterances before their first chunk (on the model's device)."""
        cfg, p = self.cfg, self.code_embedding.weight
        kv = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.cache_frames,
              cfg.head_dim)
        return Qwen3OmniCode2WavStreamState(
            torch.zeros(batch, dtype=torch.long, device=p.device),
            p.new_zeros(kv), p.new_zeros(kv),
            torch.full((batch, cfg.cache_frames), EMPTY_POSITION, dtype=torch.long,
                       device=p.device))

    def decode_chunk(self, codes: torch.Tensor, state: Qwen3OmniCode2WavStreamState
                     ) -> torch.Tensor:
        """codes: [B, num_quantizers, n] (ids, the model's device), the next n frames of each
        of the state's B utterances -> their new samples [B, 1, m]: m = n x samples_per_frame,
        less num_samples' loss on the first chunk. Updates `state` in place."""
        q = self.cfg.num_quantizers
        if codes.dim() != 3 or codes.shape[1] != q or codes.shape[0] != state.batch_size:
            raise ValueError(f"codes: [{state.batch_size}, {q}, frames] (the state's batch), "
                             f"got {tuple(codes.shape)}")
        n = codes.shape[-1]
        if n == 0:
            return self.code_embedding.weight.new_zeros(state.batch_size, 1, 0)
        offsets = torch.arange(q, device=codes.device)[None, :, None] * self.cfg.codebook_size
        hidden = self.code_embedding(codes + offsets).mean(1)  # [B, n, D]
        hidden = self.pre_transformer(hidden, state).transpose(1, 2)  # [B, D, n]
        carry = _Carry(state.conv_tails)
        for blocks in self.upsample:
            for block in blocks:
                hidden = block(hidden, carry)
        for block in self.decoder:
            hidden = block(hidden, carry)
        state.conv_tails = carry.next
        state.frames = state.frames + n
        return hidden.clamp(-1.0, 1.0)

    def forward(self, codes: torch.Tensor, chunk_frames: int | None = 300) -> torch.Tensor:
        """Whole utterances: codes [B, num_quantizers, F] -> waveform [B, 1, num_samples(F)].
        Decoded in pieces of chunk_frames (bounded memory for long utterances; exact: the
        streaming decoder) or in one piece (None)."""
        self.check_codes(codes)
        if chunk_frames is not None and chunk_frames < 1:
            raise ValueError(f"chunk_frames: >= 1 or None, got {chunk_frames}")
        state = self.new_stream_state(codes.shape[0])
        step = chunk_frames or max(codes.shape[-1], 1)
        pieces = [self.decode_chunk(codes[..., s:s + step], state)
                  for s in range(0, codes.shape[-1], step)]
        return torch.cat(pieces, dim=-1) if pieces else self.decode_chunk(codes, state)

    def chunked_decode(self, codes: torch.Tensor, chunk_size: int = 300,
                       left_context_size: int = 25) -> torch.Tensor:
        """transformers' generate decode: each chunk of chunk_size frames decoded alone with up
        to left_context_size frames before it, whose samples are dropped. Not exact beyond one
        chunk (attention reaches ~570 frames back) and each chunk loses num_samples' tail:
        forward is the exact decode."""
        if chunk_size < 1 or left_context_size < 0:
            raise ValueError(f"chunk_size >= 1 and left_context_size >= 0, got {chunk_size}, "
                             f"{left_context_size}")
        self.check_codes(codes)
        pieces = []
        for start in range(0, codes.shape[-1], chunk_size):
            context = min(left_context_size, start)
            wav = self(codes[..., start - context:start + chunk_size], chunk_frames=None)
            pieces.append(wav[..., context * self.cfg.samples_per_frame:])
        return torch.cat(pieces, dim=-1) if pieces else self(codes)
