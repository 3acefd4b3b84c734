"""Sparse mixture-of-experts block (Qwen3-Omni thinker and talker): router, experts, and the
optional sigmoid-gated shared expert (Qwen2-MoE style, the talker's).

  select_experts  router logits -> top-k weights and expert ids (transformers' rule)
  fused_experts   SiLU(gate) * up -> down per chosen expert, weighted sum over the k experts
  MoEExperts      the experts' stacked weights, loaded per expert from checkpoint names
  SparseMoE       gate (router) + experts (+ shared_expert, shared_expert_gate)

Tensor parallelism (layers/parallel.py): each expert's intermediate size is split over the
ranks (TP of the experts, not expert parallelism: docs/distributed.md says why). A rank holds
every expert's gate/up rows and down columns of its slice; the router is whole on every rank;
the block's output is then this rank's partial sum, all-reduced by the decoder layer.

The torch path reproduces transformers' `Qwen3OmniMoe*TextExperts` arithmetic: each expert's
rows are linear outputs in the activation dtype, scaled by the routing weight, and added into a
zero output in ascending expert order (the same rounding, so fp32 and bf16 match it bitwise on
one device). The Triton path (`moe_triton.py`) sums the k contributions in fp32 instead.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.fp8 import FP8_DTYPE, quantize_fp8, quantize_linears, triton_installed
from omnistage.layers.parallel import (Shard, column_linear, current_tp, mark_shard,
                                       quantize_fp8_row_parallel, row_linear,
                                       split)

BACKENDS = ("auto", "torch", "triton")
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
_EXPERT_PARAM = re.compile(r"^((?:.*\.)?experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def select_experts(router_logits: Tensor, top_k: int, norm_topk_prob: bool
                   ) -> tuple[Tensor, Tensor]:
    """[T, E] logits -> (weights [T, k] in router_logits.dtype, ids [T, k] int64).

    Softmax in fp32, top-k, renormalised to sum 1 when norm_topk_prob, then cast (as
    transformers' Qwen3OmniMoe routers)."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits: shape {tuple(router_logits.shape)}, expected [T, E]")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k: {top_k}, expected 1..{router_logits.shape[1]} (the experts)")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def fused_experts(x: Tensor, w_gate_up: Tensor, w_down: Tensor, topk_weights: Tensor,
                  topk_ids: Tensor, backend: str = "auto",
                  scales: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Weighted sum over each token's k experts of down(SiLU(gate) * up) -> [T, D] in x.dtype.

    x [T, D]; w_gate_up [E, 2F, D] (gate rows first, then up); w_down [E, D, F];
    topk_weights [T, k] (any float dtype); topk_ids [T, k] (ids in [0, E); not checked on the
    triton path, which would read out of bounds).
    backend: "torch" | "triton" | "auto" (triton on CUDA when installed, else torch).
    scales: fp32 per-output-channel scales (gate_up [E, 2F], down [E, D]) for float8_e4m3fn
    weights (weight-only FP8: dequantised as fp8 * scale). Reads only; returns a new tensor."""
    _check_experts_args(x, w_gate_up, w_down, topk_weights, topk_ids, scales)
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r}, expected one of {BACKENDS}")
    if backend == "auto":
        backend = "triton" if x.is_cuda and triton_installed() else "torch"
    if backend == "triton":
        from omnistage.layers import moe_triton  # lazy: triton is optional on CPU

        return moe_triton.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, scales)
    return _fused_experts_torch(x, w_gate_up, w_down, topk_weights, topk_ids, scales)


def _check_experts_args(x: Tensor, w_gate_up: Tensor, w_down: Tensor, topk_weights: Tensor,
                        topk_ids: Tensor, scales: tuple[Tensor, Tensor] | None) -> None:
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)}, w_down "
                         f"{tuple(w_down.shape)}: expected [T, D], [E, 2F, D], [E, D, F]")
    num_tokens, hidden = x.shape
    num_experts, two_f, _ = w_gate_up.shape
    expect_down = (num_experts, hidden, two_f // 2)
    if w_gate_up.shape[2] != hidden or two_f % 2 or tuple(w_down.shape) != expect_down:
        raise ValueError(f"w_gate_up {tuple(w_gate_up.shape)}, w_down {tuple(w_down.shape)}: "
                         f"expected [E, 2F, {hidden}] and {list(expect_down)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_ids.dtype not in (
            torch.int32, torch.int64):
        raise ValueError(f"topk_ids: {tuple(topk_ids.shape)} {topk_ids.dtype}, "
                         f"expected [{num_tokens}, k] int32/int64")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights: {tuple(topk_weights.shape)}, expected "
                         f"{tuple(topk_ids.shape)} (as topk_ids)")
    if not x.dtype.is_floating_point or x.dtype == FP8_DTYPE:
        raise ValueError(f"x: dtype {x.dtype}, expected fp32/bf16/fp16")
    if scales is None:
        if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
            raise ValueError(f"w_gate_up {w_gate_up.dtype}, w_down {w_down.dtype}: expected "
                             f"x's dtype {x.dtype} (or {FP8_DTYPE} with scales)")
        return
    if w_gate_up.dtype != FP8_DTYPE or w_down.dtype != FP8_DTYPE:
        raise ValueError(f"scales given but w_gate_up {w_gate_up.dtype}, w_down "
                         f"{w_down.dtype}: expected {FP8_DTYPE}")
    scale_gate_up, scale_down = scales
    for name, scale, shape in (("scales[0]", scale_gate_up, w_gate_up.shape[:2]),
                               ("scales[1]", scale_down, w_down.shape[:2])):
        if tuple(scale.shape) != tuple(shape) or scale.dtype != torch.float32:
            raise ValueError(f"{name}: {tuple(scale.shape)} {scale.dtype}, expected "
                             f"{list(shape)} float32")


def _expert_weight(w: Tensor, scale: Tensor | None, expert: int, dtype: torch.dtype) -> Tensor:
    if scale is None:
        return w[expert]
    return (w[expert].float() * scale[expert][:, None]).to(dtype)


def _fused_experts_torch(x: Tensor, w_gate_up: Tensor, w_down: Tensor, topk_weights: Tensor,
                         topk_ids: Tensor, scales: tuple[Tensor, Tensor] | None) -> Tensor:
    # NOTE: visits experts in ascending order and each expert's rows in (slot, token) order,
    # as transformers does, so that every matmul and every index_add_ sees the same rows.
    num_tokens = x.shape[0]
    num_experts = w_gate_up.shape[0]
    scale_gate_up, scale_down = scales if scales is not None else (None, None)
    out = torch.zeros_like(x)
    flat_ids = topk_ids.t().reshape(-1)  # slot-major: index = slot * T + token
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()  # one host sync
    if len(counts) > num_experts or (flat_ids.numel() and int(flat_ids.min()) < 0):
        raise ValueError(f"topk_ids: ids outside [0, {num_experts}) (the experts)")
    tokens, slots = order % num_tokens, order // num_tokens
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        token, slot = tokens[start:start + count], slots[start:start + count]
        start += count
        gate, up = F.linear(x[token], _expert_weight(w_gate_up, scale_gate_up, expert, x.dtype)
                            ).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, _expert_weight(w_down, scale_down, expert, x.dtype))
        out.index_add_(0, token, (y * topk_weights[token, slot, None]).to(out.dtype))
    return out


class MoEExperts(nn.Module):
    """All experts' weights stacked: gate_up_proj [E, 2F, D] (gate rows, then up), down_proj
    [E, D, F]; under tensor parallelism F is this rank's slice of `full_intermediate_size`
    (its block of each expert's rows: checkpoint matrices are cut on load). After quantize_fp8
    they are float8_e4m3fn with fp32 per-row scale buffers
    gate_up_scale [E, 2F], down_scale [E, D]: move/cast the module before quantising, as
    Module.to(dtype) would cast the fp8 weights and their scales."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        for name, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                            ("intermediate_size", intermediate_size)):
            if value < 1:
                raise ValueError(f"{name}: {value}, expected >= 1")
        tp = current_tp()
        start, local = split(intermediate_size, tp, "moe_intermediate_size")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.full_intermediate_size = intermediate_size
        self.intermediate_size = local
        self.shard_start = start  # this rank's first row of each expert's intermediate
        self.tp = tp  # (quantize_fp8: the row-parallel down_proj takes its whole rows' scales)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, local))
        if tp.enabled:  # fused checkpoint tensors: the gate half's block, then the up half's
            full = intermediate_size
            mark_shard(self.gate_up_proj, 1, [(start, local), (full + start, local)],
                       (num_experts, 2 * full, hidden_size))
            mark_shard(self.down_proj, 2, [(start, local)], (num_experts, hidden_size, full))
        self.register_buffer("gate_up_scale", None)
        self.register_buffer("down_scale", None)

    @property
    def is_fp8(self) -> bool:
        return self.gate_up_scale is not None

    @property
    def scales(self) -> tuple[Tensor, Tensor] | None:
        return (self.gate_up_scale, self.down_scale) if self.is_fp8 else None

    def _target(self, proj: str) -> tuple[Tensor, Tensor | None, slice]:
        # (weights, scales, rows of one expert's matrix that `proj` fills)
        inter = self.intermediate_size
        if proj == "gate_proj":
            return self.gate_up_proj, self.gate_up_scale, slice(0, inter)
        if proj == "up_proj":
            return self.gate_up_proj, self.gate_up_scale, slice(inter, 2 * inter)
        if proj == "down_proj":
            return self.down_proj, self.down_scale, slice(0, self.hidden_size)
        raise ValueError(f"proj: {proj!r}, expected one of {EXPERT_PROJS}")

    @torch.no_grad()
    def load_expert(self, expert: int, proj: str, tensor: Tensor) -> None:
        """Copy one checkpoint matrix (`experts.{expert}.{proj}.weight`, [F, D] for gate/up,
        [D, F] for down) into its rows; quantised on the fly once the module is FP8."""
        weights, scales, rows = self._target(proj)
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert: {expert}, expected 0..{self.num_experts - 1}")
        if self.intermediate_size != self.full_intermediate_size or not isinstance(
                tensor, torch.Tensor):  # tensor parallel, or a lazy checkpoint tensor
            tensor = self._expert_slice(proj, tensor)
        expect = (rows.stop - rows.start, weights.shape[2])
        if tuple(tensor.shape) != expect:
            raise ValueError(f"{proj} of expert {expert}: shape {tuple(tensor.shape)}, "
                             f"expected {list(expect)}")
        tensor = tensor.to(weights.device)
        if scales is None:
            weights[expert, rows].copy_(tensor)
            return
        quantized, scale = quantize_fp8(tensor)
        weights[expert, rows].copy_(quantized)
        scales[expert, rows].copy_(scale)

    def _expert_slice(self, proj: str, tensor) -> Tensor:
        # this rank's block of one whole checkpoint matrix ([F, D] gate/up, [D, F] down)
        full, d = self.full_intermediate_size, self.hidden_size
        if proj == "down_proj":
            shard = Shard(1, [(self.shard_start, self.intermediate_size)], (d, full))
        else:
            shard = Shard(0, [(self.shard_start, self.intermediate_size)], (full, d))
        try:
            return shard.take(tensor)
        except ValueError as e:
            raise ValueError(f"{proj}: {e}") from e

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """Weights -> float8_e4m3fn with per-row fp32 scales (buffers), one expert at a time
        (bounded temporary memory). Idempotent."""
        if self.is_fp8:
            return
        for name in ("gate_up_proj", "down_proj"):
            weights = getattr(self, name)
            quantized = torch.empty(weights.shape, dtype=FP8_DTYPE, device=weights.device)
            scale = torch.empty(weights.shape[:2], dtype=torch.float32, device=weights.device)
            row_parallel = name == "down_proj" and self.tp.enabled  # (collective, then)
            for expert in range(self.num_experts):
                quantized[expert], scale[expert] = (
                    quantize_fp8_row_parallel(weights[expert], self.tp) if row_parallel
                    else quantize_fp8(weights[expert]))
            setattr(self, name, nn.Parameter(quantized, requires_grad=False))
            setattr(self, name.replace("_proj", "_scale"), scale)

    def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                backend: str = "auto") -> Tensor:
        """x [T, D], topk_weights/ids [T, k] -> [T, D] (see fused_experts)."""
        return fused_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                             backend, self.scales)


