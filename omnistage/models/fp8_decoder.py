"""Weight-only FP8 for the dense decoder layers of models/layers.py (Qwen2, Llama, Qwen2.5-Omni's
thinker): the fused q/k/v, o, fused gate/up and down projections, and an untied LM head, stored
as float8 e4m3 with per-output-row fp32 scales (layers/fp8.py). Activations, norms, the KV cache
and attention stay in the model dtype.

  quantize_decoder(model)  in place, after loading and casting; frees the 16-bit weights
  fp8_layer_forward        DecoderLayer.forward for a quantised layer

Decode rows (up to triton_gemv.MAX_ROWS) take the Triton GEMVs with the row scales applied in
their epilogue: the weight stream, which bounds a decode step, is half of bf16's. Longer rows
(prefill) take the Triton W8A16 GEMM (layers/moe_triton.fp8_linear). Without CUDA (tests) the
weights are dequantised per call: the same numbers as a bf16 model on the dequantised weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from omnistage.engine.ar.attention import _triton_ok, paged_attention, write_kv
from omnistage.engine.ar.interface import ForwardBatch
from omnistage.layers.fp8 import Fp8Linear, dequantize_fp8, quantize_fp8
from omnistage.layers.parallel import quantize_fp8_row_parallel
from omnistage.models.layers import DecoderLayer, _rms_norm, apply_rope


@dataclass
class Fp8LayerWeights:
    """One decoder layer's projections: e4m3 [N, K] with fp32 row scales [N], biases as they
    were (the model dtype)."""

    w_qkv: torch.Tensor
    s_qkv: torch.Tensor
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    s_o: torch.Tensor
    w_gate_up: torch.Tensor
    s_gate_up: torch.Tensor
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor
    s_down: torch.Tensor
    b_down: torch.Tensor | None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if t is not None)


def _quantize_layer(layer: DecoderLayer) -> Fp8LayerWeights:
    if not hasattr(layer, "w_qkv"):
        layer.fuse()
    a, m = layer.self_attn, layer.mlp
    w_qkv, s_qkv = quantize_fp8(layer.w_qkv)
    # tensor parallel: o and down are row-parallel, scaled by their whole rows (collective)
    row = (lambda w: quantize_fp8_row_parallel(w, a.tp)) if a.tp.enabled else quantize_fp8
    w_o, s_o = row(a.o_proj.weight)
    w_gate_up, s_gate_up = quantize_fp8(layer.w_gate_up)
    w_down, s_down = row(m.down_proj.weight)
    q = Fp8LayerWeights(w_qkv, s_qkv, layer.b_qkv, w_o, s_o, w_gate_up, s_gate_up,
                        layer.b_gate_up, w_down, s_down, m.down_proj.bias)
    # the 16-bit projections go (the q/k/v and gate/up linears are views of the fused ones)
    for attr in ("q_proj", "k_proj", "v_proj", "o_proj"):
        delattr(a, attr)
    for attr in ("gate_proj", "up_proj", "down_proj"):
        delattr(m, attr)
    del layer.w_qkv, layer.w_gate_up, layer.b_qkv, layer.b_gate_up
    return q


@torch.no_grad()
def quantize_decoder(model: nn.Module, lm_head: bool = True) -> int:
    """Every DecoderLayer under `model` (and its `lm_head` when untied and `lm_head`) to FP8, in
    place, layer by layer so the device holds one layer's fp32 staging at a time. Returns the
    bytes of the quantised weights. Call after load_weights and the cast to the model dtype."""
    total = 0
    for layer in model.modules():
        if isinstance(layer, DecoderLayer) and layer.fp8 is None:
            layer.fp8 = _quantize_layer(layer)
            total += layer.fp8.nbytes()
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    tied = head is not None and embed is not None and head.weight is embed.weight
    if lm_head and isinstance(head, nn.Linear) and not tied:
        model.lm_head = Fp8Linear.from_linear(head)
        total += model.lm_head.weight.numel() + model.lm_head.weight_scale.numel() * 4
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the freed 16-bit weights go back to the device
    return total


def _linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
            b: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] @ (w * scale).T + b in x's dtype."""
    if x.is_cuda and _triton_ok(x.device):
        from omnistage.layers import moe_triton  # triton: lazily
        return moe_triton.fp8_linear(x, w, scale, b)
    return nn.functional.linear(x, dequantize_fp8(w, scale, x.dtype), b)


