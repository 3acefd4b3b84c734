"""Triton paged attention for the AR engine's GPU path (decode and varlen prefill).

KV cache layout (per layer): ``k_cache``/``v_cache`` ``[num_blocks, block_size, num_kv_heads,
head_dim]``; ``block_tables`` ``[num_seqs, max_blocks_per_seq]`` int32 maps a sequence's logical
block to a physical one. Entries past a sequence's length are never read (masked loads), so
padding entries may hold any value.

NOTE: both kernels put a KV head's whole query-head group into the rows of one tile (GQA), so
each K/V tile is loaded once per group. Token tiles are gathered token by token through the block
table, which makes the tile size independent of the cache's block size. Softmax is the online
(flash) form in base 2, accumulated in fp32. Decode additionally splits the keys of a sequence
into ``num_splits`` slices (flash-decoding) and merges them with their log-sum-exp; the split
boundaries come from ``seq_lens`` on the device, so a launch is CUDA-graph capturable (launch
shapes depend only on B, the head counts and ``block_tables.shape``).
"""

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from omnistage.engine.ar.triton_pdl import pdl_flags, pdl_kwargs, pdl_wait
from omnistage.engine.kernels_ahead import CompileOnly, TensorSpec, empty_on, launch

_LOG2E = 1.4426950408889634
_DECODE_BLOCK_N = 64  # key tokens per tile
_PREFILL_BLOCK_M = 64  # rows per tile = query tokens * padded group
_PREFILL_BLOCK_N = 64
_PREFILL_WARPS = 4
_PREFILL_STAGES = 3


