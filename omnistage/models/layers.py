"""Decoder-only transformer building blocks shared by Qwen2, Llama, and Qwen2.5-Omni's LMs.

Module and parameter names mirror Hugging Face checkpoints (model.layers.N.self_attn.q_proj ...),
so weights load by name. NOTE: RMSNorm and RoPE run in fp32 whatever the model dtype."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from omnistage.checkpoint import load_parameters
from omnistage.engine.ar.attention import _triton_ok, paged_attention, write_kv
from omnistage.engine.ar.kernels import KernelOptions
from omnistage.engine.ar.interface import DecoderContract, ForwardBatch, merge_inputs
from omnistage.layers.parallel import (ParallelLMHead, VocabParallelEmbedding, column_linear,
                                       current_tp, head_layout, row_linear, split)


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple | None  # frozen items of the rope parameters besides theta
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    mrope_section: tuple[int, ...] | None = None
    hidden_act: str = "silu"

    @classmethod
    def from_hf(cls, cfg: dict, attention_bias: bool | None = None) -> DecoderConfig:
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        mrope = rope.pop("mrope_section", None)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3", "linear"):
            raise ValueError(f"config.rope_parameters.rope_type: {rope_type!r} is not supported "
                             "(supported: default, llama3, linear)")
        if cfg.get("use_sliding_window"):
            raise ValueError("config.use_sliding_window: sliding-window attention is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.hidden_act: {cfg.get('hidden_act')!r} is not supported")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=tuple(sorted(rope.items())) if rope_type != "default" else None,
            attention_bias=(cfg.get("attention_bias", False) if attention_bias is None
                            else attention_bias),
            mlp_bias=cfg.get("mlp_bias", False),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            mrope_section=tuple(mrope) if mrope else None)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin [T, head_dim] (fp32) for 1-D positions [T] or 3-axis mrope positions [3, T]."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        half = cfg.head_dim // 2
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, half, dtype=torch.float32) / half)
        if cfg.rope_scaling:
            inv_freq = _scaled_inv_freq(inv_freq, dict(cfg.rope_scaling))
        # plain attributes, not buffers: model.to(bf16) must not round the frequencies
        self.inv_freq = inv_freq
        if cfg.mrope_section:
            if sum(cfg.mrope_section) != half:
                raise ValueError(f"config mrope_section {cfg.mrope_section} must sum to head_dim/2")
            axis = torch.repeat_interleave(torch.arange(3), torch.tensor(cfg.mrope_section))
            self.mrope_axis = axis.to(inv_freq.device)  # [half]: the axis of each frequency
        else:
            self.mrope_axis = None

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
            if self.mrope_axis is not None:
                self.mrope_axis = self.mrope_axis.to(positions.device)
        if positions.dim() == 2:
            if self.mrope_axis is None:
                raise ValueError("3-axis positions given to a model without mrope_section")
            # NOTE: frequency j rotates with the position of axis mrope_axis[j] (t, h or w)
            pos = positions.float()[self.mrope_axis].transpose(0, 1)  # [T, half]
            freqs = pos * self.inv_freq
        else:
            freqs = positions.float()[:, None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def _scaled_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    rope_type = p.get("rope_type", p.get("type"))
    if rope_type == "linear":
        return inv_freq / p["factor"]
    # llama3: long wavelengths scaled by `factor`, short kept, smooth in between
    factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(is_mid, mid, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, hd]; cos/sin: [T, hd] fp32
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _linear(x, w, b=None):
    return nn.functional.linear(x, w, b)


def attention_qkv(x, ln_w, eps: float, w_qkv, b_qkv):
    """input norm -> fused q/k/v projection. x: [T, D] -> qkv [T, (H + 2*Hkv) * hd]."""
    return _linear(_rms_norm(x, ln_w, eps), w_qkv, b_qkv)


def attention_in(x, ln_w, eps: float, w_qkv, b_qkv, cos, sin, num_heads: int,
                 num_kv_heads: int, head_dim: int):
    """input norm -> fused q/k/v projection -> rope. x: [T, D] -> q [T,H,hd], k/v [T,Hkv,hd]."""
    T = x.shape[0]
    qkv = attention_qkv(x, ln_w, eps, w_qkv, b_qkv)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    q = apply_rope(q.reshape(T, num_heads, head_dim), cos, sin)
    k = apply_rope(k.reshape(T, num_kv_heads, head_dim), cos, sin)
    return q, k, v.reshape(T, num_kv_heads, head_dim)


def attention_out_mlp(x, o, wo, ln_w, eps: float, w_gate_up, b_gate_up, wd, bd):
    """o_proj + residual -> post norm -> fused gate/up, SiLU gate, down + residual."""
    x = x + _linear(o.reshape(o.shape[0], -1), wo)
    gate, up = _linear(_rms_norm(x, ln_w, eps), w_gate_up, b_gate_up).chunk(2, dim=-1)
    return x + _linear(nn.functional.silu(gate) * up, wd, bd)


def residual_mlp_in(x, attn, ln_w, eps: float, w_gate_up, b_gate_up):
    """Tensor parallel: x + the reduced attention output -> (new residual [T, D], SiLU(gate) *
    up of this rank's intermediate slice [T, F / size])."""
    x = x + attn
    gate, up = _linear(_rms_norm(x, ln_w, eps), w_gate_up, b_gate_up).chunk(2, dim=-1)
    return x, nn.functional.silu(gate) * up


def row_parallel_out(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     tp) -> torch.Tensor:
    """A row-parallel linear: this rank's partial product, all-reduced, then the whole bias."""
    out = tp.all_reduce(_linear(x, weight))
    return out if bias is None else out + bias


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linears over the same input; each linear's parameters
    become views into it, so checkpoint names keep working and memory is not doubled."""
    weight = torch.cat([lin.weight.data for lin in linears])
    has_bias = all(lin.bias is not None for lin in linears)
    bias = torch.cat([lin.bias.data for lin in linears]) if has_bias else None
    off = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = weight[off:off + n]
        if has_bias:
            lin.bias.data = bias[off:off + n]
        off += n
    return weight, bias


# NOTE: on CUDA the engine runs these compiled (torch.compile fuses the norms, rope, activation
# and residuals around the GEMMs); the paged attention between them stays our Triton kernel.
# "qkv" serves the fused rope + KV-write path (below), "in" the plain one.
KERNELS = {"in": attention_in, "qkv": attention_qkv, "out": attention_out_mlp,
           "tp_mlp_in": residual_mlp_in}


@functools.cache
def compiled_kernels() -> dict:
    """KERNELS through torch.compile (built once per process, on first use; CUDA)."""
    return {name: torch.compile(fn, dynamic=True) for name, fn in KERNELS.items()}


class Attention(nn.Module):
    """q/k/v/o projections (q/k/v biased as the config says, o_proj as `o_proj_bias`); the
    engine binds k_cache/v_cache. Under tensor parallelism (layers/parallel.py) this rank's
    heads: q/k/v column-parallel, o_proj row-parallel (its product a partial sum)."""

    def __init__(self, cfg: DecoderConfig, o_proj_bias: bool = False) -> None:
        super().__init__()
        self.tp = tp = current_tp()
        layout = head_layout(cfg.num_attention_heads, cfg.num_key_value_heads, tp)
        self.num_heads, self.num_kv_heads = layout.num_heads, layout.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim ** -0.5
        d, hd, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        if not tp.enabled:
            self.q_proj = nn.Linear(d, self.num_heads * hd, bias=bias)
            self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=bias)
            self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=bias)
            self.o_proj = nn.Linear(self.num_heads * hd, d, bias=o_proj_bias)
        else:
            q_rows = [(layout.q_start * hd, self.num_heads * hd)]
            kv_rows = [(layout.kv_start * hd, self.num_kv_heads * hd)]
            full_q, full_kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
            self.q_proj = column_linear(d, full_q, q_rows, bias)
            self.k_proj = column_linear(d, full_kv, kv_rows, bias)
            self.v_proj = column_linear(d, full_kv, kv_rows, bias)
            self.o_proj = row_linear(full_q, d, *q_rows[0], bias=o_proj_bias)
        # bound by the engine: [num_blocks, block_size, n_kv, hd]
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        d, f, tp = cfg.hidden_size, cfg.intermediate_size, current_tp()
        if not tp.enabled:
            self.gate_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
            self.up_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
            self.down_proj = nn.Linear(f, d, bias=cfg.mlp_bias)
            return
        start, n = split(f, tp, "intermediate_size")
        self.gate_proj = column_linear(d, f, [(start, n)], cfg.mlp_bias)
        self.up_proj = column_linear(d, f, [(start, n)], cfg.mlp_bias)
        self.down_proj = row_linear(f, d, start, n, cfg.mlp_bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._gemv_tuned: bool | None = None  # gemv_tuned(), once the weights are fused
        self.kernels = KernelOptions()  # the engine's runner sets its own (configure_kernels)
        self.fp8 = None  # Fp8LayerWeights once quantised (models/fp8_decoder.py)

    def fuse(self) -> None:
        """After loading and casting: fused q/k/v and gate/up weights (fewer, larger GEMMs)."""
        a, m = self.self_attn, self.mlp
        self.w_qkv, self.b_qkv = fuse_linears([a.q_proj, a.k_proj, a.v_proj])
        self.w_gate_up, self.b_gate_up = fuse_linears([m.gate_proj, m.up_proj])

    def gemv_tuned(self) -> bool:
        """Whether triton_gemv's table has measured 1-row configs for this layer's weights."""
        if self._gemv_tuned is None:
            from omnistage.engine.ar.triton_gemv import has_configs  # triton: lazily
            a, m = self.self_attn, self.mlp

            def fused(linears: list[nn.Linear]) -> tuple[int, int]:  # (fuse() may not have run)
                return sum(lin.weight.shape[0] for lin in linears), linears[0].weight.shape[1]

            shapes = [fused([a.q_proj, a.k_proj, a.v_proj]), tuple(a.o_proj.weight.shape),
                      fused([m.gate_proj, m.up_proj]), tuple(m.down_proj.weight.shape)]
            self._gemv_tuned = has_configs(shapes, a.q_proj.weight.dtype)
        return self._gemv_tuned

    def uses_fused_rope_kv(self, device: torch.device) -> bool:
        forced = self.kernels.fused_rope_kv
        return _triton_ok(device) if forced is None else forced

    def uses_triton_gemv(self, x: torch.Tensor) -> bool:
        """Whether this step's rows x run through the Triton GEMVs (KernelOptions)."""
        opts = self.kernels
        if self.self_attn.tp.enabled:  # (the GEMVs' fused residuals cannot all-reduce)
            return False
        if x.shape[0] > opts.gemv_max_rows or not self.uses_fused_rope_kv(x.device):
            return False
        if opts.triton_gemv is not None:
            return opts.triton_gemv
        return _triton_ok(x.device) and self.gemv_tuned()

    def forward(self, x, cos, sin, batch: ForwardBatch) -> torch.Tensor:
        if self.fp8 is not None:  # weight-only FP8 projections
            from omnistage.models.fp8_decoder import fp8_layer_forward  # (it imports this)
            return fp8_layer_forward(self, x, cos, sin, batch)
        a, m, opts = self.self_attn, self.mlp, self.kernels
        if not hasattr(self, "w_qkv"):
            self.fuse()
        kernels = compiled_kernels() if opts.compile else KERNELS
        ln = self.input_layernorm
        gemv = self.uses_triton_gemv(x)  # decode rows: Triton GEMVs for the dense parts
        if gemv:
            from omnistage.engine.ar import triton_gemv as tg  # triton: lazily
            launch = dict(pdl=opts.pdl, fused_reduce=opts.gemv_fused_reduce)
        if self.uses_fused_rope_kv(x.device):
            from omnistage.engine.ar.triton_rope_kv import rope_write_kv  # triton: lazily
            if gemv:
                qkv = tg.norm_gemv(x, ln.weight, ln.eps, self.w_qkv, self.b_qkv, **launch)
            else:
                qkv = kernels["qkv"](x, ln.weight, ln.eps, self.w_qkv, self.b_qkv)
            q = rope_write_kv(qkv, cos, sin, a.k_cache, a.v_cache, batch.attn.slot_mapping,
                              a.num_heads, a.num_kv_heads, a.head_dim, pdl=opts.pdl)
        else:
            q, k, v = kernels["in"](x, ln.weight, ln.eps, self.w_qkv, self.b_qkv, cos, sin,
                                    a.num_heads, a.num_kv_heads, a.head_dim)
            write_kv(k, v, a.k_cache, a.v_cache, batch.attn.slot_mapping)
        o = paged_attention(q, a.k_cache, a.v_cache, batch.attn, a.scale, pdl=opts.pdl)
        post = self.post_attention_layernorm
        if a.tp.enabled:  # row-parallel o_proj and down_proj: all-reduced partial sums
            attn = row_parallel_out(o.reshape(o.shape[0], -1), a.o_proj.weight, a.o_proj.bias,
                                    a.tp)
            x, h = kernels["tp_mlp_in"](x, attn, post.weight, post.eps, self.w_gate_up,
                                        self.b_gate_up)
            return x + row_parallel_out(h, m.down_proj.weight, m.down_proj.bias, a.tp)
        if gemv:
            x = tg.gemv_residual(o.reshape(o.shape[0], -1), a.o_proj.weight, x, **launch)
            h = tg.norm_gemv_silu_mul(x, post.weight, post.eps, self.w_gate_up, self.b_gate_up,
                                      **launch)
            return tg.gemv_residual(h, m.down_proj.weight, x, m.down_proj.bias, **launch)
        return kernels["out"](x, o, a.o_proj.weight, post.weight, post.eps, self.w_gate_up,
                              self.b_gate_up, m.down_proj.weight, m.down_proj.bias)


class DecoderModel(nn.Module):
    """embed_tokens -> layers -> norm (the `model.*` part of a causal LM checkpoint)."""

    def __init__(self, cfg: DecoderConfig, embed_dim: int | None = None) -> None:
        super().__init__()
        tp = current_tp()
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, embed_dim or cfg.hidden_size)
                             if not tp.enabled else
                             VocabParallelEmbedding(cfg.vocab_size, embed_dim or cfg.hidden_size,
                                                    tp))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # x: [T, D] input rows -> [T, D] final-normed hidden
        cos, sin = self.rotary_emb(batch.positions)
        for layer in self.layers:
            x = layer(x, cos, sin, batch)
        return self.norm(x)


