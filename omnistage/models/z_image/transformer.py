"""Z-Image's single-stream DiT: diffusers' `ZImageTransformer2DModel`, text-to-image path.

Parameter names mirror diffusers' checkpoints (`layers.N.attention.to_q`, `all_x_embedder.2-1`,
`cap_pad_token` ...), so weights load by name.

NOTE: the token sequence, as diffusers builds it for one row:
- image: the latents' (h/p)(w/p) patch tokens (row-major), padded to a multiple of 32 with the
  learned `x_pad_token`; rope position (P + 1, row, col) for a patch, (0, 0, 0) for a pad;
- caption: the row's L real tokens, padded to P = ceil(L / 32) * 32 with the learned
  `cap_pad_token` (attended like real tokens); rope position (1 + j, 0, 0) for slot j < P;
- the noise refiner (timestep-modulated) runs on the image tokens, the context refiner (not
  modulated) on the caption tokens, the main layers on [image, caption], and the final layer
  gives the image tokens' output.
Here a batch shares one caption buffer of T_pad = ceil(T / 32) * 32 slots: slot j of row i holds
a real token (j < L_i), the pad token (L_i <= j < P_i), or nothing (j >= P_i: masked out as an
attention key, its output unused). Attention is order-free given the rope positions, so each
row equals diffusers run on that row's caption alone. L_i and P_i stay on the device (no host
sync): only the image tokens' first rope axis depends on them, gathered per row.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.checkpoint import load_parameters
from omnistage.layers.compile import raise_recompile_limit

SEQ_MULTIPLE = 32  # diffusers pads image and caption tokens to a multiple of this
ADALN_MAX_DIM = 256  # the timestep embedding's width: min(dim, 256)
T_EMBED_HIDDEN = 1024
T_FREQ_DIM = 256


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class ZImageConfig:
    in_channels: int
    dim: int
    n_layers: int
    n_refiner_layers: int
    n_heads: int
    norm_eps: float
    qk_norm: bool
    cap_feat_dim: int
    rope_theta: float
    t_scale: float
    axes_dims: tuple[int, int, int]
    axes_lens: tuple[int, int, int]
    patch_size: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def adaln_dim(self) -> int:
        return min(self.dim, ADALN_MAX_DIM)

    @classmethod
    def from_dict(cls, cfg: dict) -> ZImageConfig:
        """transformer/config.json as a dict; diffusers' defaults for absent keys."""
        patches = list(cfg.get("all_patch_size", [2]))
        f_patches = list(cfg.get("all_f_patch_size", [1]))
        if len(patches) != 1 or f_patches != [1]:
            raise ValueError(f"config.all_patch_size / all_f_patch_size: {patches} / {f_patches}:"
                             " only one spatial patch size with frame patch 1 is supported")
        if cfg.get("siglip_feat_dim") is not None:
            raise ValueError("config.siglip_feat_dim: the Omni variant (SigLIP inputs) is not "
                             "supported")
        dim, heads = int(cfg.get("dim", 3840)), int(cfg.get("n_heads", 30))
        if dim % heads:
            raise ValueError(f"config.n_heads: {heads} does not divide dim {dim}")
        axes_dims = tuple(int(d) for d in cfg.get("axes_dims", [32, 48, 48]))
        axes_lens = tuple(int(n) for n in cfg.get("axes_lens", [1024, 512, 512]))
        if len(axes_dims) != 3 or len(axes_lens) != 3:
            raise ValueError(f"config.axes_dims / axes_lens: {axes_dims} / {axes_lens}: "
                             "expected 3 axes each")
        if sum(axes_dims) != dim // heads or any(d % 2 for d in axes_dims):
            raise ValueError(f"config.axes_dims: {axes_dims} must be even and sum to head_dim "
                             f"{dim // heads}")
        # n_kv_heads is not read: diffusers builds full-width k/v whatever it says
        return cls(in_channels=int(cfg.get("in_channels", 16)), dim=dim,
                   n_layers=int(cfg.get("n_layers", 30)),
                   n_refiner_layers=int(cfg.get("n_refiner_layers", 2)), n_heads=heads,
                   norm_eps=float(cfg.get("norm_eps", 1e-5)),
                   qk_norm=bool(cfg.get("qk_norm", True)),
                   cap_feat_dim=int(cfg.get("cap_feat_dim", 2560)),
                   rope_theta=float(cfg.get("rope_theta", 256.0)),
                   t_scale=float(cfg.get("t_scale", 1000.0)), axes_dims=axes_dims,
                   axes_lens=axes_lens, patch_size=int(patches[0]))


class ZImageRMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast to the weight's dtype before the scale (as diffusers)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.to(self.weight.dtype) * self.weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2k], x[2k+1]) in fp32. x: [B, S, H, D]; cos, sin: [B|1, S, D/2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)


class ZImageAttention(nn.Module):
    def __init__(self, cfg: ZImageConfig) -> None:
        super().__init__()
        self.heads = cfg.n_heads
        self.to_q = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.to_k = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.to_v = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(cfg.dim, cfg.dim, bias=False)])
        # q/k norms over head_dim; diffusers' Attention fixes their eps at 1e-5
        self.norm_q = ZImageRMSNorm(cfg.head_dim, 1e-5) if cfg.qk_norm else None
        self.norm_k = ZImageRMSNorm(cfg.head_dim, 1e-5) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                key_mask: torch.Tensor | None) -> torch.Tensor:
        # x: [B, S, dim]; key_mask: [B, 1, 1, S] bool (True = attend) or None
        q = self.to_q(x).unflatten(-1, (self.heads, -1))
        k = self.to_k(x).unflatten(-1, (self.heads, -1))
        v = self.to_v(x).unflatten(-1, (self.heads, -1))
        if self.norm_q is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=key_mask)
        return self.to_out[0](out.transpose(1, 2).flatten(2))


class ZImageFeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        hidden = int(dim / 3 * 8)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ZImageBlock(nn.Module):
    """Pre/post-normed attention + SwiGLU; with `modulated`, the timestep embedding scales the
    inputs (1 + s) and gates the residual branches (tanh g)."""

    def __init__(self, cfg: ZImageConfig, modulated: bool) -> None:
        super().__init__()
        self.attention = ZImageAttention(cfg)
        self.feed_forward = ZImageFeedForward(cfg.dim)
        self.attention_norm1 = ZImageRMSNorm(cfg.dim, cfg.norm_eps)
        self.attention_norm2 = ZImageRMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm1 = ZImageRMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm2 = ZImageRMSNorm(cfg.dim, cfg.norm_eps)
        self.adaLN_modulation = (nn.Sequential(nn.Linear(cfg.adaln_dim, 4 * cfg.dim))
                                 if modulated else None)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                key_mask: torch.Tensor | None, adaln: torch.Tensor | None) -> torch.Tensor:
        # x: [B, S, dim]; adaln: [B, adaln_dim] (modulated blocks only)
        if self.adaLN_modulation is None:
            x = x + self.attention_norm2(
                self.attention(self.attention_norm1(x), cos, sin, key_mask))
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        scale_attn, gate_attn, scale_ffn, gate_ffn = (
            self.adaLN_modulation(adaln).unsqueeze(1).chunk(4, dim=2))
        attn = self.attention(self.attention_norm1(x) * (1.0 + scale_attn), cos, sin, key_mask)
        x = x + gate_attn.tanh() * self.attention_norm2(attn)
        ffn = self.feed_forward(self.ffn_norm1(x) * (1.0 + scale_ffn))
        return x + gate_ffn.tanh() * self.ffn_norm2(ffn)


