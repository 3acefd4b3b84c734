"""Decode GEMVs for small batches (up to 16 rows): a decoder layer's dense parts in 4 launches.

  norm_gemv          rmsnorm(x) @ W.T + b                  (input norm -> fused q/k/v)
  norm_gemv_silu_mul silu(gate) * up of rmsnorm(x) @ W.T   (post norm -> fused gate/up -> SiLU)
  gemv_residual      residual + x @ W.T + b                (o_proj / down_proj + residual)

NOTE: at decode batch sizes a linear layer is a weight stream: W [N, K] is read once per step
and each element feeds only M FMAs. Each program owns BLOCK_N rows of W and all M rows of x,
streams [BLOCK_N, BLOCK_K] tiles of W along K (16-byte loads, up to 1 KB of each row per
step; evict-first, as W is not read again this step) and keeps fp32 accumulators [M, BLOCK_N].
The products are either tl.dot (M padded to 16, tensor cores) or broadcast FMAs reduced along
K (no padding: the better choice at M = 1). A norm is recomputed
by every program from x (M x K elements, L2-resident) instead of costing a launch. When too few
programs cover the GPU (N / BLOCK_N small, K large: the down projection), K is split: each
split stores fp32 partials and counts its arrival on its N tile (an atomic add), and the last
one to arrive sums the partials in split order (deterministic) and runs the epilogue, so no
second launch is needed (fused_reduce; else a reduce launch does it, the same sums). Launch
shapes depend only on tensor shapes: CUDA-graph capturable.

Rounding follows the torch expressions in models/layers.py: the norm casts to the dtype before
the product with its weight (product rounded to the dtype), a linear's output is rounded to
the dtype before the residual add, and gate/up are rounded before the SiLU and the product.
Arithmetic is done in fp32 on values cast from the dtype (NOTE: Triton's interpreter gets
bf16 arithmetic and bf16 tl.dot wrong, and truncates fp32 -> bf16 casts, so under it the dot
operands are upcast; the tests account for the truncation).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from omnistage.engine.ar.triton_pdl import pdl_flags, pdl_kwargs, pdl_wait
from omnistage.engine.kernels_ahead import CompileOnly, TensorSpec, empty_on, launch

_INTERPRET = triton.knobs.runtime.interpret  # Triton's own TRITON_INTERPRET
if _INTERPRET:
    _math = tl  # the interpreter implements tl.exp, not libdevice
else:
    from triton.language.extra import libdevice as _math  # precise expf, as torch's silu

MAX_ROWS = 16  # x rows one launch takes (designed for decode batches <= 8)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # rows of W per program (per half for gate/up)
    block_k: int  # K elements per loop step
    split_k: int = 1  # K ranges, summed by a second launch
    use_dot: bool = False  # tl.dot with M padded to 16, else FMAs + a reduction along K
    num_warps: int = 4
    num_stages: int = 3


# Explicit choices for Qwen2.5-Omni's bf16 shapes, (W rows N, K) -> (M = 1 config, 2 <= M
# config). M = 1: the winners of `benchmarks/gemv_gpu.py --sections sweep --sweep-ms 1`
# (measured: benchmarks/results/gemv_gpu_h100_2026-11-22.json); 2 <= M (tl.dot, M padded to
# 16): first guesses, slower than cuBLAS (layers.py takes this path at M = 1 only).
_C = GemvConfig
_TABLE = {
    # talker: d 896, 12 heads, 4 KV heads, ffn 18944
    (2560, 896): (_C(8, 1024), _C(16, 512, use_dot=True)),
    (896, 1536): (_C(8, 1024, num_warps=2, num_stages=2), _C(16, 512, 3, use_dot=True)),
    (37888, 896): (_C(8, 1024, num_warps=2, num_stages=2), _C(16, 256, use_dot=True)),
    (896, 18944): (_C(8, 512, 8, num_stages=2), _C(16, 512, 5, use_dot=True)),
    # thinker: d 3584, 28 heads, 4 KV heads, ffn 18944
    (4608, 3584): (_C(8, 1024), _C(16, 512, use_dot=True)),
    (3584, 3584): (_C(8, 512, 2, num_warps=2), _C(16, 512, 2, use_dot=True)),
    (37888, 3584): (_C(8, 1024, num_stages=4), _C(16, 256, use_dot=True)),
    (3584, 18944): (_C(8, 1024, 2), _C(16, 512, 2, use_dot=True)),
}
# keyed (N, K, M bucket: 1, or 8 for 2 <= M <= MAX_ROWS); benchmarks may edit it
CONFIGS: dict[tuple[int, int, int], GemvConfig] = {
    (n, k, mb): cfg for (n, k), pair in _TABLE.items() for mb, cfg in zip((1, 8), pair)}
_STAGE_BYTES = 32 * 1024


def _heuristic(n_rows: int, k: int, m_bucket: int, elem: int, silu: bool, norm: bool,
               sms: int) -> GemvConfig:
    use_dot = m_bucket > 1
    block_n = 16
    tile_rows = block_n * (2 if silu else 1) + (16 if use_dot else 0)  # per stage
    block_k = 1024 // elem  # 1 KB of a row per step
    while block_k > 64 and tile_rows * block_k * elem > _STAGE_BYTES:
        block_k //= 2
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    n_prog = triton.cdiv(n_rows // (2 if silu else 1), block_n)
    split = 1
    if not norm and n_prog < 2 * sms:
        split = max(1, min(triton.cdiv(2 * sms, n_prog), triton.cdiv(k, block_k)))
    return GemvConfig(block_n, block_k, split, use_dot=use_dot)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_config(n_rows: int, k: int, m: int, dtype: torch.dtype, silu: bool, norm: bool,
                device: torch.device) -> GemvConfig:
    """The table's entry for bf16/fp16 (N, K, M bucket), else the heuristic."""
    return choose_config(n_rows, k, m, dtype, silu, norm, _num_sms(device))


