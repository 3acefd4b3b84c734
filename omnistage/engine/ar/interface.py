"""The contract between the AR engine and a model: what one forward step gets and returns.

A model used by the engine provides
  embed(input_ids [T]) -> [T, D]
  forward(batch: ForwardBatch) -> hidden [T, D]      (last hidden state, after the final norm)
  compute_logits(hidden [N, D]) -> [N, V]
  attention_layers() -> list of modules with `k_cache` / `v_cache` attributes the engine binds
  kv_shape -> (num_layers, num_kv_heads, head_dim)
  load_weights(named tensors)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnistage.engine.ar.attention import AttentionMetadata


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long, device
    positions: torch.Tensor  # [T] long (1-D rope) or [3, T] long (mrope), device
    attn: AttentionMetadata
    inputs_embeds: torch.Tensor | None = None  # [T, D]: rows that replace token embeddings...
    embeds_mask: torch.Tensor | None = None  # [T] bool: ...where this is True
    additive_embeds: torch.Tensor | None = None  # [T, D]: added to every input row


def merge_inputs(tokens_embeds: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """Token embeddings with the batch's explicit rows substituted and additive rows added."""
    x = tokens_embeds
    if batch.inputs_embeds is not None:
        x = torch.where(batch.embeds_mask[:, None], batch.inputs_embeds.to(x.dtype), x)
    if batch.additive_embeds is not None:
        x = x + batch.additive_embeds.to(x.dtype)
    return x