class ZImageFinalLayer(nn.Module):
    def __init__(self, cfg: ZImageConfig) -> None:
        super().__init__()
        self.linear = nn.Linear(cfg.dim, cfg.patch_size ** 2 * cfg.in_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cfg.adaln_dim, cfg.dim))

    def forward(self, x: torch.Tensor, adaln: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.adaLN_modulation(adaln).unsqueeze(1)
        return self.linear(F.layer_norm(x, x.shape[-1:], eps=1e-6) * scale)


class ZImageTimestepEmbedder(nn.Module):
    def __init__(self, out_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(T_FREQ_DIM, T_EMBED_HIDDEN), nn.SiLU(),
                                 nn.Linear(T_EMBED_HIDDEN, out_dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        # t: [B] fp32, already times t_scale; sinusoids [cos | sin] in fp32
        half = T_FREQ_DIM // 2
        freqs = torch.exp(-math.log(10000.0) / half
                          * torch.arange(half, dtype=torch.float32, device=t.device))
        args = t.float()[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


def _axis_tables(cfg: ZImageConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per rope axis, cos and sin [axes_lens[i], axes_dims[i] / 2] in fp32 (angles in fp64 then
    rounded to fp32, as diffusers)."""
    tables = []
    for dim, length in zip(cfg.axes_dims, cfg.axes_lens):
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = torch.outer(torch.arange(length, dtype=torch.float64), inv).float()
        tables.append((angles.cos(), angles.sin()))
    return tables


class ZImageTransformer(nn.Module):
    """Velocity model of `ZImagePipeline` (the output as diffusers returns it: the pipeline
    negates it before the scheduler step)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        cfg = self.cfg = ZImageConfig.from_dict(config)
        key = f"{cfg.patch_size}-1"
        self.all_x_embedder = nn.ModuleDict(
            {key: nn.Linear(cfg.patch_size ** 2 * cfg.in_channels, cfg.dim)})
        self.all_final_layer = nn.ModuleDict({key: ZImageFinalLayer(cfg)})
        self.noise_refiner = nn.ModuleList(
            [ZImageBlock(cfg, modulated=True) for _ in range(cfg.n_refiner_layers)])
        self.context_refiner = nn.ModuleList(
            [ZImageBlock(cfg, modulated=False) for _ in range(cfg.n_refiner_layers)])
        self.t_embedder = ZImageTimestepEmbedder(cfg.adaln_dim)
        self.cap_embedder = nn.Sequential(ZImageRMSNorm(cfg.cap_feat_dim, cfg.norm_eps),
                                          nn.Linear(cfg.cap_feat_dim, cfg.dim))
        self.x_pad_token = nn.Parameter(torch.zeros(1, cfg.dim))
        self.cap_pad_token = nn.Parameter(torch.zeros(1, cfg.dim))
        self.layers = nn.ModuleList(
            [ZImageBlock(cfg, modulated=True) for _ in range(cfg.n_layers)])
        self._patch_key = key
        # fp32 rope tables as plain attributes (a module-wide .to(bf16) must not round them);
        # per-device copies and per-shape static parts are cached on first use
        self._tables_cpu = _axis_tables(cfg)
        self._tables: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._static_rope: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def compile_blocks(self) -> None:
        """torch.compile every block (GPU serving; shapes dynamic after the first change, one
        graph with a key mask and one without)."""
        raise_recompile_limit()
        for block in (*self.noise_refiner, *self.context_refiner, *self.layers):
            block.forward = torch.compile(block.forward)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """diffusers' transformer safetensors names; ValueError on a missing, unexpected or
        mis-shaped tensor."""
        load_parameters(self, tensors)

    # ------------------------------------------------------------------ rope tables

    def _device_tables(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if device not in self._tables:
            self._tables[device] = [(c.to(device), s.to(device)) for c, s in self._tables_cpu]
        return self._tables[device]

    def _static_parts(self, cap_slots: int, h_tokens: int, w_tokens: int,
                      device: torch.device) -> tuple[torch.Tensor, ...]:
        """Rope parts that depend on shapes only: caption (cos, sin) [cap_slots, D/2] at
        positions (1 + j, 0, 0); image (cos, sin) of the row/col axes [N_pad, (d1 + d2) / 2]
        (identity at pad tokens); and the image pad flags [N_pad, 1]."""
        key = (cap_slots, h_tokens, w_tokens, device)
        if key not in self._static_rope:
            (c0, s0), (c1, s1), (c2, s2) = self._device_tables(device)
            n = h_tokens * w_tokens
            n_pad = _round_up(n, SEQ_MULTIPLE)
            slots = torch.arange(1, cap_slots + 1, device=device)
            rest = self.cfg.head_dim // 2 - c0.shape[1]
            cap_cos = torch.cat([c0[slots], c0.new_ones(cap_slots, rest)], dim=-1)
            cap_sin = torch.cat([s0[slots], s0.new_zeros(cap_slots, rest)], dim=-1)
            rows = torch.arange(h_tokens, device=device).repeat_interleave(w_tokens)
            cols = torch.arange(w_tokens, device=device).repeat(h_tokens)
            img_cos = F.pad(torch.cat([c1[rows], c2[cols]], dim=-1), (0, 0, 0, n_pad - n),
                            value=1.0)
            img_sin = F.pad(torch.cat([s1[rows], s2[cols]], dim=-1), (0, 0, 0, n_pad - n))
            is_pad = (torch.arange(n_pad, device=device) >= n)[:, None]
            self._static_rope[key] = (cap_cos, cap_sin, img_cos, img_sin, is_pad)
        return self._static_rope[key]

    def _image_rope(self, cap_len_padded: torch.Tensor, img_cos: torch.Tensor,
                    img_sin: torch.Tensor, is_pad: torch.Tensor,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # first axis at P_i + 1 for each row's patches, angle 0 at pad tokens -> [B, N_pad, D/2]
        c0, s0 = self._device_tables(device)[0]
        index = cap_len_padded + 1
        batch, n_pad = index.shape[0], img_cos.shape[0]
        f_cos = torch.where(is_pad, 1.0, c0[index][:, None]).expand(batch, n_pad, -1)
        f_sin = torch.where(is_pad, 0.0, s0[index][:, None]).expand(batch, n_pad, -1)
        return (torch.cat([f_cos, img_cos.expand(batch, -1, -1)], dim=-1),
                torch.cat([f_sin, img_sin.expand(batch, -1, -1)], dim=-1))

    # ------------------------------------------------------------------ forward

    def _check_inputs(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                      text_mask: torch.Tensor | None) -> None:
        cfg, p = self.cfg, self.cfg.patch_size
        if latents.dim() != 4 or latents.shape[1] != cfg.in_channels:
            raise ValueError(f"latents: shape {tuple(latents.shape)}, expected "
                             f"[B, {cfg.in_channels}, h, w]")
        b, _, h, w = latents.shape
        if h % p or w % p:
            raise ValueError(f"latents: spatial size {h}x{w} is not a multiple of the patch "
                             f"size {p}")
        if h // p > cfg.axes_lens[1] or w // p > cfg.axes_lens[2]:
            raise ValueError(f"latents: {h // p}x{w // p} patches exceed the rope tables "
                             f"(axes_lens {cfg.axes_lens})")
        if timestep.shape != (b,):
            raise ValueError(f"timestep: shape {tuple(timestep.shape)}, expected [{b}]")
        if text.dim() != 3 or text.shape[0] != b or text.shape[2] != cfg.cap_feat_dim:
            raise ValueError(f"text: shape {tuple(text.shape)}, expected "
                             f"[{b}, T, {cfg.cap_feat_dim}]")
        if _round_up(text.shape[1], SEQ_MULTIPLE) + 1 >= cfg.axes_lens[0]:
            raise ValueError(f"text: {text.shape[1]} tokens exceed the rope tables "
                             f"(axes_lens[0] {cfg.axes_lens[0]})")
        if text_mask is not None and (text_mask.shape != text.shape[:2]
                                      or text_mask.dtype != torch.bool):
            raise ValueError(f"text_mask: {text_mask.dtype} {tuple(text_mask.shape)}, expected "
                             f"bool {tuple(text.shape[:2])}")

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                text_mask: torch.Tensor | None) -> torch.Tensor:
        """See first() for the arguments; returns diffusers' output [B, C, h, w]."""
        state, _ = self.first(latents, timestep, text, text_mask)
        return self.finish(state, self.rest(state))

    # NOTE: forward = first -> rest -> finish, so a step cache (engine/gen/diffusion.py) can
    # run the first main layer for every row and the others only for rows whose first-layer
    # change is large, reusing the others' residual of the later layers
    def first(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
              text_mask: torch.Tensor | None) -> tuple[FirstBlockState, torch.Tensor]:
        """latents: [B, C, h, w] (one size for the batch); timestep: [B] float, diffusers'
        `(1000 - t) / 1000`; text: [B, T, cap_feat_dim] caption features padded at the end;
        text_mask: [B, T] bool, True at real tokens (a prefix of each row; an empty row gives
        diffusers' output for an empty caption), or None when all are real. Returns (the state
        after main layer 0, the image tokens' change by it [B, N, dim]: the cache's probe); the
        model runs in its parameters' dtype. No host syncs; shapes alone pick the cached rope
        parts."""
        self._check_inputs(latents, timestep, text, text_mask)
        cfg, p, device = self.cfg, self.cfg.patch_size, latents.device
        dtype = self.x_pad_token.dtype
        b, c, h, w = latents.shape
        ht, wt = h // p, w // p
        n, t_len = ht * wt, text.shape[1]
        slots = _round_up(t_len, SEQ_MULTIPLE)
        cap_cos, cap_sin, img_cos, img_sin, is_pad = self._static_parts(slots, ht, wt, device)
        n_pad = img_cos.shape[0]

        # caption: real tokens, then the pad token up to each row's P_i, then masked slots
        slot = torch.arange(slots, device=device)
        if text_mask is None:
            cap_len = torch.full((b,), t_len, device=device)
        else:
            cap_len = text_mask.sum(dim=1)
        cap_len_padded = (cap_len + SEQ_MULTIPLE - 1) // SEQ_MULTIPLE * SEQ_MULTIPLE
        cap = self.cap_embedder(F.pad(text.to(dtype), (0, 0, 0, slots - t_len)))
        cap_is_pad = (slot[None] >= cap_len[:, None])[..., None]
        cap = torch.where(cap_is_pad, self.cap_pad_token, cap)
        if text_mask is None:  # every row fills all slots: no key mask needed
            cap_keys = None
        else:
            cap_keys = slot[None] < cap_len_padded[:, None]  # [B, slots]

        # image: patch tokens [B, N, p*p*C] in (row, col) order, features (ph, pw, c)
        x = latents.to(dtype).view(b, c, ht, p, wt, p).permute(0, 2, 4, 3, 5, 1)
        x = self.all_x_embedder[self._patch_key](x.reshape(b, n, p * p * c))
        x = torch.cat([x, self.x_pad_token.expand(b, n_pad - n, -1)], dim=1)
        x_cos, x_sin = self._image_rope(cap_len_padded, img_cos, img_sin, is_pad, device)

        adaln = self.t_embedder(timestep.float() * cfg.t_scale).to(dtype)
        for layer in self.noise_refiner:
            x = layer(x, x_cos, x_sin, None, adaln)
        # slot 0 always attends (no effect when P_i > 0): an empty caption's slots stay finite
        cap_mask = None if cap_keys is None else (cap_keys | (slot == 0))[:, None, None, :]
        for layer in self.context_refiner:
            cap = layer(cap, cap_cos[None], cap_sin[None], cap_mask, None)

        seq = torch.cat([x, cap], dim=1)
        cos = torch.cat([x_cos, cap_cos.expand(b, -1, -1)], dim=1)
        sin = torch.cat([x_sin, cap_sin.expand(b, -1, -1)], dim=1)
        mask = None if cap_keys is None else torch.cat(
            [cap_keys.new_ones(b, n_pad), cap_keys], dim=1)[:, None, None, :]
        seq1 = self.layers[0](seq, cos, sin, mask, adaln)
        state = FirstBlockState(seq1, cos, sin, mask, adaln, n, tuple(latents.shape),
                                latents.dtype)
        return state, (seq1 - seq)[:, :n]

    def rest(self, state: FirstBlockState, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Main layers 1.. on `rows` of the batch (None: all): the image tokens' change
        [r, N, dim]."""
        seq, cos, sin, mask, adaln = state.seq, state.cos, state.sin, state.mask, state.adaln
        if rows is not None:
            seq, cos, sin, adaln = seq[rows], cos[rows], sin[rows], adaln[rows]
            mask = None if mask is None else mask[rows]
        start = seq
        for layer in self.layers[1:]:
            seq = layer(seq, cos, sin, mask, adaln)
        return (seq - start)[:, :state.image_tokens]

    def finish(self, state: FirstBlockState, residual: torch.Tensor) -> torch.Tensor:
        """The output [B, C, h, w] from layer 0's image tokens plus the later layers' change."""
        b, c, h, w = state.shape
        p = self.cfg.patch_size
        out = self.all_final_layer[self._patch_key](
            state.seq[:, :state.image_tokens] + residual, state.adaln)  # [B, N, p*p*C]
        out = out.view(b, h // p, w // p, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)
        return out.to(state.dtype)


@dataclass
class FirstBlockState:
    """What the main layers after the first continue from (see ZImageTransformer.first)."""

    seq: torch.Tensor  # [B, S, dim] after main layer 0
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None
    adaln: torch.Tensor
    image_tokens: int  # N: the image patches at the front of seq
    shape: tuple[int, ...]  # the latents' [B, C, h, w]
    dtype: torch.dtype
