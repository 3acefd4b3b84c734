"""The code2wav DiT's block attention in one Triton kernel: qkv [B, W, 3 D] -> out [B, W, D].

NOTE: what it replaces (code2wav_fast._dit_layer's SDPA path): rotary on the first head of q and
k (a copy of all of q and k through torch.cat), a dense [W, W] additive mask, a fused attention
kernel that computes every query-key pair of the window, and the output's transpose. But a DiT
layer only lets a query see the keys whose block (absolute frame // block_size) lies within
[-look_backward, +look_ahead] of its own (`qwen2_5_omni_dit_attention_mask`; look_backward and
look_ahead are 0 or 1), so a query tile needs a contiguous key range of a few blocks, not the
window: at the pipeline's 360-frame windows most layers need 1 block of 15. This kernel
  - reads q, k and v where the qkv GEMM wrote them ([B, W, 3, H, hd]) and writes out in the
    [B, W, H * hd] layout the output projection reads;
  - applies the first head's rotary while loading (in the interleaved layout: the module's
    (evens, odds) output order is a permutation shared by q and k, so q.k is the same);
  - visits only the key range its query tile's blocks can see, with the exact mask per element:
    key block within the layer's window, and (key valid or query padding), as the mask function
    (padding queries see their blocks' keys, so no row is empty).
`frames` [B, 4] int32 holds per row (start frame, valid frames, look_backward, look_ahead).
Accumulates in fp32 (online softmax); fp32 inputs use exact (ieee) dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _rotate(x, cos_ptr, sin_ptr, cs, ok, ROWS: tl.constexpr, HALF: tl.constexpr):
    # interleaved rotary of x [ROWS, 2 HALF]: (x[2i], x[2i+1]) turned by angle i; cs [ROWS, HALF]
    # offsets of the angles' cos/sin (contiguous loads; the pairs come from a register split)
    c = tl.load(cos_ptr + cs, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + cs, mask=ok, other=0.0).to(tl.float32)
    even, odd = tl.split(tl.reshape(x.to(tl.float32), [ROWS, HALF, 2]))
    turned = tl.join(even * c - odd * s, odd * c + even * s)
    return tl.reshape(turned, [ROWS, 2 * HALF]).to(x.dtype)


@triton.jit
def _dit_block_attention_kernel(qkv_ptr, cos_ptr, sin_ptr, frames_ptr, out_ptr, W,
                                stride_qkv_b, stride_qkv_w, stride_cs_b, stride_cs_w,
                                stride_out_b, stride_out_w, scale_log2, BLOCK_FRAMES,
                                HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                IEEE: tl.constexpr):
    # grid: (query tiles of W, heads, rows B)
    pid_m, head, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(frames_ptr + b * 4)
    nvalid = tl.load(frames_ptr + b * 4 + 1)
    look_back = tl.load(frames_ptr + b * 4 + 2)
    look_ahead = tl.load(frames_ptr + b * 4 + 3)
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HEAD_DIM)
    h2 = tl.arange(0, HALF)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < W
    row = qkv_ptr + b.to(tl.int64) * stride_qkv_b
    cs_row = b.to(tl.int64) * stride_cs_b
    q = tl.load(row + m[:, None] * stride_qkv_w + head * HEAD_DIM + d[None, :],
                mask=m_ok[:, None], other=0.0)
    if head == 0:  # the checkpoint's rotary is on the first head only
        q = _rotate(q, cos_ptr, sin_ptr, cs_row + m[:, None] * stride_cs_w + h2[None, :],
                    m_ok[:, None], BLOCK_M, HALF)

    q_block = (start + m) // BLOCK_FRAMES
    q_pad = m >= nvalid
    # the keys any query of the tile may see: blocks [first - look_back, last + look_ahead]
    m_last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, W) - 1
    lo = ((start + pid_m * BLOCK_M) // BLOCK_FRAMES - look_back) * BLOCK_FRAMES - start
    hi = ((start + m_last) // BLOCK_FRAMES + look_ahead + 1) * BLOCK_FRAMES - start
    lo = tl.maximum(lo, 0)
    hi = tl.minimum(hi, W)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        n = j0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        kv = row + n[:, None] * stride_qkv_w + d[None, :]
        k = tl.load(kv + (HEADS + head) * HEAD_DIM, mask=n_ok[:, None], other=0.0)
        if head == 0:
            k = _rotate(k, cos_ptr, sin_ptr, cs_row + n[:, None] * stride_cs_w + h2[None, :],
                        n_ok[:, None], BLOCK_N, HALF)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        diff = ((start + n) // BLOCK_FRAMES)[None, :] - q_block[:, None]
        seen = ((diff >= -look_back) & (diff <= look_ahead) & n_ok[None, :]
                & ((n < nvalid)[None, :] | q_pad[:, None]))
        s = tl.where(seen, s * scale_log2, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a tile with nothing seen yet leaves m_new = -1e30; its p values are wiped by the
        # first real key's alpha = exp2(-1e30 - m) = 0 (every real row sees >= 1 key)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(kv + (2 * HEADS + head) * HEAD_DIM, mask=n_ok[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + b.to(tl.int64) * stride_out_b + m[:, None] * stride_out_w + head * HEAD_DIM
    tl.store(o_ptrs + d[None, :], out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])


def frame_table(start: torch.Tensor, nvalid: torch.Tensor, look_backward: int, look_ahead: int
                ) -> torch.Tensor:
    """Per-row (start, valid frames, look_backward, look_ahead) [B, 4] int32 for the kernel."""
    lb = torch.full_like(start, look_backward)
    la = torch.full_like(start, look_ahead)
    return torch.stack([start, nvalid, lb, la], 1).to(torch.int32)


def supported(head_dim: int) -> bool:
    """Whether the kernel handles this head size (a power of two >= 16: tl.dot's smallest K)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


@torch.library.custom_op("omnistage::dit_block_attention", mutates_args=())
def dit_block_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        frames: torch.Tensor, heads: int, block_frames: int) -> torch.Tensor:
    """Block attention of one DiT layer: qkv [B, W, 3 * heads * hd] (the fused q/k/v GEMM's
    output) -> [B, W, heads * hd] in qkv's dtype.

    cos/sin [B, W, hd / 2] (views are fine): the rotary angles of the first head; frames [B, 4]
    int32 from `frame_table`; block_frames: the DiT's block size. CUDA, or CPU under
    TRITON_INTERPRET=1. No host sync (CUDA-graph capturable).
    """
    return launch(qkv, cos, sin, frames, heads, block_frames)


