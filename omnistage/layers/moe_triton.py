"""Fused MoE experts on the GPU (Triton): fused_moe(x, w_gate_up, w_down, weights, ids) in three
kernels and a sum, for fp32 / bf16 / fp16 activations and bf16/fp16/fp32 or FP8 e4m3 weights.

  _align_kernel    token slots sorted by expert into BLOCK_M-row blocks (one program per expert)
  _gate_up_kernel  per block: x rows @ [gate | up].T of its expert -> SiLU(gate) * up   (h)
  _down_kernel     per block: h @ down.T of its expert, times the slot's routing weight  (y)
  y.view(T, k, D).sum(1)                                                                (out)

and fp8_linear, the dense weight-only FP8 GEMM of fp8.Fp8Linear (the same tiles, one expert).

NOTE (layout): a "slot" is one (token, choice) pair, slot = t * k + j, N = T * k of them. Each
expert's slots are laid out in slot order and padded to a multiple of BLOCK_M with the sentinel
N, so that every block of BLOCK_M rows belongs to one expert and a grouped GEMM is one grid
over (blocks, output tiles). The number of blocks is bounded by cdiv(N, BLOCK_M) + min(E, N)
(each non-empty expert wastes less than one block), so launch shapes depend only on T, k, E
and the config: no host sync, CUDA-graph capturable. Blocks past the used ones are marked with
expert -1 and exit at once. h is stored by sorted row, y by slot; the k contributions of a
token are summed in fp32 by torch's reduction (deterministic, no atomics), rounded once.

Rounding follows the torch path (moe.py): gate/up and down outputs are rounded to the dtype,
SiLU is rounded before the product with up, the routing-weight product is rounded. FP8 weights
(e4m3, weight-only) are converted exactly to the activation dtype inside the kernel and their
per-output-channel scale multiplies the fp32 accumulator (== a GEMM with fp8 * scale weights,
without rounding the dequantised weight). Under Triton's interpreter the dot operands are
upcast to fp32 (it gets bf16 dots wrong); tests use fp32 there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

_INTERPRET = triton.knobs.runtime.interpret  # Triton's own TRITON_INTERPRET
if _INTERPRET:
    _math = tl  # the interpreter implements tl.exp, not libdevice
else:
    from triton.language.extra import libdevice as _math  # precise expf, as torch's silu


@dataclass(frozen=True)
class MoEConfig:
    block_m: int  # slots per block (one expert's); tl.dot needs >= 16
    block_n_gate_up: int  # columns of gate (and of up) per program
    block_k_gate_up: int  # hidden (D) elements per loop step
    block_n_down: int  # output (D) columns per program
    block_k_down: int  # intermediate (F) elements per loop step
    num_warps: int = 4
    num_stages: int = 3


# Keyed by the largest token count T each config serves. Decode (T <= 64, k = 8) streams the
# chosen experts' weights once per call: small BLOCK_M, narrow N tiles so that the ~8 active
# experts still spread over all SMs, long K steps. Prefill: wider tiles reuse each weight tile
# over more rows. First guesses for H100 (E 128, D 2048, F 768), to be tuned by
# `benchmarks/moe_gpu.py --sweep`; benchmarks may edit this table.
CONFIGS: dict[int, MoEConfig] = {
    16: MoEConfig(16, 32, 256, 64, 128, num_warps=4, num_stages=4),
    64: MoEConfig(16, 64, 128, 64, 128, num_warps=4, num_stages=4),
    256: MoEConfig(32, 64, 128, 64, 128, num_warps=4, num_stages=3),
    1 << 62: MoEConfig(64, 128, 64, 128, 64, num_warps=8, num_stages=3),
}


def pick_config(num_tokens: int, dtype: torch.dtype = torch.bfloat16) -> MoEConfig:
    """The table's config for the smallest bucket that holds num_tokens; for fp32 (tests)
    shorter K steps and 2 stages, as fp32 tiles of the bf16 sizes overflow shared memory."""
    cfg = CONFIGS[min(bound for bound in CONFIGS if bound >= num_tokens)]
    if dtype != torch.float32:
        return cfg
    return replace(cfg, block_k_gate_up=min(cfg.block_k_gate_up, 64),
                               block_k_down=min(cfg.block_k_down, 64), num_stages=2)


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Upper bound of BLOCK_M blocks after padding each expert's slots (see the NOTE)."""
    return triton.cdiv(num_slots, block_m) + min(num_experts, num_slots)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, N, E, MAX_BLOCKS,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                  COUNT_CHUNK: tl.constexpr):
    # grid (E,): program e writes expert e's blocks; ids [N] (slot order) -> sorted_ptr
    # [MAX_BLOCKS * BLOCK_M] slot ids (sentinel N in padding), block_expert_ptr [MAX_BLOCKS]
    expert = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, N, COUNT_CHUNK):  # every expert's count: the ids are few, L2-resident
        offs = c0 + tl.arange(0, COUNT_CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < N, other=0).to(tl.int32)
        counts += tl.histogram(ids, E_PAD, mask=offs < N)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    first_block = tl.sum(tl.where(experts < expert, blocks, 0))
    num_blocks = tl.sum(tl.where(experts == expert, blocks, 0))
    count = tl.sum(tl.where(experts == expert, counts, 0))
    rows = sorted_ptr + first_block * BLOCK_M
    for b0 in range(0, num_blocks, CHUNK):
        offs = b0 + tl.arange(0, CHUNK)
        tl.store(block_expert_ptr + first_block + offs, tl.zeros([CHUNK], tl.int32) + expert,
                 mask=offs < num_blocks)
    pad = count + tl.arange(0, BLOCK_M)  # the padding of this expert's last block
    tl.store(rows + pad, tl.zeros([BLOCK_M], tl.int32) + N, mask=pad < num_blocks * BLOCK_M)
    rank = count * 0  # an int32 scalar, carried through the loop
    for c0 in range(0, N, CHUNK):  # this expert's slots, in slot order
        offs = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < N, other=-1)
        hit = (ids == expert).to(tl.int32)
        tl.store(rows + rank + tl.cumsum(hit, axis=0) - hit, offs, mask=hit > 0)
        rank += tl.sum(hit)
    if expert == E - 1:  # blocks past the used ones: expert -1 (their programs exit)
        used = tl.sum(blocks)
        for b0 in range(used, MAX_BLOCKS, CHUNK):
            offs = b0 + tl.arange(0, CHUNK)
            tl.store(block_expert_ptr + offs, tl.zeros([CHUNK], tl.int32) - 1,
                     mask=offs < MAX_BLOCKS)