def choose_config(n_rows: int, k: int, m: int, dtype: torch.dtype, silu: bool, norm: bool,
                  sms: int) -> GemvConfig:
    """pick_config on a GPU of `sms` SMs (compile_ahead: read by its lister)."""
    bucket = 1 if m == 1 else 8
    elem = torch.finfo(dtype).bits // 8
    if elem == 2 and (n_rows, k, bucket) in CONFIGS:
        return CONFIGS[(n_rows, k, bucket)]
    return _heuristic(n_rows, k, bucket, elem, silu, norm, sms)


def has_configs(shapes: list[tuple[int, int]], dtype: torch.dtype) -> bool:
    """Whether every weight [N, K] of `shapes` has a measured 1-row config in `dtype` (what
    DecoderLayer.gemv_tuned asks of a layer's four weights)."""
    return dtype in (torch.bfloat16, torch.float16) and all(
        (n, k, 1) in CONFIGS for n, k in shapes)


@triton.jit
def _mac(acc, xk, w, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr):
    # acc [M_PAD, BLOCK_N] fp32 += xk [M_PAD, BLOCK_K] @ w [BLOCK_N, BLOCK_K].T
    if USE_DOT:
        if DOT_F32:
            return tl.dot(xk.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                          input_precision="ieee")
        return tl.dot(xk, tl.trans(w.to(xk.dtype)), acc)  # fp8 W: upcast to x's dtype
    prod = w.to(tl.float32)[None, :, :] * xk.to(tl.float32)[:, None, :]
    return acc + tl.sum(prod, axis=2)


@triton.jit
def _epilogue(acc, acc_up, rm, rn, M, N, b_ptr, res_ptr, out_ptr, scale_ptr, stride_rm,
              stride_om, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, HAS_RES: tl.constexpr,
              HAS_SCALE: tl.constexpr):
    # acc/acc_up: [M_PAD, BLOCK_N] fp32 sums of rows rm, columns rn -> out (dtype)
    ty = out_ptr.dtype.element_ty
    n_ok = rn < N
    mask = (rm < M)[:, None] & n_ok[None, :]
    if HAS_SCALE:  # fp8 W: its per-row scale applies to the whole sum (before the bias)
        acc *= tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
        if SILU_MUL:
            acc_up *= tl.load(scale_ptr + N + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc_up += tl.load(b_ptr + N + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:  # gate and up rounded as a dtype linear's output, silu rounded, then the product
        g = acc.to(ty).to(tl.float32)
        u = acc_up.to(ty).to(tl.float32)
        y = (g / (1.0 + _math.exp(-g))).to(ty).to(tl.float32) * u
    elif HAS_RES:
        res = tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :], mask=mask, other=0.0)
        y = res.to(tl.float32) + acc.to(ty).to(tl.float32)
    else:
        y = acc
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], y.to(ty), mask=mask)


