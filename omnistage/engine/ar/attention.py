"""Paged attention: KV written through a slot mapping, read back through block tables.

CPU (and fallback) path: torch reference with SDPA. CUDA path: our Triton kernels
(`triton_attention.py`) when available."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step layout of the flattened batch. Device tensors unless noted."""

    slot_mapping: torch.Tensor  # [T] long: KV slot (block * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # [B+1] int32: start of each sequence's queries in the flat batch
    seq_lens: torch.Tensor  # [B] int32: tokens in the cache after this step (prefix + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_lens_cpu: list[int]  # host copies, for the torch path's per-sequence loop
    seq_lens_cpu: list[int]
    max_query_len: int
    decode_only: bool  # every sequence has exactly one query token


_use_triton: bool | None = None


def _triton_ok(device: torch.device) -> bool:
    global _use_triton
    if device.type != "cuda":
        return False
    if _use_triton is None:
        try:
            from omnistage.engine.ar import triton_attention  # noqa: F401
            _use_triton = True
        except ImportError:
            _use_triton = False
    return _use_triton


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # k, v: [T, n_kv, hd]; caches: [num_blocks, block_size, n_kv, hd]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, pdl: bool = True) -> torch.Tensor:
    """q: [T, H, hd] -> [T, H, hd]; K/V of the new tokens are already in the cache. pdl: the
    Triton decode kernels launch with programmatic dependent launch where supported."""
    if _triton_ok(q.device):
        from omnistage.engine.ar import triton_attention as ta
        if meta.decode_only:
            return ta.paged_decode_attention(q, k_cache, v_cache, meta.block_tables,
                                             meta.seq_lens, scale, pdl=pdl)
        return ta.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables,
                                          meta.query_start_loc, meta.seq_lens,
                                          meta.max_query_len, scale)
    if meta.decode_only:
        return _decode_torch(q, k_cache, v_cache, meta, scale)
    return _varlen_torch(q, k_cache, v_cache, meta, scale)


def _decode_torch(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    # one query per sequence: gather each sequence's blocks, mask past its length
    B, H, hd = q.shape
    bs, n_kv = k_cache.shape[1], k_cache.shape[2]
    max_len = max(meta.seq_lens_cpu)
    nb = (max_len + bs - 1) // bs
    flat = meta.block_tables[:, :nb].reshape(-1).long()
    # index_select is several times faster than advanced indexing for this gather on CPU
    k = k_cache.index_select(0, flat).view(B, nb * bs, n_kv, hd).transpose(1, 2)
    v = v_cache.index_select(0, flat).view(B, nb * bs, n_kv, hd).transpose(1, 2)
    mask = torch.arange(nb * bs, device=q.device)[None, :] < meta.seq_lens[:, None]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                         scale=scale, enable_gqa=n_kv != H)
    return out.squeeze(2)


def _varlen_torch(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    H = q.shape[1]
    bs, n_kv, hd = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        nb = (kv_len + bs - 1) // bs
        table = meta.block_tables[b, :nb].long()
        k = k_cache[table].reshape(nb * bs, n_kv, hd)[:kv_len].transpose(0, 1)
        v = v_cache[table].reshape(nb * bs, n_kv, hd)[:kv_len].transpose(0, 1)
        qs = q[start:start + q_len].transpose(0, 1)  # [H, q_len, hd]
        if q_len == kv_len:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale,
                                               enable_gqa=n_kv != H)
        else:
            # query i sits at absolute position kv_len - q_len + i
            qpos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
            mask = torch.arange(kv_len, device=q.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=n_kv != H)
        out[start:start + q_len] = o.transpose(0, 1)
        start += q_len
    return out