@triton.jit
def _mac(acc, a, b, DOT_F32: tl.constexpr):
    # acc [BM, BN] fp32 += a [BM, BK] @ b [BK, BN]; b may be fp8 (exact in a's dtype)
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b.to(a.dtype), acc)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, scale_ptr, sorted_ptr, block_expert_ptr, h_ptr,
    N, F, D, TOP_K, stride_xm, stride_we, stride_wn, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, DOT_F32: tl.constexpr, EVEN_K: tl.constexpr,
):
    # grid (blocks, cdiv(F, BLOCK_N)): h[rows, cols] = silu(x @ gate.T) * (x @ up.T) of the
    # block's expert; w [E, 2F, D] (gate rows, then up rows)
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + rm)
    m_ok = slots < N
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < F
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + (slots // TOP_K).to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    gate_cols = w_expert + rn.to(tl.int64)[None, :] * stride_wn  # [1, BN]: W rows as columns
    up_cols = gate_cols + F * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        kk = k0 + rk
        x_mask = m_ok[:, None] if EVEN_K else m_ok[:, None] & (kk < D)[None, :]
        w_mask = n_ok[None, :] if EVEN_K else n_ok[None, :] & (kk < D)[:, None]
        xk = tl.load(x_rows + kk[None, :], mask=x_mask, other=0.0)
        w_gate = tl.load(gate_cols + kk[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(up_cols + kk[:, None], mask=w_mask, other=0.0)
        acc_gate = _mac(acc_gate, xk, w_gate, DOT_F32)
        acc_up = _mac(acc_up, xk, w_up, DOT_F32)
    if FP8:
        scales = scale_ptr + expert.to(tl.int64) * 2 * F + rn
        acc_gate *= tl.load(scales, mask=n_ok, other=0.0)[None, :]
        acc_up *= tl.load(scales + F, mask=n_ok, other=0.0)[None, :]
    ty = h_ptr.dtype.element_ty
    gate = acc_gate.to(ty).to(tl.float32)  # linear outputs rounded, silu rounded, then product
    up = acc_up.to(ty).to(tl.float32)
    h = (gate / (1.0 + _math.exp(-gate))).to(ty).to(tl.float32) * up
    # padded rows are stored too (zeros: their x rows loaded as 0), so h holds no garbage
    tl.store(h_ptr + rm.to(tl.int64)[:, None] * stride_hm + rn[None, :], h.to(ty),
             mask=n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, scale_ptr, sorted_ptr, block_expert_ptr, topk_w_ptr, y_ptr,
    N, D, F, stride_hm, stride_we, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, DOT_F32: tl.constexpr, EVEN_K: tl.constexpr,
):
    # grid (blocks, cdiv(D, BLOCK_N)): y[slot] = (h @ down.T) * routing weight of the slot;
    # w [E, D, F]
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + rm)
    m_ok = slots < N
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < D
    rk = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + rm.to(tl.int64)[:, None] * stride_hm
    w_cols = w_ptr + expert.to(tl.int64) * stride_we + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            hk = tl.load(h_rows + kk[None, :])
            w = tl.load(w_cols + kk[:, None], mask=n_ok[None, :], other=0.0)
        else:
            hk = tl.load(h_rows + kk[None, :], mask=(kk < F)[None, :], other=0.0)
            w = tl.load(w_cols + kk[:, None], mask=n_ok[None, :] & (kk < F)[:, None],
                        other=0.0)
        acc = _mac(acc, hk, w, DOT_F32)
    if FP8:
        acc *= tl.load(scale_ptr + expert.to(tl.int64) * D + rn, mask=n_ok, other=0.0)[None, :]
    ty = y_ptr.dtype.element_ty
    routing = tl.load(topk_w_ptr + slots, mask=m_ok, other=0.0).to(tl.float32)
    y = acc.to(ty).to(tl.float32) * routing[:, None]  # the linear's output rounded first
    tl.store(y_ptr + slots.to(tl.int64)[:, None] * stride_ym + rn[None, :], y.to(ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              scales: tuple[torch.Tensor, torch.Tensor] | None = None,
              config: MoEConfig | None = None) -> torch.Tensor:
    """x [T, D]; w_gate_up [E, 2F, D]; w_down [E, D, F]; topk_weights/ids [T, k] -> [T, D].

    Arguments as moe.fused_experts (which validates them); scales: fp32 [E, 2F] and [E, D] for
    float8_e4m3fn weights. config: block sizes (default: pick_config(T)). Returns a new tensor;
    allocates its buffers per call (graph-capturable: no host sync)."""
    if not (x.is_cuda or _INTERPRET):
        raise ValueError(f"x: on {x.device}; the Triton MoE needs CUDA tensors "
                         "(or Triton's interpreter)")
    num_tokens, hidden = x.shape
    num_experts, two_f, _ = w_gate_up.shape
    inter = two_f // 2
    top_k = topk_ids.shape[1]
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(x)
    cfg = config or pick_config(num_tokens, x.dtype)
    if cfg.block_m < 16:
        raise ValueError(f"config.block_m: {cfg.block_m}, expected >= 16 (tl.dot)")
    x = _last_dim_contiguous(x)
    w_gate_up, w_down = _last_dim_contiguous(w_gate_up), _last_dim_contiguous(w_down)
    ids = topk_ids.reshape(-1).contiguous()
    routing = topk_weights.reshape(-1).contiguous()
    blocks = max_blocks(num_slots, num_experts, cfg.block_m)
    device = x.device
    sorted_slots = torch.empty(blocks * cfg.block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    _align_kernel[(num_experts,)](
        ids, sorted_slots, block_expert, num_slots, num_experts, blocks,
        BLOCK_M=cfg.block_m, E_PAD=max(16, triton.next_power_of_2(num_experts)),
        CHUNK=64, COUNT_CHUNK=1024, num_warps=4)

    fp8 = scales is not None
    scale_gate_up, scale_down = scales if fp8 else (x, x)  # x: never read (FP8 off)
    dot_f32 = _INTERPRET or x.dtype == torch.float32
    h = torch.empty(blocks * cfg.block_m, inter, dtype=x.dtype, device=device)
    _gate_up_kernel[(blocks, triton.cdiv(inter, cfg.block_n_gate_up))](
        x, w_gate_up, scale_gate_up, sorted_slots, block_expert, h,
        num_slots, inter, hidden, top_k, x.stride(0), w_gate_up.stride(0),
        w_gate_up.stride(1), h.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_gate_up, BLOCK_K=cfg.block_k_gate_up,
        FP8=fp8, DOT_F32=dot_f32, EVEN_K=hidden % cfg.block_k_gate_up == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    y = torch.empty(num_slots, hidden, dtype=x.dtype, device=device)
    _down_kernel[(blocks, triton.cdiv(hidden, cfg.block_n_down))](
        h, w_down, scale_down, sorted_slots, block_expert, routing, y,
        num_slots, hidden, inter, h.stride(0), w_down.stride(0), w_down.stride(1), y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down, BLOCK_K=cfg.block_k_down,
        FP8=fp8, DOT_F32=dot_f32, EVEN_K=inter % cfg.block_k_down == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.view(num_tokens, top_k, hidden).sum(dim=1)


# --- the dense weight-only FP8 GEMM of fp8.Fp8Linear (the same tiles, one "expert") ---

@dataclass(frozen=True)
class LinearConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# keyed by the largest row count M each serves; decode rows stream W (narrow N, long K)
LINEAR_CONFIGS: dict[int, LinearConfig] = {
    16: LinearConfig(16, 32, 256, num_warps=4, num_stages=4),
    64: LinearConfig(32, 64, 128, num_warps=4, num_stages=4),
    256: LinearConfig(64, 128, 64, num_warps=4, num_stages=3),
    1 << 62: LinearConfig(128, 128, 64, num_warps=8, num_stages=3),
}


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, scale_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, EVEN_K: tl.constexpr,
):
    # grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)): out = (x @ w.T) * scale + b; w [N, K] fp8
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x_mask = m_ok[:, None] if EVEN_K else m_ok[:, None] & (kk < K)[None, :]
        w_mask = n_ok[None, :] if EVEN_K else n_ok[None, :] & (kk < K)[:, None]
        xk = tl.load(x_rows + kk[None, :], mask=x_mask, other=0.0)
        w = tl.load(w_cols + kk[:, None], mask=w_mask, other=0.0)
        acc = _mac(acc, xk, w, DOT_F32)
    acc *= tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
    ty = out_ptr.dtype.element_ty
    if HAS_BIAS:  # added in fp32 and rounded once, as addmm's epilogue
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], acc.to(ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None,
               config: LinearConfig | None = None) -> torch.Tensor:
    """x [M, K] (fp32/bf16/fp16) @ (weight [N, K] e4m3 * scale [N] fp32).T + bias [N]
    -> [M, N] in x.dtype (fp32 accumulation). Shapes are checked by fp8.Fp8Linear."""
    if not (x.is_cuda or _INTERPRET):
        raise ValueError(f"x: on {x.device}; the Triton FP8 GEMM needs CUDA tensors "
                         "(or Triton's interpreter)")
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    cfg = config or LINEAR_CONFIGS[min(b for b in LINEAR_CONFIGS if b >= rows)]
    if x.dtype == torch.float32:  # fp32 tiles of the bf16 sizes overflow shared memory
        cfg = replace(cfg, block_k=min(cfg.block_k, 64), num_stages=2)
    x, weight = _last_dim_contiguous(x), _last_dim_contiguous(weight)
    _fp8_linear_kernel[(triton.cdiv(rows, cfg.block_m), triton.cdiv(n, cfg.block_n))](
        x, weight, scale, bias if bias is not None else scale, out, rows, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        HAS_BIAS=bias is not None, DOT_F32=_INTERPRET or x.dtype == torch.float32,
        EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