@triton.jit
def _w_tile(w_rows, up_rows, kk, K, n_ok, EVEN_K: tl.constexpr, SILU_MUL: tl.constexpr):
    # one [BLOCK_N, BLOCK_K] tile of W at columns kk (and of its up half); evict-first: W is
    # not read again this step
    w_mask = n_ok[:, None] if EVEN_K else n_ok[:, None] & (kk < K)[None, :]
    w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
    w_up = w
    if SILU_MUL:
        w_up = tl.load(up_rows + kk[None, :], mask=w_mask, other=0.0,
                       eviction_policy="evict_first")
    return w, w_up


@triton.jit
def _tile_mac(acc, acc_up, w, w_up, x_rows, ln_ptr, rstd, kk, K, m_ok,
              HAS_NORM: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
              USE_DOT: tl.constexpr, DOT_F32: tl.constexpr):
    # acc (and acc_up) += x[:, kk] (normed) @ the W tile(s).T
    x_mask = m_ok[:, None] if EVEN_K else m_ok[:, None] & (kk < K)[None, :]
    xk = tl.load(x_rows + kk[None, :], mask=x_mask, other=0.0, eviction_policy="evict_last")
    if HAS_NORM:  # (x * rstd).to(dtype), then * ln_w rounded to the dtype
        ty = x_rows.dtype.element_ty
        lw = tl.load(ln_ptr + kk, mask=kk < K, other=0.0, eviction_policy="evict_last")
        xn = (xk.to(tl.float32) * rstd[:, None]).to(ty).to(tl.float32)
        xk = (xn * lw.to(tl.float32)[None, :]).to(ty)
    acc = _mac(acc, xk, w, USE_DOT, DOT_F32)
    if SILU_MUL:
        acc_up = _mac(acc_up, xk, w_up, USE_DOT, DOT_F32)
    return acc, acc_up


