"""Prefill-only causal LM text encoder for diffusion pipelines (Qwen2.5-VL text part, Qwen3).

A diffusion pipeline runs its prompt once through a causal LM and keeps one entry of
transformers' `hidden_states` tuple: Qwen-Image takes `[-1]` (last layer, after the final norm)
of `Qwen2_5_VLForConditionalGeneration`, Z-Image takes `[-2]` (output of layer N-1, no norm) of a
Qwen3 model. This is a dense batched forward over a right-padded [B, T] batch: no KV cache, SDPA
with a causal + key-padding mask, and only the layers up to the chosen output are built.

NOTE: text-only Qwen2.5-VL mrope gives the three axes (t, h, w) the same position, so every
frequency rotates with that one position: it equals plain 1-D rope with positions arange(T) (what
transformers uses when no image grid is given), and that is what runs here."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from omnistage.checkpoint import load_parameters
from omnistage.models.layers import (
    MLP,
    Attention,
    DecoderConfig,
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
)

# model_type -> family; a family fixes the parts its config does not spell out
_FAMILIES = {
    "qwen2": "qwen2", "qwen2_vl": "qwen2", "qwen2_vl_text": "qwen2",
    "qwen2_5_vl": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3": "qwen3",
}
# checkpoint prefixes of the language model, most specific first (Qwen2.5-VL as transformers 5
# saves it; causal LMs; bare `Qwen3Model` saves carry no prefix)
_LM_PREFIXES = ("model.language_model.", "model.")
# checkpoint tensors that are not the language model's body
_SKIPPED_PREFIXES = ("lm_head.", "visual.", "model.visual.")


def text_decoder_config(config: dict) -> tuple[DecoderConfig, str]:
    """(DecoderConfig, family) of a text encoder folder's config.json (Qwen2.5-VL: its text part,
    nested `text_config` over the flat top-level keys of older saves; Qwen2/Qwen3: as is)."""
    model_type = config.get("model_type")
    if model_type not in _FAMILIES:
        raise ValueError(f"config.model_type: {model_type!r} is not supported "
                         f"(supported: {', '.join(sorted(_FAMILIES))})")
    family = _FAMILIES[model_type]
    text = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
    text.update(config.get("text_config") or {})
    rope = dict(text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {})
    text.pop("rope_scaling", None)
    if rope.get("rope_type", rope.get("type")) == "mrope":  # pre-v5 name of default + sections
        rope.pop("type", None)
        rope["rope_type"] = "default"
    text["rope_parameters"] = rope
    if family == "qwen2":
        text.pop("head_dim", None)  # Qwen2(-VL) attention always uses hidden_size / heads
        bias = True  # q/k/v always biased, o_proj never
    else:
        text.setdefault("head_dim", 128)  # transformers' Qwen3Config default
        bias = bool(text.get("attention_bias", False))
    return DecoderConfig.from_hf(text, attention_bias=bias), family


class _EncoderAttention(Attention):
    """q/k/v/o projections (layers.Attention), plus Qwen3's per-head q/k RMSNorm."""

    def __init__(self, cfg: DecoderConfig, qk_norm: bool, o_proj_bias: bool) -> None:
        super().__init__(cfg, o_proj_bias=o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None


class _EncoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, qk_norm: bool, o_proj_bias: bool) -> None:
        super().__init__()
        self.self_attn = _EncoderAttention(cfg, qk_norm, o_proj_bias)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        # x: [B, T, D]; cos/sin: [T, hd] fp32; mask: [B, 1, T, T] bool (True = attend) or None
        a, m = self.self_attn, self.mlp
        B, T, _ = x.shape
        h = self.input_layernorm(x)
        q = a.q_proj(h).view(B, T, a.num_heads, a.head_dim)
        k = a.k_proj(h).view(B, T, a.num_kv_heads, a.head_dim)
        v = a.v_proj(h).view(B, T, a.num_kv_heads, a.head_dim)
        if a.q_norm is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        q = apply_rope(q, cos, sin).transpose(1, 2)  # [B, H, T, hd]
        k = apply_rope(k, cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        groups = a.num_heads // a.num_kv_heads
        if groups > 1:  # explicit GQA repeat (a view, then one copy): every SDPA backend takes it
            k = k[:, :, None].expand(B, a.num_kv_heads, groups, T, a.head_dim).flatten(1, 2)
            v = v[:, :, None].expand(B, a.num_kv_heads, groups, T, a.head_dim).flatten(1, 2)
        o = nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=a.scale)
        x = x + a.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        h = self.post_attention_layernorm(x)
        return x + m.down_proj(nn.functional.silu(m.gate_proj(h)) * m.up_proj(h))


