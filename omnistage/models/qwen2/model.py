"""Qwen2 causal LM: the shared decoder with q/k/v biases."""

from omnistage.models.layers import DecoderForCausalLM
from omnistage.models.registry import register_model


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def attention_bias(hf_config: dict) -> bool:
        return True  # Qwen2 always has q/k/v biases (o_proj has none)