@triton.jit
def _gemv_kernel(
    x_ptr, ln_ptr, w_ptr, b_ptr, res_ptr, out_ptr, part_ptr, count_ptr, scale_ptr,
    M, N, K, K_SPLIT, eps, stride_xm, stride_wn, stride_rm, stride_om,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_K: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, SPLITS: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    EVEN_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # grid (cdiv(N, BLOCK_N), splits); N = output columns (F for gate/up: up rows start at F)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, M_PAD)
    m_ok = rm < M
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm  # [M_PAD, 1]
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    up_rows = w_ptr + (rn[:, None] + N).to(tl.int64) * stride_wn  # gate/up: the up half
    k_lo = pid_k * K_SPLIT  # < K: every split has at least one tile
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    # the first W tile does not depend on the previous kernel: loaded before waiting for it
    w, w_up = _w_tile(w_rows, up_rows, k_lo + rk, K, n_ok, EVEN_K, SILU_MUL)
    pdl_wait(PDL)

    rstd = tl.zeros([M_PAD], dtype=tl.float32)
    if HAS_NORM:  # this row's sum of squares over all of K (x is small and L2-resident)
        ss = tl.zeros([M_PAD], dtype=tl.float32)
        for k0 in range(0, K, NORM_K):
            kn = k0 + tl.arange(0, NORM_K)
            xs = tl.load(x_rows + kn[None, :], mask=m_ok[:, None] & (kn < K)[None, :],
                         other=0.0, eviction_policy="evict_last").to(tl.float32)
            ss += tl.sum(xs * xs, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)

    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    acc, acc_up = _tile_mac(acc, acc_up, w, w_up, x_rows, ln_ptr, rstd, k_lo + rk, K, m_ok,
                            HAS_NORM, SILU_MUL, EVEN_K, USE_DOT, DOT_F32)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        w, w_up = _w_tile(w_rows, up_rows, k0 + rk, K, n_ok, EVEN_K, SILU_MUL)
        acc, acc_up = _tile_mac(acc, acc_up, w, w_up, x_rows, ln_ptr, rstd, k0 + rk, K, m_ok,
                                HAS_NORM, SILU_MUL, EVEN_K, USE_DOT, DOT_F32)

    if SPLITS > 1:  # fp32 partials [splits, M, N (x2 for gate/up)]
        width = 2 * N if SILU_MUL else N
        part = part_ptr + pid_k * M * width + rm[:, None] * width + rn[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        tl.store(part, acc, mask=mask)
        if SILU_MUL:
            tl.store(part + N, acc_up, mask=mask)
        if FUSED_REDUCE:  # the last split of this N tile to finish sums them (else a launch)
            tl.debug_barrier()  # every thread's partial stored before the count (release)
            done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if done == SPLITS - 1:
                acc, acc_up = _sum_partials(part_ptr, rm, rn, M, N, SPLITS, SILU_MUL, True)
                _epilogue(acc, acc_up, rm, rn, M, N, b_ptr, res_ptr, out_ptr, scale_ptr,
                          stride_rm, stride_om, HAS_BIAS, SILU_MUL, HAS_RES, HAS_SCALE)
                tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # next use
    else:
        _epilogue(acc, acc_up, rm, rn, M, N, b_ptr, res_ptr, out_ptr, scale_ptr, stride_rm,
                  stride_om, HAS_BIAS, SILU_MUL, HAS_RES, HAS_SCALE)


@triton.jit
def _sum_partials(part_ptr, rm, rn, M, N, S, SILU_MUL: tl.constexpr, L2_ONLY: tl.constexpr):
    # the S fp32 partials of rows rm, columns rn, summed in split order (deterministic);
    # L2_ONLY: written by other programs of the running kernel, so not read through L1
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    width = 2 * N if SILU_MUL else N
    ptrs = part_ptr + rm[:, None] * width + rn[None, :]
    acc = tl.zeros([rm.shape[0], rn.shape[0]], dtype=tl.float32)
    acc_up = tl.zeros([rm.shape[0], rn.shape[0]], dtype=tl.float32)
    for s in range(S):
        if L2_ONLY:
            acc += tl.load(ptrs + s * M * width, mask=mask, other=0.0, cache_modifier=".cg")
            if SILU_MUL:
                acc_up += tl.load(ptrs + s * M * width + N, mask=mask, other=0.0,
                                  cache_modifier=".cg")
        else:
            acc += tl.load(ptrs + s * M * width, mask=mask, other=0.0)
            if SILU_MUL:
                acc_up += tl.load(ptrs + s * M * width + N, mask=mask, other=0.0)
    return acc, acc_up


@triton.jit
def _reduce_kernel(
    part_ptr, b_ptr, res_ptr, out_ptr, scale_ptr, M, N, S, stride_rm, stride_om,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, HAS_RES: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # grid (cdiv(N, BLOCK_N),): sums the S partials in order, then the epilogue
    pdl_wait(PDL)
    rm = tl.arange(0, M_PAD)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc, acc_up = _sum_partials(part_ptr, rm, rn, M, N, S, SILU_MUL, False)
    _epilogue(acc, acc_up, rm, rn, M, N, b_ptr, res_ptr, out_ptr, scale_ptr, stride_rm,
              stride_om, HAS_BIAS, SILU_MUL, HAS_RES, HAS_SCALE)


# Split K (fused_reduce, the default): the last split of each N tile to finish sums the
# partials and runs the epilogue, counted in a per-weight int32 array that this program resets
# (no second launch). fused_reduce=False: a separate reduce launch (benchmarks compare the two).
_COUNTS: dict[tuple[int, int, int], torch.Tensor] = {}


def _arrival_counts(w: torch.Tensor, n_tiles: int) -> torch.Tensor:
    """Zeroed arrival counters of this weight's N tiles (each launch leaves them at zero).

    NOTE: keyed by the weight, so kernels that may run at the same time (the thinker's and
    the talker's, on their own streams) never share counters; launches of one weight are
    ordered on its stage's stream. Created on first use, which is a graph's warm-up run, not
    its capture."""
    key = (w.device.index or 0, w.data_ptr(), n_tiles)
    counts = _COUNTS.get(key)
    if counts is None:
        counts = _COUNTS[key] = torch.zeros(n_tiles, dtype=torch.int32, device=w.device)
    return counts


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ValueError(f"{name}: {tuple(t.shape)} {t.dtype}, expected {list(shape)} {dtype}")


def _gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, ln_w: torch.Tensor | None,
          eps: float, residual: torch.Tensor | None, silu: bool,
          config: GemvConfig | None, pdl: bool, fused_reduce: bool,
          scale: torch.Tensor | None = None) -> torch.Tensor:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)}: expected [M, K] and [N, K]")
    M, K = x.shape
    n_rows = w.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"x: {M} rows; these GEMVs take at most {MAX_ROWS}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"x dtype {x.dtype}: expected a float type")
    if scale is None and x.dtype != w.dtype:
        raise ValueError(f"x dtype {x.dtype} and w dtype {w.dtype} must be the same float type")
    if scale is not None:  # weight-only FP8 (layers/fp8.py): e4m3 rows * fp32 row scales
        _check("w", w, tuple(w.shape), torch.float8_e4m3fn)
        _check("scale", scale, (n_rows,), torch.float32)
    if silu and n_rows % 2:
        raise ValueError(f"w_gate_up: {n_rows} rows, expected 2 * F")
    N = n_rows // 2 if silu else n_rows
    if b is not None:
        _check("b", b, (n_rows,), x.dtype)
    if ln_w is not None:
        _check("ln_w", ln_w, (K,), x.dtype)
    if residual is not None:
        _check("residual", residual, (M, N), x.dtype)
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    cfg = config or pick_config(n_rows, K, M, w.dtype, silu, ln_w is not None, x.device)
    _launch(launch, empty_on(x.device), lambda n_tiles: _arrival_counts(w, n_tiles), x, w, b,
            ln_w, eps, residual, silu, cfg, fused_reduce, scale, out, pdl_kwargs(x.device, pdl))
    return out