@triton.jit
def _mm(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    # fp32 inputs: exact products for parity with torch; UPCAST works around the interpreter,
    # whose tl.dot multiplies bf16/fp16 operands as raw integer bits (triton 3.9).
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, t0, kv_end, q_pos, k_ptr, v_ptr, bt_row_ptr, kvh, d, dmask, scale_log2,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """Online-softmax update with key tile [t0, t0 + BLOCK_N); returns (m_i, l_i, acc).

    MASKED: the tile may reach past kv_end (and, if CAUSAL, past a row's q_pos); unmasked
    tiles skip all token masks.
    """
    # q: [M, D_PAD]; m_i, l_i: [M]; acc: [M, D_PAD] fp32; q_pos: [M] (read only if CAUSAL)
    t = t0 + tl.arange(0, BLOCK_N)
    if MASKED:
        tmask = t < kv_end
        blk = tl.load(bt_row_ptr + t // PAGE, mask=tmask, other=0)
        kv_mask = tmask[:, None] & dmask[None, :]
    else:
        blk = tl.load(bt_row_ptr + t // PAGE)
        kv_mask = dmask[None, :]
    slot = blk.to(tl.int64)
    k_off = slot * stride_kb + (t % PAGE) * stride_kt + kvh * stride_kh
    v_off = slot * stride_vb + (t % PAGE) * stride_vt + kvh * stride_vh
    k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BN, D_PAD]
    v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = _mm(q, tl.trans(k), IEEE, UPCAST) * scale_log2  # [M, BN], log2 units
    if MASKED:
        visible = tmask[None, :]
        if CAUSAL:
            visible = visible & (t[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
    # Tiles run in order and every row sees key 0 of the first one, so m_new is finite.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, IEEE, UPCAST)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_bt"])  # see _prefill_kernel
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    num_heads,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, PDL: tl.constexpr = False,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    pdl_wait(PDL)  # seq_lens is a step input; q and this token's K/V come from the kernel before
    # Equal slices of this sequence's keys, rounded to whole tiles.
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N

    g = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + g
    hmask = g < GROUP
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)  # [GROUP_PAD, D_PAD]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for t0 in range(start, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, t0, end, None, k_ptr, v_ptr, bt_row, kvh, d, dmask, scale_log2,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            PAGE, BLOCK_N, False, False, IEEE, UPCAST)
    for t0 in range(full_end, end, BLOCK_N):  # at most one partial tile
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, t0, end, None, k_ptr, v_ptr, bt_row, kvh, d, dmask, scale_log2,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            PAGE, BLOCK_N, True, False, IEEE, UPCAST)

    # Empty slices (and seq_len 0 padding rows) give zeros with lse -inf.
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    omask = hmask[:, None] & dmask[None, :]
    if NUM_SPLITS == 1:
        out_off = b.to(tl.int64) * num_heads * HEAD_DIM + heads[:, None] * HEAD_DIM + d[None, :]
        tl.store(out_ptr + out_off, o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        row = (b.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=omask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=hmask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_heads,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pdl_wait(PDL)
    row0 = (b.to(tl.int64) * num_heads + h) * NUM_SPLITS
    s = tl.arange(0, S_PAD)
    smask = s < NUM_SPLITS
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + row0 + s, mask=smask, other=float("-inf"))
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # all slices empty: weights all 0
    w = tl.exp2(lse - mx)
    denom = tl.sum(w, 0)
    part = tl.load(part_out_ptr + (row0 + s)[:, None] * HEAD_DIM + d[None, :],
                   mask=smask[:, None] & dmask[None, :], other=0.0)
    o = tl.sum(w[:, None] * part, 0) / tl.where(denom > 0, denom, 1.0)
    out_off = (b.to(tl.int64) * num_heads + h) * HEAD_DIM + d
    tl.store(out_ptr + out_off, o.to(out_ptr.dtype.element_ty), mask=dmask)


# NOTE: stride_bt (the step's widest block table) grows with the sequences; Triton specializes
# ints equal to 1 or divisible by 16, so each such width would compile a new kernel mid-serving.
# H100: requests arriving over 6 s, after all-at-once warm-ups, compiled this kernel once more
# (~1.1 s stall); stride_bt is the one int argument of it that changes while serving.
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    num_heads,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    qt = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if qt * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len  # tokens already cached before this chunk

    # Row r of the tile = query token r // GROUP_PAD, head r % GROUP_PAD of this KV group.
    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    qi = qt * BLOCK_Q + r // GROUP_PAD
    hi = r % GROUP_PAD
    rmask = (qi < q_len) & (hi < GROUP)
    heads = kvh * GROUP + hi
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    tok = (q_start + qi).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_M, D_PAD]
    q_pos = ctx + qi  # absolute position of each row's query token

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, D_PAD], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    # Causal: keys past the tile's last query are never needed; keys up to its first query's
    # position are visible to every row, so those whole tiles skip the masks.
    kv_end = tl.minimum(seq_len, ctx + tl.minimum((qt + 1) * BLOCK_Q, q_len))
    full_end = tl.minimum(ctx + qt * BLOCK_Q + 1, kv_end) // BLOCK_N * BLOCK_N
    for t0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, t0, kv_end, q_pos, k_ptr, v_ptr, bt_row, kvh, d, dmask, scale_log2,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            PAGE, BLOCK_N, False, True, IEEE, UPCAST)
    for t0 in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, t0, kv_end, q_pos, k_ptr, v_ptr, bt_row, kvh, d, dmask, scale_log2,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            PAGE, BLOCK_N, True, True, IEEE, UPCAST)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_off = (tok * num_heads + heads)[:, None] * HEAD_DIM + d[None, :]
    omask = rmask[:, None] & dmask[None, :]
    tl.store(out_ptr + out_off, o.to(out_ptr.dtype.element_ty), mask=omask)


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor) -> None:
    """Validates shared inputs."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache/v_cache must be [num_blocks, block_size, kv_heads, head_dim] "
                         f"of equal shape, got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache/v_cache: last dim (head_dim) must be contiguous")
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"q num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} must match cache dtypes {k_cache.dtype}")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError("block_tables must be a 2-D int32 tensor [num_seqs, max_blocks_per_seq]")


def _upcast(dtype: torch.dtype) -> bool:
    return dtype != torch.float32 and triton.knobs.runtime.interpret


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
    """Splits per (sequence, KV head): ~2 waves of programs, >= 128 keys per split.

    Tuned on an H100 (Qwen2.5-7B heads): B=1/len 4096 -> 32 splits (9 us), B=64/len 4096 -> 2.
    """
    return num_splits_for(batch, num_kv_heads, max_len, _num_sms(device))


def num_splits_for(batch: int, num_kv_heads: int, max_len: int, sms: int) -> int:
    """choose_num_splits on a GPU of `sms` SMs (compile_ahead_decode: read by its lister)."""
    want = math.ceil(2 * sms / max(1, batch * num_kv_heads))
    return max(1, min(want, math.ceil(max_len / 128), 64))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, pdl: bool = True) -> torch.Tensor:
    """One query token per sequence against its paged K/V (already holding that token's K/V).

    Reads only; no host syncs, so it can be captured in a CUDA graph. Rows with seq_len 0
    (batch padding) give zeros. pdl: programmatic dependent launch where supported.
    """
    # q: [B, H, D]; k_cache/v_cache: [NB, page, KVH, D]; block_tables: [B, MB] int32;
    # seq_lens: [B] int32 -> out [B, H, D] in q's dtype
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, num_heads, head_dim], got {tuple(q.shape)}")
    _check_cache(q, k_cache, v_cache, block_tables)
    batch = q.shape[0]
    if seq_lens.shape != (batch,) or block_tables.shape[0] < batch:
        raise ValueError("seq_lens must be [batch] and block_tables must have >= batch rows")
    if q.stride(2) != 1:
        q = q.contiguous()
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, block_tables.shape[1] * page,
                                       q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return _decode(launch, empty_on(q.device), q, k_cache, v_cache, block_tables, seq_lens,
                   scale, num_splits, pdl_kwargs(q.device, pdl))


def _decode(run: Callable[..., Any], empty: Callable[..., Any], q: Any, k_cache: Any,
            v_cache: Any, block_tables: Any, seq_lens: Any, scale: float, num_splits: int,
            flags: dict[str, Any]) -> Any:
    """The launches of paged_decode_attention (checked inputs), by run(kernel, grid, *args,
    **kwargs): kernels_ahead.launch, or CompileOnly on TensorSpecs (compile_ahead_decode);
    empty(shape, dtype) allocates. Returns out [B, H, D]."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = empty(tuple(q.shape), q.dtype)
    if num_splits > 1:
        part_out = empty((batch, num_heads, num_splits, head_dim), torch.float32)
        part_lse = empty((batch, num_heads, num_splits), torch.float32)
    else:
        part_out = part_lse = out  # unused by the kernel
    d_pad = _pow2(head_dim)
    # (PDL: seq_lens must not come from the kernel right before)
    run(_decode_split_kernel, (batch, num_kv_heads, num_splits),
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        num_heads,
        GROUP=group, GROUP_PAD=_pow2(group), HEAD_DIM=head_dim, D_PAD=d_pad, PAGE=page,
        BLOCK_N=_DECODE_BLOCK_N, NUM_SPLITS=num_splits,
        IEEE=q.dtype == torch.float32, UPCAST=_upcast(q.dtype),
        num_warps=4, **flags)
    if num_splits > 1:
        run(_decode_reduce_kernel, (batch, num_heads),
            part_out, part_lse, out, num_heads,
            HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=num_splits,
            S_PAD=triton.next_power_of_2(num_splits), num_warps=1, **flags)
    return out


def compile_ahead_decode(num_heads: int, num_kv_heads: int, head_dim: int, page: int,
                         dtype: torch.dtype, num_splits: int, max_blocks: int,
                         tables_offset: int, lens_offset: int, pdl: bool,
                         capability: tuple[int, int]) -> list[str]:
    """Compile, without launching, what paged_decode_attention launches with num_splits for
    q [B, num_heads, head_dim] and caches [_, page, num_kv_heads, head_dim] of `dtype`, block
    tables [B, max_blocks] and seq_lens int32 at these byte offsets past 16-byte boundaries,
    on a GPU of this capability with the switch pdl (engine/kernels_ahead.py runs it in a
    process of its own). Returns the cache keys."""
    cache = TensorSpec.empty((1, page, num_kv_heads, head_dim), dtype)
    run = CompileOnly()
    _decode(run, TensorSpec.empty, TensorSpec.empty((1, num_heads, head_dim), dtype), cache,
            cache, TensorSpec(torch.int32, (1, max_blocks), offset=tables_offset),
            TensorSpec(torch.int32, (1,), offset=lens_offset), head_dim ** -0.5, num_splits,
            pdl_flags(pdl, capability))
    return run.keys


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, max_query_len: int,
                            scale: float) -> torch.Tensor:
    """Causal varlen attention: each sequence's queries are its last q_len of seq_lens[b] tokens.

    K/V of all tokens (cached prefix and new chunk) are read from the paged cache, so the new
    chunk's K/V must be written first. Decode rows (q_len 1) are fine, so one call can serve a
    mixed batch. Reads only.
    """
    # q: [T, H, D]; query_start_loc: [B+1] int32; seq_lens: [B] int32 -> out [T, H, D]
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    _check_cache(q, k_cache, v_cache, block_tables)
    batch = seq_lens.shape[0]
    if query_start_loc.shape != (batch + 1,) or block_tables.shape[0] < batch:
        raise ValueError("query_start_loc must be [batch + 1]; block_tables needs >= batch rows")
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    if q.stride(2) != 1:
        q = q.contiguous()
    return _prefill(launch, empty_on(q.device), q, k_cache, v_cache, block_tables,
                    query_start_loc, seq_lens, max_query_len, scale)