class CausalTextEncoder(nn.Module):
    """Dense prefill of a Qwen2/Qwen2.5-VL/Qwen3 LM returning one `hidden_states` entry.

    output_layer indexes transformers' `hidden_states` tuple of N+1 entries: 0 = embeddings,
    i = output of layer i (no norm), N or -1 = last layer after the final norm, -2 = output of
    layer N-1. Layers after it (and the final norm unless it is used) are neither built nor
    loaded. Parameter names are the checkpoint's with the language-model prefix stripped
    (`embed_tokens`, `layers.N.self_attn.q_proj`, `norm`)."""

    def __init__(self, config: dict, output_layer: int) -> None:
        super().__init__()
        self.config, family = text_decoder_config(config)
        cfg = self.config
        n = cfg.num_hidden_layers
        if isinstance(output_layer, bool) or not isinstance(output_layer, int) or not (
                -(n + 1) <= output_layer <= n):
            raise ValueError(f"output_layer: {output_layer!r} must be an int index into the "
                             f"{n + 1} hidden states (-{n + 1} .. {n})")
        self.num_layers = output_layer % (n + 1)  # layers run
        qk_norm, o_proj_bias = family == "qwen3", family == "qwen3" and cfg.attention_bias
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            _EncoderLayer(cfg, qk_norm, o_proj_bias) for _ in range(self.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.num_layers == n else None
        self.rotary_emb = RotaryEmbedding(cfg)
        # per (T, device): rope cos/sin [T, hd] fp32, causal and diagonal masks [T, T]; filled on
        # the first call of a shape, so a CUDA graph captured after a warm-up call only reads it
        self._shape_cache: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}

    def checkpoint_name(self, name: str) -> str | None:
        """Our parameter name for a checkpoint tensor name, or None when it is not ours (vision
        tower, lm_head, layers past the output layer, the unused final norm)."""
        if name.startswith(_SKIPPED_PREFIXES):
            return None
        for prefix in _LM_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        if name.startswith("layers."):
            index = name.split(".", 2)[1]
            if index.isdigit() and int(index) >= self.num_layers:
                return None
        if name.startswith("norm.") and self.norm is None:
            return None
        return name

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (checkpoint name, tensor) pairs in; ValueError naming a tensor with no parameter
        or the wrong shape, and the parameters no tensor filled."""
        load_parameters(self, tensors, rename=self.checkpoint_name)

    def _shape_tables(self, T: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        key = (T, device)
        if key not in self._shape_cache:
            cos, sin = self.rotary_emb(torch.arange(T, device=device))
            causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
            diagonal = torch.eye(T, dtype=torch.bool, device=device)
            self._shape_cache[key] = (cos, sin, causal, diagonal)
        return self._shape_cache[key]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """input_ids [B, T] (right-padded), attention_mask [B, T] (1 real, 0 pad) or None (all
        real; plain causal SDPA, flash-eligible). Returns [B, T, D] in the model dtype: the
        `hidden_states[output_layer]` rows; rows at padded positions are finite but meaningless.
        Positions are arange(T) per row, as transformers uses for text-only input."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [B, T], got shape {tuple(input_ids.shape)}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask: shape {tuple(attention_mask.shape)} must equal "
                             f"input_ids' {tuple(input_ids.shape)}")
        T = input_ids.shape[1]
        cos, sin, causal, diagonal = self._shape_tables(T, input_ids.device)
        mask = None
        if attention_mask is not None:
            # NOTE: the diagonal stays open so a row with no real key before it (padding, or an
            # all-padding row) attends to itself and stays finite; real rows are unaffected.
            keys = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, T]
            mask = causal & keys | diagonal
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return x if self.norm is None else self.norm(x)
