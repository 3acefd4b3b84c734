"""Qwen3-style decoder with q/k norm and per-layer MoE or dense MLP: Qwen3-Omni's thinker LM,
its talker LM (shared-expert MoE) and its code predictor (dense, 1-D rope).

  MoEDecoderConfig  a text config.json dict -> frozen config (unsupported options rejected)
  MoEDecoderLayer   input norm -> q/k/v -> per-head q/k RMSNorm -> rope -> paged attention ->
                    o_proj + residual -> post norm -> SparseMoE or SiLU MLP + residual
  MoEDecoderModel   embed_tokens (optional) -> layers (+ deepstack rows) -> norm
  load_named_tensors  checkpoint names -> parameters; per-expert names into MoEExperts

Module and parameter names equal the checkpoint's (`layers.N.self_attn.q_norm.weight`,
`layers.N.mlp.experts.E.gate_proj.weight` ...). NOTE: RMSNorm and RoPE run in fp32 whatever the
model dtype (models/layers.py's math, imported). The layer's pieces (`qkv`, `attn_out_mlp`)
take no ForwardBatch, so a caller with its own small dense cache (the code predictor) can run
them around its own attention; only `forward` touches the paged KV cache."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.checkpoint import load_parameters
from omnistage.engine.ar.attention import paged_attention, write_kv
from omnistage.engine.ar.interface import ForwardBatch
from omnistage.engine.ar.kernels import KernelOptions
from omnistage.layers.moe import MoEExperts, SiluMLP, SparseMoE, expert_param
from omnistage.layers.parallel import VocabParallelEmbedding, current_tp
from omnistage.models.layers import (
    Attention,
    RMSNorm,
    RotaryEmbedding,
    _rms_norm,
    apply_rope,
    attention_qkv,
    fuse_linears,
)


@dataclass(frozen=True)
class MoEDecoderConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool
    tie_word_embeddings: bool
    intermediate_size: int  # the dense layers' MLP width
    num_experts: int  # 0: every layer dense
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int | None  # the talker's sigmoid-gated shared expert
    sparse_layers: tuple[bool, ...]  # per layer: SparseMoE (True) or the dense SiLU MLP
    mrope_section: tuple[int, ...] | None = None  # 3-axis positions (t, h, w) when set
    mrope_interleaved: bool = False  # Qwen3's frequency layout (t h w t h w ...), else blocks
    rope_scaling: None = None  # only plain rope (RotaryEmbedding reads this field)

    @classmethod
    def from_hf(cls, cfg: dict, *, mrope_interleaved: bool | None = None) -> MoEDecoderConfig:
        """From a transformers text config dict (the thinker's `text_config`, the talker's
        `text_config`, or its `code_predictor_config`). mrope_interleaved: None reads the
        config's `mrope_interleaved` / `interleaved` flags; Qwen3-Omni's thinker and talker
        pass True (transformers interleaves their mrope whatever the flags say)."""
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"config.rope_parameters.rope_type: {rope_type!r} is not supported "
                             "(supported: default)")
        mrope = rope.get("mrope_section")
        if mrope_interleaved is None:
            mrope_interleaved = bool(rope.get("mrope_interleaved", rope.get("interleaved")))
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.hidden_act: {cfg.get('hidden_act')!r} is not supported")
        if cfg.get("use_sliding_window"):
            raise ValueError("config.use_sliding_window: sliding-window attention is not supported")
        other = sorted(set(cfg.get("layer_types") or ()) - {"full_attention"})
        if other:
            raise ValueError(f"config.layer_types: {other} are not supported (full_attention only)")
        layers = cfg["num_hidden_layers"]
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts")) or 0
        step = cfg.get("decoder_sparse_step", 1)
        if num_experts and (not isinstance(step, int) or step < 1):
            raise ValueError(f"config.decoder_sparse_step: {step!r}, expected an integer >= 1")
        dense_only = set(cfg.get("mlp_only_layers") or ())
        sparse = tuple(num_experts > 0 and i not in dense_only and (i + 1) % step == 0
                       for i in range(layers))
        if not all(sparse) and not cfg.get("intermediate_size"):
            raise ValueError("config.intermediate_size: needed by the dense MLP layers")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            attention_bias=cfg.get("attention_bias", False),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            intermediate_size=cfg.get("intermediate_size") or 0,
            num_experts=num_experts, num_experts_per_tok=cfg.get("num_experts_per_tok", 0),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
            norm_topk_prob=cfg.get("norm_topk_prob", False),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size"),
            sparse_layers=sparse, mrope_section=tuple(mrope) if mrope else None,
            mrope_interleaved=bool(mrope) and mrope_interleaved)


def interleaved_mrope_axis(mrope_section: tuple[int, ...], half: int) -> torch.Tensor:
    """[half] long: the position axis (0 t, 1 h, 2 w) of each rope frequency in Qwen3's
    interleaved layout: h on frequencies 1, 4, ... (mrope_section[1] of them), w on 2, 5, ...
    (mrope_section[2]), t on the rest."""
    j = torch.arange(half)
    axis = torch.zeros(half, dtype=torch.long)
    axis[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
    return axis


class MoERotaryEmbedding(RotaryEmbedding):
    """cos/sin [T, head_dim] (fp32) for positions [T] or [3, T]; interleaved mrope when the
    config says so, else RotaryEmbedding's blocked sections or 1-D rope."""

    def __init__(self, cfg: MoEDecoderConfig) -> None:
        super().__init__(cfg)
        if cfg.mrope_section and cfg.mrope_interleaved:
            self.mrope_axis = interleaved_mrope_axis(cfg.mrope_section, cfg.head_dim // 2)


# ------------------------------------------------------------------------- layer kernels
def qk_norm_attention_in(x, ln_w, eps: float, w_qkv, b_qkv, q_norm_w, k_norm_w, cos, sin,
                         num_heads: int, num_kv_heads: int, head_dim: int):
    """input norm -> fused q/k/v -> per-head RMSNorm of q and k -> rope.
    x: [T, D] -> q [T, H, hd], k/v [T, Hkv, hd]."""
    T = x.shape[0]
    qkv = attention_qkv(x, ln_w, eps, w_qkv, b_qkv)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    q = apply_rope(_rms_norm(q.reshape(T, num_heads, head_dim), q_norm_w, eps), cos, sin)
    k = apply_rope(_rms_norm(k.reshape(T, num_kv_heads, head_dim), k_norm_w, eps), cos, sin)
    return q, k, v.reshape(T, num_kv_heads, head_dim)


def attention_out_norm(x, o, wo, bo, ln_w, eps: float):
    """o_proj + residual -> (new residual [T, D], its post-attention norm [T, D])."""
    x = x + F.linear(o.reshape(o.shape[0], -1), wo, bo)
    return x, _rms_norm(x, ln_w, eps)


# NOTE: on CUDA (KernelOptions.compile) these run through torch.compile, which fuses the norms,
# rope and residuals around the GEMMs; the paged attention and the MoE experts stay outside.
KERNELS = {"in": qk_norm_attention_in, "out": attention_out_norm}


@functools.cache
def compiled_kernels() -> dict:
    """KERNELS through torch.compile (built once per process, on first use; CUDA)."""
    return {name: torch.compile(fn, dynamic=True) for name, fn in KERNELS.items()}


# ------------------------------------------------------------------------- modules
class MoEAttention(Attention):
    """q/k/v/o projections (o_proj biased as the others) and the per-head q/k norms; the
    engine binds k_cache/v_cache."""

    def __init__(self, cfg: MoEDecoderConfig) -> None:
        super().__init__(cfg, o_proj_bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)


class MoEDecoderLayer(nn.Module):
    def __init__(self, cfg: MoEDecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MoEAttention(cfg)
        d = cfg.hidden_size
        if cfg.sparse_layers[layer_idx]:
            self.mlp: nn.Module = SparseMoE(d, cfg.num_experts, cfg.num_experts_per_tok,
                                            cfg.moe_intermediate_size, cfg.norm_topk_prob,
                                            cfg.shared_expert_intermediate_size)
        else:
            self.mlp = SiluMLP(d, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.kernels = KernelOptions()  # the engine's runner sets its own (configure_kernels)
        self._w_qkv: torch.Tensor | None = None
        self._b_qkv: torch.Tensor | None = None

    def _fused_qkv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        # one q/k/v weight whose rows the three linears view (fused on first use, and again
        # when the parameters were replaced since, e.g. by Module.to)
        a = self.self_attn
        if self._w_qkv is None or a.q_proj.weight.data_ptr() != self._w_qkv.data_ptr():
            self._w_qkv, self._b_qkv = fuse_linears([a.q_proj, a.k_proj, a.v_proj])
        return self._w_qkv, self._b_qkv

    def _kernels(self) -> dict:
        return compiled_kernels() if self.kernels.compile else KERNELS

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] (the layer input), cos/sin [T, hd] -> q [T, H, hd], k and v [T, Hkv, hd]:
        input norm, projections, q/k norm and rope applied. No cache is touched."""
        a, ln = self.self_attn, self.input_layernorm
        w_qkv, b_qkv = self._fused_qkv()
        return self._kernels()["in"](x, ln.weight, ln.eps, w_qkv, b_qkv, a.q_norm.weight,
                                     a.k_norm.weight, cos, sin, a.num_heads, a.num_kv_heads,
                                     a.head_dim)

    def attn_out_mlp(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """x [T, D] (the layer input), o [T, H, hd] (attention output) -> the layer output:
        x + o_proj(o), then + mlp(post_attention_layernorm(.)). No cache is touched."""
        o_proj, post = self.self_attn.o_proj, self.post_attention_layernorm
        tp = self.self_attn.tp
        if tp.enabled:  # row-parallel o_proj, and the MLP's partial sum: both all-reduced
            attn = tp.all_reduce(F.linear(o.reshape(o.shape[0], -1), o_proj.weight))
            x = x + (attn if o_proj.bias is None else attn + o_proj.bias)
            return x + tp.all_reduce(self.mlp(_rms_norm(x, post.weight, post.eps)))
        x, h = self._kernels()["out"](x, o, o_proj.weight, o_proj.bias, post.weight, post.eps)
        return x + self.mlp(h)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """x [T, D] -> [T, D]; writes this step's K/V into the bound paged cache."""
        a = self.self_attn
        q, k, v = self.qkv(x, cos, sin)
        write_kv(k, v, a.k_cache, a.v_cache, batch.attn.slot_mapping)
        o = paged_attention(q, a.k_cache, a.v_cache, batch.attn, a.scale, pdl=self.kernels.pdl)
        return self.attn_out_mlp(x, o)


class MoEDecoderModel(nn.Module):
    """embed_tokens (unless embed_tokens=False: the talker and code predictor embed codec ids
    themselves) -> layers -> norm, with the rotary table in `rotary_emb`."""

    def __init__(self, cfg: MoEDecoderConfig, embed_tokens: bool = True) -> None:
        super().__init__()
        self.config = cfg
        tp = current_tp()
        table = VocabParallelEmbedding if tp.enabled else nn.Embedding
        extra = (tp,) if tp.enabled else ()
        self.embed_tokens = table(cfg.vocab_size, cfg.hidden_size, *extra) if embed_tokens \
            else None
        self.layers = nn.ModuleList(MoEDecoderLayer(cfg, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = MoERotaryEmbedding(cfg)

    def forward(self, x: torch.Tensor, batch: ForwardBatch,
                deepstack: list[torch.Tensor] | None = None, export_layer: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, D] input rows -> (final-normed hidden [T, D], exported [T, D] or None).

        deepstack: per early layer i, rows [T, D] added to layer i's output (zeros where the
        position is not visual), as transformers' `_deepstack_process`.
        export_layer: transformers' `hidden_states[export_layer]`: 0 = the input rows; i in
        1..L-1 = layer i-1's output BEFORE that layer's deepstack addition (transformers
        records the layer's output and adds the deepstack rows after); L = the normed output."""
        num_layers = len(self.layers)
        if export_layer is not None and not 0 <= export_layer <= num_layers:
            raise ValueError(f"export_layer: {export_layer}, expected 0..{num_layers}")
        if deepstack is not None and len(deepstack) > num_layers:
            raise ValueError(f"deepstack: {len(deepstack)} rows sets for {num_layers} layers")
        cos, sin = self.rotary_emb(batch.positions)
        exported = x if export_layer == 0 else None
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, batch)
            if export_layer == i + 1:
                exported = x
            if deepstack is not None and i < len(deepstack):
                x = x + deepstack[i].to(x.dtype)
        x = self.norm(x)
        return x, (x if export_layer == num_layers else exported)


# ------------------------------------------------------------------------- loading
def load_named_tensors(module: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                       skip: Callable[[str], bool] | None = None) -> None:
    """Copy checkpoint tensors into `module`'s parameters by name (after any prefix the caller
    stripped), as checkpoint.load_parameters. Per-expert names
    (`...experts.{e}.{gate,up,down}_proj.weight`) go through MoEExperts.load_expert; fused
    `experts.gate_up_proj`/`down_proj` load as plain parameters. skip(name) True: the tensor
    is not ours. ValueError on an unknown name, a wrong shape, or a parameter (or expert) the
    tensors left out."""
    load_parameters(module, tensors,
                    rename=None if skip is None else (lambda name: None if skip(name) else name),
                    load_special=_per_expert_loader(module))


def _per_expert_loader(module: nn.Module) -> Callable[[str, torch.Tensor], set[str] | None]:
    """load_parameters' hook for per-expert checkpoint matrices: each goes into its rows of
    the fused expert weights, which count as loaded once all 3 x num_experts matrices came."""
    modules = dict(module.named_modules())
    seen: dict[str, set[tuple[int, str]]] = {}

    def load(name: str, tensor: torch.Tensor) -> set[str] | None:
        per_expert = expert_param(name)
        if per_expert is None:
            return None
        path, expert, proj = per_expert
        experts = modules.get(path)
        if not isinstance(experts, MoEExperts):
            raise ValueError(f"checkpoint tensor {name!r} has no matching experts module")
        experts.load_expert(expert, proj, tensor)
        seen.setdefault(path, set()).add((expert, proj))
        if len(seen[path]) < 3 * experts.num_experts:
            return set()
        return {f"{path}.gate_up_proj", f"{path}.down_proj"}

    return load