def _prefill(run: Callable[..., Any], empty: Callable[..., Any], q: Any, k_cache: Any,
             v_cache: Any, block_tables: Any, query_start_loc: Any, seq_lens: Any,
             max_query_len: int, scale: float) -> Any:
    """The launch of paged_prefill_attention (checked inputs), as _decode's."""
    num_tokens, num_heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = empty((num_tokens, num_heads, head_dim), q.dtype)
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, _PREFILL_BLOCK_M // group_pad)
    grid = (batch, num_kv_heads, triton.cdiv(max_query_len, block_q))
    run(_prefill_kernel, grid,
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        num_heads,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, D_PAD=_pow2(head_dim), PAGE=page,
        BLOCK_Q=block_q, BLOCK_N=_PREFILL_BLOCK_N,
        IEEE=q.dtype == torch.float32, UPCAST=_upcast(q.dtype),
        num_warps=_PREFILL_WARPS, num_stages=_PREFILL_STAGES)
    return out


def compile_ahead_prefill(num_heads: int, num_kv_heads: int, head_dim: int, page: int,
                          dtype: torch.dtype, max_blocks: int) -> list[str]:
    """Compile, without launching, what paged_prefill_attention launches for q [T, num_heads,
    head_dim] and caches [_, page, num_kv_heads, head_dim] of `dtype`, block tables
    [B, max_blocks] (its metadata: aligned allocations). Returns the cache keys."""
    new = TensorSpec.empty
    cache = new((1, page, num_kv_heads, head_dim), dtype)
    run = CompileOnly()
    _prefill(run, new, new((16, num_heads, head_dim), dtype), cache, cache,
             new((1, max_blocks), torch.int32), new((2,), torch.int32), new((1,), torch.int32),
             16, head_dim ** -0.5)
    return run.keys


