"""`Qwen2_5OmniAntiAliasedSnake.forward` fused into one Triton pass: x [B, C, L] -> y [B, C, L].

NOTE: the module's three passes (2x upsample, Snake-Beta, 2x downsample; 12-tap filter w), written
for one row x[0..L) with X(i) = x[min(max(i, 0), L - 1)] (the upsample's replicate padding):
  up[2m]   = 2 * sum_q w[2q+1] * X(m + 2 - q),   up[2m+1] = 2 * sum_q w[2q] * X(m + 3 - q)   (q < 6)
  s[t]     = up[t] + sin(up[t] * e^alpha)^2 / (e^beta + 1e-9)                         (t < 2L)
  y[n]     = sum_j w[j] * s[min(max(2n + j - 5, 0), 2L - 1)]                          (j < 12)
           = sum_p w[2p] * S1(n + p - 3) + w[2p + 1] * S0(n + p - 2)                  (p < 6)
with S0(m) = s[2m], S1(m) = s[2m + 1] for 0 <= m < L; the downsample's replicate padding makes
both phases s[0] for m < 0 and s[2L - 1] for m >= L. So y needs x[n-5 .. n+5] only, never the
2L-long intermediates. Two ways to get the 12 values S(.) an output needs:
  "recompute": each output computes its own 12 (12 sines per output; plain loads, no shuffles);
  "gather": a tile computes S0, S1 once per position (2 sines) and the taps read them shifted
            with tl.gather (through shared memory on the GPU).
Both accumulate in fp32 (inputs fp32, bf16 or fp16; the output has x's dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from triton import knobs

from omnistage.engine.kernels_ahead import CompileOnly, TensorSpec, launch

if knobs.runtime.interpret:
    _math = tl  # the CPU interpreter implements tl.sin/tl.exp, not libdevice
else:
    # the precise libdevice sinf/expf (as torch's CUDA kernels), not the MUFU approximations
    from triton.language.extra import libdevice as _math

VARIANTS = ("recompute", "gather")
DEFAULT_VARIANT = "gather"  # H100, batch 32 x 168 frames: vocoder 408 -> 132 ms (recompute 175)
_TILE = {"recompute": 512, "gather": 1024}  # elements per program
NUM_WARPS = 4


@triton.jit
def _fir6(a0, a1, a2, a3, a4, a5, w0, w1, w2, w3, w4, w5):
    return 2.0 * (w0 * a0 + w1 * a1 + w2 * a2 + w3 * a3 + w4 * a4 + w5 * a5)


@triton.jit
def _snake(u, alpha, inv_beta, FAST_SIN: tl.constexpr):
    v = u * alpha
    if FAST_SIN:  # the MUFU approximation (benchmarks only: larger error for large |v|)
        sn = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [v], dtype=tl.float32,
                                       is_pure=True, pack=1)
    else:
        sn = _math.sin(v)
    return u + inv_beta * (sn * sn)


@triton.jit
def _edge(s, m, L, s_first, s_last):
    # the downsample's replicate padding of the 2L-long snake output
    return tl.where(m < 0, s_first, tl.where(m >= L, s_last, s))


@triton.jit
def _ld(row, i, L):
    return tl.load(row + tl.minimum(tl.maximum(i, 0), L - 1)).to(tl.float32)


@triton.jit
def _phase(row, m, L, w0, w1, w2, w3, w4, w5, ODD: tl.constexpr):
    # up[2m + ODD] from x (m: scalar or vector); w*: that phase's taps
    return _fir6(_ld(row, m + 2 + ODD, L), _ld(row, m + 1 + ODD, L), _ld(row, m + ODD, L),
                 _ld(row, m - 1 + ODD, L), _ld(row, m - 2 + ODD, L), _ld(row, m - 3 + ODD, L),
                 w0, w1, w2, w3, w4, w5)


@triton.jit
def _shift(s, i, k: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # s[:, min(i + k, BLOCK - 1)]: a register shift (through shared memory on the GPU)
    idx = tl.broadcast_to(tl.minimum(i + k, BLOCK - 1), (ROWS, BLOCK))
    return tl.gather(s, idx, 1)


@triton.jit
def _pair(xa, xb, xc, xd, xe, xf, m1, L, s_first, s_last, alpha, inv_beta,
          e0, e1, e2, e3, e4, e5, o0, o1, o2, o3, o4, o5, we, wo, FAST_SIN: tl.constexpr):
    # w[2p] * S1(n + p - 3) + w[2p + 1] * S0(n + p - 2): both read x[n + p - 5 .. n + p]
    s1 = _snake(_fir6(xa, xb, xc, xd, xe, xf, e0, e1, e2, e3, e4, e5), alpha, inv_beta, FAST_SIN)
    s0 = _snake(_fir6(xa, xb, xc, xd, xe, xf, o0, o1, o2, o3, o4, o5), alpha, inv_beta, FAST_SIN)
    return (we * _edge(s1, m1, L, s_first, s_last)
            + wo * _edge(s0, m1 + 1, L, s_first, s_last))


@triton.jit
def _aa_snake_kernel(x_ptr, y_ptr, alpha_ptr, beta_ptr, w_ptr, R, C, L, ROWS: tl.constexpr,
                     BLOCK: tl.constexpr, GATHER: tl.constexpr, FAST_SIN: tl.constexpr):
    # grid: (row tiles of the B * C rows, position tiles of L); x, y: [B * C, L] contiguous.
    # A program computes a [ROWS, BLOCK] tile (ROWS > 1 only where L is short).
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    row_ok = r < R
    r = tl.minimum(r, R - 1)  # rows past the end read row R - 1 (their stores are masked)
    row = x_ptr + r.to(tl.int64) * L
    c = r % C
    alpha = _math.exp(tl.load(alpha_ptr + c).to(tl.float32))
    inv_beta = 1.0 / (_math.exp(tl.load(beta_ptr + c).to(tl.float32)) + 1e-9)
    w0, w1, w2, w3 = tl.load(w_ptr), tl.load(w_ptr + 1), tl.load(w_ptr + 2), tl.load(w_ptr + 3)
    w4, w5, w6, w7 = tl.load(w_ptr + 4), tl.load(w_ptr + 5), tl.load(w_ptr + 6), tl.load(w_ptr + 7)
    w8, w9, w10, w11 = (tl.load(w_ptr + 8), tl.load(w_ptr + 9), tl.load(w_ptr + 10),
                        tl.load(w_ptr + 11))
    # s[0] = S0(0) and s[2L - 1] = S1(L - 1) per row: the values the ends are padded with
    zero = r * 0
    s_first = _snake(_phase(row, zero, L, w1, w3, w5, w7, w9, w11, False), alpha, inv_beta,
                     FAST_SIN)
    s_last = _snake(_phase(row, zero + L - 1, L, w0, w2, w4, w6, w8, w10, True), alpha,
                    inv_beta, FAST_SIN)
    i = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    if GATHER:
        out = BLOCK - 6  # a tile of BLOCK positions m serves BLOCK - 6 outputs
        n0 = tl.program_id(1) * out
        m = n0 - 3 + i
        s1 = _snake(_phase(row, m, L, w0, w2, w4, w6, w8, w10, True), alpha, inv_beta, FAST_SIN)
        s0 = _snake(_phase(row, m, L, w1, w3, w5, w7, w9, w11, False), alpha, inv_beta,
                    FAST_SIN)
        s1 = _edge(s1, m, L, s_first, s_last)
        s0 = _edge(s0, m, L, s_first, s_last)
        # output n0 + i reads S1 at tile position i + p and S0 at i + p + 1 (p < 6)
        acc = w0 * _shift(s1, i, 0, ROWS, BLOCK) + w1 * _shift(s0, i, 1, ROWS, BLOCK)
        acc += w2 * _shift(s1, i, 1, ROWS, BLOCK) + w3 * _shift(s0, i, 2, ROWS, BLOCK)
        acc += w4 * _shift(s1, i, 2, ROWS, BLOCK) + w5 * _shift(s0, i, 3, ROWS, BLOCK)
        acc += w6 * _shift(s1, i, 3, ROWS, BLOCK) + w7 * _shift(s0, i, 4, ROWS, BLOCK)
        acc += w8 * _shift(s1, i, 4, ROWS, BLOCK) + w9 * _shift(s0, i, 5, ROWS, BLOCK)
        acc += w10 * _shift(s1, i, 5, ROWS, BLOCK) + w11 * _shift(s0, i, 6, ROWS, BLOCK)
        n = n0 + i
        mask = row_ok & (i < out) & (n < L)
    else:
        n = tl.program_id(1) * BLOCK + i
        mask = row_ok & (n < L)
        x0, x1, x2, x3 = _ld(row, n - 5, L), _ld(row, n - 4, L), _ld(row, n - 3, L), _ld(
            row, n - 2, L)
        x4, x5, x6, x7 = _ld(row, n - 1, L), _ld(row, n, L), _ld(row, n + 1, L), _ld(
            row, n + 2, L)
        x8, x9, x10 = _ld(row, n + 3, L), _ld(row, n + 4, L), _ld(row, n + 5, L)
        # p = 0..5: the window x[n + p - 5 .. n + p], newest first
        acc = _pair(x5, x4, x3, x2, x1, x0, n - 3, L, s_first, s_last, alpha, inv_beta,
                    w0, w2, w4, w6, w8, w10, w1, w3, w5, w7, w9, w11, w0, w1, FAST_SIN)
        acc += _pair(x6, x5, x4, x3, x2, x1, n - 2, L, s_first, s_last, alpha, inv_beta,
                     w0, w2, w4, w6, w8, w10, w1, w3, w5, w7, w9, w11, w2, w3, FAST_SIN)
        acc += _pair(x7, x6, x5, x4, x3, x2, n - 1, L, s_first, s_last, alpha, inv_beta,
                     w0, w2, w4, w6, w8, w10, w1, w3, w5, w7, w9, w11, w4, w5, FAST_SIN)
        acc += _pair(x8, x7, x6, x5, x4, x3, n, L, s_first, s_last, alpha, inv_beta,
                     w0, w2, w4, w6, w8, w10, w1, w3, w5, w7, w9, w11, w6, w7, FAST_SIN)
        acc += _pair(x9, x8, x7, x6, x5, x4, n + 1, L, s_first, s_last, alpha, inv_beta,
                     w0, w2, w4, w6, w8, w10, w1, w3, w5, w7, w9, w11, w8, w9, FAST_SIN)
        acc += _pair(x10, x9, x8, x7, x6, x5, n + 2, L, s_first, s_last, alpha, inv_beta,
                     w0, w2, w4, w6, w8, w10, w1, w3, w5, w7, w9, w11, w10, w11, FAST_SIN)
    tl.store(y_ptr + r.to(tl.int64) * L + n, acc.to(y_ptr.dtype.element_ty), mask=mask)


def anti_aliased_snake(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                       filt: torch.Tensor, variant: str = "recompute", fast_sin: bool = False,
                       block: int | None = None) -> torch.Tensor:
    """Fused 2x-up / Snake-Beta / 2x-down; equals `Qwen2_5OmniAntiAliasedSnake.forward`.

    x: [B, C, L] float32/bfloat16/float16 (CUDA, or CPU under TRITON_INTERPRET=1);
    alpha, beta: [C] the SnakeBeta parameters (log scale: the kernel exponentiates them);
    filt: [12] the low-pass filter. Returns a new [B, C, L] tensor of x's dtype. No host sync
    (CUDA-graph capturable). block: tile size override (a power of two; tests and tuning).
    """
    if x.dim() != 3:
        raise ValueError(f"x: expected [B, C, L], got shape {tuple(x.shape)}")
    B, C, L = x.shape
    if alpha.shape != (C,) or beta.shape != (C,):
        raise ValueError(f"alpha/beta: expected shape ({C},), got {tuple(alpha.shape)}, "
                         f"{tuple(beta.shape)}")
    if filt.numel() != 12:
        raise ValueError(f"filt: the kernel is written for 12 taps, got {filt.numel()}")
    if variant not in VARIANTS:
        raise ValueError(f"variant: {variant!r}; one of {VARIANTS}")
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    tile_block = launch_tile(B * C, L, variant, block)[1]
    if variant == "gather" and tile_block < 8:
        raise ValueError(f"block: the gather variant needs >= 8, got {tile_block}")
    _launch(launch, x, y, alpha.contiguous(), beta.contiguous(),
            filt.reshape(-1).float().contiguous(), variant, fast_sin, block)
    return y


def _launch(run: Callable[..., Any], x: Any, y: Any, alpha: Any, beta: Any, filt: Any,
            variant: str, fast_sin: bool, block: int | None = None) -> None:
    """The launch of anti_aliased_snake (checked inputs), by run(kernel, grid, *args,
    **kwargs): kernels_ahead.launch, or CompileOnly on TensorSpecs (compile_ahead)."""
    B, C, L = x.shape
    gather = variant == "gather"
    rows, block = launch_tile(B * C, L, variant, block)
    grid = (triton.cdiv(B * C, rows), triton.cdiv(L, block - 6 if gather else block))
    run(_aa_snake_kernel, grid, x, y, alpha, beta, filt, B * C, C, L, ROWS=rows, BLOCK=block,
        GATHER=gather, FAST_SIN=fast_sin, num_warps=NUM_WARPS)


def launch_tile(rows_total: int, L: int, variant: str, block: int | None = None
                ) -> tuple[int, int]:
    """A launch's (ROWS, BLOCK) for B * C = rows_total rows of length L."""
    tile = _TILE[variant]
    if block is None:
        block = min(tile, max(16, triton.next_power_of_2(L + 6 * (variant == "gather"))))
    # short rows share a tile
    return max(1, min(tile // block, triton.next_power_of_2(rows_total))), block


def variant_key(shape: tuple[int, int, int], variant: str) -> tuple[int, ...]:
    """What tells apart the compiled variants of the kernel for x [B, C, L] (beside the dtypes):
    the launch's tile, and what Triton specializes its int arguments R, C and L on (the value 1,
    divisibility by 16). Each variant costs seconds of compile (5 were 32 s of a cold 7B start:
    engine/kernels_ahead.py compiles them ahead)."""
    B, C, L = shape

    def specialized(v: int) -> int:
        return 1 if v == 1 else 16 if v % 16 == 0 else 0

    return (*launch_tile(B * C, L, variant), specialized(B * C), specialized(C), specialized(L))


def compile_ahead(shape: tuple[int, int, int], variant: str, x_dtype: torch.dtype,
                  param_dtype: torch.dtype) -> str:
    """Compile the variant `anti_aliased_snake` launches for x [B, C, L] of x_dtype (alpha and
    beta of param_dtype), without launching it (engine/kernels_ahead.py runs this in a process
    of its own). Returns its cache key."""
    new = TensorSpec.empty
    params = new((shape[1],), param_dtype)
    run = CompileOnly()
    _launch(run, new(shape, x_dtype), new(shape, x_dtype), params, params,
            new((12,), torch.float32), variant, False)
    (key,) = run.keys
    return key