class DecoderForCausalLM(DecoderContract, nn.Module):
    """A plain causal LM on the engine's model interface (engine/ar/interface.py). Built
    inside layers.parallel.tensor_parallel(tp): this rank's shard (`self.tp`)."""

    def __init__(self, hf_config: dict) -> None:
        super().__init__()
        self.tp = current_tp()
        self.config = DecoderConfig.from_hf(hf_config,
                                            attention_bias=self.attention_bias(hf_config))
        self.model = DecoderModel(self.config)
        self.lm_head = parallel_lm_head(self.config.hidden_size, self.config.vocab_size,
                                        self.model.embed_tokens, self.tp,
                                        self.config.tie_word_embeddings)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings and not self.tp.enabled:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, this rank's KV heads, head_dim): under tensor parallelism a rank caches
        only its heads."""
        c = self.config
        return c.num_hidden_layers, self.model.layers[0].self_attn.num_kv_heads, c.head_dim

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embed_lookup(self.input_embedding, input_ids)

    def embed_row(self, token_id: int) -> torch.Tensor:
        return embed_row_lookup(self.input_embedding, token_id)

    @staticmethod
    def attention_bias(hf_config: dict) -> bool | None:
        return None  # from the config

    @classmethod
    def supports_tensor_parallel(cls) -> bool:
        """Whether a shard of it runs under tensor parallelism: a subclass with a forward of
        its own (the Qwen2.5-Omni talker's) may embed with the local lookup, so it does not."""
        return cls.forward is DecoderForCausalLM.forward

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        # the module call: collective under tensor parallelism (embed() is a local lookup)
        return self.model(merge_inputs(self.input_embedding(batch.input_ids), batch), batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def checkpoint_name(self, name: str) -> str | None:
        """Map a checkpoint tensor name to ours (None = not ours, skip)."""
        return name

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # a tied head is the embedding's parameter: named_parameters lists it once
        load_parameters(self, tensors, rename=self.checkpoint_name)


def parallel_lm_head(dim: int, vocab_size: int, embedding: nn.Module, tp,
                     tied: bool) -> nn.Module:
    """nn.Linear, or under tensor parallelism the vocab-parallel head (sharing the
    embedding's rows when tied)."""
    if not tp.enabled:
        return nn.Linear(dim, vocab_size, bias=False)
    return ParallelLMHead(dim, vocab_size, tp, embedding if tied else None)


def embed_lookup(table: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Token rows outside a step (adapters, on rank 0): no collective."""
    if isinstance(table, VocabParallelEmbedding):
        return table.lookup(input_ids)
    return table(input_ids)


def embed_row_lookup(table: nn.Module, token_id: int) -> torch.Tensor:
    """One token's row [D], a view of the (whole) table."""
    if isinstance(table, VocabParallelEmbedding):
        if table.full_table is None:
            table.lookup(torch.zeros(1, dtype=torch.long))  # raises: not rank 0
        return table.full_table[token_id]
    return table.weight[token_id]