def _uses_gemv(layer: DecoderLayer, x: torch.Tensor) -> bool:
    from omnistage.engine.ar.triton_gemv import MAX_ROWS  # triton: lazily
    if layer.self_attn.tp.enabled:  # (the GEMVs' fused residuals cannot all-reduce)
        return False
    return x.shape[0] <= MAX_ROWS and layer.uses_fused_rope_kv(x.device) \
        and layer.kernels.triton_gemv is not False and _triton_ok(x.device)


def fp8_layer_forward(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """DecoderLayer.forward on the layer's Fp8LayerWeights (same rounding points as the 16-bit
    path: the norm, each linear's output and the SiLU are rounded to the dtype)."""
    q8, a, opts = layer.fp8, layer.self_attn, layer.kernels
    ln, post = layer.input_layernorm, layer.post_attention_layernorm
    if _uses_gemv(layer, x):  # decode rows: the weight stream at 1 byte per weight
        from omnistage.engine.ar import triton_gemv as tg  # triton: lazily
        from omnistage.engine.ar.triton_rope_kv import rope_write_kv
        launch = dict(pdl=opts.pdl, fused_reduce=opts.gemv_fused_reduce)
        qkv = tg.norm_gemv(x, ln.weight, ln.eps, q8.w_qkv, q8.b_qkv, scale=q8.s_qkv, **launch)
        q = rope_write_kv(qkv, cos, sin, a.k_cache, a.v_cache, batch.attn.slot_mapping,
                          a.num_heads, a.num_kv_heads, a.head_dim, pdl=opts.pdl)
        o = paged_attention(q, a.k_cache, a.v_cache, batch.attn, a.scale, pdl=opts.pdl)
        x = tg.gemv_residual(o.reshape(o.shape[0], -1), q8.w_o, x, scale=q8.s_o, **launch)
        h = tg.norm_gemv_silu_mul(x, post.weight, post.eps, q8.w_gate_up, q8.b_gate_up,
                                  scale=q8.s_gate_up, **launch)
        return tg.gemv_residual(h, q8.w_down, x, q8.b_down, scale=q8.s_down, **launch)
    T = x.shape[0]
    qkv = _linear(_rms_norm(x, ln.weight, ln.eps), q8.w_qkv, q8.s_qkv, q8.b_qkv)
    hq, hkv, hd = a.num_heads, a.num_kv_heads, a.head_dim
    if layer.uses_fused_rope_kv(x.device):
        from omnistage.engine.ar.triton_rope_kv import rope_write_kv  # triton: lazily
        q = rope_write_kv(qkv, cos, sin, a.k_cache, a.v_cache, batch.attn.slot_mapping,
                          hq, hkv, hd, pdl=opts.pdl)
    else:
        q, k, v = qkv.split([hq * hd, hkv * hd, hkv * hd], dim=-1)
        q = apply_rope(q.reshape(T, hq, hd), cos, sin)
        k = apply_rope(k.reshape(T, hkv, hd), cos, sin)
        write_kv(k, v.reshape(T, hkv, hd), a.k_cache, a.v_cache, batch.attn.slot_mapping)
    o = paged_attention(q, a.k_cache, a.v_cache, batch.attn, a.scale, pdl=opts.pdl)
    x = x + a.tp.all_reduce(_linear(o.reshape(T, -1), q8.w_o, q8.s_o, None))
    gate, up = _linear(_rms_norm(x, post.weight, post.eps), q8.w_gate_up, q8.s_gate_up,
                       q8.b_gate_up).chunk(2, dim=-1)
    if a.tp.enabled:  # row-parallel down: the partial sums all-reduced, then the whole bias
        down = a.tp.all_reduce(_linear(nn.functional.silu(gate) * up, q8.w_down, q8.s_down,
                                       None))
        return x + down if q8.b_down is None else x + down + q8.b_down
    return x + _linear(nn.functional.silu(gate) * up, q8.w_down, q8.s_down, q8.b_down)