def _launch(run: Callable[..., Any], empty: Callable[..., Any], counts: Callable[[int], Any],
            x: Any, w: Any, b: Any, ln_w: Any, eps: float, residual: Any, silu: bool,
            cfg: GemvConfig, fused_reduce: bool, scale: Any, out: Any,
            flags: dict[str, Any]) -> None:
    """The launches of _gemv (checked inputs, out [M, N] allocated), by run(kernel, grid,
    *args, **kwargs): kernels_ahead.launch, or CompileOnly on TensorSpecs (compile_ahead).
    empty(shape, dtype): a buffer; counts(n_tiles): the weight's arrival counters."""
    M, K = x.shape
    N = out.shape[1]
    k_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(K, k_split)
    m_pad = 16 if cfg.use_dot else triton.next_power_of_2(M)
    width = 2 * N if silu else N
    part = empty((splits, M, width), torch.float32) if splits > 1 else out
    dummy = out  # stands in for absent pointers (never read: constexpr-guarded)
    res = residual if residual is not None else dummy
    flags = dict(HAS_BIAS=b is not None, SILU_MUL=silu, HAS_RES=residual is not None,
                 HAS_SCALE=scale is not None, **flags)
    scale_arg = scale if scale is not None else dummy
    n_tiles = triton.cdiv(N, cfg.block_n)
    fused = splits > 1 and fused_reduce
    run(_gemv_kernel, (n_tiles, splits),
        x, ln_w if ln_w is not None else dummy, w, b if b is not None else dummy, res, out,
        part, counts(n_tiles) if fused else out, scale_arg,
        M, N, K, k_split, float(eps), x.stride(0), w.stride(0), res.stride(0), out.stride(0),
        M_PAD=m_pad, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NORM_K=max(16, min(triton.next_power_of_2(K), 8192 // m_pad)),
        HAS_NORM=ln_w is not None, SPLITS=splits, FUSED_REDUCE=fused,
        EVEN_K=K % cfg.block_k == 0,  # k_split is a multiple of block_k: full steps
        USE_DOT=cfg.use_dot, DOT_F32=_INTERPRET or x.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags)
    if splits > 1 and not fused:
        m_red = triton.next_power_of_2(M)
        block = max(16, 1024 // m_red)
        run(_reduce_kernel, (triton.cdiv(N, block),),
            part, b if b is not None else dummy, res, out, scale_arg, M, N, splits, res.stride(0),
            out.stride(0), M_PAD=m_red, BLOCK_N=block, num_warps=4, **flags)


GEMVS = ("norm_gemv", "norm_gemv_silu_mul", "gemv_residual")


def compile_ahead(op: str, n_rows: int, k: int, m: int, dtype: torch.dtype, has_bias: bool,
                  fused_reduce: bool, pdl: bool, capability: tuple[int, int],
                  sms: int) -> list[str]:
    """Compile, without launching, what `op` (one of GEMVS) launches for x [m, k] and its
    weight [n_rows, k] of `dtype` (bias if has_bias), on a GPU of this capability and SM count
    with the switches pdl / fused_reduce (engine/kernels_ahead.py runs it in a process of its
    own). Returns the cache keys."""
    if op not in GEMVS:
        raise ValueError(f"op: {op!r}; one of {GEMVS}")
    silu, res = op == "norm_gemv_silu_mul", op == "gemv_residual"
    new = TensorSpec.empty
    n = n_rows // 2 if silu else n_rows
    run = CompileOnly()
    _launch(run, new, lambda n_tiles: new((n_tiles,), torch.int32), new((m, k), dtype),
            new((n_rows, k), dtype), new((n_rows,), dtype) if has_bias else None,
            None if res else new((k,), dtype), 1e-6, new((m, n), dtype) if res else None, silu,
            choose_config(n_rows, k, m, dtype, silu, not res, sms), fused_reduce, None,
            new((m, n), dtype), pdl_flags(pdl, capability))
    return run.keys


def norm_gemv(x: torch.Tensor, ln_w: torch.Tensor, eps: float, w: torch.Tensor,
              b: torch.Tensor | None = None, config: GemvConfig | None = None, *,
              pdl: bool = True, fused_reduce: bool = True,
              scale: torch.Tensor | None = None) -> torch.Tensor:
    """rms_norm(x, ln_w, eps) @ w.T + b, as layers.attention_qkv.

    x: [M, K]; ln_w: [K]; w: [N, K]; b: [N] -> [M, N], all one float dtype (fp32 accumulation).
    scale [N] fp32: w is float8 e4m3 and its row n counts scale[n] times (weight-only FP8).
    """
    return _gemv(x, w, b, ln_w, eps, None, False, config, pdl, fused_reduce, scale)


def norm_gemv_silu_mul(x: torch.Tensor, ln_w: torch.Tensor, eps: float, w_gate_up: torch.Tensor,
                       b: torch.Tensor | None = None,
                       config: GemvConfig | None = None, *, pdl: bool = True,
                       fused_reduce: bool = True,
                       scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up with gate, up = (rms_norm(x) @ w_gate_up.T + b).chunk(2, -1).

    x: [M, K]; ln_w: [K]; w_gate_up: [2F, K] (gate rows, then up rows); b: [2F] -> [M, F].
    scale [2F]: as norm_gemv's.
    """
    return _gemv(x, w_gate_up, b, ln_w, eps, None, True, config, pdl, fused_reduce, scale)


def gemv_residual(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor,
                  b: torch.Tensor | None = None, config: GemvConfig | None = None, *,
                  pdl: bool = True, fused_reduce: bool = True,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
    """residual + (x @ w.T + b), the linear's output rounded to the dtype before the add.

    x: [M, K]; w: [N, K]; residual: [M, N]; b: [N] -> [M, N] (a new tensor).
    scale [N]: as norm_gemv's.
    """
    return _gemv(x, w, b, None, 0.0, residual, False, config, pdl, fused_reduce, scale)
