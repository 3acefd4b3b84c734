"""The contract between the AR engine and a model: what one forward step gets and returns.

A model used by the engine provides
  embed(input_ids [T]) -> [T, D]
  forward(batch: ForwardBatch) -> hidden [T, D]      (last hidden state, after the final norm)
  compute_logits(hidden [N, D]) -> [N, V]
  attention_layers() -> list of modules with `k_cache` / `v_cache` attributes the engine binds
  kv_shape -> (num_layers, num_kv_heads, head_dim)
  load_weights(named tensors)
`DecoderContract` supplies the members every decoder LM here computes the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

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


class DecoderContract:
    """kv_shape, vocab_size, attention_layers, embed and embed_row of a decoder LM module that
    has `config` (num_hidden_layers, num_key_value_heads, head_dim, vocab_size) and `model`
    (`layers[i].self_attn`; the input table `embed_tokens` unless `input_embedding` says
    otherwise). Mixed in before nn.Module."""

    config: Any
    model: nn.Module

    @property
    def input_embedding(self) -> nn.Embedding:
        """The table the engine's input ids index."""
        return self.model.embed_tokens

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        c = self.config
        return c.num_hidden_layers, c.num_key_value_heads, c.head_dim

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.model.layers]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.input_embedding(input_ids)

    def embed_row(self, token_id: int) -> torch.Tensor:
        """embed of one id, [D]: a view of the table's row (no id tensor, no kernel)."""
        return self.input_embedding.weight[token_id]
