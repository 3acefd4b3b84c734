"""Llama causal LM (also SmolLM2, Mistral-style checkpoints without sliding window)."""

from omnistage.models.layers import DecoderForCausalLM
from omnistage.models.registry import register_model


@register_model("LlamaForCausalLM")
class LlamaForCausalLM(DecoderForCausalLM):
    pass