def launch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: torch.Tensor,
           heads: int, block_frames: int, block_m: int = 64, block_n: int = 32,
           num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """`dit_block_attention` with the kernel's tile sizes exposed (benchmarks tune them).

    NOTE: the defaults are the fastest of 9 configs on the H100 at 64 rows x 16 heads x 64,
    windows 144 and 360 (code2wav_gpu.py attention_op: 0.09-0.17 ms, 0.8-1.2 TB/s, vs 0.29-0.55
    ms for torch's rotary + SDPA + transpose); 64 x 64 is within 10%, 128-row tiles 1.5-2x slower.
    """
    b, w, three_d = qkv.shape
    head_dim = three_d // (3 * heads)
    if three_d != 3 * heads * head_dim or not supported(head_dim):
        raise ValueError(f"qkv: last dim {three_d} is not 3 x {heads} heads x a head size that "
                         f"is a power of two >= 16")
    if cos.shape != (b, w, head_dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin: expected {(b, w, head_dim // 2)}, got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")
    if frames.shape != (b, 4) or frames.dtype != torch.int32:
        raise ValueError(f"frames: expected int32 [{b}, 4], got {frames.dtype} "
                         f"{tuple(frames.shape)}")
    if qkv.stride(-1) != 1:
        raise ValueError(f"qkv: the last dim must be contiguous, got strides {qkv.stride()}")
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():  # the kernel shares their strides
        cos, sin = cos.contiguous(), sin.contiguous()
    out = qkv.new_empty(b, w, heads * head_dim)
    if out.numel() == 0:
        return out
    # short windows: tiles no larger than the window (tl.dot needs >= 16)
    block_m = min(block_m, max(16, triton.next_power_of_2(w)))
    block_n = min(block_n, max(16, triton.next_power_of_2(w)))
    grid = (triton.cdiv(w, block_m), heads, b)
    _dit_block_attention_kernel[grid](
        qkv, cos, sin, frames.contiguous(), out, w, qkv.stride(0), qkv.stride(1), cos.stride(0),
        cos.stride(1), out.stride(0), out.stride(1), _LOG2E / head_dim ** 0.5, block_frames,
        HEADS=heads, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=qkv.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages)
    return out


@dit_block_attention.register_fake
def _(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: torch.Tensor, heads: int,
      block_frames: int) -> torch.Tensor:
    b, w, three_d = qkv.shape
    return qkv.new_empty(b, w, three_d // 3)
