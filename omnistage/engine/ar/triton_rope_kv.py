"""One Triton launch per decoder layer: rope of q and k, and the paged KV-cache write.

Replaces `apply_rope(q)`, `apply_rope(k)` and `write_kv` (two `index_copy_`) after the fused
q/k/v projection. The rotation is rotate-half (out = x*cos + cat(-x2, x1)*sin) computed in fp32
from the input dtype and cast back, the same operations in the same order as `apply_rope`; the
launch turns off fp fusion (no FMA contraction), so results are bit-identical to it.

Each program takes one token and a tile of BLOCK_H "rope heads": index j < H is q head j,
H <= j < H + Hkv is k head j - H (which also copies v head j - H). In a qkv row the k heads
follow the q heads, so row j of a tile always reads at j * head_dim. Launch shapes depend only
on T and the head counts (no host syncs): CUDA-graph capturable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from omnistage.engine.ar.triton_pdl import pdl_flags, pdl_kwargs, pdl_wait
from omnistage.engine.kernels_ahead import CompileOnly, TensorSpec, launch

_TILE_ELEMS = 1024  # elements (heads x head_dim) one program rotates


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qkv_t, stride_cos_t, stride_sin_t,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    H: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] rope-head index
    d = tl.arange(0, HALF_PAD)  # [HALF_PAD] position in a half
    HALF: tl.constexpr = HD // 2
    dmask = d < HALF
    is_q = j < H
    is_k = (j >= H) & (j < H + HKV)
    rows = (is_q | is_k)[:, None] & dmask[None, :]

    # cos/sin of this token, both halves (rows may differ per token: mrope)
    c1 = tl.load(cos_ptr + t * stride_cos_t + d, mask=dmask, other=0.0)[None, :]
    c2 = tl.load(cos_ptr + t * stride_cos_t + HALF + d, mask=dmask, other=0.0)[None, :]
    s1 = tl.load(sin_ptr + t * stride_sin_t + d, mask=dmask, other=0.0)[None, :]
    s2 = tl.load(sin_ptr + t * stride_sin_t + HALF + d, mask=dmask, other=0.0)[None, :]
    slot = tl.load(slot_ptr + t).to(tl.int64)
    pdl_wait(PDL)  # cos, sin and slots are step inputs; qkv comes from the kernel before

    src = qkv_ptr + t * stride_qkv_t + j[:, None] * HD + d[None, :]  # [BLOCK_H, HALF_PAD]
    x1 = tl.load(src, mask=rows, other=0.0)
    x2 = tl.load(src + HALF, mask=rows, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # same two products and one add per element as apply_rope: x*cos + rotated*sin
    o1 = x1f * c1 + (-x2f) * s1
    o2 = x2f * c2 + x1f * s2

    # q: a fresh [T, H, HD] tensor. The casts round to nearest even on the GPU, like torch
    # (NOTE: Triton's interpreter truncates fp32 -> bf16 instead).
    qmask = is_q[:, None] & dmask[None, :]
    q_dst = q_ptr + t * (H * HD) + j[:, None] * HD + d[None, :]
    q_ty = q_ptr.dtype.element_ty
    tl.store(q_dst, o1.to(q_ty), mask=qmask)
    tl.store(q_dst + HALF, o2.to(q_ty), mask=qmask)

    # k (roped) and v (raw) into the paged caches at this token's slot
    blk = slot // PAGE
    off = slot % PAGE
    kvh = tl.where(is_k, j - H, 0)
    write = is_k & (tl.zeros_like(j).to(tl.int64) + slot >= 0)  # negative slot: no write
    kmask = write[:, None] & dmask[None, :]
    k_dst = k_cache_ptr + blk * stride_kb + off * stride_ks + kvh[:, None] * stride_kh + d[None, :]
    k_ty = k_cache_ptr.dtype.element_ty
    tl.store(k_dst, o1.to(k_ty), mask=kmask)
    tl.store(k_dst + HALF, o2.to(k_ty), mask=kmask)
    v_src = src + HKV * HD  # v head j - H sits Hkv heads after k head j - H
    v1 = tl.load(v_src, mask=kmask, other=0.0)
    v2 = tl.load(v_src + HALF, mask=kmask, other=0.0)
    v_dst = v_cache_ptr + blk * stride_vb + off * stride_vs + kvh[:, None] * stride_vh + d[None, :]
    v_ty = v_cache_ptr.dtype.element_ty
    tl.store(v_dst, v1.to(v_ty), mask=kmask)
    tl.store(v_dst + HALF, v2.to(v_ty), mask=kmask)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  num_heads: int, num_kv_heads: int, head_dim: int, pdl: bool = True
                  ) -> torch.Tensor:
    """Ropes q and k of the fused projection, writes k and v at `slot_mapping`; returns q.

    qkv: [T, (H + 2*Hkv) * hd] (q heads, then k, then v); cos/sin: [T, hd] fp32;
    caches: [num_blocks, block_size, Hkv, hd]; slot_mapping: [T] long (block*block_size + offset,
    negative = skip). Returns q roped, [T, H, hd] in qkv's dtype. With PDL (triton_pdl.py),
    cos, sin and slot_mapping are read before waiting: they must not come from the kernel
    launched right before this one (qkv may). pdl: False = a plain launch.
    """
    T = qkv.shape[0]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(f"qkv: shape {tuple(qkv.shape)}, expected [T, {width}]")
    if head_dim % 2:
        raise ValueError(f"head_dim: {head_dim} must be even")
    for name, c in (("cos", cos), ("sin", sin)):
        if c.shape != (T, head_dim) or c.dtype != torch.float32:
            raise ValueError(f"{name}: {tuple(c.shape)} {c.dtype}, expected [{T}, {head_dim}] "
                             "float32")
    cache_shape = (num_kv_heads, head_dim)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (c.dim() != 4 or tuple(c.shape[2:]) != cache_shape or c.stride(3) != 1
                or c.shape[:2] != k_cache.shape[:2]):
            raise ValueError(f"{name}: shape {tuple(c.shape)}, expected [blocks, block_size, "
                             f"{num_kv_heads}, {head_dim}] with unit last stride")
    if slot_mapping.shape != (T,):
        raise ValueError(f"slot_mapping: shape {tuple(slot_mapping.shape)}, expected [{T}]")
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    cos = cos if cos.stride(1) == 1 else cos.contiguous()
    sin = sin if sin.stride(1) == 1 else sin.contiguous()
    q = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    _launch(launch, qkv, cos, sin, q, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
            head_dim, pdl_kwargs(qkv.device, pdl))
    return q


def _launch(run: Callable[..., Any], qkv: Any, cos: Any, sin: Any, q: Any, k_cache: Any,
            v_cache: Any, slot_mapping: Any, num_heads: int, num_kv_heads: int, head_dim: int,
            flags: dict[str, Any]) -> None:
    """The launch of rope_write_kv (checked inputs, q allocated), by run(kernel, grid, *args,
    **kwargs): kernels_ahead.launch, or CompileOnly on TensorSpecs (compile_ahead)."""
    half_pad = triton.next_power_of_2(head_dim // 2)
    rope_heads = num_heads + num_kv_heads
    block_h = max(1, min(triton.next_power_of_2(rope_heads), _TILE_ELEMS // (2 * half_pad)))
    grid = (qkv.shape[0], triton.cdiv(rope_heads, block_h))
    run(_rope_write_kv_kernel, grid,
        qkv, cos, sin, q, k_cache, v_cache, slot_mapping,
        qkv.stride(0), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        H=num_heads, HKV=num_kv_heads, HD=head_dim, HALF_PAD=half_pad, BLOCK_H=block_h,
        PAGE=k_cache.shape[1], num_warps=4, enable_fp_fusion=False, **flags)


def compile_ahead(num_heads: int, num_kv_heads: int, head_dim: int, page: int,
                  dtype: torch.dtype, pdl: bool, capability: tuple[int, int]) -> list[str]:
    """Compile, without launching, what rope_write_kv launches for qkv of `dtype` and caches
    [_, page, num_kv_heads, head_dim] of `dtype` (its other inputs: fresh allocations), on a
    GPU of this capability with the switch pdl (engine/kernels_ahead.py runs it in a process of
    its own). Returns the cache keys."""
    new = TensorSpec.empty
    cache = new((1, page, num_kv_heads, head_dim), dtype)
    rope = new((1, head_dim), torch.float32)
    run = CompileOnly()
    _launch(run, new((1, (num_heads + 2 * num_kv_heads) * head_dim), dtype), rope, rope,
            new((1, num_heads, head_dim), dtype), cache, cache, new((1,), torch.long), num_heads,
            num_kv_heads, head_dim, pdl_flags(pdl, capability))
    return run.keys