def bench_decode(batch: int, seq_len: int, num_heads: int = 28, num_kv_heads: int = 4,
                 head_dim: int = 128, page: int = 16, dtype: torch.dtype = torch.bfloat16,
                 num_splits: int | None = None, iters: int = 100) -> float:
    """Times one decode call (CUDA events, after warmup); prints ms and K/V read bandwidth."""
    dev = torch.device("cuda")
    blocks_per_seq = triton.cdiv(seq_len, page)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, dtype=dtype, device=dev)
    v_cache = torch.randn_like(k_cache)
    # Shuffled physical blocks, as a real allocator would hand them out.
    block_tables = torch.randperm(num_blocks, device=dev).to(torch.int32)
    block_tables = block_tables.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=dev)
    q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=dev)
    scale = head_dim ** -0.5

    def call() -> torch.Tensor:
        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                      num_splits)

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop) / iters

    eager_ms = timed(call)
    # The engine replays decode from a CUDA graph, so that time excludes Python launch cost.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    ms = timed(graph.replay)
    kv_bytes = 2 * batch * seq_len * num_kv_heads * head_dim * k_cache.element_size()
    print(f"decode B={batch} len={seq_len} H={num_heads}/{num_kv_heads} D={head_dim} "
          f"splits={num_splits or 'auto'}: graph {ms * 1e3:.1f} us "
          f"({kv_bytes / ms / 1e6:.0f} GB/s of K/V), eager {eager_ms * 1e3:.1f} us")
    return ms


if __name__ == "__main__":
    for b, n in [(1, 1024), (1, 4096), (8, 2048), (32, 1024), (64, 4096), (256, 512)]:
        bench_decode(b, n)