class SiluMLP(nn.Module):
    """down(SiLU(gate(x)) * up(x)), no biases (checkpoint names gate_proj/up_proj/down_proj):
    the shared expert, and the dense layers' MLP of layers/moe_decoder.py. Under tensor
    parallelism gate/up are column- and down row-parallel: forward() is a partial sum."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        tp = current_tp()
        if not tp.enabled:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
            self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
            self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
            return
        start, n = split(intermediate_size, tp, "intermediate_size")
        self.gate_proj = column_linear(hidden_size, intermediate_size, [(start, n)], False)
        self.up_proj = column_linear(hidden_size, intermediate_size, [(start, n)], False)
        self.down_proj = row_linear(intermediate_size, hidden_size, start, n, False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Router (`gate`, weight [E, D]) + `experts`; with shared_expert_intermediate_size, plus
    sigmoid(shared_expert_gate(x)) * shared_expert(x) (the talker's block).

    `backend` ("auto" | "torch" | "triton") picks the experts' implementation per call."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 norm_topk_prob: bool, shared_expert_intermediate_size: int | None = None
                 ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k: {top_k}, expected 1..{num_experts} (num_experts)")
        if shared_expert_intermediate_size is not None and shared_expert_intermediate_size < 1:
            raise ValueError(f"shared_expert_intermediate_size: "
                             f"{shared_expert_intermediate_size}, expected >= 1 or None")
        self.hidden_size = hidden_size
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.backend = "auto"
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = MoEExperts(num_experts, hidden_size, intermediate_size)
        self.shared_expert: SiluMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_expert_intermediate_size is not None:
            self.shared_expert = SiluMLP(hidden_size, shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def quantize_fp8(self) -> None:
        """Weight-only FP8 for the experts and the shared expert's linears; the router and
        shared_expert_gate stay in their dtype (routing decisions are sensitive to them)."""
        self.experts.quantize_fp8()
        if self.shared_expert is not None:
            quantize_linears(self.shared_expert)

    def forward(self, x: Tensor) -> Tensor:
        """x [T, D] (or [..., D]) -> the same shape and dtype."""
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: shape {tuple(x.shape)}, expected [..., {self.hidden_size}]")
        flat = x.reshape(-1, self.hidden_size)
        weights, ids = select_experts(self.gate(flat), self.top_k, self.norm_topk_prob)
        out = self.experts(flat, weights, ids, self.backend)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(flat))
            out = out + gate * self.shared_expert(flat)
        return out.reshape(x.shape)


def expert_param(name: str) -> tuple[str, int, str] | None:
    """'...mlp.experts.7.up_proj.weight' -> ('...mlp.experts', 7, 'up_proj'); else None."""
    match = _EXPERT_PARAM.match(name)
    if match is None:
        return None
    return match.group(1), int(match.group(2)), match.group(3)
